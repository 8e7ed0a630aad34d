"""
checks.py: the refusals of bad input that take more than a line, for train_char.py and eval_char.py.
Each ends the program with one line (configurator.die) saying what is wrong and what to do: settings
that break a rule, a checkpoint damaged on disk or inside, weights that no longer fit the settings
given, a kernel the device cannot run, rows that cannot fit in memory, and the errors a script's
main ends in (one_line_errors). Following how a model trains does not need this file, as it does
not need data/prepare.py; docs/reliability.md lists each promise and the test that holds it.
"""
import errno
import importlib.util
import math
import os
import resource
import sys
import zipfile
from contextlib import contextmanager

import torch

from configurator import die, exit_status, pipe_closed, problem
from damcha_torch import GPT, GPTConfig


# ---------------------------------------------------------------------------------------------
# Settings

def settings_problem(cfg, ranges):
    """What is wrong with a run's settings, in one line, or None; those given and those a checkpoint
    saved are checked alike. ranges = (choices, positive, non_negative) as configure() takes them;
    out_dir names a folder (several, comma-separated, for a plot); the seed is one torch and numpy
    both take; Adam's rates, in a script that has them."""
    wrong = problem(cfg, *ranges)
    if wrong:
        return wrong
    if not [d for d in cfg['out_dir'].split(',') if d.strip()]:
        return f"out_dir={cfg['out_dir']!r} names no folder"
    if not 0 <= cfg['seed'] < 2**32:   # torch.manual_seed takes seed + rank, numpy up to 2**32 - 1
        return f"seed={cfg['seed']} must be a whole number from 0 to 2**32 - 1"
    for key in ('beta1', 'beta2'):   # Adam's moment decay rates
        if key in cfg and not 0 <= cfg[key] < 1:
            return f"{key}={cfg[key]} must be at least 0 and below 1, e.g. 0.9"
    return None


def check_run_settings(cfg, ranges):
    wrong = settings_problem(cfg, ranges)
    if wrong:
        die(wrong)


def snapshot_iterations(cfg, given, ckpt):
    """The iterations of snapshot_iters, refused if outside the run (for a resume given new ones,
    from its checkpoint's iteration on: those saved before stay)."""
    try:
        snapshots = {int(t) for t in cfg['snapshot_iters'].split(',') if t.strip()}
    except ValueError:
        die(f"snapshot_iters={cfg['snapshot_iters']!r}: give iterations as comma-separated whole numbers, "
            "e.g. 0,1000,5000")
    first = ckpt['iter_num'] if ckpt is not None and 'snapshot_iters' in given else 0
    outside = sorted(i for i in snapshots if not first <= i <= cfg['max_iters'])
    if outside:
        whose = "the checkpoint's" if ckpt is not None and 'snapshot_iters' not in given else 'given'
        die(f"snapshot_iters ({whose}): {outside} outside this run's iterations {first}..{cfg['max_iters']}"
            + ("; --snapshot_iters= sets others, or none" if whose != 'given' else ''))
    return snapshots


def model_config(model_args):
    try:
        return GPTConfig(**model_args)
    except (ValueError, TypeError) as e:
        die(f"invalid model: {e}")


# ---------------------------------------------------------------------------------------------
# Checkpoints

