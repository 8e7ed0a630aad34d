"""
checkpoint.py: a training run's folder, kept safe, and what a run rebuilds from its settings.

    out_dir/ckpt.pt          weights, optimizer, settings, vocabulary, RNG states
    out_dir/log.jsonl        one line per evaluation: the curves
    out_dir/train_log.jsonl  one line per iteration: the losses
    out_dir/train.lock       flock'ed for the run's lifetime; names the run that holds it

Every file is written whole or not at all (atomic_write): a kill or a full disk never costs the last
good checkpoint. A checkpoint is verified (its archive's CRC-32s, then what it holds) with a
one-line error for a missing, empty or damaged file; a resume cuts the logs back to it (cut_logs),
dropping a torn last line with a note; a new run refuses an out_dir holding a checkpoint or logs.
Then the model, the device, the precision and memory. train_char.py and eval_char.py import it.
"""
import errno
import fcntl
import importlib.util
import json
import math
import os
import re
import resource
import shlex
import sys
import time
import warnings
import zipfile
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from configurator import die, exit_status, pipe_closed, problem, to_json
from damcha_torch import GPT, GPTConfig

HELD = []   # this process's lock on its training run's out_dir (lock_out_dir), while the run lasts
DIVERGED = 3   # train_char.py's exit status when a non-finite loss stopped the run (lab/reproduce.py reads it)
PARTIAL = r'.+\.damcha-partial-\d+\.tmp'   # atomic_write's temporary files: the only ones a run removes


