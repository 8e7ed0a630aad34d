"""
Tests of what survives faults and bad input (issue 14), through the command line with real
signals: SIGKILL mid-run and resume, a torn last log line, a second run in a busy out_dir, a full
disk during a save (a small tmpfs, mounted here when the tests run as root), Ctrl-C (SIGINT), and
settings that reach a library underneath (one line, never a traceback).

    python -m pytest -q tests/test_reliability.py

The models are train_char.py's tiny test model (one layer, 32 wide); the runs that are not the
point of a test run in-process (tc.main), the ones that are run as subprocesses.
"""
import contextlib
import glob
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import damcha_numpy
import eval_char as ec
import train_char as tc
from run_folder import atomic_write, read_jsonl
from common import digest, sigint_default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4', '--gen_width=16',
        '--eval_iters=2', '--log_interval=5', '--max_new_tokens=5', '--device=cpu', '--compile=False',
        '--warmup_iters=2']
ENV = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'} | {'PYTHONUNBUFFERED': '1'}


def cli(*args, script='train_char.py', timeout=120):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, timeout=timeout,
                          env=ENV, text=not any(isinstance(a, bytes) for a in args))


def start(*args):
    """train_char.py in the background; its stdout (log lines) to read, stderr to a file."""
    err = open(os.devnull, 'w')
    return subprocess.Popen([sys.executable, 'train_char.py', *args], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=err)


def wait_for(proc, prefix):
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the run ended before printing {prefix!r}: exit status {proc.wait()}")


def one_line_error(result, words):
    """A failed run whose stderr ends in one 'error: ' line holding words, with no traceback."""
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''
    assert result.returncode == 1 and last.startswith('error: ') and words in last, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr, result.stderr[-2000:]
    return last


