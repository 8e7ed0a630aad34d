"""
damcha_numpy.py: the whole DAMCHA GPT in NumPy, with a hand-written backward pass.

DAMCHA (Data-Adaptive Mahalanobis Cross-Head Attention, arXiv 2610.13261) replaces the query
and key projections of multi-head attention by a D x D cross-head metric M(c) that a small MLP
(the metric generator f) computes from the causal context c of every position. Head i compares
its own slice x_i of the layer input through m_i = sum_j M_ij (RowSum). The off-diagonal
blocks M_ij (j != i) are only added into m_i: head i never reads another head's slice, and the
other heads' subspaces reach it through the generator, which reads all of c (docs/model.md,
"What is known not to match the paper's claims").

This file is the reference that the PyTorch model and the GPU kernel are checked against. It
follows the model as docs/model.md writes it down, equation by equation. Every operation is a pair, llm.c style:
    out, cache = op_forward(...)        grads = op_backward(dout, cache)
Comments give tensor shapes, e.g. (B, T, H, dh, dh), and the paper's equation numbers.

Run it:
    python damcha_numpy.py                          # train a tiny DAMCHA on the bundled corpus
    python damcha_numpy.py --attn=mha --iters=500   # model and loop settings (--help)
Check the backward pass against central finite differences (float64):
    python -c "import damcha_numpy as d; print(d.gradcheck(d.GPTConfig(vocab_size=7, \\
        block_size=6, n_layer=2, n_head=2, n_embd=8, gen_width=5)))"
which prints, per parameter, max |analytic - numeric| / (1e-8 + 1e-5 |numeric|): <= 1 passes.
"""
import math
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from configurator import configure   # the settings parser of every script; no torch
from shell import die, memory_for, not_a_file, one_line_errors   # one-line errors; no torch


@dataclass
class GPTConfig:
    vocab_size: int = 80
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    attn: str = "damcha"     # "damcha" | "mha" (the baseline)
    adaptive: bool = True    # False: M (or m, when folded) is a learned constant, the ablation "without f(x)"
    share: bool = True       # one generator for the whole stack (Section 3.4)
    blocks: str = "all"      # which blocks RowSum adds: "all" | "diag" (M_ii) | "offdiag" (j != i)
    gen_out: str = "full"    # "full": f outputs M (D*D numbers); "folded": f outputs m (H*dh*dh)
    gen_depth: int = 2       # P, the number of linear layers in f
    gen_width: int = 64      # w, the hidden width of f
    bias: bool = True
    dropout: float = 0.0     # NumPy supports 0 only
    attn_dropout: float = 0.0   # likewise; the fields are damcha_torch.GPTConfig's, less its kernel
    metric_init: str = "normal"  # the study's variants (damcha_torch): NumPy has the paper's model
    mlp_hidden: int = 0          # only, so these two keep their defaults

    def __post_init__(self):
        sizes = dict(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                     n_head=self.n_head, n_embd=self.n_embd, gen_depth=self.gen_depth, gen_width=self.gen_width)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        checks = [
            (self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.attn in ("damcha", "mha"), f"attn must be 'damcha' or 'mha', not {self.attn!r}"),
            (self.blocks in ("all", "diag", "offdiag"), f"blocks must be 'all', 'diag' or 'offdiag', not {self.blocks!r}"),
            (self.gen_out in ("full", "folded"), f"gen_out must be 'full' or 'folded', not {self.gen_out!r}"),
            (self.gen_out == "full" or self.blocks == "all", "blocks other than 'all' need gen_out='full'"),
            (self.dropout == 0, "the NumPy model supports dropout=0 only"),
            (self.attn_dropout == 0, "the NumPy model supports attn_dropout=0 only"),
            ((self.metric_init, self.mlp_hidden) == ("normal", 0),
             "the NumPy model is the paper's: metric_init='normal', mlp_hidden=0 only"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# Generic layers

def embedding_forward(weight, idx):
    # weight (N, D), idx (...) of ints -> (..., D)
    return weight[idx], (weight.shape, idx)


def embedding_backward(dout, cache):
    shape, idx = cache
    dweight = np.zeros(shape, dtype=dout.dtype)
    np.add.at(dweight, idx, dout)  # a row picked several times collects every gradient
    return dweight


def linear_forward(x, weight, bias=None):
    # x (..., n_in), weight (n_out, n_in) as torch stores it: y = x W^T + b
    out = x @ weight.T
    if bias is not None:
        out = out + bias
    return out, (x, weight, bias is not None)


def linear_backward(dout, cache):
    x, weight, has_bias = cache
    dout2 = dout.reshape(-1, dout.shape[-1])                  # (B*T, n_out): every position's rows
    dweight = dout2.T @ x.reshape(-1, x.shape[-1])            # (n_out, n_in)
    dbias = dout2.sum(0) if has_bias else None
    return dout @ weight, dweight, dbias


def layernorm_forward(x, weight, bias=None, eps=1e-5):
    # x (..., D), normalised over the last axis with the biased variance, as torch does
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc ** 2).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    out = xhat * weight
    if bias is not None:
        out = out + bias
    return out, (xhat, rstd, weight, bias is not None)


def layernorm_backward(dout, cache):
    xhat, rstd, weight, has_bias = cache
    D = xhat.shape[-1]
    dweight = (dout * xhat).reshape(-1, D).sum(0)
    dbias = dout.reshape(-1, D).sum(0) if has_bias else None
    dxhat = dout * weight
    # xhat depends on x through the mean and the variance: remove both projections
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, dweight, dbias


GELU_C = math.sqrt(2.0 / math.pi)


def gelu_forward(x):
    # the tanh approximation (NumPy has no erf; torch: approximate='tanh')
    th = np.tanh(GELU_C * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1.0 + th), (x, th)


def gelu_backward(dout, cache):
    x, th = cache
    dinner = GELU_C * (1.0 + 3 * 0.044715 * x ** 2)
    return dout * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th ** 2) * dinner)


