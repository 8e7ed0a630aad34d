"""
train_char.py: train, evaluate, sample and plot character-level DAMCHA and MHA GPTs.

In the manner of nanoGPT's train.py: every setting has a default below; config files
(config/*.py, plain assignments) and then --key=value flags override them in the order given.

    python train_char.py                                # small DAMCHA on the bundled Shakespeare
    python train_char.py config/enwik8_damcha.py        # one-GPU run; downloads enwik8 the first time
    python train_char.py --dataset=notes.txt --attn=mha --n_layer=2 --out_dir=out-notes
    python train_char.py --init_from=resume --out_dir=out-shakespeare --max_iters=3000
    torchrun --standalone --nproc_per_node=4 train_char.py config/enwik8_damcha.py \
        --batch_size=8 --gradient_accumulation_steps=4      # the same 32 rows per step, on 4 GPUs
    python train_char.py --mode=eval --out_dir=out-enwik8-damcha      # bpc, whole val and test splits
    python train_char.py --mode=sample --out_dir=out-shakespeare --start="Ham." --num_samples=3
    python train_char.py --mode=plot --out_dir=out-enwik8-damcha,out-enwik8-mha   # PNG of val bpc

Datasets are prepared once into <data_dir>/<name>/ as uint8 token ids ({train,val,test}.bin,
read with np.memmap) and meta.json (vocabulary as byte values, split sizes, source, checksum):
    shakespeare  the bundled data/shakespeare/input.txt: its distinct bytes, 90% train / 10% val
                 (no test split, so eval reports val only)
    enwik8       the first 10^8 bytes of English Wikipedia XML: 256 bytes, 90M / 5M / 5M
    text8        10^8 characters of a-z and space: 27 symbols, 90M / 5M / 5M
    mix          the paper's 50-50 mixture: each training row comes from enwik8 or text8 with
                 probability 1/2, over the 256-byte vocabulary; evaluations report both and their mean
    PATH         any text file, read as bytes: its distinct bytes, 90 / 5 / 5, under data/<file stem>/
Without a network, put enwik8.zip or text8.zip (from mattmahoney.net/dc/) in data/enwik8/ or data/text8/.
A run writes to out_dir: ckpt.pt, log.jsonl (one line per evaluation: the curves) and
train_log.jsonl (one line per iteration: the losses that a resumed run reproduces exactly on CPU).
Resumed, evaluated and sampled runs keep the checkpoint's settings except those you pass.
"""
import dataclasses
import hashlib
import importlib.util
import http.client
import json
import math
import os
import sys
import textwrap
import time
import urllib.request
import zipfile
import zlib
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from configurator import configure, die
from damcha_torch import GPT, GPTConfig, get_lr

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# Defaults: a small DAMCHA that learns Shakespeare in about two minutes on two idle CPU cores.
DEFAULTS = dict(
    mode='train',                 # train | eval | sample | plot
    out_dir='out-shakespeare',    # ckpt.pt and logs; for plot, several folders joined by commas
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
    eval_iters=10,                # batches per split for the loss estimates logged while training
    log_interval=10,
    always_save_checkpoint=True,  # False: save only when the val loss improves
    snapshot_iters='',            # e.g. 0,1000,5000: also keep the weights at these iterations,
                                  # as float16, in out_dir/snapshot-<iter>.pt (notebooks/04 reads them)
    # eval mode
    stride=0,                     # window step; 0: block_size (non-overlapping windows)
    # sample mode, and the sample printed after training
    start='',                     # prompt, or FILE:path; '' is a newline (a space for text8)
    num_samples=1,
    max_new_tokens=500,
    temperature=0.8,
    top_k=0,                      # 0: sample from the whole distribution
    # plot mode
    plot_file='',                 # '' is bpc.png in the first out_dir
)
# every GPTConfig field is a setting; vocab_size 0 means the dataset's vocabulary size
MODEL_DEFAULTS = dict(vocab_size=0, block_size=64, n_layer=4, n_head=4, n_embd=128,
                      gen_out='folded', gen_depth=2, gen_width=64)
MODEL_KEYS = [f.name for f in dataclasses.fields(GPTConfig)]
DEFAULTS.update({f.name: MODEL_DEFAULTS.get(f.name, f.default) for f in dataclasses.fields(GPTConfig)})
CHOICES = dict(mode=('train', 'eval', 'sample', 'plot'), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
POSITIVE = ('batch_size', 'gradient_accumulation_steps', 'eval_interval', 'eval_iters', 'log_interval',
            'num_samples', 'temperature', 'learning_rate', 'block_size')
NON_NEGATIVE = ('max_iters', 'warmup_iters', 'lr_decay_iters', 'min_lr', 'weight_decay', 'grad_clip',
                'stride', 'max_new_tokens', 'top_k', 'vocab_size')

# The downloadable corpora. The tests point these at small archives of their own.
SOURCES = {
    'enwik8': dict(url='http://mattmahoney.net/dc/enwik8.zip', size=10**8,
                   digest=('md5', 'a1fa5ffddb56f4953e226637dabbb36a'), vocab=list(range(256))),
    # mattmahoney.net publishes no checksum for text8; this SHA-1 is the one that Apache
    # MXNet and GluonNLP check their text8 downloads against
    'text8': dict(url='http://mattmahoney.net/dc/text8.zip', size=10**8,
                  digest=('sha1', '0dc3edebc970dcc96137e7deda4d9995af9d93de'),
                  vocab=list(b' abcdefghijklmnopqrstuvwxyz')),
}
MIX = ('enwik8', 'text8')
BUNDLED = os.path.join(HERE, 'data', 'shakespeare', 'input.txt')
LN2 = math.log(2)


# ---------------------------------------------------------------------------------------------
# Configuration

def parse_config(argv):
    """Defaults, then each config file or --key=value in order. Returns (config, keys given)."""
    return configure(DEFAULTS, argv, CHOICES, POSITIVE, NON_NEGATIVE, doc=__doc__)


def model_config(model_args):
    try:
        return GPTConfig(**model_args)
    except (ValueError, TypeError) as e:
        die(f"invalid model: {e}")


def pick_device(name, local_rank):
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    kind = name.split(':')[0]
    if kind not in ('cpu', 'cuda', 'mps'):
        die(f"device must be auto, cpu, cuda, cuda:N or mps, not {name!r}")
    if not {'cpu': True, 'cuda': torch.cuda.is_available(), 'mps': torch.backends.mps.is_available()}[kind]:
        die(f"device={name}, but this machine has no {kind.upper()} device")
    return f'cuda:{local_rank}' if name == 'cuda' else name


def check_kernel(kernel, device):
    # the fused kernel runs on CUDA, or on the CPU in Triton's interpreter (as the tests run it)
    if kernel != 'triton':
        return
    if importlib.util.find_spec('triton') is None:
        die("kernel=triton needs the triton package (pip install triton); use --kernel=torch")
    if not device.startswith('cuda') and os.environ.get('TRITON_INTERPRET') != '1':
        die(f"kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 on a CPU), not {device}; use --kernel=torch")


def autocast_for(device, dtype):
    """(dtype name, autocast context). Half precision runs under autocast, weights stay float32."""
    kind = device.split(':')[0]
    if dtype == 'auto':
        dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if kind == 'cuda' else 'float32'
    if dtype == 'float16' and kind != 'cuda':
        die("dtype=float16 needs a CUDA device (its GradScaler is CUDA-only); use bfloat16 or float32")
    if dtype == 'float32':
        return dtype, nullcontext()
    return dtype, torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


# ---------------------------------------------------------------------------------------------
# Data

def write_atomic(path, data):
    """Write bytes (or a contiguous array) so that `path` is either absent or complete."""
    with open(path + '.tmp', 'wb') as f:
        f.write(data)
    os.replace(path + '.tmp', path)


def read_meta(folder):
    """meta.json of a completely prepared dataset folder, else None."""
    try:
        with open(os.path.join(folder, 'meta.json')) as f:
            meta = json.load(f)
        if all(os.path.getsize(os.path.join(folder, f'{s}.bin')) == n for s, n in meta['splits'].items()):
            return meta | {'dir': folder}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def write_splits(folder, ids, vocab, percents, source, digest):
    """Cut ids into consecutive train/val(/test) parts by percentage; meta.json goes last."""
    sizes = [len(ids) * p // 100 for p in percents[:-1]]
    sizes.append(len(ids) - sum(sizes))
    os.makedirs(folder, exist_ok=True)
    splits, begin = {}, 0
    for split, size in zip(('train', 'val', 'test'), sizes):
        write_atomic(os.path.join(folder, f'{split}.bin'), ids[begin:begin + size])
        splits[split], begin = size, begin + size
    meta = dict(vocab=[int(b) for b in vocab], splits=splits, source=source, digest=digest)
    write_atomic(os.path.join(folder, 'meta.json'), json.dumps(meta).encode())
    print(f"prepared {folder}: " + ', '.join(f'{s} {n:,}' for s, n in splits.items())
          + f" tokens, vocabulary of {len(vocab)}", file=sys.stderr)   # stdout: eval's JSON
    return meta | {'dir': folder}


def download(url, part, archive):
    print(f"downloading {url} to {archive}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, 'wb') as f:
            size = int(response.headers.get('Content-Length') or 0) or None
            with tqdm(total=size, unit='B', unit_scale=True, desc=os.path.basename(archive)) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
    except (OSError, http.client.HTTPException) as e:   # urllib's URLError is an OSError
        die(f"could not download {url} ({e}); download it by hand and put it at {archive}")


def unzip_verified(path, name, source):
    """The archive's member `name`, checked against the expected size and digest."""
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(name)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is not a zip archive holding {name} ({e})")
    algorithm, expected = source['digest']
    digest = hashlib.new(algorithm, data).hexdigest()
    if len(data) != source['size'] or digest != expected:
        raise ValueError(f"{path}: {name} is {len(data):,} bytes with {algorithm} {digest}, "
                         f"expected {source['size']:,} bytes with {algorithm} {expected}")
    return data


def prepare_download(name, data_dir):
    """enwik8 or text8: download the archive unless it is there (or was put there by hand),
    verify it, and only then rename it into place and write the splits."""
    source, folder = SOURCES[name], os.path.join(data_dir, name)
    meta = read_meta(folder)
    if meta is not None:
        return meta
    os.makedirs(folder, exist_ok=True)
    archive = os.path.join(folder, name + '.zip')
    if os.path.exists(archive):
        try:
            data = unzip_verified(archive, name, source)
        except ValueError as e:
            die(f"{e}; delete it to download it again")
    else:
        download(source['url'], archive + '.part', archive)
        try:
            data = unzip_verified(archive + '.part', name, source)
        except ValueError as e:
            os.remove(archive + '.part')
            die(f"the download failed verification: {e}")
        os.replace(archive + '.part', archive)
    vocab = source['vocab']
    lookup = np.full(256, 255, dtype=np.uint8)
    lookup[vocab] = np.arange(len(vocab), dtype=np.uint8)
    ids = lookup[np.frombuffer(data, dtype=np.uint8)]
    if len(vocab) < 256 and (ids == 255).any():
        die(f"{archive}: {name} holds bytes outside its {len(vocab)}-symbol vocabulary")
    algorithm, digest = source['digest']
    return write_splits(folder, ids, vocab, (90, 5, 5), source['url'], f'{algorithm}:{digest}')


def prepare_text(path, folder, percents):
    """A local text file, byte-level: its distinct bytes are the vocabulary. Prepared again
    whenever the file's contents change."""
    with open(path, 'rb') as f:
        raw = f.read()
    if not raw:
        die(f"{path} is empty")
    digest = 'md5:' + hashlib.md5(raw).hexdigest()
    meta = read_meta(folder)
    if meta is not None and meta['digest'] == digest:
        return meta
    data = np.frombuffer(raw, dtype=np.uint8)
    vocab = np.unique(data)
    return write_splits(folder, np.searchsorted(vocab, data).astype(np.uint8), vocab, percents,
                        os.path.abspath(path), digest)


def prepare(name, data_dir):
    """meta (with 'dir') of the prepared dataset `name`, preparing it if needed."""
    data_dir = data_dir or os.path.join(HERE, 'data')   # resolved here, so a moved checkout still works
    if name in SOURCES:
        return prepare_download(name, data_dir)
    if name == 'shakespeare':
        return prepare_text(BUNDLED, os.path.join(data_dir, 'shakespeare'), (90, 10))
    if not os.path.isfile(name):
        die(f"dataset {name!r} is neither shakespeare, enwik8, text8, mix nor an existing file")
    stem = os.path.splitext(os.path.basename(name))[0]
    if stem in ('shakespeare', 'mix', *SOURCES):
        die(f"{name} would be prepared into {data_dir}/{stem}/, which belongs to the {stem} dataset; rename it")
    return prepare_text(name, os.path.join(data_dir, stem), (90, 5, 5))


def load_dataset(name, data_dir, vocab=None):
    """(components, vocabulary). A component is one corpus (mix has two): its name, its splits
    as memmaps and `lut`, its ids -> model ids (None when they are the same). The vocabulary, a
    list of byte values, is the union of the components' unless a checkpoint fixes it."""
    names = MIX if name == 'mix' else (name,)
    metas = [prepare(n, data_dir) for n in names]
    if vocab is None:
        vocab = sorted(set().union(*(m['vocab'] for m in metas)))
    components = []
    for n, meta in zip(names, metas):
        outside = sorted(set(meta['vocab']) - set(vocab))
        if outside:
            die(f"dataset {n} has {len(outside)} characters outside the model's vocabulary, "
                f"e.g. {bytes(outside[:10])!r}")
        lut = None if meta['vocab'] == vocab else torch.tensor([vocab.index(b) for b in meta['vocab']])
        splits = {s: np.memmap(os.path.join(meta['dir'], f'{s}.bin'), dtype=np.uint8, mode='r') if size
                  else np.zeros(0, dtype=np.uint8) for s, size in meta['splits'].items()}
        components.append(dict(name=n, lut=lut, splits=splits))
    return components, vocab


def draw_rows(components, split, n, block_size, generator):
    """n training rows as (component, offset): the component uniformly at random (1/2 each for
    mix), the offset uniformly over that split's windows of block_size + 1 tokens."""
    which = torch.randint(len(components), (n,), generator=generator)
    room = torch.tensor([len(c['splits'][split]) - block_size for c in components], dtype=torch.float64)
    offsets = (torch.rand(n, generator=generator, dtype=torch.float64) * room[which]).long()
    return which, offsets


def get_batch(components, split, which, offsets, block_size, device):
    """Inputs x and next-token targets y, (B, T) int64 on device."""
    rows = []
    for c, o in zip(which.tolist(), offsets.tolist()):
        row = torch.from_numpy(components[c]['splits'][split][o:o + block_size + 1].astype(np.int64))
        rows.append(row if components[c]['lut'] is None else components[c]['lut'][row])
    xy = torch.stack(rows)
    if device.startswith('cuda'):
        xy = xy.pin_memory().to(device, non_blocking=True)
    else:
        xy = xy.to(device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()   # contiguous: models may .view() them


def check_lengths(components, splits, block_size):
    for c in components:
        for s in splits:
            if s in c['splits'] and len(c['splits'][s]) <= block_size:
                die(f"the {s} split of {c['name']} has {len(c['splits'][s])} tokens, "
                    f"too few for block_size={block_size}")


def encode(start, vocab, block_size):
    """The prompt's token ids; FILE:path reads it from a file."""
    if start.startswith('FILE:'):
        try:
            with open(start[5:], encoding='utf-8') as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            die(f"cannot read the prompt from {start[5:]}: {e}")
    elif start == '':
        start = '\n' if ord('\n') in vocab else ' '
    index = {b: i for i, b in enumerate(vocab)}
    outside = sorted({ch for ch in start if any(b not in index for b in ch.encode())})
    if outside:
        die(f"the prompt has characters outside the model's {len(vocab)}-symbol vocabulary: "
            + ' '.join(repr(ch) for ch in outside))
    ids = [index[b] for b in start.encode()]
    if not ids:
        die("the prompt is empty")
    if len(ids) > block_size:
        die(f"the prompt is {len(ids)} tokens, longer than the model's context (block_size={block_size})")
    return ids


def decode(ids, vocab):
    # ids past the vocabulary (a vocab_size set larger than it) become 0xFF, which shows as U+FFFD
    return bytes(vocab[i] if i < len(vocab) else 0xFF for i in ids).decode('utf-8', errors='replace')


# ---------------------------------------------------------------------------------------------
# Checkpoints

def load_checkpoint(out_dir):
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.isfile(path):
        die(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:   # torch.load raises many kinds for a damaged file; all mean the same
        die(f"{path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:300]})")
    needed = ('model', 'optimizer', 'scaler', 'model_args', 'config', 'vocab', 'iter_num', 'best_val_loss',
              'tokens', 'elapsed', 'rng')
    missing = [k for k in needed if k not in ckpt] if isinstance(ckpt, dict) else ['everything']
    if missing or not all(isinstance(ckpt[k], dict) for k in ('model', 'model_args', 'config')):
        die(f"{path} is not a checkpoint of train_char.py (it lacks {', '.join(missing) or 'the right types'})")
    return ckpt


def parse_iters(text, max_iters):
    """'0,1000,5000' -> {0, 1000, 5000}; anything else, or an iteration the run never reaches, is a
    one-line error."""
    try:
        iters = {int(t) for t in text.split(',') if t.strip()}
    except ValueError:
        die(f"snapshot_iters={text!r}: give iterations as comma-separated whole numbers, e.g. 0,1000,5000")
    outside = sorted(i for i in iters if not 0 <= i <= max_iters)
    if outside:
        die(f"snapshot_iters: {outside} outside this run's iterations 0..{max_iters}")
    return iters


def from_checkpoint(ckpt, config, given):
    """The run's saved settings overridden by those given now; model fields too, as long as
    the weights still fit (say --blocks=diag to ablate a trained model)."""
    merged = dict(DEFAULTS) | {k: v for k, v in ckpt['config'].items() if k in DEFAULTS}
    merged |= {k: config[k] for k in given | {'mode', 'init_from', 'out_dir'}}
    model_args = {k: merged[k] if k in given else v for k, v in ckpt['model_args'].items()}
    return merged | model_args, model_args


def build_model(model_args, ckpt=None):
    model = GPT(model_config(model_args))
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt['model'])
        except (RuntimeError, KeyError, TypeError) as e:
            die(f"the checkpoint's weights do not fit the model ({str(e)[:300]})")
    return model


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


# ---------------------------------------------------------------------------------------------
# Training

def lr_at(it, cfg):
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    return get_lr(it, cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'], cfg['min_lr'])


@torch.no_grad()
def estimate_loss(model, components, cfg, device, ctx):
    """Mean loss over eval_iters batches per split and component. The batches are the same at
    every evaluation (their own generator, reseeded), so curves are not noisy from resampling."""
    model.eval()
    out = {}
    for split in ('train', 'val'):
        per_component = {}
        for c in components:
            generator = torch.Generator().manual_seed(cfg['seed'])
            losses = []
            for _ in range(cfg['eval_iters']):
                which, offsets = draw_rows([c], split, cfg['batch_size'], cfg['block_size'], generator)
                with ctx:
                    x, y = get_batch([c], split, which, offsets, cfg['block_size'], device)
                    losses.append(model(x, y)[1].item())
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


def append_jsonl(path, entries):
    with open(path, 'a') as f:
        f.writelines(json.dumps(e) + '\n' for e in entries)


def read_jsonl(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        die(f"cannot read {path}: {e}")


def train(cfg, given):
    ddp = 'RANK' in os.environ
    rank, local_rank, world = (int(os.environ['RANK']), int(os.environ['LOCAL_RANK']),
                               int(os.environ['WORLD_SIZE'])) if ddp else (0, 0, 1)
    master = rank == 0
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    ckpt = None
    if cfg['init_from'] == 'resume':
        ckpt = load_checkpoint(cfg['out_dir'])
        cfg, model_args = from_checkpoint(ckpt, cfg, given)
        if ckpt['iter_num'] >= cfg['max_iters']:
            die(f"the checkpoint is at iter {ckpt['iter_num']} and max_iters={cfg['max_iters']}: "
                "raise max_iters to train further")
    elif os.path.exists(ckpt_path):
        die(f"{ckpt_path} exists: continue it with --init_from=resume, or choose another --out_dir")
    else:
        model_args = {k: cfg[k] for k in MODEL_KEYS}
        model_config(model_args | {'vocab_size': model_args['vocab_size'] or 1})   # fail before downloading
    snapshots = parse_iters(cfg['snapshot_iters'], cfg['max_iters'])
    if cfg['gradient_accumulation_steps'] % world:
        die(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple of "
            f"the {world} processes")
    device = pick_device(cfg['device'], local_rank)
    check_kernel(model_args['kernel'], device)
    dtype, ctx = autocast_for(device, cfg['dtype'])
    if ddp:
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
        if device.startswith('cuda'):
            torch.cuda.set_device(device)
    if master:
        print('config:\n' + textwrap.indent(textwrap.fill(
            ' '.join(f'{k}={v!r}' for k, v in cfg.items()), 100, break_long_words=False), '  '))
    if ddp and not master:
        dist.barrier()   # rank 0 downloads and prepares the data, the others then only read it
    components, vocab = load_dataset(cfg['dataset'], cfg['data_dir'], ckpt['vocab'] if ckpt else None)
    if ddp and master:
        dist.barrier()
    if ckpt is None:
        if model_args['vocab_size'] and model_args['vocab_size'] < len(vocab):
            die(f"vocab_size={model_args['vocab_size']} is smaller than the dataset's {len(vocab)} symbols")
        model_args['vocab_size'] = model_args['vocab_size'] or len(vocab)
        cfg['vocab_size'] = model_args['vocab_size']
    check_lengths(components, ('train', 'val'), model_args['block_size'])
    prompt = encode(cfg['start'], vocab, model_args['block_size'])

    torch.manual_seed(cfg['seed'] + rank)
    model = build_model(model_args, ckpt).to(device)
    optimizer = model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                           (cfg['beta1'], cfg['beta2']), device.split(':')[0])
    scaler = torch.amp.GradScaler('cuda', enabled=(dtype == 'float16'))
    batches = torch.Generator().manual_seed(cfg['seed'])   # the same on every process: see below
    iter_num, best_val, tokens, elapsed = 0, float('inf'), 0, 0.0
    if ckpt is not None:
        restore(ckpt, optimizer, scaler, batches, rank, device)
        iter_num, best_val, tokens, elapsed = (ckpt[k] for k in ('iter_num', 'best_val_loss', 'tokens', 'elapsed'))
    raw_model = model
    if cfg['compile']:
        model = torch.compile(model)
    fast_model = model   # evaluations run on the undistributed model, on rank 0 only
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device.startswith('cuda') else None)

    log_path, train_log_path = (os.path.join(cfg['out_dir'], n) for n in ('log.jsonl', 'train_log.jsonl'))
    if master:
        os.makedirs(cfg['out_dir'], exist_ok=True)
        for path in (log_path, train_log_path):
            # a resumed run continues the logs from its checkpoint; later lines belong to the
            # part of the interrupted run that it is about to redo
            kept = [e for e in read_jsonl(path) if e['iter'] <= iter_num] if ckpt and os.path.isfile(path) else []
            write_atomic(path, ''.join(json.dumps(e) + '\n' for e in kept).encode())
    # Every process draws the same rows for the whole iteration (the same generator, seeded
    # alike) and takes its own micro-batches from them: rank r does rows r*accum .. r*accum+accum-1
    # of batch_size each. So a run on N processes sees exactly the data of a run on one, and
    # only rank 0's generator state needs saving.
    accum = cfg['gradient_accumulation_steps'] // world
    rows_per_iter = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    tokens_per_iter = rows_per_iter * model_args['block_size']
    if master:
        print(f"{sum(p.numel() for p in raw_model.parameters()):,} parameters; {tokens_per_iter:,} tokens "
              f"per iteration ({world} x {accum} x {cfg['batch_size']} x {model_args['block_size']}); "
              f"device {device}, {dtype}")
    start_iter, saved_iter, pending, lr = iter_num, ckpt and iter_num, [], lr_at(iter_num, cfg)

    def stop(what, value, it):
        die(f"the {what} loss became {value} at iter {it}; stopped without saving: "
            + (f"{ckpt_path} (iter {saved_iter}) is the last good checkpoint" if saved_iter else
               "no checkpoint was written yet") + "; try a lower learning_rate")

    since_eval = [0, 0.0]   # iterations and training seconds since the last evaluation
    t_run = t_flush = time.time()
    # the with-block closes the progress bar also when die() stops the run mid-line
    with tqdm(total=cfg['max_iters'], initial=iter_num, disable=not master, unit='it', dynamic_ncols=True) as bar:
        while True:
            last = iter_num >= cfg['max_iters']
            evaluating = iter_num % cfg['eval_interval'] == 0 or last
            if pending and (iter_num % cfg['log_interval'] == 0 or evaluating):
                # one device sync and one all-reduce per log line, not per iteration
                losses = torch.stack([loss for _, _, loss in pending])
                if ddp:
                    dist.all_reduce(losses)
                    losses /= world
                seconds, t_flush = time.time() - t_flush, time.time()
                dt = seconds / len(pending)
                since_eval[0] += len(pending)
                since_eval[1] += seconds
                for (it, _, _), loss in zip(pending, losses.tolist()):
                    if not math.isfinite(loss):
                        stop('training', loss, it)
                if master:
                    append_jsonl(train_log_path, [dict(iter=it, loss=loss, lr=l) for (it, l, _), loss
                                                  in zip(pending, losses.tolist())])
                    mfu = raw_model.estimate_mfu(cfg['batch_size'] * accum, dt)
                    bar.write(f"iter {iter_num}: loss {losses.mean().item():.4f}, lr {lr:.2e}, "
                              f"{dt * 1000:.1f} ms/iter, {tokens_per_iter / dt:,.0f} tokens/s, mfu {mfu * 100:.2f}%")
                pending = []
            if evaluating and (iter_num > start_iter or ckpt is None):
                states = rng_states(ddp)
                if master:
                    losses = estimate_loss(fast_model, components, cfg, device, ctx)
                val_loss = torch.tensor(losses['val_loss'] if master else 0.0, device=device)
                if ddp:
                    dist.broadcast(val_loss, 0)   # only rank 0 evaluates, but every process must stop
                if not math.isfinite(val_loss.item()):
                    stop('val', val_loss.item(), iter_num)
                if master:
                    tokens_per_sec = since_eval[0] * tokens_per_iter / since_eval[1] if since_eval[0] else 0.0
                    entry = dict(iter=iter_num, tokens=tokens, time=round(elapsed + time.time() - t_run, 3),
                                 lr=lr, tokens_per_sec=tokens_per_sec, **losses)
                    append_jsonl(log_path, [entry])
                    bar.write(f"eval {iter_num}: train loss {losses['train_loss']:.4f}, val loss "
                              f"{losses['val_loss']:.4f}, val bpc {losses['val_bpc']:.4f}")
                    if iter_num > start_iter and (losses['val_loss'] < best_val or cfg['always_save_checkpoint']):
                        best_val = min(best_val, losses['val_loss'])
                        checkpoint = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                                          scaler=scaler.state_dict(), model_args=model_args, config=cfg,
                                          vocab=vocab, iter_num=iter_num, best_val_loss=best_val, tokens=tokens,
                                          elapsed=entry['time'], rng=dict(batches=batches.get_state(), torch=states))
                        torch.save(checkpoint, ckpt_path + '.tmp')
                        os.replace(ckpt_path + '.tmp', ckpt_path)   # a crash never leaves half a checkpoint
                        saved_iter = iter_num
                since_eval = [0, 0.0]
                t_flush = time.time()
            if master and iter_num in snapshots:
                # weights only, for looking at (the learned metric over training), not for resuming
                weights = {k: v.to(torch.float16) for k, v in raw_model.state_dict().items()}
                snapshot = dict(model=weights, model_args=model_args, vocab=vocab, iter_num=iter_num)
                path = os.path.join(cfg['out_dir'], f'snapshot-{iter_num}.pt')
                torch.save(snapshot, path + '.tmp')
                os.replace(path + '.tmp', path)
            if last:
                break

            lr = lr_at(iter_num, cfg)
            for group in optimizer.param_groups:
                group['lr'] = lr
            which, offsets = draw_rows(components, 'train', rows_per_iter, model_args['block_size'], batches)
            total = torch.zeros((), device=device)
            for micro in range(accum):
                first = (rank * accum + micro) * cfg['batch_size']
                rows = slice(first, first + cfg['batch_size'])
                x, y = get_batch(components, 'train', which[rows], offsets[rows], model_args['block_size'], device)
                if ddp:
                    model.require_backward_grad_sync = micro == accum - 1   # all-reduce once, at the last
                with ctx:
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
            pending.append((iter_num, lr, total))
            iter_num += 1
            tokens += tokens_per_iter
            bar.update()
    if master:
        print(f"done: iter {iter_num}, {time.time() - t_run:.0f} s; best val loss {best_val:.4f} "
              f"({best_val / LN2:.4f} bpc)")
        raw_model.eval()
        torch.manual_seed(cfg['seed'])
        with ctx:
            out = raw_model.generate(torch.tensor([prompt], device=device), cfg['max_new_tokens'],
                                     cfg['temperature'], cfg['top_k'] or None)
        print('sample:\n' + decode(out[0].tolist(), vocab))
    if ddp:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Evaluation, sampling, plotting

def load_for_inference(cfg, given):
    ckpt = load_checkpoint(cfg['out_dir'])
    cfg, model_args = from_checkpoint(ckpt, cfg, given)
    device = pick_device(cfg['device'], 0)
    check_kernel(model_args['kernel'], device)
    _, ctx = autocast_for(device, cfg['dtype'])
    model = build_model(model_args, ckpt).to(device)
    model.eval()
    return ckpt, cfg, model, device, ctx


@torch.no_grad()
def split_loss(model, data, lut, cfg, device, ctx, desc):
    """Mean loss over every next-token target of a split (all but its first token). Windows of
    block_size start every `stride` tokens; each scores only targets not scored before, so with
    a stride below block_size each target sees at least block_size - stride tokens of context."""
    T = cfg['block_size']
    stride = cfg['stride'] or T
    starts = list(range(0, len(data) - T, stride))
    if starts[-1] != len(data) - T - 1:
        starts.append(len(data) - T - 1)   # a last window flush with the end
    skips, scored = [], 1                  # scored: first target position not yet scored
    for s in starts:
        skips.append(scored - (s + 1))
        scored = s + T + 1
    total, count = 0.0, 0
    for b in tqdm(range(0, len(starts), cfg['batch_size']), desc=desc, unit='batch'):
        batch = starts[b:b + cfg['batch_size']]
        rows = torch.stack([torch.from_numpy(data[s:s + T + 1].astype(np.int64)) for s in batch])
        rows = (rows if lut is None else lut[rows]).to(device)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with ctx:
            logits, _ = model(x, y)
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, reduction='none')   # (B, T)
        keep = torch.arange(T, device=device) >= torch.tensor(skips[b:b + len(batch)], device=device)[:, None]
        total += nll[keep].double().sum().item()
        count += int(keep.sum())
    return total / count, count


def evaluate(cfg, given):
    ckpt, cfg, model, device, ctx = load_for_inference(cfg, given)
    if cfg['stride'] > cfg['block_size']:
        die(f"stride={cfg['stride']} is larger than block_size={cfg['block_size']}: tokens would go unscored")
    if cfg['compile']:
        model = torch.compile(model)
    components, _ = load_dataset(cfg['dataset'], cfg['data_dir'], ckpt['vocab'])
    check_lengths(components, ('val', 'test'), cfg['block_size'])
    result = dict(dataset=cfg['dataset'], iter=ckpt['iter_num'], block_size=cfg['block_size'],
                  stride=cfg['stride'] or cfg['block_size'])
    for split in ('val', 'test'):
        for c in components:
            if split not in c['splits']:
                print(f"note: {c['name']} has no {split} split", file=sys.stderr)
                continue
            loss, count = split_loss(model, c['splits'][split], c['lut'], cfg, device, ctx, f"{c['name']} {split}")
            suffix = f"_{c['name']}" if len(components) > 1 else ''
            result |= {f'{split}_loss{suffix}': loss, f'{split}_bpc{suffix}': loss / LN2,
                       f'{split}_tokens{suffix}': count}
        if len(components) > 1 and f"{split}_loss_{components[0]['name']}" in result:
            loss = sum(result[f"{split}_loss_{c['name']}"] for c in components) / len(components)
            result |= {f'{split}_loss': loss, f'{split}_bpc': loss / LN2}
    print(json.dumps(result, indent=2))


def sample(cfg, given):
    ckpt, cfg, model, device, ctx = load_for_inference(cfg, given)
    ids = encode(cfg['start'], ckpt['vocab'], cfg['block_size'])
    torch.manual_seed(cfg['seed'])
    with ctx:
        out = model.generate(torch.tensor([ids] * cfg['num_samples'], device=device), cfg['max_new_tokens'],
                             cfg['temperature'], cfg['top_k'] or None)
    for row in out.tolist():
        print(decode(row, ckpt['vocab']))
        print('---------------')


def plot(cfg, given):
    import matplotlib   # here, not at the top: only this mode needs it, and it is slow to import
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    dirs = [d for d in cfg['out_dir'].split(',') if d]
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for d in dirs:
        log = read_jsonl(os.path.join(d, 'log.jsonl'))
        if not log:
            die(f"{d}/log.jsonl has no evaluations yet")
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
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv):
    cfg, given = parse_config(argv)
    try:
        dict(train=train, eval=evaluate, sample=sample, plot=plot)[cfg['mode']](cfg, given)
    except OSError as e:   # an unwritable out_dir, a full disk: the system's own one-line reason
        die(e)


if __name__ == '__main__':
    main(sys.argv[1:])