def fails(*argv, main=tc.main):
    """one_line_error's checks, in this process: main(argv) ends in a SystemExit whose message is one
    'error: ' line (which Python prints as the process's last line, with exit status 1), and prints
    no traceback before it. Returns the line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    message = e.value.code
    assert isinstance(message, str) and message.startswith('error: ') and '\n' not in message, message
    assert 'Traceback' not in err.getvalue(), err.getvalue()[-2000:]
    return message


def iters(path):
    return [e['iter'] for e in read_jsonl(path)]


# ---------------------------------------------------------------------------------------------
# History: a kill and a resume neither repeat nor lose a line

def test_sigkill_then_resume_gives_the_uninterrupted_history(tmp_path, data_dir):
    """Killed 5 iterations past its checkpoint at 20, with train_log.jsonl already past it, the
    resumed run ends with the very logs of a run never killed: one line per iteration and per
    evaluation, the same losses bit for bit."""
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=20', '--max_iters=40']
    tc.main([*common, f'--out_dir={tmp_path / "whole"}'])
    out = tmp_path / 'killed'
    proc = start(*common, f'--out_dir={out}')
    wait_for(proc, 'iter 25:')
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    assert saved == 20 and max(iters(out / 'train_log.jsonl')) >= saved   # history past the checkpoint
    tc.main([f'--out_dir={out}', '--init_from=resume'])
    assert iters(out / 'train_log.jsonl') == list(range(40))
    assert read_jsonl(out / 'train_log.jsonl') == read_jsonl(tmp_path / 'whole' / 'train_log.jsonl')
    assert iters(out / 'log.jsonl') == [0, 20, 40]
    assert [e['val_loss'] for e in read_jsonl(out / 'log.jsonl')] == \
           [e['val_loss'] for e in read_jsonl(tmp_path / 'whole' / 'log.jsonl')]


KILLED_INSIDE_THE_SECOND_SAVE = """
import io, os, signal, sys, torch
import train_char
real_save, saves = torch.save, []
def save(obj, f, *args, **kwargs):   # the second checkpoint: half of its bytes reach the disk, then SIGKILL
    saves.append(f)
    if len(saves) < 2:
        return real_save(obj, f, *args, **kwargs)
    whole = io.BytesIO()
    real_save(obj, whole, *args, **kwargs)
    f.write(whole.getvalue()[:len(whole.getvalue()) // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = save
train_char.main(sys.argv[1:])
"""


def test_sigkill_inside_a_save_leaves_the_last_checkpoint_and_a_resume_the_whole_history(tmp_path, data_dir):
    """Killed halfway through writing its checkpoint at 40, after log.jsonl took iteration 40's
    evaluation: ckpt.pt is still the whole checkpoint at 20, and the half-written one is the dead
    process's temporary file. The resume cuts log.jsonl back to the checkpoint, removes that file,
    and ends with the very logs of a run never killed."""
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=20', '--max_iters=60']
    tc.main([*common, f'--out_dir={tmp_path / "whole"}'])
    out = tmp_path / 'killed'
    killed = subprocess.run([sys.executable, '-c', KILLED_INSIDE_THE_SECOND_SAVE, *common, f'--out_dir={out}'],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    half = glob.glob(str(out / 'ckpt.pt.*.tmp'))
    assert len(half) == 1 and 0 < os.path.getsize(half[0]) < os.path.getsize(tmp_path / 'whole' / 'ckpt.pt') * 0.6
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 20
    assert iters(out / 'log.jsonl') == [0, 20, 40]   # the evaluation past the checkpoint
    tc.main([f'--out_dir={out}', '--init_from=resume'])
    assert not glob.glob(str(out / '*.tmp'))
    for name in ('log.jsonl', 'train_log.jsonl'):
        again, whole = read_jsonl(out / name), read_jsonl(tmp_path / 'whole' / name)
        assert [e['iter'] for e in again] == [e['iter'] for e in whole]
        assert [e.get('loss', e.get('val_loss')) for e in again] == [e.get('loss', e.get('val_loss')) for e in whole]


def test_torn_last_line_is_dropped_and_said_a_bad_middle_line_is_an_error(tmp_path, data_dir, capsys):
    out = tmp_path / 'out'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--eval_interval=4', '--max_iters=8'])
    with open(out / 'train_log.jsonl', 'a') as f:   # what a full disk or a kill mid-append leaves
        f.write('{"iter": 8, "loss": 2.4')
    with open(out / 'log.jsonl', 'a') as f:
        f.write('{"iter": 12, "tok')
    capsys.readouterr()
    tc.main([f'--out_dir={out}', '--init_from=resume', '--max_iters=12'])
    stderr = capsys.readouterr().err
    notes = [line for line in stderr.splitlines() if line.startswith('note: dropped the unreadable last line')]
    assert len(notes) == 2 and 'line 9 of' in notes[0] + notes[1], stderr[-2000:]
    assert iters(out / 'train_log.jsonl') == list(range(12)) and iters(out / 'log.jsonl') == [0, 4, 8, 12]

    lines = (out / 'train_log.jsonl').read_text().splitlines()
    lines[2] = lines[2][:20]
    (out / 'train_log.jsonl').write_text('\n'.join(lines) + '\n')
    before = (out / 'train_log.jsonl').read_text()
    message = fails(f'--out_dir={out}', '--init_from=resume', '--max_iters=16')
    assert 'train_log.jsonl, line 3 of 12, is unreadable' in message, message
    assert (out / 'train_log.jsonl').read_text() == before   # the history is never dropped


# ---------------------------------------------------------------------------------------------
# A second run, temporary files

def test_a_second_run_is_refused_and_the_lock_dies_with_the_first(tmp_path, data_dir):
    out = tmp_path / 'out'
    first = start(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--eval_interval=5', '--max_iters=100000')
    try:
        wait_for(first, 'iter 10:')   # holds the lock, and a checkpoint at 5 exists
        first.send_signal(signal.SIGSTOP)   # stopped, it still holds the lock, and leaves the CPU to the second
        last = fails(f'--out_dir={out}', '--init_from=resume', '--max_iters=100001')
        assert f'{out} is in use by another training run (pid {first.pid}, started ' in last, last
        assert 'command: python train_char.py' in last and f'--out_dir={out}' in last
        fresh = fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')   # refused before it reaches the lock
        assert f'{out}/ckpt.pt exists: continue it with --init_from=resume' in fresh, fresh
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    (out / 'ckpt.pt.damcha-partial-99999.tmp').write_bytes(b'half a checkpoint')   # as a kill mid-save leaves it
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    tc.main([f'--out_dir={out}', '--init_from=resume', f'--max_iters={saved + 1}'])   # the kernel freed the lock
    assert not glob.glob(str(out / '*.tmp'))


def test_temporary_files_are_per_process_and_removed_on_failure(tmp_path):
    path = tmp_path / 'ckpt.pt'
    path.write_bytes(b'the last good one')
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(path) as f:
            f.write(b'half of a new one')
            assert os.path.exists(f'{path}.damcha-partial-{os.getpid()}.tmp')
            raise KeyboardInterrupt
    assert path.read_bytes() == b'the last good one' and os.listdir(tmp_path) == ['ckpt.pt']


# ---------------------------------------------------------------------------------------------
# A full disk, Ctrl-C

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real file system that runs full (mounting needs root)."""
    disk = tmp_path / 'disk'
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip('mounting a tmpfs needs root')
    yield disk
    subprocess.run(['umount', str(disk)], check=True)


def fill(disk, leave):
    """Fill the file system but `leave` bytes."""
    try:
        with open(disk / 'filler', 'wb') as f:
            while True:
                f.write(b'\0' * 4096)
                f.flush()
    except OSError:   # no space left: on a write, or on the flush at close
        pass
    os.truncate(disk / 'filler', max(0, os.path.getsize(disk / 'filler') - leave))


def test_full_disk_during_a_save_says_so_and_keeps_the_checkpoint(small_disk, data_dir):
    out = small_disk / 'out'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--eval_interval=4', '--max_iters=4'])
    before = digest(out / 'ckpt.pt')
    assert os.path.getsize(out / 'ckpt.pt') > 3 * 32768
    fill(small_disk, 32768)   # room for the log lines, not for a checkpoint
    assert (f'could not save {out}/ckpt.pt: the disk is full (No space left on device); the partial file was '
            f'removed; {out}/ckpt.pt (iter 4) is the last good checkpoint') in fails(f'--out_dir={out}', '--init_from=resume',
                                                                                    '--max_iters=8')
    assert digest(out / 'ckpt.pt') == before and not glob.glob(str(out / '*.tmp'))
    os.remove(small_disk / 'filler')
    tc.main([f'--out_dir={out}', '--init_from=resume', '--max_iters=8'])   # room again: it carries on
    assert iters(out / 'train_log.jsonl') == list(range(8)) and iters(out / 'log.jsonl') == [0, 4, 8]


def test_ctrl_c_says_where_training_stopped_and_where_a_resume_starts(tmp_path, data_dir):
    out = tmp_path / 'out'
    proc = subprocess.Popen([sys.executable, 'train_char.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                             '--eval_interval=5', '--max_iters=100000'], cwd=ROOT, env=ENV, text=True,
                            preexec_fn=sigint_default,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(proc, 'iter 10:')
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 130 and 'Traceback' not in stderr, stderr[-2000:]
    match = re.fullmatch(rf'interrupted at iter (\d+): a resume \(--init_from=resume\) starts from '
                         rf'{re.escape(str(out))}/ckpt.pt at iter (\d+)', last)
    assert match, last
    stopped, resume_from = map(int, match.groups())
    assert resume_from == torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] and 5 <= resume_from <= stopped


def test_ctrl_c_inside_a_save_stops_as_ctrl_c_does(tmp_path, data_dir, monkeypatch, capsys):
    """torch.save reports a Ctrl-C that lands inside it as an error of its own (a RuntimeError
    whose context is the KeyboardInterrupt): the run still stops as Ctrl-C stops it, status 130
    and where a resume starts, and the checkpoint before stays whole."""
    out, real_save, saves = tmp_path / 'out', torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) < 2:
            return real_save(obj, f, *args, **kwargs)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 48581312 vs 48581200')
    monkeypatch.setattr(torch, 'save', save)
    with pytest.raises(SystemExit) as e:
        tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--eval_interval=5', '--max_iters=20'])
    monkeypatch.undo()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 130 and last == f'interrupted at iter 10: a resume (--init_from=resume) starts from {out}/ckpt.pt at iter 5'
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 5
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'log.jsonl', 'train.lock', 'train_log.jsonl']


# ---------------------------------------------------------------------------------------------
# Settings that pass the type check but not the library underneath: one line

def test_settings_are_checked_where_they_are_parsed(tmp_path, data_dir, capsys):
    assert 'beta1=2.0 must be at least 0 and below 1' in fails('--beta1=2', f'--out_dir={tmp_path / "never"}')
    (tmp_path / 'afile').write_text('')
    capsys.readouterr()
    assert 'is a file, not a folder' in fails(*TINY, f'--data_dir={data_dir}', f"--out_dir={tmp_path / 'afile'}")
    assert 'config:' not in capsys.readouterr().out   # refused before the run prints its settings
    assert "plot_file='bpc.xyz': end it in a format matplotlib writes: " in fails(
        '--mode=plot', f'--out_dir={tmp_path}', '--plot_file=bpc.xyz', main=ec.main)
    assert 'beta2=1.0 must be at least 0 and below 1' in fails('--beta2=1')
    assert 'beta1=-0.5' in fails('--beta1=-0.5')
    assert 'seed=-1 must be a whole number from 0 to 2**32 - 1' in fails('--seed=-1')
    assert 'seed=4294967296' in fails(f'--seed={2**32}')
    assert "out_dir=',' names no folder" in fails('--mode=plot', '--out_dir=,', main=ec.main)
    assert "out_dir='' names no folder" in fails('--out_dir=')
    for device in ('cpu:abc', 'cuda:x', 'mps:1'):
        assert f"device must be auto, cpu, cuda, cuda:N or mps, not '{device}'" in fails(f'--device={device}')
    assert 'max_iters must be positive, not 0' in fails('--max_iters=0')
    assert 'learning_rate must be a finite number, not inf' in fails('--learning_rate=1e999')
    assert "end it in a format" in fails('--mode=plot', f'--out_dir={tmp_path}', '--plot_file=bpc', main=ec.main)
    assert not os.path.exists(tmp_path / 'never')


@pytest.fixture(scope='module')
def byte_model(tmp_path_factory, data_dir):
    """A model of a corpus that is not UTF-8 (bytes 0xfe and 0xff) and has no newline or space."""
    folder = tmp_path_factory.mktemp('bytes')
    corpus = folder / 'raw.bin'
    corpus.write_bytes(b'ab\xffcd\xfe' * 400)
    tc.main([*TINY, f'--dataset={corpus}', f'--data_dir={data_dir}', f'--out_dir={folder / "out"}',
             '--max_iters=1', '--start=a'])
    return folder


def test_prompts_are_bytes(byte_model, data_dir, capsys):
    out = f'--out_dir={byte_model / "out"}'
    prompt = byte_model / 'prompt'
    prompt.write_bytes(b'a\xff')   # a FILE: prompt is read as bytes, UTF-8 or not
    capsys.readouterr()
    ec.main(['--mode=sample', out, f'--start=FILE:{prompt}'])
    assert capsys.readouterr().out.startswith('a\ufffd')
    # typed bytes that are not UTF-8 too: Python hands them to main as sys.argv does, surrogate-escaped
    ec.main(['--mode=sample', out, os.fsdecode(b'--start=c\xfe')])
    assert capsys.readouterr().out.startswith('c\ufffd')
    typed = byte_model / 'typed'   # the trainer too, a process typed bytes: its lock file names the command as typed
    result = cli(*TINY, f'--dataset={byte_model / "raw.bin"}', f'--data_dir={data_dir}', f'--out_dir={typed}',
                 '--max_iters=1', b'--start=c\xfe')
    assert result.returncode == 0 and b'--start=c\xfe' in (typed / 'train.lock').read_bytes(), result.stderr[-2000:]
    config = byte_model / 'surrogate.py'
    config.write_text('start = "\\ud800"\n')   # a str that has no bytes
    assert 'the prompt cannot be written as bytes' in fails('--mode=sample', out, config, main=ec.main)
    assert "outside the model's 6-symbol vocabulary: b'\\x80'" in fails('--mode=sample', out, '--start=a\udc80', main=ec.main)
    # with no prompt given, an empty --start stands for a newline or a space, which this corpus lacks
    assert 'the dataset has neither a newline nor a space' in fails(*TINY, f'--dataset={byte_model / "raw.bin"}',
                                                                    f'--data_dir={data_dir}', f'--out_dir={byte_model / "never"}')
    assert not os.path.exists(byte_model / 'never')   # out_dir is made (and locked) once the input is checked


# ---------------------------------------------------------------------------------------------
# damcha_numpy.py

def test_damcha_numpy_checks_before_training_and_stops_on_a_non_finite_loss(tmp_path):
    tiny = ['--n_layer=1', '--block_size=8', '--iters=20', '--eval_every=10', '--warmup=1']
    result = cli('--start=', *tiny, script='damcha_numpy.py')
    assert result.returncode == 1 and 'iter' not in result.stdout, result.stdout   # before any training
    assert result.stderr.strip() == 'error: --start is empty: the sample after training needs at least one character to follow'
    result = cli('--lr=1e30', *tiny, script='damcha_numpy.py')
    assert result.returncode == 1 and result.stderr.strip() == \
        'error: the training loss became nan at iter 1; stopped; try a lower --lr', result.stderr[-2000:]
    main = damcha_numpy.main
    for lr in ('nan', '-1', '0', 'inf'):
        assert fails(f'--lr={lr}', main=main).startswith('error: lr')
    assert 'seed must be a whole number' in fails('--seed=-1', main=main)
    empty = tmp_path / 'empty.txt'
    empty.write_bytes(b'')
    assert fails(f'--data={empty}', main=main) == f'error: --data={empty}: the file is empty'
    if os.path.exists('/proc/self/mem'):   # a file that exists but fails to read (EIO)
        assert fails('--data=/proc/self/mem', main=main).startswith('error: --data=/proc/self/mem: cannot read it')
    assert fails('--start=ROMEO: hello', '--block_size=8', main=main) == \
        "error: --start is 12 bytes, longer than the model's block_size of 8: it would not see the beginning"
    result = cli('--start=ROMEO:', '--block_size=6', '--n_layer=1', '--iters=1', '--eval_every=1', '--warmup=1',
                 script='damcha_numpy.py')   # as long as the context: taken
    assert result.returncode == 0, result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Messages about checkpoints

def test_checkpoints_damaged_inside_are_refused_before_they_are_used(tmp_path, data_dir):
    """A checkpoint that loads but holds a wrong-typed or negative count, a non-finite weight or optimizer
    moment (bytes overwritten inside a tensor), a weight too few or too many, a vocabulary that is
    not byte values or longer than the embedding, a wrong-typed saved setting or one of the right
    type that no flag may have (batch_size=0), is one line at resume, and never changed."""
    good = tmp_path / 'good'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={good}', '--eval_interval=4', '--max_iters=4'])
    ckpt = torch.load(good / 'ckpt.pt', weights_only=True)
    weight = ckpt['model']['wte.weight'].clone()
    weight[3, 5] = float('nan')                  # one entry
    damaged = {'iter_num': dict(ckpt, iter_num=-4), 'tokens': dict(ckpt, tokens=True),
               'best_val_loss': dict(ckpt, best_val_loss='x'), 'elapsed': dict(ckpt, elapsed=-1.0), 'weight': dict(ckpt, model=dict(ckpt['model'], **{'wte.weight': weight}))}
    moments = {k: dict(s) for k, s in ckpt['optimizer']['state'].items()}
    moments[0]['exp_avg_sq'] = moments[0]['exp_avg_sq'] * float('inf')
    damaged['moment'] = dict(ckpt, optimizer=dict(ckpt['optimizer'], state=moments))
    damaged['missing'] = dict(ckpt, model={k: v for k, v in ckpt['model'].items() if k != 'ln_f.weight'})
    damaged['extra'] = dict(ckpt, model=dict(ckpt['model'], extra=torch.zeros(1)))
    vocab = ckpt['vocab']
    for k, bad in enumerate([bytes(vocab).decode('latin-1'), [], vocab[:-1] + vocab[:1], vocab[:-1] + [256],
                             vocab[:-1] + [-1], vocab[:-1] + ['z']]):   # a string, none, a repeat, not bytes
        damaged[f'vocab{k}'] = dict(ckpt, vocab=bad)
    damaged['setting'] = dict(ckpt, config=dict(ckpt['config'], learning_rate='x'))
    damaged['setting_bool'] = dict(ckpt, config=dict(ckpt['config'], warmup_iters=True))
    damaged['setting_model'] = dict(ckpt, model_args=dict(ckpt['model_args'], n_layer='2'))
    ranges = dict(range_batch=('batch_size', 0, 'batch_size must be positive, not 0'),
                  range_eval=('eval_interval', 0, 'eval_interval must be positive, not 0'),
                  range_beta=('beta1', 1.5, 'beta1=1.5 must be at least 0 and below 1'),
                  range_seed=('seed', -1, 'seed=-1 must be a whole number'))
    for name, (key, value, _) in ranges.items():   # the right type, a value no flag may have
        damaged[name] = dict(ckpt, config=dict(ckpt['config'], **{key: value}))
    unused = next(b for b in range(256) if b not in vocab)
    damaged['vocab_longer'] = dict(ckpt, vocab=vocab + [unused])   # more symbols than the embedding has rows
    for name, bad in damaged.items():
        (tmp_path / name).mkdir()
        torch.save(bad, tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        message = fails('--init_from=resume', f'--out_dir={tmp_path / name}', f'--data_dir={data_dir}', '--max_iters=8')
        if name in ('missing', 'extra'):
            assert "the checkpoint's weights do not fit the model" in message, message
        elif name in ranges:
            assert f'is damaged: a setting it saved fails its check ({ranges[name][2]}' in message, message
        elif name == 'vocab_longer':
            assert f"its vocab has {len(vocab) + 1} symbols, more than the model's vocab_size={len(vocab)}" in message
        elif name.startswith('vocab'):
            assert 'is damaged: vocab should be a list of distinct byte values' in message, message
        elif name.startswith('setting'):
            setting = dict(setting='learning_rate', setting_bool='warmup_iters', setting_model='n_layer')[name]
            assert f'is damaged: its saved settings {setting} are not' in message, message
        else:
            assert 'is damaged: ' + ('it holds weights or optimizer state that are not finite' if name in ('weight', 'moment')
                                     else f'{name} should be numbers of at least 0') in message, message
        assert digest(tmp_path / name / 'ckpt.pt') == before
    message = fails('--mode=eval', f"--out_dir={tmp_path / 'range_batch'}", main=ec.main)   # eval_char checks alike
    assert 'is damaged: a setting it saved fails its check (batch_size must be positive, not 0)' in message


def test_a_damaged_random_state_is_one_line_at_resume(tmp_path, data_dir):
    """The batch generator's and torch's saved states are only read when the optimizer is restored,
    after the checks above: whatever is wrong with them (not a dict, a tensor cut short, a per-process
    entry of the wrong shape) is the same one line, and the checkpoint is left as it was."""
    good = tmp_path / 'good'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={good}', '--eval_interval=4', '--max_iters=4'])
    ckpt = torch.load(good / 'ckpt.pt', weights_only=True)
    rng = ckpt['rng']
    damaged = dict(not_a_dict=5, short=dict(rng, batches=rng['batches'][:10]),
                   float_state=dict(rng, batches=rng['batches'].float()), triple=dict(rng, torch=[(1, 2, 3)]),
                   no_list=dict(rng, torch=None))
    for name, bad in damaged.items():
        (tmp_path / name).mkdir()
        torch.save(dict(ckpt, rng=bad), tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        message = fails('--init_from=resume', f'--out_dir={tmp_path / name}', f'--data_dir={data_dir}', '--max_iters=8')
        assert "the checkpoint's optimizer or RNG state does not fit this run" in message, (name, message)
        assert digest(tmp_path / name / 'ckpt.pt') == before


def test_a_resume_in_a_copy_of_a_run_leaves_the_original_alone(tmp_path, data_dir, monkeypatch, capsys):
    """The checkpoint remembers its out_dir, mode and init_from, but they are never taken from it:
    a copied run resumed in the default out_dir carries on there, and eval_char.py without --mode evaluates."""
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "a"}', '--eval_interval=4', '--max_iters=4'])
    shutil.copytree(tmp_path / 'a', tmp_path / 'out-shakespeare')
    before = digest(tmp_path / 'a' / 'ckpt.pt')
    monkeypatch.chdir(tmp_path)
    tc.main(['--init_from=resume', '--max_iters=8'])
    assert digest(tmp_path / 'a' / 'ckpt.pt') == before
    assert torch.load(tmp_path / 'out-shakespeare' / 'ckpt.pt', weights_only=True)['iter_num'] == 8
    capsys.readouterr()
    ec.main([])
    assert json.loads(capsys.readouterr().out)['iter'] == 8


def test_damaged_checkpoints_get_one_line_that_recommends_nothing_unsafe(tmp_path):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'empty' / 'ckpt.pt').write_bytes(b'')
    (tmp_path / 'random').mkdir()
    (tmp_path / 'random' / 'ckpt.pt').write_bytes(bytes(range(256)) * 8)
    assert 'ckpt.pt is empty (0 bytes), not a checkpoint' in fails('--mode=sample', f'--out_dir={tmp_path / "empty"}', main=ec.main)
    last = fails('--mode=sample', f'--out_dir={tmp_path / "random"}', main=ec.main)
    assert 'is not a readable checkpoint' in last and 'weights_only' not in last and 'UnpicklingError' in last, last
    assert 'weights_only' not in json.dumps(fails('--init_from=resume', f'--out_dir={tmp_path / "random"}'))
    (tmp_path / 'pickle').mkdir()   # a plain pickle (protocol 4), which torch.load warns about before refusing
    (tmp_path / 'pickle' / 'ckpt.pt').write_bytes(pickle.dumps({'model': print}, protocol=4))
    result = cli('--mode=sample', f'--out_dir={tmp_path / "pickle"}', script='eval_char.py')   # the process: the warning too
    one_line_error(result, 'is not a readable checkpoint')
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (tmp_path / 'code').mkdir()   # torch.save'd, holding a function: torch advises allowing it, we do not
    torch.save({'model': print}, tmp_path / 'code' / 'ckpt.pt')
    last = fails('--mode=sample', f'--out_dir={tmp_path / "code"}', main=ec.main)
    assert 'is not a readable checkpoint' in last and 'Unsupported global' in last and 'safe_globals' not in last and 'weights_only' not in last, last
