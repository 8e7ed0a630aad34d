"""
checkpoint.py: a checkpoint of train_char.py read back, trusting nothing in it. load() checks the
file (its zip CRCs, that it holds tensors and plain values only, what a checkpoint holds, of the
right types and values); resume() merges its settings with those given and checks that its weights
fit them; load_data() loads the data it records and holds it to them; load_weights() and restore()
put the weights, optimizer, loss scaler and random generators back. Each refusal is one line
(shell.die). run_folder.py writes checkpoints.
"""
import dataclasses
import errno
import math
import os
import sys
import warnings
import zipfile

import torch

from configurator import settings_problem
from damcha_torch import GPT, GPTConfig
from data import dataset
from shell import die, not_a_file

# never taken from a checkpoint: where a resume writes and what it is asked to do now (a saved
# data_dir is only read from: load_data)
KEEP = ('mode', 'init_from', 'out_dir', 'data_dir', 'other_data')


def load_checkpoint(out_dir):
    """out_dir/ckpt.pt, checked: its archive, its contents (check_contents)."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.isfile(path):
        kind = not_a_file(path)
        die(f"{path} is {kind}, not a checkpoint" if kind else f"no checkpoint at {path}")
    if os.path.getsize(path) == 0:
        die(f"{path} is empty (0 bytes), not a checkpoint")
    try:   # before anything else, which would call an unreadable file damaged
        open(path, 'rb').close()
    except OSError as e:
        die(f"cannot read {path}: "
            + ('permission denied' if e.errno == errno.EACCES else e.strerror or str(e)))
    zipped = zipfile.is_zipfile(path)
    if zipped:   # anything else: torch.load's own error below says what it is
        verify_archive(path)
    try:
        # e.g. on a plain pickle: the error below says it in one line
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:   # torch.load raises many kinds for a damaged file; all mean the same
        die(f"{path} is not a readable checkpoint: damaged, or not written by train_char.py "
            f"({type(e).__name__}: {load_error(e)})")
    if not zipped:   # torch.save's legacy format: no CRCs, so a changed byte would go unseen
        die(f"{path} is not a zip-format checkpoint of train_char.py (an old torch.save format, "
            "whose bytes cannot be verified): refused rather than used unverified")
    check_contents(ckpt, path)
    return ckpt


def resume(cfg, given, ranges, attentions, keep=KEEP):
    """(settings, model fields, checkpoint) of a run resumed, or evaluated, from out_dir/ckpt.pt:
    its settings overridden by those given, refused now if its weights no longer fit them
    (attentions: {attn name: the class of h.{l}.attn} beyond the book's, as the scripts' main
    takes them)."""
    ckpt = load_checkpoint(cfg['out_dir'])
    cfg, model_args = from_checkpoint(ckpt, cfg, given, ranges, keep)
    check_fit(model_args, ckpt, attention_class(model_args['attn'], attentions))
    if 'dataset' not in given:
        cfg['dataset'] = data_source(cfg['dataset'], ckpt)
    return cfg, model_args, ckpt


def data_source(name, ckpt):
    """The dataset a resume or evaluation reads: the checkpoint's as it was given (a text file
    relative to the folder the script runs in), or, where no such file is here, the text file at
    the absolute path the checkpoint recorded. The path only finds the data; load_data compares
    their digests."""
    path = ckpt.get('data', {}).get('path')
    if path and name == ckpt['data']['dataset'] and not os.path.exists(name) \
            and os.path.isfile(path):
        print(f"note: the dataset {name} is not here: reading the run's {path}", file=sys.stderr)
        return path
    return name


def load_data(cfg, given, ckpt, use):
    """(corpora, vocabulary) of a run resumed or evaluated from ckpt, held to the data the
    checkpoint records. Its saved data_dir is read from, where it holds those data, never prepared
    into: anything prepared goes into the data_dir of this run's settings. Data that differ from
    the checkpoint's are refused unless other_data (use: what is done with them, for the message);
    a checkpoint that records none (an older version's) is used with a note."""
    record = ckpt.get('data')
    saved_dir = ckpt['config'].get('data_dir')
    also_in = saved_dir if 'data_dir' not in given and isinstance(saved_dir, str) else None
    expected = record['corpora'] if record else None
    corpora, vocab = dataset.load_dataset(cfg['dataset'], cfg['data_dir'], ckpt['vocab'],
                                          also_in, expected)
    path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if record is None:
        print(f"note: {path} records no digests of its data (saved by an older version): the "
              f"data of {cfg['dataset']} are {use} unchecked", file=sys.stderr)
        return corpora, vocab
    records = (record['corpora'] if len(record['corpora']) == len(corpora)
               else [None] * len(corpora))
    for c, r in zip(corpora, records):
        if r is not None and dataset.same_data(c.meta, r):
            continue
        differ = ['vocabulary'] * (r is None or c.meta['vocab'] != r['vocab']) + [
            f'{s}.bin' for s in sorted(c.meta['sha256'].keys() | (r or {}).get('sha256', {}).keys())
            if r is None or c.meta['sha256'].get(s) != r['sha256'].get(s)]
        message = (f"{c.name}, prepared in {c.dir}, is not the data {path} was trained on "
                   f"({record['dataset']}"
                   + (f", {record['path']}" if record['path'] not in ('', record['dataset']) else '')
                   + f"): its {', '.join(differ)} differ (another file of that name, a file "
                   "changed since, or a folder prepared again)")
        if not cfg['other_data']:
            die(f"{message}; give --other_data=True to have them {use} all the same")
        print(f"note: {message}; --other_data=True: they are {use}", file=sys.stderr)
    return corpora, vocab


def from_checkpoint(ckpt, cfg, given, ranges, keep=KEEP):
    """(settings, model_args): the run's saved settings, overridden by those given now (and by keep,
    never taken from a checkpoint); model fields too, as long as the weights still fit (say
    --blocks=diag to ablate a trained model)."""
    saved = {k: v for k, v in ckpt['config'].items()
             if k in cfg and k not in given and k not in keep}
    # the model's own copy
    fields = {k: v for k, v in ckpt['model_args'].items() if k in cfg and k not in given}
    check_saved_settings(os.path.join(cfg['out_dir'], 'ckpt.pt'), cfg, saved, fields, ranges)
    merged = cfg | saved
    model_args = {k: merged[k] if k in given else v for k, v in ckpt['model_args'].items()}
    return merged | model_args, model_args


def load_weights(model, ckpt):
    """The checkpoint's weights into model, whose names and shapes resume() checked to fit."""
    try:
        model.load_state_dict(ckpt['model'])
    except (RuntimeError, KeyError, TypeError) as e:
        # not the names or shapes (check_fit): damage inside
        die(f"the checkpoint's weights do not load into the model ({str(e)[:300]})")


def restore(ckpt, optimizer, scaler, batches, rank, device):
    """The optimizer, loss scaler and random generators as the checkpoint left them, except the
    weight decay and betas, which the settings of this run decide."""
    settings = [{k: g[k] for k in ('weight_decay', 'betas')} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(ckpt['optimizer'])
        if ckpt['scaler']:   # {} when the saved run had no loss scaling (anything but float16)
            scaler.load_state_dict(ckpt['scaler'])
        batches.set_state(ckpt['rng']['batches'])
        if not ckpt['rng']['torch']:   # a run saves one state a process, at least rank 0's
            raise ValueError("no process's torch RNG state")
        # more processes than saved: the new ones keep their seed
        if rank < len(ckpt['rng']['torch']):
            cpu_state, cuda_state = ckpt['rng']['torch'][rank]
            torch.set_rng_state(cpu_state)
            if cuda_state is not None and device.startswith('cuda'):
                torch.cuda.set_rng_state(cuda_state)
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        die(f"the checkpoint's optimizer or RNG state does not fit this run "
            f"({type(e).__name__}: {str(e)[:300]})")
    check_optimizer_state(optimizer)
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)


def attention_class(attn, attentions):
    """The class of h.{l}.attn that GPT takes for this attn: None for the book's damcha and mha,
    else the caller's (the lab's, by name); any other name is refused in one line."""
    if attn in ('damcha', 'mha'):
        return None
    if attn not in attentions:
        die(f"attn={attn!r}: this script builds attn='damcha' or 'mha'; the lab's attentions "
            "(proj, tha, dcmha) train and evaluate with python lab/train.py and lab/eval.py")
    return attentions[attn]


def model_config(model_args):
    try:
        return GPTConfig(**model_args)
    except (ValueError, TypeError) as e:
        die(f"invalid model: {e}")


def verify_archive(path):
    """torch.save writes a zip archive with a CRC-32 of each entry, which torch.load never checks:
    a changed byte (a flipped bit, a forged weight) would load in silence. One read of the file."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        bad = f'? ({e})'
    if bad:
        die(f"{path} is damaged: its entry {bad} fails its CRC-32 check (its bytes changed after "
            "it was saved); it is left as it is: restore it from a copy, or start again in another "
            "--out_dir")


def load_error(e):
    """torch.load's reason, without its advice to load with weights_only=False or to allow the
    file's Python objects: either runs code the file holds, no remedy for a damaged or untrusted
    file."""
    text = str(e)
    if 'WeightsUnpickler error:' in text:
        text = (text.split('WeightsUnpickler error:')[1].split('Check the documentation')[0]
                .split('. Please')[0])
    else:
        text = text.split('. ')[0]
    text = ' '.join(text.split())[:200]
    return text if 'weights_only' not in text else 'not a file of tensors and plain values'


def check_contents(ckpt, path):
    """What a checkpoint of train_char.py holds, of the right types, and values no training writes
    (negative counts, non-finite weights, a negative mean squared gradient): said now, not as a
    diverging loss later."""
    needed = ('model', 'optimizer', 'scaler', 'model_args', 'config', 'vocab', 'iter_num',
              'best_val_loss', 'tokens', 'elapsed', 'rng')
    missing = [k for k in needed if k not in ckpt] if isinstance(ckpt, dict) else ['everything']
    if missing or not all(isinstance(ckpt[k], dict)
                          for k in ('model', 'model_args', 'config', 'optimizer')):
        die(f"{path} is not a checkpoint of train_char.py "
            f"(it lacks {', '.join(missing) or 'the right types'})")
    lacking = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in ckpt['model_args']]
    if lacking:
        die(f"{path} is damaged: its model_args lack {', '.join(lacking)}")
    elapsed = ckpt['elapsed']
    if type(elapsed) in (int, float) and -math.inf < elapsed < 0:
        # an older version timed runs by the wall clock, which an NTP correction can step back
        print(f"note: {path} holds a negative training time, elapsed={elapsed} s (a wall clock "
              "that stepped back under an older version): counted as 0", file=sys.stderr)
        ckpt['elapsed'] = 0.0
    numbers = dict(iter_num=int, tokens=int, best_val_loss=(int, float), elapsed=(int, float))
    # a negative iter_num would resume with negative learning rates; best_val_loss is inf while
    # no evaluation was saved (a run stopped before its first periodic checkpoint)
    wrong = [k for k, kind in numbers.items() if type(ckpt[k]) is bool
             or not isinstance(ckpt[k], kind) or not 0 <= ckpt[k] < math.inf
             and not (k == 'best_val_loss' and ckpt[k] == math.inf)]
    if wrong:
        die(f"{path} is damaged: {', '.join(wrong)} should be numbers of at least 0, and finite")
    vocab = ckpt['vocab']
    if not (isinstance(vocab, list) and vocab and len(set(vocab)) == len(vocab)
            and all(type(b) is int and 0 <= b < 256 for b in vocab)):
        die(f"{path} is damaged: vocab should be a list of distinct byte values")
    vocab_size = ckpt['model_args'].get('vocab_size')
    # its type is checked with the other settings
    if type(vocab_size) is int and len(vocab) > vocab_size:
        die(f"{path} is damaged: its vocab has {len(vocab)} symbols, more than the model's "
            f"vocab_size={vocab_size}")
    if 'data' in ckpt and not data_record_ok(ckpt['data']):   # an older version's has none
        die(f"{path} is damaged: its record of its data is not the dataset, its path and each "
            "corpus's name, vocabulary and digests")
    state = [s for s in ckpt['optimizer'].get('state', {}).values() if isinstance(s, dict)]
    if not all(torch.isfinite(t).all()
               for t in [*ckpt['model'].values(), *(t for s in state for t in s.values())]
               if isinstance(t, torch.Tensor) and t.is_floating_point()):
        die(f"{path} is damaged: it holds weights or optimizer state that are not finite numbers")
    if any(isinstance(s.get('exp_avg_sq'), torch.Tensor) and (s['exp_avg_sq'] < 0).any()
           for s in state):
        die(f"{path} is damaged: its optimizer state holds a negative exp_avg_sq "
            "(Adam's mean squared gradient)")


def data_record_ok(data):
    """Whether a checkpoint's `data` (dataset.record) has the form load_data reads."""
    def strings(d):
        return isinstance(d, dict) and all(isinstance(v, str) for v in [*d, *d.values()])
    return (isinstance(data, dict) and isinstance(data.get('dataset'), str)
            and isinstance(data.get('path', 0), (str, type(None)))
            and isinstance(data.get('corpora'), list)
            and all(isinstance(c, dict) and isinstance(c.get('name'), str)
                    and isinstance(c.get('vocab'), list) and strings(c.get('sha256'))
                    and isinstance(c.get('meta_sha256'), str) for c in data['corpora']))


def check_saved_settings(path, cfg, saved, fields, ranges):
    """The settings a resume takes from a checkpoint (saved: the run's, fields: its model's own
    copy) of their setting's type and within its rules, as if given as flags."""
    wrong = sorted({k for k, v in [*saved.items(), *fields.items()] if type(v) is not type(cfg[k])
                    and not (type(cfg[k]) is float and type(v) is int)})
    if wrong:
        die(f"{path} is damaged: its saved settings {', '.join(wrong)} are not of their "
            "setting's type")
    wrong = settings_problem(cfg | saved | fields, ranges)
    if wrong:
        die(f"{path} is damaged: a setting it saved fails its check ({wrong})")


def check_fit(model_args, ckpt, attention=None):
    """Whether the checkpoint's weights fit GPT(model_args): the same names and shapes, compared on
    the meta device (no memory), so that a resume whose settings no longer fit is refused before
    the data are loaded."""
    with torch.device('meta'):
        want = {k: tuple(v.shape)
                for k, v in GPT(model_config(model_args), attention).state_dict().items()}
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None
            for k, v in ckpt['model'].items()}
    differ = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    saved = ckpt['model_args']
    changed = [f"{k}={v!r} (the checkpoint's: {saved.get(k)!r})"
               for k, v in model_args.items() if saved.get(k) != v]
    # settings given now, in a config file or a flag, override the saved ones
    if differ and changed:
        die(f"the checkpoint's weights do not fit the model with {', '.join(changed)}: "
            "settings given in config files and flags override the checkpoint's; give the run's "
            "own, or none")
    if differ:
        die(f"the checkpoint's weights do not fit the model ({len(differ)} of its tensors, "
            f"e.g. {differ[0]}: saved {have.get(differ[0])}, the model's {want.get(differ[0])})")


def check_optimizer_state(optimizer):
    """Adam's moments of the shapes of their weights: a damaged one would fail the first step in a
    traceback."""
    wrong = [(tuple(t.shape), tuple(w.shape)) for g in optimizer.param_groups for w in g['params']
             for k, t in optimizer.state.get(w, {}).items() if k != 'step' and t.shape != w.shape]
    if wrong:
        die(f"the checkpoint is damaged: its optimizer state has a moment of shape {wrong[0][0]} "
            f"for a {wrong[0][1]} weight")
    steps = [float(s['step']) for s in optimizer.state.values() if 'step' in s]
    if not all(math.isfinite(n) and n >= 1 for n in steps):   # Adam divides by 1 - beta^step
        die("the checkpoint is damaged: its optimizer state has a step count below 1 (Adam's "
            "steps taken, which a saved state has at least one of)")
