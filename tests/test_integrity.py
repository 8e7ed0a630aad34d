"""
Tests of issue 31: damaged data is never used in silence, no history is replaced, every fault gets
one line. Each class of fault is tried through the command line, as a user (or a hostile
environment) would: two same-named files prepared at once, a user's files in an out_dir, prepared
splits and checkpoints damaged on disk, logs without their checkpoint, sizes that cannot fit, a
damaged optimizer state, SIGTERM and SIGHUP, an output encoding without the sample's characters,
the file-size limit, and input that is not what it claims to be. The scripts run as processes
where the process is the point (its exit status, a traceback on its stderr, a signal, a limit);
elsewhere their main(argv) runs in this process, checked alike (fails: one 'error: ' line, no
traceback), without a torch import per case.

    python -m pytest -q tests/test_integrity.py

The models are train_char.py's tiny test model (one layer, 32 wide); docs/reliability.md names
each test beside its promise.
"""
import io
import json
import os
import pathlib
import resource
import shutil
import signal
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import data.prepare as prep
import eval_char as ec
import train_char as tc
from data import dataset
from run_folder import RunFolder, read_jsonl
from common import digest, lab_runs_in_process
from lab import reproduce, synthetic
from test_reliability import ENV, ROOT, TINY, cli, fails, one_line_error, wait_for
from test_train import make_corpora


def text_file(path, seed, size=200_000):
    """A text file of random lowercase words, different for each seed."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.choice(list(b'abcdefghij '), size).astype(np.uint8).tobytes())
    return path


@pytest.fixture(scope='module')
def run(tmp_path_factory, data_dir):
    """A tiny run of 8 iterations on the bundled corpus, checkpointed at 8: copied by the tests
    that damage it."""
    out = tmp_path_factory.mktemp('run') / 'out'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=8', '--eval_interval=4'])
    return out


def copy_of(run, tmp_path, name='copy'):
    shutil.copytree(run, tmp_path / name)
    return tmp_path / name


# ---------------------------------------------------------------------------------------------
# Prepared data: each file its own folder, preparations take turns, damage is found and repaired

def test_two_files_of_one_name_prepared_at_once_keep_their_own_data(tmp_path, capsys):
    """x/notes.txt and y/notes.txt, prepared at the same time into one data_dir, each go into a
    folder of their own, named after the file and printed; and two preparations of one file at
    once take turns (an flock), both ending with the folder whole."""
    data = tmp_path / 'data'
    files = [text_file(tmp_path / d / 'notes.txt', seed) for seed, d in enumerate('xyx')]
    procs = [subprocess.Popen([sys.executable, 'data/prepare.py', str(f), f'--data_dir={data}'], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    folders = [out.split(':')[1].strip() for out, _ in outputs]   # "notes.txt: <folder>: train ..."
    assert folders[0] == folders[2] != folders[1] and sorted(os.listdir(data)) == sorted(map(os.path.basename, folders[:2]))
    for f, folder in zip(files, folders):
        meta = json.loads((pathlib.Path(folder) / 'meta.json').read_text())
        ids = np.concatenate([np.fromfile(pathlib.Path(folder) / f'{s}.bin', dtype=np.uint8) for s in meta['splits']])
        assert meta['source'] == str(f) and bytes(np.array(meta['vocab'], dtype=np.uint8)[ids]) == f.read_bytes()
    text_file(files[1], seed=7)   # the file changed: its folder no longer matches it, and is prepared again
    capsys.readouterr()
    prep.main([str(files[1]), f'--data_dir={data}'])
    assert f'prepared {folders[1]}' in capsys.readouterr().err


def test_only_the_projects_own_temporary_files_are_removed_from_an_out_dir(run, tmp_path):
    """A run takes its out_dir and removes what a run killed mid-save left there (its own partial
    files, named <file>.damcha-partial-<pid>.tmp), never a user's file that merely looks temporary."""
    out = copy_of(run, tmp_path)
    users = ['notes.2024.tmp', 'backup.1.tmp', 'ckpt.pt.123.tmp', 'x.damcha-partial-1.tmp.bak']
    for name in users:
        (out / name).write_text('mine')
    (out / 'ckpt.pt.damcha-partial-99999.tmp').write_bytes(b'half a checkpoint')
    tc.main([f'--out_dir={out}', '--init_from=resume', '--max_iters=9'])
    assert all((out / name).read_text() == 'mine' for name in users)
    assert not (out / 'ckpt.pt.damcha-partial-99999.tmp').exists()


