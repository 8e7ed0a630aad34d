"""Make the project's modules (repo root) and the test helpers (tests/) importable; fixtures shared
by the test files."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A folder for prepared datasets, one per test module."""
    return tmp_path_factory.mktemp('data')
