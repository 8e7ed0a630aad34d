"""
enwik8: the first 10^8 bytes of English Wikipedia's XML, a vocabulary of all 256 bytes, split
90M / 5M / 5M; downloaded, checked and prepared on the first run (data/prepare.py). Follow it
with a model file, which sets the model, the batch and the schedule:

    python train_char.py config/enwik8.py config/damcha.py          # into out-enwik8-damcha/
    python train_char.py config/enwik8.py config/mha.py             # into out-enwik8-mha/
    python eval_char.py --out_dir=out-enwik8-damcha    # bpc, whole val and test splits

The model files' 50,000 iterations of 16,384 characters (819M) are about nine passes over the
90M training characters.
"""
dataset = 'enwik8'
out_dir = 'out-enwik8-{attn}'   # named after the model file's attention
