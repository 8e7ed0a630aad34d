"""
text8: 10^8 characters of Wikipedia text reduced to a-z and space, a vocabulary of 27 symbols,
split 90M / 5M / 5M; downloaded, checked and prepared on the first run (data/prepare.py).
After it, a model file (config/damcha.py or config/mha.py) sets the model, batch and schedule:

    python train_char.py config/text8.py config/damcha.py      # into out-text8-damcha/
    python eval_char.py --out_dir=out-text8-damcha

Their 819M training characters are about nine passes over text8's 90M.
"""
dataset = 'text8'
out_dir = 'out-text8-{attn}'
