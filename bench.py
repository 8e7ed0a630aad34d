"""
bench.py: what a DAMCHA training step costs next to MHA's, in time and in memory.

    python bench.py --quick --device=cpu      # under 2 minutes on two CPU cores
    python bench.py --device=cpu              # also the T sweep and the DCMHA, THA baselines
    python bench.py --device=cuda             # on a GPU, in bf16 autocast, with MFU

A training step is forward, backward and an AdamW update on random tokens. The model is
train_char.py's default (4 layers, 4 heads, D = 128, T = 64, a shared folded generator of depth 2;
--n_layer etc. change it), with three differences: batch 16 (train_char.py: 12), a vocabulary of
65 (train_char.py: the dataset's, 80 for the bundled corpus), and the damcha row's generator width
solved for equal parameters with MHA, w = 30 at these sizes (train_char.py: 64).
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
  mha_T{T}, damcha_T{T}  T = 256 .. 2048 at --sweep_batch sequences a step (not with --quick)
  damcha_parts           what costs what: the generator, the metric application q_i = x_i m_i and
                         the attention, each timed alone (forward and backward, all layers), next
                         to MHA's q, k projections, which DAMCHA does without
  numpy_f64, torch_f64   damcha_numpy against damcha_torch, float64 forward and backward, at
                         damcha_numpy's demo size
Every row has name, params (GPT.get_num_params(), i.e. without the position embedding),
tokens_per_sec and peak_mb (null where not measured). The models of a group are timed alternately,
one step each in turn, repeatedly, and a row reports the median step: these machines are shared,
and bursts of load from other processes then fall on all models alike. Rows carry their ratios to
MHA's: params_vs_mha, peak_vs_mha, and throughput_vs_mha, the median over the rounds of the ratio
of the two steps within a round.
peak_mb is the memory of one float32 train step (damcha_torch.train_step_peak_memory): on the CPU
the growth of the peak RSS of a fresh process over what the libraries take (rss_peak_mb is that
process's whole peak), on CUDA the peak of allocated memory. A summary goes to stderr.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import damcha_numpy
from damcha_torch import (GPT, GPTConfig, MetricQuery, compute_metric, count_params, equal_params_width,
                          fresh_process_peak_memory, train_step_peak_memory)

QUICK_WIDTHS, WIDTHS = (8, 64), (8, 16, 64, 128, 256)
SWEEP_T = (256, 512, 1024, 2048)
# damcha_numpy's demo run (python damcha_numpy.py, the bundled corpus of 80 distinct bytes): the
# NumPy-against-PyTorch comparison
NUMPY_FIELDS = dict(vocab_size=80, block_size=64, n_layer=2, n_head=4, n_embd=64, gen_width=64, gen_out="full")
NUMPY_BATCH = 16


def peak_memory(fields, batch_size, device):
    """-> (peak_mb, process peak in MiB or None): a train step's memory, see the docstring."""
    if device == "cuda":
        before, peak = train_step_peak_memory(GPTConfig(**fields), batch_size, device)
        return peak - before, None
    before, peak = fresh_process_peak_memory(fields, batch_size, device)
    return peak - before, peak


