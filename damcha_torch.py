"""
damcha_torch.py: the DAMCHA GPT in PyTorch, in the shape of nanoGPT's model.py.

DAMCHA (Data-Adaptive Mahalanobis Cross-Head Attention, arXiv 2610.13261) drops the query and
key projections of multi-head attention. A small MLP, the metric generator f, reads the causal
prefix mean c of every position and outputs a D x D cross-head metric M(c); head i compares
its own slice x_i of the layer input through m_i = sum_j M_ij (RowSum). The off-diagonal
blocks M_ij (j != i) are only added into m_i: head i never reads another head's slice, and the
other heads' subspaces reach it through the generator, which reads all of c.

The model is the one docs/model.md describes; damcha_numpy.py is the NumPy reference with the same
parameter names and layouts, so one set of weights loads into both (tests/test_torch.py checks
logits, loss and every gradient against it in float64). attn="mha" is the standard baseline;
attn="tha" and "dcmha", Talking-Heads and DCMHA, live in baselines.py. What this file adds to
the reference is speed:
  - gen_out="full" never builds the (B, T, D, D) tensor M: RowSum is linear, so it is applied
    to the last generator layer's weights inside forward (exact, gradients included);
  - softmax(q k^T) v goes through F.scaled_dot_product_attention (flash attention on CUDA), or
    with kernel="triton" through the fused kernel of damcha_triton.py;
  - with share=True the generator runs once per forward pass;
  - generate() decodes incrementally from a cache of keys, values and context sums.

Use it:
    from damcha_torch import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=256))
    logits, loss = model(idx, targets)            # idx, targets (B, T) int64
Speed and peak memory are measured by bench.py (python bench.py --quick, python bench.py --memory).
"""
import dataclasses
import math

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
    adaptive: bool = True    # False: M (or m, when folded) is a learned constant, the ablation "without f(x)"
    share: bool = True       # one generator for the whole stack (Section 3.4)
    blocks: str = "all"      # which blocks RowSum adds: "all" | "diag" (M_ii) | "offdiag" (j != i)
    gen_out: str = "full"    # "full": f outputs M (D*D numbers); "folded": f outputs m (H*dh*dh)
    gen_depth: int = 2       # P, the number of linear layers in f
    gen_width: int = 64      # w, the hidden width of f
    bias: bool = True
    dropout: float = 0.0     # embedding, residual and MLP dropout while training (NumPy: 0 only)
    attn_dropout: float = 0.0   # dropout of the attention probabilities (NumPy, kernel="triton": 0 only)
    kernel: str = "torch"    # DAMCHA attention: "torch" (Eq. 5 product + SDPA) | "triton" (damcha_triton.py, fused)
    # The 2x2 study (PyTorch only, NumPy keeps the defaults):
    qk: str = "slice"        # DAMCHA's queries and keys: "slice", Eq. 5's q_i = x_i m_i, k_i = x_i;
                             # "proj", MHA's projections with the metric: q_i = (u W_q^T)_i m_i, k_i = (u W_k^T)_i
    metric_init: str = "normal"  # "normal": N(0, 0.02) as every weight; "identity": m_i = I at init
                             # (the static metric, or the generator's last bias; its weight stays N(0, 0.02))
    mlp_hidden: int = 0      # the MLP's hidden width; 0: 4 * n_embd. A width that can trade for parameters

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
            (0.0 <= self.attn_dropout < 1.0, f"attn_dropout must be in [0, 1), not {self.attn_dropout}"),
            (self.kernel in ("torch", "triton"), f"kernel must be 'torch' or 'triton', not {self.kernel!r}"),
            (self.kernel == "torch" or self.attn == "damcha", "kernel='triton' is for attn='damcha' only"),
            (self.kernel == "torch" or self.qk == "slice", "kernel='triton' is for qk='slice' only"),
            (self.qk in ("slice", "proj"), f"qk must be 'slice' or 'proj', not {self.qk!r}"),
            (self.metric_init in ("normal", "identity"), f"metric_init must be 'normal' or 'identity', not {self.metric_init!r}"),
            (self.metric_init == "normal" or self.bias or not self.adaptive,
             "metric_init='identity' sets the generator's last bias: it needs bias=True"),
            (self.mlp_hidden >= 0, f"mlp_hidden must be at least 0 (0: 4 * n_embd), not {self.mlp_hidden}"),
            (self.kernel == "torch" or self.attn_dropout == 0,
             "kernel='triton' has no attention-probability dropout: use attn_dropout=0 (dropout is fine)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# The cross-head metric (Eqs. 3-4)

def rowsum(M, config):
    """Eq. 4, RowSum m_i = sum_j M_ij, over the blocks that config.blocks keeps.

    M holds Eq. 3's D x D metric, row-major, with k numbers per entry: entry (a, b) of block M_ij
    is row (i*dh + a)*D + j*dh + b of the generator's last weight (D*D, k), k its input width, or
    of its bias (D*D,), or entry [i*dh + a, j*dh + b] of a static metric (D, D).
    Returns (H, dh, dh, k), k = 1 for a bias or a static metric."""
    H = config.n_head
    dh = config.n_embd // H
    M = M.reshape(H, dh, H, dh, -1)                                  # (i, a, j, b, k)
    if config.blocks == "all":
        return M.sum(dim=2)
    diag = torch.diagonal(M, dim1=0, dim2=2).permute(3, 0, 1, 2)     # (H, dh, dh, k): M_ii
    return diag if config.blocks == "diag" else M.sum(dim=2) - diag


def prefix_mean(z, state=None):
    """The causal context c_t of Eq. 3: c[b, t] = mean of z[b, s] over s <= t, so position t never sees a later
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
    are the list's items, so their keys are gen.{p}.weight and gen.{p}.bias, as docs/model.md names them."""

    def __init__(self, config):
        D, H = config.n_embd, config.n_head
        out = D * D if config.gen_out == "full" else H * (D // H) ** 2
        sizes = generator_sizes(config, out)
        super().__init__(nn.Linear(n_in, n_out, bias=config.bias) for n_in, n_out in zip(sizes, sizes[1:]))
        self.config = config

    def __getitem__(self, idx):
        # ModuleList rebuilds a slice as its own class, which takes a config, not layers: a slice
        # (gen[:-1], the hidden layers) is a plain ModuleList of the same layers
        return nn.ModuleList(list(self)[idx]) if isinstance(idx, slice) else super().__getitem__(idx)

    def forward(self, c):
        # c (B, T, D) -> m (B, T, H, dh, dh)
        *hidden, last = self
        h = c
        for layer in hidden:
            h = F.gelu(layer(h), approximate="tanh")                 # (B, T, w)
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
        return F.linear(h, weight, bias).unflatten(-1, (H, dh, dh))  # (B, T, H, dh, dh)


def add_metric(owner, config):
    """Give `owner` (the GPT when shared, a layer's attention otherwise) its generator `gen`, or
    with adaptive=False its static metric `metric`: the keys docs/model.md names, with no extra prefix."""
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


def identity_metric(config):
    """The metric whose every m_i is the identity, in the layout of the static metric or of the
    generator's last bias: folded (H, dh, dh), full the D x D identity (M_ii = I, M_ij = 0 for
    j != i, so RowSum gives I with blocks "all" or "diag", and 0 with "offdiag")."""
    D, H = config.n_embd, config.n_head
    if config.gen_out == "full":
        return torch.eye(D)
    return torch.eye(D // H).expand(H, -1, -1).clone()


# ----------------------------------------------------------------------------------------------
# The transformer

def extend_cache(state, k, v):
    """Decoding: append the new keys and values k, v (B, H, T, dh) to those of the earlier
    positions kept in `state`, and return all of them, (B, H, t + T, dh). state None: no cache."""
    if state is not None:
        if "k" in state:
            k = torch.cat([state["k"], k], dim=2)
            v = torch.cat([state["v"], v], dim=2)
        state["k"], state["v"] = k, v
    return k, v


class MetricQuery(torch.autograd.Function):
    """Eq. 5 for per-token metrics: q_t = x_t m_t, x (B, T, H, dh) and m (B, T, H, dh, dh) of one
    dtype -> (B, T, H, dh). The backward is the one autograd derives for the batched matmul, but
    writes dm_t = x_t^T dq_t, an outer product per position and head, as a broadcast multiply.
    With a shared m (share=True) every layer adds such a dm, as large as m, to m's gradient.
    Elementwise, torch.compile fuses the L products into their sum and stores none of them; as
    matmul outputs (inductor of torch 2.11; 2.13 rewrites the product itself) they stayed alive
    together until the sum: 9,630 MiB peak instead of eager's 5,644 on an H200 (results/gpu/).
    Eager keeps its speed."""

    @staticmethod
    def forward(ctx, x, m):
        ctx.save_for_backward(x, m)
        return (x.unsqueeze(-2) @ m).squeeze(-2)

    @staticmethod
    def backward(ctx, dq):
        x, m = ctx.saved_tensors
        dx = (dq.unsqueeze(-2) @ m.transpose(-1, -2)).squeeze(-2)    # dq m^T
        dm = x.unsqueeze(-1) * dq.unsqueeze(-2)                      # x^T dq
        return dx, dm


class CausalSelfAttention(nn.Module):
    """DAMCHA attention (Eqs. 3-8), or with attn="mha" standard multi-head attention. With
    qk="proj" DAMCHA's metric acts on MHA's projections: x_i below is (u W_q^T)_i for the query
    and (u W_k^T)_i for the key, from MHA's c_attn, which also gives v."""

    def __init__(self, config):
        super().__init__()
        D = config.n_embd
        if config.attn == "damcha" and config.qk == "slice":
            self.c_v = nn.Linear(D, D, bias=config.bias)             # Eq. 7: the value projection
        else:
            self.c_attn = nn.Linear(D, 3 * D, bias=config.bias)      # rows [q; k; v]
        if config.attn == "damcha" and not config.share:
            add_metric(self, config)
        self.c_proj = nn.Linear(D, D, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def forward(self, u, m=None, state=None):
        """u (B, T, D), the normalised layer input. m: the stack's shared metrics, or None when
        this layer owns its generator or static metric (or attn="mha"). state: this layer's
        decoding cache, or None. Returns y (B, T, D)."""
        B, T, D = u.size()
        H = self.config.n_head
        dh = D // H
        if self.config.attn == "mha":
            q, k, v = (a.view(B, T, H, dh).transpose(1, 2) for a in self.c_attn(u).split(D, dim=2))
        else:
            if m is None:
                m = compute_metric(self, u, self.config, state)      # Eqs. 3-4: (B, T, H, dh, dh), static (H, dh, dh)
            if self.config.qk == "slice":
                x = xk = u.view(B, T, H, dh)                         # head slices x_i: no q/k projections
                v = self.c_v(u).view(B, T, H, dh).transpose(1, 2)    # Eq. 7, (B, H, T, dh)
            else:                                                    # projected: x_i = (u W_q^T)_i, keys (u W_k^T)_i
                x, xk, v = (a.view(B, T, H, dh) for a in self.c_attn(u).split(D, dim=2))
                v = v.transpose(1, 2)                                # (B, H, T, dh)
            # The kernel is for per-token metrics. A static m gives q = x m as one small matmul, and
            # then SDPA's flash attention is twice the fused kernel's speed (bf16, H200); decoding
            # (state) keeps the torch path too
            if self.config.kernel == "triton" and state is None and m.dim() == 5:
                from damcha_triton import damcha_attention           # imports triton only when asked
                # Eqs. 5-7 in one kernel: each query q_i = x_i m_i is formed on chip from its tile of m,
                # and the (B, H, T, T) scores never reach memory
                y = damcha_attention(x.transpose(1, 2), m, v)                              # (B, H, T, dh)
                return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, D)))   # Eq. 8
            # Eq. 5: q_i = x_i m_i, a (1 x dh)(dh x dh) product per head and position, m (B, T, H, dh, dh),
            # or per head for a static m (H, dh, dh). Per-token m goes through MetricQuery (a batched
            # matmul: 10% faster for a whole CPU training step than the einsum it equals), for the
            # memory of the compiled backward; x takes m's dtype, as autocast's matmul would cast it.
            # A static m is one matmul per head, so that its gradient sums x^T dq over the positions
            # inside the matmul: a broadcast matmul would first form it per position (B, T, H, dh, dh)
            q = (MetricQuery.apply(x.to(m.dtype), m) if m.dim() == 5
                 else torch.einsum("bthd,hde->bthe", x, m))
            q = q.transpose(1, 2)                                    # (B, H, T, dh)
            k = xk.transpose(1, 2)                                   # slice: the keys are the x_i themselves; proj: (u W_k^T)_i
        k, v = extend_cache(state, k, v)                             # (B, H, t + T, dh): the cached keys, then these
        # Eqs. 5-7: softmax(q k^T / sqrt(dh)) v over s <= t. With a cache the T new queries are the
        # last positions, so causal masking is only needed when there is no earlier token;
        # GPT.forward feeds a single token once the cache holds any.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.config.attn_dropout if self.training else 0.0,
                                           is_causal=q.size(2) == k.size(2))                    # (B, H, T, dh)
        y = y.transpose(1, 2).reshape(B, T, D)                       # Eq. 8: concat(O_0 .. O_{H-1})
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        D = config.n_embd
        hidden = config.mlp_hidden or 4 * D
        self.c_fc = nn.Linear(D, hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, D, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.attn in ("tha", "dcmha"):
            from lab.baselines import ComposedAttention                  # the baselines' own module
            self.attn = ComposedAttention(config)
        else:
            self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, m=None, state=None):
        """x (B, T, D) -> (B, T, D). m: the stack's shared metrics, state: the decoding cache."""
        x = x + self.attn(self.ln_1(x), m, state)                    # attention sees u = ln_1(x)
        return x + self.mlp(self.ln_2(x))


