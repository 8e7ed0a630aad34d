"""Independent float64 reference of the DAMCHA forward pass, written from the model's description only.

This file is deliberately independent of damcha_numpy.py and damcha_torch.py: it was
written without reading them, uses explicit Python loops so that every formula of the
description appears literally, and is only meant for tiny sizes in tests (speed does not matter).

    reference_forward(params, config, idx, targets=None) -> (logits, loss)
    reference_random_params(config, seed) -> dict of float64 arrays (the model's parameter keys)

The description is the one docs/model.md gives. Its "DAMCHA attention" section is
followed in three steps: (1) the causal context, (2) the generator, (3) the metric's RowSum.
"""
import math

import numpy as np


# ---------------------------------------------------------------- small building blocks
def _gelu(x):
    # "GELU is the tanh approximation everywhere"
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _p(params, name):
    """Parameter as float64, or None when absent (bias=False removes every .bias)."""
    return None if name not in params else np.asarray(params[name], dtype=np.float64)


def _linear(params, prefix, x):
    # "Linear layers store weight as (out, in): y = x @ W.T + b"
    y = x @ _p(params, prefix + ".weight").T
    b = _p(params, prefix + ".bias")
    return y if b is None else y + b


def _layernorm(params, prefix, x, eps=1e-5):
    # LayerNorm over the last axis, biased variance, eps 1e-5
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * _p(params, prefix + ".weight")
    b = _p(params, prefix + ".bias")
    return y if b is None else y + b


def _softmax_1d(s):
    s = s - s.max()
    e = np.exp(s)
    return e / e.sum()


# ---------------------------------------------------------------- DAMCHA metric (steps 1-3)
def _rowsum(M, H, dh, blocks):
    """RowSum (Eq. 4) of one D x D matrix M: m_i = sum over j of M_ij, block selection per
    'blocks' (all: every j; diag: j == i; offdiag: j != i). Returns (H, dh, dh)."""
    m = np.zeros((H, dh, dh))
    for i in range(H):
        for j in range(H):
            if blocks == "diag" and j != i:
                continue
            if blocks == "offdiag" and j == i:
                continue
            m[i] += M[i * dh:(i + 1) * dh, j * dh:(j + 1) * dh]
    return m


def _output_to_metric(vec, config):
    """One generator output vector (or static metric) -> per-head metrics (H, dh, dh)."""
    D, H = config.n_embd, config.n_head
    dh = D // H
    if config.gen_out == "full":
        M = np.asarray(vec, dtype=np.float64).reshape(D, D)  # row-major, row i*dh+a, col j*dh+b
        return _rowsum(M, H, dh, config.blocks)
    return np.asarray(vec, dtype=np.float64).reshape(H, dh, dh)  # folded: m directly


def _metrics(params, config, prefix, z):
    """Per-position per-head metrics m[b, t, i] (B, T, H, dh, dh) for the generator (or
    static metric) whose parameters start with `prefix` ('' or 'h.{l}.attn.'), fed by z."""
    B, T, D = z.shape
    H = config.n_head
    dh = D // H
    m = np.zeros((B, T, H, dh, dh))
    if not config.adaptive:
        # static-metric ablation: the same learned constant for every (b, t)
        const = _output_to_metric(_p(params, prefix + "metric"), config)
        m[:, :] = const
        return m
    P = config.gen_depth
    for b in range(B):
        for t in range(T):
            # step 1: causal prefix mean of z over s <= t
            c = np.zeros(D)
            for s in range(t + 1):
                c += z[b, s]
            c /= (t + 1)
            # step 2: generator MLP, P linear layers, GELU between (none after the last)
            h = c
            for p in range(P):
                h = _linear(params, prefix + "gen.%d" % p, h)
                if p < P - 1:
                    h = _gelu(h)
            # step 3: reshape to M and RowSum (or read m directly when folded)
            m[b, t] = _output_to_metric(h, config)
    return m


# ---------------------------------------------------------------- attention
def _damcha_attn(params, config, l, u, m):
    """DAMCHA attention (steps 4-5) of layer l with metrics m (B, T, H, dh, dh)."""
    B, T, D = u.shape
    H = config.n_head
    dh = D // H
    pre = "h.%d.attn." % l
    v = _linear(params, pre + "c_v", u)  # V = u @ W_v.T + b_v (Eq. 7)
    out = np.zeros((B, T, D))
    for b in range(B):
        for i in range(H):
            sl = slice(i * dh, (i + 1) * dh)
            x_i = u[b, :, sl]  # head slice of u, no q/k projections
            for t in range(T):
                # S_i[t, s] = x_i[t] @ m_i[b, t] @ x_i[s] / sqrt(dh), s <= t (Eq. 5)
                scores = np.array([x_i[t] @ m[b, t, i] @ x_i[s] / math.sqrt(dh)
                                   for s in range(t + 1)])
                a = _softmax_1d(scores)  # Eq. 6
                o = np.zeros(dh)
                for s in range(t + 1):
                    o += a[s] * v[b, s, sl]  # O_i = A_i @ V_i
                out[b, t, sl] = o  # concat over heads
    return _linear(params, pre + "c_proj", out)  # Eq. 8


