"""
tests/test_triton.py: checks the Triton DAMCHA attention kernels (damcha_triton.py).

Run: python -m pytest -q tests/test_triton.py   (skipped when triton is not installed)

Without a GPU the kernels run on Triton's interpreter, on the CPU, which this module
selects (TRITON_INTERPRET=1) before triton is imported; that setting then holds for the whole
pytest process, and the kernels there use blocks of 16 positions. At small sizes with odd T (37,
70: several blocks, the last one partial): the output and the gradients for x, m and v against a
float64 autograd reference (einsum + SDPA) and against the chain of damcha_numpy's attention
pieces, for per-token and static metrics and head sizes that need padding (8, 12, 48), and in
float16 against float64 (no worse than torch's own float16 path); then the
edge cases of T, input and output layouts, argument checks, dh = 128, autocast, the launch
constants (on meta tensors), the float32 precision setting, torch.compile
tracing through the op, and the whole GPT with GPTConfig(kernel="triton") against kernel="torch",
the independent reference forward and damcha_numpy's gradients. With a GPU the same tests run on
it, the 16-bit one in bfloat16 and float16 at T = 1000, plus T = 4096 in float32, offsets past
2^31, and the forward's peak memory. Errors
are relative to the largest entry: max |a - b| / max |b| (rel_err). The inputs (make_inputs) and
the torch path (torch_path) come from bench_triton_gpu.py, which checks the same on a GPU.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

# the interpreter must be chosen before damcha_triton defines its kernels, hence the late imports
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import damcha_numpy
import damcha_triton
from lab.bench_triton_gpu import last_rows_errors, last_rows_ok, make_inputs, torch_path
from common import MetricSizedOutputs, rel_err
from damcha_torch import GPT, GPTConfig
from damcha_triton import damcha_attention
from lab.counts import flops_per_token
from spec_reference import reference_forward, reference_random_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not damcha_triton.INTERPRETED:
    pytest.skip("damcha_triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
FWD_TOL, GRAD_TOL = 1e-4, 1e-3                       # float32 against float64


def off_in_dx(op, scale):
    """op with its output and dm unchanged and dx off by scale * x: a wrong kernel the checks must catch."""
    return lambda x, m, v: op(x, m, v) + scale * (x - x.detach())


def output_and_grads(op, x, m, v, do):
    """op(x, m, v) and the gradients of sum(op * dO) for x, m and v."""
    x, m, v = (t.detach().requires_grad_() for t in (x, m, v))
    o = op(x, m, v)
    (o * do).sum().backward()
    return o, x.grad, m.grad, v.grad


def check_against_float64(x, m, v, do):
    got = output_and_grads(damcha_attention, x, m, v, do)
    want = output_and_grads(torch_path, *(t.double() for t in (x, m, v, do)))
    for name, a, b, tol in zip(("o", "dx", "dm", "dv"), got, want, (FWD_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL)):
        assert a.dtype == x.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.2e}"


# ----------------------------------------------------------------------------------------------
# float32, small sizes (the interpreter on a CPU)

@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
@pytest.mark.parametrize("B, T, dh", [(2, 37, 8), (2, 37, 12), (1, 70, 48)])   # dh padded to DH = 16, 16, 64
def test_against_torch_path(static, B, T, dh):
    # blocks of 16: T = 37 is two full blocks and a partial one, T = 70 four and a partial one
    check_against_float64(*make_inputs(B, 2, T, dh, static))


@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_against_damcha_numpy(static):
    """The kernels against damcha_numpy's attention pieces, chained as its attention_forward and
    attention_backward chain them (its layout: x (B, T, H, dh))."""
    B, H, T, dh = 2, 2, 21, 8
    x, m, v, do = make_inputs(B, H, T, dh, static, seed=1)
    o, dx, dm, dv = output_and_grads(damcha_attention, x, m, v, do)

    dn = damcha_numpy
    x_np, v_np, do_np = (t.transpose(1, 2).double().cpu().numpy() for t in (x, v, do))   # (B, T, H, dh)
    heads = lambda a: a.transpose(0, 2, 1, 3)                                           # <-> (B, H, T, dh)
    q, cache_q = dn.metric_query_forward(x_np, m.double().cpu().numpy())                # Eq. 5, query side
    S, cache_s = dn.scores_forward(heads(q), heads(x_np))                               # Eq. 5
    A, cache_a = dn.causal_softmax_forward(S)                                           # Eq. 6
    O, cache_v = dn.attn_values_forward(A, heads(v_np))                                 # Eq. 7
    dA, dv_np = dn.attn_values_backward(heads(do_np), cache_v)
    dq, dk = dn.scores_backward(dn.causal_softmax_backward(dA, cache_a), cache_s)
    dx_query, dm_np = dn.metric_query_backward(heads(dq), cache_q)
    dx_np = dx_query + heads(dk)                   # x is the query's input and the key

    assert rel_err(o, torch.from_numpy(O)) < FWD_TOL
    assert rel_err(dx, torch.from_numpy(heads(dx_np))) < GRAD_TOL
    assert rel_err(dm, torch.from_numpy(dm_np)) < GRAD_TOL
    assert rel_err(dv, torch.from_numpy(dv_np)) < GRAD_TOL


@pytest.mark.parametrize("T", [16, 17, 33])
def test_sequence_lengths(T):
    # exactly one block, one past a block, one past two
    check_against_float64(*make_inputs(1, 2, T, 8, static=False, seed=T))


def test_single_position():
    # T = 1: the softmax is over one key, so o = v, and x and m get no gradient (up to rounding)
    x, m, v, do = make_inputs(2, 2, 1, 8, static=False)
    o, dx, dm, dv = output_and_grads(damcha_attention, x, m, v, do)
    assert torch.equal(o, v) and torch.equal(dv, do)
    assert dx.abs().max() < 1e-6 and dm.abs().max() < 1e-6


def test_contiguous_heads_and_strided_output_gradient():
    """x laid out as (B, H, T, dh) while v keeps the model's (B, T, H, dh), a metric that is a
    view, and an output gradient with a zero stride: the kernels follow each tensor's strides."""
    x, m, v, _ = make_inputs(1, 2, 20, 8, static=False, seed=3)
    x = x.contiguous()
    assert x.stride() != v.stride()
    m = m.transpose(-1, -2).contiguous().transpose(-1, -2)             # same values, other strides
    do = torch.randn(1, 2, 20, 1, device=DEVICE).expand(-1, -1, -1, 8)  # stride 0 along dh
    check_against_float64(x, m, v, do)