def rel_err(a, b):
    """max |a - b| / max |b|, in float64, of two tensors (any dtype, any device) or arrays; the
    relative error of the tests and of bench_triton_gpu.py."""
    a, b = (t.detach().double() if torch.is_tensor(t) else torch.tensor(np.asarray(t, dtype=np.float64))
            for t in (a, b))
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def time_alternately(steps, repeats, device, warmup=2):
    """steps: {name: a function running one step}. Each runs `warmup` times to warm up, then
    `repeats` rounds run every one once, in turn, the order reversed every other round so that
    none always follows the same one. Returns {name: seconds of each timed step}."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            sync()
            t0 = time.perf_counter()
            steps[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def trainer(fields, batch_size, device, dtype):
    """-> (model, a function running one train step on a fixed batch of random tokens)"""
    torch.manual_seed(0)
    config = GPTConfig(**fields)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device == "cuda" else {}))
    idx = torch.randint(config.vocab_size, (batch_size, config.block_size), device=device)

    def step():
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(idx, idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model, step


def measure(group, reference, args, dtype):
    """Time and memory of the models of one group, {name: (GPTConfig fields, batch size)}, timed
    alternately. Returns one row per model, with its ratios to the row named `reference`."""
    rows = {}
    for name, (fields, batch_size) in group.items():
        peak_mb, rss_mb = peak_memory(fields, batch_size, args.device)
        rows[name] = dict(name=name, params=count_params(fields), tokens_per_sec=None, peak_mb=round(peak_mb, 1),
                          **({"rss_peak_mb": round(rss_mb, 1)} if rss_mb is not None else {}))
    trainers = {name: trainer(fields, batch_size, args.device, dtype) for name, (fields, batch_size) in group.items()}
    times = time_alternately({name: step for name, (_, step) in trainers.items()}, args.repeats, args.device)
    for name, (fields, batch_size) in group.items():
        dt = statistics.median(times[name])
        row = rows[name]
        row.update(tokens_per_sec=round(batch_size * fields["block_size"] / dt), ms_per_step=round(1e3 * dt, 2),
                   ms_min=round(1e3 * min(times[name]), 2), batch_size=batch_size, device=args.device,
                   dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                   config={k: v for k, v in fields.items() if k != "vocab_size"})
        if args.device == "cuda":
            row["mfu"] = round(trainers[name][0].estimate_mfu(batch_size, dt), 4)
    for name, row in rows.items():
        # the ratio of the steps of one round, taken close together in time, then the median
        # over the rounds: a burst of load that slows a whole round down cancels out
        ratios = [t_ref / t for t_ref, t in zip(times[reference], times[name])]
        ref = rows[reference]
        row.update(params_vs_mha=round(row["params"] / ref["params"], 4),
                   throughput_vs_mha=round(statistics.median(ratios), 3),
                   peak_vs_mha=round(row["peak_mb"] / ref["peak_mb"], 3) if ref["peak_mb"] > 0 else None)
    return list(rows.values())


def cost_breakdown(fields, batch_size, args, dtype):
    """The parts of a DAMCHA step that MHA does not have, and their MHA counterpart, each timed
    alone over all layers (forward and backward, random inputs and output gradients):
    generator_ms  the context c and the generator f (Eqs. 3-4), once per step when shared
    metric_ms     the queries q_i = x_i m_i of every layer (MetricQuery, as GPT chains it)
    attention_ms  softmax(q k^T) v of every layer (F.scaled_dot_product_attention, as MHA's)
    mha_qk_ms     MHA's q and k projections of every layer (a D -> 2D linear)"""
    config = GPTConfig(**fields)
    B, T, D, H, L = batch_size, config.block_size, config.n_embd, config.n_head, config.n_layer
    dh = D // H
    device = args.device
    torch.manual_seed(0)
    model = GPT(config).to(device)
    qk = torch.nn.Linear(D, 2 * D).to(device)
    rand = lambda *shape: torch.randn(*shape, device=device)
    u, xs = rand(B, T, D).requires_grad_(), [rand(B, T, H, dh).requires_grad_() for _ in range(L)]
    dm, dqs, dqks = rand(B, T, H, dh, dh), [rand(B, T, H, dh) for _ in range(L)], [rand(B, T, 2 * D) for _ in range(L)]
    m = compute_metric(model, u, config).detach().requires_grad_()
    heads = [rand(B, H, T, dh).requires_grad_() for _ in range(3 * L)]

    def metric():
        qs, m_l = [], m
        for x in xs:
            q, m_l = MetricQuery.apply(x, m_l)
            qs.append(q)
        torch.autograd.backward(qs, dqs)

    def attention():
        ys = [F.scaled_dot_product_attention(*heads[3 * l:3 * l + 3], is_causal=True) for l in range(L)]
        torch.autograd.backward(ys, [dq.transpose(1, 2) for dq in dqs])

    def mha_qk():
        torch.autograd.backward([qk(u) for _ in range(L)], dqks)

    parts = dict(generator=lambda: compute_metric(model, u, config).backward(dm), metric=metric,
                 attention=attention, mha_qk=mha_qk)
    with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
        times = time_alternately(parts, args.repeats, device)
    row = dict(name="damcha_parts", params=count_params(fields), tokens_per_sec=None, peak_mb=None)
    row.update({f"{name}_ms": round(1e3 * statistics.median(t), 2) for name, t in times.items()})
    return row


def numpy_vs_torch(args):
    """damcha_numpy against damcha_torch, float64 forward and backward on the CPU, the same weights
    and batch, timed alternately. -> rows numpy_f64 (with time_vs_torch) and torch_f64."""
    np_config = damcha_numpy.GPTConfig(**NUMPY_FIELDS)
    params = damcha_numpy.init_params(np_config, seed=0)
    idx = np.random.default_rng(0).integers(0, np_config.vocab_size, (NUMPY_BATCH, np_config.block_size))
    model = GPT(GPTConfig(**NUMPY_FIELDS)).double()
    model.load_state_dict({k: torch.tensor(v) for k, v in params.items()})
    tidx = torch.tensor(idx)

    def numpy_step():
        _, _, cache = damcha_numpy.forward(params, np_config, idx, idx)
        damcha_numpy.backward(params, np_config, cache)

    def torch_step():
        model.zero_grad(set_to_none=True)
        model(tidx, tidx)[1].backward()

    times = time_alternately({"numpy_f64": numpy_step, "torch_f64": torch_step}, args.repeats, "cpu")
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


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="the main rows only, in under 2 minutes on 2 cores")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="of the timed steps; auto: bfloat16 autocast on CUDA, float32 on the CPU")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per model (0: 20 with --quick, else 12)")
    for name, default in dict(batch_size=16, block_size=64, n_layer=4, n_head=4, n_embd=128, vocab_size=65,
                              gen_depth=2, sweep_batch=4).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--gen_out", default="folded", choices=("folded", "full"),
                        help="the generator output of the damcha row (the other: damcha_full or damcha_folded)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda: no CUDA device")
    args.repeats = args.repeats or (20 if args.quick else 12)
    dtype = {"auto": torch.bfloat16 if args.device == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.time()

    base = dict(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                n_head=args.n_head, n_embd=args.n_embd)
    mha = dict(base, attn="mha")
    other_out = "full" if args.gen_out == "folded" else "folded"
    damcha = dict(base, gen_out=args.gen_out, gen_depth=args.gen_depth)
    damcha["gen_width"] = equal_params_width(count_params(mha), damcha)
    damcha_other = dict(damcha, gen_out=other_out)
    damcha_other["gen_width"] = equal_params_width(count_params(mha), damcha_other)
    B = args.batch_size
    group = {"mha": mha, "damcha": damcha, f"damcha_{other_out}": damcha_other,
             "damcha_unshared": dict(damcha, share=False), "damcha_static": dict(damcha, adaptive=False)}
    group.update({f"damcha_w{w}": dict(damcha, gen_width=w) for w in (QUICK_WIDTHS if args.quick else WIDTHS)})
    if not args.quick:
        group.update(dcmha=dict(base, attn="dcmha"), tha=dict(base, attn="tha"))
    rows = []
    if args.device == "cuda":
        error = triton_error(damcha, args.device)
        if error is None:
            group["damcha_triton"] = dict(damcha, kernel="triton")
        else:
            rows.append(dict(name="damcha_triton", params=count_params(damcha), tokens_per_sec=None, peak_mb=None,
                             error=error))

    rows += measure({name: (fields, B) for name, fields in group.items()}, "mha", args, dtype)
    if not args.quick:
        for T in SWEEP_T:
            sweep = {f"mha_T{T}": (dict(mha, block_size=T), args.sweep_batch),
                     f"damcha_T{T}": (dict(damcha, block_size=T), args.sweep_batch)}
            rows += measure(sweep, f"mha_T{T}", args, dtype)
    rows.append(cost_breakdown(damcha, B, args, dtype))
    rows += numpy_vs_torch(args)
    for row in rows:
        print(json.dumps(row), flush=True)

    by_name = {row["name"]: row for row in rows}
    ours, theirs = by_name["damcha"], by_name["mha"]
    check = lambda value, ok: "n/a" if value is None else f"{value:.2f}x, {'met' if ok(value) else 'NOT met'}"
    say = lambda text: print(text, file=sys.stderr)
    say(f"damcha vs mha: {ours['params']:,} vs {theirs['params']:,} parameters ({ours['params_vs_mha'] - 1:+.1%}, "
        f"generator width {damcha['gen_width']}); throughput {check(ours['throughput_vs_mha'], lambda r: r >= 0.8)} "
        f"(target >= 0.8x); step memory {check(ours['peak_vs_mha'], lambda r: r <= 1.5)} (target <= 1.5x)")
    if "rss_peak_mb" in ours:
        say(f"  whole-process peak RSS {ours['rss_peak_mb'] / theirs['rss_peak_mb']:.2f}x "
            f"(with the {theirs['rss_peak_mb'] - theirs['peak_mb']:.0f} MiB that the libraries take)")
    parts = by_name["damcha_parts"]
    say(f"  steps: damcha {ours['ms_per_step']} ms, mha {theirs['ms_per_step']} ms; alone: generator "
        f"{parts['generator_ms']} ms + metric application {parts['metric_ms']} ms, against MHA's q, k "
        f"projections {parts['mha_qk_ms']} ms; attention {parts['attention_ms']} ms in both")
    numpy_ratio = by_name["numpy_f64"]["time_vs_torch"]
    say(f"numpy / torch, float64 forward and backward: {check(numpy_ratio, lambda r: r <= 3)} (target <= 3x)")
    say(f"wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
