"""
bench.py: what a DAMCHA training step costs next to MHA's, in time and in memory.

    python lab/bench.py --quick --device=cpu      # the main rows only
    python lab/bench.py --device=cpu              # also the T sweep and the DCMHA, THA baselines
    python lab/bench.py --device=cuda             # on a GPU, in bf16 autocast, with MFU (lab/counts.py)
    python lab/bench.py --memory                  # peak memory of a train step, gen_out="full" vs "folded"

Settings are --key=value (configurator.py): quick, memory, device (cpu | cuda), dtype (auto |
float32 | bfloat16; auto: bfloat16 autocast on CUDA, float32 on the CPU), repeats (timed steps per
model; 0: 20 with --quick, else 12), the model's batch_size, block_size, n_layer, n_head, n_embd,
vocab_size, gen_depth, gen_out (of the damcha row; the other value gives damcha_full or
damcha_folded), and sweep_batch (sequences a step in the T sweep).

A training step is forward, backward and an AdamW update (GPT.configure_optimizers) on random
tokens. The model is train_char.py's default (4 layers, 4 heads, D = 128, T = 64, a shared folded
generator of depth 2), with three differences: batch 16 (train_char.py: 12), a vocabulary of 65
(train_char.py: the dataset's, 80 for the bundled corpus), and the damcha row's generator width
solved for equal parameters with MHA (w = 30 at these sizes, train_char.py's default).
The rows, one JSON object per line:
  mha, damcha            MHA and DAMCHA at equal parameter count: DAMCHA's generator width is
                         solved for (equal_params_width) so that the counts agree within 5%
  damcha_full            the same with gen_out="full" (damcha_folded when --gen_out=full)
  damcha_unshared        a generator per layer (share=False), damcha's width
  damcha_static          a learned constant metric (adaptive=False)
  damcha_w{w}            the generator-width sweep
  damcha_triton          with --device=cuda: damcha with kernel="triton" (the fused kernel of
                         damcha_triton.py); a row with the error instead if one step of it fails
  dcmha, tha             the baselines (not with --quick)
  mha_T{T}, damcha_T{T}  T = 256 .. 2048 at sweep_batch sequences a step (not with --quick)
  damcha_parts           what costs what: the generator, the metric application q_i = x_i m_i and
                         the attention, each timed alone (forward and backward, all layers), next
                         to MHA's q, k projections, which DAMCHA does without
  numpy_f64, torch_f64   damcha_numpy against damcha_torch, float64 forward and backward, at
                         damcha_numpy's demo size
Every row has name, params (GPT.get_num_params(), i.e. without the position embedding),
tokens_per_sec and peak_mb (null where not measured). The models of a group are timed alternately,
one step each in turn, repeatedly, and a row reports the median step: these machines are shared,
and bursts of load from other processes then fall on all models alike. On the CPU each step is
timed by the wall clock; on CUDA by a pair of CUDA events around it, read after the last step, so
that no step waits for the host. Rows carry their ratios to MHA's: params_vs_mha, peak_vs_mha,
and throughput_vs_mha, the median over the rounds of the ratio of the two steps within a round.
peak_mb is the memory of one train step in the timed dtype (train_step_peak_memory): on the CPU the
growth of the peak RSS of a fresh process over what the libraries take (rss_peak_mb is that
process's whole peak), on CUDA the peak of allocated memory. A summary goes to stderr.

--memory: one float32 AdamW step at B=4, T=512, D=256, H=8, w=128, 4 layers, with the shared
generator and with one per layer, gen_out="full" against "folded", each in a fresh process; of the
settings it takes --device only.
"""
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/bench.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

# first: its excepthook makes memory too short to import torch one line, not a traceback
from shell import die, one_line_errors

import numpy as np
import torch
import torch.nn.functional as F

import damcha_numpy
from configurator import configure
from damcha_torch import GPTConfig, MetricQuery
from lab.counts import count_params, equal_params_width, estimate_mfu
from lab.variants import build

DEFAULTS = dict(quick=False, memory=False, device="cpu", dtype="auto", repeats=0, batch_size=16, block_size=64,
                n_layer=4, n_head=4, n_embd=128, vocab_size=65, gen_depth=2, gen_out="folded", sweep_batch=4)
