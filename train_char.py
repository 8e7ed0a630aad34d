r"""
train_char.py: train character-level DAMCHA and MHA GPTs.

In the manner of nanoGPT's train.py: every setting has a default below; config files
(config/*.py, plain assignments) and then --key=value flags override them in the order given.

    python train_char.py                                # small DAMCHA on the bundled Shakespeare
    python train_char.py config/enwik8.py config/damcha.py   # one-GPU run: a dataset file, a model file
    python train_char.py --dataset=notes.txt --attn=mha --n_layer=2 --out_dir=out-notes
    python train_char.py --init_from=resume --out_dir=out-shakespeare --max_iters=3000
    torchrun --standalone --nproc_per_node=4 train_char.py config/enwik8.py config/damcha.py \
        --batch_size=8 --gradient_accumulation_steps=4      # the same 32 rows per step, on 4 GPUs
    python train_char.py config/text8.py config/mha.py --mode=config  # the settings it would run, as JSON

eval_char.py evaluates (bpc of whole splits), samples from and plots the runs it trains.

The datasets (shakespeare, enwik8, text8, their 50-50 mix, or any text file) are described in
data/prepare.py, which prepares them on their first use; mix draws each training row from enwik8
or text8 with probability 1/2, and its evaluations report both and their mean.
out_dir may name other settings in braces: 'out-enwik8-{attn}' is out-enwik8-mha for an MHA run.
A run writes to out_dir: ckpt.pt, log.jsonl (one line per evaluation: the curves) and
train_log.jsonl (one line per iteration: the losses that a resumed run reproduces exactly on CPU).
A resumed run keeps the checkpoint's settings except those you pass.
A training run holds out_dir/train.lock while it runs: a second run in the same out_dir is refused.
Ctrl-C stops a run (exit status 130) and says which checkpoint a resume will start from.
"""
import dataclasses
import errno
import json
import math
import os
import sys
import textwrap
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import (DIVERGED, HELD, append_jsonl, autocast_for, build_model, check_fit, check_kernel, check_run_settings, from_checkpoint,
                        load_checkpoint, lock_out_dir, model_config, pick_device, read_jsonl, why)
from configurator import configure, die
from damcha_torch import GPT, GPTConfig, get_lr
from data.prepare import atomic_write, check_lengths, corpora, decode, draw_rows, encode, get_batch, load_dataset

# ---------------------------------------------------------------------------------------------
# Defaults: a small DAMCHA that learns Shakespeare in about two minutes on two idle CPU cores.
DEFAULTS = dict(
    mode='train',                 # train | config (print the settings as JSON)
    out_dir='out-shakespeare',    # ckpt.pt and logs
    init_from='scratch',          # scratch | resume (continue out_dir/ckpt.pt)
    dataset='shakespeare',        # shakespeare | enwik8 | text8 | mix | path to a text file
    data_dir='',                  # prepared datasets go in <data_dir>/<name>/; '' is data/ beside this file
    seed=1337,
    device='auto',                # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype='auto',                 # auto (CUDA: bfloat16 if supported, else float16; float32 elsewhere)
    compile=False,                # torch.compile: faster on a GPU, minutes of warm-up on a CPU
    # training
    batch_size=12,                # rows per micro-batch and process
    gradient_accumulation_steps=1,  # micro-batches per iteration over all processes together
    max_iters=2000,
    learning_rate=2e-3,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.99,
    grad_clip=1.0,                # 0: off
    decay_lr=True,                # linear warm-up, then cosine decay to min_lr at lr_decay_iters
    warmup_iters=100,
    lr_decay_iters=2000,          # set it with max_iters
    min_lr=2e-4,
    eval_interval=250,
    eval_iters=10,                # batches (of an iteration's rows) per split for the loss estimates logged while training
    log_interval=10,
    always_save_checkpoint=True,  # False: save only when the val loss improves
    snapshot_iters='',            # e.g. 0,1000,5000: also keep the weights at these iterations,
                                  # as float16, in out_dir/snapshot-<iter>.pt (notebooks/04 reads them)
    # the sample printed after training
    start='',                     # prompt, or FILE:path; '' is a newline (a space for text8)
    num_samples=1,
    max_new_tokens=500,
    temperature=0.8,
    top_k=0,                      # 0: sample from the whole distribution
)
# every GPTConfig field is a setting; vocab_size 0 means the dataset's vocabulary size. At this
# size, generator width 30 gives DAMCHA MHA's parameter count (damcha_torch.equal_params_width), so
# `python train_char.py` and `python train_char.py --attn=mha` compare at equal parameters
MODEL_DEFAULTS = dict(vocab_size=0, block_size=64, n_layer=4, n_head=4, n_embd=128,
                      gen_out='folded', gen_depth=2, gen_width=30)
MODEL_KEYS = [f.name for f in dataclasses.fields(GPTConfig)]
DEFAULTS.update({f.name: MODEL_DEFAULTS.get(f.name, f.default) for f in dataclasses.fields(GPTConfig)})
CHOICES = dict(mode=('train', 'config'), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
POSITIVE = ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'eval_iters', 'log_interval',
            'num_samples', 'temperature', 'learning_rate', 'block_size', 'max_iters')
NON_NEGATIVE = ('warmup_iters', 'lr_decay_iters', 'min_lr', 'weight_decay', 'grad_clip',
                'max_new_tokens', 'top_k', 'vocab_size')
RANGES = (CHOICES, POSITIVE, NON_NEGATIVE)
LN2 = math.log(2)


# ---------------------------------------------------------------------------------------------
# Configuration

def parse_config(argv):
    """Defaults, then each config file or --key=value in order. Returns (config, keys given)."""
    cfg, given = configure(DEFAULTS, argv, *RANGES, doc=__doc__)
    try:   # a dataset config file names its runs' folders after the model: out-enwik8-{attn}
        cfg['out_dir'] = cfg['out_dir'].format(**cfg)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        die(f"out_dir={cfg['out_dir']!r}: braces must hold a setting's name, as in out-enwik8-{{attn}} ({e!r})")
    check_run_settings(cfg, RANGES)
    return cfg, given


# ---------------------------------------------------------------------------------------------
# Checkpoints (reading them, the logs, the lock and the model: checkpoint.py)

def parse_iters(text, start, max_iters, whose='given'):
    """'0,1000,5000' -> {0, 1000, 5000}; anything else, or an iteration the run never reaches (from
    start, where a resumed run begins, to max_iters), is a one-line error. whose: where the list
    came from, for that error."""
    try:
        iters = {int(t) for t in text.split(',') if t.strip()}
    except ValueError:
        die(f"snapshot_iters={text!r}: give iterations as comma-separated whole numbers, e.g. 0,1000,5000")
    outside = sorted(i for i in iters if not start <= i <= max_iters)
    if outside:
        die(f"snapshot_iters ({whose}): {outside} outside this run's iterations {start}..{max_iters}"
            + ("; --snapshot_iters= sets others, or none" if whose != 'given' else ''))
    return iters


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
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)


def save(run, name, obj):
    """torch.save into out_dir/name through atomic_write: on any failure the partial file is gone
    (atomic_write) and the previous one stays; the run ends with one line."""
    try:
        with atomic_write(run.path(name)) as f:
            torch.save(obj, f)
    except Exception as e:
        if interrupted(e):   # Ctrl-C inside torch.save, which reports it as an error of its own
            raise KeyboardInterrupt from None
        die(f"could not save {run.path(name)}: {why(e)}; the partial file was removed; "
            + last_good(run))


def interrupted(e):
    """Whether a Ctrl-C (KeyboardInterrupt) is among the exceptions that led to e."""
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__context__
    return e is not None


def last_good(run):
    return (f"{run.path('ckpt.pt')} (iter {run.saved_iter}) is the last good checkpoint"
            if run.saved_iter is not None else "no checkpoint was written yet")


# ---------------------------------------------------------------------------------------------
# Training: set up a Run, then loop over log, evaluate, checkpoint, snapshot and step

