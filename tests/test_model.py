"""
tests/test_model.py: checks damcha_torch.GPT against the independent reference and against damcha_numpy.

Run: python -m pytest -q tests/test_model.py

In float64, for every variant of the model (attn, adaptive, share, blocks, gen_out, gen_depth,
bias) at three layers: logits and loss equal the independent loop-by-loop reference
(tests/spec_reference.py) to 1e-10, and logits, loss and every parameter's gradient equal
damcha_numpy's to 1e-9, the weights moving between the two through the state_dict; so do three
AdamW steps. Then the properties that only the PyTorch path has: the folded computation of
gen_out="full", the generator running once per forward when shared, causality, incremental
generate() and its sampling, every dropout site, and bf16 autocast (on the CPU here; the
CUDA-only tests skip without a GPU). Errors are relative to the largest entry: max |a - b| / max |b|.
"""
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import damcha_numpy
from common import check_attention_dropout_is_its_own_setting, MetricSizedOutputs, rel_err
from damcha_torch import PEAK_FLOPS, GPT, GPTConfig, rowsum
from spec_reference import reference_forward, reference_random_params

# three layers: with two, a shared metric gets dm from one layer only, and its sum over layers goes untested
TINY = dict(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, gen_width=6)


def all_variants():
    """Every combination of settings GPTConfig allows, at the TINY size: MHA with and without bias, and
    DAMCHA over share x bias x (gen_out, blocks) x (static metric, or P = 1, 2, 3 layers)."""
    variants = [dict(attn="mha", bias=bias) for bias in (True, False)]
    for share in (True, False):
        for bias in (True, False):
            for gen_out, blocks in (("folded", "all"), ("full", "all"), ("full", "diag"), ("full", "offdiag")):
                common = dict(attn="damcha", share=share, bias=bias, gen_out=gen_out, blocks=blocks)
                variants.append(dict(common, adaptive=False))
                variants += [dict(common, adaptive=True, gen_depth=P) for P in (1, 2, 3)]
    return variants


VARIANTS = all_variants()
IDS = ["-".join(f"{k}={v}" for k, v in variant.items()) for variant in VARIANTS]
# a few that between them exercise every code path, for the costlier tests
KEY_VARIANTS = [dict(attn="mha"), dict(share=True), dict(share=False), dict(adaptive=False),
                dict(adaptive=False, share=False, gen_out="folded"), dict(gen_out="folded", bias=False),
                dict(share=False, blocks="offdiag", gen_depth=3)]
KEY_IDS = ["-".join(f"{k}={v}" for k, v in variant.items()) for variant in KEY_VARIANTS]


def model_from(config, params):
    """A float64 GPT holding `params` (a dict of arrays with the model's parameter keys), loaded strictly."""
    model = GPT(config).double()
    model.load_state_dict({k: torch.tensor(np.asarray(v), dtype=torch.float64) for k, v in params.items()},
                          strict=True)
    return model


def tokens(config, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, shape, generator=g)


# ----------------------------------------------------------------------------------------------
# Against the independent reference and the NumPy model, every variant

@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_matches_spec_reference(variant):
    config = GPTConfig(**TINY, **variant)
    params = reference_random_params(config, seed=1)
    idx, targets = tokens(config, (2, 6), 0), tokens(config, (2, 6), 1)
    logits, loss = model_from(config, params)(idx, targets)
    ref_logits, ref_loss = reference_forward(params, config, idx.numpy(), targets.numpy())
    assert rel_err(logits, ref_logits) < 1e-10
    assert abs(loss.item() - ref_loss) / ref_loss < 1e-10


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_matches_numpy_forward_and_gradients(variant):
    # torch's own initialisation, moved N(0, 0.3) so that every gradient is far from zero, then
    # handed to NumPy through the state_dict
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **variant)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    params = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    np_config = damcha_numpy.GPTConfig(**TINY, **variant)
    idx, targets = tokens(model.config, (2, 7), 2), tokens(model.config, (2, 7), 3)
    np_logits, np_loss, cache = damcha_numpy.forward(params, np_config, idx.numpy(), targets.numpy())
    np_grads = damcha_numpy.backward(params, np_config, cache)
    logits, loss = model(idx, targets)
    loss.backward()
    assert rel_err(logits, np_logits) < 1e-9
    assert abs(loss.item() - np_loss) / np_loss < 1e-9
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == np_grads.keys()
    errors = {name: rel_err(grads[name], np_grads[name]) for name in grads}
    assert max(errors.values()) < 1e-9, errors


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_state_dict_has_numpy_layout(variant):
    state = GPT(GPTConfig(**TINY, **variant)).state_dict()
    params = damcha_numpy.init_params(damcha_numpy.GPTConfig(**TINY, **variant), seed=0)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: v.shape for k, v in params.items()}


@pytest.mark.parametrize("variant", [dict(), dict(adaptive=False), dict(adaptive=False, share=False)],
                         ids=["damcha", "static", "static-unshared"])
def test_init_matches_numpy_statistics(variant):
    torch.manual_seed(0)
    fields = dict(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64, gen_width=64, **variant)
    state = GPT(GPTConfig(**fields)).state_dict()
    params = damcha_numpy.init_params(damcha_numpy.GPTConfig(**fields), seed=0)
    for name, p in params.items():
        if name.endswith("metric"):   # a static metric: N(0, 0.02) as every weight
            assert abs(p.std() / 0.02 - 1) < 0.1, name
        t = state[name].numpy()
        if p.std() == 0:
            np.testing.assert_array_equal(t, p, err_msg=name)        # LayerNorm 1 and 0, biases 0
        else:
            assert abs(t.std() / p.std() - 1) < 0.1, name            # N(0, 0.02) or the c_proj scale
            assert abs(t.mean()) < 4 * p.std() / math.sqrt(p.size), name


# ----------------------------------------------------------------------------------------------
# Properties of the PyTorch path

def generator_calls(model):
    """Records each generator (the ModuleList `gen`) as its first layer runs."""
    calls = []
    for name, module in model.named_modules():
        if name == "gen" or name.endswith(".gen"):
            module[0].register_forward_hook(lambda mod, args, out, gen=module: calls.append(gen))
    return calls


def test_shared_generator_runs_once_per_forward():
    model = GPT(GPTConfig(**dict(TINY, n_layer=3), share=True))
    calls = generator_calls(model)
    model(tokens(model.config, (2, 5), 0))
    assert calls == [model.gen]
    assert not any(".attn.gen." in name for name in model.state_dict())


def test_unshared_model_has_one_generator_per_layer():
    model = GPT(GPTConfig(**dict(TINY, n_layer=3), share=False))
    calls = generator_calls(model)
    model(tokens(model.config, (2, 5), 0))
    assert calls == [block.attn.gen for block in model.h]
    assert not hasattr(model, "gen")


@pytest.mark.parametrize("variant", KEY_VARIANTS, ids=KEY_IDS)
def test_causal(variant):
    config = GPTConfig(**TINY, **variant)
    model = model_from(config, reference_random_params(config, seed=4))
    idx = tokens(config, (2, 8), 5)
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % config.vocab_size
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :5], b[:, :5])                           # the past never sees the future
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("blocks", ["all", "diag", "offdiag"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_folded_equals_full(blocks, adaptive):
    """A gen_out="full" model and the "folded" model whose last generator layer (or static
    metric) is the full one summed over block columns (Eq. 4) compute the same function."""
    full_config = GPTConfig(**TINY, gen_out="full", blocks=blocks, adaptive=adaptive, share=False)
    params = reference_random_params(full_config, seed=6)
    H, dh = full_config.n_head, full_config.n_embd // full_config.n_head
    folded = {}
    for name, value in params.items():
        t = torch.tensor(value)
        if name.endswith(f"gen.{full_config.gen_depth - 1}.weight"):
            t = rowsum(t, full_config).reshape(H * dh * dh, -1)
        elif name.endswith(f"gen.{full_config.gen_depth - 1}.bias"):
            t = rowsum(t, full_config).reshape(H * dh * dh)
        elif name.endswith("metric"):
            t = rowsum(t, full_config).reshape(H, dh, dh)
        folded[name] = t.numpy()
    folded_config = GPTConfig(**TINY, gen_out="folded", adaptive=adaptive, share=False)
    idx = tokens(full_config, (2, 8), 7)
    a = model_from(full_config, params)(idx)[0]
    b = model_from(folded_config, folded)(idx)[0]
    assert rel_err(a, b) < 1e-12


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation creates."""
    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_full_output_never_builds_M():
    # B*T*D*D = 16384 entries would be M; the largest legitimate tensor is the generator's
    # last weight, D*D*w = 2048 entries, and the per-position metrics m are B*T*H*dh*dh = 4096
    config = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=16, gen_width=8, gen_out="full")
    model = GPT(config)
    idx = tokens(config, (4, 16), 8)
    with LargestTensor() as mode:
        _, loss = model(idx, idx)
        loss.backward()
    assert mode.largest < 4 * 16 * 16 * 16 / 2


@pytest.mark.parametrize("share", [True, False])
def test_static_metric_never_builds_per_position_metrics(share):
    """A static metric m_i (H, dh, dh) is one matrix per head: its gradient is a sum over positions
    of x^T dq, which must not be formed position by position as a (B, T, H, dh, dh) tensor
    (B*T*H*dh*dh = 65,536 entries here, 16 times the largest legitimate tensor, the MLP's weight)."""
    config = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=64, adaptive=False, share=share)
    model = GPT(config)
    idx = tokens(config, (2, 16), 8)
    with LargestTensor() as mode:
        _, loss = model(idx, idx)
        loss.backward()
    assert mode.largest <= 64 * 4 * 64


def test_shared_metric_gradient_is_elementwise():
    """With share=True every layer adds its own dm = x^T dq, as large as m, to m's gradient.
    The backward must form it as an elementwise product (MetricQuery), never as a matmul output:
    torch.compile can then fuse the L products into one sum and store none of them, while matmul
    outputs may stay alive together until the sum (results/gpu/). The sizes make m's
    B*T*H*dh*dh = 1024 entries unique."""
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16, gen_width=6)
    model = GPT(config)
    idx = tokens(config, (2, 8), 4)
    _, loss = model(idx, idx)
    with MetricSizedOutputs(2 * 8 * 2 * 8 * 8) as mode:
        loss.backward()
    assert mode.ops.count("mul") >= config.n_layer              # each layer's dm, elementwise
    assert not {"bmm", "mm", "matmul", "baddbmm"} & set(mode.ops), mode.ops


@pytest.mark.parametrize("variant", [dict(share=True), dict(share=False, adaptive=False)],
                         ids=["shared", "unshared-static"])
def test_compiles_as_one_graph(variant):
    """torch.compile (which the GPU configs use) traces forward and backward without a graph
    break. backend="eager" runs the traced graph as it is: the trace is what is checked here."""
    torch._dynamo.reset()
    model = GPT(GPTConfig(**TINY, **variant))
    idx = tokens(model.config, (2, 8), 19)
    logits, loss = torch.compile(model, backend="eager", fullgraph=True)(idx, idx)
    loss.backward()
    assert torch.equal(logits, model(idx)[0])


# ----------------------------------------------------------------------------------------------
# Generation

@pytest.mark.parametrize("variant", KEY_VARIANTS, ids=KEY_IDS)
def test_generate_logits_equal_full_forward(variant):
    """Every step's logits are a full forward's over the last block_size tokens, before and after
    the sequence outgrows block_size."""
    config = GPTConfig(**TINY, **variant)
    model = model_from(config, reference_random_params(config, seed=9)).eval()
    steps = []
    hook = model.register_forward_hook(lambda mod, args, out: steps.append(out[0][:, -1]))
    torch.manual_seed(0)
    prompt = tokens(config, (3, 3), 10)
    out = model.generate(prompt, max_new_tokens=9)
    hook.remove()
    assert out.shape == (3, 12) and torch.equal(out[:, :3], prompt)
    assert len(steps) == 9
    for s, logits in enumerate(steps):
        window = out[:, :3 + s][:, -config.block_size:]
        assert rel_err(logits, model(window)[0][:, -1]) < 1e-10, s


def test_generate_conditions_on_the_last_block_size_tokens():
    config = GPTConfig(**TINY)
    model = GPT(config).eval()
    lengths = []
    model.register_forward_pre_hook(lambda mod, args: lengths.append(args[0].size(1)))
    model.generate(tokens(config, (1, 3), 11), max_new_tokens=8, top_k=3)
    assert lengths == [3, 4, 5, 6, 7, 8, 8, 8]   # the sequence so far, then windows of block_size = 8


def test_generate_from_a_prompt_longer_than_block_size():
    config = GPTConfig(**TINY)
    model = model_from(config, reference_random_params(config, seed=12)).eval()
    out = model.generate(tokens(config, (2, 11), 13), max_new_tokens=2)
    assert out.shape == (2, 13)


def fixed_logits(model, z):
    """Make model's forward return logits z at the last position, and at every other position
    logits that put all the mass on token 0."""
    def forward(idx, targets=None):
        logits = torch.zeros(*idx.shape, len(z), dtype=z.dtype)
        logits[:, :, 0] = 50.0
        logits[:, -1] = z
        return logits, None
    model.forward = forward


@pytest.mark.parametrize("temperature, top_k, dtype", [(2.0, None, torch.float32), (1.0, 2, torch.float32),
                                                       (1.0, 1, torch.float32), (1e-40, None, torch.float32),
                                                       (1e-50, None, torch.float32), (1e-5, None, torch.float16)])
def test_generate_samples_at_the_temperature_within_top_k(temperature, top_k, dtype):
    # the logits' dtype as under autocast: 3 / 1e-40 overflows float32 and 1e-50 is 0 there; 3 / 1e-5 overflows float16
    z = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=dtype)
    model = GPT(GPTConfig(**dict(TINY, vocab_size=4)))
    fixed_logits(model, z)
    z = z.double()
    n = 20000
    torch.manual_seed(0)
    out = model.generate(torch.zeros(n, 2, dtype=torch.long), 1, temperature=temperature, top_k=top_k)
    freq = torch.bincount(out[:, -1], minlength=4).double() / n
    kept = z >= z.topk(top_k or len(z)).values[-1]                 # the top_k largest logits
    p = torch.softmax(torch.where(kept, z, -math.inf) / temperature, 0)
    assert torch.all((freq - p).abs() <= 4 * torch.sqrt(p * (1 - p) / n)), (freq, p)


# ----------------------------------------------------------------------------------------------
# Configuration, training helpers

@pytest.mark.parametrize("bad", [dict(n_head=3), dict(attn="linear"), dict(blocks="upper"),
                                 dict(gen_out="half"), dict(gen_depth=0), dict(gen_out="folded", blocks="diag"),
                                 dict(kernel="cuda"), dict(kernel="triton", attn="mha"),
                                 dict(kernel="triton", attn_dropout=0.1), dict(dropout=1.0), dict(attn_dropout=1.0),
                                 dict(attn_dropout=-0.1)])
def test_config_rejects(bad):
    """GPTConfig refuses them, or GPT does (an attn name it has no attention class for)."""
    with pytest.raises(ValueError):
        GPT(GPTConfig(**dict(TINY, **bad)))


def test_triton_kernel_accepts_residual_dropout():
    # the kernel has no attention-probability dropout; embedding, residual and MLP dropout are its callers'
    assert GPTConfig(**TINY, kernel="triton", dropout=0.1).dropout == 0.1


def test_sequence_longer_than_block_size_raises():
    config = GPTConfig(**TINY)
    with pytest.raises(ValueError, match="block_size"):
        GPT(config)(tokens(config, (1, 9), 0))


def test_dropout_is_off_in_eval_mode():
    config = GPTConfig(**TINY, dropout=0.5)
    model = GPT(config)
    idx = tokens(config, (2, 8), 14)
    reference = GPT(GPTConfig(**TINY))
    reference.load_state_dict(model.state_dict())
    assert torch.equal(model.eval()(idx)[0], reference(idx)[0])
    assert not torch.equal(model.train()(idx)[0], reference(idx)[0])


@pytest.mark.parametrize("attn", ["damcha", "mha"])
def test_every_dropout_runs_in_training_and_none_in_eval(attn):
    """The embedding, each attention output and each MLP output have their own nn.Dropout, and a
    training forward passes through each once; in eval mode attention-probability dropout is off too."""
    config = GPTConfig(**TINY, attn=attn, dropout=0.5, attn_dropout=0.5)
    model = GPT(config)
    calls = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda mod, args, out, name=name: calls.append((name, mod.training)))
    idx = tokens(config, (2, 8), 19)
    model.train()(idx)
    sites = ["drop"] + [f"h.{l}.{site}" for l in range(config.n_layer) for site in ("attn.resid_dropout", "mlp.dropout")]
    assert sorted(calls) == sorted((name, True) for name in sites)
    reference = GPT(GPTConfig(**TINY, attn=attn))
    reference.load_state_dict(model.state_dict())
    assert torch.equal(model.eval()(idx)[0], reference.eval()(idx)[0])


