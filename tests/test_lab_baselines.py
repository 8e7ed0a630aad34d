"""
tests/test_lab_baselines.py: checks the attention baselines of lab/baselines.py, DCMHA and Talking-Heads,
the GPTs of GPTConfig(attn="dcmha") and GPTConfig(attn="tha") that lab/variants.build makes.

Run: python -m pytest -q tests/test_lab_baselines.py

Both are MHA with the heads mixed before and after the softmax. With the mixing at the identity
(THA's pre_mix and post_mix zero; DCMHA's dyn_proj and gates zero) a model's logits equal, in
float64, those of the MHA model holding the same c_attn, c_proj, MLP, LayerNorm and embedding
weights. One entry of THA's mixing does what the formula says, per head; DCMHA's composition equals
a loop over compose's formula, and each reads its own group of weights; the weights on later
keys are exactly zero after the post-softmax mixing; both models are causal, decode
incrementally as they compute in full, and send a gradient to every parameter from the start.
Errors are relative to the largest entry: max |a - b| / max |b|.
"""
import itertools
import os
import subprocess
import sys

import pytest
import torch

import common
from common import check_attention_dropout_is_its_own_setting, rel_err
from damcha_torch import GPTConfig
from lab.baselines import DCMHA_RANK, ComposedAttention, compose
from lab.counts import flops_per_token
from lab.variants import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=3, n_embd=12)
BASELINES = ["dcmha", "tha"]


def tokens(config, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, shape, generator=g)


def perturbed(config, seed=0, scale=0.3):
    """A float64 GPT with torch's initialisation moved by N(0, scale): every mixing is far from
    the identity and every weight far from zero."""
    torch.manual_seed(seed)
    model = build(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def mixing_params(name):
    return name.endswith(("pre_mix", "post_mix", "dyn_proj")) or ".dyn_gate." in name


# ----------------------------------------------------------------------------------------------
# Shapes and parameters

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("attn", BASELINES)
def test_shapes_and_parameter_count(attn, bias):
    config = GPTConfig(**TINY, attn=attn, bias=bias)
    model, mha = build(config), build(GPTConfig(**TINY, attn="mha", bias=bias))
    logits, loss = model(tokens(config, (2, 8), 0), tokens(config, (2, 8), 1))
    assert logits.shape == (2, 8, 11) and loss.ndim == 0 and torch.isfinite(loss)
    D, H, L, R = config.n_embd, config.n_head, config.n_layer, DCMHA_RANK
    extra = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in mha.state_dict()}
    if attn == "tha":
        expected = {f"h.{l}.attn.{name}": (H, H) for l in range(L) for name in ("pre_mix", "post_mix")}
        per_layer = 2 * H * H
    else:
        expected = {}
        for l in range(L):
            expected.update({f"h.{l}.attn.dyn_fc.weight": (16 * H, D), f"h.{l}.attn.dyn_proj": (4, 2 * R * H, 4 * H),
                             f"h.{l}.attn.dyn_gate.weight": (4 * H, D)})
            if bias:
                expected.update({f"h.{l}.attn.dyn_fc.bias": (16 * H,), f"h.{l}.attn.dyn_gate.bias": (4 * H,)})
        per_layer = 20 * H * D + 64 * H * H + (20 * H if bias else 0)     # as the module docstring says
    assert extra == expected
    assert all(mha.state_dict()[k].shape == v.shape for k, v in model.state_dict().items() if k in mha.state_dict())
    assert model.get_num_params() - mha.get_num_params() == L * per_layer


def test_build_makes_the_baselines_and_refuses_other_names():
    for attn in ("damcha", "mha", "dcmha", "tha"):
        assert build(GPTConfig(**TINY, attn=attn)).config.attn == attn
    with pytest.raises(ValueError, match="attn must be 'damcha' or 'mha', not 'linear'"):
        build(GPTConfig(**TINY, attn="linear"))


