r"""
eval_char.py: evaluate, sample from and plot the runs that train_char.py trained.

In the manner of nanoGPT's sample.py: it reads out_dir/ckpt.pt and keeps the run's saved settings
(its data, model, device, precision, batch size and seed) except those you pass, so `--blocks=diag`
ablates a trained model at inference (a model trained with --gen_out=full); compile and the
sampling settings are this script's own. Settings: the defaults below, then config files and
--key=value flags, read by the configurator that every script uses.

    python eval_char.py --out_dir=out-shakespeare                 # whole-val bpc, as JSON
    python eval_char.py --out_dir=out-enwik8-damcha --stride=256  # windows overlap: more context
    python eval_char.py --out_dir=out-enwik8-damcha --blocks=diag # Table 3's ablation (full M)
    python eval_char.py --mode=sample --out_dir=out-shakespeare --start="ROMEO:" --num_samples=3
                                                # each sample printed as soon as it is generated
    python eval_char.py --mode=plot --out_dir=out-enwik8-damcha,out-enwik8-mha \
        --plot_file=enwik8.png

eval scores every next-character target of a split exactly once: windows of block_size start every
stride tokens (0: block_size, non-overlapping), and each scores only the targets not scored before,
so with a stride below block_size every target past the first window sees at least
block_size - stride + 1 tokens of context.
"""
import shell   # first: its excepthook makes memory too short to import torch one line

if __name__ == '__main__':   # and Ctrl-C while torch is imported below ends in one line too
    shell.quit_on_signals()

import dataclasses
import inspect
import json
import math
import os
import sys

from shell import die, one_line_errors, signals_as_ctrl_c

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import device as devices
from configurator import check_run_settings, configure
from damcha_torch import GPT, GPTConfig
from data import dataset
from run_folder import atomic_write, read_jsonl

DEFAULTS = dict(
    mode='eval',                  # eval | sample | plot
    out_dir='out-shakespeare',    # the run's folder; for plot, several joined by commas
    # taken from the checkpoint unless given here
    dataset='shakespeare',        # shakespeare | enwik8 | text8 | mix | path to a text file
    data_dir='',                  # prepared datasets go in <data_dir>/<name>/; '' is data/ beside
                                  # this file (the checkpoint's is read from, never written to)
    other_data=False,             # True: score data other than those the checkpoint records (a
                                  # changed file, another of its name): refused otherwise
    seed=1337,                    # of the samples
    device='auto',                # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype='auto',                 # auto (CUDA: bfloat16 if supported, else float16; float32
                                  # elsewhere)
    batch_size=12,                # windows per forward pass in eval
    # eval (this script's own: a run trained compiled, on a GPU, may be evaluated on a CPU, where
    # compiling takes minutes; and one pass over a split rarely repays the compile anyway)
    compile=False,                # torch.compile the model
    stride=0,                     # window step; 0: block_size (non-overlapping windows)
    # sample (this script's own: not the trainer's settings for its end-of-run sample)
    start='',                     # prompt, or FILE:path; '' is a newline (a space for text8)
    num_samples=1,                # samples, each printed as soon as it is generated
    max_new_tokens=500,           # characters per sample
    temperature=0.8,              # below 1: likelier characters; above 1: more varied ones
    top_k=0,                      # sample from the k likeliest characters; 0: from all
    # plot
    plot_file='',                 # '' is bpc.png in the first out_dir
)
# every GPTConfig field is a setting too (they come from the checkpoint unless given)
DEFAULTS.update({f.name: f.default for f in dataclasses.fields(GPTConfig)})
SAMPLING = ('start', 'num_samples', 'max_new_tokens', 'temperature', 'top_k')
# this script's own settings; every other one is the checkpoint's unless given
OWN = ('mode', 'out_dir', 'data_dir', 'other_data', 'compile', 'stride', *SAMPLING, 'plot_file')
FROM_CHECKPOINT = [k for k in DEFAULTS if k not in OWN]
CHOICES = dict(mode=('eval', 'sample', 'plot'), dtype=('auto', 'float32', 'bfloat16', 'float16'))
POSITIVE = ('batch_size', 'num_samples', 'temperature', 'block_size')
NON_NEGATIVE = ('stride', 'max_new_tokens', 'top_k', 'vocab_size')
RANGES = (CHOICES, POSITIVE, NON_NEGATIVE)
LN2 = math.log(2)


