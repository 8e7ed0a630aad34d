"""
damcha_torch.py: the DAMCHA GPT in PyTorch, in the shape of nanoGPT's model.py, with the attention
baselines it is compared against.

DAMCHA (Data-Adaptive Mahalanobis Cross-Head Attention, arXiv 2610.13261) drops the query and
key projections of multi-head attention. A small MLP, the metric generator f, reads the causal
prefix mean c of every position and outputs a D x D cross-head metric M(c); head i compares
its own slice x_i of the layer input through m_i = sum_j M_ij (RowSum), so the off-diagonal
blocks M_ij (j != i) let the other heads' subspaces shape head i's similarity.

The model is the one docs/model.md describes; damcha_numpy.py is the NumPy reference with the same
parameter names and layouts, so one set of weights loads into both (tests/test_torch.py checks
logits, loss and every gradient against it in float64). What this file adds is speed:
  - gen_out="full" never builds the (B, T, D, D) tensor M: RowSum is linear, so it is applied
    to the last generator layer's weights inside forward (exact, gradients included);
  - the metrics m (B, T, H, dh, dh), the largest tensors of a step, are applied with a hand-written
    backward (MetricQuery) and handed from layer to layer, so that the gradient of the stack's
    shared m is a single buffer that every layer adds into (at bench.py's --quick config this
    took a train step from 0.63x to 0.77x MHA's throughput, and its memory from 103 to 74 MiB);
  - softmax(q k^T) v goes through F.scaled_dot_product_attention (flash attention on CUDA);
  - with share=True the generator runs once per forward pass;
  - generate() decodes incrementally from a cache of keys, values and context sums.

The baselines (attn=...) all use MHA's c_attn (rows [q; k; v]) and c_proj:
  "mha"    standard multi-head attention;
  "tha"    Talking-Heads attention (Shazeer et al. 2020): a learned H x H matrix mixes the heads'
           logits before the softmax and another mixes their probabilities after it. Stored as
           their difference from the identity, h.{l}.attn.pre_mix and .post_mix (H, H), zero at
           init (the model starts as MHA, and weight decay pulls back towards it): 2 H^2
           parameters per layer more than MHA;
  "dcmha"  Dynamically Composable MHA (Xiao et al. 2024): the logits and then the probabilities
           are composed across heads with weights computed from the block input (see compose):
             h.{l}.attn.dyn_fc    Linear D -> 4 C, then GELU: the hidden units of the four
                                  compositions (before the softmax query-wise and key-wise, after
                                  it the same), C = 4H each, as in DCFormer
             h.{l}.attn.dyn_proj  (4, 2 R H, C): each composition's output layer, giving its
                                  w1 and w2 (R, H); rank R = 2
             h.{l}.attn.dyn_gate  Linear D -> 4 H, then tanh: the gates d, zero at init
           20 H D + 64 H^2 parameters per layer more than MHA, + 20 H with bias.
Both materialise the (B, H, T, T) logits and probabilities, which F.scaled_dot_product_attention
does not expose: their activation memory grows as T^2. damcha_numpy.py has "damcha" and "mha" only.

Use it:
    from damcha_torch import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=256))
    logits, loss = model(idx, targets)            # idx, targets (B, T) int64
Measure the peak memory of a train step, gen_out="full" against "folded" (each in a fresh
process):
    python damcha_torch.py
"""
import dataclasses
import inspect
import math
import os
import subprocess
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 80
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    attn: str = "damcha"     # "damcha" | the baselines "mha", "dcmha", "tha" (these two: PyTorch only)
    adaptive: bool = True    # False: M is a learned constant, the ablation "without f(x)"
    share: bool = True       # one generator for the whole stack (Section 3.4)
    blocks: str = "all"      # which blocks RowSum adds: "all" | "diag" (M_ii) | "offdiag" (j != i)
    gen_out: str = "full"    # "full": f outputs M (D*D numbers); "folded": f outputs m (H*dh*dh)
    gen_depth: int = 2       # P, the number of linear layers in f
    gen_width: int = 64      # w, the hidden width of f
    bias: bool = True
    dropout: float = 0.0     # embedding, attention and residual dropout while training (NumPy: 0 only)
    kernel: str = "torch"    # DAMCHA attention: "torch" (einsum + SDPA) | "triton" (damcha_triton.py, fused)

    def __post_init__(self):
        sizes = dict(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                     n_head=self.n_head, n_embd=self.n_embd, gen_depth=self.gen_depth, gen_width=self.gen_width)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        checks = [
            (self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.attn in ("damcha", "mha", "dcmha", "tha"), f"attn must be 'damcha', 'mha', 'dcmha' or 'tha', not {self.attn!r}"),
            (self.blocks in ("all", "diag", "offdiag"), f"blocks must be 'all', 'diag' or 'offdiag', not {self.blocks!r}"),
            (self.gen_out in ("full", "folded"), f"gen_out must be 'full' or 'folded', not {self.gen_out!r}"),
            (self.gen_out == "full" or self.blocks == "all", "blocks other than 'all' need gen_out='full'"),
            (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), not {self.dropout}"),
            (self.kernel in ("torch", "triton"), f"kernel must be 'torch' or 'triton', not {self.kernel!r}"),
            (self.kernel == "torch" or self.attn == "damcha", "kernel='triton' is for attn='damcha' only"),
            (self.kernel == "torch" or self.dropout == 0, "kernel='triton' has no attention dropout: use dropout=0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# The cross-head metric (Eqs. 3-4)

def rowsum(M, config):
    """Eq. 4, RowSum m_i = sum_j M_ij, over the blocks that config.blocks keeps.

    M holds D*D rows laid out as the spec's D x D metric, row-major: row (i*dh + a)*D + j*dh + b
    is entry (a, b) of block M_ij. It is the generator's last weight (D*D, w), its bias (D*D,)
    or a static metric (D, D). Returns (H, dh, dh, k), k = w for a weight and 1 otherwise."""
    H = config.n_head
    dh = config.n_embd // H
    M = M.reshape(H, dh, H, dh, -1)                                  # (i, a, j, b, k)
    if config.blocks == "all":
        return M.sum(dim=2)
    diag = torch.diagonal(M, dim1=0, dim2=2).permute(3, 0, 1, 2)     # (H, dh, dh, k): M_ii
    return diag if config.blocks == "diag" else M.sum(dim=2) - diag


def prefix_mean(z, state=None):
    """Step 1 of the spec: c[b, t] = mean of z[b, s] over s <= t, so position t never sees a later
    token. z (B, T, D) -> c (B, T, D). When decoding, `state` carries the sum and the count of
    the earlier tokens, so that a new token costs O(1) here."""
    total = torch.cumsum(z, dim=1)                                   # (B, T, D)
    seen = 0
    if state is not None:
        if "zsum" in state:
            total = total + state["zsum"].unsqueeze(1)
            seen = state["n"]
        state["zsum"], state["n"] = total[:, -1], seen + z.size(1)
    count = torch.arange(seen + 1, seen + z.size(1) + 1, device=z.device, dtype=total.dtype)
    return total / count.view(1, -1, 1)


def generator_sizes(config, out):
    """The widths of f's layers, input to output: D -> w -> ... -> w -> out (P linear layers)."""
    return [config.n_embd] + [config.gen_width] * (config.gen_depth - 1) + [out]


class MetricGenerator(nn.ModuleList):
    """f of Eq. 3: P linear layers D -> w -> ... -> w -> out with GELU between them. The layers
    are the list's items, so their keys are gen.{p}.weight and gen.{p}.bias, as in the spec."""

    def __init__(self, config):
        D, H = config.n_embd, config.n_head
        out = D * D if config.gen_out == "full" else H * (D // H) ** 2
        sizes = generator_sizes(config, out)
        super().__init__(nn.Linear(n_in, n_out, bias=config.bias) for n_in, n_out in zip(sizes, sizes[1:]))
        self.config = config

    def forward(self, c):
        # c (B, T, D) -> m (B, T, H, dh, dh)
        *hidden, last = self
        for layer in hidden:
            c = F.gelu(layer(c), approximate="tanh")                 # (B, T, w)
        weight, bias = last.weight, last.bias
        H, D = self.config.n_head, self.config.n_embd
        dh = D // H
        if self.config.gen_out == "full":
            # Eq. 4 moved onto the weights: RowSum is linear, so it commutes with the last affine
            # layer. Summing its (D*D, w) weight over the block columns j gives an (H*dh*dh, w)
            # layer with the same outputs: M (B, T, D, D) is never built, and autograd sends
            # the exact gradient back to every entry of the full weight.
            weight = rowsum(weight, self.config).reshape(H * dh * dh, -1)
            bias = None if bias is None else rowsum(bias, self.config).reshape(H * dh * dh)
        B, T, _ = c.shape
        # F.linear's product, with the weight passed as a contiguous (w, out) copy (w*out numbers):
        # autograd then forms the weight gradient as c^T dm, (w, B*T)(B*T, out), which MKL runs about
        # twice as fast on the CPU as the dm^T c it picks for a transposed view (measured, w ~ 30)
        c, weight = c.reshape(B * T, -1), weight.t().contiguous()
        m = c @ weight if bias is None else torch.addmm(bias, c, weight)   # (B*T, H*dh*dh)
        return m.view(B, T, H, dh, dh)


def add_metric(owner, config):
    """Give `owner` (the GPT when shared, a layer's attention otherwise) its generator `gen`, or
    with adaptive=False its static metric `metric`: the spec's keys, with no extra prefix."""
    D, H = config.n_embd, config.n_head
    if config.adaptive:
        owner.gen = MetricGenerator(config)
    else:
        shape = (D, D) if config.gen_out == "full" else (H, D // H, D // H)
        owner.metric = nn.Parameter(torch.empty(shape))


def compute_metric(owner, z, config, state=None):
    """The effective metrics m of `owner`'s generator fed with z (B, T, D), the attention input u
    of the layer that owns it: (B, T, H, dh, dh), or (H, dh, dh) for a static metric."""
    if config.adaptive:
        return owner.gen(prefix_mean(z, state))                      # Eqs. 3-4 on the context c
    H = config.n_head
    dh = config.n_embd // H
    if config.gen_out == "full":
        return rowsum(owner.metric, config).reshape(H, dh, dh)
    return owner.metric


class MetricQuery(torch.autograd.Function):
    """Eq. 5's query side with one metric per position: q_i = x_i m_i. x (B, T, H, dh) and
    m (B, T, H, dh, dh) -> (q (B, T, H, dh), m), m passed on (as a view) to the next layer.

    Why by hand: autograd's backward of the einsum takes torch's per-matrix bmm loop on the CPU
    for the outer products dm = x_i^T dq_i (B*T*H products of a column and a row; measured over
    10x slower than the broadcast product below). Why m is passed on: when the stack shares m,
    layer l uses the m that layer l-1 returned, so the layers form a chain and backward hands
    each layer the gradient of m summed over the layers above it; the layer adds its own
    x_i^T dq_i into that buffer in place. Autograd's own summing would allocate one m-sized
    gradient per layer and add them up: for a tensor this large that is memory traffic and,
    the buffers being freshly mapped each step, page faults (measured: ~12k per step at the
    bench's --quick config). Eager mode only: torch.compile rejects the returned view of m
    being written in place, and CausalSelfAttention gives it the plain einsum instead."""

    @staticmethod
    def forward(ctx, x, m):
        ctx.save_for_backward(x, m)
        ctx.set_materialize_grads(False)                             # an unused m arrives as None
        return (x.unsqueeze(-2) @ m).squeeze(-2), m.view_as(m)

    @staticmethod
    def backward(ctx, dq, dm):
        # dq (B, T, H, dh); dm: the gradient of the m this layer passed on, or None at the top
        if dq is None:
            return None, dm
        x, m = ctx.saved_tensors
        dx = (dq.unsqueeze(-2) @ m.transpose(-1, -2)).squeeze(-2)   # dq_i m_i^T
        if dm is None:
            return dx, x.unsqueeze(-1) * dq.unsqueeze(-2)            # x_i^T dq_i
        return dx, dm.addcmul_(x.unsqueeze(-1), dq.unsqueeze(-2))   # the chain's one buffer, in place


# ----------------------------------------------------------------------------------------------
# The transformer

DCMHA_RANK = 2             # R, the rank of DCMHA's query-wise and key-wise compositions


def compose(A, query, key):
    """DCMHA's cross-head composition of logits or probabilities A (B, H, T, S):
        C(A)[n,t,s] = A[n,t,s] + sum_r w2_q(t)[r,n] sum_m w1_q(t)[r,m] A[m,t,s]
                               + sum_r w2_k(s)[r,n] sum_m w1_k(s)[r,m] A[m,t,s]
                               + (d_q(t)[n] + d_k(s)[n]) A[n,t,s]
    query = (w1_q, w2_q, d_q) of the T query positions, (B, T, R, H), (B, T, R, H), (B, T, H);
    key = (w1_k, w2_k, d_k) of the S key positions, (B, S, R, H), (B, S, R, H), (B, S, H).
    Every term mixes the heads at a single (t, s), never across positions."""
    (w1q, w2q, dq), (w1k, w2k, dk) = query, key
    out = A * (1 + dq.transpose(1, 2).unsqueeze(-1) + dk.transpose(1, 2).unsqueeze(-2))
    out = out + torch.einsum("brts,btrn->bnts", torch.einsum("bmts,btrm->brts", A, w1q), w2q)
    return out + torch.einsum("brts,bsrn->bnts", torch.einsum("bmts,bsrm->brts", A, w1k), w2k)


class CausalSelfAttention(nn.Module):
    """DAMCHA attention (Eqs. 5-8), or one of the baselines: attn="mha", "tha" or "dcmha"."""

    def __init__(self, config):
        super().__init__()
        D, H = config.n_embd, config.n_head
        if config.attn == "damcha":
            self.c_v = nn.Linear(D, D, bias=config.bias)             # Eq. 7: the value projection
            if not config.share:
                add_metric(self, config)
        else:
            self.c_attn = nn.Linear(D, 3 * D, bias=config.bias)      # rows [q; k; v]
        if config.attn == "tha":
            self.pre_mix = nn.Parameter(torch.zeros(H, H))           # logits mixed by I + pre_mix
            self.post_mix = nn.Parameter(torch.zeros(H, H))          # probabilities by I + post_mix
        if config.attn == "dcmha":
            C = 4 * H
            self.dyn_fc = nn.Linear(D, 4 * C, bias=config.bias)
            self.dyn_proj = nn.Parameter(torch.empty(4, 2 * DCMHA_RANK * H, C))
            self.dyn_gate = nn.Linear(D, 4 * H, bias=config.bias)
        self.c_proj = nn.Linear(D, D, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def forward(self, u, m=None, state=None):
        """u (B, T, D), the normalised layer input. m: the stack's shared metrics, or None when
        this layer owns its generator (or there is none). state: this layer's decoding cache, or
        None. Returns (y (B, T, D), the shared metrics for the next layer, see MetricQuery)."""
        B, T, D = u.size()
        H = self.config.n_head
        dh = D // H
        fused = self.config.kernel == "triton" and state is None    # decoding keeps the torch path
        if self.config.attn == "damcha":
            x = u.view(B, T, H, dh)                                  # head slices x_i: no q/k projections
            own = m is None
            if own:
                m = compute_metric(self, u, self.config, state)
            v = self.c_v(u).view(B, T, H, dh)                        # Eq. 7
            if fused:
                from damcha_triton import damcha_attention           # imports triton only when asked
                # Eqs. 5-7 in one kernel: each query q_i = x_i m_i is formed on chip, never stored
                y = damcha_attention(x.transpose(1, 2), m, v.transpose(1, 2))          # (B, H, T, dh)
            # Eq. 5, the query side: q_i = x_i m_i, one (dh x dh) metric per head and position, or
            # a static one (then the einsum is one matrix product per head). torch.compile plans
            # its own kernels and memory: it gets the plain einsum
            elif m.dim() == 5 and not torch.compiler.is_compiling():
                q, m = MetricQuery.apply(x, m)
            else:
                q = torch.einsum("bthd,bthde->bthe" if m.dim() == 5 else "bthd,hde->bthe", x, m)
            if own:
                m = None                                             # a layer's own metrics stay with it
            k = x                                                    # keys are the slices x_i themselves
        else:
            q, k, v = (a.view(B, T, H, dh) for a in self.c_attn(u).split(D, dim=2))
        if not fused:
            q, k, v = (a.transpose(1, 2) for a in (q, k, v))         # (B, H, T, dh)
            if state is not None:
                if "k" in state:
                    k = torch.cat([state["k"], k], dim=2)            # (B, H, t + T, dh)
                    v = torch.cat([state["v"], v], dim=2)
                state["k"], state["v"] = k, v
            if self.config.attn in ("damcha", "mha"):
                # Eqs. 5-7: softmax(q k^T / sqrt(dh)) v over s <= t. With a cache the T new queries
                # are the last positions, so causal masking is only needed when there is no earlier
                # token; GPT.forward feeds a single token once the cache holds any.
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.config.dropout if self.training else 0.0,
                                                   is_causal=q.size(2) == k.size(2))
            else:
                y = self.composed_attention(q, k, v, u, state)
        y = y.transpose(1, 2).reshape(B, T, D)                       # Eq. 8: concat(O_0 .. O_{H-1})
        return self.resid_dropout(self.c_proj(y)), m

    def composed_attention(self, q, k, v, u, state):
        """THA and DCMHA: softmax attention whose heads are mixed before and after the softmax.
        q (B, H, T, dh) for the T new positions, k and v (B, H, S, dh) for all S, u (B, T, D).
        The mixing needs the (B, H, T, S) logits and probabilities themselves."""
        T, S = q.size(2), k.size(2)
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)   # query t is key S - T + t
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))                     # (B, H, T, S)
        if self.config.attn == "tha":
            logits = logits + torch.einsum("nm,bmts->bnts", self.pre_mix, logits)
            probs = F.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            # the masked probabilities are 0, and mixing heads at one (t, s) keeps them 0
            probs = probs + torch.einsum("nm,bmts->bnts", self.post_mix, probs)
        else:
            pre, post = self.dynamic_weights(u, state)
            # the mask comes after the pre-softmax composition, and the masked probabilities are
            # zeroed after the post-softmax one, as in DCFormer
            probs = F.softmax(compose(logits, *pre).masked_fill(~causal, float("-inf")), dim=-1)
            probs = compose(probs, *post).masked_fill(~causal, 0.0)
        probs = F.dropout(probs, self.config.dropout, self.training)
        return probs @ v                                                             # (B, H, T, dh)

    def dynamic_weights(self, u, state):
        """DCMHA's weights, computed from the block input u (B, T, D) by a small MLP, for the four
        compositions: w1 (RMS-normalised over the heads), w2 and the tanh gate d. Returns
        (pre, post), each a pair (query, key) of compose's arguments. With a cache the weights of
        the earlier positions come from it: they serve as keys to the new queries."""
        B, T, _ = u.shape
        H, R = self.config.n_head, DCMHA_RANK
        hidden = F.gelu(self.dyn_fc(u), approximate="tanh").view(B, T, 4, -1)       # (B, T, 4, C)
        w = torch.einsum("btgc,goc->btgo", hidden, self.dyn_proj).view(B, T, 4, 2, R, H)
        w1, w2 = w.unbind(3)                                                         # (B, T, 4, R, H)
        w1 = w1 * torch.rsqrt(w1.pow(2).mean(-1, keepdim=True) + 1e-6)
        d = torch.tanh(self.dyn_gate(u)).view(B, T, 4, H)
        if state is not None:
            if "dyn" in state:
                w1, w2, d = (torch.cat([old, new], dim=1) for old, new in zip(state["dyn"], (w1, w2, d)))
            state["dyn"] = w1, w2, d
        # composition g: 0 and 1 before the softmax (query-wise, key-wise), 2 and 3 after it;
        # the queries are the last T positions, the keys all of them
        query = lambda g: tuple(a[:, -T:, g] for a in (w1, w2, d))
        key = lambda g: tuple(a[:, :, g] for a in (w1, w2, d))
        return (query(0), key(1)), (query(2), key(3))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        D = config.n_embd
        self.c_fc = nn.Linear(D, 4 * D, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * D, D, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, m=None, state=None):
        """-> (x, the shared metrics m for the next block)"""
        y, m = self.attn(self.ln_1(x), m, state)                     # attention sees u = ln_1(x)
        x = x + y
        return x + self.mlp(self.ln_2(x)), m


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        if self.shares_metric:
            add_metric(self, config)
        # nanoGPT's init, as damcha_numpy.init_params: N(0, 0.02) weights, embeddings, generator
        # and static metric; zero biases; residual projections scaled by 1/sqrt(2 n_layer).
        # The baselines' extras: THA's mixes zero (built so), DCMHA's dyn_proj N(0, 0.02)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif name.endswith(("metric", "dyn_proj")):
                torch.nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("dyn_gate.weight"):
                # DCMHA's gates start at tanh(0) = 0, and its low-rank terms small (dyn_proj): the
                # compositions start near the identity, i.e. near MHA, and every weight has a gradient
                torch.nn.init.zeros_(p)

    @property
    def shares_metric(self):
        return self.config.attn == "damcha" and self.config.share

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Parameter count; without the position embeddings by default, as nanoGPT. The token
        embedding stays in: it is also the (tied) lm_head."""
        n_params = sum(p.numel() for p in self.parameters())
        return n_params - self.wpe.weight.numel() if non_embedding else n_params

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) int64 -> (logits (B, T, V), mean cross-entropy or None).
        cache: generate()'s decoding state (see new_cache), or None for an ordinary pass."""
        B, T = idx.size()
        start = 0 if cache is None else cache["pos"]
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        if start > 0 and T != 1:
            raise ValueError("after the prompt, the cache takes one token at a time")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))                 # (B, T, D)
        m = None
        if self.shares_metric:
            # Section 3.4: one generator for the stack, run once here on layer 0's attention
            # input u (its LayerNorm is recomputed inside the block: cheap next to the generator)
            m = compute_metric(self, self.h[0].ln_1(x), self.config, None if cache is None else cache["shared"])
        for l, block in enumerate(self.h):
            x, m = block(x, m, None if cache is None else cache["layers"][l])
        logits = F.linear(self.ln_f(x), self.wte.weight)              # lm_head tied to wte (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if cache is not None:
            cache["pos"] = start + T
        return logits, loss

    def new_cache(self):
        """An empty decoding state: the next position, and per layer a dict that fills with the
        keys 'k' and values 'v' (B, H, t, dh) and, for a layer owning a generator, the running
        sum 'zsum' (B, D) and count 'n' of its context; 'shared' holds those of a shared one.
        DCMHA layers also keep their dynamic weights 'dyn' of every position."""
        return {"pos": 0, "layers": [{} for _ in self.h], "shared": {}}

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # weight decay for every tensor with >= 2 dims (weights, embeddings, static metrics),
        # none for biases and LayerNorm gains
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        print(f"num decayed parameter tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
        use_fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        print(f"using fused AdamW: {use_fused}")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if use_fused else {}))

    def flops_per_token(self):
        """Training FLOPs per token at context block_size: 6 per multiply-add of the forward pass
        (2 forward, 4 backward), counting the matmuls as nanoGPT does (PaLM, appendix B), plus
        the metric generator and the metric application q_i = x_i m_i (Eq. 5), or the baselines'
        head mixing. gen_out="full" is counted as it runs, folded: the generator's last layer
        costs w*H*dh*dh per token; folding the weights (D*D*w adds per pass) is left out."""
        cfg = self.config
        D, L, T, H, R = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.n_head, DCMHA_RANK
        dh = D // H
        attention = 2 * T * D                                        # q k^T and A v over T positions
        if cfg.attn == "damcha":
            per_layer = 2 * D * D + D * dh + attention               # c_v, c_proj, Eq. 5 (H*dh*dh)
        else:
            per_layer = 4 * D * D + attention                        # c_attn, c_proj
        if cfg.attn == "tha":
            per_layer += 2 * T * H * H                               # two H x H mixes at every (t, s)
        if cfg.attn == "dcmha":
            # the dynamic weights (dyn_fc, dyn_proj, dyn_gate), then at every (t, s) two
            # compositions of 2 R H (query-wise) + 2 R H (key-wise) + 2 H (gates)
            per_layer += 20 * H * D + 32 * R * H * H + 2 * (4 * R + 2) * H * T
        per_layer += 8 * D * D                                       # mlp
        generator = 0
        if cfg.attn == "damcha" and cfg.adaptive:
            sizes = generator_sizes(cfg, D * dh)                     # the last layer as it runs: folded
            generator = sum(a * b for a, b in zip(sizes, sizes[1:])) * (1 if cfg.share else L)
        return 6 * (L * per_layer + generator + D * cfg.vocab_size)  # + tied lm_head

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilisation against the H100/H200 peak of 989e12 bf16 dense FLOP/s."""
        flops_per_iter = self.flops_per_token() * self.config.block_size * fwdbwd_per_iter
        return flops_per_iter / dt / 989e12

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, t). The prompt runs once in full and
        fills a cache; each new token then costs O(t): its own generator context (from the
        running sum), its query against the cached keys and values. Once the sequence outgrows
        block_size the model conditions on the last block_size tokens, whose absolute positions
        and prefix means all change with every step, so from then on it reruns the full pass."""
        cache = None
        for _ in range(max_new_tokens):
            if idx.size(1) > self.config.block_size:
                logits, _ = self(idx[:, -self.config.block_size:])   # the window moved: no cache
            elif cache is None:
                cache = self.new_cache()
                logits, _ = self(idx, cache=cache)                   # the prompt, filling the cache
            else:
                logits, _ = self(idx[:, -1:], cache=cache)           # the newest token only
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