def test_a_damaged_split_is_noted_and_prepared_again_never_used(run, tmp_path, data_dir, monkeypatch, capsys):
    """A split overwritten with valid ids of the same size, or with ids past the vocabulary (0xFF),
    even with meta.json's digest made to match: the run notes it and prepares it again from its
    source, and scores what it scored before. Where the source is gone (an archive deleted,
    no network), one line."""
    out = copy_of(run, tmp_path)

    def main(script, *argv):   # what it printed: (stdout, stderr)
        capsys.readouterr()
        script.main([f'--out_dir={out}', *argv])
        return capsys.readouterr()
    good = main(ec, '--batch_size=1024')
    assert 'SHA-256' not in good.err, good.err[-2000:]
    folder = pathlib.Path(data_dir) / 'shakespeare'
    val = np.fromfile(folder / 'val.bin', dtype=np.uint8)
    np.random.default_rng(0).permutation(val).tofile(folder / 'val.bin')   # valid ids, the same size
    again = main(ec, '--batch_size=1024')
    assert json.loads(again.out) == json.loads(good.out), again.err[-2000:]
    assert f'note: {folder}: val.bin does not match its SHA-256 in meta.json' in again.err
    assert np.array_equal(np.fromfile(folder / 'val.bin', dtype=np.uint8), val)

    train = np.fromfile(folder / 'train.bin', dtype=np.uint8)
    train[100:200] = 0xFF   # past the 80-symbol vocabulary: an IndexError in the embedding, once
    train.tofile(folder / 'train.bin')
    result = main(tc, '--init_from=resume', '--max_iters=9')
    assert 'train.bin does not match its SHA-256' in result.err, result.err[-2000:]
    train[100:200] = 0xFF
    train.tofile(folder / 'train.bin')
    meta = json.loads((folder / 'meta.json').read_text())
    meta['sha256']['train'] = prep.hashlib.sha256(train).hexdigest()   # a digest that matches the damage
    (folder / 'meta.json').write_text(json.dumps(meta))
    result = main(tc, '--init_from=resume', '--max_iters=10')
    assert 'train.bin holds token id 255, past its 80-symbol vocabulary' in result.err, result.err[-2000:]
    assert np.fromfile(folder / 'train.bin', dtype=np.uint8).max() < 80

    make_corpora(str(tmp_path / 'data'), monkeypatch, as_prepared=True)   # enwik8.zip in place, no network
    prep.prepare('enwik8', str(tmp_path / 'data'))
    os.remove(tmp_path / 'data' / 'enwik8' / 'enwik8.zip')
    (tmp_path / 'data' / 'enwik8' / 'test.bin').write_bytes(b'\0' * 200)
    with pytest.raises(SystemExit, match='could not download http://127.0.0.1:9/unreachable.zip'):
        dataset.load_dataset('enwik8', str(tmp_path / 'data'))


