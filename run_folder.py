"""
run_folder.py: a training run's folder, and everything a run does to it (RunFolder).

    out_dir/ckpt.pt          weights, optimizer, settings, vocabulary, RNG states
    out_dir/log.jsonl        one line per evaluation: the curves
    out_dir/train_log.jsonl  one line per iteration: the losses
    out_dir/snapshot-N.pt    float16 weights at iteration N, when snapshot_iters asks for them
    out_dir/train.lock       flock'ed for the run's lifetime; names the run that holds it

Every file is written whole or not at all (atomic_write): a kill or a full disk never costs the last
good checkpoint. A new run refuses a folder holding a checkpoint, logs or snapshots, printing the
command that resumes it; a resume cuts the logs back to its checkpoint; a stopped run says where a
resume starts, with that command. docs/reliability.md lists each promise and the test that holds
it.

No file is written through a symbolic link (open_own): a link where one belongs is refused, and
left as it is.
"""
import errno
import fcntl
import json
import math
import os
import re
import secrets
import shlex
import stat
import sys
import time
from contextlib import contextmanager

import torch

from shell import DIVERGED, die, exit_status, not_a_file, why

# atomic_write's partial files, <file>.damcha-partial-<pid>-<random>.tmp (older versions: without
# -<random>): the only files the project removes, and only a dead process's
PARTIAL = r'.+\.damcha-partial-(\d+)(?:-[0-9a-f]{8})?\.tmp'
SNAPSHOT = r'snapshot-\d+\.pt'
# what a run writes in its out_dir under these names: a link there is refused before the run starts
OWN_FILES = ('ckpt.pt', 'log.jsonl', 'train_log.jsonl')


class Diverged(Exception):
    """A non-finite loss (what, value, iteration): the run stops on every process without saving."""