CHOICES = dict(device=("cpu", "cuda"), dtype=("auto", "float32", "bfloat16"), gen_out=("folded", "full"))
POSITIVE = ("batch_size", "block_size", "n_layer", "n_head", "n_embd", "vocab_size", "gen_depth", "sweep_batch")
QUICK_WIDTHS, WIDTHS = (8, 64), (8, 16, 64, 128, 256)
SWEEP_T = (256, 512, 1024, 2048)
# damcha_numpy's demo run (python damcha_numpy.py, the bundled corpus of 80 distinct bytes): the
# NumPy-against-PyTorch comparison
NUMPY_FIELDS = dict(vocab_size=80, block_size=64, n_layer=2, n_head=4, n_embd=64, gen_width=64, gen_out="full")
NUMPY_BATCH = 16
# --memory: the model of README's memory comparison
MEMORY_FIELDS = dict(vocab_size=65, block_size=512, n_layer=4, n_head=8, n_embd=256, gen_width=128)
MEMORY_BATCH = 4


# ----------------------------------------------------------------------------------------------
# One train step, its time and its memory

def trainer(fields, batch_size, device, dtype):
    """-> (model, a function running one train step on a fixed batch of random tokens)"""
    torch.manual_seed(0)
    config = GPTConfig(**fields)
    model = build(config).to(device)
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device)
    idx = torch.randint(config.vocab_size, (batch_size, config.block_size), device=device)

    def step():
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(idx, idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model, step


def time_alternately(steps, repeats, device, warmup=2):
    """steps: {name: a function running one step}. Each runs `warmup` times to warm up, then
    `repeats` rounds run every one once, in turn, the order reversed every other round so that
    none always follows the same one. Returns {name: seconds of each timed step}. On CUDA each
    step is bracketed by two CUDA events, read once all steps are queued and done."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    events = []
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name]()
                end.record()
                events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    if events:
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end) / 1e3)          # elapsed_time is in ms
    return times


def process_peak_mib():
    """This process's peak resident memory in MiB (Linux: VmHWM; elsewhere ru_maxrss)."""
    if os.path.exists("/proc/self/status"):
        # getrusage's ru_maxrss would start from the size of the parent, which a subprocess
        # inherits through fork and exec; VmHWM is the peak of this process image
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def train_step_peak_memory(fields, batch_size, device="cpu", dtype=torch.float32):
    """Build GPT(GPTConfig(**fields)) and run one train step (trainer's) in dtype. A step of a
    tiny model of the same kind runs first, so that the libraries' one-off allocations (on the
    CPU those of MKL, oneDNN and autograd) count as 'before'. Returns (peak before
    building the model, peak after the step) in MiB: the process's peak RSS on the CPU, the peak
    allocated memory on CUDA. The peak RSS only ever grows, so on the CPU call it in a fresh
    process (fresh_process_peak_memory)."""
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else process_peak_mib
    dh = fields["n_embd"] // fields["n_head"]
    tiny = dict(fields, n_layer=1, n_embd=fields["n_head"] * min(dh, 16), block_size=min(fields["block_size"], 16),
                gen_width=min(fields.get("gen_width", 8), 8))
    trainer(tiny, 1, device, dtype)[1]()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = peak()
    trainer(fields, batch_size, device, dtype)[1]()
    return before, peak()


def fresh_process_peak_memory(fields, batch_size, device="cpu", dtype=torch.float32):
    """train_step_peak_memory run in a fresh Python process with one thread, where both peaks
    start from nothing. Returns (before, peak) in MiB."""
    code = (f"import torch; from lab import bench; torch.set_num_threads(1); print(*bench.train_step_peak_memory("
            f"{fields!r}, {batch_size}, {device!r}, {dtype}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:   # its last line says why (shell.last_resort's line, if memory ran out)
        why = (out.stderr.strip().splitlines() or ["no message"])[-1].removeprefix("error: ")
        raise (MemoryError if why.startswith("out of memory") else RuntimeError)(
            f"the process measuring a train step's memory: {why}")
    return tuple(float(s) for s in out.stdout.split())


def peak_memory(fields, batch_size, device, dtype):
    """-> (peak_mb, process peak in MiB or None): a train step's memory, see the docstring."""
    if device == "cuda":
        before, peak = train_step_peak_memory(fields, batch_size, device, dtype)
        return peak - before, None
    before, peak = fresh_process_peak_memory(fields, batch_size, device, dtype)
    return peak - before, peak


# ----------------------------------------------------------------------------------------------
# The rows

def measure(group, reference, device, dtype, repeats):
    """Time and memory of the models of one group, {name: (GPTConfig fields, batch size)}, timed
    alternately. Returns one row per model, with its ratios to the row named `reference`."""
    rows = {}
    for name, (fields, batch_size) in group.items():
        peak_mb, rss_mb = peak_memory(fields, batch_size, device, dtype)
        rows[name] = dict(name=name, params=count_params(fields), tokens_per_sec=None, peak_mb=round(peak_mb, 1),
                          **({"rss_peak_mb": round(rss_mb, 1)} if rss_mb is not None else {}))
    trainers = {name: trainer(fields, batch_size, device, dtype) for name, (fields, batch_size) in group.items()}
    times = time_alternately({name: step for name, (_, step) in trainers.items()}, repeats, device)
    for name, (fields, batch_size) in group.items():
        dt = statistics.median(times[name])
        rows[name].update(tokens_per_sec=round(batch_size * fields["block_size"] / dt), ms_per_step=round(1e3 * dt, 2),
                          ms_min=round(1e3 * min(times[name]), 2), batch_size=batch_size, device=device,
                          dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                          config={k: v for k, v in fields.items() if k != "vocab_size"})
        if device == "cuda":
            rows[name]["mfu"] = round(estimate_mfu(trainers[name][0].config, batch_size, dt, dtype), 4)
    for name, row in rows.items():
        # the ratio of the steps of one round, taken close together in time, then the median
        # over the rounds: a burst of load that slows a whole round down cancels out
        ratios = [t_ref / t for t_ref, t in zip(times[reference], times[name])]
        ref = rows[reference]
        row.update(params_vs_mha=round(row["params"] / ref["params"], 4),
                   throughput_vs_mha=round(statistics.median(ratios), 3),
                   peak_vs_mha=round(row["peak_mb"] / ref["peak_mb"], 3) if ref["peak_mb"] > 0 else None)
    return list(rows.values())


def cost_breakdown(fields, batch_size, device, dtype, repeats):
    """The parts of a DAMCHA step that MHA does not have, and their MHA counterpart, each timed
    alone over all layers (forward and backward, random inputs and output gradients):
    generator_ms  the context c and the generator f (Eqs. 3-4), once per step when shared
    metric_ms     the queries q_i = x_i m_i of every layer from the one shared m (Eq. 5, as GPT)
    attention_ms  softmax(q k^T) v of every layer (F.scaled_dot_product_attention, as MHA's)
    mha_qk_ms     MHA's q and k projections of every layer (a D -> 2D linear)"""
    config = GPTConfig(**fields)
    B, T, D, H, L = batch_size, config.block_size, config.n_embd, config.n_head, config.n_layer
    dh = D // H
    torch.manual_seed(0)
    model = build(config).to(device)
    qk = torch.nn.Linear(D, 2 * D).to(device)
    rand = lambda *shape: torch.randn(*shape, device=device)
    u, xs = rand(B, T, D).requires_grad_(), [rand(B, T, H, dh).requires_grad_() for _ in range(L)]
    dm, dqs, dqks = rand(B, T, H, dh, dh), [rand(B, T, H, dh) for _ in range(L)], [rand(B, T, 2 * D) for _ in range(L)]
    m = model.gen(u).detach().requires_grad_()
    heads = [rand(B, H, T, dh).requires_grad_() for _ in range(3 * L)]

    def metric():
        torch.autograd.backward([MetricQuery.apply(x, m) for x in xs], dqs)   # as the model does

    def attention():
        ys = [F.scaled_dot_product_attention(*heads[3 * l:3 * l + 3], is_causal=True) for l in range(L)]
        torch.autograd.backward(ys, [dq.transpose(1, 2) for dq in dqs])

    def mha_qk():
        torch.autograd.backward([qk(u) for _ in range(L)], dqks)

    parts = dict(generator=lambda: model.gen(u).backward(dm), metric=metric,
                 attention=attention, mha_qk=mha_qk)
    with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
        times = time_alternately(parts, repeats, device)
    row = dict(name="damcha_parts", params=count_params(fields), tokens_per_sec=None, peak_mb=None)
    row.update({f"{name}_ms": round(1e3 * statistics.median(t), 2) for name, t in times.items()})
    return row


def numpy_vs_torch(repeats):
    """damcha_numpy against damcha_torch, float64 forward and backward on the CPU, the same weights
    and batch, timed alternately. -> rows numpy_f64 (with time_vs_torch) and torch_f64."""
    np_config = damcha_numpy.GPTConfig(**NUMPY_FIELDS)
    params = damcha_numpy.init_params(np_config, seed=0)
    idx = np.random.default_rng(0).integers(0, np_config.vocab_size, (NUMPY_BATCH, np_config.block_size))
    model = build(GPTConfig(**NUMPY_FIELDS)).double()
    model.load_state_dict({k: torch.tensor(v) for k, v in params.items()})
    tidx = torch.tensor(idx)

    def numpy_step():
        _, _, cache = damcha_numpy.forward(params, np_config, idx, idx)
        damcha_numpy.backward(params, np_config, cache)

    def torch_step():
        model.zero_grad(set_to_none=True)
        model(tidx, tidx)[1].backward()

    times = time_alternately({"numpy_f64": numpy_step, "torch_f64": torch_step}, repeats, "cpu")
    dt = {name: statistics.median(t) for name, t in times.items()}
    tokens = NUMPY_BATCH * np_config.block_size
    rows = [dict(name=name, params=count_params(NUMPY_FIELDS), tokens_per_sec=round(tokens / dt[name]), peak_mb=None,
                 ms_per_step=round(1e3 * dt[name], 2), batch_size=NUMPY_BATCH, config=NUMPY_FIELDS) for name in dt]
    rows[0]["time_vs_torch"] = round(dt["numpy_f64"] / dt["torch_f64"], 2)
    return rows


def triton_error(fields, device):
    """Why the Triton kernel cannot train the model GPTConfig(**fields, kernel="triton") here, or
    None when one step runs: triton may not be installed (damcha_triton.py is optional), or the
    kernel may refuse the configuration or fail at run time."""
    try:
        trainer(dict(fields, kernel="triton"), 1, device, torch.float32)[1]()
    except Exception as error:    # whatever the optional kernel raises, the other rows stand
        return f"{type(error).__name__}: {error}"
    return None


# ----------------------------------------------------------------------------------------------
# The two modes

def groups(cfg):
    """The models to compare, {name: GPTConfig fields}, and the damcha row's fields."""
    base = {k: cfg[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    mha = dict(base, attn="mha")
    other_out = "full" if cfg["gen_out"] == "folded" else "folded"
    damcha = dict(base, gen_out=cfg["gen_out"], gen_depth=cfg["gen_depth"])
    damcha["gen_width"] = equal_params_width(count_params(mha), damcha)
    damcha_other = dict(damcha, gen_out=other_out)
    damcha_other["gen_width"] = equal_params_width(count_params(mha), damcha_other)
    group = {"mha": mha, "damcha": damcha, f"damcha_{other_out}": damcha_other,
             "damcha_unshared": dict(damcha, share=False), "damcha_static": dict(damcha, adaptive=False)}
    group.update({f"damcha_w{w}": dict(damcha, gen_width=w) for w in (QUICK_WIDTHS if cfg["quick"] else WIDTHS)})
    if not cfg["quick"]:
        group.update(dcmha=dict(base, attn="dcmha"), tha=dict(base, attn="tha"))
    return group, damcha


def bench(cfg, dtype):
    """The rows of the docstring, in order."""
    group, damcha = groups(cfg)
    device, repeats, B = cfg["device"], cfg["repeats"], cfg["batch_size"]
    rows = []
    if device == "cuda":
        error = triton_error(damcha, device)
        if error is None:
            group["damcha_triton"] = dict(damcha, kernel="triton")
        else:
            rows.append(dict(name="damcha_triton", params=count_params(damcha), tokens_per_sec=None, peak_mb=None,
                             error=error))
    rows += measure({name: (fields, B) for name, fields in group.items()}, "mha", device, dtype, repeats)
    if not cfg["quick"]:
        for T in SWEEP_T:
            sweep = {f"mha_T{T}": (dict(group["mha"], block_size=T), cfg["sweep_batch"]),
                     f"damcha_T{T}": (dict(damcha, block_size=T), cfg["sweep_batch"])}
            rows += measure(sweep, f"mha_T{T}", device, dtype, repeats)
    rows.append(cost_breakdown(damcha, B, device, dtype, repeats))
    return rows + numpy_vs_torch(repeats)


def summarize(rows):
    """The summary lines for stderr: the damcha row against MHA, and what costs what."""
    by_name = {row["name"]: row for row in rows}
    ours, theirs, parts = by_name["damcha"], by_name["mha"], by_name["damcha_parts"]
    check = lambda value, ok: "n/a" if value is None else f"{value:.2f}x, {'met' if ok(value) else 'NOT met'}"
    lines = [f"damcha vs mha: {ours['params']:,} vs {theirs['params']:,} parameters ({ours['params_vs_mha'] - 1:+.1%}, "
             f"generator width {ours['config']['gen_width']}); throughput {check(ours['throughput_vs_mha'], lambda r: r >= 0.8)} "
             f"(target >= 0.8x); step memory {check(ours['peak_vs_mha'], lambda r: r <= 1.5)} (target <= 1.5x)"]
    if "rss_peak_mb" in ours:
        lines.append(f"  whole-process peak RSS {ours['rss_peak_mb'] / theirs['rss_peak_mb']:.2f}x "
                     f"(with the {theirs['rss_peak_mb'] - theirs['peak_mb']:.0f} MiB that the libraries take)")
    lines.append(f"  steps: damcha {ours['ms_per_step']} ms, mha {theirs['ms_per_step']} ms; alone: generator "
                 f"{parts['generator_ms']} ms + metric application {parts['metric_ms']} ms, against MHA's q, k "
                 f"projections {parts['mha_qk_ms']} ms; attention {parts['attention_ms']} ms in both")
    numpy_ratio = by_name["numpy_f64"]["time_vs_torch"]
    lines.append(f"numpy / torch, float64 forward and backward: {check(numpy_ratio, lambda r: r <= 3)} (target <= 3x)")
    return lines


def memory_report(fields, batch_size, device):
    """Peak memory of a float32 train step with gen_out="full" and "folded", shared and unshared
    generator, each on the CPU in a fresh process. -> the lines to print."""
    lines = []
    for share in (True, False):
        f = dict(fields, share=share)
        lines.append(f"B={batch_size} {f} on {device}, float32")
        peaks = {gen_out: (train_step_peak_memory if device == "cuda" else fresh_process_peak_memory)(
                 dict(f, gen_out=gen_out), batch_size, device) for gen_out in ("full", "folded")}
        for gen_out, (before, peak) in peaks.items():
            lines.append(f"  gen_out={gen_out:7s} peak {peak:8.1f} MiB (model and step: {peak - before:8.1f} MiB)")
        (full_before, full), (folded_before, folded) = peaks["full"], peaks["folded"]
        lines.append(f"  full / folded peak: {full / folded:.3f} (model and step: "
                     f"{(full - full_before) / (folded - folded_before):.3f})")
    return lines


def main(argv):
    cfg, given = configure(DEFAULTS, argv, choices=CHOICES, positive=POSITIVE, non_negative=("repeats",), doc=__doc__)
    if cfg["n_embd"] % cfg["n_head"]:
        die(f"n_head ({cfg['n_head']}) must divide n_embd ({cfg['n_embd']})")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        die("--device=cuda: no CUDA device")
    if cfg["memory"]:
        ignored = sorted(given - {"memory", "device"})
        if ignored:   # it would measure its own model and say nothing of these
            die(f"--memory measures its own model and float32 step (see --help); it takes --device only, "
                f"drop {', '.join('--' + k for k in ignored)}")
        for line in memory_report(MEMORY_FIELDS, MEMORY_BATCH, cfg["device"]):
            print(line, flush=True)
        return
    cfg["repeats"] = cfg["repeats"] or (20 if cfg["quick"] else 12)
    dtype = {"auto": torch.bfloat16 if cfg["device"] == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    t0 = time.time()
    rows = bench(cfg, dtype)
    for row in rows:
        print(json.dumps(row), flush=True)
    for line in summarize(rows):
        print(line, file=sys.stderr)
    print(f"wall time {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    with one_line_errors("block_size, batch_size, n_embd, n_layer or sweep_batch"):
        main(sys.argv[1:])
