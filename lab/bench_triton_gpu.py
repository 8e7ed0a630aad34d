"""
bench_triton_gpu.py: the one-shot GPU check of the Triton DAMCHA attention (damcha_triton.py):
correctness, speed and memory against the torch path, one JSON line per measurement, in a time
bounded by its budgets: each section stops starting rows at its time budget and says what it
skipped (a row already started runs to its end), and no section starts a row past
--budget_total seconds from the start, the train rows included.

    python lab/bench_triton_gpu.py              # one CUDA GPU
    python lab/bench_triton_gpu.py --smoke      # tiny shapes, on a CPU through Triton's interpreter:
                                                # checks that the script runs, measures nothing useful
    python lab/bench_triton_gpu.py --n_layer=4 --train_configs=config/enwik8.py,config/damcha.py
    python lab/bench_triton_gpu.py --budget_check=0 --budget_op=0 --budget_train=0 --batch_size=32   # model rows alone
    python lab/bench_triton_gpu.py --budget_check=0 --budget_op=0 --budget_train=0 --budget_model=200 \
        --n_embd=512 --n_head=8 --block_size=512 --batch_size=32 --gen_out=folded   # the shipped GPU model
    bash lab/gpu_busy.sh                        # the busy section alone, at both shapes (results/gpu/)

Rows (kind=...), in order:
  setup   device, versions, peaks used for bandwidth and MFU.
  check   the op's output and gradients (o, dx, dm, dv) in bfloat16 and float32, per-token and
          static metrics, at odd T (1000, 1023, 777) and dh in {8, 16, 48, 64, 128}: the relative
          error (max |a - b| / max |b|) of the kernels and of the torch path (einsum + SDPA)
          against float64, and ok by tests/test_kernel.py's bar (float32: 1e-4 forward, 1e-3
          gradients; 16-bit: no worse than twice the torch path plus 1e-3), and the configs
          autotuning chose; each shape in both dtypes, dh = 64 first. One row, before them, checks
          offsets past 2^31 (T = 8192, H = 24, dh = 128; --smoke: the same check at a small shape):
          o, dm and dx against float64 with an output gradient on the last 16 positions only.
  op      the op alone at B=8, H=12, T=1024, dh=64, per-token metrics first: forward and
          forward + backward in ms (triton.testing.do_bench: CUDA events, median) of the kernels,
          of the torch path and, in bf16, of the torch path compiled (torch_compiled: q = x m as
          inductor fuses it, as in a compiled model), ratios to the torch path; with per-token metrics, the forward's effective
          bandwidth on m (bytes of m / forward time) against the device's peak and against a plain
          read of m (impl=read_m: torch's sum over m, a reference for one read of m, not a bound);
          the configs autotuning chose for the kernels, and (vs_torch) the kernels' output and
          gradients against the torch path's at this shape, where autotuning may choose a config
          that no check row ran.
  model   one training step (forward, backward, fused AdamW; bf16 autocast as train_char.py) of
          the GPT at B=8, T=1024, D=768, H=12 (--batch_size, --block_size, --n_embd, --n_head,
          --n_layer, and DAMCHA's --gen_out): MHA, DAMCHA on the torch path and on Triton (its
          generator width giving MHA's parameter count), eager and torch.compile'd: ms per step,
          the host's ms to launch one step (host_ms), tokens/s, MFU, peak memory, time to the end
          of the first step (compiling). Before them, name=matmul: the MLP's first matmul alone,
          its TFLOP/s and MFU, the most the model's largest matmuls reach; and
          name=grad_agreement: the bf16 gradients of the two DAMCHA paths against each other.
  profile after all the model rows, budget allowing (--profile=False: none): one step of each
          under torch.profiler, its total device time and the kernels that took most of it (CPU
          time on a CPU), to say where one path's step is slower than another's.
  busy    (--budget_busy, 0 by default: none) train_char.py's own step, compiled: its get_batch on
          random tokens, forward and backward in bf16 autocast, gradient clipping, its fused
          AdamW, at each of --busy_shapes (shipped: B 32, T 512, D 512, H 8, the generator
          folded; wide: B 8, T 1024, D 768, H 12, full; 12 layers) for MHA and both DAMCHA paths
          in each of --compile_modes: ms per step (CUDA events, median), device_ms (the kernels'
          time in one step under torch.profiler), busy (device_ms / ms per step), launches and
          kernels per step, host_syncs (torch.cuda.set_sync_debug_mode's warnings in one step),
          host_ms, tokens/s, MFU, compile_s; then per shape and mode (kind=busy_targets) the
          issue's targets: every path busy >= 0.9, the kernel path's step <= the torch path's,
          DAMCHA's faster path >= 0.85x MHA's tokens/s, MHA's MFU. --busy_dir: each row's profile
          (top kernels, top host ops) as profile.jsonl and a text table per row.
  train   `python train_char.py <train_configs> --max_iters=30` on the bundled Shakespeare
          (compile on, bf16), with --kernel=triton, then on the torch path if the budget allows
          (a row needs TRAIN_ROW_S: with the default budgets only the first runs;
          --budget_check=0 --budget_op=0 --budget_model=0 --budget_train=200 runs both): exit
          status, wall time and the last loss line.
A row whose measurement raised (an implementation in the op rows, a model step, the gradient
agreement, a profile) has error="..." in place of its numbers, and the check goes on.
tests/test_lab_gpu_check.py tests it; importing this module runs nothing.
"""
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/bench_triton_gpu.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

