"""
eval.py: the book's eval_char.py with the lab's attentions registered (lab/variants.py), for the
checkpoints of lab/train.py: every eval_char.py setting and mode.

    python lab/eval.py --out_dir=out-proj                  # bpc of the whole val split
    python lab/eval.py --out_dir=out-proj --mode=sample
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/eval.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

import lab.variants  # noqa: F401  (registers the lab's attentions)
import eval_char

if __name__ == '__main__':
    eval_char.main(sys.argv[1:])