def flip(path, entry_size, value=None):
    """Overwrite, in place, the stored entry of `entry_size` bytes of a checkpoint's zip archive:
    every float set to `value`, or, without one, a single bit of its first byte."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.file_size == entry_size)
    with open(path, 'r+b') as f:
        f.seek(info.header_offset + 26)
        name, extra = struct.unpack('<HH', f.read(4))
        f.seek(info.header_offset + 30 + name + extra)
        data = struct.pack('<f', value) * (entry_size // 4) if value is not None else bytes([f.read(1)[0] ^ 1])
        f.seek(info.header_offset + 30 + name + extra)
        f.write(data)


def test_a_damaged_checkpoint_is_refused_and_left_as_it_is(run, tmp_path):
    """A checkpoint changed on disk after it was saved (its embedding's floats forged to 3e4, which
    are finite; one flipped bit) fails its archive's CRC-32: sampling, evaluating and resuming each
    refuse it in one line, and nothing overwrites it."""
    wte = torch.load(run / 'ckpt.pt', weights_only=True)['model']['wte.weight']
    for name, value in (('forged', 3e4), ('flipped', None)):
        out = copy_of(run, tmp_path, name)
        flip(out / 'ckpt.pt', wte.numel() * 4, value)
        before = digest(out / 'ckpt.pt')
        if value is not None:   # as a user meets it: the process's one line, its exit status
            one_line_error(cli('--mode=sample', f'--out_dir={out}', script='eval_char.py'),
                           f'{out}/ckpt.pt is damaged: its entry archive/data/0 fails its CRC-32 check')
        assert 'fails its CRC-32 check' in fails(f'--out_dir={out}', main=ec.main)
        assert 'fails its CRC-32 check' in fails(f'--out_dir={out}', '--init_from=resume', '--max_iters=12')
        assert 'ckpt.pt exists: continue it with --init_from=resume' in fails(*TINY, f'--out_dir={out}')
        assert digest(out / 'ckpt.pt') == before


def test_a_new_run_never_replaces_the_logs_of_another(run, tmp_path, data_dir, monkeypatch, capsys):
    """An out_dir that holds logs but no checkpoint (moved away, or a link to a missing file) is
    refused by a new run, saying what is there and what to do; the logs stay as they were. Empty
    logs hold no history and are taken. A run stopped before its first checkpoint says so."""
    out = copy_of(run, tmp_path)
    os.remove(out / 'ckpt.pt')
    before = {n: (out / n).read_bytes() for n in ('log.jsonl', 'train_log.jsonl')}
    last = fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')
    assert (f'{out} holds log.jsonl and train_log.jsonl of an earlier run but no ckpt.pt: '
            'it cannot be resumed; move the logs away, or choose another --out_dir') in last, last
    (out / 'ckpt.pt').symlink_to(tmp_path / 'gone.pt')
    assert 'no ckpt.pt (a link to a missing file)' in fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')
    assert {n: (out / n).read_bytes() for n in before} == before and 'error: ' in last
    empty = tmp_path / 'empty'
    empty.mkdir()
    (empty / 'log.jsonl').write_text('')
    (empty / 'train_log.jsonl').write_text('')
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={empty}', '--max_iters=2'])

    # a real SIGTERM, sent to this process at its 10th training iteration (test_sigterm_and_sighup_stop_a_run_as_ctrl_c_does
    # sends it to a train_char.py process), before the run's first checkpoint
    get_lr, steps = tc.get_lr, []

    def lr_then_sigterm(*args):   # called once an iteration, before its step
        steps.append(args[0])
        if len(steps) == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return get_lr(*args)
    monkeypatch.setattr(tc, 'get_lr', lr_then_sigterm)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "early"}', '--eval_interval=1000',
                 '--max_iters=100000'])
    stderr = capsys.readouterr().err
    assert e.value.code == 128 + signal.SIGTERM and 'Traceback' not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1].endswith(f'no checkpoint was written yet: to start again, move the logs '
                                                    f'out of {tmp_path / "early"}, or choose another --out_dir')


def limit_memory(size):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (size, size))


def test_sizes_that_cannot_fit_are_one_line(run, tmp_path, data_dir):
    """Sizes that cannot fit in memory are refused before anything is allocated (a batch, the
    samples after training, eval's windows, synthetic.py's dims); a batch that runs out of memory
    all the same (here under a 3 GB address-space limit, ulimit -v) is one line naming the
    settings to lower; a prompt file is read no further than the context (/dev/zero)."""
    out = f'--out_dir={tmp_path / "never"}'
    assert 'batch_size=3000000 asks for more than' in fails(*TINY, f'--data_dir={data_dir}', out, '--batch_size=3000000')
    assert 'num_samples=100000000 asks for more than' in fails(*TINY, f'--data_dir={data_dir}', out, '--num_samples=100000000')
    assert 'batch_size=100000000 asks for more than' in fails(f'--out_dir={run}', '--batch_size=100000000', main=ec.main)
    assert 'dims=100000 asks for more than' in fails('--dims=100000', f'--out={tmp_path / "syn"}', main=synthetic.main)
    assert "outside the model's 80-symbol vocabulary: '\\x00'" in fails('--mode=sample', f'--out_dir={run}',
                                                                         '--start=FILE:/dev/zero', main=ec.main)
    result = subprocess.run([sys.executable, 'train_char.py', *TINY, f'--data_dir={data_dir}', out, '--batch_size=100000',
                             '--max_iters=2'], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, 'out of memory (')
    assert 'lower batch_size (raise gradient_accumulation_steps)' in result.stderr


def test_a_damaged_optimizer_or_saved_number_is_called_damaged_not_divergence(run, tmp_path):
    """A negative Adam exp_avg_sq (which would make the loss nan, read as a diverged run), a moment
    of the wrong shape (a traceback at the first step), an infinite elapsed time: one line that
    says the checkpoint is damaged, exit status 1 (not the divergence's 3), the file untouched.
    A min_lr above learning_rate is refused; what eval_char.py writes is JSON without NaN."""
    ckpt = torch.load(run / 'ckpt.pt', weights_only=True)
    state = {k: dict(s) for k, s in ckpt['optimizer']['state'].items()}
    negative, shape = ({k: dict(s) for k, s in state.items()} for _ in range(2))
    negative[0]['exp_avg_sq'] = -negative[0]['exp_avg_sq'] - 1
    shape[0]['exp_avg'] = shape[0]['exp_avg'][:2]
    cases = dict(negative=(dict(ckpt, optimizer=dict(ckpt['optimizer'], state=negative)), 'negative exp_avg_sq'),
                 shape=(dict(ckpt, optimizer=dict(ckpt['optimizer'], state=shape)), 'its optimizer state has a moment'),
                 elapsed=(dict(ckpt, elapsed=float('inf')), 'elapsed should be numbers of at least 0, and finite'))
    for name, (bad, words) in cases.items():
        (tmp_path / name).mkdir()
        torch.save(bad, tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        args = f'--out_dir={tmp_path / name}', '--init_from=resume', '--max_iters=12'
        last = fails(*args)
        assert words in last and 'damaged' in last and digest(tmp_path / name / 'ckpt.pt') == before
    assert 'min_lr=1.0 is above learning_rate=0.001' in fails(*TINY, f'--out_dir={tmp_path / "never"}', '--min_lr=1.0',
                                                              '--learning_rate=1e-3')
    overflow = dict(ckpt['model'], **{'ln_f.weight': torch.full_like(ckpt['model']['ln_f.weight'], 3e38)})   # finite
    (tmp_path / 'overflow').mkdir()
    torch.save(dict(ckpt, model=overflow), tmp_path / 'overflow' / 'ckpt.pt')
    last = fails(f'--out_dir={tmp_path / "overflow"}', main=ec.main)
    assert 'the val loss of shakespeare is ' in last and last.endswith(": the model's outputs are not finite numbers"), last


def test_a_diverged_study_run_is_recorded_in_json_without_infinity(tmp_path, monkeypatch):
    """The LR sweep records a diverged run's val bpc, infinite, as null in its eval JSON (strict
    JSON), and reads it back as infinite (never the chosen rate). The run is a call in this process
    (tests/test_reproduce.py's test_only_a_diverged_run_is_recorded_as_diverged runs it as a process)."""
    lab_runs_in_process(monkeypatch)
    tiny = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, max_iters=20, eval_interval=10,
                eval_iters=1, device='cpu', data_dir=str(tmp_path / 'data'), gen_width=8, learning_rate=1e30)
    (tmp_path / 'results').mkdir()
    reproduce.train_and_evaluate('hot', str(tmp_path / 'hot'), (), tiny, 20, dict(snapshot='', device='cpu'),
                                 str(tmp_path / 'results'), 'a learning rate that diverges', may_diverge=True)
    text = (tmp_path / 'results' / 'hot.eval.json').read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f'{c} in JSON')) == dict(failed=True, val_bpc=None)
    assert reproduce.read_evals(str(tmp_path / 'results'))['hot']['val_bpc'] == float('inf')


