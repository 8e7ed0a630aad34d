"""
tests/test_kernel.py: the Triton DAMCHA attention kernels (damcha_triton.py); test_kernel_sm90.py
compiles them for a GPU.

Run: python -m pytest -q tests/test_kernel.py   (skipped when triton is not installed)

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
the torch path (torch_attention) come from bench_triton_gpu.py, which checks the same on a GPU.
"""
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

# the interpreter must be chosen before damcha_triton defines its kernels, hence the late imports
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import damcha_numpy
import damcha_triton
from common import (FWD_TOL, GRAD_TOL, MetricSizedOutputs, attention_inputs, check_against_float64,
                    output_and_grads, rel_err, torch_attention)
from damcha_torch import GPT, GPTConfig
from damcha_triton import damcha_attention
from spec_reference import reference_forward, reference_random_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not damcha_triton.INTERPRETED:
    pytest.skip("damcha_triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------
# float32, small sizes (the interpreter on a CPU)

@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
@pytest.mark.parametrize("B, T, dh", [(2, 37, 8), (2, 37, 12), (1, 70, 48)])   # dh padded to DH = 16, 16, 64
def test_against_torch_attention(static, B, T, dh):
    # blocks of 16: T = 37 is two full blocks and a partial one, T = 70 four and a partial one
    check_against_float64(*attention_inputs(B, 2, T, dh, static))


@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_against_damcha_numpy(static):
    """The kernels against damcha_numpy's attention pieces, chained as its attention_forward and
    attention_backward chain them (its layout: x (B, T, H, dh))."""
    B, H, T, dh = 2, 2, 21, 8
    x, m, v, do = attention_inputs(B, H, T, dh, static, seed=1)
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
    check_against_float64(*attention_inputs(1, 2, T, 8, static=False, seed=T))


def test_single_position():
    # T = 1: the softmax is over one key, so o = v, and x and m get no gradient (up to rounding)
    x, m, v, do = attention_inputs(2, 2, 1, 8, static=False)
    o, dx, dm, dv = output_and_grads(damcha_attention, x, m, v, do)
    assert torch.equal(o, v) and torch.equal(dv, do)
    assert dx.abs().max() < 1e-6 and dm.abs().max() < 1e-6


def test_contiguous_heads_and_strided_output_gradient():
    """x laid out as (B, H, T, dh) while v keeps the model's (B, T, H, dh), a metric that is a
    view, and an output gradient with a zero stride: the kernels follow each tensor's strides."""
    x, m, v, _ = attention_inputs(1, 2, 20, 8, static=False, seed=3)
    x = x.contiguous()
    assert x.stride() != v.stride()
    m = m.transpose(-1, -2).contiguous().transpose(-1, -2)             # same values, other strides
    do = torch.randn(1, 2, 20, 1, device=DEVICE).expand(-1, -1, -1, 8)  # stride 0 along dh
    check_against_float64(x, m, v, do)


def test_masked_positions_get_no_gradient():
    # causality: the output at t depends on no later position, through x, m or v
    x, m, v, _ = attention_inputs(1, 2, 20, 8, static=False, seed=4)
    do = torch.zeros(1, 2, 20, 8, device=DEVICE)
    do[:, :, :9] = 1.0                                                  # only outputs 0..8 are used
    _, dx, dm, dv = output_and_grads(damcha_attention, x, m, v, do)
    assert dx[:, :, 9:].abs().max() == 0 and dv[:, :, 9:].abs().max() == 0 and dm[:, 9:].abs().max() == 0
    assert dx[:, :, :9].abs().min() > 0


def test_argument_checks():
    x, m, v, _ = attention_inputs(1, 2, 8, 8, static=False)
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
    x, m, v, do = attention_inputs(1, 1, 5, 128, static=False)
    check_against_float64(x, m, v, do)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float16)
    x, m, v, do = attention_inputs(1, 2, 20, 8, static=False, dtype=torch.float64)
    o = damcha_attention(x, m, v)
    assert o.dtype == torch.float16 and rel_err(o, torch_attention(x, m, v)) < 5e-3
    # as the model hands them over under autocast: x from a LayerNorm in float32, m from a linear in float16
    o = damcha_attention(x.float(), m.half(), v.half())
    assert o.dtype == torch.float16 and rel_err(o, torch_attention(x, m, v)) < 5e-3


