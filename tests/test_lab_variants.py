"""
tests/test_lab_variants.py: the 2x2 study's model variants: the book's GPTConfig fields metric_init
and mlp_hidden, and the lab's attention "proj" (lab/variants.py); GPT's attention class.

    python -m pytest -q tests/test_lab_variants.py

  attn="proj"             q_i = (u W_q)_i m_i, k_i = (u W_k)_i, v from MHA's c_attn
  metric_init="identity"  every m_i starts at I (static metric, or the generator's last bias)
  mlp_hidden              the MLP's hidden width (0: 4D), a width that trades for parameters
In float64: the GPT equals a loop implementation of each formula (the projected attention is
written out below; the rest comes from tests/spec_reference.py), attn="proj" with m = I equals
MHA exactly, the own-slice static identity metric equals MHA with W_q = W_k = I; causality;
parameter matching within 2% at train_char's default model; defaults unchanged; attn names the
class GPT is given; a seed draws the same weights for every attn, the book's and the lab's.
"""

import hashlib

import numpy as np
import pytest
import torch

from common import rel_err
from damcha_torch import GPT, GPTConfig, static_metrics
from lab.counts import count_params, equal_params_width, flops_per_token
from lab.variants import ATTENTIONS, ProjectedAttention, build
from spec_reference import _causal_heads, _gelu, _layernorm, _linear, _metrics, reference_forward

TINY = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, gen_width=6)
PROJ = [dict(attn="proj", share=share, adaptive=adaptive, gen_out=gen_out)
        for share in (True, False) for adaptive in (True, False) for gen_out in ("folded", "full")]
PROJ_IDS = ["-".join(f"{k}={v}" for k, v in p.items()) for p in PROJ]


def random_model(config, seed):
    """A float64 GPT with every parameter random: weights N(0, 0.3), LayerNorm gains near 1."""
    model = build(config).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def params_of(model):
    return {k: v.numpy() for k, v in model.state_dict().items()}


