"""
bench_triton_gpu.py: the Triton DAMCHA attention (damcha_triton.py) against the torch path on a GPU:
correctness, speed and peak memory, as one JSON line per measurement.

    python bench_triton_gpu.py            # one CUDA GPU; a few minutes on an H200
    python bench_triton_gpu.py --smoke    # tiny shapes on the CPU, through Triton's interpreter:
                                          # checks that the script runs, measures nothing useful

Rows, in order:
  setup   the device and versions.
  check   per dtype (float32, bfloat16) and metric (per-token, static), at B=2, H=12, T=1024,
          dh=64: the relative error (max |a - b| / max |b|) of o, dx, dm, dv against float64, for
          the kernels and for the torch path (einsum + SDPA) on the same inputs, and "ok" by the
          bar of tests/test_triton.py (float32: 1e-4 forward, 1e-3 gradients; 16-bit: no worse
          than twice the torch path's error plus 1e-3).
  op      the attention op alone at B=8, H=12, T=1024, dh=64: forward, and forward + backward,
          in ms (median over alternating repetitions), the peak memory above the inputs, and the
          ratios to the torch path.
  model   one training step (forward, backward, fused AdamW) of the GPT at B=8, T=1024, D=768,
          H=12, under bfloat16 autocast as train_char.py runs it: DAMCHA with kernel="torch" and
          kernel="triton" (per-token and static metric), and MHA with SDPA; step time, peak
          memory, the loss, and ratios to DAMCHA with kernel="torch" and to MHA.
Variants of one table are timed in turn within each repetition (bench.time_alternately), so that
clock and thermal drift fall on all of them alike. The inputs are drawn on the CPU from a seeded
generator, the same on every device. tests/test_triton.py imports make_inputs and torch_path from
here; importing this module runs nothing.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench import rel_err, time_alternately
from damcha_torch import GPT, GPTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
METRICS = {"per_token": False, "static": True}


def make_inputs(B, H, T, dh, static, seed=0, dtype=torch.float32, device=DEVICE):
    """x, m, v as the model produces them: x and v are (B, T, H, dh) tensors seen as (B, H, T, dh);
    m (B, T, H, dh, dh) or (H, dh, dh), scaled so that the scores are O(1). Plus an output
    gradient dO (B, H, T, dh). Drawn on the CPU, so the same on every device; none requires grad."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, dh, generator=g).transpose(1, 2)
    m = torch.randn(*((H,) if static else (B, T, H)), dh, dh, generator=g) / dh ** 0.5
    v = torch.randn(B, T, H, dh, generator=g).transpose(1, 2)
    do = torch.randn(B, H, T, dh, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, m, v, do)]


def torch_path(x, m, v):
    """damcha_torch's kernel="torch": q = x m (Eq. 5), then causal SDPA with keys x (Eqs. 5-7)."""
    q = torch.einsum("bhtd,hde->bhte" if m.dim() == 3 else "bhtd,bthde->bhte", x, m)
    return F.scaled_dot_product_attention(q, x, v, is_causal=True)


def emit(**row):
    print(json.dumps(row), flush=True)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def grad_inputs(B, H, T, dh, static, dtype, seed=0):
    """make_inputs on DEVICE, with x, m and v leaves that require grad."""
    x, m, v, do = make_inputs(B, H, T, dh, static, seed=seed, dtype=dtype)
    return [x.requires_grad_(), m.requires_grad_(), v.requires_grad_(), do]


def forward_backward(op, x, m, v, do):
    o = op(x, m, v)
    return (o, *torch.autograd.grad(o, (x, m, v), do))


def median_ms(fns, reps, warmup):
    """{name: fn} -> {name: median ms}, timed by bench.time_alternately."""
    times = time_alternately(fns, reps, DEVICE, warmup=warmup)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def peak_mib(fn):
    """Peak memory allocated while fn runs, above what was allocated before (None on a CPU)."""
    if DEVICE != "cuda":
        fn()
        return None
    sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def ratio(a, b):
    return None if a is None or b is None else round(a / b, 3)


def checks(impls, shape, dtypes):
    names = ("o", "dx", "dm", "dv")
    for dtype in dtypes:
        for metric, static in METRICS.items():
            x, m, v, do = grad_inputs(**shape, static=static, dtype=dtype, seed=1)
            exact = forward_backward(torch_path, *(t.detach().double().requires_grad_(t.requires_grad)
                                                   for t in (x, m, v, do)))
            got = {impl: forward_backward(op, x, m, v, do) for impl, op in impls.items()}
            err = {impl: {n: rel_err(a, b) for n, a, b in zip(names, res, exact)} for impl, res in got.items()}
            if dtype == torch.float32:
                ok = all(err["triton"][n] < (1e-4 if n == "o" else 1e-3) for n in names)
            else:
                ok = all(err["triton"][n] < 2 * err["torch"][n] + 1e-3 for n in names)
            emit(kind="check", dtype=str(dtype).split(".")[1], metric=metric, **shape, ok=ok,
                 err_triton=err["triton"], err_torch=err["torch"],
                 triton_vs_torch={n: rel_err(a, b) for n, a, b in zip(names, got["triton"], got["torch"])})
            del exact, got


