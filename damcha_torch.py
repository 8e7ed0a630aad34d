"""
damcha_torch.py: the DAMCHA GPT in PyTorch, in the shape of nanoGPT's model.py.

DAMCHA (arXiv 2610.13261) drops the query and key projections of multi-head attention. A small
MLP, the metric generator f, reads the causal prefix mean c of every position and outputs a
D x D cross-head metric M(c); head i compares its own slice x_i of the layer input with itself
through m_i = sum_j M_ij (RowSum). docs/model.md states the model; damcha_numpy.py is its NumPy
reference with the same parameter names (tests/test_model.py checks logits, loss and every
gradient against it in float64). attn="mha" is the baseline. What this file adds is speed: RowSum
applied to the generator's weights (M is never built), SDPA or damcha_triton.py's fused kernel,
and a shared generator run once per pass.

    from damcha_torch import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=256))
    logits, loss = model(idx, targets)            # idx, targets (B, T) int64

GPT's one extension point is its `attention`: the class of every block's attention (see GPT).
"""
import dataclasses
import math

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 80     # V, the number of distinct tokens
    block_size: int = 64     # T, the longest context
    n_layer: int = 2         # L, transformer blocks
    n_head: int = 4          # H, heads: each owns a slice of dh = D / H coordinates
    n_embd: int = 64         # D, the width of the residual stream
    attn: str = "damcha"     # "damcha" | "mha" (the baseline); another name with GPT's attention
    adaptive: bool = True    # False: M (or m, when folded) is a learned constant, the ablation
                             # "without f(x)"
    share: bool = True       # one generator for the whole stack (Section 3.4)
    blocks: str = "all"      # which blocks RowSum adds: "all" | "diag" (M_ii) | "offdiag" (j != i)
    gen_out: str = "full"    # "full": f outputs M (D*D numbers); "folded": f outputs m (H*dh*dh)
    gen_depth: int = 2       # P, the number of linear layers in f
    gen_width: int = 64      # w, the hidden width of f
    bias: bool = True        # biases in the Linear layers and LayerNorms
    dropout: float = 0.0     # embedding, residual and MLP dropout while training (NumPy: 0 only)
    attn_dropout: float = 0.0   # dropout of the attention probabilities (NumPy, triton: 0 only)
    kernel: str = "torch"    # DAMCHA attention: "torch" (Eq. 5 product + SDPA) | "triton"
                             # (damcha_triton.py, fused)
    # Two choices of the model the paper leaves open: how the metric starts (identity: every
    # head begins as dot-product attention on its own slice), and the MLP's width, which trades
    # parameters between models compared at equal size (the 2x2 study uses both).
    metric_init: str = "normal"  # "normal": N(0, 0.02) as every weight; "identity": m_i = I
    mlp_hidden: int = 0      # the MLP's hidden width; 0: 4 * n_embd

    def __post_init__(self):
        sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "gen_depth",
                 "gen_width")
        choices = dict(blocks=("all", "diag", "offdiag"), gen_out=("full", "folded"),
                       kernel=("torch", "triton"), metric_init=("normal", "identity"))
        checks = [(getattr(self, k) >= 1, f"{k} must be at least 1, not {getattr(self, k)}")
                  for k in sizes]
        checks += [(getattr(self, k) in allowed, f"{k} must be one of "
                    f"{', '.join(map(repr, allowed))}, not {getattr(self, k)!r}")
                   for k, allowed in choices.items()]
        checks += [
            (self.n_head and self.n_embd % self.n_head == 0,   # (n_head = 0: refused above)
             f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.gen_out == "full" or self.blocks == "all",
             "blocks other than 'all' need gen_out='full'"),
            (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), not {self.dropout}"),
            (0.0 <= self.attn_dropout < 1.0,
             f"attn_dropout must be in [0, 1), not {self.attn_dropout}"),
            (self.mlp_hidden >= 0,
             f"mlp_hidden must be at least 0 (0: 4 * n_embd), not {self.mlp_hidden}"),
            (self.kernel == "torch" or self.attn == "damcha",
             "kernel='triton' is for attn='damcha' only"),
            (self.kernel == "torch" or self.attn_dropout == 0, "kernel='triton' has no "
             "attention-probability dropout: use attn_dropout=0 (dropout is fine)"),
            (self.metric_init == "normal" or self.bias or not self.adaptive,
             "metric_init='identity' sets the generator's last bias: it needs bias=True")]
        message = next((message for ok, message in checks if not ok), None)
        if message:
            raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# The cross-head metric (Eqs. 3-4)