@contextmanager
def atomic_write(path):
    """A binary file to write that appears at `path` only once complete: it is written beside it,
    flushed to disk, then renamed over it. A crash leaves the old file or none, never half a file.
    The temporary file is this process's own (two processes never write the same one), named so
    that it cannot be mistaken for a user's (PARTIAL), and any failure (a full disk, Ctrl-C, an
    error in the caller's block) removes it before passing on. Every save of the project goes
    through here (prepared data, checkpoints, snapshots, logs)."""
    tmp = f'{path}.damcha-partial-{os.getpid()}.tmp'
    try:
        with open(tmp, 'wb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save(obj, out_dir, name, saved_iter):
    """torch.save into out_dir/name through atomic_write: on any failure the partial file is gone
    and the previous one stays; the run ends with one line, which names the last good checkpoint
    (saved_iter: the iteration of the ckpt.pt on disk, None if there is none yet)."""
    path = os.path.join(out_dir, name)
    try:
        with atomic_write(path) as f:
            torch.save(obj, f)
    except Exception as e:
        cause = e   # a Ctrl-C inside torch.save, which reports it as an error of its own, stops as Ctrl-C does
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            cause = cause.__context__
        if cause is not None:
            raise cause from None
        die(f"could not save {path}: {why(e)}; the partial file was removed; {last_good(out_dir, saved_iter)}")


class Diverged(Exception):
    """A non-finite loss (what, value, iteration): the run stops on every process without saving."""


def stopped(e, out_dir, iter_num, saved_iter):
    """(exit status, one line) of a run that Ctrl-C, SIGTERM or SIGHUP (exit_status) or a non-finite
    loss (DIVERGED, which tells lab/reproduce.py's sweep that the run diverged rather than failed)
    stopped at iter_num: where it stopped, and what is on disk."""
    if isinstance(e, KeyboardInterrupt):
        return exit_status(e), f"interrupted at iter {iter_num}: " + (
            f"a resume (--init_from=resume) starts from {out_dir}/ckpt.pt at iter {saved_iter}"
            if saved_iter is not None else f"no checkpoint was written yet: to start again, move the logs "
            f"out of {out_dir}, or choose another --out_dir")
    what, value, it = e.args
    return DIVERGED, (f"error: the {what} loss became {value} at iter {it}; stopped without saving: "
                      f"{last_good(out_dir, saved_iter)}; try a lower learning_rate")


def last_good(out_dir, saved_iter):
    return (f"{os.path.join(out_dir, 'ckpt.pt')} (iter {saved_iter}) is the last good checkpoint"
            if saved_iter is not None else "no checkpoint was written yet")


def rng_states(ddp):
    """Every process's torch RNG state (dropout), gathered so that rank 0 can save them all."""
    state = (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
    if not ddp:
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def restore(ckpt, optimizer, scaler, batches, rank, device):
    """The optimizer, loss scaler and random generators as the checkpoint left them, except the
    weight decay and betas, which the settings of this run decide."""
    settings = [{k: g[k] for k in ('weight_decay', 'betas')} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(ckpt['optimizer'])
        if ckpt['scaler']:   # {} when the saved run had no loss scaling (anything but float16)
            scaler.load_state_dict(ckpt['scaler'])
        batches.set_state(ckpt['rng']['batches'])
        if rank < len(ckpt['rng']['torch']):   # more processes than saved: the new ones keep their seed
            cpu_state, cuda_state = ckpt['rng']['torch'][rank]
            torch.set_rng_state(cpu_state)
            if cuda_state is not None and device.startswith('cuda'):
                torch.cuda.set_rng_state(cuda_state)
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        die(f"the checkpoint's optimizer or RNG state does not fit this run ({type(e).__name__}: {str(e)[:300]})")
    wrong = [(tuple(t.shape), tuple(w.shape)) for g in optimizer.param_groups for w in g['params']
             for k, t in optimizer.state.get(w, {}).items() if k != 'step' and t.shape != w.shape]
    if wrong:   # Adam would fail on them at the first step, in a traceback
        die(f"the checkpoint is damaged: its optimizer state has a moment of shape {wrong[0][0]} for a "
            f"{wrong[0][1]} weight")
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)


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


def load_checkpoint(out_dir):
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.isfile(path):
        die(f"no checkpoint at {path}")
    if os.path.getsize(path) == 0:
        die(f"{path} is empty (0 bytes), not a checkpoint")
    if zipfile.is_zipfile(path):   # anything else: torch.load's own error below says what it is
        verify_archive(path)
    try:
        with warnings.catch_warnings():   # e.g. on a plain pickle: the error below says it in one line
            warnings.simplefilter('ignore')
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:   # torch.load raises many kinds for a damaged file; all mean the same
        die(f"{path} is not a readable checkpoint: damaged, or not written by train_char.py "
            f"({type(e).__name__}: {load_error(e)})")
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
    # values no training writes: say so now, not as a diverging loss later
    state = [s for s in ckpt['optimizer'].get('state', {}).values() if isinstance(s, dict)]
    if not all(torch.isfinite(t).all() for t in [*ckpt['model'].values(), *(t for s in state for t in s.values())]
               if isinstance(t, torch.Tensor) and t.is_floating_point()):
        die(f"{path} is damaged: it holds weights or optimizer state that are not finite numbers")
    if any(isinstance(s.get('exp_avg_sq'), torch.Tensor) and (s['exp_avg_sq'] < 0).any() for s in state):
        die(f"{path} is damaged: its optimizer state holds a negative exp_avg_sq (Adam's mean squared gradient)")
    return ckpt


def resume(cfg, given, ranges, keep=('mode', 'init_from', 'out_dir')):
    """(settings, model fields, checkpoint) of a run resumed, or evaluated, from out_dir/ckpt.pt:
    its settings overridden by those given (from_checkpoint), refused now if its weights no longer
    fit them."""
    ckpt = load_checkpoint(cfg['out_dir'])
    cfg, model_args = from_checkpoint(ckpt, cfg, given, ranges, keep)
    check_fit(model_args, ckpt)
    return cfg, model_args, ckpt


def load_error(e):
    """torch.load's reason, without its advice to retry with weights_only=False or to allow the
    file's Python objects: either runs code the file holds, no remedy for a damaged or untrusted
    checkpoint."""
    text = str(e)
    if 'WeightsUnpickler error:' in text:
        text = text.split('WeightsUnpickler error:')[1].split('Check the documentation')[0].split('. Please')[0]
    else:
        text = text.split('. ')[0]
    text = ' '.join(text.split())[:200]
    return text if 'weights_only' not in text else 'not a file of tensors and plain values'


def append_jsonl(path, entries):
    with open(path, 'a') as f:
        f.writelines(to_json(e) + '\n' for e in entries)


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
                print(f"note: dropped the unreadable last line {n} of {path}, an interrupted write: "
                      f"{line[:60].decode(errors='replace')!r}", file=sys.stderr)
                break
            die(f"{path}, line {n} of {len(lines)}, is unreadable ({e}): only a last line is dropped "
                "(an interrupted write); repair or delete this one")
        entries.append(entry)
    return entries


def cut_logs(out_dir, k, resumed):
    """Empty logs for a new run; a resumed run's logs cut at its checkpoint at iteration k: later
    lines belong to the part of the interrupted run that it is about to redo. A checkpoint at k is
    saved after the evaluation at k and before the step of k, which the resumed run takes again:
    log.jsonl keeps iter <= k and train_log.jsonl iter < k, so no line is repeated or lost."""
    for name, keep in (('log.jsonl', lambda it: it <= k), ('train_log.jsonl', lambda it: it < k)):
        path = os.path.join(out_dir, name)
        entries = read_jsonl(path) if resumed and os.path.isfile(path) else []
        if not all(isinstance(e.get('iter'), int) for e in entries):
            die(f"{path} has an entry without an iteration number: not a log of train_char.py")
        with atomic_write(path) as f:
            f.write(''.join(to_json(e) + '\n' for e in entries if keep(e['iter'])).encode())


def no_checkpoint_in(out_dir):
    """A new run never overwrites a checkpoint, nor the logs of a run whose checkpoint is gone."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(path):
        die(f"{path} exists: continue it with --init_from=resume, or choose another --out_dir")
    logs = [n for n in ('log.jsonl', 'train_log.jsonl') if os.path.isfile(os.path.join(out_dir, n))
            and os.path.getsize(os.path.join(out_dir, n))]
    if logs:   # a resume is impossible, and a new run would replace them
        die(f"{out_dir} holds {' and '.join(logs)} of an earlier run but no ckpt.pt"
            f"{' (a link to a missing file)' * os.path.islink(path)}: it cannot be resumed; move the logs "
            "away, or choose another --out_dir")


def lock_out_dir(out_dir):
    """Hold out_dir for this training run: an exclusive flock on out_dir/train.lock, which the
    kernel releases when the process ends in any way, SIGKILL included, so it never goes stale. The
    file names the holder, for the message to a second run. The open file stays in HELD until
    the run ends (unlock)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        die(f"out_dir {out_dir} is a file, not a folder")
    os.makedirs(out_dir, exist_ok=True)
    # surrogateescape: the command's bytes as typed, also those that are not UTF-8 (a prompt, a path)
    f = open(os.path.join(out_dir, 'train.lock'), 'a+', errors='surrogateescape')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or 'a run that is just starting'
        f.close()
        die(f"{out_dir} is in use by another training run ({holder}); wait for it to end, "
            "or choose another --out_dir")
    f.truncate(0)
    f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}, "
            f"command: {shlex.join([os.path.basename(sys.executable), *sys.argv])}\n")
    f.flush()
    HELD.append(f)
    for name in os.listdir(out_dir):   # left by a run killed mid-save (atomic_write): nobody writes them now
        if re.fullmatch(PARTIAL, name):
            os.remove(os.path.join(out_dir, name))


def unlock():
    """Let go of this process's lock (as its end would), for a run called in-process."""
    while HELD:
        HELD.pop().close()


def why(e):
    """An exception as a reason, naming a full disk or the file size limit (ulimit -f) where it, or the
    error it came from, says so (torch.save reports either as a RuntimeError, 'unexpected pos')."""
    cause, reasons = e, {errno.ENOSPC: 'the disk is full', errno.EFBIG: 'the file size limit (ulimit -f) was reached'}
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in reasons:
            return f"{reasons[cause.errno]} ({cause.strerror})"
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


# ---------------------------------------------------------------------------------------------
# A run's model, device and precision

def settings_problem(cfg, ranges):
    """What is wrong with a run's settings, in one line, or None; every script that runs a model
    checks them alike, those given and those a checkpoint saved: ranges = (choices, positive,
    non_negative) as configure() takes them; out_dir names a folder (several, comma-separated, for
    a plot); the seed is one torch and numpy both take; Adam's rates, in a script that has them."""
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


def from_checkpoint(ckpt, cfg, given, ranges, keep=('mode', 'init_from', 'out_dir')):
    """The run's saved settings, overridden by those given now (and by keep, which are never
    taken from a checkpoint); model fields too, as long as the weights still fit (say
    --blocks=diag to ablate a trained model). The saved ones are checked as flags are (ranges:
    settings_problem's). Returns (settings, model_args)."""
    saved = {k: v for k, v in ckpt['config'].items() if k in cfg and k not in given and k not in keep}
    fields = {k: v for k, v in ckpt['model_args'].items() if k in cfg and k not in given}   # the model's own copy
    wrong = sorted({k for k, v in [*saved.items(), *fields.items()]
                    if type(v) is not type(cfg[k]) and not (type(cfg[k]) is float and type(v) is int)})
    if wrong:
        die(f"{os.path.join(cfg['out_dir'], 'ckpt.pt')} is damaged: its saved settings {', '.join(wrong)} "
            "are not of their setting's type")
    merged = cfg | saved
    model_args = {k: merged[k] if k in given else v for k, v in ckpt['model_args'].items()}
    wrong = settings_problem(merged | model_args, ranges)   # those given passed already: a saved one fails
    if wrong:
        die(f"{os.path.join(cfg['out_dir'], 'ckpt.pt')} is damaged: a setting it saved fails its check ({wrong})")
    return merged | model_args, model_args


def model_config(model_args):
    try:
        return GPTConfig(**model_args)
    except (ValueError, TypeError) as e:
        die(f"invalid model: {e}")


def pick_device(name, local_rank):
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    kind, colon, index = name.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (colon and not (kind == 'cuda' and index.isdigit())):
        die(f"device must be auto, cpu, cuda, cuda:N or mps, not {name!r}")
    if not {'cpu': True, 'cuda': torch.cuda.is_available(), 'mps': torch.backends.mps.is_available()}[kind]:
        die(f"device={name}, but this machine has no {kind.upper()} device")
    if colon and int(index) >= torch.cuda.device_count():
        die(f"device={name}, but this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 to "
            f"cuda:{torch.cuda.device_count() - 1}")
    device = f'cuda:{local_rank}' if name == 'cuda' else name
    if kind == 'cuda':   # the current device too: Triton launches on it, and the saved CUDA RNG state is its
        torch.cuda.set_device(device)
    return device


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


def autocast_for(device, dtype):
    """(dtype name, autocast context). Half precision runs under autocast, weights stay float32."""
    kind = device.split(':')[0]
    if dtype == 'auto':
        dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if kind == 'cuda' else 'float32'
    if dtype == 'float16' and kind != 'cuda':
        die("dtype=float16 runs on a CUDA device only here (training it needs CUDA's GradScaler); "
            "use bfloat16 or float32")
    if dtype == 'float32':
        return dtype, nullcontext()
    return dtype, torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


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


def build_model(model_args, ckpt=None):
    """GPT(model_args), with the checkpoint's weights (which resume checked to fit)."""
    model = GPT(model_config(model_args))
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt['model'])
        except (RuntimeError, KeyError, TypeError) as e:   # not the names or shapes (check_fit): damage inside
            die(f"the checkpoint's weights do not load into the model ({str(e)[:300]})")
    return model


def check_fit(model_args, ckpt):
    """Whether the checkpoint's weights fit GPT(model_args): the same names and shapes, compared on
    the meta device (no memory, next to no time), so that a resume whose settings no longer fit
    is refused before the data are loaded or the run's settings printed."""
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
