"""
A run's folder, run_folder.RunFolder: a kill and a resume neither repeat nor lose a log line, a
torn last line is dropped, a second run is refused while the first holds the lock, a new run never
replaces another's logs, saves are atomic (a full disk, the file size limit, Ctrl-C inside a save),
and only the project's own temporary files are ever removed; no file is written through a
symbolic link (train.lock, a log, ckpt.pt; another user's link too), and a FIFO as train.lock is
refused.

    python -m pytest -q tests/test_run_folder.py

The runs that are the point of a test are processes (real SIGKILL, SIGINT, a full tmpfs mounted
when the tests run as root); the others run in-process.
"""
import glob
import json
import os
import pathlib
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import data.prepare as prep
import train_char as tc
from run_folder import PARTIAL, RunFolder, atomic_write, read_jsonl
from common import ENV, NO_PID, ROOT, TINY, cli, copy_of, digest, fails, iters, one_line_error, start, wait_for


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


def test_only_the_projects_own_temporary_files_are_removed_from_an_out_dir(checkpointed, tmp_path):
    """A run takes its out_dir and removes what a run killed mid-save left there (its own partial
    files, here of the older name <file>.damcha-partial-<pid>.tmp), never a user's file that merely
    looks temporary."""
    out = copy_of(checkpointed, tmp_path)
    users = ['notes.2024.tmp', 'backup.1.tmp', 'ckpt.pt.123.tmp', 'x.damcha-partial-1.tmp.bak']
    for name in users:
        (out / name).write_text('mine')
    (out / f'ckpt.pt.damcha-partial-{NO_PID}.tmp').write_bytes(b'half a checkpoint')
    tc.main([f'--out_dir={out}', '--init_from=resume', '--max_iters=9'])
    assert all((out / name).read_text() == 'mine' for name in users)
    assert not (out / f'ckpt.pt.damcha-partial-{NO_PID}.tmp').exists()


def test_a_new_run_never_replaces_the_logs_of_another(checkpointed, tmp_path, data_dir):
    """An out_dir that holds logs or snapshots but no checkpoint (moved away, or a link to a
    missing file) is refused by a new run, saying what is there and where to start afresh instead,
    never to delete anything; the files stay as they were. Empty logs hold no history and are
    taken."""
    out = copy_of(checkpointed, tmp_path)
    os.remove(out / 'ckpt.pt')
    before = {n: (out / n).read_bytes() for n in ('log.jsonl', 'train_log.jsonl')}
    last = fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')
    assert last.endswith(f'{out} holds log.jsonl and train_log.jsonl of an earlier run but no ckpt.pt: it cannot be '
                         f'resumed; to start afresh, choose another --out_dir, or move {out} aside first'), last
    (out / 'ckpt.pt').symlink_to(tmp_path / 'gone.pt')
    assert 'no ckpt.pt (a link to a missing file)' in fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')
    assert {n: (out / n).read_bytes() for n in before} == before and 'delete' not in last
    snapshots = tmp_path / 'snapshots'   # another run's weights alone
    snapshots.mkdir()
    for it in (20, 100, 5, 0, 1000):
        (snapshots / f'snapshot-{it}.pt').write_bytes(b'weights')
    assert (f'{snapshots} holds snapshot-0.pt, snapshot-5.pt, snapshot-20.pt and 2 more of an earlier run but no '
            'ckpt.pt: it cannot be resumed') in fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={snapshots}')
    for it in (0, 5, 100, 1000):
        os.remove(snapshots / f'snapshot-{it}.pt')
    assert f'{snapshots} holds snapshot-20.pt of an earlier run' in fails(*TINY, f'--out_dir={snapshots}')
    assert (snapshots / 'snapshot-20.pt').read_bytes() == b'weights'
    empty = tmp_path / 'empty'
    empty.mkdir()
    (empty / 'log.jsonl').write_text('')
    (empty / 'train_log.jsonl').write_text('')
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={empty}', '--max_iters=2'])