def cross_entropy_forward(logits, targets):
    # logits (B, T, V), targets (B, T): the mean negative log-likelihood, in nats
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, targets[..., None], -1).mean()
    return loss, (logp, targets)


def cross_entropy_backward(dloss, cache):
    logp, targets = cache
    dlogits = np.exp(logp)                                    # softmax probabilities
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
    return dloss * dlogits / targets.size


# ----------------------------------------------------------------------------------------------
# The cross-head metric (Eqs. 3-4)

def prefix_mean_forward(z):
    # z (B, T, D) -> c (B, T, D) with c[:, t] = mean of z[:, :t+1]: position t never sees later tokens
    counts = np.arange(1, z.shape[1] + 1, dtype=z.dtype)[:, None]   # (T, 1)
    return np.cumsum(z, axis=1) / counts, counts


def prefix_mean_backward(dc, counts):
    # z_s feeds every c_t with t >= s, each with weight 1/(t+1): a cumulative sum taken backwards in time
    return np.cumsum((dc / counts)[:, ::-1], axis=1)[:, ::-1]


def generator_forward(c, layers):
    # Eq. 3: the metric generator f, an MLP of P linear layers with GELU between them.
    # c (B, T, D) -> (B, T, out); layers: [(weight, bias or None)] * P
    caches, h = [], c
    for p, (weight, bias) in enumerate(layers):
        h, cache_lin = linear_forward(h, weight, bias)
        cache_gelu = None
        if p < len(layers) - 1:
            h, cache_gelu = gelu_forward(h)
        caches.append((cache_lin, cache_gelu))
    return h, caches


def generator_backward(dout, caches):
    # Eq. 3, backward: through the P layers in reverse -> (dc (B, T, D), [(dweight, dbias)] * P)
    layer_grads = []
    for cache_lin, cache_gelu in reversed(caches):
        if cache_gelu is not None:
            dout = gelu_backward(dout, cache_gelu)
        dout, dweight, dbias = linear_backward(dout, cache_lin)
        layer_grads.append((dweight, dbias))
    return dout, layer_grads[::-1]


def block_mask(n_head, blocks):
    # (H, H): 1 where RowSum adds the block M_ij
    eye = np.eye(n_head)
    return {"all": np.ones((n_head, n_head)), "diag": eye, "offdiag": 1.0 - eye}[blocks]


def block_mask_forward(M, blocks):
    # M (..., H, dh, H, dh): zero the blocks M_ij that this ablation leaves out (Section 5.3)
    mask = block_mask(M.shape[-2], blocks)[:, None, :, None].astype(M.dtype)   # (H, 1, H, 1)
    return M * mask, mask


def block_mask_backward(dout, mask):
    return dout * mask


