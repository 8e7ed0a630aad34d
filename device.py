"""
device.py: the device a script runs on, and what it can run there: the device picked from a setting
(auto: CUDA, then MPS, then the CPU), the precision (autocast for half precision, weights in
float32), whether the fused Triton kernel runs there, whether torch.compile can build for it, and
whether rows of a batch fit its memory. train_char.py and eval_char.py call setup(); each refusal
is one line (shell.die).
"""
import importlib.util
import math
import os
import resource
from contextlib import nullcontext

import torch

from shell import die


def setup(device, dtype, kernel, local_rank=0):
    """(device, dtype name, autocast context) of a run: the device picked, its precision, and the
    kernel checked to run there."""
    device = pick_device(device, local_rank)
    dtype, ctx = autocast_for(device, dtype)
    check_kernel(kernel, device, dtype)
    return device, dtype, ctx


def pick_device(name, local_rank):
    if name == 'auto':
        name = ('cuda' if torch.cuda.is_available() else
                'mps' if torch.backends.mps.is_available() else 'cpu')
    kind, colon, index = name.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (colon and not (kind == 'cuda' and index.isdigit())):
        die(f"device must be auto, cpu, cuda, cuda:N or mps, not {name!r}")
    if not {'cpu': True, 'cuda': torch.cuda.is_available(),
            'mps': torch.backends.mps.is_available()}[kind]:
        die(f"device={name}, but this machine has no {kind.upper()} device")
    if colon and int(index) >= torch.cuda.device_count():
        die(f"device={name}, but this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    device = f'cuda:{local_rank}' if name == 'cuda' else name
    if kind == 'cuda':
        # the current device too: Triton launches on it, and the saved CUDA RNG state is its
        torch.cuda.set_device(device)
    return device


def autocast_for(device, dtype):
    """(dtype name, autocast context). Half precision runs under autocast, weights stay float32."""
    kind = device.split(':')[0]
    if dtype == 'auto':
        dtype = (('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if kind == 'cuda'
                 else 'float32')
    if dtype == 'float16' and kind != 'cuda':
        die("dtype=float16 runs on a CUDA device only here (training it needs CUDA's GradScaler); "
            "use bfloat16 or float32")
    if dtype == 'float32':
        return dtype, nullcontext()
    return dtype, torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


def check_kernel(kernel, device, dtype):
    """Refuse a kernel the device cannot run."""
    # the fused kernel runs on CUDA, or on the CPU in Triton's interpreter (as the tests run it),
    # which runs it in float32 (bfloat16 comes out wrong there; float16 trains on CUDA only)
    if kernel != 'triton':
        return
    if importlib.util.find_spec('triton') is None:
        die("kernel=triton needs the triton package (pip install triton); use --kernel=torch")
    if not device.startswith('cuda') and os.environ.get('TRITON_INTERPRET') != '1':
        die(f"kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 on a CPU), not {device}; "
            "use --kernel=torch")
    if not device.startswith('cuda') and dtype != 'float32':
        die(f"kernel=triton on a CPU runs in Triton's interpreter, which cannot train in {dtype}; "
            "use --dtype=float32")


def check_compiler(device):
    """Refuse --compile=True on a CPU without a working C++ compiler, which Inductor needs there:
    found the way Inductor looks for one (CXX, else g++), before the run starts, rather than a
    traceback of some hundred lines at the first forward pass."""
    if device != 'cpu':
        return
    try:   # here, not at the top: it takes a second to import, and only compile needs it
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:   # a torch that keeps it elsewhere: its own error, if any, tells
        return
    try:
        get_cpp_compiler()
    except RuntimeError:   # Inductor's InvalidCxxCompiler
        cxx = os.environ.get('CXX')
        found = f"CXX={cxx} does not run" if cxx else "none found: CXX unset, no g++ on the PATH"
        die(f"--compile=True needs a working C++ compiler ({found}): install gcc/g++, or run "
            "without --compile")


def check_fits(cfg, key, device, training=False):
    """Refuse, before allocating them, cfg[key] rows that cannot fit: a float32 (rows, block_size,
    width) is less than a forward pass holds, width a token's logits and embedding, or in training
    those backward keeps (over eight embeddings a layer: the norms', attention's and the MLP's
    inputs)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]   # ulimit -v, if one is set
    have = (torch.cuda.get_device_properties(device).total_memory if device.startswith('cuda') else
            min(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'),
                math.inf if limit < 0 else limit))
    need = 4 * cfg[key] * cfg['block_size'] * (
        (8 * cfg['n_layer'] if training else 1) * cfg['n_embd'] + cfg['vocab_size'])
    if need > have:
        die(f"{key}={cfg[key]} asks for more than {need / 2**30:,.1f} GiB, "
            f"and {device} has {have / 2**30:,.1f} GiB: lower it")
