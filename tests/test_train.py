"""
Tests of train_char.py and eval_char.py: data preparation (from small archives made here, with the expected
size and checksum set for the test), training, exact resume, DDP on CPU, eval, sample, plot,
and every bad input of issue 4 (one line, non-zero exit, checkpoint untouched).

    python -m pytest -q tests/test_train.py

Most runs are in-process (tc.main) with a one-layer, 32-wide model; the command line itself,
torchrun included, runs as a subprocess where exit codes and tracebacks are the point.
"""
import contextlib
import errno
import functools
import hashlib
import http.server
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import damcha_torch
import data.prepare as prep
import device
from data import dataset
from run_folder import RunFolder, read_jsonl
from shell import DIVERGED
import eval_char as ec
import train_char as tc
from common import digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4', '--gen_width=16',
        '--eval_iters=2', '--log_interval=5', '--max_new_tokens=20', '--device=cpu', '--compile=False',
        '--warmup_iters=2']


def run(*argv, main=tc.main):
    main([str(a) for a in argv])


def run_eval(*argv):
    run(*argv, main=ec.main)


def fails(*argv, main=tc.main):
    """The one-line error message that main (train_char's, or eval_char's) exits with."""
    with pytest.raises(SystemExit) as e:
        run(*argv, main=main)
    message = e.value.code
    assert isinstance(message, str) and message.startswith('error: ') and '\n' not in message, message
    return message


def fails_eval(*argv):
    return fails(*argv, main=ec.main)


def cli(*args, script='train_char.py', timeout=120):
    # without TRITON_INTERPRET, which tests/test_triton.py may have set in this process
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_dir):
    """A tiny Shakespeare run of 20 iterations, shared by the eval, sample and bad-input tests."""
    out = tmp_path_factory.mktemp('run')
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=20', '--eval_interval=10')
    return out


def make_corpora(folder, monkeypatch, serve_url=None, as_prepared=False):
    """Small stand-ins for enwik8 (random bytes) and text8 (random a-z and space), zipped into
    folder/<name>.zip, or folder/<name>/<name>.zip where prepare() looks for them when
    as_prepared; SOURCES then expects their sizes and checksums. Returns the contents."""
    rng = np.random.default_rng(0)
    contents = dict(enwik8=rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(),
                    text8=bytes(rng.choice(list(b' abcdefghijklmnopqrstuvwxyz'), 4000).astype(np.uint8)))
    for name, data in contents.items():
        where = os.path.join(folder, name) if as_prepared else folder
        os.makedirs(where, exist_ok=True)
        with zipfile.ZipFile(os.path.join(where, f'{name}.zip'), 'w', zipfile.ZIP_DEFLATED) as z:
            z.writestr(name, data)
        algorithm = prep.SOURCES[name]['digest'][0]
        url = f'{serve_url}/{name}.zip' if serve_url else 'http://127.0.0.1:9/unreachable.zip'
        monkeypatch.setitem(prep.SOURCES, name, dict(prep.SOURCES[name], url=url, size=len(data),
                                                   digest=(algorithm, hashlib.new(algorithm, data).hexdigest())))
    return contents


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


# ---------------------------------------------------------------------------------------------
# Configuration

def test_config_types_files_and_order(tmp_path):
    config_file = tmp_path / 'c.py'
    config_file.write_text('"""a config file"""\nbatch_size = 3\nlearning_rate = 1\ndataset = "text8"\n')
    cfg, given = tc.parse_config([str(config_file), '--batch_size=5', '--compile=True', '--beta2=0',
                                  '--start=123', '--n_layer=3'])
    assert (cfg['batch_size'], cfg['learning_rate'], cfg['dataset']) == (5, 1.0, 'text8')
    assert type(cfg['learning_rate']) is float and type(cfg['beta2']) is float   # int accepted for float
    assert cfg['compile'] is True and cfg['start'] == '123' and cfg['n_layer'] == 3
    assert given == {'batch_size', 'learning_rate', 'dataset', 'compile', 'beta2', 'start', 'n_layer'}
    assert all(f in tc.DEFAULTS for f in tc.MODEL_KEYS)   # every GPTConfig field is a setting
    assert tc.parse_config(['--compile'])[0]['compile'] is True   # a bare boolean flag sets it
    later = tmp_path / 'd.py'
    later.write_text('batch_size = 7\n')
    # in the order given: a config file after a flag overrides it, and a later file an earlier one
    assert tc.parse_config(['--batch_size=5', str(config_file)])[0]['batch_size'] == 3
    assert tc.parse_config([str(config_file), str(later)])[0]['batch_size'] == 7
    assert tc.parse_config([str(later), str(config_file)])[0]['batch_size'] == 3


def test_a_whole_float_is_not_an_int_and_nan_is_not_a_number(tmp_path):
    """An int setting refuses 3.0, from a flag or a file; a config file can give nan (a flag cannot:
    its text is a Python literal), and a checked number refuses it."""
    fast = f'--out_dir={tmp_path / "out"}', '--max_iters=1'   # a check that let it through fails fast
    assert 'batch_size=3.0: expected int, not float' in fails('--batch_size=3.0', *fast)
    for text, message in [('batch_size = 3.0', 'batch_size=3.0: expected int, not float'),
                          ('learning_rate = float("nan")', 'learning_rate must be a finite number, not nan')]:
        config_file = tmp_path / 'c.py'
        config_file.write_text(text + '\n')
        assert message in fails(str(config_file), *fast)


def test_help_prints_the_docstring_and_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        tc.main(['--batch_size=3', '--help'])   # the defaults, not the settings given before --help
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(tc.__doc__.strip())
    lines = out.split('--key=value):\n')[1].splitlines()
    assert [line.split()[0] for line in lines] == [f'{k}={v!r}' for k, v in tc.DEFAULTS.items()]
    for line, (k, v) in zip(lines, tc.DEFAULTS.items()):   # each with a description, the comment beside its default
        assert line.startswith(f'  {k}={v!r}  ') and len(line.removeprefix(f'  {k}={v!r}').split()) >= 2, line
    described = dict(line.split(maxsplit=1) for line in lines)
    assert described["lr_decay_iters=2000"] == "iteration where the decay reaches min_lr; unless set, max_iters"
    assert described["snapshot_iters=''"].endswith('in out_dir/snapshot-<iter>.pt (a notebook reads them)')   # three lines
    assert described["n_head=4"].startswith('H, heads')   # from GPTConfig's fields, in damcha_torch.py


def test_eval_help_prints_its_docstring_and_every_default(capsys):
    """eval_char.py -h and --help: its own docstring, then each of its settings with its default
    (not a value given before the flag), and exit status 0."""
    for flag in ('-h', '--help'):
        with pytest.raises(SystemExit) as e:
            ec.main(['--stride=3', flag])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(ec.__doc__.strip())
        lines = out.split('--key=value):\n')[1].splitlines()
        assert [line.split()[0] for line in lines] == [f'{k}={v!r}' for k, v in ec.DEFAULTS.items()]
        for line, (k, v) in zip(lines, ec.DEFAULTS.items()):   # each with a description
            assert line.startswith(f'  {k}={v!r}  ') and len(line.removeprefix(f'  {k}={v!r}').split()) >= 2, line