def rowsum_forward(M):
    # Eq. 4: RowSum, m_i = sum_j M_ij.  M (..., H, dh, H, dh) -> m (..., H, dh, dh)
    return M.sum(-2), M.shape


def rowsum_backward(dm, shape):
    # Eq. 4, backward: every block M_ij of row i receives head i's gradient, dM_ij = dm_i
    return np.broadcast_to(dm[..., None, :], shape).copy()


def metric_forward(params, prefix, config, u):
    """The effective metrics m of one generator. u (B, T, D) -> m (B, T, H, dh, dh), or a
    static (H, dh, dh) when adaptive=False. prefix: "" (shared) or "h.{l}.attn." (unshared)."""
    H, D = config.n_head, config.n_embd
    dh = D // H
    cache = {}
    if config.adaptive:
        c, cache["context"] = prefix_mean_forward(u)                              # (B, T, D)
        layers = [_linear_params(params, f"{prefix}gen.{p}") for p in range(config.gen_depth)]
        g, cache["generator"] = generator_forward(c, layers)                      # (B, T, out)
        lead = u.shape[:2]
    else:
        g, lead = params[prefix + "metric"], ()                                   # (D, D) or (H, dh, dh)
    cache["g_shape"] = g.shape
    if config.gen_out == "full":
        M = g.reshape(*lead, H, dh, H, dh)   # Eq. 3: the D x D metric, M(c) or static; M_ij = M[..., i, :, j, :]
        M, cache["mask"] = block_mask_forward(M, config.blocks)
        m, cache["rowsum"] = rowsum_forward(M)                       # Eq. 4: (B, T, H, dh, dh), static (H, dh, dh)
    else:
        m = g.reshape(*lead, H, dh, dh)      # folded: f (or the static metric) holds the m_i themselves
    return m, (prefix, config, cache)


def metric_backward(dm, cache):
    """-> (du or None, grads of the generator or of the static metric)"""
    prefix, config, cache = cache
    if config.gen_out == "full":
        dM = rowsum_backward(dm, cache["rowsum"])                # Eq. 4
        dg = block_mask_backward(dM, cache["mask"]).reshape(cache["g_shape"])
    else:
        dg = dm.reshape(cache["g_shape"])
    if not config.adaptive:
        return None, {prefix + "metric": dg}
    dc, layer_grads = generator_backward(dg, cache["generator"])   # Eq. 3
    grads = {}
    for p, (dweight, dbias) in enumerate(layer_grads):
        _store_linear_grads(grads, f"{prefix}gen.{p}", dweight, dbias)
    return prefix_mean_backward(dc, cache["context"]), grads


# ----------------------------------------------------------------------------------------------
# Attention (Eqs. 5-8)

def metric_query_forward(x, m):
    # Eq. 5, the query side: q_i[b, t] = x_i[b, t] @ m_i[b, t].
    # x (B, T, H, dh); m (B, T, H, dh, dh), or (H, dh, dh) for a static metric -> q (B, T, H, dh)
    return (x[..., None, :] @ m)[..., 0, :], (x, m)


def metric_query_backward(dq, cache):
    # Eq. 5, backward (the query side): dx_t = dq_t m_t^T, dm_t = x_t^T dq_t, an outer product
    x, m = cache
    dx = (dq[..., None, :] @ m.swapaxes(-1, -2))[..., 0, :]   # (B, T, H, dh)
    dm = x[..., :, None] * dq[..., None, :]                   # (B, T, H, dh, dh)
    if m.ndim == 3:                                           # a static metric served every (b, t)
        dm = dm.reshape(-1, *m.shape).sum(0)
    return dx, dm


def scores_forward(q, k):
    # Eq. 5: S[b, i, t, s] = q_t . k_s / sqrt(dh) for head i.  q, k (B, H, T, dh) -> S (B, H, T, T)
    # Every (t, s) is computed; Eq. 5's s <= t is the mask that causal_softmax_forward applies
    scale = 1.0 / math.sqrt(q.shape[-1])
    return (q @ k.swapaxes(-1, -2)) * scale, (q, k, scale)


def scores_backward(dS, cache):
    # Eq. 5, backward: dq = dS k / sqrt(dh), dk = dS^T q / sqrt(dh).  (B, H, T, dh) each
    q, k, scale = cache
    return (dS @ k) * scale, (dS.swapaxes(-1, -2) @ q) * scale