def test_a_fresh_start_over_a_checkpoint_prints_the_command_that_resumes_it(checkpointed, tmp_path, data_dir):
    """Refused over a checkpoint, a new run prints the command to copy that continues it (the
    arguments given, with --init_from=resume and the out_dir), which resumes; a ckpt.pt that is a
    directory or an empty file is named as such, with no advice to resume what cannot be."""
    out = copy_of(checkpointed, tmp_path)
    last = fails(*TINY, f'--data_dir={data_dir}', '--init_from=scratch', f'--out_dir={out}', '--max_iters=9')
    assert last.startswith(f'error: {out}/ckpt.pt exists: continue it with --init_from=resume: python '), last
    assert last.endswith(f'; or, to start afresh, choose another --out_dir, or move {out} aside first'), last
    command = shlex.split(last.split(': ', 3)[3].split('; or, ')[0])
    assert command[2:] == [*TINY, f'--data_dir={data_dir}', '--max_iters=9', '--init_from=resume',
                           f'--out_dir={out}'], last   # in this process, the script is pytest's
    tc.main(command[2:])
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 9
    for kind, make in (('a directory', os.mkdir), ('an empty file', lambda p: open(p, 'w').close())):
        odd = tmp_path / kind.split()[-1]
        odd.mkdir()
        make(odd / 'ckpt.pt')
        last = fails(*TINY, f'--out_dir={odd}')
        assert last.endswith(f'{odd}/ckpt.pt is {kind}, not a checkpoint, and a new run would replace it; to start '
                             f'afresh, choose another --out_dir, or move {odd} aside first'), last
        assert 'resume' not in last


def signal_at(monkeypatch, signals):
    """signals: {iteration: signal}, each sent to this process at the start of that iteration, as
    a real signal lands (get_lr is called once an iteration, before its step), and once only."""
    get_lr = tc.get_lr

    def lr_then_signal(*args):
        if args[0] in signals:
            os.kill(os.getpid(), signals.pop(args[0]))
        return get_lr(*args)
    monkeypatch.setattr(tc, 'get_lr', lr_then_signal)


def same_history(out, whole):
    """The run in out ended with the history of the run in whole: train_log.jsonl line for line,
    log.jsonl but for its timings, and bit-identical final weights."""
    assert read_jsonl(out / 'train_log.jsonl') == read_jsonl(whole / 'train_log.jsonl')
    untimed = [[{k: v for k, v in e.items() if k not in ('time', 'tokens_per_sec')} for e in read_jsonl(d / 'log.jsonl')]
               for d in (out, whole)]
    assert untimed[0] == untimed[1]
    ckpts = [torch.load(d / 'ckpt.pt', weights_only=True) for d in (out, whole)]
    assert ckpts[0]['iter_num'] == ckpts[1]['iter_num']
    assert ckpts[0]['model'].keys() == ckpts[1]['model'].keys()
    assert all(torch.equal(ckpts[0]['model'][k], ckpts[1]['model'][k]) for k in ckpts[1]['model'])


def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_that_resumes_exactly(tmp_path, data_dir, monkeypatch,
                                                                                   capsys):
    """SIGTERM at iteration 3, before the first checkpoint, and SIGHUP at 10, an evaluation's
    iteration, stop the run there, with the status of the signal and one line naming the
    checkpoint of that iteration (at 10 the periodic one) and the command that resumes; resumed
    twice, the run ends with the history of a run never stopped. With always_save_checkpoint=False,
    ckpt.pt keeps the best weights: a stop after it replaces them with nothing and says that a
    resume starts there, and the history is the same."""
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=5', '--max_iters=14']
    for keep_best in (False, True):
        flags = [*common, f'--always_save_checkpoint={not keep_best}']
        whole, out = tmp_path / f'whole-{keep_best}', tmp_path / f'stopped-{keep_best}'
        tc.main([*flags, f'--out_dir={whole}'])
        signal_at(monkeypatch, {3: signal.SIGTERM, 10: signal.SIGHUP})
        for at, sig, argv in ((3, signal.SIGTERM, flags), (10, signal.SIGHUP, ['--init_from=resume'])):
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                tc.main([*argv, f'--out_dir={out}'])
            last = capsys.readouterr().err.strip().splitlines()[-1]
            saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
            assert e.value.code == 128 + sig and last.startswith(
                f'interrupted at iter {at}: a resume starts from {out}/ckpt.pt at iter {saved}'), last
            assert last.endswith(f' --init_from=resume --out_dir={out}'), last
            assert saved == at or (keep_best and at == 10 and saved in (5, 10)), last
            best = ' (the best so far: always_save_checkpoint=False): python ' in last
            assert best == (saved != at), last
            assert max(iters(out / 'train_log.jsonl')) == at - 1   # the steps before the stop, logged
        tc.main(['--init_from=resume', f'--out_dir={out}'])
        same_history(out, whole)


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


