"""
shell.py: how every script meets the shell. Bad input ends a script with one line on stderr (die),
never a traceback; SIGTERM and SIGHUP stop it as Ctrl-C does; a closed pipe (`... | head`) is not
an error; an output encoding that lacks a character prints '?'; each way of ending has the exit
status a shell expects (exit_status, DIVERGED). A script wraps its main in one_line_errors and
signals_as_ctrl_c, and calls die. Memory that runs out is one line naming what needed it: the
settings of the model (one_line_errors), the data being prepared (memory_for), or, before any
handler, the libraries being loaded under a memory limit (last_resort, the excepthook that importing
this module sets: a script imports it before torch). Torch-free, so that it can be imported first.
"""
import errno
import io
import os
import resource
import signal
import stat
import sys
from contextlib import contextmanager
from traceback import walk_tb

# train_char.py's exit status when a non-finite loss stopped the run (lab/reproduce.py reads it)
DIVERGED = 3


def die(message):
    """Bad input ends here: one line on stderr, exit status 1, no traceback."""
    raise SystemExit('error: ' + ' '.join(str(message).split()))


def pipe_closed():
    """stdout's reader went away (`... | head`): not an error. stdout goes to /dev/null, so the
    last flush is quiet too, and the exit status is that of a process SIGPIPE ended, as any Unix
    tool's."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(128 + 13)


def tolerant_stdout():
    """stdout writes '?' for a character its encoding lacks (a C locale) rather than failing, say, a
    finished run on the sample it prints."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors='replace')


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (args: its number), raised where Ctrl-C would be, to stop a run alike."""


@contextmanager
def signals_as_ctrl_c():
    """SIGTERM (kill) and SIGHUP (a closed terminal) stop the block as Ctrl-C does, saying where; a
    second signal while stopping is ignored."""
    def stop(signum, frame):
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def exit_status(e):
    """A shell's status for a process that a signal stopped: 128 + its number (Ctrl-C: 130)."""
    return 128 + (e.args[0] if isinstance(e, Interrupted) else signal.SIGINT)


def why(e):
    """An exception as a reason, naming a full disk or the file size limit (ulimit -f) where it, or
    the error it came from, says so (torch.save reports either as a RuntimeError,
    'unexpected pos')."""
    cause, reasons = e, {errno.ENOSPC: 'the disk is full',
                         errno.EFBIG: 'the file size limit (ulimit -f) was reached'}
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in reasons:
            return f"{reasons[cause.errno]} ({cause.strerror})"
        cause = cause.__cause__ or cause.__context__
    return said(e, 200)


def said(e, width=120):
    """An exception in words, on one line: its class, and its message cut at width characters."""
    message = ' '.join(str(e).split())[:width]
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def short_of_memory(e):
    """Whether e is memory running out: a MemoryError (NumPy's too), CUDA's OutOfMemoryError, the
    CPU allocator's RuntimeError, or a mapping refused (np.memmap's OSError, a library's
    ImportError under ulimit -v)."""
    return (isinstance(e, MemoryError) or type(e).__name__ == 'OutOfMemoryError'
            or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
            or any(s in str(e) for s in ("can't allocate memory", 'not enough memory',
                                         'Cannot allocate memory', 'failed to map segment')))


def needs_more():
    """What memory running out asks of the user: the memory limit named, where ulimit -v set one."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return ("it needs more than this machine has: free some" if limit == resource.RLIM_INFINITY
            else f"it needs more than the memory limit (ulimit -v) of {limit / 2**20:,.0f} MiB: "
            "raise the limit")


def out_of_memory(e, settings):
    """One line naming the settings to lower, if e is memory running out; else nothing."""
    if short_of_memory(e):
        die(f"out of memory ({said(e)}): lower {settings}")


@contextmanager
def memory_for(doing, alternative):
    """Memory running out in the block is one line saying what it was doing (preparing a
    dataset, say) and what else to do, rather than the model's settings, which had no part in it."""
    try:
        yield
    except (MemoryError, RuntimeError, OSError) as e:
        if short_of_memory(e):
            die(f"out of memory {doing} ({said(e)}): {needs_more()}, or {alternative}")
        raise


def last_resort(kind, error, tb):
    """sys.excepthook: memory that runs out where no handler of a script is, as torch is imported
    under a tight ulimit -v, is one line (status 1, as for any uncaught error); anything else
    prints Python's traceback, a bug to report."""
    if not short_of_memory(error):
        sys.__excepthook__(kind, error, tb)
        return
    importing = isinstance(error, ImportError) or any(
        frame.f_code.co_filename.startswith('<frozen importlib') for frame, _ in walk_tb(tb))
    print(f"error: out of memory{' loading the libraries' if importing else ''} ({said(error)}): "
          f"{needs_more()}", file=sys.stderr)


sys.excepthook = last_resort


def not_a_file(path):
    """What path is if it exists but is no regular file (a directory, a FIFO, a device or
    socket), else None: such input is named in one line, never read (a FIFO would block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:   # missing or unreachable: opening it says so
        return None
    return (None if stat.S_ISREG(mode) else 'a directory' if stat.S_ISDIR(mode)
            else 'a FIFO (named pipe)' if stat.S_ISFIFO(mode) else 'a device or socket')


@contextmanager
def one_line_errors(memory_settings):
    """What a script's main ends in besides its own checks: a closed pipe quietly, a system error
    or memory running out (naming memory_settings, the settings to lower) in one line, Ctrl-C (or
    a signal raised as it) with the shell's status. stdout prints '?' for a character it lacks."""
    tolerant_stdout()
    try:
        yield
    except BrokenPipeError:   # stdout's reader went away (| head): not an error
        pipe_closed()
    except OSError as e:
        out_of_memory(e, memory_settings)
        # an unwritable out_dir or plot_file, a full disk: the system's own reason
        die(why(e) if e.errno in (errno.ENOSPC, errno.EFBIG) else e)
    except (MemoryError, RuntimeError) as e:   # CUDA's OutOfMemoryError is a RuntimeError
        out_of_memory(e, memory_settings)
        raise
    except KeyboardInterrupt as e:   # before a run's own handler, or where there is none
        print("interrupted", file=sys.stderr)
        raise SystemExit(exit_status(e))