@pytest.mark.parametrize("attn", ["damcha", "mha"])
def test_attention_dropout_is_its_own_setting(attn):
    check_attention_dropout_is_its_own_setting(TINY, attn)


def test_configure_optimizers_decays_matrices_only(capsys):
    model = GPT(GPTConfig(**TINY, adaptive=False, share=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert any(p is model.h[0].attn.metric for p in decay["params"])


@pytest.mark.parametrize("variant", [dict(), dict(adaptive=False, share=False)], ids=["damcha", "static"])
def test_adamw_matches_numpy(variant):
    """Three steps of the AdamW that every PyTorch training loop uses and of damcha_numpy's
    adamw_step, from the same weights and gradients: the same weights after each, to 1e-12."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **variant)).double()
    params = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    named = dict(model.named_parameters())
    state = {}
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
        for k, p in named.items():
            p.grad = torch.tensor(grads[k])
        optimizer.step()
        damcha_numpy.adamw_step(params, grads, state, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        errors = {k: rel_err(p.detach(), params[k]) for k, p in named.items()}
        assert max(errors.values()) < 1e-12, errors


def test_parameter_count_written_out():
    """GPT.get_num_params: every weight but the position embeddings, the token embedding counted
    once (it is also the lm_head)."""
    V, T, D = 11, 16, 16
    linear = lambda n_in, n_out: n_in * n_out + n_out
    layer = 2 * D + linear(D, 3 * D) + linear(D, D) + 2 * D + linear(D, 4 * D) + linear(4 * D, D)   # ln_1, attn, ln_2, mlp
    wte, ln_f = V * D, 2 * D
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=D, attn="mha"))
    assert model.get_num_params() == wte + layer + ln_f
    assert model.get_num_params(non_embedding=False) == wte + layer + ln_f + T * D


def test_estimate_mfu_is_nanogpts():
    """6 FLOPs per parameter and token, 12 L T D for the attention, against the one fixed peak."""
    model = GPT(GPTConfig(**TINY))
    L, T, D = TINY["n_layer"], TINY["block_size"], TINY["n_embd"]
    flops = (6 * model.get_num_params() + 12 * L * T * D) * T * 4 / 1e-3
    assert model.estimate_mfu(fwdbwd_per_iter=4, dt=1e-3) == pytest.approx(flops / 989e12)
    assert PEAK_FLOPS == 989e12


# ----------------------------------------------------------------------------------------------
# bf16 autocast: logits within 3e-2 of float32 relative to their largest entry, loss within
# 5e-3 relative (measured at the sizes below: about 1e-2 and 2e-4 at worst)

def check_bf16(device, variant):
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64, gen_width=64, **variant)
    model = GPT(config).to(device)
    idx, targets = tokens(config, (4, 64), 15).to(device), tokens(config, (4, 64), 16).to(device)
    logits, loss = model(idx, targets)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        logits16, loss16 = model(idx, targets)
    assert logits16.dtype == torch.bfloat16
    assert rel_err(logits16.float(), logits) < 3e-2
    assert abs(loss16.item() - loss.item()) / loss.item() < 5e-3


@pytest.mark.parametrize("variant", KEY_VARIANTS, ids=KEY_IDS)
def test_bf16_autocast_cpu(variant):
    check_bf16("cpu", variant)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("variant", KEY_VARIANTS, ids=KEY_IDS)
def test_bf16_autocast_cuda(variant):
    check_bf16("cuda", variant)


@requires_cuda
@pytest.mark.parametrize("variant", [dict(attn="mha"), dict(share=True), dict(share=False)],
                         ids=["mha", "shared", "unshared"])
def test_flash_attention_backend_used(variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    config = GPTConfig(vocab_size=65, block_size=128, n_layer=2, n_head=4, n_embd=128, **variant)
    model = GPT(config).cuda()
    idx = tokens(config, (2, 128), 17).cuda()
    # only the flash kernel is allowed: any attention call it cannot serve raises
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
        loss.backward()
        model.generate(idx[:, :4], max_new_tokens=4)