def causal_softmax_forward(S):
    # Eq. 5's causal mask, then Eq. 6: A = softmax over s <= t; later positions get probability
    # exactly 0.  (B, H, T, T)
    T = S.shape[-1]
    S = np.where(np.tril(np.ones((T, T), dtype=bool)), S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    A = A / A.sum(-1, keepdims=True)
    return A, A


def causal_softmax_backward(dA, A):
    # Eq. 6, backward: dS = A * (dA - rowsum(dA * A)); masked entries have A = 0, so they
    # receive no gradient.  (B, H, T, T)
    return A * (dA - (dA * A).sum(-1, keepdims=True))


def attn_values_forward(A, v):
    # Eq. 7: O_i = A_i V_i.  A (B, H, T, T), v (B, H, T, dh) -> (B, H, T, dh)
    return A @ v, (A, v)


def attn_values_backward(dO, cache):
    # Eq. 7, backward: dA = dO v^T (B, H, T, T), dv = A^T dO (B, H, T, dh)
    A, v = cache
    return dO @ v.swapaxes(-1, -2), A.swapaxes(-1, -2) @ dO


def attention_forward(params, prefix, config, u, m):
    """Causal self-attention, DAMCHA or MHA. u (B, T, D) -> y (B, T, D); m: the metrics (DAMCHA)."""
    B, T, D = u.shape
    H = config.n_head
    dh = D // H
    to_heads = lambda a: a.reshape(B, T, H, dh).transpose(0, 2, 1, 3)   # (B, T, D) -> (B, H, T, dh)
    cache = {}
    if config.attn == "mha":
        qkv, cache["c_attn"] = linear_forward(u, *_linear_params(params, prefix + "c_attn"))  # (B, T, 3D)
        q, k, v = (to_heads(a) for a in np.split(qkv, 3, axis=-1))
    else:
        x_heads = u.reshape(B, T, H, dh)                      # head slices x_i: no query/key projections
        q, cache["query"] = metric_query_forward(x_heads, m)  # Eq. 5: (B, T, H, dh)
        q, k = q.transpose(0, 2, 1, 3), x_heads.transpose(0, 2, 1, 3)
        v, cache["c_v"] = linear_forward(u, *_linear_params(params, prefix + "c_v"))  # Eq. 7: V = u W_v^T + b_v
        v = to_heads(v)
    S, cache["scores"] = scores_forward(q, k)                 # Eq. 5: (B, H, T, T)
    A, cache["softmax"] = causal_softmax_forward(S)           # Eq. 6
    O, cache["values"] = attn_values_forward(A, v)            # Eq. 7: (B, H, T, dh)
    O = O.transpose(0, 2, 1, 3).reshape(B, T, D)              # Eq. 8: concat(O_0 .. O_{H-1})
    y, cache["c_proj"] = linear_forward(O, *_linear_params(params, prefix + "c_proj"))  # Eq. 8
    return y, (prefix, config, cache)


def attention_backward(dy, cache):
    """-> (du, dm or None, grads)"""
    prefix, config, cache = cache
    grads = {}
    dO, *dproj = linear_backward(dy, cache["c_proj"])         # Eq. 8, backward: (B, T, D)
    _store_linear_grads(grads, prefix + "c_proj", *dproj)
    B, T, D = dO.shape
    H = config.n_head
    dh = D // H
    from_heads = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, D)     # (B, H, T, dh) -> (B, T, D)
    dO = dO.reshape(B, T, H, dh).transpose(0, 2, 1, 3)
    dA, dv = attn_values_backward(dO, cache["values"])        # Eq. 7
    dS = causal_softmax_backward(dA, cache["softmax"])        # Eq. 6
    dq, dk = scores_backward(dS, cache["scores"])             # Eq. 5
    if config.attn == "mha":
        dqkv = np.concatenate([from_heads(dq), from_heads(dk), from_heads(dv)], axis=-1)
        du, *dattn = linear_backward(dqkv, cache["c_attn"])
        _store_linear_grads(grads, prefix + "c_attn", *dattn)
        return du, None, grads
    du, *dv_params = linear_backward(from_heads(dv), cache["c_v"])
    _store_linear_grads(grads, prefix + "c_v", *dv_params)
    dx_query, dm = metric_query_backward(dq.transpose(0, 2, 1, 3), cache["query"])   # Eq. 5, the query side
    # x_i is both the query's input and the key: its gradient has both parts
    du = du + (dx_query + dk.transpose(0, 2, 1, 3)).reshape(B, T, D)
    return du, dm, grads


# ----------------------------------------------------------------------------------------------
# The transformer

def mlp_forward(params, prefix, x):
    # D -> 4D -> GELU -> D.  x (B, T, D)
    h, cache_fc = linear_forward(x, *_linear_params(params, prefix + "c_fc"))   # (B, T, 4D)
    h, cache_gelu = gelu_forward(h)
    y, cache_proj = linear_forward(h, *_linear_params(params, prefix + "c_proj"))
    return y, (prefix, cache_fc, cache_gelu, cache_proj)


def mlp_backward(dy, cache):
    prefix, cache_fc, cache_gelu, cache_proj = cache
    grads = {}
    dhidden, *dproj = linear_backward(dy, cache_proj)                            # (B, T, 4D)
    _store_linear_grads(grads, prefix + "c_proj", *dproj)
    dx, *dfc = linear_backward(gelu_backward(dhidden, cache_gelu), cache_fc)
    _store_linear_grads(grads, prefix + "c_fc", *dfc)
    return dx, grads


def block_forward(params, config, l, x, m=None):
    """One pre-LN residual block. x (B, T, D). m: the metrics shared by the stack, or None when
    this block makes its own (share=False, or layer 0, whose input feeds the shared generator)."""
    prefix = f"h.{l}."
    u, cache_ln1 = layernorm_forward(x, *_linear_params(params, prefix + "ln_1"))
    cache_metric = None
    if config.attn == "damcha" and m is None:
        owner = "" if config.share else prefix + "attn."
        m, cache_metric = metric_forward(params, owner, config, u)
    a, cache_attn = attention_forward(params, prefix + "attn.", config, u, m)
    x = x + a                                                   # docs/model.md's h^(l)
    u2, cache_ln2 = layernorm_forward(x, *_linear_params(params, prefix + "ln_2"))
    y, cache_mlp = mlp_forward(params, prefix + "mlp.", u2)
    cache = dict(prefix=prefix, m=m, ln_1=cache_ln1, metric=cache_metric, attn=cache_attn,
                 ln_2=cache_ln2, mlp=cache_mlp)
    return x + y, cache


def block_backward(dx, cache, dm_shared=None):
    """-> (dx, dm, grads). dm_shared: the gradient that later layers sent to this block's shared
    metrics; the block that owns the generator back-propagates it and returns dm = None."""
    prefix = cache["prefix"]
    dmlp_in, grads = mlp_backward(dx, cache["mlp"])
    dx2, *dln2 = layernorm_backward(dmlp_in, cache["ln_2"])
    _store_linear_grads(grads, prefix + "ln_2", *dln2)
    dx = dx + dx2
    du, dm, attn_grads = attention_backward(dx, cache["attn"])
    grads.update(attn_grads)
    if cache["metric"] is not None:
        if dm_shared is not None:
            dm = dm + dm_shared
        du_metric, metric_grads = metric_backward(dm, cache["metric"])
        grads.update(metric_grads)
        if du_metric is not None:
            du = du + du_metric
        dm = None
    dx1, *dln1 = layernorm_backward(du, cache["ln_1"])
    _store_linear_grads(grads, prefix + "ln_1", *dln1)
    return dx + dx1, dm, grads


def forward(params, config, idx, targets=None):
    """idx (B, T) ints -> (logits (B, T, V), mean cross-entropy or None, cache for backward)."""
    B, T = idx.shape
    if T > config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {config.block_size}")
    tok, cache_wte = embedding_forward(params["wte.weight"], idx)               # (B, T, D)
    pos, cache_wpe = embedding_forward(params["wpe.weight"], np.arange(T))       # (T, D)
    x = tok + pos
    block_caches, m = [], None
    for l in range(config.n_layer):
        x, cache = block_forward(params, config, l, x, m)
        block_caches.append(cache)
        if config.share:
            m = cache["m"]                        # later layers reuse layer 0's metrics
    x, cache_lnf = layernorm_forward(x, *_linear_params(params, "ln_f"))
    logits, cache_head = linear_forward(x, params["wte.weight"])                # tied lm_head (B, T, V)
    loss, cache_loss = cross_entropy_forward(logits, targets) if targets is not None else (None, None)
    cache = dict(wte=cache_wte, wpe=cache_wpe, blocks=block_caches, ln_f=cache_lnf,
                 head=cache_head, loss=cache_loss)
    return logits, loss, cache