def test_sigterm_and_sighup_stop_a_run_as_ctrl_c_does(tmp_path, data_dir):
    """SIGTERM and SIGHUP print the line Ctrl-C prints (where the run stopped, where a resume
    starts), with status 128 + the signal's number."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        out = tmp_path / sig.name
        proc = subprocess.Popen([sys.executable, 'train_char.py', *TINY, '--max_iters=100000', f'--data_dir={data_dir}',
                                 f'--out_dir={out}', '--eval_interval=5'], cwd=ROOT, env=ENV, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(proc, 'eval 10:')
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
        assert proc.returncode == 128 + sig and 'Traceback' not in stderr, stderr[-2000:]
        assert stderr.strip().splitlines()[-1].endswith(f'a resume (--init_from=resume) starts from {out}/ckpt.pt '
                                                        f'at iter {saved}'), stderr[-2000:]


@pytest.mark.slow
def test_sigterm_to_reproduce_stops_its_training_run_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    """kill -TERM on lab/reproduce.py alone: it passes the signal on to its train_char.py run, which
    stops as on Ctrl-C (saying where), and ends with status 143, leaving no run behind that holds
    the out_dir. Stopped before the run's first checkpoint, its logs hold nothing to resume: the
    same command drops them, with a note, and trains the run again to the end (here in this
    process, its runs too: lab_runs_in_process)."""
    # 2,000 iterations: an idle machine runs 100 of this model in 0.2 s, before the signal lands
    args = ['lab/reproduce.py', '--seeds=1', '--variants=mha', '--max_iters=2000', '--eval_interval=2000',
            '--log_interval=5', '--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4',
            '--max_new_tokens=5', '--device=cpu', f"--results={tmp_path / 'results'}", f"--out_root={tmp_path / 'out'}",
            f"--data_dir={tmp_path / 'data'}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_for(proc, 'iter 5:')   # the training run's line, on the stdout it shares
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and 'Traceback' not in stderr, stderr[-2000:]
    assert 'interrupted at iter ' in stderr and stderr.strip().endswith(
        'interrupted: finished runs are kept, and the same command resumes the rest'), stderr[-2000:]
    out = tmp_path / 'out' / 'mha-seed1'
    with RunFolder(str(out)) as folder:
        folder.lock()   # no training run is left holding it
    lab_runs_in_process(monkeypatch)
    capsys.readouterr()
    reproduce.main(args[1:])
    assert 'note: mha-seed1 was stopped before its first checkpoint' in capsys.readouterr().out
    assert [e['iter'] for e in read_jsonl(out / 'train_log.jsonl')] == list(range(2000))


def test_an_output_encoding_without_a_characters_never_fails_a_finished_run(tmp_path, data_dir, monkeypatch):
    """PYTHONIOENCODING=ascii: the sample after training, and eval_char.py's, print '?' for the
    characters ascii lacks; the run ends with status 0. The training run is a process; eval_char's
    main then runs here, with the stdout such a process has: a text stream to ascii."""
    corpus = tmp_path / 'fr.txt'
    corpus.write_text('café crème, éléphant à côté; ' * 200)
    env = dict(ENV, PYTHONIOENCODING='ascii')
    out = tmp_path / 'out'
    result = subprocess.run([sys.executable, 'train_char.py', *TINY, f'--dataset={corpus}', f'--data_dir={data_dir}',
                             f'--out_dir={out}', '--max_iters=2', '--start=é'], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and 'sample:\n?' in result.stdout, result.stderr[-2000:]
    ascii_stdout = io.TextIOWrapper(io.BytesIO(), encoding='ascii')   # as Python makes it for PYTHONIOENCODING=ascii
    monkeypatch.setattr(sys, 'stdout', ascii_stdout)
    ec.main(['--mode=sample', f'--out_dir={out}', '--start=é'])
    ascii_stdout.flush()
    assert ascii_stdout.buffer.getvalue().startswith(b'?')


def test_the_file_size_limit_is_named(tmp_path, data_dir):
    """A save past the file-size limit (ulimit -f) is one line that names the limit, not torch's
    'unexpected pos'; the partial file is removed."""
    out = tmp_path / 'out'
    prep.prepare('shakespeare', str(data_dir))   # its splits are larger than the limit
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))   # logs fit, a checkpoint does not
    result = subprocess.run([sys.executable, 'train_char.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out}',
                             '--max_iters=4', '--eval_interval=4'], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=120, preexec_fn=limit)
    last = one_line_error(result, f'could not save {out}/ckpt.pt: the file size limit (ulimit -f) was reached (File too large)')
    assert 'unexpected pos' not in last and sorted(os.listdir(out)) == ['log.jsonl', 'train.lock', 'train_log.jsonl']


def test_input_that_is_not_what_it_claims_is_named_in_one_line(tmp_path, data_dir):
    """A config file that exits, nan as a number, a FIFO or a directory as a dataset, a file that
    cannot be read: one 'error: ' line each, that says what the input is and why it cannot be used."""
    never = f'--out_dir={tmp_path / "never"}'
    (tmp_path / 'exits.py').write_text('raise SystemExit(0)\n')
    one_line_error(cli(str(tmp_path / 'exits.py'), never), 'exits.py: exits (SystemExit: 0) instead of setting values')
    one_line_error(cli(*TINY, '--dataset=/proc/self/mem', f'--data_dir={data_dir}', never),
                   'cannot read the dataset /proc/self/mem: Input/output error')
    assert 'learning_rate must be a finite number, not nan' in fails('--learning_rate=nan', never)
    assert 'temperature must be a finite number, not -inf' in fails('--temperature=-inf', never, main=ec.main)
    os.mkfifo(tmp_path / 'fifo')
    assert 'is a FIFO (named pipe), not a regular file' in fails(*TINY, f'--dataset={tmp_path / "fifo"}', never)
    assert 'is a directory, not a regular file' in fails(*TINY, f'--dataset={tmp_path}', never)
    assert not os.path.exists(tmp_path / 'never')