def test_autotuning_keeps_the_configs_that_fit(monkeypatch):
    """On a GPU (not the interpreter's one config): blocks of 64 or more for 16-bit, of 32 or less
    for float32; at dh = 128 only those that compile without spills (tests/test_kernel_sm90.py);
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
        x, m, v, _ = attention_inputs(1, 2, 20, 8, static=False)
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
        x, m, v, _ = attention_inputs(1, 2, 20, 12, static)
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
        x, m, v, do = attention_inputs(2, 2, 20, 8, static)
        o, lse, q = damcha_triton._attention(x, m, v)
        outputs = torch.ops.damcha.attention_backward(do, x, m, v, o, lse, q)
        assert all(t.shape == x.shape and t.stride() == x.stride() and t.dtype == x.dtype for t in outputs)


def test_shared_metric_gradient_is_elementwise():
    """With share=True every layer adds its own dm = x^T dq, as large as m, to m's gradient. The
    kernels' backward must leave it to torch as an elementwise product, as damcha_torch.MetricQuery
    does (tests/test_model.py has the same test): torch.compile can then fuse the L products into
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
    x, m, v, do = attention_inputs(1, 2, 20, 8, static=False)
    op = lambda x, m, v: 2 * damcha_attention(x, m * 0.5, v)
    compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
    for got, want in zip(output_and_grads(compiled, x, m, v, do), output_and_grads(op, x, m, v, do)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_gpt_with_the_kernel_compiles_as_one_graph_forward_and_backward():
    """GPT(kernel="triton") compiles with no graph break (fullgraph=True raises at one), and
    AOTAutograd traces its backward ahead as one graph that holds each layer's
    op backward and the dm = x^T dq its autograd formula forms in torch, as an m-sized product: so
    Inductor compiles that product with the step's backward rather than leaving it to run
    eagerly. The compiled step's loss and gradients are eager's."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    torch._dynamo.reset()
    config = GPTConfig(kernel="triton", vocab_size=11, block_size=20, n_layer=1, n_head=2, n_embd=16, gen_width=8)
    torch.manual_seed(0)
    model = GPT(config).to(DEVICE)
    idx = torch.randint(11, (2, 20), device=DEVICE)
    graphs = {}

    def keep(name):
        def compiler(graph_module, example_inputs):
            graphs[name] = [(str(n.target), tuple(n.meta["val"].shape)) for n in graph_module.graph.nodes
                            if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
            graphs[name] += [(str(n.target), None) for n in graph_module.graph.nodes
                             if n.op == "call_function" and "damcha" in str(n.target)]
            return make_boxed_func(graph_module.forward)
        return compiler
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep("forward"),
                                                                          bw_compiler=keep("backward")))
    _, loss = compiled(idx, idx)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, want = model(idx, idx)
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6) and all(
        rel_err(grads[n], p.grad) < 1e-5 for n, p in model.named_parameters())
    targets = {phase: [target for target, _ in nodes] for phase, nodes in graphs.items()}
    assert targets["forward"].count("damcha.attention.default") == config.n_layer
    assert targets["backward"].count("damcha.attention_backward.default") == config.n_layer
    m_shape = (2, 20, config.n_head, 8, 8)
    assert sum(node == ("aten.mul.Tensor", m_shape) for node in graphs["backward"]) >= config.n_layer


def test_autotuning_keeps_one_choice_per_kind_of_metric():
    """Triton keeps an autotuned config per key (and per dtype of the tensors): a kernel that takes
    both per-token and static metrics must have PER_TOKEN in its key, or a static launch reuses
    the choice made for per-token ones (a 6-deep pipeline over an m it does not stream)."""
    for kernel in (damcha_triton._attn_fwd, damcha_triton._bwd_dkdv, damcha_triton._bwd_dq):
        assert ("PER_TOKEN" in kernel.keys) == ("PER_TOKEN" in kernel.arg_names), kernel.fn.__name__
        assert "PRECISION" in kernel.keys   # and per float32 precision: TF32 or IEEE products


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
    x, m, v, do = attention_inputs(B, H, T, dh, static, dtype=dtype)
    got = output_and_grads(damcha_attention, x, m, v, do)
    torch_16 = output_and_grads(torch_attention, x, m, v, do)
    exact = output_and_grads(torch_attention, *(t.double() for t in (x, m, v, do)))
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
    check_against_float64(*attention_inputs(1, 2, 4096, 64, static))


@requires_cuda
def test_forward_memory_cuda():
    """The forward allocates its output, the queries q it keeps for the backward (both
    (B, H, T, dh)) and the row logsumexp only: the scores (B, H, T, T) never reach global memory."""
    B, H, T, dh = 1, 4, 4096, 64
    x, m, v, _ = attention_inputs(B, H, T, dh, static=False, dtype=torch.bfloat16)
    damcha_attention(x, m, v)                                  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        o = damcha_attention(x, m, v)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 2 * o.numel() * o.element_size() + B * H * T * 4 + 2**20


@pytest.mark.parametrize("config", ["64,6", "128,3"])
def test_the_gpus_block_sizes_in_the_interpreter(config):
    """The interpreter runs blocks of 16; a GPU runs 64 or 128 (with 3 or 6 tiles of m in flight).
    The same kernels at those sizes, in float32 against float64, at T = 150 (3 or 2 blocks, the
    last partial) and dh = 12 (padded to 16), both kinds of metric: run in a fresh process, since
    the interpreter's config is fixed when damcha_triton is imported."""
    code = ("import common\n"
            "for static in (False, True):\n"
            "    common.check_against_float64(*common.attention_inputs(1, 2, 150, 12, static))\n"
            "import damcha_triton\n"
            "print([c.kwargs for c in damcha_triton._attn_fwd.configs])\n")
    root = os.path.dirname(damcha_triton.__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", DAMCHA_INTERPRETER_CONFIG=config,
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    block, m_stages = config.split(",")
    assert done.stdout.strip() == f"[{{'BLOCK': {block}, 'M_STAGES': {m_stages}}}]", done.stdout   # the tile asked for