def test_bad_settings_are_one_line_errors(tmp_path):
    assert "did you mean 'batch_size'" in fails('--batchsize=3')
    assert 'expected int' in fails('--batch_size=1.5')
    assert 'expected int' in fails('--batch_size=many')
    assert 'expected int, not bool' in fails('--batch_size=True')
    assert 'expected bool' in fails('--compile=yes')
    assert 'mode must be one of' in fails('--mode=fly')
    assert 'must be positive' in fails('--batch_size=0')
    assert 'no such config file' in fails('config/none.py')
    assert '--key=value' in fails('--max_iters')
    assert "unknown setting 'compil' in --compil; did you mean 'compile'?" in fails('--compil')
    for pattern in ('out-{attn.x}', 'out-{n_layer[0]}', 'out-{}'):
        assert 'braces must hold a setting' in fails(f'--out_dir={pattern}')
    assert 'comma-separated whole numbers' in fails('--snapshot_iters=0,half', f'--out_dir={tmp_path / "out"}')
    assert "outside this run's iterations" in fails('--snapshot_iters=0,2001', f'--out_dir={tmp_path / "out"}')
    broken = tmp_path / 'broken.py'
    broken.write_text('batch_size = = 3\n')
    assert 'SyntaxError' in fails(broken)
    unknown = tmp_path / 'unknown.py'
    unknown.write_text('batch_sise = 3\n')
    assert 'unknown setting' in fails(unknown)


def test_command_line_errors_have_no_traceback(data_dir, monkeypatch, capsys):
    """Each is one line on stderr and nothing on stdout: the config a run prints comes after the data.
    The first runs as a process; the others in this process, where main's SystemExit holds the one
    line that Python prints (exit status 1) and main itself must print nothing."""
    result = cli('--no_such_flag=1', '--out_dir=/nonexistent/never-written')
    assert result.returncode == 1 and 'unknown setting' in result.stderr, result.stderr
    assert result.stderr.strip().count('\n') == 0 and 'Traceback' not in result.stderr, result.stderr
    assert result.stdout == '', result.stdout
    prep.prepare('shakespeare', str(data_dir))   # so that the prompt's run says only its error
    monkeypatch.chdir(ROOT)   # as cli runs it, without tests/test_triton.py's TRITON_INTERPRET
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    capsys.readouterr()
    for args, words in [(['--max_iters=ten'], 'expected int'),
                        (['--dataset=no/such/file.txt'], 'neither'),
                        ([f'--data_dir={data_dir}', '--start=' + 'a' * 65], 'longer than the model'),
                        (['--n_embd=30', '--n_head=4'], 'divisible'), (['--n_head=0'], 'at least 1'),
                        (['--kernel=triton', '--device=cpu'], 'kernel=triton needs'),
                        (['--n_embd=30', '--n_head=4', '--mode=config'], 'divisible'),   # as the run would
                        (['--dataset=no/such/file.txt', '--mode=config'], 'neither')]:
        assert words in fails(*args, '--out_dir=/nonexistent/never-written')
        assert capsys.readouterr() == ('', ''), args


def test_the_interpreted_kernel_is_refused_in_16_bit(monkeypatch):
    """Triton's interpreter (the kernel on a CPU) trains in float32 only: bf16 is one line, not a
    traceback from inside the op. On CUDA every dtype is the kernel's (checked here without one)."""
    if importlib.util.find_spec('triton') is None:   # found, not imported: tests/test_triton.py picks its mode first
        pytest.skip("needs the triton package")
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    with pytest.raises(SystemExit, match="which cannot train in bfloat16; use --dtype=float32"):
        device.check_kernel('triton', 'cpu', 'bfloat16')
    device.check_kernel('triton', 'cpu', 'float32')
    for dtype in ('float32', 'bfloat16', 'float16'):
        device.check_kernel('triton', 'cuda', dtype)


def test_config_mode_prints_the_composed_settings(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)   # the config files' paths, as typed in the repository
    capsys.readouterr()
    run('config/text8.py', 'config/mha.py', '--mode=config', '--n_layer=2')
    cfg = json.loads(capsys.readouterr().out)   # a dataset file, a model file, then flags, in that order
    assert (cfg['dataset'], cfg['attn'], cfg['n_layer'], cfg['max_iters']) == ('text8', 'mha', 2, 50000)
    assert cfg['out_dir'] == 'out-text8-mha'   # out-text8-{attn}
    assert 'braces must hold' in fails('--out_dir=out-{nope}', '--mode=config')


