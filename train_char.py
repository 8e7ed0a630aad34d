r"""
train_char.py: train character-level DAMCHA and MHA GPTs, as nanoGPT's train.py trains GPT-2.

    python train_char.py                                     # small DAMCHA on the bundled Shakespeare
    python train_char.py config/enwik8.py config/damcha.py   # one GPU: a dataset file, then a model file
    python train_char.py --dataset=notes.txt --attn=mha --out_dir=out-notes   # any text file
    python train_char.py --init_from=resume --out_dir=out-shakespeare --max_iters=3000
    torchrun --standalone --nproc_per_node=4 train_char.py config/enwik8.py config/damcha.py \
        --batch_size=8 --gradient_accumulation_steps=4      # the same 32 rows per step, on 4 GPUs
    python train_char.py config/text8.py config/mha.py --mode=config   # the settings it would run, as JSON
    python train_char.py --help                              # every setting: its default, what it does

Settings: the defaults below, then config files and --key=value flags in order; a resumed run keeps
its checkpoint's, but those given. data/prepare.py prepares a dataset on first use, into data/<name>/.
A run writes out_dir/ckpt.pt, log.jsonl (each evaluation) and train_log.jsonl (each iteration), and
checkpoint.py keeps that folder safe. Ctrl-C, SIGTERM or SIGHUP stops a run, saying where a resume
starts. eval_char.py evaluates, samples from and plots the runs.
"""
import dataclasses
import json
import math
import os
import sys
import textwrap
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import damcha_torch
from checkpoint import (HELD, Diverged, append_jsonl, autocast_for, build_model, cut_logs, lock_out_dir,
                        no_checkpoint_in, pick_device, restore, resume, rng_states, save, stopped, unlock)
from checks import check_fits, check_kernel, check_run_settings, model_config, one_line_errors, snapshot_iterations
from configurator import configure, die, signals_as_ctrl_c, tolerant_stdout
from damcha_torch import GPTConfig, get_lr
from data.prepare import check_lengths, corpora, decode, encode, load_dataset

# ---------------------------------------------------------------------------------------------
# Settings: a small DAMCHA that learns Shakespeare in minutes on a CPU. The comment beside each
# default is its description in --help.
DEFAULTS = dict(
    mode='train',                 # train | config (print the settings a run would use, as JSON)
    out_dir='out-shakespeare',    # the run's folder (ckpt.pt, logs); {setting} takes a setting's value
    init_from='scratch',          # scratch | resume (continue out_dir/ckpt.pt with its settings, but those given)
    dataset='shakespeare',        # shakespeare | enwik8 | text8 | mix | path to a text file
    data_dir='',                  # prepared data go in <data_dir>/<dataset, or a text file's stem-digest>/; '': data/
    seed=1337,                    # of the weights, the training rows and dropout
    device='auto',                # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype='auto',                 # auto (CUDA: bfloat16 if supported, else float16; float32 elsewhere)
    compile=False,                # torch.compile: faster on a GPU, minutes of warm-up on a CPU
    # training
    batch_size=12,                # rows per micro-batch and process
    gradient_accumulation_steps=1,  # micro-batches per iteration over all processes together
    max_iters=2000,               # iterations (optimizer steps) of the whole run
    learning_rate=2e-3,           # the peak, reached after warm-up
    weight_decay=0.1,             # AdamW's, of tensors with 2 or more dimensions
    beta1=0.9,                    # AdamW's decay rate of the gradient's mean
    beta2=0.99,                   # AdamW's decay rate of the gradient's square
    grad_clip=1.0,                # largest gradient norm; 0: no clipping
    decay_lr=True,                # linear warm-up, then cosine decay to min_lr; False: learning_rate throughout
    warmup_iters=100,             # iterations of warm-up; unless set, min(100, max_iters // 10)
    lr_decay_iters=2000,          # iteration where the decay reaches min_lr; unless set, max_iters
    min_lr=2e-4,                  # the rate at and after lr_decay_iters
    eval_interval=250,            # iterations between loss estimates (and checkpoints)
    eval_iters=10,                # batches (of an iteration's rows) per split for each loss estimate
    log_interval=10,              # iterations between printed training losses
    always_save_checkpoint=True,  # False: save only when the val loss improves
    snapshot_iters='',            # e.g. 0,1000,5000: also keep the weights at these iterations,
                                  # as float16, in out_dir/snapshot-<iter>.pt (notebooks/04 reads them)
    # the sample printed after training
    start='',                     # prompt, or FILE:path; '' is a newline (a space for text8)
    num_samples=1,                # samples printed after training
    max_new_tokens=500,           # characters per sample
    temperature=0.8,              # below 1: likelier characters; above 1: more varied ones
    top_k=0,                      # sample from the k likeliest characters; 0: from all
)
# every GPTConfig field is a setting too (damcha_torch.py describes them); the trainer's defaults:
MODEL_DEFAULTS = dict(
    vocab_size=0,                 # V; 0: the dataset's number of distinct bytes
    block_size=64, n_layer=4, n_head=4, n_embd=128, gen_out='folded', gen_depth=2,
    gen_width=30)                 # w, f's hidden width; 30: here DAMCHA has MHA's parameter count
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