def test_masked_positions_get_no_gradient():
    # causality: the output at t depends on no later position, through x, m or v
    x, m, v, _ = make_inputs(1, 2, 20, 8, static=False, seed=4)
    do = torch.zeros(1, 2, 20, 8, device=DEVICE)
    do[:, :, :9] = 1.0                                                  # only outputs 0..8 are used
    _, dx, dm, dv = output_and_grads(damcha_attention, x, m, v, do)
    assert dx[:, :, 9:].abs().max() == 0 and dv[:, :, 9:].abs().max() == 0 and dm[:, 9:].abs().max() == 0
    assert dx[:, :, :9].abs().min() > 0


def test_argument_checks():
    x, m, v, _ = make_inputs(1, 2, 8, 8, static=False)
    with pytest.raises(ValueError, match="m must be"):
        damcha_attention(x, m[:, :, :, :4], v)
    with pytest.raises(ValueError, match="x and v"):
        damcha_attention(x, m, v[..., :4])
    with pytest.raises(ValueError, match="one dtype"):
        damcha_attention(x, m.double(), v)
    big = torch.zeros(1, 1, 4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="limit"):
        damcha_attention(big, torch.zeros(1, 256, 256, device=DEVICE), big)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="float32 or float16, not torch.bfloat16"):
            damcha_attention(x.bfloat16(), m.bfloat16(), v.bfloat16())


def test_head_sizes_up_to_the_limit_and_autocast(monkeypatch):
    """dh = 128, the limit, runs; under autocast x, m and v are all cast to its dtype, whichever
    dtypes they come in (emulated here, float16 from float64 or mixed inputs, which the interpreter
    runs too)."""
    x, m, v, do = make_inputs(1, 1, 5, 128, static=False)
    check_against_float64(x, m, v, do)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float16)
    x, m, v, do = make_inputs(1, 2, 20, 8, static=False, dtype=torch.float64)
    o = damcha_attention(x, m, v)
    assert o.dtype == torch.float16 and rel_err(o, torch_path(x, m, v)) < 5e-3
    # as the model hands them over under autocast: x from a LayerNorm in float32, m from a linear in float16
    o = damcha_attention(x.float(), m.half(), v.half())
    assert o.dtype == torch.float16 and rel_err(o, torch_path(x, m, v)) < 5e-3


def test_autotuning_keeps_the_configs_that_fit(monkeypatch):
    """On a GPU (not the interpreter's one config): blocks of 64 or more for 16-bit, of 32 or less
    for float32; at dh = 128 only those that compile without spills (tests/test_sm90_compile.py);
    6 tiles of m in flight for per-token metrics only."""
    monkeypatch.setattr(damcha_triton, "INTERPRETED", False)
    configs = damcha_triton._configs(*damcha_triton.FWD_CONFIGS)
    def kept(dtype, DH, per_token=True):
        return [(c.kwargs["BLOCK"], c.num_warps, c.kwargs["M_STAGES"]) for c in damcha_triton._keep_for_dtype(
            configs, {"x_ptr": torch.empty(0, dtype=dtype)}, DH=DH, PER_TOKEN=per_token)]
    assert kept(torch.bfloat16, 64) == kept(torch.float16, 64) == [(64, 4, 3), (64, 4, 6), (64, 8, 3), (64, 8, 6), (128, 8, 3)]
    assert kept(torch.bfloat16, 64, per_token=False) == [(64, 4, 3), (64, 8, 3), (128, 8, 3)]
    assert kept(torch.bfloat16, 128) == [(64, 8, 3), (64, 8, 6)]
    assert kept(torch.float32, 64) == [(32, 8, 3), (16, 4, 3)] and kept(torch.float32, 128) == [(16, 4, 3)]