def backward(params, config, cache):
    """Gradients of the mean loss with respect to every parameter (same keys as params)."""
    if cache["loss"] is None:
        raise ValueError("backward needs the forward pass to have been given targets")
    dlogits = cross_entropy_backward(1.0, cache["loss"])
    dx, dwte_head, _ = linear_backward(dlogits, cache["head"])
    grads = {}
    dx, *dlnf = layernorm_backward(dx, cache["ln_f"])
    _store_linear_grads(grads, "ln_f", *dlnf)
    dm_shared = None
    for block_cache in reversed(cache["blocks"]):
        dx, dm, block_grads = block_backward(dx, block_cache, dm_shared)
        grads.update(block_grads)
        if dm is not None:
            dm_shared = dm if dm_shared is None else dm_shared + dm
    grads["wpe.weight"] = embedding_backward(dx.sum(0), cache["wpe"])
    grads["wte.weight"] = embedding_backward(dx, cache["wte"]) + dwte_head   # tied: both uses add up
    return {k: grads[k] for k in params}


def _linear_params(params, name):
    # (weight, bias) of a linear or LayerNorm; bias is None when config.bias is False
    return params[name + ".weight"], params.get(name + ".bias")


def _store_linear_grads(grads, name, dweight, dbias):
    grads[name + ".weight"] = dweight
    if dbias is not None:
        grads[name + ".bias"] = dbias


# ----------------------------------------------------------------------------------------------
# Initialisation