def init_weights(model, n_layer):
    """nanoGPT's initialisation, as damcha_numpy.init_params: N(0, 0.02) for every Linear and
    Embedding weight, the generator and the static metric; zero biases; the residual projections
    c_proj N(0, 0.02 / sqrt(2 n_layer)). The baselines' extras (baselines.py): THA's mixes stay
    zero as built, DCMHA's dyn_proj is N(0, 0.02) and its gates dyn_gate zero (tanh(0) = 0: the
    compositions start near the identity, i.e. near MHA, and every weight has a gradient).
    metric_init="identity" then sets every static metric, or every generator's last bias, to
    identity_metric: each m_i starts at I, plus the generator's N(0, 0.02) noise."""
    if any(p.is_meta for p in model.parameters()):
        # count_params builds on the meta device, where a tensor has a shape but no values: there
        # is nothing to initialise, and torch's meta init functions took 49 of count_params's 57 ms
        return
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        elif name.endswith(("metric", "dyn_proj")):
            nn.init.normal_(p, mean=0.0, std=0.02)
        elif name.endswith("dyn_gate.weight"):
            nn.init.zeros_(p)
    config = model.config
    if config.attn == "damcha" and config.metric_init == "identity":
        last = f"gen.{config.gen_depth - 1}.bias"
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("metric") or name.endswith(last):
                    p.copy_(identity_metric(config).reshape(p.shape))