def rowsum(M, config):
    """Eq. 4, RowSum m_i = sum_j M_ij over the blocks config.blocks keeps. M holds Eq. 3's D x D
    metric row-major, k numbers an entry: the generator's last weight (D*D, k), its bias (D*D,)
    or a static metric (D, D). Returns (H, dh, dh, k), k = 1 for a bias or a static metric."""
    H = config.n_head
    dh = config.n_embd // H
    M = M.reshape(H, dh, H, dh, -1)                                  # (i, a, j, b, k)
    if config.blocks == "all":
        return M.sum(dim=2)
    diag = torch.diagonal(M, dim1=0, dim2=2).permute(3, 0, 1, 2)     # (H, dh, dh, k): M_ii
    return diag if config.blocks == "diag" else M.sum(dim=2) - diag


def prefix_mean(z):
    """Eq. 3's causal context: c[b, t] = mean of z[b, s] over s <= t. z (B, T, D) -> c (B, T, D)."""
    count = torch.arange(1, z.size(1) + 1, device=z.device, dtype=z.dtype)
    return torch.cumsum(z, dim=1) / count.view(1, -1, 1)


class Generator(nn.ModuleList):
    """The metric generator f of Eq. 3, with RowSum (Eq. 4): the attention input u (B, T, D) ->
    the metrics m (B, T, H, dh, dh), computed from u's prefix mean c. P linear layers D -> w ->
    ... -> w -> D*D (gen_out="full": M) or H*dh*dh ("folded": m), GELU between them; its keys are
    gen.{p}.weight and gen.{p}.bias. The GPT owns it when shared, each attention otherwise."""

    def __init__(self, config):
        D, H = config.n_embd, config.n_head
        out = D * D if config.gen_out == "full" else H * (D // H) ** 2
        sizes = [D] + [config.gen_width] * (config.gen_depth - 1) + [out]
        super().__init__(nn.Linear(n_in, n_out, bias=config.bias)
                         for n_in, n_out in zip(sizes, sizes[1:]))
        self.config = config

    def forward(self, u):
        H = self.config.n_head
        dh = self.config.n_embd // H
        *hidden, last = self
        h = prefix_mean(u)                                           # the context c (B, T, D)
        for layer in hidden:
            h = F.gelu(layer(h), approximate="tanh")                 # (B, T, w)
        weight, bias = last.weight, last.bias
        if self.config.gen_out == "full":
            # RowSum is linear, so it commutes with the last affine layer: summing its (D*D, w)
            # weight over the blocks j gives an (H*dh*dh, w) layer with the same outputs. M
            # (B, T, D, D) is never built, and autograd sends the exact gradient to every entry
            # of the full weight.
            weight = rowsum(weight, self.config).reshape(H * dh * dh, -1)
            bias = None if bias is None else rowsum(bias, self.config).reshape(H * dh * dh)
        return F.linear(h, weight, bias).unflatten(-1, (H, dh, dh))    # (B, T, H, dh, dh)


def static_metric(config):
    """The ablation "without f(x)" (adaptive=False): a learned M (D, D) in f's place, or m
    (H, dh, dh) when folded; its key is `metric`."""
    D, H = config.n_embd, config.n_head
    return nn.Parameter(torch.empty((D, D) if config.gen_out == "full" else (H, D // H, D // H)))


def static_metrics(metric, config):
    """Eq. 4 on a static metric: M (D, D) -> m (H, dh, dh); a folded one is m already."""
    if config.gen_out == "folded":
        return metric
    H = config.n_head
    dh = config.n_embd // H
    return rowsum(metric, config).reshape(H, dh, dh)


def init_residual(linear, config):
    """nanoGPT's start for a projection onto the residual stream: N(0, 0.02 / sqrt(2 n_layer))."""
    nn.init.normal_(linear.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))


# ----------------------------------------------------------------------------------------------
# Attention (Eqs. 5-8): the two classes GPT builds h.{l}.attn from (GPT's docstring says what
# another class it is given must do)

class MetricQuery(torch.autograd.Function):
    """Eq. 5 for per-token metrics, q_t = x_t m_t: x (B, T, H, dh), m (B, T, H, dh, dh) ->
    (B, T, H, dh). The backward writes dm_t = x_t^T dq_t as a broadcast multiply rather than a
    matmul: with a shared m, torch.compile can then fuse the L layers' dm into their sum without
    storing each."""

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
    """Multi-head attention, attn="mha": nanoGPT's, with queries, keys and values from c_attn."""

    def __init__(self, config):
        super().__init__()
        D = config.n_embd
        self.c_attn = nn.Linear(D, 3 * D, bias=config.bias)          # rows [q; k; v]
        self.c_proj = nn.Linear(D, D, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def forward(self, u, m=None):
        """u (B, T, D), the normalised layer input; m unused (DAMCHA's metrics). -> (B, T, D)"""
        B, T, D = u.size()
        H = self.config.n_head
        q, k, v = (a.view(B, T, H, D // H).transpose(1, 2) for a in self.c_attn(u).split(D, dim=2))
        p = self.config.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)   # (B, H, T, dh)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, D)))  # Eq. 8

    def init_weights(self):
        """Its start after init_weights' N(0, 0.02) for every Linear: c_proj as a residual's."""
        init_residual(self.c_proj, self.config)


class DamchaAttention(nn.Module):
    """DAMCHA attention, Eqs. 3-8: head i's query is q_i = x_i m_i and its key x_i itself, x_i
    its slice of the layer input u; its value comes from c_v (Eq. 7). The metrics m come from the
    stack's shared generator, or from this layer's own (gen) or static metric (metric)."""

    def __init__(self, config):
        super().__init__()
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)   # Eq. 7: the values
        self.add_own_metric(config)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def add_own_metric(self, config):
        """This layer's own generator (Eq. 3) or static metric, unless the stack shares one."""
        if not config.share:
            if config.adaptive:
                self.gen = Generator(config)
            else:
                self.metric = static_metric(config)

    def forward(self, u, m=None):
        """u (B, T, D), the normalised layer input; m: the stack's shared metrics, or None when
        this layer owns its generator or static metric. -> (B, T, D)"""
        if m is None:
            m = self.own_metrics(u)
        B, T, D = u.size()
        H = self.config.n_head
        x = u.view(B, T, H, D // H)                                  # head slices x_i (B, T, H, dh)
        return self.attend(x, x, self.c_v(u).view_as(x), m)           # the keys are x itself

    def own_metrics(self, u):
        """Eqs. 3-4 from this layer's own generator, u (B, T, D) -> m (B, T, H, dh, dh); or its
        static metric, m (H, dh, dh)."""
        return self.gen(u) if self.config.adaptive else static_metrics(self.metric, self.config)

    def attend(self, x, k, v, m):
        """Eqs. 5-8 from the query inputs x, keys k and values v, each (B, T, H, dh), and the
        metrics m (B, T, H, dh, dh), or static (H, dh, dh): q_i = x_i m_i, then softmax(q k^T /
        sqrt(dh)) v over s <= t, then concat(O_0 .. O_{H-1}) W_o. -> (B, T, D)"""
        B, T, H, dh = x.size()
        if self.config.kernel == "triton" and m.dim() == 5:
            # The fused kernel forms q = x m on chip and never stores the scores; its keys are x
            # (GPTConfig allows it for attn="damcha" only). For a static m, q is one small matmul
            # and SDPA's flash attention is the faster path.
            from damcha_triton import damcha_attention               # imports triton when asked
            y = damcha_attention(x.transpose(1, 2), m, v.transpose(1, 2))   # (B, H, T, dh)
        else:
            # Eq. 5: x in m's dtype, as autocast's matmul would; a static m (H, dh, dh) is one
            # matmul per head, which sums the gradient x^T dq over positions inside the matmul.
            q = (MetricQuery.apply(x.to(m.dtype), m) if m.dim() == 5
                 else torch.einsum("bthd,hde->bthe", x, m))
            p = self.config.attn_dropout if self.training else 0.0
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, H, T, dh)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)   # Eqs. 5-7
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, H * dh)))   # Eq. 8

    def init_weights(self):
        """Its start after init_weights' N(0, 0.02) for every Linear: its own static metric
        N(0, 0.02), if it has one; c_proj as a residual's."""
        if not self.config.share and not self.config.adaptive:
            nn.init.normal_(self.metric, mean=0.0, std=0.02)
        init_residual(self.c_proj, self.config)