from configurator import configure
from shell import die
from damcha_torch import GPT, GPTConfig
from lab.counts import count_params, equal_params_width, flops_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
METRICS = {"per_token": False, "static": True}
DEFAULTS = dict(
    smoke=False,                  # tiny shapes (on a CPU, through Triton's interpreter)
    n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=8,   # the GPT of the model rows
    gen_out='full',               # DAMCHA's generator output in the model rows (the shipped configs: folded)
    profile=True,                 # profile one step of each model row
    train_configs='config/enwik8.py,config/damcha.py',   # comma-separated config files for the train rows
    train_iters=30,
    budget_check=80, budget_op=60, budget_model=100, budget_train=40,   # seconds per section
    budget_total=300,             # seconds for the whole check: no row starts later (one started runs to its end)
    budget_busy=0,                # seconds for the busy section (0: none)
    busy_shapes='shipped,wide',   # the busy section's shapes, of BUSY_SHAPES
    compile_modes='default,reduce-overhead',   # torch.compile modes of the busy section
    busy_dir='',                  # folder for the busy section's profiles ('': none written)
)
BUSY_SHAPES = {   # the busy section's: the shipped GPU model, and the model rows' default
    "shipped": dict(batch_size=32, block_size=512, n_embd=512, n_head=8, n_layer=12, gen_out="folded"),
    "wide": dict(batch_size=8, block_size=1024, n_embd=768, n_head=12, n_layer=12, gen_out="full"),
    "smoke": dict(batch_size=2, block_size=16, n_embd=32, n_head=2, n_layer=1, gen_out="folded"),
}
TRAIN_ROW_S = 100                 # what a train row needs at least, with a margin over its times in results/gpu/
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# the host's calls that queue work on the device, as the profiler names them
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}   # dense, per device name


def make_inputs(B, H, T, dh, static, seed=0, dtype=torch.float32, device=DEVICE, draw_on="cpu"):
    """x, m, v as the model produces them: x and v are (B, T, H, dh) tensors seen as (B, H, T, dh);
    m (B, T, H, dh, dh) or (H, dh, dh), scaled so that the scores are O(1). Plus an output
    gradient dO (B, H, T, dh). Drawn on the CPU by default, so the same on every device;
    draw_on=device draws there, for inputs too large to draw quickly on a CPU. None requires grad."""
    g = torch.Generator(draw_on).manual_seed(seed)
    x = torch.randn(B, T, H, dh, generator=g, device=draw_on).transpose(1, 2)
    m = torch.randn(*((H,) if static else (B, T, H)), dh, dh, generator=g, device=draw_on).div_(dh ** 0.5)
    v = torch.randn(B, T, H, dh, generator=g, device=draw_on).transpose(1, 2)
    do = torch.randn(B, H, T, dh, generator=g, device=draw_on)
    return [t.to(device=device, dtype=dtype) for t in (x, m, v, do)]


def torch_path(x, m, v):
    """damcha_torch's kernel="torch": q = x m (Eq. 5), then causal SDPA with keys x (Eqs. 5-7)."""
    q = torch.einsum("bhtd,hde->bhte" if m.dim() == 3 else "bhtd,bthde->bhte", x, m)
    return F.scaled_dot_product_attention(q, x, v, is_causal=True)


def rel_err(a, b):
    """max |a - b| / max |b| in float64."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return ((a - b).abs().max() / b.abs().max()).item()


def emit(**row):
    """One measurement as a line of JSON. A non-finite number (a kernel that returns NaN) is written
    as the string "nan" or "inf": bare NaN is not JSON, and stricter readers than Python's refuse it."""
    print(json.dumps(finite(row)), flush=True)


def finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def failure(e):
    """An exception as a row's error field: one line, its type and the start of its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def time_ms(fn, rep=60):
    """Median ms of fn over about rep ms of calls: CUDA events through triton.testing.do_bench on a
    GPU; wall time on a CPU."""
    if DEVICE == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def peak_mib(fn):
    """Peak memory allocated while fn runs, above what was allocated before (None on a CPU)."""
    if DEVICE != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def forward_backward(op, x, m, v, do):
    x, m, v = (t.detach().requires_grad_() for t in (x, m, v))
    o = op(x, m, v)
    return (o, *torch.autograd.grad(o, (x, m, v), do))


class Budget:
    """A section's time budget, ending at `seconds` from now or at the whole check's deadline,
    whichever is first: over() says when to stop, and the section reports what it skipped."""
    def __init__(self, seconds, deadline=math.inf):
        self.end = min(time.time() + seconds, deadline)
        self.deadline = deadline

    def over(self):
        return time.time() > self.end


def checks(op, shapes, dtypes, budget):
    """Each shape in both dtypes before the next shape: a budget that runs out cuts shapes, not a dtype."""
    names = ("o", "dx", "dm", "dv")
    for B, H, T, dh in shapes:
        for dtype in dtypes:
            for metric, static in METRICS.items():
                row = dict(kind="check", dtype=str(dtype)[6:], metric=metric, B=B, H=H, T=T, dh=dh)
                if budget.over():
                    emit(**row, skipped="time budget")
                    continue
                x, m, v, do = make_inputs(B, H, T, dh, static, seed=T + dh, dtype=dtype)
                exact = forward_backward(torch_path, *(t.double() for t in (x, m, v, do)))
                got, ref = forward_backward(op, x, m, v, do), forward_backward(torch_path, x, m, v, do)
                err = {n: rel_err(a, b) for n, a, b in zip(names, got, exact)}
                err_torch = {n: rel_err(a, b) for n, a, b in zip(names, ref, exact)}
                if dtype == torch.float32:
                    ok = all(err[n] < (1e-4 if n == "o" else 1e-3) for n in names)
                else:
                    ok = all(err[n] < 2 * err_torch[n] + 1e-3 for n in names)
                emit(**row, ok=ok, err_triton=err, err_torch=err_torch,
                     triton_vs_torch={n: rel_err(a, b) for n, a, b in zip(names, got, ref)}, configs=tuned_configs())
                del exact, got, ref


def last_rows_errors(op, B, H, T, dh, R, dtype):
    """The op's output, dm and dx against float64 with an output gradient on the last R positions
    only: those positions' outputs and metric gradients, and every position's dx (as a key, and
    for the last R as a query), have a cheap reference, their own queries against all keys, so
    T can be large enough for T * H * dh^2 to pass 2^31 (offsets into m that need 64 bits)."""
    x, m, v, _ = make_inputs(B, H, T, dh, static=False, dtype=dtype, draw_on=DEVICE)   # m: 6.4 GB at the GPU shape
    do = torch.zeros_like(x)
    do[:, :, -R:] = torch.randn(B, H, R, dh, generator=torch.Generator().manual_seed(5)).to(do)
    o, dx, dm, _ = forward_backward(op, x, m, v, do)
    xd, md = x.double().requires_grad_(), m[:, -R:].double().requires_grad_()
    scores = torch.einsum("bhtd,bthde->bhte", xd[:, :, -R:], md) @ xd.transpose(-1, -2) / dh ** 0.5   # (B, H, R, T)
    causal = torch.ones(R, T, dtype=torch.bool, device=x.device).triu(T - R + 1)
    o_last = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v.double()
    o_last.backward(do[:, :, -R:].double())
    return {"o": rel_err(o[:, :, -R:], o_last), "dx": rel_err(dx, xd.grad), "dm": rel_err(dm[:, -R:], md.grad)}


def last_rows_ok(err):
    """last_rows_errors' bar: loose for 16-bit inputs, and far below the gross errors an offset
    that overflows gives."""
    return err["o"] < 2e-2 and err["dx"] < 5e-2 and err["dm"] < 5e-2


def check_large_offsets(op, budget, shape=(1, 24, 8192, 128, 16), dtype=torch.bfloat16):
    """last_rows_errors at T * H * dh^2 > 2^31 (the smoke run: a small shape, in float32)."""
    B, H, T, dh, R = shape
    row = dict(kind="check", dtype=str(dtype)[6:], metric="per_token", B=B, H=H, T=T, dh=dh,
               offsets_past_2_31=T * H * dh * dh >= 2**31)
    if budget.over():
        return emit(**row, skipped="time budget")
    err = last_rows_errors(op, B, H, T, dh, R, dtype)
    emit(**row, ok=last_rows_ok(err), err_triton=err, configs=tuned_configs())


def tuned_configs():
    """The config autotuning chose for each Triton kernel at its last launch."""
    import damcha_triton
    kernels = (damcha_triton._attn_fwd, damcha_triton._bwd_dkdv, damcha_triton._bwd_dq)
    return {k.fn.__name__: str(getattr(k, "best_config", None)) for k in kernels}


def op_plan(ops, dtypes):
    """(metric, dtype, impls) in the order the op rows run them: per-token metrics first (the
    model's), the kernels and the torch path in each dtype before torch_compiled, whose two cold
    compiles must not cut the float32 row, then the static metric (no torch_compiled there: a
    GPT with a static metric runs the torch path whatever its kernel setting). torch_compiled in
    the first dtype only on a GPU: a compiled model trains in bf16."""
    plain, plan = [impl for impl in ops if impl != "torch_compiled"], []
    for metric, static in METRICS.items():          # per-token first
        plan += [(metric, dtype, plain) for dtype in dtypes]
        if "torch_compiled" in ops and not static:
            plan += [(metric, dtype, ["torch_compiled"]) for dtype in (dtypes[:1] if DEVICE == "cuda" else dtypes)]
    return plan


def op_rows(ops, shape, dtypes, peak_bandwidth, budget):
    B, H, T, dh = shape
    base, read = {}, {}   # per dtype and metric: the torch path's times, a plain read of m
    for metric, dtype, impls in op_plan(ops, dtypes):
        static, key = METRICS[metric], (dtype, metric)
        row = dict(kind="op", dtype=str(dtype)[6:], metric=metric, B=B, H=H, T=T, dh=dh)
        if budget.over():
            emit(**row, **({"impl": impls[0]} if impls == ["torch_compiled"] else {}), skipped="time budget")
            continue
        x, m, v, do = make_inputs(B, H, T, dh, static, dtype=dtype)
        torch._dynamo.reset()   # torch_compiled compiles afresh: earlier rows' graphs count to the recompile limit
        ms, reference = {}, None
        for impl in impls:
            try:
                with torch.no_grad():
                    fwd = time_ms(lambda: ops[impl](x, m, v))
                ms[impl] = fwd, time_ms(lambda: forward_backward(ops[impl], x, m, v, do))
            except Exception as e:  # torch_compiled has not yet run on a GPU: report it, time the others
                emit(**row, impl=impl, error=failure(e))
        m_bytes = m.numel() * m.element_size()
        if not static and key not in read:
            # a reference for the bandwidth on m: torch's own reduction reading m once (a
            # reference, not a bound: a kernel may read faster)
            read[key] = m_bytes / time_ms(lambda: m.sum(dtype=torch.float32)) * 1e3
            emit(**row, impl="read_m", m_GBps=round(read[key] / 1e9, 1),
                 m_bandwidth_vs_peak=None if peak_bandwidth is None else round(read[key] / peak_bandwidth, 3))
        if "torch" in ms:
            base[key] = ms["torch"]
            reference = forward_backward(ops["torch"], x, m, v, do)
        torch_fwd, torch_fwd_bwd = base.get(key, (None, None))   # None when the torch path itself failed
        for impl, (fwd, fwd_bwd) in ms.items():
            bandwidth = m_bytes / fwd * 1e3
            # the output and gradients against the torch path's, at this shape and the config chosen for it
            agree = None if impl == "torch" or "torch" not in ms else {
                n: rel_err(a, b) for n, a, b in zip(("o", "dx", "dm", "dv"), forward_backward(ops[impl], x, m, v, do), reference)}
            emit(**row, impl=impl, fwd_ms=round(fwd, 3), fwd_bwd_ms=round(fwd_bwd, 3), vs_torch=agree,
                 fwd_speedup_vs_torch=torch_fwd and round(torch_fwd / fwd, 3),
                 fwd_bwd_speedup_vs_torch=torch_fwd_bwd and round(torch_fwd_bwd / fwd_bwd, 3),
                 **({} if static else dict(
                     m_GBps=round(bandwidth / 1e9, 1),
                     m_bandwidth_vs_peak=None if peak_bandwidth is None else round(bandwidth / peak_bandwidth, 3),
                     m_bandwidth_vs_read=round(bandwidth / read[key], 3))),
                 peak_mib=peak_mib(lambda: forward_backward(ops[impl], x, m, v, do)),
                 **(dict(configs=tuned_configs()) if impl == "triton" else {}))
        del x, m, v, do, reference


def profile_step(step, top=8):
    """One step under torch.profiler: total device ms (CPU ms on a CPU), the kernels run (calls),
    the `top` kernels by their own time, as [name, ms, calls], and the host's side: the launches
    (kernel and CUDA-graph launches, copies and fills), the runtime's synchronize calls (the
    profile's own closing one left out) and the `top` host ops by their own CPU time. On a GPU
    only the kernels count to the device time: the profiler also files each kernel's time under
    the op that launched it and under annotations such as the optimizer step, which would count
    it twice. Returns (summary, the profiler's table of kernels and host ops as text)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize()
    device, key = (DeviceType.CUDA, "self_device_time_total") if DEVICE == "cuda" else (DeviceType.CPU, "self_cpu_time_total")
    averages = prof.key_averages()
    events = [e for e in averages
              if e.device_type == device and not e.is_user_annotation and getattr(e, key) > 0]
    if not events:   # a profiler that recorded nothing must not read as a step that took no time
        raise RuntimeError("the profiler recorded no kernels")
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    host = sorted((e for e in averages if e.device_type == DeviceType.CPU and not e.is_user_annotation),
                  key=lambda e: e.self_cpu_time_total, reverse=True)
    runtime = {e.key: e.count for e in host}
    summary = dict(
        total_ms=round(sum(getattr(e, key) for e in events) / 1e3, 3), kernels=sum(e.count for e in events),
        top=[[e.key[:80], round(getattr(e, key) / 1e3, 3), e.count] for e in events[:top]],
        launches=sum(n for name, n in runtime.items() if name.startswith(LAUNCHES)),
        runtime_syncs=sum(n for name, n in runtime.items() if "Synchronize" in name) - (DEVICE == "cuda"),
        host_top=[[e.key[:80], round(e.self_cpu_time_total / 1e3, 3), e.count] for e in host[:top]])
    sort_by = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    table = (averages.table(sort_by=sort_by, row_limit=25, max_name_column_width=80) + "\n"
             + averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=80))
    return summary, table


def compile_on_device(fn, mode="default", **kwargs):
    """torch.compile with Inductor, in `mode`, on a GPU. On a CPU (--smoke) with
    backend="aot_eager", which has no modes: the same graph capture and autograd trace, without
    Inductor's C++ code generation, which would be most of the smoke run's time and is no part
    of the GPU path."""
    if DEVICE == "cuda":
        return torch.compile(fn, backend="inductor", mode=mode, **kwargs)
    return torch.compile(fn, backend="aot_eager", **kwargs)


def autocast():
    """bf16 autocast on a GPU, as train_char.py trains; float32 on a CPU."""
    return torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda")


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_row(variant, idx, compiled, peak_flops):
    """Time one training step of GPT(variant) on the batch idx. Returns (row, step), step for the
    profile that follows all timed rows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**variant)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
    run = compile_on_device(model) if compiled else model

    def step():
        with autocast():
            _, loss = run(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    synchronize()
    start = time.time()
    step()                                               # compiles, if compiled
    synchronize()
    first_s = time.time() - start
    ms = time_ms(step, rep=1000)                         # tens of steps: a step is 20-100 ms
    tokens = idx.numel()
    flops = flops_per_token(model.config) * tokens / (ms / 1e3)
    row = dict(ms_per_step=round(ms, 2), host_ms=round(host_ms(step), 2), tokens_per_s=round(tokens / ms * 1e3),
               mfu=None if peak_flops is None else round(flops / peak_flops, 3),
               peak_mib=peak_mib(step), first_step_s=round(first_s, 1))
    return row, step


def host_ms(step, n=5):
    """Median ms the host takes to launch one step, from an idle GPU: the call returns once every
    kernel is queued, not when they have run (it waits sooner only if the launch queue fills). A step
    whose ms_per_step is about this, and well above its profile's device time, is bound by the host."""
    times = []
    for _ in range(n):
        synchronize()
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    synchronize()
    return sorted(times)[n // 2]


def matmul_row(B, T, D, peak_flops):
    """The MLP's first matmul alone, (B*T, D) @ (D, 4D), in bf16 (float32 on a CPU): the FLOP rate
    that the model's largest matmuls reach on this device, to read the model rows' MFU against."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    a, w = (torch.randn(*shape, device=DEVICE, dtype=dtype) for shape in ((B * T, D), (D, 4 * D)))
    ms = time_ms(lambda: a @ w)
    flops = 2 * B * T * D * 4 * D / (ms / 1e3)
    emit(kind="model", name="matmul", B=B, T=T, n_embd=D, dtype=str(dtype)[6:], ms=round(ms, 3),
         tflops=round(flops / 1e12, 1), mfu=None if peak_flops is None else round(flops / peak_flops, 3))


def grad_agreement(damcha, idx):
    """The bf16 gradients of the two DAMCHA paths (float32 on a CPU), the same weights and batch."""
    grads = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**dict(damcha, kernel=kernel))).to(DEVICE)
        with autocast():
            _, loss = model(idx, idx)
        loss.backward()
        grads[kernel] = {n: p.grad for n, p in model.named_parameters()}
    errs = {n: rel_err(grads["triton"][n], g) for n, g in grads["torch"].items()}
    worst = max(errs, key=errs.get)
    emit(kind="model", name="grad_agreement", dtype="bfloat16" if DEVICE == "cuda" else "float32",
         max_rel_err=errs[worst], worst_param=worst, median_rel_err=sorted(errs.values())[len(errs) // 2])


def model_variants(fields, gen_out):
    """MHA's fields and DAMCHA's, its generator width giving MHA's parameter count."""
    mha = dict(fields, attn="mha")
    damcha = dict(fields, gen_out=gen_out)
    damcha["gen_width"] = equal_params_width(count_params(mha), damcha)
    return mha, damcha


def model_rows(fields, B, peak_flops, budget, gen_out="full", profile=False):
    """The matmul row, the gradient agreement, every timed step, then (budget allowing) the
    profiles: after all the timing, so that no profiler is attached while a row is timed."""
    if budget.over():   # --budget_model=0: the section is skipped
        return emit(kind="model", skipped="time budget")
    matmul_row(B, fields["block_size"], fields["n_embd"], peak_flops)
    mha, damcha = model_variants(fields, gen_out)
    variants = {"mha": mha, "damcha/torch": dict(damcha, kernel="torch"), "damcha/triton": dict(damcha, kernel="triton")}
    idx = torch.randint(fields["vocab_size"], (B, fields["block_size"]), generator=torch.Generator().manual_seed(0))
    idx = idx.to(DEVICE)
    try:   # a model that fails (an inductor error, a shortage of memory) is a row: the train rows still run
        grad_agreement(damcha, idx)
    except Exception as e:
        emit(kind="model", name="grad_agreement", error=failure(e))
    steps = {}
    for compiled in (False, True):
        for name, variant in variants.items():
            row = dict(kind="model", name=name, compiled=compiled, B=B, params=count_params(variant), **variant)
            if budget.over() or (compiled and DEVICE != "cuda"):
                emit(**row, skipped="time budget" if DEVICE == "cuda" else "no GPU")
                continue
            try:
                timing, steps[name, compiled] = step_row(variant, idx, compiled, peak_flops)
            except Exception as e:
                emit(**row, error=failure(e))
                continue
            emit(**row, **timing)
    for (name, compiled), step in steps.items() if profile else ():
        row = dict(kind="profile", name=name, compiled=compiled, B=B)
        if budget.over():
            emit(**row, skipped="time budget")
            continue
        try:
            emit(**row, **profile_step(step)[0])
        except Exception as e:      # the profiler has not yet run on a GPU here: a failure is reported, not fatal
            emit(**row, error=failure(e))


def train_step(variant, B, mode):
    """train_char.py's training step for GPT(variant), compiled in torch.compile's `mode`: rows
    from its get_batch (one corpus of random tokens), the forward and backward under bf16
    autocast, the loss kept on the device for the log line, gradient clipping at 1.0 and the
    model's own AdamW (fused on CUDA); the loss scaler, disabled in bf16, does nothing."""
    import numpy as np
    import train_char
    from data.dataset import Corpus
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**variant)).to(DEVICE)
    model = compile_on_device(raw, mode=mode)
    optimizer = raw.configure_optimizers(0.1, 1e-4, (0.9, 0.99), DEVICE)
    tokens = np.random.default_rng(0).integers(0, variant["vocab_size"], 2**20, dtype=np.uint8)
    corpora, batches = [Corpus("random", "", dict(train=tokens), None)], torch.Generator().manual_seed(0)

    def step():
        X, Y = train_char.get_batch(corpora, "train", B, variant["block_size"], batches, DEVICE)
        with autocast():
            _, loss = model(X, Y)
        kept = torch.zeros((), device=DEVICE)
        kept += loss.detach()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return kept
    return raw, step


def host_syncs(step):
    """The step's waits for the device that torch can see (.item(), copies to the host, ...): the
    warnings of torch.cuda.set_sync_debug_mode over one step (None on a CPU)."""
    if DEVICE != "cuda":
        return None
    import warnings
    synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def busy_row(row, variant, mode, peak_flops, busy_dir):
    """One compiled train_step: its timing, the profile of one step and its waits for the device.
    The first three steps compile it and, in reduce-overhead, record its CUDA graphs."""
    B = row["B"]
    torch._dynamo.reset()   # each row compiles afresh: the rows' models count to one recompile limit
    start = time.time()
    model, step = train_step(variant, B, mode)
    for _ in range(3):
        step()
    synchronize()
    compile_s = time.time() - start
    ms = time_ms(step, rep=500)
    profile, table = profile_step(step)
    tokens = B * variant["block_size"]
    flops = flops_per_token(model.config) * tokens / (ms / 1e3)
    timing = dict(ms_per_step=round(ms, 2), device_ms=profile["total_ms"],
                  busy=round(profile["total_ms"] / ms, 3),
                  **{k: profile[k] for k in ("launches", "kernels", "runtime_syncs")},
                  host_syncs=host_syncs(step), host_ms=round(host_ms(step), 2),
                  tokens_per_s=round(tokens / ms * 1e3),
                  mfu=None if peak_flops is None else round(flops / peak_flops, 3),
                  compile_s=round(compile_s, 1))
    if busy_dir:
        name = f"{row['shape']}-{row['name'].replace('/', '-')}-{mode}"
        with open(os.path.join(busy_dir, f"{name}.txt"), "w") as f:
            f.write(table)
        with open(os.path.join(busy_dir, "profile.jsonl"), "a") as f:
            tops = {k: profile[k] for k in ("top", "host_top")}
            f.write(json.dumps(finite(dict(row, **timing, **tops))) + "\n")
    return timing