@dataclasses.dataclass
class Run:
    """What a training run carries from one step to the next."""
    cfg: dict
    model_args: dict
    ckpt: dict | None                    # the checkpoint this run resumes, or None
    ddp: bool                            # started by torchrun: one process per device
    rank: int
    local_rank: int                      # the process's device on its machine
    world: int                           # processes
    accum: int                           # micro-batches per iteration and process
    device: str
    dtype: str
    ctx: object                          # autocast, or nullcontext for float32
    components: list = None              # the dataset (load_dataset)
    vocab: list = None
    prompt: list = None                  # of the sample printed after training
    model: torch.nn.Module = None        # what the train step calls: compiled, wrapped in DDP
    raw_model: GPT = None                # the weights, for saving and for the MFU estimate
    fast_model: torch.nn.Module = None   # compiled but not DDP: evaluations run on rank 0 alone
    optimizer: torch.optim.Optimizer = None
    scaler: torch.amp.GradScaler = None
    batches: torch.Generator = None      # draws the training rows; the same on every process
    snapshots: set = dataclasses.field(default_factory=set)
    iter_num: int = 0
    start_iter: int = 0
    best_val: float = float('inf')
    tokens: int = 0
    elapsed: float = 0.0                 # seconds of training before this process, from the checkpoint
    saved_iter: int | None = None        # the iteration of the checkpoint on disk
    lr: float = 0.0
    pending: list = dataclasses.field(default_factory=list)   # (iter, lr, loss tensor) not yet logged
    since_eval: list = dataclasses.field(default_factory=lambda: [0, 0.0])   # iterations, seconds
    t_run: float = 0.0
    t_flush: float = 0.0

    @property
    def master(self):
        return self.rank == 0

    @property
    def rows_per_iter(self):   # of all processes together
        return self.cfg['batch_size'] * self.cfg['gradient_accumulation_steps']

    @property
    def tokens_per_iter(self):
        return self.rows_per_iter * self.model_args['block_size']

    def path(self, name):
        return os.path.join(self.cfg['out_dir'], name)