# ----------------------------------------------------------------------------------------------
# The transformer

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

    def __init__(self, config, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, m=None):
        """x (B, T, D) -> (B, T, D); m: the stack's shared metrics, if any."""
        x = x + self.attn(self.ln_1(x), m)                           # attention sees u = ln_1(x)
        return x + self.mlp(self.ln_2(x))


def init_weights(model):
    """nanoGPT's initialisation, as damcha_numpy.init_params, of a GPT (or of another stack of
    Blocks, model.h): N(0, 0.02) for every Linear and Embedding weight, zero biases; then the
    stack's static metric N(0, 0.02), and block by block the attention's own start (its
    init_weights: its static metric N(0, 0.02), the residual projection c_proj N(0, 0.02 /
    sqrt(2 L))) and the MLP's c_proj. The draws follow the order of the parameters: a seed gives
    one model. metric_init="identity" then sets every static metric, or every generator's last
    bias, so that every m_i is I."""
    config = model.config
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    own = dict(model.named_parameters(recurse=False))
    if "metric" in own:
        nn.init.normal_(own["metric"], mean=0.0, std=0.02)
    for block in model.h:
        block.attn.init_weights()
        init_residual(block.mlp.c_proj, config)
    if config.metric_init == "identity":   # M_ii = I, M_ij = 0 (RowSum: 0 with blocks="offdiag")
        D, H = config.n_embd, config.n_head
        eye = torch.eye(D) if config.gen_out == "full" else torch.eye(D // H).expand(H, -1, -1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("metric", f"gen.{config.gen_depth - 1}.bias")):
                    p.copy_(eye.reshape(p.shape))


def configure_optimizers(model, weight_decay, learning_rate, betas, device_type):
    """AdamW, weight decay on every tensor with >= 2 dims (weights, embeddings, static metrics),
    none on biases and LayerNorm gains; fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **fused)


PEAK_FLOPS = 989e12   # dense bfloat16 FLOP/s of one H100 / H200 SXM GPU: estimate_mfu's yardstick


class GPT(nn.Module):
    """The GPT of docs/model.md, nanoGPT's with DAMCHA attention.

    attention, the model's one extension point: the class of every block's attention h.{l}.attn
    (the lab's come in here, lab/variants.py); None: the book's, DamchaAttention or
    CausalSelfAttention as config.attn says ("damcha" or "mha"). Given a class, config.attn only
    names it. The class is built as attention(config); attn(u, m) maps the normalised layer
    input u (B, T, D) and the stack's shared metrics m (or None) to (B, T, D); attn.init_weights()
    sets its start once init_weights has drawn every Linear weight N(0, 0.02) (at least its
    residual projection, init_residual). A subclass of DamchaAttention shares the stack's metric
    when config.share."""

    def __init__(self, config, attention=None):
        super().__init__()
        if attention is None:
            if config.attn not in ("damcha", "mha"):
                raise ValueError(f"attn must be 'damcha' or 'mha', not {config.attn!r} "
                                 f"(another attention: GPT(config, attention=its class))")
            attention = DamchaAttention if config.attn == "damcha" else CausalSelfAttention
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config, attention) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # Section 3.4: one generator (or static metric) for the whole stack, run once per pass
        self.shares_metric = config.share and issubclass(attention, DamchaAttention)
        if self.shares_metric and config.adaptive:
            self.gen = Generator(config)
        elif self.shares_metric:
            self.metric = static_metric(config)
        init_weights(self)

    def get_num_params(self, non_embedding=True):
        """Without the position embeddings by default, as nanoGPT; wte stays: it is also the
        lm_head."""
        n_params = sum(p.numel() for p in self.parameters())
        return n_params - self.wpe.weight.numel() if non_embedding else n_params

    def forward(self, idx, targets=None):
        """idx (B, T) int64 -> (logits (B, T, V), mean cross-entropy or None)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))                 # (B, T, D)
        m = None
        if self.shares_metric and self.config.adaptive:
            # on layer 0's attention input u (that LayerNorm is recomputed in the block: cheap)
            m = self.gen(self.h[0].ln_1(x))                          # (B, T, H, dh, dh)
        elif self.shares_metric:
            m = static_metrics(self.metric, self.config)            # (H, dh, dh)
        for block in self.h:
            x = block(x, m)
        logits = F.linear(self.ln_f(x), self.wte.weight)             # lm_head tied to wte (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return configure_optimizers(self, weight_decay, learning_rate, betas, device_type)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilisation of fwdbwd_per_iter sequences in dt seconds against PEAK_FLOPS, as
        nanoGPT (PaLM, appendix B): 6 FLOPs per parameter and token plus 12 L T D for attention.
        A parameter counts once a token, so gen_out="full" (its last layer runs folded) reads
        high."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        return flops_per_token * T * fwdbwd_per_iter / dt / PEAK_FLOPS

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, t), each conditioned on the last
        block_size."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            # less the largest logit: near temperature 0 the others go to -inf (never inf - inf)
            logits = logits[:, -1, :]
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, 1e-30)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx

