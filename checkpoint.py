"""
checkpoint.py: a training run's folder kept safe, and the model, device and precision of a run.

    out_dir/ckpt.pt          weights, optimizer, settings, vocabulary, RNG states
    out_dir/log.jsonl        one line per evaluation: the curves
    out_dir/train_log.jsonl  one line per iteration: the losses
    out_dir/train.lock       flock'ed for the run's lifetime; names the run that holds it

Every file is written whole or not at all (atomic_write): a kill or a full disk never costs the last
good checkpoint. A resume cuts the logs back to its checkpoint (cut_logs); a new run refuses an
out_dir holding a checkpoint or logs. checks.py holds the longer refusals of bad input.
"""
import fcntl
import json
import os
import re
import shlex
import sys
import time
import warnings
import zipfile
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from checks import (check_contents, check_fit, check_optimizer_state, check_saved_settings, load_error,
                    model_config, verify_archive, why)
from configurator import die, exit_status, to_json
from damcha_torch import GPT

HELD = []   # this process's lock on its training run's out_dir (lock_out_dir), while the run lasts
DIVERGED = 3   # train_char.py's exit status when a non-finite loss stopped the run (lab/reproduce.py reads it)
PARTIAL = r'.+\.damcha-partial-\d+\.tmp'   # atomic_write's temporary files: the only ones a run removes


@contextmanager
def atomic_write(path):
    """A binary file to write that appears at `path` only once complete: written beside it (this
    process's own file, named PARTIAL), flushed to disk, renamed over it. A crash leaves the old
    file or none; any failure removes the partial file before passing on. Every save goes through here."""
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
    """torch.save into out_dir/name through atomic_write; a failure ends the run with one line naming
    the last good checkpoint (saved_iter: the iteration of the ckpt.pt on disk, None if none)."""
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
    loss (DIVERGED) stopped at iter_num: where it stopped, and what is on disk."""
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
    check_optimizer_state(optimizer)
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)


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
    check_contents(ckpt, path)
    return ckpt


def resume(cfg, given, ranges, keep=('mode', 'init_from', 'out_dir')):
    """(settings, model fields, checkpoint) of a run resumed, or evaluated, from out_dir/ckpt.pt: its
    settings overridden by those given, refused now if its weights no longer fit them."""
    ckpt = load_checkpoint(cfg['out_dir'])
    cfg, model_args = from_checkpoint(ckpt, cfg, given, ranges, keep)
    check_fit(model_args, ckpt)
    return cfg, model_args, ckpt


def from_checkpoint(ckpt, cfg, given, ranges, keep=('mode', 'init_from', 'out_dir')):
    """(settings, model_args): the run's saved settings, overridden by those given now (and by keep,
    never taken from a checkpoint); model fields too, as long as the weights still fit (say
    --blocks=diag to ablate a trained model)."""
    saved = {k: v for k, v in ckpt['config'].items() if k in cfg and k not in given and k not in keep}
    fields = {k: v for k, v in ckpt['model_args'].items() if k in cfg and k not in given}   # the model's own copy
    check_saved_settings(os.path.join(cfg['out_dir'], 'ckpt.pt'), cfg, saved, fields, ranges)
    merged = cfg | saved
    model_args = {k: merged[k] if k in given else v for k, v in ckpt['model_args'].items()}
    return merged | model_args, model_args


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


# ---------------------------------------------------------------------------------------------
# A run's model, device and precision

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


def build_model(model_args, ckpt=None):
    """GPT(model_args), with the checkpoint's weights (which resume checked to fit)."""
    model = GPT(model_config(model_args))
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt['model'])
        except (RuntimeError, KeyError, TypeError) as e:   # not the names or shapes (check_fit): damage inside
            die(f"the checkpoint's weights do not load into the model ({str(e)[:300]})")
    return model