def test_the_schedule_follows_max_iters_unless_set(tmp_path):
    """lr_decay_iters and warmup_iters left unset follow max_iters (a run of 200 iterations decays
    over 200 and warms up over 20, not the defaults' 2000 and 100); set, in a flag or a config
    file, they are kept. The defaults themselves are a run of 2000 iterations."""
    cfg, _ = tc.parse_config([])
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['warmup_iters']) == (2000, 2000, 100)
    cfg, given = tc.parse_config(['--max_iters=200'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (200, 20) and given == {'max_iters'}
    assert tc.parse_config(['--max_iters=5000'])[0]['warmup_iters'] == 100
    cfg, _ = tc.parse_config(['--max_iters=200', '--lr_decay_iters=150', '--warmup_iters=0'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (150, 0)
    cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', 'mha.py')])   # 50,000 iterations, 1,000 of warm-up
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['warmup_iters']) == (50000, 50000, 1000)
    cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', 'mha.py'), '--max_iters=100'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (100, 1000)   # the config file's warm-up, set there


def test_a_closed_pipe_ends_quietly():
    """`python train_char.py --mode=config | head` and the like: a reader that goes away is not an
    error. No message, the status of a process ended by SIGPIPE (128 + 13). Here the reader is gone
    before the first write."""
    for script, args in [('train_char.py', ['--mode=config']), ('train_char.py', ['--help']),
                         ('eval_char.py', ['--help'])]:
        env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
        proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141 and err == '', (script, args, proc.returncode, err)


def test_a_run_says_where_it_resumes_and_where_its_data_are(tmp_path, capsys):
    """A run prints where its dataset was prepared (a text file: <data_dir>/<its stem>-<digest>/); a resumed
    run prints the checkpoint and iteration it starts from, and says in one line when its
    checkpoint's lr_decay_iters is no longer max_iters."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 300)
    out = tmp_path / 'out'
    run(*TINY, f'--dataset={text}', f'--data_dir={tmp_path / "data"}', f'--out_dir={out}', '--max_iters=4',
        '--eval_interval=2')
    printed, err = capsys.readouterr()
    where = prep.text_file_dir(str(text), str(tmp_path / 'data'))
    assert re.fullmatch(r'notes-[0-9a-f]{8}', os.path.basename(where)) and os.path.dirname(where) == str(tmp_path / 'data')
    assert f"data: {text} prepared in {where}\n" in printed and 'resuming' not in printed
    assert 'lr_decay_iters' not in err   # it followed max_iters
    run(f'--out_dir={out}', '--init_from=resume', '--max_iters=6')
    printed, err = capsys.readouterr()
    assert printed.startswith(f"resuming from {out / 'ckpt.pt'} at iter 4\n")
    assert "note: lr_decay_iters=4 is not max_iters=6" in err   # the checkpoint's schedule, kept


# ---------------------------------------------------------------------------------------------
# Data

def test_shakespeare_is_split_90_10_over_its_distinct_bytes(data_dir):
    meta = prep.prepare('shakespeare', str(data_dir))
    with open(prep.BUNDLED, 'rb') as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    assert meta['vocab'] == sorted(set(raw.tolist())) and len(meta['vocab']) == 80
    n_train = len(raw) * 90 // 100
    assert meta['splits'] == {'train': n_train, 'val': len(raw) - n_train}
    vocab = np.array(meta['vocab'], dtype=np.uint8)
    train = np.fromfile(os.path.join(meta['dir'], 'train.bin'), dtype=np.uint8)
    val = np.fromfile(os.path.join(meta['dir'], 'val.bin'), dtype=np.uint8)
    assert (vocab[train] == raw[:n_train]).all() and (vocab[val] == raw[n_train:]).all()


def test_text_file_is_split_90_5_5_and_prepared_again_when_it_changes(tmp_path):
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    meta = prep.prepare(str(text), str(tmp_path / 'data'))
    assert meta['dir'] == prep.text_file_dir(str(text), str(tmp_path / 'data'))
    assert meta['splits'] == {'train': 1170, 'val': 65, 'test': 65}
    assert bytes(meta['vocab']) == b' ,dehlorw'
    text.write_bytes(b'abc' * 100)
    assert bytes(prep.prepare(str(text), str(tmp_path / 'data'))['vocab']) == b'abc'
    meta = pathlib.Path(meta['dir']) / 'meta.json'   # damaged (no checksum): prepared again, not a traceback
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != 'digest'}))
    assert bytes(prep.prepare(str(text), str(tmp_path / 'data'))['vocab']) == b'abc' and 'digest' in meta.read_text()


def test_a_split_needs_more_tokens_than_the_context_and_a_file_its_own_folder(tmp_path):
    """A window is block_size + 1 tokens: a split of exactly block_size is refused in one line,
    and a prompt of block_size bytes is taken. A text file named like a dataset is prepared into
    a folder of its own, never over that dataset's prepared folder."""
    split = dataset.Corpus('notes', '', dict(val=np.zeros(16, dtype=np.uint8)), None)
    with pytest.raises(SystemExit, match='the val split of notes has 16 tokens, too few for block_size=16'):
        dataset.check_lengths([split], ('val',), 16)
    dataset.check_lengths([split], ('val',), 15)
    assert dataset.encode('a' * 16, [97], 16) == [0] * 16
    (tmp_path / 'enwik8.txt').write_text('abc' * 100)
    meta = prep.prepare(str(tmp_path / 'enwik8.txt'), str(tmp_path / 'data'))
    assert os.path.basename(meta['dir']).startswith('enwik8-') and not (tmp_path / 'data' / 'enwik8').exists()


def test_prepare_runs_as_a_script_from_anywhere(tmp_path):
    script = os.path.join(ROOT, 'data', 'prepare.py')
    result = subprocess.run([sys.executable, script, 'shakespeare', f'--data_dir={tmp_path}'], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and 'train 1,429,444, val 158,828 tokens' in result.stdout, result.stderr
    assert (tmp_path / 'shakespeare' / 'meta.json').exists()
    result = subprocess.run([sys.executable, script, 'shakespeare', 'no/such.txt', f'--data_dir={tmp_path / "new"}'],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith('error: dataset') and result.stderr.count('\n') == 1
    assert not (tmp_path / 'new').exists()   # every name is checked before the first is prepared


def test_a_split_file_of_the_wrong_size_is_prepared_again(tmp_path):
    """A .bin file whose size is not the one meta.json gives (cut short, say) leaves the folder
    unprepared: the next use writes it again in full rather than reading the short one."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    val = pathlib.Path(prep.prepare(str(text), str(tmp_path / 'data'))['dir']) / 'val.bin'
    whole = val.read_bytes()
    val.write_bytes(whole[:10])
    assert prep.prepare(str(text), str(tmp_path / 'data'))['splits']['val'] == 65
    assert val.read_bytes() == whole


def test_an_interrupted_preparation_is_done_again(tmp_path, monkeypatch):
    """meta.json, which marks a folder prepared, is written after every .bin file: a text file
    that changed (same length, so each old .bin keeps the size meta.json gives), whose preparation
    is interrupted at its last .bin, is prepared in full at the next use, not left part old."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'ab' * 500)
    data = str(tmp_path / 'data')
    prep.prepare(str(text), data)
    text.write_bytes(b'ba' * 500)
    write = prep.atomic_write

    def interrupted(path):
        if path.endswith('test.bin'):
            raise KeyboardInterrupt
        return write(path)
    monkeypatch.setattr(prep, 'atomic_write', interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(text), data)
    monkeypatch.undo()
    meta = prep.prepare(str(text), data)
    ids = np.concatenate([np.fromfile(os.path.join(meta['dir'], f'{s}.bin'), dtype=np.uint8)
                          for s in ('train', 'val', 'test')])
    assert bytes(np.array(meta['vocab'], dtype=np.uint8)[ids]) == b'ba' * 500


def test_prepare_script_says_why_a_data_dir_cannot_be_made_in_one_line(tmp_path):
    """data/prepare.py with a data_dir below a file (a folder that cannot be made): the system's
    reason, naming the path, in one line rather than a traceback."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 100)
    blocker = tmp_path / 'afile'
    blocker.write_text('')
    message = fails(text, f'--data_dir={blocker / "data"}', main=prep.main)
    assert 'Not a directory' in message and str(blocker) in message


def test_enwik8_text8_and_mix_from_archives(corpora, monkeypatch, capsys):
    data, contents = corpora
    for name in ('enwik8', 'text8'):
        meta = prep.prepare(name, str(data))
        assert meta['splits'] == {'train': 3600, 'val': 200, 'test': 200}   # 90 / 5 / 5 of 4000
        assert meta['vocab'] == prep.SOURCES[name]['vocab']
        vocab = np.array(meta['vocab'], dtype=np.uint8)
        raw = np.frombuffer(contents[name], dtype=np.uint8)
        for split, (a, b) in dict(train=(0, 3600), val=(3600, 3800), test=(3800, 4000)).items():
            ids = np.fromfile(data / name / f'{split}.bin', dtype=np.uint8)
            assert (vocab[ids] == raw[a:b]).all(), (name, split)
        os.remove(data / name / f'{name}.zip')   # prepared once: the archive is not needed again
        assert prep.prepare(name, str(data))['splits'] == meta['splits']
    assert len(prep.SOURCES['text8']['vocab']) == 27 and bytes(prep.SOURCES['text8']['vocab'][:2]) == b' a'

    components, vocab = dataset.load_dataset('mix', str(data))
    assert vocab == list(range(256)) and [c.name for c in components] == ['enwik8', 'text8']
    assert [c.dir for c in components] == [str(data / 'enwik8'), str(data / 'text8')]
    x, y = tc.get_batch(components, 'train', 4000, 16, torch.Generator().manual_seed(0), 'cpu')
    # the rows as get_batch draws them: a corpus each, then a start in its train split (3600 tokens)
    generator = torch.Generator().manual_seed(0)
    which = torch.randint(2, (4000,), generator=generator)
    offsets = (torch.rand(4000, generator=generator, dtype=torch.float64) * (3600 - 16)).long()
    assert abs(which.float().mean().item() - 0.5) < 0.03   # each row from either with probability 1/2
    raw = {n: np.frombuffer(contents[n], dtype=np.uint8) for n in contents}
    for row, (c, o) in enumerate(zip(which.tolist(), offsets.tolist())):
        expected = raw[components[c].name][o:o + 17]   # text8 rows come as bytes, like enwik8's
        assert x[row].tolist() == expected[:-1].tolist() and y[row].tolist() == expected[1:].tolist()
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.int64

    prep.main(['enwik8', 'mix', f'--data_dir={data}'])   # each dataset once
    assert [line.split(':')[0] for line in capsys.readouterr().out.splitlines()] == ['enwik8', 'text8']
    # data prepared from an archive with another checksum are not used: text8 is fetched again,
    # and its archive is gone (removed above)
    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], digest=('sha1', '0' * 40)))
    with pytest.raises(SystemExit, match='could not download'):
        prep.prepare('text8', str(data))


def test_download_is_verified_renamed_and_not_repeated(tmp_path, monkeypatch, server, capsys):
    folder, url = server
    make_corpora(str(folder), monkeypatch, serve_url=url)
    meta = prep.prepare('enwik8', str(tmp_path / 'data'))
    assert meta['splits']['train'] == 3600 and meta['source'] == f'{url}/enwik8.zip'
    assert sorted(os.listdir(tmp_path / 'data' / 'enwik8')) == ['enwik8.zip', 'meta.json', 'test.bin',
                                                                'train.bin', 'val.bin']
    assert 'enwik8.zip: 100%' in capsys.readouterr().err   # the progress bar
    os.remove(folder / 'enwik8.zip')            # no second download: it would now fail
    assert prep.prepare('enwik8', str(tmp_path / 'data'))['splits']['train'] == 3600

    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], digest=('sha1', '0' * 40)))
    # --max_iters=1: a check that let the archive through would fail fast, not train a whole run
    message = fails('--dataset=text8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}', '--max_iters=1')
    assert 'failed verification' in message and 'sha1' in message
    assert os.listdir(tmp_path / 'data' / 'text8') == []   # neither the archive nor a partial one


def test_two_runs_downloading_at_once_both_prepare_the_data(tmp_path, monkeypatch, server):
    """Two runs started together on a fresh machine both download enwik8. The other one (another
    process id) downloads, checks and prepares it all while this one is checking its own copy:
    both must end with the data prepared and nothing else left in the folder."""
    folder, url = server
    contents = make_corpora(str(folder), monkeypatch, serve_url=url)
    data = str(tmp_path / 'data')
    check = prep.unzip_verified

    def the_other_run_finishes_meanwhile(*args):
        monkeypatch.setattr(prep, 'unzip_verified', check)
        with monkeypatch.context() as m:
            m.setattr(prep.os, 'getpid', lambda: 1)
            assert prep.prepare('enwik8', data)['splits']['train'] == 3600
        return check(*args)

    monkeypatch.setattr(prep, 'unzip_verified', the_other_run_finishes_meanwhile)
    meta = prep.prepare('enwik8', data)
    assert meta['splits']['train'] == 3600 and prep.unzip_verified is check   # the other run did run
    assert sorted(os.listdir(tmp_path / 'data' / 'enwik8')) == ['enwik8.zip', 'meta.json', 'test.bin',
                                                                'train.bin', 'val.bin']
    with zipfile.ZipFile(tmp_path / 'data' / 'enwik8' / 'enwik8.zip') as z:
        assert z.read('enwik8') == contents['enwik8']


def test_offline_download_says_where_to_put_the_archive(tmp_path, monkeypatch):
    make_corpora(str(tmp_path / 'zips'), monkeypatch)   # URLs point at a closed port
    message = fails('--dataset=mix', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}')
    assert 'could not download http://127.0.0.1:9/' in message
    assert f"put it at {tmp_path / 'data' / 'enwik8' / 'enwik8.zip'}" in message


@pytest.mark.parametrize('cut', [ConnectionResetError('connection reset by peer'), KeyboardInterrupt()])
def test_a_dropped_download_leaves_nothing_behind(tmp_path, monkeypatch, cut):
    """The connection drops, or Ctrl-C comes, after the first chunk: one line, and no partial file
    is left in the dataset's folder."""
    make_corpora(str(tmp_path / 'zips'), monkeypatch)

    class Dropped(io.BytesIO):
        headers = {'Content-Length': str(3 << 20)}
        def read(self, n=-1):
            if self.tell():
                raise cut
            return super().read(n)
    monkeypatch.setattr(prep.urllib.request, 'urlopen', lambda url, timeout: Dropped(b'x' * (2 << 20)))
    argv = '--dataset=enwik8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}'
    if isinstance(cut, KeyboardInterrupt):
        with pytest.raises(SystemExit) as e:
            run(*argv)
        assert e.value.code == 130
    else:
        message = fails(*argv)
        assert 'could not download' in message and 'connection reset by peer' in message
    assert os.listdir(tmp_path / 'data' / 'enwik8') == []


def test_a_full_disk_during_a_download_says_so(tmp_path, monkeypatch):
    """The disk fills while the archive is written: one line that says so (not advice to download
    the archive by hand), and no partial file left behind."""
    make_corpora(str(tmp_path / 'zips'), monkeypatch)
    class Response(io.BytesIO):
        headers = {'Content-Length': str(2 << 20)}
    monkeypatch.setattr(prep.urllib.request, 'urlopen', lambda url, timeout: Response(b'x' * (2 << 20)))
    write = prep.atomic_write

    @contextlib.contextmanager
    def full_disk(path):
        with write(path) as f:
            def no_space(chunk):
                raise OSError(errno.ENOSPC, 'No space left on device')
            f.write = no_space
            yield f
    monkeypatch.setattr(prep, 'atomic_write', full_disk)
    message = fails('--dataset=enwik8', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}')
    assert message.startswith(f"error: no space left on the device for {tmp_path / 'data' / 'enwik8' / 'enwik8.zip'}")
    assert 'by hand' not in message
    assert os.listdir(tmp_path / 'data' / 'enwik8') == []


def test_wrong_archive_is_reported_and_kept(corpora, monkeypatch):
    data, _ = corpora
    monkeypatch.setitem(prep.SOURCES, 'enwik8', dict(prep.SOURCES['enwik8'], size=10**8))
    # --max_iters=1: a check that let the archive through would fail fast, not train a whole run
    message = fails('--dataset=enwik8', f'--data_dir={data}', f'--out_dir={data / "out"}', '--max_iters=1')
    assert 'expected 100,000,000 bytes' in message and 'delete it' in message
    assert message.startswith(f"error: {data / 'enwik8' / 'enwik8.zip'}: enwik8 is ")   # which file
    assert os.path.exists(data / 'enwik8' / 'enwik8.zip')


# ---------------------------------------------------------------------------------------------
# Training, resuming, DDP

def test_command_line_train_resume_sample(tmp_path, data_dir, capsys):
    """Issue 4's 'done when': 60 iterations log a falling val loss and a checkpoint, a resume
    continues to 90, and sampling prints text after the prompt. The first run is the command itself,
    a process; the resume and the sampling are its main(argv) in this process."""
    out = tmp_path / 'out'
    common = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--learning_rate=1e-2']
    result = cli(*common, '--max_iters=60', '--eval_interval=30')
    assert result.returncode == 0, result.stderr
    val = [e['val_loss'] for e in read_jsonl(out / 'log.jsonl')]
    assert len(val) == 3 and val[0] > val[1] > val[2], val
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 60
    assert 'sample:' in result.stdout and ' tokens/s' in result.stdout
    assert 'mfu' not in result.stdout   # a GPU's peak: not printed for a CPU run

    capsys.readouterr()
    run(*common, '--init_from=resume', '--max_iters=90', '--num_samples=2')
    stdout = capsys.readouterr().out
    assert f"resuming from {out / 'ckpt.pt'} at iter 60" in stdout
    assert stdout.count('sample:\n') == 2, stdout[-500:]   # --num_samples
    assert [e['iter'] for e in read_jsonl(out / 'log.jsonl')] == [0, 30, 60, 90]
    rates = [e['lr'] for e in read_jsonl(out / 'train_log.jsonl')]
    assert len(rates) == 90 and rates[0] < rates[10] > rates[89]   # warm-up, then decay
    assert [e['lr'] for e in read_jsonl(out / 'log.jsonl')][:3] == [rates[0], rates[30], rates[60]]

    tc.main(['--init_from=resume', f'--out_dir={out}', '--mode=config', '--max_iters=120'])   # the run a resume would be
    shown = json.loads(capsys.readouterr().out)
    assert (shown['n_embd'], shown['block_size'], shown['max_iters'], shown['learning_rate']) == (32, 16, 120, 1e-2)
    for more, words in (([], 'raise max_iters'), (['--max_iters=120', '--n_embd=64'], 'do not fit the model with n_embd=64')):
        with pytest.raises(SystemExit, match=words):   # refused, as the resume itself would be
            tc.main(['--init_from=resume', f'--out_dir={out}', '--mode=config', *more])
    capsys.readouterr()
    assert 'do not fit the model with n_embd=64' in fails('--init_from=resume', f'--out_dir={out}', '--max_iters=120',
                                                          '--n_embd=64')
    assert capsys.readouterr().out == ''   # before the data are loaded and the settings printed

    run_eval('--mode=sample', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=40', '--num_samples=2')
    samples = capsys.readouterr().out.split('---------------\n')
    assert len(samples) == 3 and all(s.startswith('ROMEO:') and len(s) > 40 for s in samples[:2])


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, data_dir):
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=4', '--dropout=0.1',
              '--gradient_accumulation_steps=2', '--lr_decay_iters=8', '--max_new_tokens=1']
    run(*common, f'--out_dir={tmp_path / "a"}', '--max_iters=8')
    run(*common, f'--out_dir={tmp_path / "b"}', '--max_iters=4')
    for log in ('log.jsonl', 'train_log.jsonl'):   # as if b had run on past its checkpoint, then crashed
        with open(tmp_path / 'b' / log, 'a') as f:
            f.write(json.dumps(dict(iter=5, loss=0.0, val_loss=0.0)) + '\n')
    run(f'--out_dir={tmp_path / "b"}', '--init_from=resume', '--max_iters=8')
    a, b = (read_jsonl(tmp_path / d / 'train_log.jsonl') for d in 'ab')
    assert [e['iter'] for e in b] == list(range(8))
    assert a == b                                    # every loss and learning rate, bit for bit
    a, b = (read_jsonl(tmp_path / d / 'log.jsonl') for d in 'ab')
    assert [(e['val_loss'], e['tokens']) for e in a] == [(e['val_loss'], e['tokens']) for e in b]
    assert all(x['time'] <= y['time'] for x, y in zip(b, b[1:]))   # the clock carries on from the checkpoint


def test_each_step_follows_the_schedule_clips_and_keeps_the_best(tmp_path, data_dir, monkeypatch):
    """Every iteration's learning rate, logged and given to every parameter group of the optimizer,
    is nanoGPT's schedule (written out here: linear warm-up, cosine to min_lr, then min_lr), or
    learning_rate throughout with decay_lr=False; the gradients are clipped to grad_clip at every
    step, and with always_save_checkpoint=False the checkpoint is the best evaluation's (losses
    set by hand)."""
    val = iter([3.0, 2.0, 2.5, 2.2])   # the evaluations at iters 0, 4, 8 and 12
    monkeypatch.setattr(tc, 'estimate_loss', lambda *a: dict(train_loss=1.0, val_loss=(v := next(val)), val_bpc=v))
    norms = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda p, max_norm: norms.append(max_norm) or clip(p, max_norm))
    stepped = []   # per optimizer step, the lr of each parameter group
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: stepped.append({g['lr'] for g in optimizer.param_groups}))
    out = tmp_path / 'out'
    try:
        run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=12', '--eval_interval=4',
            '--warmup_iters=2', '--lr_decay_iters=10', '--learning_rate=1e-3', '--min_lr=1e-4',
            '--always_save_checkpoint=False', '--grad_clip=0.5')
        schedule, stepped[:] = stepped[:], []
        val = iter([3.0, 2.0, 1.0])   # the evaluations at iters 0, 2 and 3
        run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "flat"}', '--max_iters=3', '--eval_interval=2',
            '--decay_lr=False', '--learning_rate=1e-3', '--min_lr=1e-4')
    finally:
        hook.remove()
    def lr(it):
        if it < 2:
            return 1e-3 * (it + 1) / 3
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(it - 2, 8) / 8)) * 9e-4
    logged = [e['lr'] for e in read_jsonl(out / 'train_log.jsonl')]
    assert logged == pytest.approx([lr(it) for it in range(12)], rel=1e-12)
    assert [group_lrs.pop() for group_lrs in schedule if len(group_lrs) == 1] == logged   # one lr for all groups
    assert [e['lr'] for e in read_jsonl(tmp_path / 'flat' / 'train_log.jsonl')] == [1e-3] * 3
    assert stepped == [{1e-3}] * 3
    assert norms == [0.5] * 12 + [1.0] * 3   # the flat run clips at the default grad_clip
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert (ckpt['iter_num'], ckpt['best_val_loss']) == (4, 2.0)
    val = iter([3.0, 2.0, 2.5])   # always_save_checkpoint=True: the last evaluation's weights, the best loss
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "always"}', '--max_iters=8', '--eval_interval=4')
    ckpt = torch.load(tmp_path / 'always' / 'ckpt.pt', weights_only=True)
    assert (ckpt['iter_num'], ckpt['best_val_loss']) == (8, 2.0)


def test_estimate_loss_scores_each_split_on_its_own_tokens(tmp_path):
    """A stand-in model whose loss is the mean target id: each split's loss is the mean of its own
    tokens (a file whose train part is one byte and whose val part another)."""
    text = tmp_path / 'two.txt'
    text.write_bytes(b'a' * 900 + b'b' * 100)   # 90 / 5 / 5: train all 'a' (id 0), val all 'b' (id 1)
    components, _ = dataset.load_dataset(str(text), str(tmp_path / 'data'))
    class MeanTarget(torch.nn.Module):
        def forward(self, x, y):
            return None, y.double().mean()
    cfg = dict(seed=0, eval_iters=3, batch_size=4, gradient_accumulation_steps=2, block_size=8)
    losses = tc.estimate_loss(MeanTarget(), components, cfg, 'cpu', contextlib.nullcontext())
    assert (losses['train_loss'], losses['val_loss'], losses['val_bpc']) == (0.0, 1.0, 1 / math.log(2))


def test_micro_batches_change_neither_the_training_nor_the_estimates(tmp_path, data_dir):
    """4 rows an iteration as one micro-batch or as two of 2: the same steps, and the same loss
    estimates in log.jsonl (each evaluation scores one iteration's rows per batch)."""
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2', '--max_new_tokens=1']
    run(*common, f'--out_dir={tmp_path / "one"}')
    run(*common, '--batch_size=2', '--gradient_accumulation_steps=2', f'--out_dir={tmp_path / "two"}')
    for log in ('train_log.jsonl', 'log.jsonl'):
        one, two = (read_jsonl(tmp_path / d / log) for d in ('one', 'two'))
        for key in ('loss', 'train_loss', 'val_loss'):
            if key in one[0]:
                np.testing.assert_allclose([e[key] for e in two], [e[key] for e in one], rtol=1e-5)