def tokens(config, shape, seed):
    return torch.randint(config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def proj_attention(params, config, l, u, m):
    """attn="proj", written out: S_i[t, s] = (u W_q)_i[t] m_i[t] (u W_k)_i[s]^T / sqrt(dh), s <= t."""
    B, T, D = u.shape
    H = config.n_head
    dh = D // H
    qkv = _linear(params, f"h.{l}.attn.c_attn", u)
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    q_m = np.zeros_like(q)                      # the query (u W_q)_i[t] m_i[t], position by position
    for b in range(B):
        for t in range(T):
            for i in range(H):
                q_m[b, t, i * dh:(i + 1) * dh] = q[b, t, i * dh:(i + 1) * dh] @ m[b, t, i]
    return _linear(params, f"h.{l}.attn.c_proj", _causal_heads(q_m, k, v, H))


def proj_forward(params, config, idx):
    """The pre-LN GPT of spec_reference.reference_forward with the projected attention."""
    T = idx.shape[1]
    wte = params["wte.weight"]
    x = wte[idx] + params["wpe.weight"][:T]
    shared_m = None
    for l in range(config.n_layer):
        u = _layernorm(params, f"h.{l}.ln_1", x)
        if config.share:
            shared_m = _metrics(params, config, "", u) if shared_m is None else shared_m
            m = shared_m
        else:
            m = _metrics(params, config, f"h.{l}.attn.", u)
        x = x + proj_attention(params, config, l, u, m)
        h = _gelu(_linear(params, f"h.{l}.mlp.c_fc", _layernorm(params, f"h.{l}.ln_2", x)))
        x = x + _linear(params, f"h.{l}.mlp.c_proj", h)
    return _layernorm(params, "ln_f", x) @ wte.T


@pytest.mark.parametrize("variant", PROJ, ids=PROJ_IDS)
def test_proj_matches_loop_reference(variant):
    config = GPTConfig(**TINY, **variant, mlp_hidden=5)
    model = random_model(config, 1)
    idx = tokens(config, (2, 6), 0)
    logits, _ = model(idx)
    assert rel_err(logits, proj_forward(params_of(model), config, idx.numpy())) < 1e-10


@pytest.mark.parametrize("gen_out", ["folded", "full"])
def test_static_per_layer_with_mlp_hidden_matches_spec_reference(gen_out):
    """The own-slice static metric, one per layer (adaptive=False, share=False), with another MLP width."""
    config = GPTConfig(**TINY, adaptive=False, share=False, gen_out=gen_out, metric_init="identity", mlp_hidden=13)
    model = random_model(config, 2)
    assert model.h[0].mlp.c_fc.weight.shape == (13, 8)
    idx = tokens(config, (2, 6), 0)
    logits, _ = model(idx)
    ref, _ = reference_forward(params_of(model), config, idx.numpy())
    assert rel_err(logits, ref) < 1e-10


def mha_twin(model, config):
    """An MHA GPT holding every weight of `model` that MHA has (the metric and generator aside)."""
    mha = build(GPTConfig(**{**vars(config), "attn": "mha"})).double()
    mha.load_state_dict({k: v for k, v in model.state_dict().items() if k in mha.state_dict()}, strict=True)
    return mha


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("gen_out", ["folded", "full"])
def test_proj_with_identity_metric_is_mha(share, gen_out):
    config = GPTConfig(**TINY, attn="proj", share=share, gen_out=gen_out, metric_init="identity")
    model = random_model(config, 3)
    with torch.no_grad():   # m = I at every position: the last layer outputs its identity bias only
        for name, p in model.named_parameters():
            if name.endswith(f"gen.{config.gen_depth - 1}.weight"):
                p.zero_()
            elif name.endswith(f"gen.{config.gen_depth - 1}.bias"):
                p.copy_(build(config).state_dict()[name])
    idx = tokens(config, (2, 8), 0)
    assert torch.equal(model(idx)[0], mha_twin(model, config)(idx)[0])


@pytest.mark.parametrize("gen_out", ["folded", "full"])
def test_own_slice_static_identity_is_mha_with_identity_projections(gen_out):
    """q_i = x_i I, k_i = x_i: MHA whose W_q, W_k are the (block-diagonal) identity, zero biases."""
    config = GPTConfig(**TINY, adaptive=False, share=False, gen_out=gen_out, metric_init="identity")
    model = random_model(config, 4)
    D = config.n_embd
    mha = build(GPTConfig(**{**vars(config), "attn": "mha"})).double()
    state = {k: v for k, v in model.state_dict().items() if k in mha.state_dict()}
    for l in range(config.n_layer):
        model.h[l].attn.metric.data.copy_(build(config).h[l].attn.metric)   # the identity init
        state[f"h.{l}.attn.c_attn.weight"] = torch.cat([torch.eye(D, dtype=torch.float64)] * 2
                                                       + [model.h[l].attn.c_v.weight.data])
        state[f"h.{l}.attn.c_attn.bias"] = torch.cat([torch.zeros(2 * D, dtype=torch.float64),
                                                      model.h[l].attn.c_v.bias.data])
    mha.load_state_dict(state, strict=True)
    idx = tokens(config, (2, 8), 0)
    assert rel_err(model(idx)[0], mha(idx)[0]) < 1e-12


@pytest.mark.parametrize("variant", [dict(adaptive=False, share=False, metric_init="identity", gen_out="folded"),
                                     dict(adaptive=False, share=False, metric_init="identity", gen_out="full"),
                                     dict(gen_out="full", metric_init="identity"),
                                     dict(gen_out="full", metric_init="identity", blocks="diag"),
                                     dict(gen_out="full", metric_init="identity", blocks="offdiag"),
                                     dict(adaptive=False, metric_init="identity", blocks="offdiag")])
def test_identity_init_gives_identity_metrics(variant):
    """m_i = I with every block or the diagonal ones; 0 with the off-diagonal ones (M_ij = 0, j != i)."""
    config = GPTConfig(**TINY, **variant)
    torch.manual_seed(0)
    model = build(config)
    if config.adaptive:   # the generator's last bias folds to I: with zero weights m = I everywhere
        model.gen[-1].weight.data.zero_()
        m = model.gen(torch.randn(1, 3, config.n_embd))
    else:
        m = static_metrics(model.metric if config.share else model.h[1].attn.metric, config)
    expected = torch.zeros(4, 4) if config.blocks == "offdiag" else torch.eye(4)
    assert torch.equal(m, expected.expand_as(m))


@pytest.mark.parametrize("variant", [dict(attn="proj"), dict(attn="proj", share=False, metric_init="identity"),
                                     dict(adaptive=False, share=False, metric_init="identity", mlp_hidden=7)])
def test_causal(variant):
    config = GPTConfig(**TINY, **variant)
    model = random_model(config, 5)
    idx = tokens(config, (1, 8), 0)
    changed = idx.clone()
    changed[0, 5:] = (idx[0, 5:] + 1) % config.vocab_size
    assert torch.equal(model(idx)[0][:, :5], model(changed)[0][:, :5])
    assert not torch.equal(model(idx)[0][:, 5:], model(changed)[0][:, 5:])


def test_defaults_unchanged():
    """mlp_hidden=0 is 4D, the same weights drawn in the same order; attn and metric_init default to the paper's model."""
    for fields in (dict(TINY), dict(TINY, attn="mha")):
        torch.manual_seed(0)
        a = build(GPTConfig(**fields)).state_dict()
        torch.manual_seed(0)
        b = build(GPTConfig(**fields, mlp_hidden=4 * TINY["n_embd"])).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert GPTConfig().attn == "damcha" and GPTConfig().metric_init == "normal"


def test_flops_follow_the_variant():
    base = flops_per_token(GPTConfig(**TINY))
    D, L = TINY["n_embd"], TINY["n_layer"]
    assert flops_per_token(GPTConfig(**TINY, attn="proj")) - base == 6 * L * 2 * D * D
    assert flops_per_token(GPTConfig(**TINY, mlp_hidden=3 * D)) - base == -6 * L * 2 * D * D


def test_parameter_matching_within_2_percent():
    """At train_char's default model: the generator width (DAMCHA, gen_out full or folded), or the
    MLP width (the per-layer static metric; the projected adaptive metric at DAMCHA's generator width)."""
    base = dict(vocab_size=80, block_size=64, n_layer=4, n_head=4, n_embd=128, gen_out="folded")
    mha = count_params(dict(base, attn="mha"))
    w = equal_params_width(mha, base)
    models = [dict(base, gen_width=w), dict(base, gen_out="full", gen_width=equal_params_width(mha, dict(base, gen_out="full")))]
    for fields in (dict(base, adaptive=False, share=False), dict(base, attn="proj", gen_width=w)):
        models.append(dict(fields, mlp_hidden=equal_params_width(mha, fields, "mlp_hidden")))
    for fields in models:
        assert abs(count_params(fields) / mha - 1) < 0.02, fields
    assert models[2]["mlp_hidden"] > 4 * 128 > models[3]["mlp_hidden"]   # static gains, proj gives width


@pytest.mark.parametrize("bad", [dict(metric_init="eye"), dict(mlp_hidden=-1),
                                 dict(attn="proj", kernel="triton"), dict(metric_init="identity", bias=False)])
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        GPTConfig(**bad)


def test_attn_names_the_attention_class():
    """GPTConfig takes any attn name; GPT builds the book's two by name, another from its class
    (GPT's attention, as lab/variants.build passes it), and refuses a name it has no class for."""
    config = GPTConfig(**TINY, attn="proj")
    with pytest.raises(ValueError, match="attention="):
        GPT(config)
    with pytest.raises(ValueError, match="'damcha' or 'mha'"):
        GPT(GPTConfig(**TINY, attn="both"))
    assert type(build(config).h[0].attn) is ATTENTIONS["proj"] is ProjectedAttention
    assert set(ATTENTIONS) == {"proj", "tha", "dcmha"}


# state_dict digests (sha256 of the keys and bytes, first 16 hex digits) of the models that
# torch.manual_seed(0) draws, and the next torch.rand(1), as the code before GPT took an attention
# class drew them: a seed still gives the same model for every attn.
SEEDED = {
    "mha": (dict(attn="mha"), "320e83b8cc2e38ef", 0.2833229303),
    "damcha": (dict(), "248c7959059461e2", 0.0130846500),
    "damcha-unshared": (dict(share=False), "5d0164d7669ab04e", 0.4975915551),
    "damcha-static": (dict(adaptive=False), "35c4051ce3cdfe0d", 0.7553913593),
    "damcha-static-unshared-identity": (
        dict(adaptive=False, share=False, gen_out="folded", metric_init="identity"),
        "f3e22665595b108e", 0.7553913593),
    "damcha-static-folded-nobias": (
        dict(gen_out="folded", mlp_hidden=5, bias=False, adaptive=False),
        "e9705f501e4d6b4b", 0.2895923257),
    "damcha-offdiag-identity": (
        dict(blocks="offdiag", metric_init="identity"), "6aadd6ef77a6c297", 0.0130846500),
    "proj": (
        dict(attn="proj", metric_init="identity", mlp_hidden=7), "374d817edaff7780", 0.5683641434),
    "proj-unshared-static": (
        dict(attn="proj", share=False, adaptive=False), "c05c76d82439ea19", 0.5111516118),
    "tha": (dict(attn="tha"), "6b8a6e2fce569eea", 0.2833229303),
    "dcmha": (dict(attn="dcmha"), "90100b2d4d40b092", 0.8658006787),
    "dcmha-nobias": (dict(attn="dcmha", bias=False), "8d4c9614c479a1dd", 0.5009523630),
}


def state_digest(module):
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", SEEDED)
def test_a_seed_draws_the_weights_it_always_drew(name):
    variant, digest, next_draw = SEEDED[name]
    torch.manual_seed(0)
    model = build(GPTConfig(**TINY, **variant))
    assert state_digest(model) == digest
    assert f"{torch.rand(1).item():.10f}" == f"{next_draw:.10f}"