def test_output_is_laid_out_as_the_models_heads():
    """o (B, H, T, dh) is stored as (B, T, H, dh), whatever the inputs' layout, so that the
    model's o.transpose(1, 2).reshape(B, T, D) is a view."""
    for contiguous in (False, True):
        x, m, v, _ = make_inputs(1, 2, 20, 8, static=False)
        if contiguous:
            x, v = x.contiguous(), v.contiguous()
        assert damcha_attention(x, m, v).transpose(1, 2).is_contiguous()


def test_launch_constants():
    """On meta tensors (nothing runs): the feature axis is padded to a power of two >= 16, tl.dot's
    smallest K; a static metric takes the kernels' static branch (one tl.dot for q = x m); the
    logsumexp is float32 whatever the inputs' dtype."""
    for dh, DH in [(8, 16), (12, 16), (16, 16), (48, 64), (128, 128)]:
        assert damcha_triton._options(torch.empty(1, 1, 1, dh, device="meta"))["DH"] == DH
    for static in (False, True):
        x = torch.empty(2, 9, 2, 8, device="meta", dtype=torch.bfloat16).transpose(1, 2)
        m = torch.empty(*((2,) if static else (2, 9, 2)), 8, 8, device="meta", dtype=torch.bfloat16)
        (o, lse, q), forward = damcha_triton._forward_plan(x, m, x)
        assert o.dtype == q.dtype == torch.bfloat16 and lse.dtype == torch.float32
        _, backward = damcha_triton._backward_plan(o, x, m, x, o, lse, q)
        per_token = {kernel.fn.__name__: constants["PER_TOKEN"]
                     for kernel, _, _, constants in forward + backward if "PER_TOKEN" in constants}
        assert per_token == {"_attn_fwd": not static, "_bwd_dq": not static}


def test_forward_keeps_q_for_the_backward():
    """The forward stores q = x m (Eq. 5) as its dots used it, so that the backward reads m only
    where it forms dx; the row logsumexp lse (base 2) comes with it."""
    for static in (False, True):
        x, m, v, _ = make_inputs(1, 2, 20, 12, static)
        o, lse, q = damcha_triton._attention(x, m, v)
        want_q = torch.einsum("bhtd,hde->bhte" if static else "bhtd,bthde->bhte", x.double(), m.double())
        scores = (want_q @ x.double().transpose(-1, -2)) / 12 ** 0.5
        scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        assert q.is_contiguous() and rel_err(q, want_q) < FWD_TOL
        assert rel_err(lse, torch.logsumexp(scores, -1) / math.log(2)) < FWD_TOL
        assert rel_err(o, torch.softmax(scores, -1) @ v.double()) < FWD_TOL


def test_backward_op_returns_dq_not_dm():
    """The backward op returns dq (B, H, T, dh), laid out as x, in x's dtype: nothing of m's size.
    Its autograd formula forms dm = x^T dq from it in torch (test below)."""
    for static in (False, True):
        x, m, v, do = make_inputs(2, 2, 20, 8, static)
        o, lse, q = damcha_triton._attention(x, m, v)
        outputs = torch.ops.damcha.attention_backward(do, x, m, v, o, lse, q)
        assert all(t.shape == x.shape and t.stride() == x.stride() and t.dtype == x.dtype for t in outputs)


def test_shared_metric_gradient_is_elementwise():
    """With share=True every layer adds its own dm = x^T dq, as large as m, to m's gradient. The
    kernels' backward must leave it to torch as an elementwise product, as damcha_torch.MetricQuery
    does (tests/test_torch.py has the same test): torch.compile can then fuse the L products into
    one sum, while m-sized outputs of the op itself may stay alive together until the sum
    (results/gpu/). m's B*T*H*dh*dh = 1024 entries are a unique size here."""
    config = GPTConfig(kernel="triton", vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16, gen_width=6)
    model = GPT(config).to(DEVICE)
    idx = torch.randint(config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _, loss = model(idx, idx)
    with MetricSizedOutputs(2 * 8 * 2 * 8 * 8) as mode:
        loss.backward()
    assert mode.ops.count("mul") >= config.n_layer, mode.ops              # each layer's dm, elementwise
    assert not {"attention_backward", "bmm", "mm", "matmul", "baddbmm"} & set(mode.ops), mode.ops


def test_the_last_rows_check_of_large_offsets():
    """The GPU's check of offsets past 2^31 at a size the interpreter runs: its cheap float64
    reference (the last positions' queries only) agrees with the kernels in float32."""
    err = last_rows_errors(damcha_attention, 1, 2, 40, 8, 16, torch.float32)
    assert all(e < GRAD_TOL for e in err.values()) and set(err) == {"o", "dx", "dm"}, err


def test_the_large_offsets_row_fails_on_a_wrong_dx(capsys):
    from lab import bench_triton_gpu as bench
    wrong_dx = off_in_dx(damcha_attention, 1e-1)
    bench.check_large_offsets(wrong_dx, bench.Budget(60), shape=(1, 2, 40, 8, 16), dtype=torch.float32)
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] is False and row["err_triton"]["o"] < 1e-6 and row["err_triton"]["dx"] > 5e-2
    assert row["offsets_past_2_31"] is False   # 40 * 2 * 8^2 is far below 2^31


