"""data: the datasets (prepare.py) and the bundled corpus (shakespeare/)."""