def generator_out_size(config):
    D, H = config.n_embd, config.n_head
    return D * D if config.gen_out == "full" else H * (D // H) ** 2


def init_params(config, seed=0, dtype=np.float64):
    """nanoGPT's initialisation: weights N(0, 0.02), residual projections (attn.c_proj,
    mlp.c_proj) N(0, 0.02/sqrt(2 n_layer)), biases 0, LayerNorm 1 and 0.

    The generator and the static metric use N(0, 0.02) weights and zero biases too. Then a
    generated m is small (rms 7e-3 at the default config: sums of products of small weights), every
    score S is close to 0 and attention starts close to uniform, like MHA's at nanoGPT's init; a
    static m (rms 0.04, the weights themselves) starts it further off (docs/model.md, choice 5).
    No generator weight is zero, so every generator parameter gets a non-zero gradient at step 0
    (a zero last layer would cut the gradient to all layers before it). tests/test_numpy.py
    checks both."""
    rng = np.random.default_rng(seed)
    D, H, L = config.n_embd, config.n_head, config.n_layer
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * L)
    params = {}

    def linear(name, n_out, n_in, s=std):
        params[name + ".weight"] = rng.normal(0.0, s, (n_out, n_in))
        if config.bias:
            params[name + ".bias"] = np.zeros(n_out)

    def layernorm(name):
        params[name + ".weight"] = np.ones(D)
        if config.bias:
            params[name + ".bias"] = np.zeros(D)

    def generator(prefix):
        out = generator_out_size(config)
        if not config.adaptive:
            shape = (D, D) if config.gen_out == "full" else (H, D // H, D // H)
            params[prefix + "metric"] = rng.normal(0.0, std, shape)
            return
        sizes = [D] + [config.gen_width] * (config.gen_depth - 1) + [out]
        for p in range(config.gen_depth):
            linear(f"{prefix}gen.{p}", sizes[p + 1], sizes[p])

    params["wte.weight"] = rng.normal(0.0, std, (config.vocab_size, D))
    params["wpe.weight"] = rng.normal(0.0, std, (config.block_size, D))
    for l in range(L):
        prefix = f"h.{l}."
        layernorm(prefix + "ln_1")
        if config.attn == "mha":
            linear(prefix + "attn.c_attn", 3 * D, D)
        else:
            linear(prefix + "attn.c_v", D, D)
            if not config.share:
                generator(prefix + "attn.")
        linear(prefix + "attn.c_proj", D, D, proj_std)
        layernorm(prefix + "ln_2")
        linear(prefix + "mlp.c_fc", 4 * D, D)
        linear(prefix + "mlp.c_proj", D, 4 * D, proj_std)
    layernorm("ln_f")
    if config.attn == "damcha" and config.share:
        generator("")
    return {k: v.astype(dtype) for k, v in params.items()}


# ----------------------------------------------------------------------------------------------
# Checking the backward pass

def numerical_gradient(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every entry of the array x, which
    f reads (x is perturbed in place and restored)."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        f_plus = f()
        flat[i] = old - eps
        f_minus = f()
        flat[i] = old
        gflat[i] = (f_plus - f_minus) / (2 * eps)
    return grad


def gradcheck(config, params=None, idx=None, targets=None, seed=0, eps=1e-6, names=None):
    """Compare backward() with central differences of forward()'s loss, in float64.
    Returns {name: max |analytic - numeric| / (1e-8 + 1e-5 |numeric|)}; <= 1 everywhere passes.
    Without params, uses init_params with every entry moved by N(0, 0.3), so that the
    generator's gradients are far from zero. names: check only these parameters (default: all)."""
    rng = np.random.default_rng(seed)
    if params is None:
        params = {k: v + rng.normal(0.0, 0.3, v.shape) for k, v in init_params(config, seed).items()}
    params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    if idx is None:
        idx = rng.integers(0, config.vocab_size, (2, config.block_size))
        targets = rng.integers(0, config.vocab_size, idx.shape)
    _, _, cache = forward(params, config, idx, targets)
    grads = backward(params, config, cache)
    loss = lambda: forward(params, config, idx, targets)[1]
    report = {}
    for name in params if names is None else names:
        numeric = numerical_gradient(loss, params[name], eps)
        report[name] = float(np.max(np.abs(grads[name] - numeric) / (1e-8 + 1e-5 * np.abs(numeric))))
    return report


# ----------------------------------------------------------------------------------------------
# Training on the bundled corpus

def adamw_step(params, grads, state, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """AdamW (Loshchilov & Hutter): decoupled weight decay, applied to tensors with >= 2 dims
    (weights, embeddings, static metrics) and not to biases or LayerNorm gains."""
    state["t"] = state.get("t", 0) + 1
    b1, b2, t = betas[0], betas[1], state["t"]
    for k, p in params.items():
        g_mean = state.setdefault("m." + k, np.zeros_like(p))   # Adam's moments: the running mean of
        g_sq = state.setdefault("v." + k, np.zeros_like(p))     # the gradient and of its square
        g_mean[...] = b1 * g_mean + (1 - b1) * grads[k]
        g_sq[...] = b2 * g_sq + (1 - b2) * grads[k] ** 2
        if p.ndim >= 2:
            p *= 1 - lr * weight_decay
        p -= lr * (g_mean / (1 - b1 ** t)) / (np.sqrt(g_sq / (1 - b2 ** t)) + eps)


def load_corpus(path):
    """-> (data as uint8 token ids, vocab): a character-level vocabulary, the sorted distinct bytes."""
    raw = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    vocab = np.unique(raw)
    return np.searchsorted(vocab, raw).astype(np.uint8), vocab


def read_data(path):
    """load_corpus(path), each way it can fail one line naming --data: a path that is no regular
    file (read whole, a FIFO would block and a device never end), none at all, one that cannot be
    read, one too big for memory, an empty one."""
    if not_a_file(path):
        die(f"--data={path} is {not_a_file(path)}, not a text file")
    if not Path(path).exists():
        die(f"--data={path}: no such file")
    try:
        with memory_for(f"reading --data={path}", "give a smaller file"):
            data, vocab = load_corpus(path)
    except OSError as e:   # a file that exists but cannot be read
        die(f"--data={path}: cannot read it ({e.strerror or e})")
    if not len(data):
        die(f"--data={path}: the file is empty")
    return data, vocab


def get_batch(data, batch_size, block_size, rng):
    # every window of block_size + 1 tokens (inputs and their next tokens), the last one included
    ix = rng.integers(0, len(data) - block_size, batch_size)
    x = np.stack([data[i:i + block_size] for i in ix]).astype(np.int64)
    y = np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64)
    return x, y


def generate(params, config, idx, max_new_tokens, rng, temperature=0.8):
    """Sample tokens one at a time, re-running the whole (cropped) forward pass for each."""
    for _ in range(max_new_tokens):
        logits, _, _ = forward(params, config, idx[:, -config.block_size:])
        z = logits[:, -1].astype(np.float64) / temperature
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        nxt = np.array([[rng.choice(len(p), p=p)] for p in probs])
        idx = np.concatenate([idx, nxt], axis=1)
    return idx


def stop_if_not_finite(what, loss, it):
    """Weights past a non-finite loss are lost: stop at once, as train_char.py does."""
    if not math.isfinite(loss):
        die(f"the {what} loss became {loss} at iter {it}; stopped; try a lower --lr")


def encode_start(start, vocab):
    """--start -> its token ids (1, n). The prompt is bytes, as the model reads: bytes typed that
    are not UTF-8 come back as they were."""
    try:
        raw = np.frombuffer(start.encode("utf-8", errors="surrogateescape"), dtype=np.uint8)
    except UnicodeEncodeError as e:
        die(f"--start cannot be written as bytes: {e.reason} at character {e.start}")
    if not len(raw):
        die("--start is empty: the sample after training needs at least one character to follow")
    if not np.isin(raw, vocab).all():
        die(f"--start={start!r} has characters that are not in the corpus")
    return np.searchsorted(vocab, raw)[None].astype(np.int64)


def main(argv):
    # the GPTConfig fields that NumPy varies (not vocab_size, which the corpus decides, nor those
    # it has at their defaults only: no dropout, and the paper's model), and the loop's settings
    fixed = ("vocab_size", "dropout", "attn_dropout", "metric_init", "mlp_hidden")
    settings = {f.name: f.default for f in fields(GPTConfig) if f.name not in fixed}
    settings.update(iters=1500, batch_size=16, lr=1e-2, warmup=100, eval_every=250, seed=0, start="ROMEO:",
                    data=str(Path(__file__).parent / "data" / "shakespeare" / "input.txt"))
    settings, _ = configure(settings, argv, positive=("iters", "batch_size", "warmup", "eval_every", "lr"),
                            doc=__doc__)   # lr < 0 would climb the loss
    if not 0 <= settings["seed"] < 2**32:
        die(f"--seed must be a whole number from 0 to 2**32 - 1, not {settings['seed']}")
    data, vocab = read_data(settings["data"])
    prompt = encode_start(settings["start"], vocab)
    try:
        config = GPTConfig(**{f.name: settings[f.name] for f in fields(GPTConfig) if f.name in settings},
                           vocab_size=len(vocab))
    except ValueError as e:
        die(str(e))
    if prompt.shape[1] > config.block_size:
        die(f"--start is {prompt.shape[1]} bytes, longer than the model's block_size of "
                         f"{config.block_size}: it would not see the beginning")
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    if len(val) < config.block_size + 1:
        die(f"--data={settings['data']}: its last 10% ({len(val)} characters) is shorter "
                         f"than block_size + 1 ({config.block_size + 1}); use a longer file or a smaller block_size")
    rng = np.random.default_rng(settings["seed"])
    params = init_params(config, settings["seed"], dtype=np.float32)   # float32: twice as fast
    print(config)
    print(f"{sum(p.size for p in params.values()):,} parameters, {len(data):,} characters, vocab {len(vocab)}")
    state, iters, t0 = {}, settings["iters"], time.time()
    np.seterr(over="ignore", invalid="ignore")   # a diverging run: stop_if_not_finite says it in one line
    for it in range(iters + 1):
        if it % settings["eval_every"] == 0 or it == iters:
            eval_rng = np.random.default_rng(1234)   # the same validation batches every time
            val_loss = np.mean([forward(params, config, *get_batch(val, 32, config.block_size, eval_rng))[1]
                                for _ in range(8)])
            print(f"iter {it:5d} | val loss {val_loss:.4f} | val bpc {val_loss / math.log(2):.3f} "
                  f"| {time.time() - t0:6.1f}s")
            stop_if_not_finite("val", val_loss, it)
        if it == iters:
            break
        x, y = get_batch(train, settings["batch_size"], config.block_size, rng)
        _, loss, cache = forward(params, config, x, y)
        stop_if_not_finite("training", loss, it)
        grads = backward(params, config, cache)
        lr = settings["lr"] * min(1.0, (it + 1) / settings["warmup"]) * 0.5 * (1 + math.cos(math.pi * it / iters))
        adamw_step(params, grads, state, lr)
        if it % 50 == 0:
            print(f"iter {it:5d} | train loss {loss:.4f} | lr {lr:.2e}")
    sample = generate(params, config, prompt, 300, rng)
    print("-" * 60)
    print(vocab[sample[0]].tobytes().decode("utf-8", errors="replace"))


if __name__ == "__main__":
    with one_line_errors("batch_size, block_size, n_embd or n_layer"):   # a batch out of memory
        main(sys.argv[1:])