def test_launch_grid_keeps_batch_and_heads_on_axis_0():
    """CUDA allows 2^31 - 1 programs on grid axis 0 but 65,535 on axes 1 and 2: B * H goes on
    axis 0, the blocks of positions (T / 16 at most) on axis 1. Meta tensors: nothing runs."""
    B, H, T, dh = 6000, 12, 4096, 16                       # B * H = 72,000
    x = torch.empty(B, T, H, dh, device="meta").transpose(1, 2)
    m = torch.empty(B, T, H, dh, dh, device="meta")
    (o, lse, q), launches = damcha_triton._forward_plan(x, m, x)
    launches += damcha_triton._backward_plan(o, x, m, x, o, lse, q)[1]
    for kernel, grid, _, constants in launches:
        grid = grid(dict(BLOCK=16)) if callable(grid) else grid
        assert grid[0] == B * H and grid[1] <= 65535, grid


def test_float32_precision_follows_torch():
    """float32 dots are TF32 exactly when torch's float32 matmuls on CUDA are. Once torch's newer
    fp32_precision API has been used, reading the legacy allow_tf32 flag raises: the
    op must read the new one. In a fresh process, as the setting is process-wide."""
    new_api = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    settings = ("fp32_precision = 'tf32'", "fp32_precision = 'ieee'") if new_api else ("allow_tf32 = True",
                                                                                      "allow_tf32 = False")
    code = "import torch, damcha_triton\n" + "".join(
        f"torch.backends.cuda.matmul.{setting}\n"
        "print(damcha_triton._precision(torch.float32), damcha_triton._precision(torch.bfloat16))\n"
        for setting in settings)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(damcha_triton.__file__), env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tf32", "ieee", "ieee", "ieee"]


def test_torch_compile_traces_through_the_op():
    """torch.compile(fullgraph=True) traces through the op (a torch.library custom op with a fake
    implementation and a registered backward) without a graph break, forward and backward, and
    gives eager's numbers. backend="aot_eager": AOTAutograd's tracing, without Inductor's codegen."""
    import torch._dynamo
    torch._dynamo.reset()
    x, m, v, do = make_inputs(1, 2, 20, 8, static=False)
    op = lambda x, m, v: 2 * damcha_attention(x, m * 0.5, v)
    compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
    for got, want in zip(output_and_grads(compiled, x, m, v, do), output_and_grads(op, x, m, v, do)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_bench_triton_gpu_smoke():
    """python bench_triton_gpu.py --smoke --profile=True: every section runs and prints JSON rows;
    its checks pass, each timed model row is profiled once all are timed (no profiler attached
    while a row is timed), and its train_char.py run with --kernel=triton exits 0. It runs as a
    user runs it, without TRITON_INTERPRET: the script chooses the interpreter itself on a CPU."""
    root = os.path.dirname(damcha_triton.__file__)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "lab/bench_triton_gpu.py", "--smoke", "--profile=True"], capture_output=True,
                          text=True, cwd=root, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    kinds = [row["kind"] for row in rows]
    assert kinds[0] == "setup" and kinds[-1] == "done" and {"check", "op", "model", "train"} <= set(kinds)
    assert not [row for row in rows if "error" in row]
    assert all(row["ok"] for row in rows if row["kind"] == "check")
    assert [row["offsets_past_2_31"] for row in rows if "offsets_past_2_31" in row] == [False]   # the GPU's check, small
    assert all("BLOCK" in config for row in rows if row["kind"] == "check" for config in row["configs"].values())
    ops = [row for row in rows if row["kind"] == "op"]
    # torch_compiled runs in the first dtype on a GPU, every dtype on a CPU: smoke has float32 alone
    assert {row["impl"] for row in ops} == {"read_m", "torch", "triton", "torch_compiled"}
    assert all(row["m_GBps"] > 0 if row["impl"] == "read_m" else row["fwd_ms"] > 0 for row in ops)
    assert all("BLOCK" in config for row in ops if row["impl"] == "triton" for config in row["configs"].values())
    kernel_rows = [row for row in ops if row["impl"] == "triton"]
    assert kernel_rows and all(max(row["vs_torch"].values()) < 1e-4 for row in kernel_rows)   # float32
    assert [row["rc"] for row in rows if row["kind"] == "train"] == [0]
    assert next(row for row in rows if row.get("name") == "matmul")["ms"] > 0
    profiled = [row for row in rows if row["kind"] == "profile"]
    timed = [row for row in rows if row["kind"] == "model" and "ms_per_step" in row]
    assert [row["name"] for row in profiled] == [row["name"] for row in timed] and timed
    assert all(0 < row["host_ms"] for row in timed)
    position = {id(row): i for i, row in enumerate(rows)}
    assert max(position[id(row)] for row in rows if row["kind"] == "model") < min(position[id(row)] for row in profiled)
    assert all(row["total_ms"] >= row["top"][0][1] > 0 for row in profiled)
    agreement = next(row for row in rows if row.get("name") == "grad_agreement")
    bar = GRAD_TOL if agreement["dtype"] == "float32" else 5e-2   # on a GPU both paths run in bf16
    assert agreement["max_rel_err"] < bar and position[id(agreement)] < position[id(timed[0])]


