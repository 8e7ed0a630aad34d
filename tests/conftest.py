"""Make the project's modules (repo root) and the test helpers (tests/) importable; one thread per
process; the slow tests first; the fixtures the test files share: prepared data, small trained
runs, stand-in archives and a local HTTP server."""
import functools
import http.server
import os
import sys
import threading

import pytest

# One thread per process, set before torch is imported and inherited by every subprocess: -n N
# already runs a process per core, and the OpenMP threads of several processes that share the cores
# wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from common import TINY, make_corpora, run  # noqa: E402  (importable once the paths are set)


def pytest_collection_modifyitems(items):
    """The slow tests first (pytest.ini's marker), in their files' order: with -n 2 the two
    processes then end together, rather than one still running a long test picked up last."""
    items.sort(key=lambda item: item.get_closest_marker('slow') is None)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A folder for prepared datasets, one per test module."""
    return tmp_path_factory.mktemp('data')


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_dir):
    """A tiny Shakespeare run of 20 iterations, shared by the eval, sample and bad-input tests."""
    out = tmp_path_factory.mktemp('run')
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=20', '--eval_interval=10')
    return out


@pytest.fixture
def corpora(tmp_path, monkeypatch):
    """data_dir with enwik8.zip and text8.zip already in place, as if put there by hand."""
    data = tmp_path / 'data'
    return data, make_corpora(str(data), monkeypatch, as_prepared=True)


@pytest.fixture
def server(tmp_path):
    """A local HTTP server for the download tests: (folder it serves, its URL)."""
    folder = tmp_path / 'www'
    folder.mkdir()
    handler = functools.partial(type('Quiet', (http.server.SimpleHTTPRequestHandler,),
                                     {'log_message': lambda *a: None}), directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f'http://127.0.0.1:{httpd.server_port}'
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope='module')
def checkpointed(tmp_path_factory, data_dir):
    """A tiny run of 8 iterations on the bundled corpus, checkpointed at 8: copied by the tests
    that damage it."""
    out = tmp_path_factory.mktemp('run') / 'out'
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=8', '--eval_interval=4')
    return out

