"""
counts.py: the lab's arithmetic on models: parameter counts and the widths that match them
(every comparison here is at equal parameter count), and training FLOPs and MFU counted for
DAMCHA's generator, Eq. 5 and the baselines' head mixing. The book's GPT.estimate_mfu is
nanoGPT's estimate; bench.py and bench_triton_gpu.py use these.

    from lab.counts import count_params, equal_params_width
    w = equal_params_width(count_params(dict(attn="mha")), dict(attn="damcha"))
"""
import functools

import torch

from damcha_torch import GPTConfig
from lab.baselines import mixing_macs
from lab.variants import build

# Dense peak FLOP/s of one H100 / H200 SXM (the same Hopper tensor cores): 16-bit, TF32 (the
# float32 matmuls when TF32 is allowed), and IEEE float32 on the CUDA cores
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 66.9e12}


def count_params(fields):
    """GPT.get_num_params of GPTConfig(**fields), any attn (lab/variants.build), built on the meta
    device: shapes, no memory."""
    return _count(tuple(sorted(fields.items())))


@functools.lru_cache(maxsize=None)
def _count(items):
    # cached: equal_params_width asks for the same counts again and again
    with torch.device("meta"):
        return build(GPTConfig(**dict(items))).get_num_params()


def equal_params_width(target, fields, field="gen_width"):
    """The width w at which GPTConfig(**fields, <field>=w) has the parameter count nearest to
    target: field "gen_width", the generator's hidden width (a DAMCHA with a generator), or
    "mlp_hidden", the MLP's (any model). The count grows with w, so bisect."""
    count = lambda w: count_params(dict(fields, **{field: w}))
    lo, hi = 1, 2
    while count(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 2**20:
            raise ValueError(f"no {'generator width' if field == 'gen_width' else 'MLP width'} reaches {target:,} parameters")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    return min((lo, hi), key=lambda w: abs(count(w) - target))


def flops_per_token(config):
    """Training FLOPs per token at context block_size: 6 per multiply-add of the forward pass
    (2 forward, 4 backward), counting the matmuls as nanoGPT does (PaLM, appendix B), plus
    the metric generator and the metric application q_i = x_i m_i (Eq. 5), or the baselines'
    head mixing. Attention is causal: a query at t meets t + 1 keys, T / 2 on average, so the
    per-pair terms count half of the full T x T. gen_out="full" runs folded
    (damcha_torch.Generator), so both outputs count the generator's last layer as
    w*H*dh*dh per token; folding the weights (D*D*w adds per pass) is left out."""
    D, L, T, H = config.n_embd, config.n_layer, config.block_size, config.n_head
    dh = D // H
    attention = T * D                                                # q k^T and A v: 2 D per key, T / 2 keys
    if config.attn == "damcha":
        per_layer = 2 * D * D + D * dh + attention                   # c_v, c_proj, Eq. 5
    elif config.attn == "proj":
        per_layer = 4 * D * D + D * dh + attention                   # c_attn, c_proj, Eq. 5
    else:
        per_layer = 4 * D * D + attention                            # c_attn, c_proj
    if config.attn in ("tha", "dcmha"):
        per_layer += mixing_macs(config)
    per_layer += 2 * D * (config.mlp_hidden or 4 * D)                # mlp
    generator = 0
    if config.attn in ("damcha", "proj") and config.adaptive:
        sizes = [D] + [config.gen_width] * (config.gen_depth - 1) + [D * dh]   # the last layer as it runs: folded
        generator = sum(a * b for a, b in zip(sizes, sizes[1:])) * (1 if config.share else L)
    return 6 * (L * per_layer + generator + D * config.vocab_size)   # + tied lm_head


def peak_flops(dtype):
    """PEAK_FLOPS of the dtype the matmuls run in: a name, or a torch.dtype; torch.float32 counts
    as "tf32" when CUDA's float32 matmuls may use TF32 (damcha_triton.tf32_matmuls, which needs triton)."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
        if dtype == "float32":
            from damcha_triton import tf32_matmuls   # triton: installed where float32 MFU is measured, on CUDA
            dtype = "tf32" if tf32_matmuls() else dtype
    return PEAK_FLOPS[dtype]


def estimate_mfu(config, fwdbwd_per_iter, dt, dtype="bfloat16", peak=None):
    """Model FLOPs utilisation: flops_per_token * block_size * fwdbwd_per_iter FLOPs in dt seconds,
    against peak, or by default peak_flops(dtype)."""
    return flops_per_token(config) * config.block_size * fwdbwd_per_iter / dt / (peak or peak_flops(dtype))