def test_bench_refuses_a_bad_train_config_before_any_section(capsys):
    """The train rows come last: a config file they would fail on is refused before the GPU time."""
    from lab import bench_triton_gpu
    with pytest.raises(SystemExit, match="train rows' command would fail: missing.py: no such config file"):
        bench_triton_gpu.main(["--smoke", "--train_configs=missing.py"])
    assert capsys.readouterr().out == ""   # no row printed


def test_a_row_with_a_nan_is_still_strict_json(capsys):
    """A kernel that returns NaN gives errors that are NaN: the row must still parse as JSON, which
    has no NaN (Python's json.loads accepts it; parse_constant makes it refuse, as jq would)."""
    from lab import bench_triton_gpu

    def refuse(name):
        raise ValueError(f"bare {name} in the output")
    bench_triton_gpu.emit(kind="check", ok=False, err_triton={"o": float("nan"), "dx": 0.5},
                          times=[float("inf"), 1.0])
    row = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert row["err_triton"] == {"o": "nan", "dx": 0.5} and row["times"] == ["inf", 1.0]


def test_a_profile_that_records_nothing_is_an_error():
    """A profiler that recorded no kernels must not read as a step of 0 ms."""
    from lab import bench_triton_gpu
    with pytest.raises(RuntimeError, match="recorded no kernels"):
        bench_triton_gpu.profile_step(lambda: None)


def test_autotuning_keeps_one_choice_per_kind_of_metric():
    """Triton keeps an autotuned config per key (and per dtype of the tensors): a kernel that takes
    both per-token and static metrics must have PER_TOKEN in its key, or a static launch reuses
    the choice made for per-token ones (a 6-deep pipeline over an m it does not stream)."""
    for kernel in (damcha_triton._attn_fwd, damcha_triton._bwd_dkdv, damcha_triton._bwd_dq):
        assert ("PER_TOKEN" in kernel.keys) == ("PER_TOKEN" in kernel.arg_names), kernel.fn.__name__
        assert "PRECISION" in kernel.keys   # and per float32 precision: TF32 or IEEE products


def test_bench_reports_a_failing_implementation_and_times_the_others(capsys):
    """An op that raises in bench_triton_gpu.py's op rows becomes one error row; the rest are timed."""
    from lab import bench_triton_gpu
    def broken(x, m, v):
        raise RuntimeError("no kernel\nfor this")
    bench_triton_gpu.op_rows({"torch": torch_path, "broken": broken}, (1, 2, 8, 4), [torch.float32], None,
                             bench_triton_gpu.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["metric"], r["impl"]) for r in rows if "error" in r] == [("per_token", "broken"), ("static", "broken")]
    assert all(r["error"] == "RuntimeError: no kernel for this" for r in rows if "error" in r)
    assert [(r["metric"], r["impl"]) for r in rows if "fwd_ms" in r] == [("per_token", "torch"), ("static", "torch")]
    bench_triton_gpu.op_rows({"torch": broken, "other": torch_path}, (1, 2, 8, 4), [torch.float32], None,
                             bench_triton_gpu.Budget(60))   # the torch path itself: no ratios to it
    timed = [r for r in map(json.loads, capsys.readouterr().out.splitlines()) if "fwd_ms" in r]
    assert [r["impl"] for r in timed] == ["other", "other"] and all(r["fwd_speedup_vs_torch"] is None for r in timed)
    # the model rows: a gradient agreement or a step that raises is one error row each, and the rest run
    def oom(*args, **kwargs):
        raise RuntimeError("out of memory")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_triton_gpu, "grad_agreement", oom)
        patch.setattr(bench_triton_gpu, "matmul_row", lambda *a: None)
        patch.setattr(bench_triton_gpu, "step_row", oom)
        fields = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
        bench_triton_gpu.model_rows(fields, 1, None, bench_triton_gpu.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [r["name"] for r in rows if r.get("error") == "RuntimeError: out of memory"]
    assert errors == ["grad_agreement", "mha", "damcha/torch", "damcha/triton"]   # compiled steps: no GPU


def test_bench_rows_compute_what_they_name(monkeypatch, capsys):
    """bench_triton_gpu.py's arithmetic, with times set by hand (ms): the bandwidth on m is m's
    bytes over the forward's time, in GB (1e9) per second; the speedups are the torch path's time
    over each; tokens/s and the MFU of a step (6 FLOPs per parameter and token as the model
    counts them) and of a matmul (2 per multiply-add)."""
    from lab import bench_triton_gpu as bench
    times = iter([1e-6, 3e-6, 0.5e-6, 2e-6, 4e-6])   # torch fwd, fwd+bwd; fake fwd, fwd+bwd; the read of m
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: next(times))
    monkeypatch.setattr(bench, "METRICS", {"per_token": False})
    bench.op_rows({"torch": torch_path, "fake": torch_path}, (1, 2, 4, 8), [torch.float32], 4.096e12, bench.Budget(60))
    rows = {r["impl"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    # m (B, T, H, dh, dh) = (1, 4, 2, 8, 8) in float32 is 2048 bytes: read in 4e-6 ms, 512 GB/s
    assert rows["read_m"]["m_GBps"] == 512.0 and rows["read_m"]["m_bandwidth_vs_peak"] == 0.125
    assert (rows["torch"]["m_GBps"], rows["torch"]["m_bandwidth_vs_peak"], rows["torch"]["m_bandwidth_vs_read"]) == (2048.0, 0.5, 4.0)
    assert (rows["fake"]["fwd_speedup_vs_torch"], rows["fake"]["fwd_bwd_speedup_vs_torch"], rows["fake"]["m_GBps"]) == (2.0, 1.5, 4096.0)
    assert rows["torch"]["vs_torch"] is None and rows["fake"]["vs_torch"] == dict(o=0.0, dx=0.0, dm=0.0, dv=0.0)
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 4e-6)
    wrong_dx = off_in_dx(torch_path, 1e-1)
    bench.op_rows({"torch": torch_path, "wrong": wrong_dx}, (1, 2, 4, 8), [torch.float16], 4.096e12, bench.Budget(60))
    rows = {r["impl"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["wrong"]["vs_torch"]["o"] < 1e-6 < 1e-2 < rows["wrong"]["vs_torch"]["dx"]
    assert rows["read_m"]["m_GBps"] == 256.0   # 1024 bytes of float16 m in 4e-6 ms

    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 100.0)
    config = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, gen_width=8)
    row, _ = bench.step_row(config, torch.zeros(2, 16, dtype=torch.long, device=DEVICE), False, peak_flops=1e9)
    assert row["tokens_per_s"] == 320 and row["mfu"] == round(flops_per_token(GPTConfig(**config)) * 32 / 0.1 / 1e9, 3)
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 1.0)
    bench.matmul_row(1, 4, 8, peak_flops=1e6)
    assert json.loads(capsys.readouterr().out)["mfu"] == 2 * 4 * 8 * 32 / 1e-3 / 1e6