def busy_targets(rows, shape, mode):
    """The issue's targets at one shape and compile mode, from its busy rows (those that ran)."""
    by = {r["name"]: r for r in rows if "ms_per_step" in r}
    damcha = [by[n]["tokens_per_s"] for n in ("damcha/torch", "damcha/triton") if n in by]
    both = "damcha/torch" in by and "damcha/triton" in by
    emit(kind="busy_targets", shape=shape, mode=mode, paths=sorted(by),
         min_busy=min((r["busy"] for r in by.values()), default=None),
         all_busy_90=bool(by) and all(r["busy"] >= 0.9 for r in by.values()),
         kernel_vs_torch_ms=round(by["damcha/triton"]["ms_per_step"] / by["damcha/torch"]["ms_per_step"], 3)
         if both else None,
         damcha_vs_mha_tokens=None if not damcha or "mha" not in by
         else round(max(damcha) / by["mha"]["tokens_per_s"], 3),
         mha_mfu=by["mha"]["mfu"] if "mha" in by else None)


def busy_rows(shapes, modes, peak_flops, budget, busy_dir=""):
    """The busy section: each shape, each compile mode, MHA and both DAMCHA paths; a row that
    raises is an error row, and the rest run."""
    if busy_dir:
        os.makedirs(busy_dir, exist_ok=True)
    for shape in shapes:
        fields = dict(BUSY_SHAPES[shape], vocab_size=65)
        B, gen_out = fields.pop("batch_size"), fields.pop("gen_out")
        mha, damcha = model_variants(fields, gen_out)
        variants = {"mha": mha, "damcha/torch": dict(damcha, kernel="torch"),
                    "damcha/triton": dict(damcha, kernel="triton")}
        for mode in modes:
            rows = []
            for name, variant in variants.items():
                row = dict(kind="busy", shape=shape, name=name, mode=mode, B=B,
                           params=count_params(variant), **variant)
                if budget.over():
                    emit(**row, skipped="time budget")
                    continue
                try:
                    rows.append(dict(row, **busy_row(row, variant, mode, peak_flops, busy_dir)))
                    emit(**rows[-1])
                except Exception as e:
                    emit(**row, error=failure(e))
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            busy_targets(rows, shape, mode)