def test_ctrl_c_before_the_first_checkpoint_then_sigterm_and_resumes_give_the_uninterrupted_history(tmp_path,
                                                                                                    data_dir):
    """Ctrl-C pressed twice, 10 ms apart, after the evaluation at 0 (the first checkpoint is due at
    20): the run stops at a step boundary with status 130 and one line, which holds the command
    that resumes; that command, stopped by SIGTERM past its checkpoint, says the same with status
    143; resumed to the end, the run has the very history of one never stopped: logs line for line
    (but their timings), weights bit for bit."""
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=20', '--lr_decay_iters=100']
    out, err = tmp_path / 'stopped', tmp_path / 'stderr'
    command = [sys.executable, 'train_char.py', *common, f'--out_dir={out}', '--max_iters=100000']
    stopped = []
    for sig, after in ((signal.SIGINT, 'eval 0:'), (signal.SIGTERM, 'iter ')):
        proc = start(*command[2:], stderr=err)
        wait_for(proc, after)
        proc.send_signal(sig)
        if sig == signal.SIGINT:
            time.sleep(0.01)
            proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig
        text = err.read_text()
        last = text.strip().splitlines()[-1]
        saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
        assert 'Traceback' not in text and text.count('interrupted') == 1, text[-2000:]
        assert last.startswith(f'interrupted at iter {saved}: a resume starts from {out}/ckpt.pt at iter {saved}: '
                               'python train_char.py '), last
        command = [sys.executable, *shlex.split(last.split(': ', 2)[2])[1:]]
        assert command[2:] == [*common, '--max_iters=100000', '--init_from=resume', f'--out_dir={out}'], last
        stopped.append(saved)
    assert stopped[0] < 20 and stopped[1] > stopped[0], stopped
    end = f'--max_iters={stopped[1] + 6}'
    tc.main([*command[2:], end])
    tc.main([*common, f'--out_dir={tmp_path / "whole"}', end])
    same_history(out, tmp_path / 'whole')


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


def test_a_second_run_is_refused_and_the_lock_dies_with_the_first(tmp_path, data_dir):
    out = tmp_path / 'out'
    first = start(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--eval_interval=5', '--max_iters=100000')
    try:
        wait_for(first, 'iter 10:')   # holds the lock, and a checkpoint at 5 exists
        first.send_signal(signal.SIGSTOP)   # stopped, it still holds the lock, and leaves the CPU to the second
        last = fails(f'--out_dir={out}', '--init_from=resume', '--max_iters=100001')
        assert f'{out} is in use by another training run (pid {first.pid}, started ' in last, last
        assert 'command: python train_char.py' in last and f'--out_dir={out}' in last
        fresh = fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}')   # named before its files
        assert f'{out} is in use by another training run (pid {first.pid}, started ' in fresh, fresh
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    (out / f'ckpt.pt.damcha-partial-{NO_PID}.tmp').write_bytes(b'half a checkpoint')   # as a kill mid-save leaves it
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    tc.main([f'--out_dir={out}', '--init_from=resume', f'--max_iters={saved + 1}'])   # the kernel freed the lock
    assert not glob.glob(str(out / '*.tmp'))


