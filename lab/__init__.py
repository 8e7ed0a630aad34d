"""The lab: the scripts that produced this repository's evidence (results/), kept apart from the
book (the model, trainer and notebooks at the top level). The lab imports the book; the book
never imports the lab. Run a lab script from the repository root, as a file or a module:

    python lab/bench.py --quick             # or: python -m lab.bench --quick

    train.py, eval.py   the book's train_char.py and eval_char.py with the lab's attentions
    variants.py         those attentions: the baselines "tha", "dcmha" (baselines.py) and the 2x2
                        study's "proj", by name (ATTENTIONS), and build(config), the GPT of any attn
    counts.py           parameter counts, equal-parameter widths, training FLOPs and MFU
    reproduce.py, synthetic.py, bench.py, bench_triton_gpu.py   the experiments (results/)
"""