def test_a_resume_takes_this_runs_weight_decay_and_betas(tmp_path, data_dir, monkeypatch):
    out = tmp_path / 'out'
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=2')
    optimizers = []
    restore = tc.checkpoint.restore
    monkeypatch.setattr(tc.checkpoint, 'restore', lambda ckpt, optimizer, *a: optimizers.append(optimizer) or restore(ckpt, optimizer, *a))
    run(f'--out_dir={out}', '--init_from=resume', '--max_iters=4', '--weight_decay=0.0', '--beta1=0.5', '--beta2=0.9')
    decay, no_decay = optimizers[0].param_groups
    assert decay['weight_decay'] == no_decay['weight_decay'] == 0.0
    assert decay['betas'] == no_decay['betas'] == (0.5, 0.9)


def test_ddp_on_two_cpu_processes_matches_one_process(tmp_path, data_dir):
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=4', '--log_interval=2',
              '--gradient_accumulation_steps=2', '--max_new_tokens=1']
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             'train_char.py', *common, f'--out_dir={tmp_path / "ddp"}'],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('sample:') == 1      # only rank 0 logs and samples
    run(*common, f'--out_dir={tmp_path / "one"}')
    ddp, one = (read_jsonl(tmp_path / d / 'train_log.jsonl') for d in ('ddp', 'one'))
    assert [e['iter'] for e in ddp] == [0, 1, 2, 3]
    np.testing.assert_allclose([e['loss'] for e in ddp], [e['loss'] for e in one], rtol=1e-4)
    ckpt = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 4 and len(ckpt['rng']['torch']) == 2   # both processes' RNG states


