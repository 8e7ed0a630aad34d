"""Make the project's modules (repo root) and the test helpers (tests/) importable."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
