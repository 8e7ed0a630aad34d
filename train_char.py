r"""
train_char.py: train character-level DAMCHA and MHA GPTs, as nanoGPT's train.py trains GPT-2.

    python train_char.py config/quick.py                    # a minute's DAMCHA on Shakespeare
    python train_char.py                                    # the study's small DAMCHA on it
    python train_char.py config/enwik8.py config/damcha.py  # one GPU: a dataset, then a model file
    python train_char.py --dataset=notes.txt --attn=mha --out_dir=out-notes   # any text file
    python train_char.py --init_from=resume --out_dir=out-shakespeare --max_iters=3000
    torchrun --standalone --nproc_per_node=4 train_char.py config/enwik8.py config/damcha.py \
        --batch_size=8 --gradient_accumulation_steps=4      # the same 32 rows per step, on 4 GPUs
    python train_char.py config/text8.py config/mha.py --mode=config  # its settings, as JSON
    python train_char.py --help                             # every setting: default, what it does

Settings: the defaults below, then config files and --key=value flags in order; a resumed run keeps
its checkpoint's, but those given. data/prepare.py prepares a dataset on first use, into
data/<name>/. A run writes out_dir/ckpt.pt, log.jsonl (each evaluation) and train_log.jsonl (each
iteration) through run_folder.RunFolder, which keeps that folder safe. Ctrl-C, SIGTERM or SIGHUP
stops a run between two steps with a checkpoint there, printing the command that resumes it.
eval_char.py evaluates, samples from and plots the runs.

The reading path, the files that hold the model and its training, is what this file imports: the
README lists it.
"""
import shell   # first: its excepthook makes memory too short to import torch one line

if __name__ == '__main__':   # and Ctrl-C while torch is imported below ends in one line too
    shell.quit_on_signals()

import dataclasses
import inspect
import json
import math
import os
import signal
import sys
import textwrap
import time

from shell import (die, note_signals, one_line_errors, raise_as_ctrl_c, raise_noted,
                   signals_as_ctrl_c)

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import checkpoint
import device as devices
from configurator import check_run_settings, configure
from damcha_torch import GPT, GPTConfig
from data import dataset
from run_folder import Diverged, RunFolder

# ---------------------------------------------------------------------------------------------
# Settings: a small DAMCHA that learns Shakespeare in minutes on a CPU. The comment beside each
# default is its description in --help.
DEFAULTS = dict(
    mode='train',                 # train | config (print the settings a run would use, as JSON)
    out_dir='out-shakespeare',    # the run's folder (ckpt.pt, logs); {setting} takes a setting's
                                  # value
    init_from='scratch',          # scratch | resume (continue out_dir/ckpt.pt with its settings,
                                  # but those given)
    dataset='shakespeare',        # shakespeare | enwik8 | text8 | mix | path to a text file
    data_dir='',                  # prepared data go in <data_dir>/<dataset, or a text file's
                                  # stem-digest>/; '': data/
    other_data=False,             # True: a resume may train on data other than those its
                                  # checkpoint records (a changed file): refused otherwise
    seed=1337,                    # of the weights, the training rows and dropout
    device='auto',                # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype='auto',                 # auto (CUDA: bfloat16 if supported, else float16; float32
                                  # elsewhere)
    compile=False,                # torch.compile: faster on a GPU, minutes of warm-up on a CPU
    compile_mode='default',       # torch.compile's mode, with compile=True: default |
                                  # reduce-overhead (CUDA graphs: the step's launches replayed as
                                  # one) | max-autotune | max-autotune-no-cudagraphs
    # training
    batch_size=12,                # rows per micro-batch and process
    gradient_accumulation_steps=1,  # micro-batches per iteration over all processes together
    max_iters=2000,               # iterations (optimizer steps) of the whole run
    learning_rate=2e-3,           # the peak, reached after warm-up
    weight_decay=0.1,             # AdamW's, of tensors with 2 or more dimensions
    beta1=0.9,                    # AdamW's decay rate of the gradient's mean
    beta2=0.99,                   # AdamW's decay rate of the gradient's square
    grad_clip=1.0,                # largest gradient norm; 0: no clipping
    decay_lr=True,                # linear warm-up, then cosine decay to min_lr; False:
                                  # learning_rate throughout
    warmup_iters=100,             # iterations of warm-up; unless set, min(100, max_iters // 10)
    lr_decay_iters=2000,          # iteration where the decay reaches min_lr; unless set, max_iters
    min_lr=2e-4,                  # the rate at and after lr_decay_iters
    eval_interval=250,            # iterations between loss estimates (and checkpoints)
    eval_iters=10,                # batches (of an iteration's rows) per split for each loss
                                  # estimate
    log_interval=10,              # iterations between printed training losses
    always_save_checkpoint=True,  # False: save only when the val loss improves (a stop: only
                                  # before the first save)
    snapshot_iters='',            # e.g. 0,1000,5000: also keep the weights at these iterations,
                                  # as float16, in out_dir/snapshot-<iter>.pt (a notebook reads
                                  # them)
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
DEFAULTS.update({k: MODEL_DEFAULTS.get(k, getattr(GPTConfig, k)) for k in MODEL_KEYS})
CHOICES = dict(mode=('train', 'config'), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'),
               compile_mode=('default', 'reduce-overhead', 'max-autotune',
                             'max-autotune-no-cudagraphs'))
POSITIVE = ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'eval_iters',
            'log_interval',
            'num_samples', 'temperature', 'learning_rate', 'block_size', 'max_iters')