class RunFolder:
    """out_dir as one training run uses it; only the master process (rank 0) writes to it. The
    lock is this object's, held from lock() until the process ends, unlock() or the end of a
    with-block. argv: the script's arguments, from which the command that resumes is built."""

    def __init__(self, out_dir, argv=()):
        self.dir = out_dir
        self.argv = list(argv)
        self.ckpt_path = os.path.join(out_dir, 'ckpt.pt')
        self.saved_iter = None   # the iteration of the ckpt.pt on disk, None while there is none
        self.lock_file = None

    def refuse_fresh_start(self):
        """A new run never replaces a checkpoint (it prints the command that continues it), nor
        the logs or snapshots of a run whose checkpoint is gone; nor does it delete anything: where
        to start afresh is the user's choice. A ckpt.pt that no resume could read is named as what
        it is."""
        self.refuse_if_in_use()
        empty = os.path.isfile(self.ckpt_path) and not os.path.getsize(self.ckpt_path)
        kind = 'an empty file' if empty else not_a_file(self.ckpt_path)
        if kind:
            die(f"{self.ckpt_path} is {kind}, not a checkpoint, and a new run would replace it; "
                f"{self.afresh()}")
        if os.path.exists(self.ckpt_path):
            die(f"{self.ckpt_path} exists: continue it with --init_from=resume: "
                f"{self.resume_command()}; or, {self.afresh()}")
        logs = [n for n in ('log.jsonl', 'train_log.jsonl') if os.path.isfile(self.path(n))
                and os.path.getsize(self.path(n))]
        snapshots = sorted((n for n in os.listdir(self.dir) if re.fullmatch(SNAPSHOT, n)),
                           key=lambda n: (len(n), n)) if os.path.isdir(self.dir) else []
        found = logs + snapshots
        if found:   # a resume is impossible, and a new run would replace them
            shown = found if len(found) <= 4 else found[:3] + [f'{len(found) - 3} more']
            die(f"{self.dir} holds {', '.join(shown[:-1])}{' and ' * (len(shown) > 1)}{shown[-1]} "
                f"of an earlier run but no ckpt.pt"
                f"{' (a link to a missing file)' * os.path.islink(self.ckpt_path)}: it cannot be "
                f"resumed; {self.afresh()}")

    def refuse_if_in_use(self):
        """A run that holds the folder now is named, rather than its files taken for an earlier
        run's: a look at train.lock's flock, taken and let go at once (nothing written)."""
        if self.lock_file is not None:   # this run's own
            return
        try:
            fd = os.open(self.path('train.lock'), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:   # none, or odd: lock() says what is wrong with it
            return
        with os.fdopen(fd, errors='surrogateescape') as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                self.busy(f)
            except OSError:   # not a regular file: lock() names it
                pass

    def busy(self, lock_file):
        """The line for a second run: the folder's holder, as train.lock names it."""
        holder = lock_file.read().strip() or 'a run that is just starting'
        lock_file.close()
        die(f"{self.dir} is in use by another training run ({holder}); wait for it to end, "
            "or choose another --out_dir")

    def afresh(self):
        """Where a new run can start instead, this folder kept as it is."""
        return f"to start afresh, choose another --out_dir, or move {self.dir} aside first"

    def resume_command(self):
        """The command to copy that continues the run in this folder: the script and its
        arguments as given, with --init_from=resume and this out_dir (as the run filled it in);
        under torchrun, on as many processes a node."""
        launcher = (['torchrun', f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
                    if 'LOCAL_WORLD_SIZE' in os.environ else ['python'])
        kept = [a for a in self.argv if not a.startswith(('--init_from=', '--out_dir='))]
        return shlex.join([*launcher, sys.argv[0], *kept, '--init_from=resume',
                           f'--out_dir={self.dir}'])

    def hold_for_resume(self):
        """A resume takes the folder before it reads the checkpoint, so that the checkpoint cannot
        change meanwhile (a folder that is not there holds none: the resume's own line says so)."""
        if os.path.isdir(self.dir):
            self.lock()

    def claim_for_a_new_run(self):
        """A new run takes the folder once its input is checked, so that no folder is made for a
        bad flag, and looks again for another run's files: one may have ended meanwhile."""
        self.lock()
        self.refuse_fresh_start()

    def lock(self):
        """Hold out_dir for this run: an exclusive flock on train.lock, which the kernel releases
        when the process ends in any way, SIGKILL included, so it never goes stale. The file names
        the holder, for the message to a second run. Partial files of a run killed mid-save
        (atomic_write) are removed (remove_partials)."""
        if self.lock_file is not None:
            return
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            die(f"out_dir {self.dir} is {not_a_file(self.dir) or 'a file'}, not a folder")
        make_folder(self.dir, 'out_dir')
        # surrogateescape: the command's bytes as typed, also those that are not UTF-8
        # (a prompt, a path)
        f = open_lock(self.path('train.lock'), errors='surrogateescape')
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.busy(f)
        f.truncate(0)
        f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                f"command: {shlex.join([os.path.basename(sys.executable), *sys.argv])}\n")
        f.flush()
        self.lock_file = f
        for name in OWN_FILES:   # refused now, not at the first save after minutes of training
            refuse_odd(self.path(name))
        remove_partials(self.dir)

    def unlock(self):
        """Let go of the lock (as the process's end would), for a run called in-process."""
        if self.lock_file is not None:
            self.lock_file.close()
            self.lock_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.unlock()

    def path(self, name):
        return os.path.join(self.dir, name)

    def start_logs(self, k, resumed):
        """Empty logs for a new run; a resumed run's logs cut at its checkpoint at iteration k:
        later lines belong to the part of the interrupted run that it is about to redo. A
        checkpoint at k is saved after the evaluation at k and before the step of k, which the
        resumed run takes again: log.jsonl keeps iter <= k and train_log.jsonl iter < k, so no
        line is repeated or lost."""
        for name, keep in (('log.jsonl', lambda it: it <= k),
                           ('train_log.jsonl', lambda it: it < k)):
            path = self.path(name)
            entries = read_jsonl(path) if resumed and os.path.isfile(path) else []
            if not all(isinstance(e.get('iter'), int) for e in entries):
                die(f"{path} has an entry without an iteration number: not a log of train_char.py")
            kept = [e for e in entries if keep(e['iter'])]
            if len(kept) < len(entries):   # the part redone, or a checkpoint older than the logs
                print(f"note: {path}: {len(entries) - len(kept)} line(s) after the checkpoint's "
                      f"iter {k} dropped, to be trained again", file=sys.stderr)
            write_text(path, ''.join(to_json(e) + '\n' for e in kept))

    def log(self, name, entries):
        """Append entries to the log `name` (log.jsonl, train_log.jsonl), a JSON object a line."""
        with os.fdopen(open_own(self.path(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT), 'a') as f:
            f.writelines(to_json(e) + '\n' for e in entries)

    def save_checkpoint(self, checkpoint):
        self.save(checkpoint, 'ckpt.pt')
        self.saved_iter = checkpoint['iter_num']

    def save_snapshot(self, model, saved, it):
        """The weights at iteration it in float16, with what a checkpoint records besides them
        (saved): for looking at, not for resuming."""
        weights = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
        self.save(dict(model=weights, **saved, iter_num=it), f'snapshot-{it}.pt')

    def save(self, obj, name):
        """torch.save into the folder through atomic_write; a failure ends the run with one line
        naming the last good checkpoint."""
        path = self.path(name)
        try:
            with atomic_write(path) as f:
                torch.save(obj, f)
        except Exception as e:
            # a Ctrl-C inside torch.save, which reports it as an error of its own, stops as
            # Ctrl-C does
            cause = e
            while cause is not None and not isinstance(cause, KeyboardInterrupt):
                cause = cause.__context__
            if cause is not None:
                raise cause from None
            die(f"could not save {path}: {why(e)}; the partial file was removed; "
                f"{self.last_good()}")

    def stopped(self, e, iter_num, best_only=False):
        """(exit status, one line) of a run that Ctrl-C, SIGTERM or SIGHUP (exit_status) or a
        non-finite loss (Diverged, DIVERGED) stopped at iter_num: where, what is on disk, and the
        command that resumes. best_only: ckpt.pt holds the best weights, not the latest
        (always_save_checkpoint=False)."""
        if isinstance(e, KeyboardInterrupt):
            best = (' (the best so far: always_save_checkpoint=False)'
                    if best_only and self.saved_iter != iter_num else '')
            return exit_status(e), f"interrupted at iter {iter_num}: " + (
                f"a resume starts from {self.ckpt_path} at iter {self.saved_iter}{best}: "
                f"{self.resume_command()}"
                if self.saved_iter is not None else
                f"no checkpoint was written yet; {self.afresh()}")
        what, value, it = e.args
        return DIVERGED, (f"error: the {what} loss became {value} at iter {it}; "
                          f"stopped without saving: {self.last_good()}; try a lower learning_rate")

    def last_good(self):
        return (f"{self.ckpt_path} (iter {self.saved_iter}) is the last good checkpoint"
                if self.saved_iter is not None else "no checkpoint was written yet")


@contextmanager
def atomic_write(path):
    """A binary file to write (and read back) that appears at `path` only once complete: written
    beside it (this process's own new file, named PARTIAL, its random part unknown to anyone who
    would plant a link there in advance), flushed to disk, renamed over it. A crash leaves the old
    file or none; any failure removes the partial file before passing on. A symbolic link at
    `path` is refused (refuse_link) rather than replaced: it is the user's, and a rename would
    drop it. Every save goes through here."""
    refuse_link(path)
    folder = os.path.dirname(path) or '.'
    if not os.path.isdir(folder):   # else the error would name the partial file
        raise FileNotFoundError(errno.ENOENT, f'no folder {folder} to write {path} in')
    tmp = f'{path}.damcha-partial-{os.getpid()}-{secrets.token_hex(4)}.tmp'
    f = os.fdopen(open_own(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL), 'w+b')
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text(path, text):
    """A text file written whole through atomic_write (summaries, results)."""
    with atomic_write(path) as f:
        f.write(text.encode())


def open_own(path, flags):
    """The descriptor of a file the project creates, truncates or appends to (os.open's flags),
    never opened through a symbolic link, nor a hard link: someone sharing the folder may have put
    one there so that this process overwrites a file of their choosing, another user's say. A FIFO,
    device or socket there is refused too, without blocking on it (O_NONBLOCK)."""
    try:
        # mode 0o666 & ~umask, as open() gives
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:   # O_NOFOLLOW's answer to a link
            refuse_link(path)
        if e.errno == errno.ENXIO:   # a FIFO opened to write, without a reader
            refuse_odd(path)
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        refuse_odd(path)
    return fd


def refuse_link(path):
    """A symbolic link where the project writes a file: one line naming it; it stays as it is."""
    if os.path.islink(path):
        die(f"{path} is a symbolic link: refusing to write through it; remove it")


def refuse_odd(path):
    """Anything but a regular file of one name where the project writes one (a link, a directory,
    a FIFO, a device or socket, a file with other hard links): one line naming it; it stays."""
    refuse_link(path)
    kind = not_a_file(path)
    if kind:
        die(f"{path} is {kind}, not a file this run may write: remove it")
    links = os.stat(path).st_nlink if os.path.exists(path) else 1
    if links > 1:
        die(f"{path} has {links - 1} other hard link(s): a write here would change the file they "
            "name too; refusing to write through it; remove it")


def open_lock(path, **kwargs):
    """A lock file (train.lock, the lab's claim.lock) to read and write, not truncated, for an
    flock; open_own refuses a link, a FIFO (without hanging on it), a device or socket."""
    return os.fdopen(open_own(path, os.O_RDWR | os.O_CREAT), 'r+', **kwargs)


def make_folder(path, what):
    """os.makedirs, naming what is wrong with a path that is a link to nothing or a link loop,
    of which makedirs says only 'File exists'."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        if not os.path.islink(path):
            raise
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                die(f"{what} {path} is a symbolic link in a loop (it leads back to itself): "
                    "remove it, or choose another folder")
        die(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist "
            "(a dangling link): create its target or remove the link")


def remove_partials(folder):
    """Remove the partial files (PARTIAL) that processes killed mid-write left in folder: a
    process that no longer exists writes them no more. A live process's stay (it may be writing
    one now: eval_char.py's plot beside a run, another preparation), as do links and anything but a
    regular file of that name."""
    for name in os.listdir(folder):
        match = re.fullmatch(PARTIAL, name)
        path = os.path.join(folder, name)
        if match and not alive(int(match[1])) and stat.S_ISREG(os.lstat(path).st_mode):
            os.remove(path)


def alive(pid):
    """Whether a process of this id exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):   # none, or no process id at all
        return False
    except PermissionError:
        pass
    return True


def read_jsonl(path):
    """The entries of a log, one JSON object a line. A last line that does not parse is what a kill
    or a full disk in the middle of an append leaves: it is dropped, and said on stderr. A bad line
    before the last is damage done by something else: a one-line error naming it."""
    try:
        with open(path, 'rb') as f:
            lines = [(n, line) for n, line in enumerate(f.read().split(b'\n'), 1) if line.strip()]
    except OSError as e:
        die(f"cannot read {path}: {e}")
    entries = []
    for n, line in lines:
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError(f"a JSON {type(entry).__name__}, not an object")
        except ValueError as e:   # UnicodeDecodeError is one too
            if n == lines[-1][0]:
                print(f"note: dropped the unreadable last line {n} of {path}, an interrupted "
                      f"write: {line[:60].decode(errors='replace')!r}", file=sys.stderr)
                break
            die(f"{path}, line {n} of {len(lines)}, is unreadable ({e}): only a last line is "
                "dropped (an interrupted write); repair or delete this one")
        entries.append(entry)
    return entries


def to_json(obj, **kwargs):
    """obj as JSON, a non-finite number as null: JSON has no NaN, which a strict reader would
    refuse."""
    def finite(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return {k: finite(v) for k, v in o.items()} if isinstance(o, dict) else o
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