def lr_at(it, cfg):
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    return get_lr(it, cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'], cfg['min_lr'])


def resolve(cfg, given):
    """(settings, model fields, checkpoint or None), checked before anything is downloaded or
    built. A resumed run locks out_dir (rank 0) before it reads the checkpoint, so the checkpoint
    cannot change under it; a new run locks it once its input is checked (hold)."""
    ckpt = None
    if cfg['init_from'] == 'resume':
        if os.environ.get('RANK', '0') == '0' and os.path.isdir(cfg['out_dir']):
            lock_out_dir(cfg['out_dir'])
        cfg, model_args, ckpt = resumed(cfg, given)
    elif os.path.exists(os.path.join(cfg['out_dir'], 'ckpt.pt')):
        die(f"{os.path.join(cfg['out_dir'], 'ckpt.pt')} exists: continue it with --init_from=resume, "
            "or choose another --out_dir")
    else:
        model_args = {k: cfg[k] for k in MODEL_KEYS}
        model_config(model_args | {'vocab_size': model_args['vocab_size'] or 1})   # fail before downloading
    return cfg, model_args, ckpt


def resumed(cfg, given):
    """A resumed run's (settings, model fields, checkpoint): the checkpoint's settings overridden
    by those given, checked as the run needs them."""
    ckpt = load_checkpoint(cfg['out_dir'])
    cfg, model_args = from_checkpoint(ckpt, cfg, given, RANGES)
    check_fit(model_args, ckpt)
    if ckpt['iter_num'] >= cfg['max_iters']:
        die(f"the checkpoint is at iter {ckpt['iter_num']} and max_iters={cfg['max_iters']}: "
            "raise max_iters to train further")
    if 'snapshot_iters' in given:   # asked for now: none before the resume (those saved earlier are kept)
        parse_iters(cfg['snapshot_iters'], ckpt['iter_num'], cfg['max_iters'])
    else:
        parse_iters(cfg['snapshot_iters'], 0, cfg['max_iters'], "the checkpoint's")
    return cfg, model_args, ckpt


def hold(run):
    """out_dir locked by rank 0 for the rest of the run: a new run takes the lock here, once all
    its input has been checked (no out_dir is made for a run that fails on a bad flag), and looks
    again for a checkpoint that a run ending meanwhile may have left."""
    if run.master and not HELD:
        lock_out_dir(run.cfg['out_dir'])
        if os.path.exists(run.path('ckpt.pt')):
            die(f"{run.path('ckpt.pt')} exists: continue it with --init_from=resume, or choose another --out_dir")


def start_processes(cfg, model_args, ckpt):
    """The Run of this process: under torchrun it joins the process group, one device each."""
    ddp = 'RANK' in os.environ
    rank, local_rank, world = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                               int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
    snapshots = parse_iters(cfg['snapshot_iters'], 0, cfg['max_iters'])
    if cfg['gradient_accumulation_steps'] % world:
        die(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple of "
            f"the {world} processes")
    device = pick_device(cfg['device'], local_rank)
    dtype, ctx = autocast_for(device, cfg['dtype'])
    check_kernel(model_args['kernel'], device, dtype)
    if ddp:
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return Run(cfg, model_args, ckpt, ddp, rank, local_rank, world, cfg['gradient_accumulation_steps'] // world,
               device, dtype, ctx, snapshots=snapshots, iter_num=ckpt['iter_num'] if ckpt else 0,
               saved_iter=ckpt['iter_num'] if ckpt else None)   # known from here, for a Ctrl-C message


def load_data(run):
    """The dataset, and with it the vocabulary size of a new model."""
    if run.ddp and not run.master:
        try:
            dist.barrier()   # rank 0 downloads and prepares the data, the others then only read it
        except RuntimeError:  # rank 0 stopped: its own error says why
            die("rank 0 stopped before the data were ready; its error is above")
    run.components, run.vocab = load_dataset(run.cfg['dataset'], run.cfg['data_dir'],
                                             run.ckpt['vocab'] if run.ckpt else None)
    if run.ddp and run.master:
        dist.barrier()
    if run.ckpt is None:
        vocab_size = run.model_args['vocab_size']
        if vocab_size and vocab_size < len(run.vocab):
            die(f"vocab_size={vocab_size} is smaller than the dataset's {len(run.vocab)} symbols")
        run.model_args['vocab_size'] = run.cfg['vocab_size'] = vocab_size or len(run.vocab)
    check_lengths(run.components, ('train', 'val'), run.model_args['block_size'])
    run.prompt = encode(run.cfg['start'], run.vocab, run.model_args['block_size'])   # fails now, not after training


def build(run):
    """Model, optimizer and loss scaler, restored from the checkpoint when resuming."""
    cfg = run.cfg
    torch.manual_seed(cfg['seed'] + run.rank)
    run.raw_model = build_model(run.model_args, run.ckpt).to(run.device)
    run.optimizer = run.raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                                       (cfg['beta1'], cfg['beta2']), run.device.split(':')[0])
    run.scaler = torch.amp.GradScaler('cuda', enabled=(run.dtype == 'float16'))
    run.batches = torch.Generator().manual_seed(cfg['seed'])   # the same on every process: see train_step
    if run.ckpt is not None:
        restore(run.ckpt, run.optimizer, run.scaler, run.batches, run.rank, run.device)
        run.best_val, run.tokens, run.elapsed = (run.ckpt[k] for k in ('best_val_loss', 'tokens', 'elapsed'))
    run.start_iter = run.iter_num
    run.fast_model = torch.compile(run.raw_model) if cfg['compile'] else run.raw_model
    run.model = run.fast_model
    if run.ddp:
        run.model = DDP(run.fast_model, device_ids=[run.local_rank] if run.device.startswith('cuda') else None)


def start_logs(run):
    """Empty logs, or a resumed run's logs cut at its checkpoint: later lines belong to the part of
    the interrupted run that it is about to redo. A checkpoint at iteration k is saved after the
    evaluation at k and before the step of k, which the resumed run takes again: log.jsonl keeps
    iter <= k and train_log.jsonl iter < k, so no line is repeated or lost."""
    k = run.iter_num
    for name, keep in (('log.jsonl', lambda it: it <= k), ('train_log.jsonl', lambda it: it < k)):
        path = run.path(name)
        entries = read_jsonl(path) if run.ckpt and os.path.isfile(path) else []
        if not all(isinstance(e.get('iter'), int) for e in entries):
            die(f"{path} has an entry without an iteration number: not a log of train_char.py")
        kept = [e for e in entries if keep(e['iter'])]
        with atomic_write(path) as f:
            f.write(''.join(json.dumps(e) + '\n' for e in kept).encode())
    print(f"{sum(p.numel() for p in run.raw_model.parameters()):,} parameters; {run.tokens_per_iter:,} tokens "
          f"per iteration ({run.world} x {run.accum} x {run.cfg['batch_size']} x {run.model_args['block_size']}); "
          f"device {run.device}, {run.dtype}")