def test_temporary_files_are_per_process_unpredictable_and_removed_on_failure(tmp_path):
    """atomic_write's partial file carries this process's pid and a random part: two saves use two
    names, and a link planted at the name a pid alone would give (train.lock names the pid)
    receives nothing. A failure removes the partial file and keeps the old file; a link where the
    file belongs is refused and stays."""
    path, victim = tmp_path / 'ckpt.pt', tmp_path / 'victim.txt'
    victim.write_bytes(b'not a checkpoint')
    guessed = tmp_path / f'ckpt.pt.damcha-partial-{os.getpid()}.tmp'
    guessed.symlink_to(victim)
    names = []
    for content in (b'the first', b'the last good one'):
        with atomic_write(path) as f:
            f.write(content)
            names += [n for n in os.listdir(tmp_path) if re.fullmatch(PARTIAL, n) and n != guessed.name]
    assert len(set(names)) == 2 and all(n.startswith(f'{guessed.name[:-4]}-') for n in names), names
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(path) as f:
            f.write(b'half of a new one')
            raise KeyboardInterrupt
    link = tmp_path / 'snapshot-4.pt'
    link.symlink_to(victim)
    with pytest.raises(SystemExit, match=f'error: {link} is a symbolic link: refusing to write through it; remove it'):
        with atomic_write(link) as f:
            f.write(b'weights')
    assert path.read_bytes() == b'the last good one' and victim.read_bytes() == b'not a checkpoint'
    assert guessed.is_symlink() and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == sorted(['ckpt.pt', 'victim.txt', guessed.name, link.name])


def test_links_where_a_run_writes_are_refused_and_left_alone(checkpointed, tmp_path, data_dir):
    """A symbolic link as train.lock, as a log to resume or append to, as ckpt.pt: refused in one
    line naming it, before any training; the file it points to is unchanged and the link stays."""
    victim = tmp_path / 'thesis.txt'
    victim.write_text('years of work')
    fresh = tmp_path / 'fresh'
    fresh.mkdir()
    (fresh / 'train.lock').symlink_to(victim)
    assert f'{fresh}/train.lock is a symbolic link: refusing to write through it; remove it' in fails(
        *TINY, f'--data_dir={data_dir}', f'--out_dir={fresh}', '--max_iters=2')
    for name in ('log.jsonl', 'ckpt.pt'):
        out, real = copy_of(checkpointed, tmp_path, f'run-{name}'), tmp_path / f'real-{name}'
        os.replace(out / name, real)   # moved away, a link in its place: it reads as the file did
        (out / name).symlink_to(real)
        before = digest(real)
        assert f'{out}/{name} is a symbolic link: refusing to write through it' in fails(
            f'--out_dir={out}', '--init_from=resume', '--max_iters=9')
        assert (out / name).is_symlink() and digest(real) == before
    appended = RunFolder(str(fresh))
    os.remove(fresh / 'train.lock')
    (fresh / 'train_log.jsonl').symlink_to(victim)
    with pytest.raises(SystemExit, match='train_log.jsonl is a symbolic link'):
        appended.log('train_log.jsonl', [dict(iter=0, loss=1.0)])
    assert victim.read_text() == 'years of work' and (fresh / 'train_log.jsonl').is_symlink()


def test_a_link_another_user_plants_in_a_shared_folder_is_refused(tmp_path, data_dir):
    """In a folder every user may write to, another user (a spare uid) links train.lock to root's
    private file: root's run refuses the link, and the file is left whole."""
    if os.geteuid() != 0:
        pytest.skip('planting the link as another user needs root, to start a process under uid 65534')
    victim = tmp_path / 'thesis.txt'
    victim.write_text("root's own")
    victim.chmod(0o600)
    shared = pathlib.Path(tempfile.mkdtemp())   # under /tmp: tmp_path's parents are root's alone
    try:
        shared.chmod(0o777)
        subprocess.run(['ln', '-s', str(victim), str(shared / 'train.lock')], user=65534, check=True)
        assert os.lstat(shared / 'train.lock').st_uid == 65534
        one_line_error(cli(*TINY, f'--data_dir={data_dir}', f'--out_dir={shared}', '--max_iters=2'),
                       f'{shared}/train.lock is a symbolic link: refusing to write through it; remove it')
        assert victim.read_text() == "root's own" and (shared / 'train.lock').is_symlink()
    finally:
        shutil.rmtree(shared)


