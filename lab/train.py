r"""
train.py: the book's trainer, train_char.py, given the lab's attentions (lab/variants.ATTENTIONS):
every train_char.py setting, and attn may also be "tha", "dcmha" or "proj".

    python lab/train.py --attn=proj --metric_init=identity --mlp_hidden=385 --out_dir=out-proj
    torchrun --standalone --nproc_per_node=4 lab/train.py config/enwik8.py config/mha.py \
        --attn=dcmha
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/train.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

import shell

if __name__ == '__main__':   # first: Ctrl-C while torch is imported below ends in one line
    shell.quit_on_signals()

import train_char
from lab.variants import ATTENTIONS

if __name__ == '__main__':
    train_char.main(sys.argv[1:], attentions=ATTENTIONS)