def op_rows(impls, shape, dtypes, reps, warmup):
    for dtype in dtypes:
        for metric, static in METRICS.items():
            x, m, v, do = grad_inputs(**shape, static=static, dtype=dtype)
            fwd = {impl: (lambda op=op: op(x, m, v)) for impl, op in impls.items()}
            fwd_bwd = {impl: (lambda op=op: forward_backward(op, x, m, v, do)) for impl, op in impls.items()}
            with torch.no_grad():
                fwd_ms = median_ms(fwd, reps, warmup)
            fwd_bwd_ms = median_ms(fwd_bwd, reps, warmup)
            peak = {impl: peak_mib(fn) for impl, fn in fwd_bwd.items()}
            for impl in impls:
                emit(kind="op", impl=impl, dtype=str(dtype).split(".")[1], metric=metric, **shape,
                     fwd_ms=round(fwd_ms[impl], 3), fwd_bwd_ms=round(fwd_bwd_ms[impl], 3),
                     peak_mib=None if peak[impl] is None else round(peak[impl], 1),
                     fwd_ratio_vs_torch=ratio(fwd_ms[impl], fwd_ms["torch"]),
                     fwd_bwd_ratio_vs_torch=ratio(fwd_bwd_ms[impl], fwd_bwd_ms["torch"]),
                     peak_ratio_vs_torch=ratio(peak[impl], peak["torch"]))
            del x, m, v, do


def model_rows(model_shape, reps, warmup):
    fields = {k: v for k, v in model_shape.items() if k != "B"}
    variants = {"mha": dict(attn="mha"), "damcha/torch": dict(kernel="torch"),
                "damcha_static/torch": dict(kernel="torch", adaptive=False),
                "damcha/triton": dict(kernel="triton"),
                "damcha_static/triton": dict(kernel="triton", adaptive=False)}
    torch.manual_seed(0)
    idx = torch.randint(fields["vocab_size"], (model_shape["B"], fields["block_size"]), device=DEVICE)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda")
    steps, losses = {}, {}
    for name, variant in variants.items():
        torch.manual_seed(0)          # one initialisation for the variants that share a layout
        model = GPT(GPTConfig(**fields, **variant)).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")

        def step(model=model, optimizer=optimizer, name=name):
            with autocast:
                _, loss = model(idx, idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if name not in losses:
                losses[name] = loss.item()         # the first step's: before any update

        steps[name] = step
    step_ms = median_ms(steps, reps, warmup)
    peak = {name: peak_mib(step) for name, step in steps.items()}
    total = torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None
    for name in variants:
        emit(kind="model", name=name, **model_shape, step_ms=round(step_ms[name], 2),
             step_peak_mib=None if peak[name] is None else round(peak[name], 1), loss=round(losses[name], 5),
             step_ratio_vs_damcha_torch=ratio(step_ms[name], step_ms["damcha/torch"]),
             step_ratio_vs_mha=ratio(step_ms[name], step_ms["mha"]),
             peak_ratio_vs_damcha_torch=ratio(peak[name], peak["damcha/torch"]),
             peak_ratio_vs_mha=ratio(peak[name], peak["mha"]))
    emit(kind="model", all_models_peak_mib=total)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 20; smoke 2)")
    parser.add_argument("--n_layer", type=int, default=12, help="layers of the GPT in the model rows")
    args = parser.parse_args(argv)
    if DEVICE == "cpu" and not args.smoke:
        sys.exit("no CUDA GPU: run with --smoke to check the script on the CPU")
    # the interpreter must be chosen before damcha_triton defines its kernels, hence the late imports
    if args.smoke and DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    from damcha_triton import damcha_attention

    reps = args.reps or (2 if args.smoke else 20)
    warmup = 1 if args.smoke else 3
    if args.smoke:
        check = dict(B=1, H=2, T=20, dh=16)
        op = dict(B=1, H=2, T=20, dh=16)
        model = dict(B=2, vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=32, gen_width=16)
        dtypes = [torch.float32]                        # the interpreter runs float32 only
    else:
        check = dict(B=2, H=12, T=1024, dh=64)
        op = dict(B=8, H=12, T=1024, dh=64)
        model = dict(B=8, vocab_size=65, block_size=1024, n_layer=args.n_layer, n_head=12, n_embd=768, gen_width=64)
        dtypes = [torch.float32, torch.bfloat16]
    impls = {"torch": torch_path, "triton": damcha_attention}

    t0 = time.time()
    emit(kind="setup", device=torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
         smoke=args.smoke, torch=torch.__version__, triton=triton.__version__, reps=reps,
         allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    checks(impls, check, dtypes)
    op_rows(impls, op, dtypes, reps, warmup)
    model_rows(model, reps, warmup)
    emit(kind="done", wall_s=round(time.time() - t0, 1))


if __name__ == "__main__":
    main(sys.argv[1:])