def verify_archive(path):
    """torch.save writes a zip archive with a CRC-32 of each entry, which torch.load never checks:
    a changed byte (a flipped bit, a forged weight) would load in silence. One read of the file."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        bad = f'? ({e})'
    if bad:
        die(f"{path} is damaged: its entry {bad} fails its CRC-32 check (its bytes changed after it was "
            "saved); it is left as it is: restore it from a copy, or start again in another --out_dir")


def load_error(e):
    """torch.load's reason, without its advice to load with weights_only=False or to allow the file's
    Python objects: either runs code the file holds, no remedy for a damaged or untrusted file."""
    text = str(e)
    if 'WeightsUnpickler error:' in text:
        text = text.split('WeightsUnpickler error:')[1].split('Check the documentation')[0].split('. Please')[0]
    else:
        text = text.split('. ')[0]
    text = ' '.join(text.split())[:200]
    return text if 'weights_only' not in text else 'not a file of tensors and plain values'


def check_contents(ckpt, path):
    """What a checkpoint of train_char.py holds, of the right types, and values no training writes
    (negative counts, non-finite weights, a negative mean squared gradient): said now, not as a
    diverging loss later."""
    needed = ('model', 'optimizer', 'scaler', 'model_args', 'config', 'vocab', 'iter_num', 'best_val_loss',
              'tokens', 'elapsed', 'rng')
    missing = [k for k in needed if k not in ckpt] if isinstance(ckpt, dict) else ['everything']
    if missing or not all(isinstance(ckpt[k], dict) for k in ('model', 'model_args', 'config', 'optimizer')):
        die(f"{path} is not a checkpoint of train_char.py (it lacks {', '.join(missing) or 'the right types'})")
    numbers = dict(iter_num=int, tokens=int, best_val_loss=(int, float), elapsed=(int, float))
    wrong = [k for k, kind in numbers.items() if type(ckpt[k]) is bool or not isinstance(ckpt[k], kind)
             or not 0 <= ckpt[k] < math.inf]   # a negative iter_num would resume with negative learning rates
    if wrong:
        die(f"{path} is damaged: {', '.join(wrong)} should be numbers of at least 0, and finite")
    vocab = ckpt['vocab']
    if not (isinstance(vocab, list) and vocab and len(set(vocab)) == len(vocab)
            and all(type(b) is int and 0 <= b < 256 for b in vocab)):
        die(f"{path} is damaged: vocab should be a list of distinct byte values")
    vocab_size = ckpt['model_args'].get('vocab_size')
    if type(vocab_size) is int and len(vocab) > vocab_size:   # its type is checked with the other settings
        die(f"{path} is damaged: its vocab has {len(vocab)} symbols, more than the model's vocab_size={vocab_size}")
    state = [s for s in ckpt['optimizer'].get('state', {}).values() if isinstance(s, dict)]
    if not all(torch.isfinite(t).all() for t in [*ckpt['model'].values(), *(t for s in state for t in s.values())]
               if isinstance(t, torch.Tensor) and t.is_floating_point()):
        die(f"{path} is damaged: it holds weights or optimizer state that are not finite numbers")
    if any(isinstance(s.get('exp_avg_sq'), torch.Tensor) and (s['exp_avg_sq'] < 0).any() for s in state):
        die(f"{path} is damaged: its optimizer state holds a negative exp_avg_sq (Adam's mean squared gradient)")


def check_saved_settings(path, cfg, saved, fields, ranges):
    """The settings a resume takes from a checkpoint (saved: the run's, fields: its model's own copy)
    of their setting's type and within its rules, as if given as flags."""
    wrong = sorted({k for k, v in [*saved.items(), *fields.items()]
                    if type(v) is not type(cfg[k]) and not (type(cfg[k]) is float and type(v) is int)})
    if wrong:
        die(f"{path} is damaged: its saved settings {', '.join(wrong)} are not of their setting's type")
    wrong = settings_problem(cfg | saved | fields, ranges)
    if wrong:
        die(f"{path} is damaged: a setting it saved fails its check ({wrong})")


def check_fit(model_args, ckpt):
    """Whether the checkpoint's weights fit GPT(model_args): the same names and shapes, compared on
    the meta device (no memory), so that a resume whose settings no longer fit is refused before
    the data are loaded."""
    with torch.device('meta'):
        want = {k: tuple(v.shape) for k, v in GPT(model_config(model_args)).state_dict().items()}
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in ckpt['model'].items()}
    differ = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    saved = ckpt['model_args']
    changed = [f"{k}={v!r} (the checkpoint's: {saved.get(k)!r})" for k, v in model_args.items() if saved.get(k) != v]
    if differ and changed:   # settings given now, in a config file or a flag, override the saved ones
        die(f"the checkpoint's weights do not fit the model with {', '.join(changed)}: settings given "
            "in config files and flags override the checkpoint's; give the run's own, or none")
    if differ:
        die(f"the checkpoint's weights do not fit the model ({len(differ)} of its tensors, e.g. {differ[0]}: "
            f"saved {have.get(differ[0])}, the model's {want.get(differ[0])})")