# ----------------------------------------------------------------------------------------------
# Peak memory of one train step

def count_params(fields):
    """GPT.get_num_params of GPTConfig(**fields), built on the meta device: no memory, no time."""
    with torch.device("meta"):
        return GPT(GPTConfig(**fields)).get_num_params()


def equal_params_width(target, fields):
    """The generator width w at which the DAMCHA model GPTConfig(**fields, gen_width=w) has the
    parameter count nearest to target. The count grows with w, so bisect."""
    count = lambda w: count_params(dict(fields, gen_width=w))
    lo, hi = 1, 2
    while count(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 2**20:
            raise ValueError(f"no generator width reaches {target:,} parameters")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    return min((lo, hi), key=lambda w: abs(count(w) - target))


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """The learning rate of iteration it: linear warm-up over warmup_iters, cosine decay to min_lr
    at lr_decay_iters, then min_lr (nanoGPT's schedule; every training loop here uses it)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train_step_peak_memory(config, batch_size, device="cpu"):
    """Build the model and run one AdamW train step (forward, backward, update) in float32 at
    T = block_size. A step of a tiny model of the same kind runs first, so that the libraries'
    one-off allocations (on the CPU some 170 MiB of MKL, oneDNN and autograd state) count as
    'before'. Returns (peak before building the model, peak after the step) in MiB: the
    process's peak RSS on the CPU (Linux and macOS), the peak allocated memory on CUDA. The
    peak RSS only ever grows, so on the CPU call it in a fresh process."""
    def peak():
        if device == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        if os.path.exists("/proc/self/status"):
            # Linux: the peak of this process image. getrusage's ru_maxrss would start from the
            # size of the parent, which a subprocess inherits through fork and exec
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)

    def train_step(config, batch_size):
        model = GPT(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(config.vocab_size, (batch_size, config.block_size), device=device)
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()

    torch.manual_seed(0)
    dh = config.n_embd // config.n_head
    train_step(dataclasses.replace(config, n_layer=1, n_embd=config.n_head * min(dh, 16),
                                   block_size=min(config.block_size, 16), gen_width=min(config.gen_width, 8)), 1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = peak()
    train_step(config, batch_size)
    return before, peak()


def fresh_process_peak_memory(fields, batch_size=4, device="cpu"):
    """train_step_peak_memory(GPTConfig(**fields), batch_size, device) run in a fresh Python
    process, where both peaks start from nothing. Returns (before, peak) in MiB."""
    code = (f"import torch, damcha_torch as d; torch.set_num_threads(1); "
            f"print(*d.train_step_peak_memory(d.GPTConfig(**{fields!r}), {batch_size}, {device!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return tuple(float(s) for s in out.stdout.split())


def compare_peak_memory(batch_size=4, device="cpu", **fields):
    """Peak memory of a float32 train step with gen_out="full" and "folded", each measured in a
    fresh Python process. Returns {gen_out: (before, peak)} in MiB."""
    return {gen_out: fresh_process_peak_memory(dict(fields, gen_out=gen_out), batch_size, device)
            for gen_out in ("full", "folded")}


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for share in (True, False):
        fields = dict(vocab_size=65, block_size=512, n_layer=4, n_head=8, n_embd=256, gen_width=128, share=share)
        print(f"B=4 {fields} on {device}, float32")
        peaks = compare_peak_memory(4, device, **fields)
        for gen_out, (before, peak) in peaks.items():
            print(f"  gen_out={gen_out:7s} peak {peak:8.1f} MiB (model and step: {peak - before:8.1f} MiB)")
        (full_before, full), (folded_before, folded) = peaks["full"], peaks["folded"]
        print(f"  full / folded peak: {full / folded:.3f} (model and step: "
              f"{(full - full_before) / (folded - folded_before):.3f})")
