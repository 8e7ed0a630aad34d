"""Make the project's modules (repo root) and the test helpers (tests/) importable; one thread per
process; the slow tests first; fixtures shared by the test files."""
import os
import sys

import pytest

# One thread per process, set before torch is imported and inherited by every subprocess: -n N
# already runs a process per core, and the OpenMP threads of several processes that share the cores
# wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def pytest_collection_modifyitems(items):
    """The slow tests first (pytest.ini's marker), in their files' order: with -n 2 the two
    processes then end together, rather than one still running a long test picked up last."""
    items.sort(key=lambda item: item.get_closest_marker('slow') is None)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A folder for prepared datasets, one per test module."""
    return tmp_path_factory.mktemp('data')