def check_optimizer_state(optimizer):
    """Adam's moments of the shapes of their weights: a damaged one would fail the first step in a traceback."""
    wrong = [(tuple(t.shape), tuple(w.shape)) for g in optimizer.param_groups for w in g['params']
             for k, t in optimizer.state.get(w, {}).items() if k != 'step' and t.shape != w.shape]
    if wrong:
        die(f"the checkpoint is damaged: its optimizer state has a moment of shape {wrong[0][0]} for a "
            f"{wrong[0][1]} weight")


# ---------------------------------------------------------------------------------------------
# The device and memory

def check_kernel(kernel, device, dtype):
    # the fused kernel runs on CUDA, or on the CPU in Triton's interpreter (as the tests run it),
    # which runs it in float32 (bfloat16 comes out wrong there; float16 trains on CUDA only)
    if kernel != 'triton':
        return
    if importlib.util.find_spec('triton') is None:
        die("kernel=triton needs the triton package (pip install triton); use --kernel=torch")
    if not device.startswith('cuda') and os.environ.get('TRITON_INTERPRET') != '1':
        die(f"kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 on a CPU), not {device}; use --kernel=torch")
    if not device.startswith('cuda') and dtype != 'float32':
        die(f"kernel=triton on a CPU runs in Triton's interpreter, which cannot train in {dtype}; use --dtype=float32")


def check_fits(cfg, key, device, training=False):
    """Refuse, before allocating them, cfg[key] rows that cannot fit: a float32 (rows, block_size, width)
    is less than a forward pass holds, width a token's logits and embedding, or in training those
    backward keeps (over eight embeddings a layer: the norms', attention's and the MLP's inputs)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]   # ulimit -v, if one is set
    have = (torch.cuda.get_device_properties(device).total_memory if device.startswith('cuda') else
            min(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'), math.inf if limit < 0 else limit))
    need = 4 * cfg[key] * cfg['block_size'] * ((8 * cfg['n_layer'] if training else 1) * cfg['n_embd'] + cfg['vocab_size'])
    if need > have:
        die(f"{key}={cfg[key]} asks for more than {need / 2**30:,.1f} GiB, and {device} has {have / 2**30:,.1f} GiB: "
            "lower it")


def why(e):
    """An exception as a reason, naming a full disk or the file size limit (ulimit -f) where it, or the
    error it came from, says so (torch.save reports either as a RuntimeError, 'unexpected pos')."""
    cause, reasons = e, {errno.ENOSPC: 'the disk is full', errno.EFBIG: 'the file size limit (ulimit -f) was reached'}
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in reasons:
            return f"{reasons[cause.errno]} ({cause.strerror})"
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def out_of_memory(e, settings):
    """One line naming the settings to lower, if e is memory running out (MemoryError, CUDA's
    OutOfMemoryError, the CPU allocator's RuntimeError); else nothing."""
    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or any(
            s in str(e) for s in ("can't allocate memory", 'not enough memory')):
        die(f"out of memory ({' '.join(str(e).split())[:120] or type(e).__name__}): lower {settings}")


@contextmanager
def one_line_errors(memory_settings):
    """What a script's main ends in besides its own checks: a closed pipe quietly, a system error
    or memory running out (naming memory_settings, the settings to lower) in one line, Ctrl-C (or
    a signal raised as it) with the shell's status."""
    try:
        yield
    except BrokenPipeError:   # stdout's reader went away (| head): not an error
        pipe_closed()
    except OSError as e:   # an unwritable out_dir or plot_file, a full disk: the system's own reason
        die(why(e) if e.errno in (errno.ENOSPC, errno.EFBIG) else e)
    except (MemoryError, RuntimeError) as e:   # CUDA's OutOfMemoryError is a RuntimeError
        out_of_memory(e, memory_settings)
        raise
    except KeyboardInterrupt as e:   # before a run's own handler, or where there is none
        print("interrupted", file=sys.stderr)
        raise SystemExit(exit_status(e))