def test_ddp_ranks_waiting_for_missing_data_stop_in_one_line(tmp_path):
    """Rank 0 refuses a missing dataset in one line; rank 1, waiting for rank 0 to prepare the
    data, then says so in one line rather than a traceback from the broken process group."""
    # torchrun stops the other ranks once one fails; checking every 2 s, it leaves rank 1 the
    # time to say why it stopped
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             '--monitor-interval=2', 'train_char.py', *TINY, '--gradient_accumulation_steps=2',
                             f'--dataset={tmp_path / "missing.txt"}', f'--out_dir={tmp_path / "out"}'],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "is neither shakespeare" in result.stderr
    assert "error: rank 0 stopped before the data were ready" in result.stderr
    assert "RuntimeError" not in result.stderr


def test_the_lock_names_only_the_run_that_holds_it(tmp_path):
    """train.lock is emptied before the run that takes it writes itself in: a second run's
    refusal names the current holder, never one that an earlier run left in the file."""
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'train.lock').write_text('pid 1, started 2000-01-01 00:00:00, command: python train_char.py --old\n')
    with RunFolder(str(out)) as first, RunFolder(str(out)) as second:
        first.lock()
        with pytest.raises(SystemExit) as e:
            second.lock()   # another open file: flock refuses it, as it would another process
    message = e.value.code
    assert message.startswith(f'error: {out} is in use by another training run (pid {os.getpid()}, started ')
    assert 'pid 1,' not in message and '--old' not in message


def test_snapshots_asked_for_at_a_resume_lie_ahead_of_it(trained, tmp_path):
    """Snapshots before the checkpoint's iteration would never be written: refused, not skipped;
    so are those the checkpoint keeps asking for past a lowered max_iters, saying where they come from."""
    message = fails('--init_from=resume', f'--out_dir={trained}', '--max_iters=40', '--snapshot_iters=5,30')
    assert "snapshot_iters (given): [5] outside this run's iterations 20..40" in message and 'sets others' not in message
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    (tmp_path / 'run').mkdir()
    torch.save(ckpt | {'config': ckpt['config'] | {'snapshot_iters': '30,60'}}, tmp_path / 'run' / 'ckpt.pt')
    assert ("snapshot_iters (the checkpoint's): [60] outside this run's iterations 0..40; --snapshot_iters= sets "
            "others, or none") in fails('--init_from=resume', f"--out_dir={tmp_path / 'run'}", '--max_iters=40')


def test_non_finite_loss_stops_and_keeps_the_checkpoint(trained, monkeypatch, tmp_path, capsys):
    """One line, the exit status that tells reproduce.py the run diverged, the checkpoint untouched."""
    class Diverging(damcha_torch.GPT):
        def forward(self, idx, targets=None, **kwargs):
            logits, loss = super().forward(idx, targets, **kwargs)
            return logits, loss * float('nan') if self.training else loss

    before = digest(trained / 'ckpt.pt')
    monkeypatch.setattr(tc, 'GPT', Diverging)   # the trainer's model
    with pytest.raises(SystemExit) as e:
        run('--init_from=resume', f'--out_dir={trained}', '--max_iters=40')
    assert e.value.code == DIVERGED
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith('error: the training loss became nan at iter 20') and 'iter 20) is the last good checkpoint' in message
    assert digest(trained / 'ckpt.pt') == before
    monkeypatch.setattr(tc, 'GPT', damcha_torch.GPT)   # training is fine, the evaluation is not
    monkeypatch.setattr(tc, 'estimate_loss', lambda *a: dict(train_loss=1.0, val_loss=float('inf'), val_bpc=0.0))
    shutil.copytree(trained, tmp_path / 'copy')        # it trains on: the shared run's logs stay as they are
    with pytest.raises(SystemExit) as e:
        run('--init_from=resume', f'--out_dir={tmp_path / "copy"}', '--max_iters=40')
    assert e.value.code == DIVERGED
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith('error: the val loss became inf at iter 30')
    assert digest(tmp_path / 'copy' / 'ckpt.pt') == before


# ---------------------------------------------------------------------------------------------
# Eval, sample, plot

def test_eval_scores_every_token_once(trained, tmp_path, monkeypatch, capsys):
    # a shorter Shakespeare keeps this fast; its vocabulary is a subset of the model's
    small = tmp_path / 'small.txt'
    small.write_bytes(open(prep.BUNDLED, 'rb').read()[:20000])
    monkeypatch.setattr(prep, 'BUNDLED', str(small))
    results = []
    for stride in (0, 5, 16):
        run_eval('--mode=eval', f'--out_dir={trained}', f'--stride={stride}', f'--data_dir={tmp_path}', '--batch_size=64')
        out, err = capsys.readouterr()
        results.append(json.loads(out))
        assert 'shakespeare has no test split' in err
    for r, stride in zip(results, (16, 5, 16)):
        assert r['stride'] == stride and r['val_tokens'] == 2000 - 1 and 'test_bpc' not in r
        assert r['val_bpc'] == pytest.approx(r['val_loss'] / np.log(2)) and 1 < r['val_bpc'] < 7
    assert abs(results[0]['val_bpc'] - results[1]['val_bpc']) < 0.2
    assert results[2] == results[0]   # stride = block_size is the default's non-overlapping windows


def test_split_loss_is_the_mean_over_every_target(monkeypatch):
    """split_loss against the loss written out, with a bigram stand-in model (logits from the
    previous token only, so the context a window gives does not matter): every target of a split
    of 103 ids, mapped through lut, scored once, for several strides and batch sizes."""
    W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    class Bigram(torch.nn.Module):
        def forward(self, x, y):
            return W[x], None
    data = np.random.default_rng(0).integers(0, 5, 103).astype(np.uint8)
    lut = np.array([7, 1, 3, 0, 5])                         # the split's ids -> a model's 8-symbol vocabulary
    ids = torch.from_numpy(lut[data.astype(np.int64)])
    want = torch.nn.functional.cross_entropy(W[ids[:-1]], ids[1:]).item()
    monkeypatch.setattr(ec, 'tqdm', lambda it, **_: it)
    for stride in (0, 1, 5, 16):
        for batch_size in (1, 3):
            loss, count = ec.split_loss(Bigram(), data, lut, dict(block_size=16, stride=stride, batch_size=batch_size),
                                          'cpu', contextlib.nullcontext())
            assert count == 102 and loss == pytest.approx(want, rel=1e-6), (stride, batch_size)   # float32 logits


def test_rows_cover_every_window_and_an_empty_prompt_is_a_newline():
    data = np.arange(18, dtype=np.uint8)                    # block_size 16: two windows of 17 tokens
    x, y = tc.get_batch([dataset.Corpus('bytes', '', dict(train=data), None)], 'train', 2000, 16, torch.Generator().manual_seed(0), 'cpu')
    assert set(x[:, 0].tolist()) == {0, 1} and (y == x + 1).all()
    assert dataset.encode('', [10, 32, 97], 8) == [0]          # a newline where there is one,
    assert dataset.encode('', [32, 97], 8) == [0]              # else a space (text8)