def test_a_fifo_as_train_lock_is_refused_without_hanging(tmp_path, data_dir):
    out = tmp_path / 'out'
    out.mkdir()
    os.mkfifo(out / 'train.lock')
    result = cli(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', timeout=60)
    one_line_error(result, f'{out}/train.lock is a FIFO (named pipe), not a file this run may write: remove it')


def test_an_out_dir_that_is_a_dangling_link_or_a_loop_is_named(tmp_path, data_dir):
    dangling, loop = tmp_path / 'dangling', tmp_path / 'loop'
    dangling.symlink_to(tmp_path / 'gone')
    loop.symlink_to(loop)
    assert (f'out_dir {dangling} is a symbolic link to {tmp_path / "gone"}, which does not exist (a dangling '
            'link)') in fails(*TINY, f'--data_dir={data_dir}', f'--out_dir={dangling}', '--max_iters=2')
    assert f'out_dir {loop} is a symbolic link in a loop' in fails(*TINY, f'--data_dir={data_dir}',
                                                                   f'--out_dir={loop}', '--max_iters=2')
    assert sorted(os.listdir(tmp_path)) == ['dangling', 'loop']


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
    assert e.value.code == 130 and last.startswith(f'interrupted at iter 10: a resume starts from {out}/ckpt.pt at iter 5: ')
    assert last.endswith(f' --init_from=resume --out_dir={out}'), last
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 5
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'log.jsonl', 'train.lock', 'train_log.jsonl']


def test_hard_links_fifos_and_folders_where_a_run_writes_are_named_and_left_alone(checkpointed, tmp_path, data_dir):
    """A hard link to another file as train.lock or as a log to resume (a write would change that
    file too), a FIFO as ckpt.pt or as out_dir: each refused in one line naming what it is, before
    any training, nothing hanging; the other file is unchanged."""
    victim = tmp_path / 'thesis.txt'
    victim.write_text('years of work')
    fresh = tmp_path / 'fresh'
    fresh.mkdir()
    os.link(victim, fresh / 'train.lock')
    assert f'{fresh}/train.lock has 1 other hard link(s): a write here would change the file' in fails(
        *TINY, f'--data_dir={data_dir}', f'--out_dir={fresh}', '--max_iters=2')
    out = copy_of(checkpointed, tmp_path, 'linked-log')
    os.replace(out / 'log.jsonl', victim)
    os.link(victim, out / 'log.jsonl')
    before = digest(victim)
    assert f'{out}/log.jsonl has 1 other hard link(s)' in fails(f'--out_dir={out}', '--init_from=resume',
                                                                 '--max_iters=9')
    assert digest(victim) == before
    fifo = tmp_path / 'fifo'
    fifo.mkdir()
    os.mkfifo(fifo / 'ckpt.pt')
    one_line_error(cli(*TINY, f'--out_dir={fifo}', timeout=60),
                   f'{fifo}/ckpt.pt is a FIFO (named pipe), not a checkpoint, and a new run would replace it')
    assert f'{fifo}/ckpt.pt is a FIFO (named pipe), not a ' in fails(f'--out_dir={fifo}', '--init_from=resume')
    os.mkfifo(tmp_path / 'pipe')
    assert f'out_dir {tmp_path / "pipe"} is a FIFO (named pipe), not a folder' in fails(
        *TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "pipe"}')


def test_a_resume_says_what_it_cuts_from_the_logs(checkpointed, tmp_path, capsys):
    """The lines of the logs after the checkpoint's iteration (the part a kill cut short, or a run
    past an older checkpoint put back) are dropped with a note saying how many, not in silence."""
    out = copy_of(checkpointed, tmp_path)
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    with open(out / 'log.jsonl', 'a') as f:
        f.write(json.dumps(dict(iter=saved + 5, val_loss=1.0)) + '\n')
    capsys.readouterr()
    tc.main([f'--out_dir={out}', '--init_from=resume', f'--max_iters={saved + 1}'])
    assert f"note: {out}/log.jsonl: 1 line(s) after the checkpoint's iter {saved} dropped" in capsys.readouterr().err