class Diverged(Exception):
    """A non-finite loss: train() says it in one line and exits with status DIVERGED, which tells
    a sweep (reproduce.py) that the run diverged rather than failed."""


def stop(run, what, value, it):
    """A non-finite loss ends the run, on every process, without saving the bad weights."""
    raise Diverged(f"the {what} loss became {value} at iter {it}; stopped without saving: {last_good(run)}; "
                   "try a lower learning_rate")


def log_losses(run, bar):
    """The pending iterations' losses: one device sync and one all-reduce per log line, not per
    iteration. Every process checks them, so all stop together on a non-finite one."""
    losses = torch.stack([loss for _, _, loss in run.pending])
    if run.ddp:
        dist.all_reduce(losses)
        losses /= run.world
    seconds, run.t_flush = time.time() - run.t_flush, time.time()
    dt = seconds / len(run.pending)
    run.since_eval[0] += len(run.pending)
    run.since_eval[1] += seconds
    for (it, _, _), loss in zip(run.pending, losses.tolist()):
        if not math.isfinite(loss):
            stop(run, 'training', loss, it)
    if run.master:
        append_jsonl(run.path('train_log.jsonl'), [dict(iter=it, loss=loss, lr=lr) for (it, lr, _), loss
                                                   in zip(run.pending, losses.tolist())])
        mfu = ''   # against an H100 / H200's peak: meaningless elsewhere
        if run.device.startswith('cuda'):
            rows = run.cfg['batch_size'] * run.accum   # this process's, in dt
            mfu = f", mfu {run.raw_model.estimate_mfu(rows, dt, getattr(torch, run.dtype)):.2%}"
        bar.write(f"iter {run.iter_num}: loss {losses.mean().item():.4f}, lr {run.lr:.2e}, "
                  f"{dt * 1000:.1f} ms/iter, {run.tokens_per_iter / dt:,.0f} tokens/s{mfu}")
    run.pending = []


def evaluate_and_save(run, bar):
    """Loss estimates on rank 0, logged; the checkpoint saved if it is due."""
    states = rng_states(run.ddp)   # before evaluating, as the next train step will find them
    if run.master:
        losses = estimate_loss(run.fast_model, run.components, run.cfg, run.device, run.ctx)
    val_loss = torch.tensor(losses['val_loss'] if run.master else 0.0, device=run.device)
    if run.ddp:
        dist.broadcast(val_loss, 0)   # only rank 0 evaluates, but every process must stop
    if not math.isfinite(val_loss.item()):
        stop(run, 'val', val_loss.item(), run.iter_num)
    if run.master:
        since, seconds = run.since_eval
        entry = dict(iter=run.iter_num, tokens=run.tokens, time=round(run.elapsed + time.time() - run.t_run, 3),
                     lr=lr_at(run.iter_num, run.cfg),   # of the step this iteration takes, as in train_log.jsonl
                     tokens_per_sec=since * run.tokens_per_iter / seconds if since else 0.0, **losses)
        append_jsonl(run.path('log.jsonl'), [entry])
        each = ''.join(f", {k.removeprefix('val_bpc_')} {v:.4f}" for k, v in losses.items() if k.startswith('val_bpc_'))
        bar.write(f"eval {run.iter_num}: train loss {losses['train_loss']:.4f}, val loss "
                  f"{losses['val_loss']:.4f}, val bpc {losses['val_bpc']:.4f}{each}")
        if run.iter_num > run.start_iter and (losses['val_loss'] < run.best_val or run.cfg['always_save_checkpoint']):
            run.best_val = min(run.best_val, losses['val_loss'])
            save_checkpoint(run, states, entry['time'])
    run.since_eval = [0, 0.0]
    run.t_flush = time.time()