def test_text8_with_a_symbol_outside_its_vocabulary_is_refused(tmp_path, monkeypatch):
    data = b'abc def A' * 400
    os.makedirs(tmp_path / 'text8')
    with zipfile.ZipFile(tmp_path / 'text8' / 'text8.zip', 'w') as z:
        z.writestr('text8', data)
    monkeypatch.setitem(prep.SOURCES, 'text8', dict(prep.SOURCES['text8'], size=len(data),
                                                    digest=('sha1', hashlib.sha1(data).hexdigest())))
    with pytest.raises(SystemExit, match="holds bytes outside its 27-symbol vocabulary"):
        prep.prepare('text8', str(tmp_path))


def test_mix_training_and_eval_report_both_corpora(corpora, capsys, monkeypatch):
    data, _ = corpora
    out = data / 'out'
    run(*TINY, '--dataset=mix', f'--data_dir={data}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=2')
    entry = read_jsonl(out / 'log.jsonl')[-1]
    assert entry['val_loss'] == pytest.approx((entry['val_loss_enwik8'] + entry['val_loss_text8']) / 2)
    assert {'val_bpc_enwik8', 'val_bpc_text8', 'train_loss_enwik8', 'train_loss_text8'} <= set(entry)
    assert f"val bpc {entry['val_bpc']:.4f}, enwik8 {entry['val_bpc_enwik8']:.4f}, text8 " in capsys.readouterr().out
    scored = []   # each split's ids, as eval hands them to split_loss
    split_loss = ec.split_loss
    monkeypatch.setattr(ec, 'split_loss', lambda model, ids, *a: scored.append((a[-1], np.array(ids))) or
                        split_loss(model, ids, *a))
    run_eval('--mode=eval', f'--out_dir={out}')
    result = json.loads(capsys.readouterr().out)
    for split in ('val', 'test'):
        assert result[f'{split}_tokens_enwik8'] == result[f'{split}_tokens_text8'] == 199
        assert result[f'{split}_loss'] == pytest.approx((result[f'{split}_loss_enwik8'] + result[f'{split}_loss_text8']) / 2)
        assert result[f'{split}_bpc'] == pytest.approx(result[f'{split}_loss'] / np.log(2))
        assert result[f'{split}_bpc'] == pytest.approx((result[f'{split}_bpc_enwik8'] + result[f'{split}_bpc_text8']) / 2)
    assert [desc for desc, _ in scored] == ['enwik8 val', 'text8 val', 'enwik8 test', 'text8 test']
    for desc, ids in scored:
        name, split = desc.split()
        assert np.array_equal(ids, np.fromfile(data / name / f'{split}.bin', dtype=np.uint8)), desc


def test_sampling_says_it_runs_uncompiled(trained, capsys):
    """compile=True serves eval; sampling says it runs uncompiled."""
    run_eval('--mode=sample', f'--out_dir={trained}', '--compile=True', '--max_new_tokens=5')
    out, err = capsys.readouterr()
    assert 'note: compile=True applies to --mode=eval; sampling runs the model uncompiled' in err and out


def test_sampling_settings_and_compile_are_eval_chars_own(trained, tmp_path, capsys):
    """The trainer's settings for its end-of-run sample (TINY: 20 new characters) stay with it, and
    so does compile (the GPU configs set it; the run may be evaluated on a CPU)."""
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    (tmp_path / 'run').mkdir()
    torch.save(ckpt | {'config': ckpt['config'] | {'compile': True, 'num_samples': 3}}, tmp_path / 'run' / 'ckpt.pt')
    run_eval('--mode=sample', f"--out_dir={tmp_path / 'run'}", '--start=ROMEO:')
    out, err = capsys.readouterr()
    sample = out.removesuffix('\n---------------\n')
    assert sample.startswith('ROMEO:') and len(sample) == len('ROMEO:') + ec.DEFAULTS['max_new_tokens'] == 506
    assert 'compile=True' not in err and out.count('---------------') == 1


def test_sample_from_a_file_prompt(trained, tmp_path, capsys):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('Ham.\n')
    run_eval('--mode=sample', f'--out_dir={trained}', f'--start=FILE:{prompt}', '--max_new_tokens=30', '--seed=1')
    first = capsys.readouterr().out
    assert first.startswith('Ham.\n') and first.endswith('---------------\n')
    run_eval('--mode=sample', f'--out_dir={trained}', f'--start=FILE:{prompt}', '--max_new_tokens=30', '--seed=1')
    assert capsys.readouterr().out == first   # the seed fixes the sample


def test_samples_are_printed_as_they_are_generated(trained, monkeypatch, capsys):
    """eval_char.py --mode=sample prints and flushes each sample before it generates the next, so
    a long run of samples shows them one by one rather than all at the end."""
    seen, flushes = [], []   # at each generate: what was printed, and how often stdout was flushed

    class Recording(damcha_torch.GPT):
        def generate(self, *args, **kwargs):
            seen.append((capsys.readouterr().out, len(flushes)))
            return super().generate(*args, **kwargs)

    class Stdout:
        def write(self, text):
            return real.write(text)

        def flush(self):
            flushes.append(1)
            real.flush()
    real = sys.stdout
    monkeypatch.setattr(sys, 'stdout', Stdout())
    monkeypatch.setattr(ec, 'GPT', Recording)
    run_eval('--mode=sample', f'--out_dir={trained}', '--start=ROMEO:', '--num_samples=3', '--max_new_tokens=5')
    seen.append((capsys.readouterr().out, len(flushes)))
    assert seen[0] == ('', 0)
    for k, (printed, flushed) in enumerate(seen[1:]):   # after each sample: that sample, printed and flushed
        assert printed.startswith('ROMEO:') and printed.endswith('\n---------------\n') and len(printed) == 6 + 5 + 17
        assert flushed >= k + 1


def test_auto_precision_is_float32_off_cuda():
    for name in ('cpu', 'mps'):
        dtype, ctx = device.autocast_for(name, 'auto')
        assert dtype == 'float32' and isinstance(ctx, contextlib.nullcontext)
    dtype, ctx = device.autocast_for('cpu', 'bfloat16')
    assert dtype == 'bfloat16' and isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16


