"""Helpers shared by the tests. rel_err, max |a - b| / max |b| in float64, is defined once, in
bench.py, which bench_triton_gpu.py imports it from too."""
from bench import rel_err

__all__ = ["rel_err"]
