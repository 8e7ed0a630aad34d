"""
The quick start: a smaller DAMCHA than train_char.py's defaults, at a higher learning rate, on the
bundled Shakespeare, sized to finish in about a minute of one idle CPU core and still end with a
sample that reads as a play (names in capitals, lines of mostly English words):

    python train_char.py config/quick.py                # into out-quick/
    python eval_char.py --mode=sample --out_dir=out-quick --start="ROMEO:"

A run prints the milliseconds an iteration takes on your machine, so the full default run,
`python train_char.py` (2000 iterations of a wider, deeper model), can be timed from its first
lines.
"""
out_dir = 'out-quick'
n_layer = 2
n_embd = 64          # 4 heads of 16, as the defaults' 4 of 32
learning_rate = 4e-3  # a model this small trains stably at twice the defaults' peak, and faster
max_iters = 2000