def configure_optimizers(model, weight_decay, learning_rate, betas, device_type):
    """AdamW with weight decay for every tensor with >= 2 dims (weights, embeddings, static
    metrics), none for biases and LayerNorm gains; fused on CUDA. Every PyTorch training loop
    here uses it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if device_type == "cuda" else {}))


# Dense peak FLOP/s of one H100 / H200 SXM (the same Hopper tensor cores): 16-bit, TF32 (the
# float32 matmuls when TF32 is allowed), and IEEE float32 on the CUDA cores
PEAK_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 66.9e12}


def shares_metric(config):
    """Section 3.4: one generator (or static metric) for the whole stack, owned by the model."""
    return config.attn == "damcha" and config.share


def stack_forward(owner, x, cache=None):
    """owner.h, the stack of Blocks, on x (B, T, D) -> (B, T, D). A shared generator (owner.gen)
    runs once here, on layer 0's attention input u; that LayerNorm is recomputed inside the
    block, which is cheap next to the generator. GPT and synthetic.py's SetModel both use it."""
    config, m = owner.config, None
    if shares_metric(config):
        m = compute_metric(owner, owner.h[0].ln_1(x), config, None if cache is None else cache["shared"])
    for l, block in enumerate(owner.h):
        x = block(x, m, None if cache is None else cache["layers"][l])
    return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        if shares_metric(config):
            add_metric(self, config)
        init_weights(self, config.n_layer)

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
        x = stack_forward(self, x, cache)
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
        """nanoGPT's method: configure_optimizers(self, ...) above."""
        return configure_optimizers(self, weight_decay, learning_rate, betas, device_type)

    def flops_per_token(self):
        """Training FLOPs per token at context block_size: 6 per multiply-add of the forward pass
        (2 forward, 4 backward), counting the matmuls as nanoGPT does (PaLM, appendix B), plus
        the metric generator and the metric application q_i = x_i m_i (Eq. 5), or the baselines'
        head mixing. Attention is causal: a query at t meets t + 1 keys, T / 2 on average, so the
        per-pair terms count half of the full T x T. gen_out="full" runs folded
        (MetricGenerator.forward), so both outputs count the generator's last layer as
        w*H*dh*dh per token; folding the weights (D*D*w adds per pass) is left out."""
        cfg = self.config
        D, L, T, H = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.n_head
        dh = D // H
        attention = T * D                                            # q k^T and A v: 2 D per key, T / 2 keys
        if cfg.attn == "damcha":
            per_layer = (2 if cfg.qk == "slice" else 4) * D * D + D * dh + attention   # c_v or c_attn, c_proj, Eq. 5
        else:
            per_layer = 4 * D * D + attention                        # c_attn, c_proj
        if cfg.attn in ("tha", "dcmha"):
            from lab.baselines import mixing_macs
            per_layer += mixing_macs(cfg)
        per_layer += 2 * D * (cfg.mlp_hidden or 4 * D)               # mlp
        generator = 0
        if cfg.attn == "damcha" and cfg.adaptive:
            sizes = generator_sizes(cfg, D * dh)                     # the last layer as it runs: folded
            generator = sum(a * b for a, b in zip(sizes, sizes[1:])) * (1 if cfg.share else L)
        return 6 * (L * per_layer + generator + D * cfg.vocab_size)  # + tied lm_head

    def estimate_mfu(self, fwdbwd_per_iter, dt, dtype="bfloat16", peak_flops=None):
        """Model FLOPs utilisation: flops_per_token() * block_size * fwdbwd_per_iter FLOPs in dt
        seconds, against peak_flops, or by default the peak of one H100 / H200 SXM GPU for the
        dtype the matmuls run in (PEAK_FLOPS): "bfloat16" or "float16" 989e12 FLOP/s dense,
        "tf32" 494.5e12 (float32 with TF32 allowed), "float32" 66.9e12 (IEEE). A torch.dtype
        is accepted: torch.float32 counts as "tf32" when CUDA's float32 matmuls may use TF32."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
            if dtype == "float32" and tf32_matmuls():
                dtype = "tf32"
        flops_per_iter = self.flops_per_token() * self.config.block_size * fwdbwd_per_iter
        return flops_per_iter / dt / (peak_flops or PEAK_FLOPS[dtype])

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
            # from the largest logit: near temperature 0 the others go to -inf (never inf - inf),
            # leaving the most likely token; below 1e-30, which float32 rounds to 0, that holds already
            logits = logits[:, -1, :]
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, 1e-30)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


# ----------------------------------------------------------------------------------------------
# Parameter counts and the learning-rate schedule, for the scripts

def count_params(fields):
    """GPT.get_num_params of GPTConfig(**fields), built on the meta device: no memory, no time."""
    with torch.device("meta"):
        return GPT(GPTConfig(**fields)).get_num_params()


def equal_params_width(target, fields, field="gen_width"):
    """The width w at which GPTConfig(**fields, <field>=w) has the parameter count nearest to
    target: field "gen_width", the generator's hidden width (a DAMCHA with a generator), or
    "mlp_hidden", the MLP's (any model). The count grows with w, so bisect."""
    count = lambda w: count_params(dict(fields, **{field: w}))
    lo, hi = 1, 2
    while count(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 2**20:
            raise ValueError(f"no {'generator width' if field == 'gen_width' else 'MLP width'} reaches {target:,} parameters")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    return min((lo, hi), key=lambda w: abs(count(w) - target))


def tf32_matmuls():
    """Whether CUDA's float32 matmuls may run in TF32 (torch.set_float32_matmul_precision("high")).
    torch >= 2.9 says so through fp32_precision, where "none" defers to the setting for all
    backends, and reading the legacy allow_tf32 raises once fp32_precision has been set."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return matmul.allow_tf32
    precision = matmul.fp32_precision
    return (torch.backends.fp32_precision if precision == "none" else precision) == "tf32"


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """The learning rate of iteration it: linear warm-up over warmup_iters, cosine decay to min_lr
    at lr_decay_iters, then min_lr (nanoGPT's schedule; every PyTorch training loop here uses it)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)