def load_for_inference(cfg, given, attentions):
    """(checkpoint, settings, model in eval mode on its device, device, autocast context)."""
    cfg, model_args, ckpt = checkpoint.resume(cfg, given, RANGES, attentions, keep=OWN)
    device, _, ctx = devices.setup(cfg['device'], cfg['dtype'], model_args['kernel'])
    model = GPT(checkpoint.model_config(model_args),
                checkpoint.attention_class(model_args['attn'], attentions))
    checkpoint.load_weights(model, ckpt)
    model.to(device).eval()
    return ckpt, cfg, model, device, ctx


def evaluate(cfg, given, attentions):
    ckpt, cfg, model, device, ctx = load_for_inference(cfg, given, attentions)
    if cfg['stride'] > cfg['block_size']:
        die(f"stride={cfg['stride']} is larger than block_size={cfg['block_size']}: "
            "tokens would go unscored")
    devices.check_fits(cfg, 'batch_size', device)
    if cfg['compile']:
        devices.check_compiler(device)
        model = torch.compile(model)
    corpora, _ = checkpoint.load_data(cfg, given, ckpt, 'scored')
    dataset.check_lengths(corpora, ('val', 'test'), cfg['block_size'])
    result = dict(dataset=cfg['dataset'], iter=ckpt['iter_num'], block_size=cfg['block_size'],
                  stride=cfg['stride'] or cfg['block_size'])
    for split in ('val', 'test'):
        for c in corpora:
            if split not in c.splits:
                print(f"note: {c.name} has no {split} split", file=sys.stderr)
                continue
            loss, count = split_loss(model, c.splits[split], c.lut, cfg, device, ctx,
                                     f"{c.name} {split}")
            if not math.isfinite(loss):   # the weights passed their checks, so the model overflows
                die(f"the {split} loss of {c.name} is {loss}: the model's outputs are not "
                    "finite numbers")
            suffix = f"_{c.name}" if len(corpora) > 1 else ''
            result |= {f'{split}_loss{suffix}': loss, f'{split}_bpc{suffix}': loss / LN2,
                       f'{split}_tokens{suffix}': count}
        if len(corpora) > 1 and f"{split}_loss_{corpora[0].name}" in result:
            loss = sum(result[f"{split}_loss_{c.name}"] for c in corpora) / len(corpora)
            result |= {f'{split}_loss': loss, f'{split}_bpc': loss / LN2}
    print(json.dumps(result, indent=2, allow_nan=False))


@torch.no_grad()
def split_loss(model, data, lut, cfg, device, ctx, desc=''):
    """Mean loss of model(x, y) -> (logits, _) over every next-token target of a split's ids `data`
    (all but its first token); lut: its ids -> the model's, or None; cfg: block_size, stride
    and batch_size. Windows of block_size start every `stride` tokens (0: block_size); each scores
    only targets not scored before, so with a stride below block_size each target past the first
    window sees at least block_size - stride + 1 tokens of context.
    Returns (mean loss in nats, number of targets)."""
    T, batch_size = cfg['block_size'], cfg['batch_size']
    stride = cfg['stride'] or T
    starts = list(range(0, len(data) - T, stride))
    if starts[-1] != len(data) - T - 1:
        starts.append(len(data) - T - 1)   # a last window flush with the end
    skips, scored = [], 1                  # scored: first target position not yet scored
    for s in starts:
        skips.append(scored - (s + 1))
        scored = s + T + 1
    total, count = 0.0, 0
    for b in tqdm(range(0, len(starts), batch_size), desc=desc, unit='batch'):
        batch = starts[b:b + batch_size]
        rows = np.stack([data[s:s + T + 1].astype(np.int64) for s in batch])
        rows = torch.from_numpy(rows if lut is None else lut[rows]).to(device)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with ctx:
            logits, _ = model(x, y)
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, reduction='none')   # (B, T)
        keep = (torch.arange(T, device=device)
                >= torch.tensor(skips[b:b + len(batch)], device=device)[:, None])
        total += nll[keep].double().sum().item()
        count += int(keep.sum())
    return total / count, count


def sample(cfg, given, attentions):
    if cfg['compile']:
        # generate() calls the module itself, which torch.compile's wrapper would not reach
        print("note: compile=True applies to --mode=eval; sampling runs the model uncompiled",
              file=sys.stderr)
    ckpt, cfg, model, device, ctx = load_for_inference(cfg, given, attentions)
    ids = dataset.encode(cfg['start'], ckpt['vocab'], cfg['block_size'])
    print(f"sampling {cfg['num_samples']} x {cfg['max_new_tokens']} characters from "
          f"{cfg['out_dir']}/ckpt.pt (iter {ckpt['iter_num']}) on {device}", file=sys.stderr)
    torch.manual_seed(cfg['seed'])
    for _ in range(cfg['num_samples']):   # one at a time: each is printed once it is generated
        with ctx:
            out = model.generate(torch.tensor([ids], device=device), cfg['max_new_tokens'],
                                 cfg['temperature'], cfg['top_k'] or None)
        print(dataset.decode(out[0].tolist(), ckpt['vocab']) + '\n---------------', flush=True)


def plot(cfg, given, attentions):
    import matplotlib   # here, not at the top: only this mode needs it, and it is slow to import
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    formats = plt.gcf().canvas.get_supported_filetypes()
    extension = os.path.splitext(cfg['plot_file'])[1][1:].lower()
    if cfg['plot_file'] and extension not in formats:
        die(f"plot_file={cfg['plot_file']!r}: end it in a format matplotlib writes: "
            + ', '.join('.' + f for f in sorted(formats)))
    plt.close()
    dirs = [d.strip() for d in cfg['out_dir'].split(',') if d.strip()]
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for d in dirs:
        log = read_jsonl(os.path.join(d, 'log.jsonl'))
        if not log:
            die(f"{d}/log.jsonl has no evaluations yet")
        if not all(type(e.get(k)) in (int, float)
                   for e in log for k in ('val_bpc', 'tokens', 'time')):
            die(f"{d}/log.jsonl has an entry without val_bpc, tokens or time: "
                "not a log of train_char.py")
        bpc = [e['val_bpc'] for e in log]
        by_tokens.plot([e['tokens'] for e in log], bpc, marker='.', label=d)
        by_time.plot([e['time'] / 60 for e in log], bpc, marker='.', label=d)
    by_tokens.set(xlabel='training tokens', ylabel='val bits per character')
    by_time.set(xlabel='wall-clock minutes')
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
    by_time.legend()
    path = cfg['plot_file'] or os.path.join(dirs[0], 'bpc.png')
    fig.tight_layout()
    with atomic_write(path) as f:   # a full disk leaves the old plot whole, not a truncated one
        fig.savefig(f, format=extension or 'png', dpi=120)
    print(f"wrote {path}")


def main(argv, attentions=None):
    """attentions: {attn name: the class of h.{l}.attn} beyond the book's damcha and mha, which GPT
    takes as its `attention` (the lab's, lab/eval.py)."""
    with one_line_errors('batch_size (eval) or block_size'), signals_as_ctrl_c():
        cfg, given = configure(DEFAULTS, argv, *RANGES, doc=__doc__,
                               described_in=(__file__, inspect.getfile(GPTConfig)),
                               from_checkpoint=FROM_CHECKPOINT)
        check_run_settings(cfg, RANGES)
        dict(eval=evaluate, sample=sample, plot=plot)[cfg['mode']](cfg, given, attentions or {})


if __name__ == '__main__':
    main(sys.argv[1:])