def save_checkpoint(run, states, elapsed):
    checkpoint = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                      scaler=run.scaler.state_dict(), model_args=run.model_args, config=run.cfg,
                      vocab=run.vocab, iter_num=run.iter_num, best_val_loss=run.best_val, tokens=run.tokens,
                      elapsed=elapsed, rng=dict(batches=run.batches.get_state(), torch=states))
    save(run, 'ckpt.pt', checkpoint)
    run.saved_iter = run.iter_num


def save_snapshot(run):
    """The weights only, in float16: for looking at (the learned metric over training), not for resuming."""
    weights = {k: v.to(torch.float16) for k, v in run.raw_model.state_dict().items()}
    snapshot = dict(model=weights, model_args=run.model_args, vocab=run.vocab, iter_num=run.iter_num)
    save(run, f'snapshot-{run.iter_num}.pt', snapshot)


def train_step(run):
    """One iteration. Every process draws the same rows for the whole iteration (the same
    generator, seeded alike) and takes its own micro-batches from them: rank r does rows
    r*accum .. r*accum+accum-1 of batch_size each. So a run on N processes sees exactly the data
    of a run on one, and only rank 0's generator state needs saving."""
    cfg, T = run.cfg, run.model_args['block_size']
    run.lr = lr_at(run.iter_num, cfg)
    for group in run.optimizer.param_groups:
        group['lr'] = run.lr
    which, offsets = draw_rows(run.components, 'train', run.rows_per_iter, T, run.batches)
    total = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = (run.rank * run.accum + micro) * cfg['batch_size']
        rows = slice(first, first + cfg['batch_size'])
        x, y = get_batch(run.components, 'train', which[rows], offsets[rows], T, run.device)
        if run.ddp:
            run.model.require_backward_grad_sync = micro == run.accum - 1   # all-reduce once, at the last
        with run.ctx:
            _, loss = run.model(x, y)
            loss = loss / run.accum
        total += loss.detach()
        run.scaler.scale(loss).backward()
    if cfg['grad_clip']:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg['grad_clip'])
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.pending.append((run.iter_num, run.lr, total))
    run.iter_num += 1
    run.tokens += run.tokens_per_iter


def finish(run):
    """The summary line and num_samples samples from the trained model."""
    print(f"done: iter {run.iter_num}, {time.time() - run.t_run:.0f} s; best val loss {run.best_val:.4f} "
          f"({run.best_val / LN2:.4f} bpc)")
    run.raw_model.eval()
    torch.manual_seed(run.cfg['seed'])
    with run.ctx:
        out = run.raw_model.generate(torch.tensor([run.prompt] * run.cfg['num_samples'], device=run.device),
                                     run.cfg['max_new_tokens'], run.cfg['temperature'], run.cfg['top_k'] or None)
    for row in out.tolist():
        print('sample:\n' + decode(row, run.vocab))


@torch.no_grad()
def estimate_loss(model, components, cfg, device, ctx):
    """Mean loss over eval_iters batches per split and component. The batches are the same at
    every evaluation (their own generator, reseeded), so curves are not noisy from resampling.
    A batch is one iteration's rows, batch_size x gradient_accumulation_steps, scored in
    micro-batches of batch_size: the estimate does not depend on how a run splits its rows
    into micro-batches and processes."""
    model.eval()
    out = {}
    rows, B = cfg['batch_size'] * cfg['gradient_accumulation_steps'], cfg['batch_size']
    for split in ('train', 'val'):
        per_component = {}
        for c in components:
            generator = torch.Generator().manual_seed(cfg['seed'])
            losses = []
            for _ in range(cfg['eval_iters']):
                which, offsets = draw_rows([c], split, rows, cfg['block_size'], generator)
                for first in range(0, rows, B):
                    with ctx:
                        x, y = get_batch([c], split, which[first:first + B], offsets[first:first + B],
                                         cfg['block_size'], device)
                        losses.append(model(x, y)[1])
            losses = torch.stack(losses).tolist()   # one device sync per component, not one per batch
            per_component[c['name']] = sum(losses) / len(losses)
        out[f'{split}_loss'] = sum(per_component.values()) / len(components)
        if len(components) > 1:
            out |= {f'{split}_loss_{name}': loss for name, loss in per_component.items()}
    model.train()
    return out | {k.replace('_loss', '_bpc'): v / LN2 for k, v in out.items() if k.startswith('val')}