NON_NEGATIVE = ('warmup_iters', 'lr_decay_iters', 'min_lr', 'weight_decay', 'grad_clip',
                'max_new_tokens', 'top_k', 'vocab_size')
RANGES = (CHOICES, POSITIVE, NON_NEGATIVE)
# the settings of the learning-rate schedule; after decay_lr, in the order get_lr takes them
SCHEDULE = ('decay_lr', 'learning_rate', 'warmup_iters', 'lr_decay_iters', 'min_lr')
LN2 = math.log(2)


def parse_config(argv):
    """Defaults, then each config file or --key=value in order; out_dir's braces filled in, and the
    schedule fitted to max_iters where it was not set. Returns (config, keys given)."""
    cfg, given = configure(DEFAULTS, argv, *RANGES, doc=__doc__,
                           described_in=(__file__, inspect.getfile(GPTConfig)))
    try:   # a dataset config file names its runs' folders after the model: out-enwik8-{attn}
        cfg['out_dir'] = cfg['out_dir'].format(**cfg)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        die(f"out_dir={cfg['out_dir']!r}: braces must hold a setting's name, as in "
            f"out-enwik8-{{attn}} ({e!r})")
    if 'lr_decay_iters' not in given:   # a resumed run keeps its checkpoint's (checkpoint.resume)
        cfg['lr_decay_iters'] = cfg['max_iters']
    if 'warmup_iters' not in given:
        cfg['warmup_iters'] = min(DEFAULTS['warmup_iters'], cfg['max_iters'] // 10)
    check_run_settings(cfg, RANGES)
    return cfg, given


def plan(cfg, given, attentions):
    """(settings, model fields, checkpoint or None, snapshot iterations) of the run these arguments
    ask for, checked before anything is downloaded or built."""
    ckpt = None
    if cfg['init_from'] == 'resume':
        cfg, model_args, ckpt = checkpoint.resume(cfg, given, RANGES, attentions)
        if ckpt['iter_num'] >= cfg['max_iters']:
            die(f"the checkpoint is at iter {ckpt['iter_num']} and max_iters={cfg['max_iters']}: "
                "raise max_iters to train further")
    else:
        model_args = {k: cfg[k] for k in MODEL_KEYS}
        checkpoint.model_config(model_args | {'vocab_size': model_args['vocab_size'] or 1})
        checkpoint.attention_class(model_args['attn'], attentions)
    if cfg['decay_lr'] and cfg['min_lr'] > cfg['learning_rate']:   # the decay would raise the rate
        die(f"min_lr={cfg['min_lr']} is above learning_rate={cfg['learning_rate']}: give a min_lr "
            "at most the peak")
    if cfg['compile_mode'] != 'default' and 'compile_mode' in given and not cfg['compile']:
        # it would be dropped in silence
        die(f"compile_mode={cfg['compile_mode']} needs compile=True")
    return cfg, model_args, ckpt, snapshot_iterations(cfg, given, ckpt)


def snapshot_iterations(cfg, given, ckpt):
    """The iterations of snapshot_iters, refused if outside the run (for a resume given new ones,
    from its checkpoint's iteration on: those saved before stay)."""
    try:
        snapshots = {int(t) for t in cfg['snapshot_iters'].split(',') if t.strip()}
    except ValueError:
        die(f"snapshot_iters={cfg['snapshot_iters']!r}: give iterations as comma-separated whole "
            "numbers, e.g. 0,1000,5000")
    first = ckpt['iter_num'] if ckpt is not None and 'snapshot_iters' in given else 0
    outside = sorted(i for i in snapshots if not first <= i <= cfg['max_iters'])
    if outside:
        whose = ("the checkpoint's" if ckpt is not None and 'snapshot_iters' not in given
                 else 'given')
        die(f"snapshot_iters ({whose}): {outside} outside this run's iterations "
            f"{first}..{cfg['max_iters']}"
            + ("; --snapshot_iters= sets others, or none" if whose != 'given' else ''))
    return snapshots


def show_config(cfg, given, attentions):
    """The settings a run of these arguments starts from, as JSON, refused as the run would
    refuse them."""
    cfg, *_ = plan(cfg, given, attentions)
    dataset.corpus_names(cfg['dataset'], cfg['data_dir'])   # a dataset neither named nor a file
    print(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------------------------
# Data, the schedule and the loss estimate

def get_batch(corpora, split, n, block_size, generator, device):
    """n rows: inputs x and next-token targets y, (n, block_size) int64 on device. Each row's corpus
    is drawn uniformly (mix: enwik8 or text8), then its start uniformly over that split. The rows
    are gathered with one index per corpus, not row by row: Python work per row would keep the
    device waiting at large batches."""
    which = torch.randint(len(corpora), (n,), generator=generator)
    room = torch.tensor([len(c.splits[split]) - block_size for c in corpora], dtype=torch.float64)
    starts = (torch.rand(n, generator=generator, dtype=torch.float64) * room[which]).numpy()
    which, window = which.numpy(), np.arange(block_size + 1)
    # pinned on CUDA, so that the copy to the device runs beside the host's work
    xy = torch.empty((n, block_size + 1), dtype=torch.int64, pin_memory=device.startswith('cuda'))
    for c, corpus in enumerate(corpora):
        rows = which == c
        ids = corpus.splits[split][starts[rows].astype(np.int64)[:, None] + window]
        xy.numpy()[rows] = ids if corpus.lut is None else corpus.lut[ids]
    xy = xy.to(device, non_blocking=device.startswith('cuda'))
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()   # contiguous: models may .view() them


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's schedule: linear warm-up over warmup_iters, cosine decay to min_lr at
    lr_decay_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def say_if_the_schedule_changed(cfg, ckpt):
    """One line when a resume's schedule settings are not its checkpoint's (a longer
    lr_decay_iters, to train on): the rate then changes at once, and where it jumps back up the val
    loss can worsen before it improves, which the user should not take for a fault."""
    saved = {k: ckpt['config'].get(k, cfg[k]) for k in SCHEDULE}
    changed = [f"{k} {saved[k]!r} -> {cfg[k]!r}" for k in SCHEDULE if saved[k] != cfg[k]]
    if changed:
        it = ckpt['iter_num']
        was, now = (get_lr(it, *(s[k] for k in SCHEDULE[1:])) if s['decay_lr']
                    else s['learning_rate'] for s in (saved, cfg))
        print(f"note: the schedule is not the checkpoint's ({', '.join(changed)}): the rate at "
              f"iter {it} is {now:.2e}, where the checkpoint's schedule has {was:.2e}"
              + ("; the val loss may worsen before it improves" if now > was else ''),
              file=sys.stderr)


@torch.no_grad()
def estimate_loss(model, corpora, cfg, device, ctx):
    """Mean loss over eval_iters batches per split and corpus: the same batches at every evaluation
    (their own generator, reseeded), each an iteration's rows, however a run splits them into
    micro-batches and processes. Returns train_loss, val_loss, val_bpc (and, for mix, each
    corpus's)."""
    model.eval()
    out = {}
    rows, B = cfg['batch_size'] * cfg['gradient_accumulation_steps'], cfg['batch_size']
    for split in ('train', 'val'):
        per_corpus = {}
        for c in corpora:
            generator = torch.Generator().manual_seed(cfg['seed'])
            losses = []
            for _ in range(cfg['eval_iters']):
                X, Y = get_batch([c], split, rows, cfg['block_size'], generator, device)
                for first in range(0, rows, B):
                    with ctx:   # a copy: under CUDA graphs the next call overwrites the output
                        losses.append(model(X[first:first + B], Y[first:first + B])[1].clone())
            losses = torch.stack(losses).tolist()   # one device sync per corpus, not one per batch
            per_corpus[c.name] = sum(losses) / len(losses)
        out[f'{split}_loss'] = sum(per_corpus.values()) / len(corpora)
        if len(corpora) > 1:
            out |= {f'{split}_loss_{name}': loss for name, loss in per_corpus.items()}
    model.train()
    bpc = {k.replace('_loss', '_bpc'): v / LN2 for k, v in out.items() if k.startswith('val')}
    return out | bpc


# ---------------------------------------------------------------------------------------------
# Training

def train(cfg, given, run, attentions):
    """A training run, top to bottom as nanoGPT's train.py: settings and run folder, this process,
    data, model, optimizer, then the loop. run: the RunFolder of out_dir; attentions: the classes
    of attn names beyond the book's (the lab's), by name."""
    # settings and the run folder: a new run refuses a folder that holds another run's files
    ddp = 'RANK' in os.environ   # started by torchrun: one process per GPU
    rank, local_rank, world = ((int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
                               if ddp else (0, 0, 1))
    master = rank == 0   # rank 0 alone evaluates, logs and saves
    if cfg['init_from'] == 'scratch':
        run.refuse_fresh_start()
    elif master:
        run.hold_for_resume()
    cfg, model_args, ckpt, snapshots = plan(cfg, given, attentions)
    if ckpt is not None:
        run.saved_iter = ckpt['iter_num']   # where a resume of this run would start, until it saves

    # this process: its device and precision, and torchrun's process group
    if cfg['gradient_accumulation_steps'] % world:
        die(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple "
            f"of the {world} processes")
    device, dtype, ctx = devices.setup(cfg['device'], cfg['dtype'], model_args['kernel'],
                                       local_rank)
    if cfg['compile']:
        devices.check_compiler(device)
    if ddp:
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')

    # data: rank 0 downloads and prepares it, the others then only read it; checked now, with the
    # prompt of the sample after training, rather than after training
    if ddp and not master:
        try:
            dist.barrier()
        except RuntimeError:   # rank 0 stopped: its own error says why
            die("rank 0 stopped before the data were ready; its error is above")
    corpora, vocab = (checkpoint.load_data(cfg, given, ckpt, 'trained on') if ckpt is not None
                      else dataset.load_dataset(cfg['dataset'], cfg['data_dir']))
    if ddp and master:
        dist.barrier()
    if ckpt is None:
        if model_args['vocab_size'] and model_args['vocab_size'] < len(vocab):
            die(f"vocab_size={model_args['vocab_size']} is smaller than the dataset's "
                f"{len(vocab)} symbols")
        model_args['vocab_size'] = cfg['vocab_size'] = model_args['vocab_size'] or len(vocab)
    dataset.check_lengths(corpora, ('train', 'val'), model_args['block_size'])
    devices.check_fits(cfg, 'batch_size', device, training=True)   # one line, not out of memory
    devices.check_fits(cfg, 'num_samples', device)   # the samples after training come together
    prompt = dataset.encode(cfg['start'], vocab, model_args['block_size'])
    if master and ckpt is None:
        run.claim_for_a_new_run()
    if master:
        if ckpt is not None:
            print(f"resuming from {run.ckpt_path} at iter {ckpt['iter_num']}")
            say_if_the_schedule_changed(cfg, ckpt)
        print(''.join(f"data: {c.name} prepared in {c.dir}\n" for c in corpora) + 'config:\n'
              + textwrap.indent(textwrap.fill(' '.join(f'{k}={v!r}' for k, v in cfg.items()), 100,
                                              break_long_words=False), '  '))
        if cfg['decay_lr'] and cfg['lr_decay_iters'] != cfg['max_iters']:
            print(f"note: lr_decay_iters={cfg['lr_decay_iters']} is not max_iters="
                  f"{cfg['max_iters']}: the rate stays at min_lr from lr_decay_iters on "
                  "(--lr_decay_iters sets it)", file=sys.stderr)

    # the model, the optimizer and the generator of the training rows, as the checkpoint left them
    torch.manual_seed(cfg['seed'] + rank)
    raw_model = GPT(checkpoint.model_config(model_args),
                    checkpoint.attention_class(model_args['attn'], attentions))
    if ckpt is not None:
        checkpoint.load_weights(raw_model, ckpt)
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), device.split(':')[0])
    scaler = torch.amp.GradScaler('cuda', enabled=(dtype == 'float16'))
    batches = torch.Generator().manual_seed(cfg['seed'])   # alike on every process
    if ckpt is not None:
        checkpoint.restore(ckpt, optimizer, scaler, batches, rank, device)
    model = torch.compile(raw_model, mode=cfg['compile_mode']) if cfg['compile'] else raw_model
    if ddp:
        model = DDP(model, device_ids=[device] if device.startswith('cuda') else None)
    eval_model = model.module if ddp else model   # compiled, not DDP: only rank 0 evaluates
    B, rows = cfg['batch_size'], cfg['batch_size'] * cfg['gradient_accumulation_steps']
    accum = cfg['gradient_accumulation_steps'] // world   # this process's micro-batches
    tokens_per_iter = rows * cfg['block_size']   # of all processes together
    start = iter_num = ckpt['iter_num'] if ckpt else 0
    best_val_loss = ckpt['best_val_loss'] if ckpt else math.inf
    tokens = ckpt['tokens'] if ckpt else 0
    saved = dict(model_args=model_args, vocab=vocab)   # checkpoints and snapshots record them too

    def checkpoint_now(rng, elapsed):
        """The checkpoint of iteration iter_num, before its step (a resume takes that step first),
        periodic or a stop's, with the record of the data it trained on."""
        run.save_checkpoint(dict(
            model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
            scaler=scaler.state_dict(), config=cfg, **saved, iter_num=iter_num,
            best_val_loss=best_val_loss, tokens=tokens, elapsed=elapsed,
            rng=dict(batches=batches.get_state(), torch=rng),
            data=dataset.record(cfg['dataset'], corpora)))
    noted = note_signals()   # from here a signal stops the run between two steps (stopping)
    if master:
        run.start_logs(start, resumed=ckpt is not None)
        print(f"{sum(t.numel() for t in raw_model.parameters()):,} parameters; {tokens_per_iter:,} "
              f"tokens per iteration ({world} x {accum} x {B} x {cfg['block_size']}); "
              f"device {device}, {dtype}")

    # the loop: log, evaluate, checkpoint, snapshot and step, until max_iters
    pending = []   # (iter, lr, loss on the device) of the steps not logged yet: one sync per line
    t_log = t_eval = time.monotonic()   # durations: a wall clock may step back (NTP, a restore)
    t_run = t_log - (ckpt['elapsed'] if ckpt else 0.0)
    eval_iter = start
    bar = tqdm(total=cfg['max_iters'], initial=start, disable=not master, unit='it',
               dynamic_ncols=True)
    try:   # ... finally: the progress bar is closed also when die() stops the run mid-line
        while True:
            lr = (get_lr(iter_num, cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'],
                         cfg['min_lr']) if cfg['decay_lr'] else cfg['learning_rate'])
            last = iter_num >= cfg['max_iters']
            evaluating = iter_num % cfg['eval_interval'] == 0 or last
            stopping = bool(noted) and not ddp   # under torchrun all decide together, when synced
            if pending and (iter_num % cfg['log_interval'] == 0 or evaluating or stopping):
                # Diverged on a non-finite loss, before any stop
                losses, stopping = synced_losses(pending, ddp, world, bool(noted))
                dt = (time.monotonic() - t_log) / len(pending)
                if master:
                    run.log('train_log.jsonl', [dict(iter=it, loss=loss, lr=step_lr)
                                                for (it, step_lr, _), loss in zip(pending, losses)])
                    # MFU against a datacenter GPU's peak: meaningless elsewhere
                    mfu = (f", mfu {raw_model.estimate_mfu(rows // world, dt):.2%}"
                           if device.startswith('cuda') and dt > 0 else '')
                    bar.write(f"iter {iter_num}: loss {sum(losses) / len(losses):.4f}, lr "
                              f"{pending[-1][1]:.2e}, {dt * 1000:.1f} ms/iter, "
                              f"{per_second(tokens_per_iter, dt):,.0f} tokens/s{mfu}")
                pending, t_log = [], time.monotonic()
            # a resumed run's first iteration was evaluated, and checkpointed, by the run it resumes
            if evaluating and not (ckpt is not None and iter_num == start):
                speed = per_second((iter_num - eval_iter) * tokens_per_iter,
                                   time.monotonic() - t_eval)
                rng = rng_states(ddp)   # before evaluating, as the next step will find them
                losses = estimate_loss(eval_model, corpora, cfg, device, ctx) if master else {}
                stop_if_diverged(losses, iter_num, ddp, device)
                elapsed = round(time.monotonic() - t_run, 3)
                if master:   # lr: of the step this iteration takes, as in train_log.jsonl
                    run.log('log.jsonl', [dict(iter=iter_num, tokens=tokens, time=elapsed, lr=lr,
                                               tokens_per_sec=speed, **losses)])
                    each = ''.join(f", {k[8:]} {v:.4f}" for k, v in losses.items()
                                   if k.startswith('val_bpc_'))   # mix: each corpus's
                    bar.write(f"eval {iter_num}: train loss {losses['train_loss']:.4f}, val loss "
                              f"{losses['val_loss']:.4f}, val bpc {losses['val_bpc']:.4f}{each}")
                    if iter_num > start and (losses['val_loss'] < best_val_loss
                                             or cfg['always_save_checkpoint']):
                        best_val_loss = min(best_val_loss, losses['val_loss'])
                        checkpoint_now(rng, elapsed)
                t_log = t_eval = time.monotonic()
                eval_iter = iter_num
            if master and iter_num in snapshots:
                run.save_snapshot(raw_model, saved, iter_num)
            if stopping:   # a signal: a checkpoint of this iteration, unless it replaced the best
                rng = rng_states(ddp)
                if master and run.saved_iter != iter_num and (
                        run.saved_iter is None or cfg['always_save_checkpoint']):
                    checkpoint_now(rng, round(time.monotonic() - t_run, 3))
                if ddp:   # no process ends (torchrun would then end rank 0) before rank 0 saved
                    dist.barrier()
                raise_as_ctrl_c(noted[0] if noted else signal.SIGTERM)   # else: another's signal
            if last:
                break

            # one step. Every process draws the iteration's rows (the same generator, seeded
            # alike) and takes its own micro-batches of them: a run on N processes sees the data
            # of a run on one, and only rank 0's generator is saved.
            for group in optimizer.param_groups:
                group['lr'] = lr
            X, Y = get_batch(corpora, 'train', rows, cfg['block_size'], batches, device)
            step_loss = torch.zeros((), device=device)
            for micro in range(accum):
                first = (rank * accum + micro) * B
                if ddp:
                    model.require_backward_grad_sync = micro == accum - 1   # all-reduce at the last
                with ctx:
                    _, loss = model(X[first:first + B], Y[first:first + B])
                    loss = loss / accum
                step_loss += loss.detach()
                scaler.scale(loss).backward()
            if cfg['grad_clip']:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            pending.append((iter_num, lr, step_loss))
            iter_num += 1
            tokens += tokens_per_iter
            bar.update()
    except (KeyboardInterrupt, Diverged) as e:
        bar.close()   # first, so that the line is not drawn over
        status, message = run.stopped(e, iter_num, not cfg['always_save_checkpoint'])
        if master:
            print(message, file=sys.stderr)
        raise SystemExit(status)
    finally:
        bar.close()
    raise_noted(noted)
    if master:
        print(f"done: iter {iter_num}, {time.monotonic() - t_run:.0f} s of training"
              f"{' in all (the runs before this resume too)' * (ckpt is not None)}; best val loss "
              f"{best_val_loss:.4f} ({best_val_loss / LN2:.4f} bpc)")
        sample(raw_model, prompt, vocab, cfg, device, ctx)
    if ddp:
        # all processes tear the group down together, so that none exits while rank 0 still saves
        # and samples: a process group whose members leave early aborts the others
        dist.barrier()
        dist.destroy_process_group()


def per_second(count, seconds):
    """count / seconds, or 0.0 where no time passed by the clock (its resolution, or a clock that
    stood still): a rate never ends a run in a division by zero."""
    return count / seconds if seconds > 0 else 0.0


def synced_losses(pending, ddp, world, stop):
    """The pending steps' losses as floats, averaged over the processes, and whether a process was
    asked to stop (stop: this one was): one device sync and all-reduce. Every process checks them,
    so that all stop on a non-finite one, and all at the same step on a signal."""
    losses = torch.stack([loss for _, _, loss in pending])
    if ddp:
        losses = torch.cat([losses, losses.new_tensor([float(stop)])])
        dist.all_reduce(losses)
        losses /= world
        *losses, stop = losses.tolist()
        stop = stop > 0
    else:
        losses = losses.tolist()
    for (it, _, _), loss in zip(pending, losses):
        if not math.isfinite(loss):
            raise Diverged('training', loss, it)
    return losses, stop


def stop_if_diverged(losses, it, ddp, device):
    """Raise Diverged on every process if rank 0's loss estimate (losses) holds a non-finite
    loss."""
    bad = [(k.split('_')[0], v) for k, v in losses.items() if not math.isfinite(v)]
    what, value = bad[0] if bad else ('val', 0.0)
    value = torch.tensor(value, device=device)
    if ddp:
        dist.broadcast(value, 0)   # only rank 0 evaluates, but every process must stop
    if not math.isfinite(value.item()):
        raise Diverged(what, value.item(), it)


def rng_states(ddp):
    """Every process's torch RNG state (dropout), gathered so that rank 0 can save them all."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    state = (torch.get_rng_state(), cuda)
    if not ddp:
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def sample(model, prompt, vocab, cfg, device, ctx):
    """num_samples samples from the trained model, generated together, after a line that says
    so: generating them can take as long as many iterations, with nothing else printed."""
    print(f"sampling {cfg['num_samples']} x {cfg['max_new_tokens']} characters on {device}",
          file=sys.stderr)
    model.eval()
    torch.manual_seed(cfg['seed'])
    with ctx:
        out = model.generate(torch.tensor([prompt] * cfg['num_samples'], device=device),
                             cfg['max_new_tokens'], cfg['temperature'], cfg['top_k'] or None)
    for row in out.tolist():
        print('sample:\n' + dataset.decode(row, vocab))


def main(argv, attentions=None):
    """attentions: {attn name: the class of h.{l}.attn} beyond the book's damcha and mha, which GPT
    takes as its `attention` (the lab's, lab/train.py)."""
    with one_line_errors('batch_size (raise gradient_accumulation_steps), block_size, n_embd, '
                         'n_layer or num_samples'), signals_as_ctrl_c():
        cfg, given = parse_config(argv)
        if cfg['mode'] == 'config':
            show_config(cfg, given, attentions or {})
            return
        # its lock is let go when the run ends, in any way; argv: the command that resumes it
        with RunFolder(cfg['out_dir'], argv) as run:
            train(cfg, given, run, attentions or {})


if __name__ == '__main__':
    main(sys.argv[1:])
