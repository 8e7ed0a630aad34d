"""
shell.py: how every script meets the shell. Bad input ends a script with one line on stderr (die),
never a traceback; SIGTERM and SIGHUP stop it as Ctrl-C does, at any moment of its start-up too,
and a second signal never cuts the first one's clean-up short; a closed pipe (`... | head`) is not
an error; an output encoding that lacks a character prints '?'; each way of ending has the exit
status a shell expects (exit_status, DIVERGED). A script imports this module and calls
quit_on_signals before its heavy imports, wraps its main in one_line_errors and signals_as_ctrl_c,
and calls die. Memory that runs out is one line naming what needed it: the settings of the model
(one_line_errors), the data being prepared (memory_for), or, before any handler, the libraries being
loaded under a memory limit (last_resort, the excepthook that importing this module sets). Nothing
here imports torch: it is in place before torch is.
"""
import errno
import io
import os
import resource
import signal
import stat
import sys
import time
from contextlib import contextmanager
from traceback import walk_tb

# train_char.py's exit status when a non-finite loss stopped the run (lab/reproduce.py reads it)
DIVERGED = 3
# what stops a script: Ctrl-C, kill (SIGTERM), a closed terminal (SIGHUP)
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# seconds after which a second Ctrl-C is a new request to stop at once: a sooner one is the same key
# pressed twice, or torchrun passing the first on to its processes
AGAIN_S = 1.0


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


def quit_at_once(signum, frame):
    """A script's start-up, before main's own handling: nothing is written yet, so a signal ends it
    here, with one line and the shell's status, never the traceback of an import it cut short."""
    os.write(2, b'interrupted\n')
    os._exit(128 + signum)


def quit_on_signals():
    """A script's first call, before it imports torch (seconds): a signal meanwhile quits at once.
    A signal the script was started ignoring (nohup, a background job) stays ignored."""
    for s in STOPS:
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, quit_at_once)


def ignore_signals():
    """Further signals are ignored: the stop under way, its clean-up and its last line, or the
    script's exit, are not cut short."""
    for s in STOPS:
        signal.signal(s, signal.SIG_IGN)


def raise_as_ctrl_c(signum, frame=None):
    """Stop where the script is, as Ctrl-C does (KeyboardInterrupt; Interrupted for SIGTERM and
    SIGHUP), deaf to any further signal."""
    ignore_signals()
    raise KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def install(handler):
    """handler for every stopping signal but those ignored (nohup); returns the handlers before."""
    old = {s: signal.getsignal(s) for s in STOPS}
    for s, before in old.items():
        if before != signal.SIG_IGN:
            signal.signal(s, handler)
    return old


@contextmanager
def signals_as_ctrl_c():
    """Ctrl-C, SIGTERM (kill) and SIGHUP (a closed terminal) stop the block alike, saying where;
    a second signal while stopping is ignored. Leaving, the handlers before are back, but for a
    script's quit_at_once: what follows main is the script's exit, which no signal cuts short."""
    old = install(raise_as_ctrl_c)
    try:
        yield
    finally:
        for s, before in old.items():
            if before is not None:   # None: a handler not set from Python, which cannot be restored
                signal.signal(s, signal.SIG_IGN if before is quit_at_once else before)


def note_signals():
    """For a training loop, inside signals_as_ctrl_c: from now on a signal is noted in the list
    returned (the first one's number), not raised, and the loop stops at a boundary of its choosing.
    Ctrl-C again, AGAIN_S or more after the first, stops at once (a boundary that does not come);
    any other signal meanwhile is ignored. raise_noted ends it."""
    noted, since = [], []

    def note(signum, frame):
        if not noted:
            noted.append(signum)
            since.append(time.monotonic())
        elif signum == signal.SIGINT and time.monotonic() - since[0] >= AGAIN_S:
            raise_as_ctrl_c(signum)
    install(note)
    return noted


def raise_noted(noted):
    """The loop is over: signals raise again (signals_as_ctrl_c), and one noted meanwhile stops the
    script now."""
    install(raise_as_ctrl_c)
    if noted:
        raise_as_ctrl_c(noted[0])


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
