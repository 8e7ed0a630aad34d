"""
mix: the paper's 50-50 mixture of enwik8 and text8. Each training row comes from either with
probability 1/2, over the 256-byte vocabulary; the evaluations report both corpora and their mean.
Both are downloaded and prepared on the first run. A model file comes next:

    python train_char.py config/mix.py config/damcha.py        # into out-mix-damcha/
    python eval_char.py --out_dir=out-mix-damcha

With the model files' schedule (819M characters) that is about 4.5 passes over each corpus's
90M training characters.
"""
dataset = 'mix'
out_dir = 'out-mix-{attn}'