def test_flops_count_the_head_mixing():
    T, H, D, L, R = TINY["block_size"], TINY["n_head"], TINY["n_embd"], TINY["n_layer"], DCMHA_RANK
    flops = {attn: flops_per_token(GPTConfig(**TINY, attn=attn)) for attn in ("mha", "dcmha", "tha")}
    # the per-(t, s) terms over the T / 2 keys of a causal query on average
    assert flops["tha"] - flops["mha"] == 6 * L * 2 * (T // 2) * H * H
    assert flops["dcmha"] - flops["mha"] == 6 * L * (20 * H * D + 32 * R * H * H + 2 * (4 * R + 2) * H * (T // 2))


def test_the_book_knows_only_its_own_attentions():
    """damcha_torch alone (a fresh process, without the lab) refuses to build the lab's attentions
    from their names, in one line: they come as GPT's attention class."""
    code = "from damcha_torch import GPT, GPTConfig\nGPT(GPTConfig(attn='dcmha'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "ValueError: attn must be 'damcha' or 'mha', not 'dcmha'" in done.stderr


@pytest.mark.parametrize("attn", BASELINES)
def test_compiles_as_one_graph(attn):
    """torch.compile traces forward and backward without a graph break (backend="eager": the trace is what is checked)."""
    torch._dynamo.reset()
    model = build(GPTConfig(**dict(TINY, n_layer=3), attn=attn))
    idx = tokens(model.config, (2, 8), 19)
    logits, loss = torch.compile(model, backend="eager", fullgraph=True)(idx, idx)
    loss.backward()
    assert torch.equal(logits, model(idx)[0])


@pytest.mark.parametrize("attn", BASELINES)
def test_attention_dropout_is_its_own_setting(attn, monkeypatch):
    monkeypatch.setattr(common, "GPT", lambda config: build(config))   # the helper's GPT, any attn
    check_attention_dropout_is_its_own_setting(TINY, attn)


@pytest.mark.parametrize("attn", BASELINES)
def test_built_from_their_own_module_with_the_mha_keys(attn):
    model = build(GPTConfig(**TINY, attn=attn))
    assert all(isinstance(block.attn, ComposedAttention) for block in model.h)
    mha_keys = build(GPTConfig(**TINY, attn="mha")).state_dict().keys()
    assert mha_keys <= model.state_dict().keys()


# ----------------------------------------------------------------------------------------------
# The mixing at the identity is MHA

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("attn", BASELINES)
def test_identity_mixing_equals_mha(attn, bias):
    mha = perturbed(GPTConfig(**TINY, attn="mha", bias=bias), seed=1)
    model = perturbed(GPTConfig(**TINY, attn=attn, bias=bias), seed=2)
    idx = tokens(mha.config, (3, 8), 3)
    assert rel_err(model(idx)[0], mha(idx)[0]) > 1e-2          # different weights, different model
    missing, unexpected = model.load_state_dict(mha.state_dict(), strict=False)
    assert not unexpected and missing and all(mixing_params(k) or ".dyn_fc." in k for k in missing)
    assert rel_err(model(idx)[0], mha(idx)[0]) > 1e-3          # the mixing alone still changes it
    with torch.no_grad():
        # dyn_fc stays random: with dyn_proj zero, w1 and w2 are zero whatever it computes
        for name, p in model.named_parameters():
            if mixing_params(name):
                p.zero_()
    assert rel_err(model(idx)[0], mha(idx)[0]) < 1e-12


def test_dcmha_starts_near_mha():
    """At initialisation DCMHA's gates are zero and its low-rank terms small: its logits stay
    within a few percent of the MHA model with the same other weights."""
    torch.manual_seed(0)
    model = build(GPTConfig(**TINY, attn="dcmha")).double()
    mha = build(GPTConfig(**TINY, attn="mha")).double()
    model.load_state_dict(mha.state_dict(), strict=False)
    idx = tokens(mha.config, (3, 8), 4)
    attn = model.h[0].attn
    pre, post = attn.dynamic_weights(torch.randn(3, 8, TINY["n_embd"], dtype=torch.float64))
    assert all(torch.equal(d, torch.zeros_like(d)) for _, _, d in pre + post)   # tanh(0)
    assert 0 < rel_err(model(idx)[0], mha(idx)[0]) < 0.05


# ----------------------------------------------------------------------------------------------
# DCMHA's composition

def compose_loop(A, query, key):
    """DCMHA's composition formula (compose's docstring), entry by entry:
    C(A)[n,t,s] = A[n,t,s] + sum_r w2_q(t)[r,n] sum_m w1_q(t)[r,m] A[m,t,s]
                           + sum_r w2_k(s)[r,n] sum_m w1_k(s)[r,m] A[m,t,s]
                           + d_q(t)[n] A[n,t,s] + d_k(s)[n] A[n,t,s]"""
    (w1q, w2q, dq), (w1k, w2k, dk) = query, key
    B, H, T, S = A.shape
    R = w1q.shape[2]
    out = torch.empty_like(A)
    for b, n, t, s in itertools.product(range(B), range(H), range(T), range(S)):
        total = A[b, n, t, s]
        for r in range(R):
            total = total + w2q[b, t, r, n] * sum(w1q[b, t, r, m] * A[b, m, t, s] for m in range(H))
            total = total + w2k[b, s, r, n] * sum(w1k[b, s, r, m] * A[b, m, t, s] for m in range(H))
        out[b, n, t, s] = total + dq[b, t, n] * A[b, n, t, s] + dk[b, s, n] * A[b, n, t, s]
    return out


def test_compose_matches_the_formula():
    g = torch.Generator().manual_seed(5)
    B, H, T, S, R = 2, 3, 4, 5, 2
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    A = rand(B, H, T, S)
    query = (rand(B, T, R, H), rand(B, T, R, H), rand(B, T, H))
    key = (rand(B, S, R, H), rand(B, S, R, H), rand(B, S, H))
    assert rel_err(compose(A, query, key), compose_loop(A, query, key)) < 1e-14


def test_dynamic_weights_are_normalised_and_gated():
    model = perturbed(GPTConfig(**TINY, attn="dcmha"), seed=6)
    u = torch.randn(2, 8, TINY["n_embd"], dtype=torch.float64)
    pre, post = model.h[1].attn.dynamic_weights(u)
    for w1, w2, d in pre + post:
        assert w1.shape == w2.shape == (2, 8, DCMHA_RANK, TINY["n_head"]) and d.shape == (2, 8, TINY["n_head"])
        # unit mean square over the heads, up to the 1e-6 that the norm adds to it
        torch.testing.assert_close(w1.pow(2).mean(-1), torch.ones_like(w1[..., 0]), rtol=1e-3, atol=0)
        assert d.abs().max() < 1 and d.abs().max() > 0


@pytest.mark.parametrize("where", ["pre_mix", "post_mix"])
def test_talking_heads_mixes_head_1_into_head_0(where):
    """With one entry [0, 1] = 1 of THA's mixing (the other zero), head 0 adds head 1's logits
    (pre_mix) or probabilities (post_mix) to its own, written out per head; the other heads are MHA's."""
    module = build(GPTConfig(**TINY, attn="tha")).double().h[0].attn
    with torch.no_grad():
        getattr(module, where)[0, 1] = 1.0
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    logits = (q @ k.transpose(-2, -1) / 2).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(logits, -1)
    if where == "pre_mix":
        head_0 = torch.softmax(logits[:, 0] + logits[:, 1], -1)
    else:
        head_0 = probs[:, 0] + probs[:, 1]
    want = torch.cat([(head_0 @ v[:, 0]).unsqueeze(1), probs[:, 1:] @ v[:, 1:]], dim=1)
    assert rel_err(module.composed_attention(q, k, v, None), want) < 1e-14


@pytest.mark.parametrize("group", range(4))
def test_dcmha_reads_each_composition_from_its_own_weights(group):
    """dynamic_weights' four groups of dyn_proj are, in order, the query-wise and key-wise
    compositions before the softmax, then the two after it: with every group but one zero, only
    that composition's weights are non-zero."""
    module = perturbed(GPTConfig(**TINY, attn="dcmha"), seed=12).h[0].attn
    with torch.no_grad():
        module.dyn_proj[[g for g in range(4) if g != group]] = 0.0
    pre, post = module.dynamic_weights(torch.randn(2, 8, TINY["n_embd"], dtype=torch.float64))
    nonzero = [bool(w2.abs().max() > 0) for _, w2, _ in pre + post]   # (pre query, pre key, post query, post key)
    assert nonzero == [g == group for g in range(4)]


@pytest.mark.parametrize("attn", BASELINES)
def test_masked_probabilities_are_zero_after_mixing(attn):
    """Every weight that a query puts on a later key is exactly zero after the post-softmax
    mixing. With dh = T and the identity as values, the attention returns its weights."""
    config = GPTConfig(**dict(TINY, n_embd=24), attn=attn)              # dh = 8 = T
    module = perturbed(config, seed=7).h[0].attn
    g = torch.Generator().manual_seed(8)
    q, k = (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    u = torch.randn(2, 8, 24, generator=g, dtype=torch.float64)
    probs = module.composed_attention(q, k, torch.eye(8, dtype=torch.float64).expand(2, 3, 8, 8), u)
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    assert torch.all(probs[..., future] == 0) and torch.all(probs[..., ~future] != 0)


# ----------------------------------------------------------------------------------------------
# Causality, decoding, gradients

@pytest.mark.parametrize("attn", BASELINES)
def test_causal(attn):
    model = perturbed(GPTConfig(**TINY, attn=attn), seed=9)
    idx = tokens(model.config, (2, 8), 10)
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % model.config.vocab_size
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :5], b[:, :5])                         # the past never sees the future
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("attn", BASELINES)
def test_every_parameter_gets_a_gradient_at_init(attn):
    torch.manual_seed(0)
    config = GPTConfig(**TINY, attn=attn)
    model = build(config)
    _, loss = model(tokens(config, (4, 8), 13), tokens(config, (4, 8), 14))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize("attn", BASELINES)
def test_bf16_autocast_cpu(attn):
    config = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64, attn=attn)
    model = build(config)
    idx = tokens(config, (2, 32), 15)
    logits, loss = model(idx, idx)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits16, loss16 = model(idx, idx)
    assert logits16.dtype == torch.bfloat16
    assert rel_err(logits16.float(), logits) < 3e-2
    assert abs(loss16.item() - loss.item()) / loss.item() < 5e-3