def test_bench_checks_fail_on_one_wrong_gradient_and_keep_their_budget(capsys):
    """A check row is ok only if the output and every gradient are; a spent budget skips a row
    without running it."""
    from lab import bench_triton_gpu as bench
    wrong_dx = off_in_dx(torch_path, 1e-2)
    bench.checks(wrong_dx, [(1, 2, 20, 8)], [torch.float32], bench.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and not any(r["ok"] for r in rows) and all(r["err_triton"]["o"] < 1e-6 for r in rows)
    def never(x, m, v):
        raise AssertionError("a skipped row ran")
    bench.checks(never, [(1, 2, 20, 8)], [torch.float32], bench.Budget(-1))
    assert all(json.loads(line)["skipped"] == "time budget" for line in capsys.readouterr().out.splitlines())
    # in 16-bit the bar is the torch path's own error against float64: the kernel wrong in dx fails
    # it, and the torch path itself, scored as the kernel, has exactly its (non-zero) errors
    bench.checks(off_in_dx(torch_path, 5e-2), [(1, 2, 20, 8)], [torch.float16], bench.Budget(60))
    assert not any(json.loads(line)["ok"] for line in capsys.readouterr().out.splitlines())
    bench.checks(torch_path, [(1, 2, 20, 8)], [torch.float16], bench.Budget(60))
    for r in map(json.loads, capsys.readouterr().out.splitlines()):
        assert r["ok"] and r["err_triton"] == r["err_torch"] and min(r["err_torch"].values()) > 0
    assert bench.rel_err(torch.tensor([2.0]), torch.tensor([1.0])) == 1.0
    assert bench.rel_err(torch.tensor([9.0, 0.0]), torch.tensor([1.0, 2.0])) == 4.0   # max |a - b| / max |b|
    assert bench.last_rows_ok(dict(o=0.0, dx=0.0, dm=0.0))
    assert not any(bench.last_rows_ok(dict(dict(o=0.0, dx=0.0, dm=0.0), **{n: 1.0})) for n in ("o", "dx", "dm"))
    # each shape in every dtype before the next shape: a budget that runs out cuts shapes, not a dtype
    bench.checks(torch_path, [(1, 2, 8, 8), (1, 2, 7, 12)], [torch.float32, torch.float64], bench.Budget(60))
    order = [(r["dh"], r["dtype"]) for r in map(json.loads, capsys.readouterr().out.splitlines())]
    assert order == [(8, "float32")] * 2 + [(8, "float64")] * 2 + [(12, "float32")] * 2 + [(12, "float64")] * 2


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
def test_gpt_kernel_triton_matches_torch(share):
    """The whole GPT, kernel="triton" against kernel="torch" with the same weights, float32:
    logits, loss and every parameter's gradient."""
    config = GPTConfig(kernel="triton", vocab_size=11, block_size=20, n_layer=3, n_head=2, n_embd=32,
                       gen_width=16, share=share)
    torch.manual_seed(0)
    models = {kernel: GPT(dataclasses.replace(config, kernel=kernel)).to(DEVICE) for kernel in ("torch", "triton")}
    models["triton"].load_state_dict(models["torch"].state_dict())
    idx = torch.randint(config.vocab_size, (2, 20), device=DEVICE)
    results = {}
    for kernel, model in models.items():
        logits, loss = model(idx, idx)
        loss.backward()
        results[kernel] = logits, loss, {n: p.grad for n, p in model.named_parameters()}
    (logits_t, loss_t, grads_t), (logits, loss, grads) = results["torch"], results["triton"]
    assert rel_err(logits, logits_t) < FWD_TOL and rel_err(loss, loss_t) < FWD_TOL
    for name, grad in grads_t.items():
        assert rel_err(grads[name], grad) < GRAD_TOL, name


def test_kernel_triton_runs_the_kernel_for_per_token_metrics_only(monkeypatch):
    """A static metric's q = x m is one small matmul, and SDPA's flash attention then beats the
    fused kernel (bench_triton_gpu.py's op rows), so GPT(kernel="triton") keeps the torch path for it."""
    metric_dims = []
    monkeypatch.setattr(damcha_triton, "damcha_attention",
                        lambda x, m, v: metric_dims.append(m.dim()) or damcha_attention(x, m, v))
    for adaptive in (True, False):
        model = GPT(GPTConfig(kernel="triton", vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16,
                              gen_width=8, adaptive=adaptive)).to(DEVICE)
        model(torch.randint(11, (1, 8), device=DEVICE))
    assert metric_dims == [5]
    # generate() runs the kernel at every length from the prompt's on, and samples what the torch path does
    fields = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, gen_width=8)
    torch.manual_seed(0)
    model = GPT(GPTConfig(kernel="triton", **fields)).to(DEVICE).eval()
    reference = GPT(GPTConfig(**fields)).to(DEVICE).eval()
    reference.load_state_dict(model.state_dict())
    metric_dims.clear()
    prompt = torch.randint(11, (2, 3), device=DEVICE)
    outs = []
    for m in (model, reference):
        torch.manual_seed(1)
        outs.append(m.generate(prompt, max_new_tokens=7, top_k=1))
    assert metric_dims == [5] * 7 and torch.equal(*outs)


@pytest.mark.parametrize("variant", [dict(), dict(share=False), dict(adaptive=False), dict(gen_out="folded")],
                         ids=["shared", "unshared", "static", "folded"])
def test_gpt_kernel_triton_matches_spec_and_numpy(variant):
    """The kernel's bar: GPT(kernel="triton") in float32 against the independent float64
    forward (logits and loss to 1e-4) and damcha_numpy's float64 gradients (to 1e-3), with T = 37
    longer than two of the interpreter's blocks of 16, three layers (a shared metric sums its dm over
    them), and weights moved in through the state_dict. One sequence: the interpreter's time grows
    with B, and the batch's strides are checked above and against kernel="torch"."""
    config = GPTConfig(kernel="triton", vocab_size=11, block_size=40, n_layer=3, n_head=2, n_embd=32,
                       gen_width=16, **variant)
    np_config = damcha_numpy.GPTConfig(**{k: v for k, v in vars(config).items() if k != "kernel"})
    params = {k: v * 0.5 for k, v in reference_random_params(np_config, seed=0).items()}
    model = GPT(config).to(DEVICE)
    model.load_state_dict({k: torch.from_numpy(v).float() for k, v in params.items()}, strict=True)
    idx = torch.randint(config.vocab_size, (2, 1, 37), generator=torch.Generator().manual_seed(0)).numpy()
    logits, loss = model(*(torch.from_numpy(a).to(DEVICE) for a in idx))
    loss.backward()
    ref_logits, ref_loss = reference_forward(params, np_config, *idx)
    _, _, cache = damcha_numpy.forward(params, np_config, *idx)
    ref_grads = damcha_numpy.backward(params, np_config, cache)
    assert rel_err(logits, torch.from_numpy(ref_logits)) < FWD_TOL
    assert abs(loss.item() - ref_loss) < FWD_TOL * abs(ref_loss)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, torch.from_numpy(ref_grads[name])) < GRAD_TOL, name


@pytest.mark.parametrize("dtype, B, H, T, dh", [(torch.float16, 2, 2, 37, 8), (torch.float16, 2, 2, 37, 12),
                                                (torch.float16, 1, 2, 40, 48)] if DEVICE == "cpu" else
                         [(torch.bfloat16, 2, 4, 1000, 64), (torch.float16, 2, 4, 1000, 64)])