def rng_states(ddp):
    """Every process's torch RNG state (dropout), gathered so rank 0 can save them all."""
    state = (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
    if not ddp:
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def train(cfg, given):
    try:
        cfg, model_args, ckpt = resolve(cfg, given)
        run = start_processes(cfg, model_args, ckpt)
        try:
            train_run(run)
        except KeyboardInterrupt:   # Ctrl-C: no traceback; what is on disk is whole (atomic_write)
            if run.master:
                print(f"interrupted at iter {run.iter_num}: " + (
                    f"a resume (--init_from=resume) starts from {run.path('ckpt.pt')} at iter {run.saved_iter}"
                    if run.saved_iter is not None else "no checkpoint was written yet: a rerun starts from scratch"),
                    file=sys.stderr)
            raise SystemExit(130)
        except Diverged as e:   # raised inside the progress bar's with-block, said once it is closed
            if run.master:
                print(f"error: {e}", file=sys.stderr)
            raise SystemExit(DIVERGED)
    finally:   # the process ending releases the lock anyway; this is for train() called in-process
        while HELD:
            HELD.pop().close()


def train_run(run):
    cfg = run.cfg
    load_data(run)   # first: a missing dataset or a bad prompt is then the only line printed
    hold(run)        # and so is a refused out_dir
    if run.master:   # with vocab_size as the dataset gave it
        print('config:\n' + textwrap.indent(textwrap.fill(
            ' '.join(f'{k}={v!r}' for k, v in cfg.items()), 100, break_long_words=False), '  '))
    build(run)
    if run.master:
        start_logs(run)
    run.t_run = run.t_flush = time.time()
    # the with-block closes the progress bar also when die() stops the run mid-line
    with tqdm(total=cfg['max_iters'], initial=run.iter_num, disable=not run.master, unit='it',
              dynamic_ncols=True) as bar:
        while True:
            last = run.iter_num >= cfg['max_iters']
            evaluating = run.iter_num % cfg['eval_interval'] == 0 or last
            if run.pending and (run.iter_num % cfg['log_interval'] == 0 or evaluating):
                log_losses(run, bar)
            if evaluating and (run.iter_num > run.start_iter or run.ckpt is None):
                evaluate_and_save(run, bar)
            if run.master and run.iter_num in run.snapshots:
                save_snapshot(run)
            if last:
                break
            train_step(run)
            bar.update()
    if run.master:
        finish(run)
    if run.ddp:   # all processes tear the group down together: one that leaves while rank 0 is still
        dist.barrier()   # saving and sampling was seen (once, under gloo) to abort at its exit
        dist.destroy_process_group()


def show_config(cfg, given):
    """The settings a run of these arguments starts from, as JSON (reproduce.py reads them): for
    a resumed run, its checkpoint's overridden by those given. What the run would refuse (a model
    it could not build, or whose weights no longer fit; a resume with nothing to train; a dataset
    that is neither named nor a file) is refused."""
    if cfg['init_from'] == 'resume':
        cfg, model_args, ckpt = resumed(cfg, given)
    model_config({k: cfg[k] for k in MODEL_KEYS} | {'vocab_size': cfg['vocab_size'] or 1})
    corpora(cfg['dataset'], cfg['data_dir'])
    print(json.dumps(cfg, indent=2))


def main(argv):
    cfg, given = parse_config(argv)
    modes = dict(train=train, config=show_config)
    try:
        modes[cfg['mode']](cfg, given)
    except OSError as e:   # an unwritable out_dir, a full disk: the system's own one-line reason
        die(why(e) if e.errno == errno.ENOSPC else e)
    except KeyboardInterrupt:   # Ctrl-C before training started
        print("interrupted", file=sys.stderr)
        raise SystemExit(130)


if __name__ == '__main__':
    main(sys.argv[1:])
