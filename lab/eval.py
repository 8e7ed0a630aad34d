"""
eval.py: the book's eval_char.py given the lab's attentions (lab/variants.ATTENTIONS), for the
checkpoints of lab/train.py: every eval_char.py setting and mode.

    python lab/eval.py --out_dir=out-proj                  # bpc of the whole val split
    python lab/eval.py --out_dir=out-proj --mode=sample
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/eval.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

import shell

if __name__ == '__main__':   # first: Ctrl-C while torch is imported below ends in one line
    shell.quit_on_signals()

import eval_char
from lab.variants import ATTENTIONS

if __name__ == '__main__':
    eval_char.main(sys.argv[1:], attentions=ATTENTIONS)