@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_half_precision(dtype, B, H, T, dh, static):
    """16-bit inputs (float32 accumulation) against float64: no worse than twice the error of
    torch's own path (einsum + SDPA) on the same 16-bit inputs, plus 1e-3, and under 5e-2. On a
    CPU in float16 only, at small sizes: the interpreter computes bfloat16 dots wrongly."""
    x, m, v, do = make_inputs(B, H, T, dh, static, dtype=dtype)
    got = output_and_grads(damcha_attention, x, m, v, do)
    torch_16 = output_and_grads(torch_path, x, m, v, do)
    exact = output_and_grads(torch_path, *(t.double() for t in (x, m, v, do)))
    for name, a, t, b in zip(("o", "dx", "dm", "dv"), got, torch_16, exact):
        assert a.dtype == dtype, name
        err, err_torch = rel_err(a, b), rel_err(t, b)
        assert err < 2 * err_torch + 1e-3 and err < 5e-2, f"{name}: {err:.2e} (torch {dtype}: {err_torch:.2e})"


# ----------------------------------------------------------------------------------------------
# GPU only

@requires_cuda
@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_long_sequence_cuda(static):
    # T = 4096, float32 (IEEE products) against float64
    check_against_float64(*make_inputs(1, 2, 4096, 64, static))


@requires_cuda
def test_forward_memory_cuda():
    """The forward allocates its output, the queries q it keeps for the backward (both
    (B, H, T, dh)) and the row logsumexp only: the scores (B, H, T, T) never reach global memory."""
    B, H, T, dh = 1, 4, 4096, 64
    x, m, v, _ = make_inputs(B, H, T, dh, static=False, dtype=torch.bfloat16)
    damcha_attention(x, m, v)                                  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        o = damcha_attention(x, m, v)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 2 * o.numel() * o.element_size() + B * H * T * 4 + 2**20


@requires_cuda
def test_offsets_past_2_to_31_cuda():
    """T * H * dh^2 = 8192 * 24 * 128^2 > 2^31: the row offsets into m need 64 bits. The output,
    dm and dx of bench_triton_gpu's last-rows check (an output gradient on the last 16 positions)."""
    err = last_rows_errors(damcha_attention, 1, 24, 8192, 128, 16, torch.bfloat16)
    assert last_rows_ok(err), err


def test_bench_budgets_end_at_the_whole_checks_deadline(monkeypatch, capsys):
    """No section of bench_triton_gpu.py starts a row past --budget_total: a section's budget ends
    at the deadline if that comes first, a train row is not started with less than a row's time
    left, and the op rows time torch_compiled only after the plain rows of both dtypes."""
    from lab import bench_triton_gpu as bench
    now = time.time()
    assert bench.Budget(60, deadline=now - 1).over() and not bench.Budget(60).over()
    assert bench.Budget(60, deadline=now + 10).end <= now + 10 < bench.Budget(60, deadline=math.inf).end
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a train row started past the deadline"))
    bench.train_rows(["config/enwik8.py"], 30, False, bench.Budget(60, deadline=time.time() + bench.TRAIN_ROW_S - 5))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kernel"], r["skipped"]) for r in rows] == [("triton", "time budget"), ("torch", "time budget")]
    for budget_s, deadline_s in ((40, 300), (200, 110)):   # the section's budget short, or the deadline
        timeouts = []
        monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: timeouts.append(k["timeout"]) or
                            subprocess.CompletedProcess(a, 0, "", ""))
        bench.train_rows(["config/enwik8.py"], 30, False, bench.Budget(budget_s, deadline=time.time() + deadline_s))
        assert [json.loads(line)["rc"] for line in capsys.readouterr().out.splitlines()] == [0, 0]   # both rows ran
        assert len(timeouts) == 2 and all(t <= deadline_s for t in timeouts)                     # none past the deadline
    monkeypatch.setattr(bench, "DEVICE", "cuda")
    plan = bench.op_plan({"torch": 0, "torch_compiled": 0, "triton": 0}, [torch.bfloat16, torch.float32])
    assert plan == [("per_token", torch.bfloat16, ["torch", "triton"]), ("per_token", torch.float32, ["torch", "triton"]),
                    ("per_token", torch.bfloat16, ["torch_compiled"]),
                    ("static", torch.bfloat16, ["torch", "triton"]), ("static", torch.float32, ["torch", "triton"])]


@pytest.mark.parametrize("config", ["64,6", "128,3"])
def test_the_gpus_block_sizes_in_the_interpreter(config):
    """The interpreter runs blocks of 16; a GPU runs 64 or 128 (with 3 or 6 tiles of m in flight).
    The same kernels at those sizes, in float32 against float64, at T = 150 (3 or 2 blocks, the
    last partial) and dh = 12 (padded to 16), both kinds of metric: run in a fresh process, since
    the interpreter's config is fixed when damcha_triton is imported."""
    code = ("from lab import bench_triton_gpu; import test_triton\n"
            "for static in (False, True):\n"
            "    test_triton.check_against_float64(*bench_triton_gpu.make_inputs(1, 2, 150, 12, static))\n"
            "import damcha_triton\n"
            "print([c.kwargs for c in damcha_triton._attn_fwd.configs])\n")
    root = os.path.dirname(damcha_triton.__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", DAMCHA_INTERPRETER_CONFIG=config,
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    block, m_stages = config.split(",")
    assert done.stdout.strip() == f"[{{'BLOCK': {block}, 'M_STAGES': {m_stages}}}]", done.stdout   # the tile asked for