def _mha_attn(params, config, l, u):
    """Standard causal multi-head attention baseline (attn='mha')."""
    D = u.shape[-1]
    H = config.n_head
    pre = "h.%d.attn." % l
    qkv = _linear(params, pre + "c_attn", u)  # rows of c_attn are [q; k; v]
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    return _linear(params, pre + "c_proj", _causal_heads(q, k, v, H))


def _causal_heads(q, k, v, H):
    """Per head i: out_i[t] = sum over s <= t of softmax_s(q_i[t] . k_i[s] / sqrt(dh)) v_i[s]."""
    B, T, D = q.shape
    dh = D // H
    out = np.zeros((B, T, D))
    for b in range(B):
        for i in range(H):
            sl = slice(i * dh, (i + 1) * dh)
            for t in range(T):
                scores = np.array([q[b, t, sl] @ k[b, s, sl] / math.sqrt(dh)
                                   for s in range(t + 1)])
                a = _softmax_1d(scores)
                o = np.zeros(dh)
                for s in range(t + 1):
                    o += a[s] * v[b, s, sl]
                out[b, t, sl] = o
    return out


# ---------------------------------------------------------------- the network
def reference_forward(params, config, idx, targets=None):
    """Forward pass of the pre-LN GPT of docs/model.md. Returns (logits (B, T, V) float64, loss),
    loss = mean cross-entropy as a float, or None when targets is None."""
    idx = np.asarray(idx)
    B, T = idx.shape
    assert T <= config.block_size
    wte = _p(params, "wte.weight")
    x = wte[idx] + _p(params, "wpe.weight")[:T]  # x0 = wte[idx] + wpe[0..T-1]
    shared_m = None
    for l in range(config.n_layer):
        u = _layernorm(params, "h.%d.ln_1" % l, x)  # attention sees u = ln_1(x)
        if config.attn == "mha":
            a = _mha_attn(params, config, l, u)
        else:
            if config.share:
                # one generator / static metric for the stack, fed by layer 0's u
                if shared_m is None:
                    shared_m = _metrics(params, config, "", u)
                m = shared_m
            else:
                m = _metrics(params, config, "h.%d.attn." % l, u)
            a = _damcha_attn(params, config, l, u, m)
        x = x + a
        hmlp = _gelu(_linear(params, "h.%d.mlp.c_fc" % l, _layernorm(params, "h.%d.ln_2" % l, x)))
        x = x + _linear(params, "h.%d.mlp.c_proj" % l, hmlp)  # mlp: D -> 4D -> D
    logits = _layernorm(params, "ln_f", x) @ wte.T  # lm_head tied to wte
    if targets is None:
        return logits, None
    targets = np.asarray(targets)
    total = 0.0
    for b in range(B):
        for t in range(T):
            row = logits[b, t]
            mx = row.max()
            lse = mx + math.log(np.exp(row - mx).sum())  # log-sum-exp
            total += lse - row[targets[b, t]]
    return logits, total / (B * T)


# ---------------------------------------------------------------- random parameters
def reference_random_params(config, seed):
    """Every parameter key docs/model.md lists for `config`, float64: weights N(0, 0.3),
    LayerNorm weights 1 + N(0, 0.1), biases N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    V, D, H = config.vocab_size, config.n_embd, config.n_head
    dh = D // H
    P, w = config.gen_depth, config.gen_width
    params = {}

    def W(name, shape):
        params[name] = rng.normal(0.0, 0.3, size=shape)

    def lin(name, out, inp):
        W(name + ".weight", (out, inp))
        if config.bias:
            params[name + ".bias"] = rng.normal(0.0, 0.1, size=(out,))

    def ln(name):
        params[name + ".weight"] = 1.0 + rng.normal(0.0, 0.1, size=(D,))
        if config.bias:
            params[name + ".bias"] = rng.normal(0.0, 0.1, size=(D,))

    def generator(prefix):
        out = D * D if config.gen_out == "full" else H * dh * dh
        if not config.adaptive:
            W(prefix + "metric", (D, D) if config.gen_out == "full" else (H, dh, dh))
            return
        for p in range(P):
            inp = D if p == 0 else w
            o = out if p == P - 1 else w
            lin(prefix + "gen.%d" % p, o, inp)

    W("wte.weight", (V, D))
    W("wpe.weight", (config.block_size, D))
    for l in range(config.n_layer):
        pre = "h.%d." % l
        ln(pre + "ln_1")
        ln(pre + "ln_2")
        if config.attn == "mha":
            lin(pre + "attn.c_attn", 3 * D, D)
        else:
            lin(pre + "attn.c_v", D, D)
            if not config.share:
                generator(pre + "attn.")
        lin(pre + "attn.c_proj", D, D)
        lin(pre + "mlp.c_fc", 4 * D, D)
        lin(pre + "mlp.c_proj", D, 4 * D)
    ln("ln_f")
    if config.attn != "mha" and config.share:
        generator("")
    return params
