"""The lab: the scripts that produced this repository's evidence (results/), kept apart from the
book (the model, trainer and notebooks at the top level). The lab imports the book; the book
never imports the lab. Run a lab script from the repository root, as a file or a module:

    python lab/bench.py --quick             # or: python -m lab.bench --quick
"""