def test_plot_of_several_runs(trained, tmp_path):
    png = tmp_path / 'bpc.png'
    run_eval('--mode=plot', f'--out_dir={trained},{trained}', f'--plot_file={png}')
    with open(png, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    import matplotlib.pyplot as plt
    log = read_jsonl(trained / 'log.jsonl')
    by_tokens, by_time = plt.gcf().axes   # val bpc against tokens, and against minutes: a line per run
    for ax, x in ((by_tokens, [e['tokens'] for e in log]), (by_time, [e['time'] / 60 for e in log])):
        assert len(ax.lines) == 2
        for line in ax.lines:
            assert list(line.get_xdata()) == x and list(line.get_ydata()) == [e['val_bpc'] for e in log]
    plt.close('all')
    for d in ('first', 'second'):
        (tmp_path / d).mkdir()
        shutil.copy(trained / 'log.jsonl', tmp_path / d)
    run_eval('--mode=plot', f"--out_dir={tmp_path / 'first'},{tmp_path / 'second'}")   # no plot_file: the first run's folder
    assert os.path.exists(tmp_path / 'first' / 'bpc.png') and not os.path.exists(tmp_path / 'second' / 'bpc.png')
    assert 'log.jsonl' in fails_eval('--mode=plot', f'--out_dir={tmp_path}')
    damaged = tmp_path / 'damaged'
    damaged.mkdir()
    entries = (trained / 'log.jsonl').read_text().splitlines()
    for key in ('val_bpc', 'tokens', 'time'):
        first = json.loads(entries[0])
        del first[key]
        (damaged / 'log.jsonl').write_text('\n'.join([json.dumps(first)] + entries[1:]) + '\n')
        assert 'has an entry without val_bpc, tokens or time' in fails_eval('--mode=plot', f'--out_dir={damaged}')


def test_an_unwritable_plot_file_is_one_line(trained, tmp_path):
    """A plot_file in a folder that does not exist, or one that is itself a folder: the system's
    reason in one line, and nothing made."""
    missing = tmp_path / 'no' / 'bpc.png'
    message = fails_eval('--mode=plot', f'--out_dir={trained}', f'--plot_file={missing}')
    assert 'No such file or directory' in message and str(missing) in message
    folder = tmp_path / 'bpc.png'
    folder.mkdir()
    assert 'Is a directory' in fails_eval('--mode=plot', f'--out_dir={trained}', f'--plot_file={folder}')
    assert sorted(os.listdir(tmp_path)) == ['bpc.png'] and os.listdir(folder) == []


def test_eval_runs_the_model_without_dropout(trained, tmp_path, monkeypatch, capsys):
    """eval scores the model in eval mode: with dropout set (--dropout and --attn_dropout 0.5), the
    result is the same on every run, and the same as without dropout."""
    small = tmp_path / 'small.txt'   # a shorter Shakespeare keeps this fast
    small.write_bytes(open(prep.BUNDLED, 'rb').read()[:20000])
    monkeypatch.setattr(prep, 'BUNDLED', str(small))
    results = []
    for dropout in (0.5, 0.5, 0.0):
        run_eval('--mode=eval', f'--out_dir={trained}', f'--data_dir={tmp_path}', '--batch_size=64',
                 f'--dropout={dropout}', f'--attn_dropout={dropout}')
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1] == results[2] and results[0]['val_tokens'] == 2000 - 1


def test_eval_refuses_a_split_too_short_for_one_window(trained, tmp_path, capsys):
    """A scored window is block_size + 1 tokens: a val split of exactly block_size (16) tokens is
    refused in one line, not a traceback from the scoring; one of 17 is scored."""
    text = tmp_path / 'short.txt'
    text.write_bytes(b'abcd' * 80)   # 90 / 5 / 5 of 320: val and test 16 tokens each
    message = fails_eval('--mode=eval', f'--out_dir={trained}', f'--dataset={text}', f'--data_dir={tmp_path}')
    assert message == f'error: the val split of {text} has 16 tokens, too few for block_size=16'
    text.write_bytes(b'abcd' * 85)   # of 340: 17 each
    run_eval('--mode=eval', f'--out_dir={trained}', f'--dataset={text}', f'--data_dir={tmp_path}')
    result = json.loads(capsys.readouterr().out)
    assert result['val_tokens'] == result['test_tokens'] == 16


# ---------------------------------------------------------------------------------------------
# Bad input never touches a checkpoint

def test_bad_checkpoints_are_refused_and_kept(trained, tmp_path):
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    cases = {'garbage': b'not a checkpoint at all', 'truncated': (trained / 'ckpt.pt').read_bytes()[:5000]}
    for name, content in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / 'ckpt.pt').write_bytes(content)
    for name, content in dict(foreign={'model': ckpt['model']},
                              mismatched=ckpt | {'model_args': ckpt['model_args'] | {'n_embd': 64}}).items():
        (tmp_path / name).mkdir()
        torch.save(content, tmp_path / name / 'ckpt.pt')
    expected = dict(garbage='not a readable checkpoint', truncated='not a readable checkpoint',
                    foreign='not a checkpoint of train_char.py', mismatched='do not fit the model')
    for name, words in expected.items():
        before = digest(tmp_path / name / 'ckpt.pt')
        assert words in fails('--init_from=resume', f'--out_dir={tmp_path / name}', '--max_iters=40')
        for mode in ('eval', 'sample'):
            assert words in fails_eval(f'--mode={mode}', f'--out_dir={tmp_path / name}')
        assert digest(tmp_path / name / 'ckpt.pt') == before
    assert 'no checkpoint at' in fails('--init_from=resume', f'--out_dir={tmp_path / "empty"}')


def test_bad_input_with_an_existing_checkpoint_leaves_it_alone(trained, corpora):
    before = digest(trained / 'ckpt.pt')
    out = f'--out_dir={trained}'
    assert 'exists: continue it with --init_from=resume' in fails(*TINY, out, '--max_iters=40')
    assert "do not fit the model with n_embd=64 (the checkpoint's: 32)" in fails('--init_from=resume', out,
                                                                                  '--max_iters=40', '--n_embd=64')
    data, _ = corpora   # a config file's model settings are given too: the message names them
    (data / 'deeper.py').write_text('n_layer = 2\n')
    assert "with n_layer=2 (the checkpoint's: 1)" in fails(str(data / 'deeper.py'), '--init_from=resume', out,
                                                           '--max_iters=40')
    assert f"out_dir {data / 'deeper.py'} is a file, not a folder" in fails(*TINY, '--dataset=text8', f'--data_dir={data}',
                                                                           f"--out_dir={data / 'deeper.py'}")
    assert 'divisible' in fails('--init_from=resume', out, '--max_iters=40', '--n_head=5')
    assert 'raise max_iters' in fails('--init_from=resume', out)
    assert 'neither' in fails('--init_from=resume', out, '--max_iters=40', '--dataset=nothing.txt')
    assert 'expected float' in fails('--init_from=resume', out, '--learning_rate=fast')
    assert 'longer than the model' in fails_eval('--mode=sample', out, '--start=' + 'a' * 17)
    assert "outside the model's 80-symbol vocabulary: '\\x00'" in fails_eval('--mode=sample', out, '--start=a\x00')
    assert 'cannot read the prompt' in fails_eval('--mode=sample', out, '--start=FILE:/no/such/prompt')
    assert 'stride=17 is larger than block_size=16' in fails_eval('--mode=eval', out, '--stride=17')
    assert digest(trained / 'ckpt.pt') == before

    # text8 knows only a-z and space
    run(*TINY, '--dataset=text8', f'--data_dir={data}', f'--out_dir={data / "t8"}', '--max_iters=1')
    message = fails_eval('--mode=sample', f'--out_dir={data / "t8"}', '--start=ROMEO:')
    assert "27-symbol vocabulary: ':' 'E' 'M' 'O' 'R'" in message


@pytest.mark.parametrize('corpus', ['enwik8', 'text8', 'mix'])
def test_gpu_configs_state_their_equal_parameter_counts(corpus):
    counts = {}
    for attn in ('damcha', 'mha'):   # a dataset file, then a model file
        path = os.path.join(ROOT, 'config', f'{attn}.py')
        cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', f'{corpus}.py'), path])
        assert (cfg['dataset'], cfg['attn'], cfg['out_dir']) == (corpus, attn, f'out-{corpus}-{attn}')
        with torch.device('meta'):   # shapes only: no memory, no time
            model = damcha_torch.GPT(damcha_torch.GPTConfig(**{k: cfg[k] for k in tc.MODEL_KEYS} | {'vocab_size': len(
                prep.SOURCES['text8']['vocab']) if corpus == 'text8' else 256}))
        counts[attn] = sum(p.numel() for p in model.parameters())
        with open(path) as f:
            assert f'{counts[attn]:,} parameters' in f.read()
    assert abs(counts['damcha'] - counts['mha']) < 0.0004 * counts['mha']