def train_argv(config_files, iters, smoke, kernel, out_dir):
    """The train row's command: the config files on the bundled text, iters iterations; smoke: a
    1-layer model, uncompiled, on this script's device (on a GPU the kernels compile for it: a GPU's
    torch may bring a Triton whose interpreter fails, results/gpu/)."""
    argv = [sys.executable, "train_char.py", *config_files, "--dataset=shakespeare", f"--max_iters={iters}",
            f"--lr_decay_iters={iters}", "--warmup_iters=0", f"--eval_interval={iters}", "--eval_iters=1",
            "--log_interval=10", "--max_new_tokens=50", f"--out_dir={out_dir}", f"--kernel={kernel}"]
    if smoke:
        argv += [f"--device={DEVICE}", "--compile=False", "--n_layer=1", "--n_embd=32", "--n_head=2",
                 "--block_size=16", "--batch_size=2", "--dropout=0.0", "--gen_width=16"]
    return argv


def train_rows(config_files, iters, smoke, budget):
    # smoke: the triton path only (tests/test_train.py runs the torch one), a 1-layer model
    for kernel in ("triton",) if smoke else ("triton", "torch"):   # the kernel first: the budget may stop the second
        row = dict(kind="train", kernel=kernel, configs=config_files, iters=iters)
        left = budget.deadline - time.time()
        if budget.over() or (not smoke and left < TRAIN_ROW_S):
            emit(**row, skipped="time budget")
            continue
        with tempfile.TemporaryDirectory() as out_dir:
            env = dict(os.environ, TRITON_INTERPRET="1") if DEVICE == "cpu" else os.environ
            start = time.time()
            try:    # a row that starts is given 2 minutes if the whole check's deadline allows
                done = subprocess.run(train_argv(config_files, iters, smoke, kernel, out_dir), capture_output=True,
                                      text=True, env=env, cwd=ROOT,
                                      timeout=min(max(120.0, budget.end - time.time() + 30), max(left, 1.0)))
            except subprocess.TimeoutExpired:
                emit(**row, skipped="time budget: stopped", wall_s=round(time.time() - start, 1))
                continue
            lines = [line for line in (done.stdout + done.stderr).splitlines() if "loss" in line or "rror" in line]
            emit(**row, rc=done.returncode, wall_s=round(time.time() - start, 1), tail=lines[-3:])