def parse_config(argv):
    """Defaults, then each config file or --key=value in order; out_dir's braces filled in, and the
    schedule fitted to max_iters where it was not set. Returns (config, keys given)."""
    cfg, given = configure(DEFAULTS, argv, *RANGES, doc=__doc__, described_in=(__file__, damcha_torch.__file__))
    try:   # a dataset config file names its runs' folders after the model: out-enwik8-{attn}
        cfg['out_dir'] = cfg['out_dir'].format(**cfg)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        die(f"out_dir={cfg['out_dir']!r}: braces must hold a setting's name, as in out-enwik8-{{attn}} ({e!r})")
    if 'lr_decay_iters' not in given:   # a resumed run keeps its checkpoint's (from_checkpoint)
        cfg['lr_decay_iters'] = cfg['max_iters']
    if 'warmup_iters' not in given:
        cfg['warmup_iters'] = min(DEFAULTS['warmup_iters'], cfg['max_iters'] // 10)
    check_run_settings(cfg, RANGES)
    return cfg, given


def plan(cfg, given):
    """(settings, model fields, checkpoint or None, snapshot iterations) of the run these arguments
    ask for, checked before anything is downloaded or built."""
    ckpt = None
    if cfg['init_from'] == 'resume':
        cfg, model_args, ckpt = resume(cfg, given, RANGES)
        if ckpt['iter_num'] >= cfg['max_iters']:
            die(f"the checkpoint is at iter {ckpt['iter_num']} and max_iters={cfg['max_iters']}: "
                "raise max_iters to train further")
    else:
        model_args = {k: cfg[k] for k in MODEL_KEYS}
        model_config(model_args | {'vocab_size': model_args['vocab_size'] or 1})   # fail before downloading
    if cfg['decay_lr'] and cfg['min_lr'] > cfg['learning_rate']:   # the decay would raise the rate
        die(f"min_lr={cfg['min_lr']} is above learning_rate={cfg['learning_rate']}: give a min_lr at most the peak")
    return cfg, model_args, ckpt, snapshot_iterations(cfg, given, ckpt)


def show_config(cfg, given):
    """The settings a run of these arguments starts from, as JSON, refused as the run would refuse them."""
    cfg, *_ = plan(cfg, given)
    corpora(cfg['dataset'], cfg['data_dir'])   # a dataset that is neither named nor a file
    print(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------------------------
# Data: rows drawn from the splits that data/prepare.py maps into memory

def get_batch(components, split, n, block_size, generator, device):
    """n rows: inputs x and next-token targets y, (n, block_size) int64 on device. Each row's corpus
    is drawn uniformly (mix: enwik8 or text8), then its start uniformly over that split."""
    which = torch.randint(len(components), (n,), generator=generator)
    room = torch.tensor([len(c['splits'][split]) - block_size for c in components], dtype=torch.float64)
    starts = (torch.rand(n, generator=generator, dtype=torch.float64) * room[which]).long()
    rows = []
    for c, s in zip(which.tolist(), starts.tolist()):
        row = torch.from_numpy(components[c]['splits'][split][s:s + block_size + 1].astype(np.int64))
        rows.append(row if components[c]['lut'] is None else components[c]['lut'][row])
    xy = torch.stack(rows)
    xy = xy.pin_memory().to(device, non_blocking=True) if device.startswith('cuda') else xy.to(device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()   # contiguous: models may .view() them


@torch.no_grad()
def estimate_loss(model, components, cfg, device, ctx):
    """Mean loss over eval_iters batches per split and component: the same batches at every evaluation
    (their own generator, reseeded), each an iteration's rows, however a run splits them into
    micro-batches and processes."""
    model.eval()
    out = {}
    rows, B = cfg['batch_size'] * cfg['gradient_accumulation_steps'], cfg['batch_size']
    for split in ('train', 'val'):
        per_component = {}
        for c in components:
            generator = torch.Generator().manual_seed(cfg['seed'])
            losses = []
            for _ in range(cfg['eval_iters']):
                X, Y = get_batch([c], split, rows, cfg['block_size'], generator, device)
                for first in range(0, rows, B):
                    with ctx:
                        losses.append(model(X[first:first + B], Y[first:first + B])[1])
            losses = torch.stack(losses).tolist()   # one device sync per component, not one per batch
            per_component[c['name']] = sum(losses) / len(losses)
        out[f'{split}_loss'] = sum(per_component.values()) / len(components)
        if len(components) > 1:
            out |= {f'{split}_loss_{name}': loss for name, loss in per_component.items()}
    model.train()
    return out | {k.replace('_loss', '_bpc'): v / LN2 for k, v in out.items() if k.startswith('val')}


# ---------------------------------------------------------------------------------------------
# Training

@dataclasses.dataclass
class Process:
    """This process: one of torchrun's (rank 0, the master, alone evaluates, logs and saves) or the only one."""
    ddp: bool
    rank: int
    world: int
    device: str
    dtype: str
    ctx: object                          # autocast, or nullcontext for float32
    master: bool


@dataclasses.dataclass
class Progress:
    """Where the run stands; ckpt.pt records all but saved_iter."""
    iter_num: int = 0
    best_val_loss: float = math.inf
    tokens: int = 0
    elapsed: float = 0.0                 # seconds of training
    saved_iter: int | None = None        # the iteration of the ckpt.pt on disk


def start_process(cfg, model_args):
    ddp = 'RANK' in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
    if cfg['gradient_accumulation_steps'] % world:
        die(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple of "
            f"the {world} processes")
    device = pick_device(cfg['device'], local_rank)
    dtype, ctx = autocast_for(device, cfg['dtype'])
    check_kernel(model_args['kernel'], device, dtype)
    if ddp:
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return Process(ddp, rank, world, device, dtype, ctx, master=rank == 0)


def load_data(cfg, model_args, ckpt, p):
    """The dataset (components, vocabulary) and the prompt of the sample after training, checked
    now rather than after training; with them a new model's vocabulary size."""
    if p.ddp and not p.master:
        try:
            dist.barrier()   # rank 0 downloads and prepares the data, the others then only read it
        except RuntimeError:  # rank 0 stopped: its own error says why
            die("rank 0 stopped before the data were ready; its error is above")
    components, vocab = load_dataset(cfg['dataset'], cfg['data_dir'], ckpt['vocab'] if ckpt else None)
    if p.ddp and p.master:
        dist.barrier()
    if ckpt is None:
        vocab_size = model_args['vocab_size']
        if vocab_size and vocab_size < len(vocab):
            die(f"vocab_size={vocab_size} is smaller than the dataset's {len(vocab)} symbols")
        model_args['vocab_size'] = cfg['vocab_size'] = vocab_size or len(vocab)
    check_lengths(components, ('train', 'val'), model_args['block_size'])
    check_fits(cfg, 'batch_size', p.device, training=True)   # an impossible size in one line, not out of memory
    check_fits(cfg, 'num_samples', p.device)   # the samples after training are generated together
    return components, vocab, encode(cfg['start'], vocab, model_args['block_size'])


def train(cfg, given):
    """A training run, as nanoGPT's train.py: settings, processes, data, model and optimizer, the loop."""
    if cfg['init_from'] == 'scratch':
        no_checkpoint_in(cfg['out_dir'])
    elif os.environ.get('RANK', '0') == '0' and os.path.isdir(cfg['out_dir']):
        lock_out_dir(cfg['out_dir'])   # before the checkpoint is read, so that it cannot change meanwhile
    cfg, model_args, ckpt, snapshots = plan(cfg, given)
    p = start_process(cfg, model_args)
    components, vocab, prompt = load_data(cfg, model_args, ckpt, p)   # a bad dataset or prompt: the only line
    if p.master and not HELD:   # a new run takes the lock once its input is checked (no out_dir made for a
        lock_out_dir(cfg['out_dir'])   # bad flag), and looks again for a checkpoint a run ending meanwhile left
        no_checkpoint_in(cfg['out_dir'])
    if p.master:
        if ckpt is not None:
            print(f"resuming from {os.path.join(cfg['out_dir'], 'ckpt.pt')} at iter {ckpt['iter_num']}")
        print(''.join(f"data: {c['name']} prepared in {c['dir']}\n" for c in components) + 'config:\n'
              + textwrap.indent(textwrap.fill(' '.join(f'{k}={v!r}' for k, v in cfg.items()), 100,
                                              break_long_words=False), '  '))
        if cfg['decay_lr'] and cfg['lr_decay_iters'] != cfg['max_iters']:
            print(f"note: lr_decay_iters={cfg['lr_decay_iters']} is not max_iters={cfg['max_iters']}: the rate "
                  "stays at min_lr from lr_decay_iters on (--lr_decay_iters sets it)", file=sys.stderr)

    torch.manual_seed(cfg['seed'] + p.rank)
    raw_model = build_model(model_args, ckpt).to(p.device)
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), p.device.split(':')[0])
    scaler = torch.amp.GradScaler('cuda', enabled=(p.dtype == 'float16'))
    batches = torch.Generator().manual_seed(cfg['seed'])   # draws the training rows, alike on every process
    progress = Progress()
    if ckpt is not None:
        restore(ckpt, optimizer, scaler, batches, p.rank, p.device)
        progress = Progress(ckpt['iter_num'], ckpt['best_val_loss'], ckpt['tokens'], ckpt['elapsed'], ckpt['iter_num'])
    model = torch.compile(raw_model) if cfg['compile'] else raw_model
    if p.ddp:
        model = DDP(model, device_ids=[p.device] if p.device.startswith('cuda') else None)
    if p.master:
        cut_logs(cfg['out_dir'], progress.iter_num, ckpt is not None)
        print(f"{sum(t.numel() for t in raw_model.parameters()):,} parameters; {tokens_per_iter(cfg):,} tokens per "
              f"iteration ({p.world} x {cfg['gradient_accumulation_steps'] // p.world} x {cfg['batch_size']} x "
              f"{cfg['block_size']}); device {p.device}, {p.dtype}")

    try:
        train_loop(cfg, p, components, model, raw_model, optimizer, scaler, batches, progress, snapshots,
                   saved=dict(model_args=model_args, vocab=vocab))
    except (KeyboardInterrupt, Diverged) as e:   # raised inside the progress bar's with-block, said once it is closed
        status, message = stopped(e, cfg['out_dir'], progress.iter_num, progress.saved_iter)
        if p.master:
            print(message, file=sys.stderr)
        raise SystemExit(status)
    if p.master:
        print(f"done: iter {progress.iter_num}, {progress.elapsed:.0f} s of training; best val loss "
              f"{progress.best_val_loss:.4f} ({progress.best_val_loss / LN2:.4f} bpc)")
        sample(raw_model, prompt, vocab, cfg, p)
    if p.ddp:   # all processes tear the group down together, so that none exits while rank 0 still
        dist.barrier()   # saves and samples: a process group whose members leave early aborts the others
        dist.destroy_process_group()


def tokens_per_iter(cfg):   # of all processes together
    return cfg['batch_size'] * cfg['gradient_accumulation_steps'] * cfg['block_size']


def train_loop(cfg, p, components, model, raw_model, optimizer, scaler, batches, progress, snapshots, saved):
    """Log, evaluate, checkpoint, snapshot and step, until max_iters. saved: what each checkpoint
    and snapshot records besides the weights (model_args, vocab)."""
    out_dir, start, tokens = cfg['out_dir'], progress.iter_num, tokens_per_iter(cfg)
    resumed = progress.saved_iter is not None
    eval_model = model.module if p.ddp else model   # compiled, not DDP: only rank 0 evaluates
    pending, t_log, t_run = [], time.time(), time.time() - progress.elapsed
    t_eval, eval_iter = t_log, start
    # the with-block closes the progress bar also when die() stops the run mid-line
    with tqdm(total=cfg['max_iters'], initial=start, disable=not p.master, unit='it', dynamic_ncols=True) as bar:
        while True:
            it = progress.iter_num
            lr = (get_lr(it, cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'], cfg['min_lr'])
                  if cfg['decay_lr'] else cfg['learning_rate'])
            last = it >= cfg['max_iters']
            evaluating = it % cfg['eval_interval'] == 0 or last
            if pending and (it % cfg['log_interval'] == 0 or evaluating):
                log_losses(pending, time.time() - t_log, cfg, p, raw_model, progress, bar)
                pending, t_log = [], time.time()
            if evaluating and (it > start or not resumed):
                speed = (it - eval_iter) * tokens / (time.time() - t_eval) if it > eval_iter else 0.0
                states = rng_states(p.ddp)   # before evaluating, as the next step will find them
                losses = estimate_loss(eval_model, components, cfg, p.device, p.ctx) if p.master else {}
                what, bad = next(((k[:k.index('_')], v) for k, v in losses.items() if not math.isfinite(v)), ('', 0.0))
                bad = torch.tensor(bad, device=p.device)
                if p.ddp:
                    dist.broadcast(bad, 0)   # only rank 0 evaluates, but every process must stop
                if not math.isfinite(bad.item()):
                    raise Diverged(what or 'val', bad.item(), it)
                progress.elapsed = round(time.time() - t_run, 3)
                if p.master:   # lr: of the step this iteration takes, as in train_log.jsonl
                    append_jsonl(os.path.join(out_dir, 'log.jsonl'), [dict(
                        iter=it, tokens=progress.tokens, time=progress.elapsed, lr=lr, tokens_per_sec=speed, **losses)])
                    each = ''.join(f", {k[8:]} {v:.4f}" for k, v in losses.items() if k.startswith('val_bpc_'))   # mix
                    bar.write(f"eval {it}: train loss {losses['train_loss']:.4f}, val loss {losses['val_loss']:.4f}, "
                              f"val bpc {losses['val_bpc']:.4f}{each}")
                    if it > start and (losses['val_loss'] < progress.best_val_loss or cfg['always_save_checkpoint']):
                        progress.best_val_loss = min(progress.best_val_loss, losses['val_loss'])
                        checkpoint = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                                          scaler=scaler.state_dict(), config=cfg, **saved, iter_num=it,
                                          best_val_loss=progress.best_val_loss, tokens=progress.tokens,
                                          elapsed=progress.elapsed, rng=dict(batches=batches.get_state(), torch=states))
                        save(checkpoint, out_dir, 'ckpt.pt', progress.saved_iter)
                        progress.saved_iter = it
                t_log = t_eval = time.time()
                eval_iter = it
            if p.master and it in snapshots:   # the weights only, in float16: for looking at, not for resuming
                weights = {k: v.to(torch.float16) for k, v in raw_model.state_dict().items()}
                save(dict(model=weights, **saved, iter_num=it), out_dir, f'snapshot-{it}.pt', progress.saved_iter)
            if last:
                break
            pending.append((it, lr, train_step(model, optimizer, scaler, batches, components, lr, cfg, p)))
            progress.iter_num += 1
            progress.tokens += tokens
            bar.update()
    progress.elapsed = round(time.time() - t_run, 3)


def train_step(model, optimizer, scaler, batches, components, lr, cfg, p):
    """One iteration at learning rate lr; returns its loss (on the device, not synced). Every process
    draws the iteration's rows (the same generator, seeded alike) and takes its own micro-batches of
    them: a run on N processes sees the data of a run on one, and only rank 0's generator is saved."""
    B, accum = cfg['batch_size'], cfg['gradient_accumulation_steps'] // p.world
    for group in optimizer.param_groups:
        group['lr'] = lr
    X, Y = get_batch(components, 'train', B * cfg['gradient_accumulation_steps'], cfg['block_size'], batches, p.device)
    total = torch.zeros((), device=p.device)
    for micro in range(accum):
        first = (p.rank * accum + micro) * B
        x, y = X[first:first + B], Y[first:first + B]
        if p.ddp:
            model.require_backward_grad_sync = micro == accum - 1   # all-reduce once, at the last
        with p.ctx:
            _, loss = model(x, y)
            loss = loss / accum
        total += loss.detach()
        scaler.scale(loss).backward()
    if cfg['grad_clip']:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


def log_losses(pending, seconds, cfg, p, raw_model, progress, bar):
    """The pending iterations' (iter, lr, loss) to train_log.jsonl and a printed line: one device sync
    and all-reduce per line. Every process checks the losses, so that all stop on a non-finite one."""
    losses = torch.stack([loss for _, _, loss in pending])
    if p.ddp:
        dist.all_reduce(losses)
        losses /= p.world
    losses = losses.tolist()
    for (it, _, _), loss in zip(pending, losses):
        if not math.isfinite(loss):
            raise Diverged('training', loss, it)
    if p.master:
        append_jsonl(os.path.join(cfg['out_dir'], 'train_log.jsonl'),
                     [dict(iter=it, loss=loss, lr=lr) for (it, lr, _), loss in zip(pending, losses)])
        dt, rows = seconds / len(pending), cfg['batch_size'] * cfg['gradient_accumulation_steps'] // p.world
        # against a datacenter GPU's peak: meaningless elsewhere
        mfu = f", mfu {raw_model.estimate_mfu(rows, dt):.2%}" if p.device.startswith('cuda') else ''
        bar.write(f"iter {progress.iter_num}: loss {sum(losses) / len(losses):.4f}, lr {pending[-1][1]:.2e}, "
                  f"{dt * 1000:.1f} ms/iter, {tokens_per_iter(cfg) / dt:,.0f} tokens/s{mfu}")


def sample(raw_model, prompt, vocab, cfg, p):
    """num_samples samples from the trained model, generated together."""
    raw_model.eval()
    torch.manual_seed(cfg['seed'])
    with p.ctx:
        out = raw_model.generate(torch.tensor([prompt] * cfg['num_samples'], device=p.device),
                                 cfg['max_new_tokens'], cfg['temperature'], cfg['top_k'] or None)
    for row in out.tolist():
        print('sample:\n' + decode(row, vocab))


def main(argv):
    tolerant_stdout()
    cfg, given = parse_config(argv)
    try:
        with one_line_errors('batch_size (raise gradient_accumulation_steps), block_size, n_embd, n_layer '
                             'or num_samples'), signals_as_ctrl_c():
            train(cfg, given) if cfg['mode'] == 'train' else show_config(cfg, given)
    finally:   # the process ending releases out_dir's lock anyway; this is for main() called in-process
        unlock()


if __name__ == '__main__':
    main(sys.argv[1:])