def main(argv):
    t0 = time.time()
    cfg, _ = configure(DEFAULTS, argv, choices={"gen_out": ("full", "folded")},
                       positive=("n_layer", "n_head", "n_embd", "block_size", "batch_size", "train_iters",
                                 "budget_total"), doc=__doc__)
    smoke = cfg["smoke"]
    shapes, modes = ([s for s in cfg[k].split(",") if s] for k in ("busy_shapes", "compile_modes"))
    unknown = [s for s in shapes if s not in BUSY_SHAPES] + [m for m in modes if m not in COMPILE_MODES]
    if unknown:
        die(f"busy_shapes or compile_modes: {', '.join(unknown)} unknown (shapes: "
            f"{', '.join(BUSY_SHAPES)}; modes: {', '.join(COMPILE_MODES)})")
    if DEVICE == "cpu" and not smoke:
        die("no CUDA GPU: run with --smoke to check the script on the CPU")
    if DEVICE == "cpu":
        # the interpreter must be chosen before triton is first imported: by damcha_triton, or by
        # torch's compile machinery, which building a GPT below already loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:    # a model the model rows cannot build is refused now, not after the sections before them
        _, damcha = model_variants({k: cfg[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}, cfg["gen_out"])
        GPTConfig(**damcha, kernel="triton")
    except ValueError as e:
        die(f"invalid model: {e}")
    train_configs, train_iters = [f for f in cfg["train_configs"].split(",") if f], 2 if smoke else cfg["train_iters"]
    if cfg["budget_train"]:   # a wrong config file is refused now, not after the other sections' device time
        shown = subprocess.run(train_argv(train_configs, train_iters, smoke, "triton", "out-check") + ["--mode=config"],
                               capture_output=True, text=True, cwd=ROOT)
        if shown.returncode:
            why = (shown.stderr.strip().splitlines() or ['?'])[-1].removeprefix('error: ')
            die(f"the train rows' command would fail: {why}")
    import triton
    from damcha_triton import damcha_attention

    deadline = t0 + cfg["budget_total"] * (3 if smoke else 1)   # the CPU is slower
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu"
    peak_bandwidth = peak_flops = None
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        peak_bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 or None          # DDR: two transfers a clock
        peak_flops = next((f for key, f in PEAK_BF16_FLOPS.items() if key in name), None)
    emit(kind="setup", device=name, smoke=smoke, torch=torch.__version__, triton=triton.__version__,
         peak_GBps=None if peak_bandwidth is None else round(peak_bandwidth / 1e9), peak_bf16_flops=peak_flops)
    if smoke:
        check_shapes, dtypes = [(1, 2, 20, 8), (1, 2, 19, 12)], [torch.float32]
        op_shape = (1, 2, 20, 16)
        fields = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=32)
        B = 2
    else:
        # the model's head size first, then the largest, then those the kernels pad
        check_shapes = [(1, 4, 1000, 64), (1, 4, 1023, 128), (1, 4, 777, 48), (1, 4, 1023, 16), (1, 4, 1000, 8)]
        dtypes = [torch.bfloat16, torch.float32]       # the training precision first
        op_shape = (8, 12, 1024, 64)
        fields = dict(vocab_size=65, **{k: cfg[k] for k in ("block_size", "n_layer", "n_head", "n_embd")})
        B = cfg["batch_size"]
    budget = Budget(cfg["budget_check"], deadline)
    if smoke:
        check_large_offsets(damcha_attention, budget, shape=(1, 2, 40, 8, 16), dtype=torch.float32)
    else:
        check_large_offsets(damcha_attention, budget)
    checks(damcha_attention, check_shapes, dtypes, budget)
    # torch_compiled: the torch path as a compiled model runs it, q = x m as inductor generates it
    ops = {"torch": torch_path, "torch_compiled": compile_on_device(torch_path, dynamic=False), "triton": damcha_attention}
    op_rows(ops, op_shape, dtypes, peak_bandwidth, Budget(cfg["budget_op"], deadline))
    model_rows(fields, B, peak_flops, Budget(cfg["budget_model"], deadline), cfg["gen_out"], cfg["profile"])
    busy_rows(["smoke"] if smoke else shapes, modes, peak_flops, Budget(cfg["budget_busy"], deadline),
              cfg["busy_dir"])
    train_rows(train_configs, train_iters, smoke,
               Budget(3 * cfg["budget_train"] if smoke else cfg["budget_train"], deadline))     # the CPU is slower
    emit(kind="done", wall_s=round(time.time() - t0, 1))


if __name__ == "__main__":
    main(sys.argv[1:])
