"""
damcha_torch.py: the DAMCHA GPT in PyTorch, in the shape of nanoGPT's model.py.

DAMCHA (arXiv 2610.13261) drops the query and key projections of multi-head attention. A small
MLP, the metric generator f, reads the causal prefix mean c of every position and outputs a
D x D cross-head metric M(c); head i compares its own slice x_i of the layer input with itself
through m_i = sum_j M_ij (RowSum). docs/model.md states the model; damcha_numpy.py is its NumPy
reference with the same parameter names (tests/test_torch.py checks logits, loss and every
gradient against it in float64). attn="mha" is the baseline. What this file adds is speed: RowSum
applied to the generator's weights (M is never built), SDPA or damcha_triton.py's fused kernel,
and a shared generator run once per pass.

    from damcha_torch import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=256))
    logits, loss = model(idx, targets)            # idx, targets (B, T) int64
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
    attn: str = "damcha"     # "damcha" | "mha" (the baseline): a name in ATTENTION
    adaptive: bool = True    # False: M (or m, when folded) is a learned constant, the ablation "without f(x)"
    share: bool = True       # one generator for the whole stack (Section 3.4)
    blocks: str = "all"      # which blocks RowSum adds: "all" | "diag" (M_ii) | "offdiag" (j != i)
    gen_out: str = "full"    # "full": f outputs M (D*D numbers); "folded": f outputs m (H*dh*dh)
    gen_depth: int = 2       # P, the number of linear layers in f
    gen_width: int = 64      # w, the hidden width of f
    bias: bool = True        # biases in the Linear layers and LayerNorms
    dropout: float = 0.0     # embedding, residual and MLP dropout while training (NumPy: 0 only)
    attn_dropout: float = 0.0   # dropout of the attention probabilities (NumPy, kernel="triton": 0 only)
    kernel: str = "torch"    # DAMCHA attention: "torch" (Eq. 5 product + SDPA) | "triton" (damcha_triton.py, fused)
    metric_init: str = "normal"  # "normal": N(0, 0.02) as every weight; "identity": every m_i starts at I
    mlp_hidden: int = 0      # the MLP's hidden width; 0: 4 * n_embd

    def __post_init__(self):
        choices = dict(attn=tuple(ATTENTION), blocks=("all", "diag", "offdiag"), gen_out=("full", "folded"),
                       kernel=("torch", "triton"), metric_init=("normal", "identity"))
        checks = [(getattr(self, k) >= 1, f"{k} must be at least 1, not {getattr(self, k)}") for k in
                  ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "gen_depth", "gen_width")]
        checks += [(getattr(self, k) in allowed, f"{k} must be one of {', '.join(map(repr, allowed))}, "
                    f"not {getattr(self, k)!r}") for k, allowed in choices.items()]
        checks += [
            (self.n_head and self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.gen_out == "full" or self.blocks == "all", "blocks other than 'all' need gen_out='full'"),
            (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), not {self.dropout}"),
            (0.0 <= self.attn_dropout < 1.0, f"attn_dropout must be in [0, 1), not {self.attn_dropout}"),
            (self.mlp_hidden >= 0, f"mlp_hidden must be at least 0 (0: 4 * n_embd), not {self.mlp_hidden}"),
            (self.kernel == "torch" or self.attn == "damcha", "kernel='triton' is for attn='damcha' only"),
            (self.kernel == "torch" or self.attn_dropout == 0,
             "kernel='triton' has no attention-probability dropout: use attn_dropout=0 (dropout is fine)"),
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


def add_metric(owner, config):
    """Give `owner` (the GPT when shared, else a layer's attention) the generator f of Eq. 3, keys
    gen.{p}.weight and gen.{p}.bias: P linear layers D -> w -> ... -> w -> D*D (full) or H*dh*dh
    (folded); or with adaptive=False a static metric, key `metric`."""
    D, H = config.n_embd, config.n_head
    dh = D // H
    if config.adaptive:
        sizes = [D] + [config.gen_width] * (config.gen_depth - 1) + [D * D if config.gen_out == "full" else H * dh * dh]
        owner.gen = nn.ModuleList(nn.Linear(n_in, n_out, bias=config.bias) for n_in, n_out in zip(sizes, sizes[1:]))
    else:
        owner.metric = nn.Parameter(torch.empty((D, D) if config.gen_out == "full" else (H, dh, dh)))


def generator_forward(gen, c, config):
    """f of Eq. 3 with Eq. 4: the context c (B, T, D) -> m (B, T, H, dh, dh), GELU between the layers."""
    *hidden, last = gen
    h = c
    for layer in hidden:
        h = F.gelu(layer(h), approximate="tanh")                     # (B, T, w)
    weight, bias = last.weight, last.bias
    H, D = config.n_head, config.n_embd
    dh = D // H
    if config.gen_out == "full":
        # RowSum is linear, so it commutes with the last affine layer: summing its (D*D, w) weight
        # over the blocks j gives an (H*dh*dh, w) layer with the same outputs. M (B, T, D, D) is
        # never built, and autograd sends the exact gradient to every entry of the full weight.
        weight = rowsum(weight, config).reshape(H * dh * dh, -1)
        bias = None if bias is None else rowsum(bias, config).reshape(H * dh * dh)
    return F.linear(h, weight, bias).unflatten(-1, (H, dh, dh))     # (B, T, H, dh, dh)


def compute_metric(owner, z, config):
    """The metrics m of `owner`'s generator fed with z (B, T, D), the attention input u of the
    layer that owns it: (B, T, H, dh, dh), or (H, dh, dh) for a static metric."""
    if config.adaptive:
        return generator_forward(owner.gen, prefix_mean(z), config)   # Eqs. 3-4 on the context c
    H = config.n_head
    dh = config.n_embd // H
    if config.gen_out == "full":
        return rowsum(owner.metric, config).reshape(H, dh, dh)
    return owner.metric


# ----------------------------------------------------------------------------------------------
# Attention (Eqs. 5-8)

class MetricQuery(torch.autograd.Function):
    """Eq. 5 for per-token metrics, q_t = x_t m_t: x (B, T, H, dh), m (B, T, H, dh, dh) -> (B, T, H, dh).
    The backward writes dm_t = x_t^T dq_t as a broadcast multiply rather than a matmul: with a shared
    m, torch.compile can then fuse the L layers' dm into their sum without storing each."""

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


class Attention(nn.Module):
    """What the attentions below share: Eqs. 5-8 from the queries, keys and values on."""

    def attend(self, q, k, v):
        """Eqs. 5-7, softmax(q k^T / sqrt(dh)) v over s <= t, then Eq. 8: q, k, v (B, H, T, dh) -> (B, T, D)."""
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.config.attn_dropout if self.training else 0.0,
                                           is_causal=True)                                      # (B, H, T, dh)
        return self.project(y)

    def project(self, y):
        """Eq. 8: concat(O_0 .. O_{H-1}) W_o, y (B, H, T, dh) -> (B, T, D)."""
        B, H, T, dh = y.size()
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, H * dh)))


class CausalSelfAttention(Attention):
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
        return self.attend(q, k, v)


class DamchaAttention(Attention):
    """DAMCHA attention, Eqs. 3-8: head i's query is q_i = x_i m_i and its key x_i itself, x_i its
    slice of the layer input u; its value comes from c_v (Eq. 7). A subclass may form the query
    inputs and keys otherwise (add_projections, heads)."""

    def __init__(self, config):
        super().__init__()
        self.add_projections(config)
        if not config.share:
            add_metric(self, config)                                 # this layer's own generator or static metric
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def add_projections(self, config):
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)   # Eq. 7: the value projection

    def heads(self, u):
        """u (B, T, D) -> the query inputs x_i, the keys and the values, each (B, T, H, dh)."""
        B, T, D = u.size()
        x = u.view(B, T, self.config.n_head, D // self.config.n_head)   # head slices x_i: the keys themselves
        return x, x, self.c_v(u).view_as(x)

    def forward(self, u, m=None):
        """u (B, T, D), the normalised layer input; m: the stack's shared metrics, or None when this
        layer owns its generator or static metric. -> (B, T, D)"""
        if m is None:
            m = compute_metric(self, u, self.config)          # Eqs. 3-4: (B, T, H, dh, dh), static (H, dh, dh)
        x, k, v = self.heads(u)                                      # (B, T, H, dh) each
        # The fused kernel forms q = x m on chip and never stores the scores; for a static m,
        # q is one small matmul and SDPA's flash attention is the faster path.
        if self.config.kernel == "triton" and m.dim() == 5:
            from damcha_triton import damcha_attention               # imports triton only when asked
            return self.project(damcha_attention(x.transpose(1, 2), m, v.transpose(1, 2)))   # Eqs. 5-8
        # Eq. 5: q_i = x_i m_i (x in m's dtype, as autocast's matmul would); a static m (H, dh, dh)
        # is one matmul per head, which sums the gradient x^T dq over positions inside the matmul.
        q = (MetricQuery.apply(x.to(m.dtype), m) if m.dim() == 5
             else torch.einsum("bthd,hde->bthe", x, m))
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


ATTENTION = {"damcha": DamchaAttention, "mha": CausalSelfAttention}   # GPTConfig.attn -> the module of h.{l}.attn


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

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = ATTENTION[config.attn](config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, m=None):
        """x (B, T, D) -> (B, T, D); m: the stack's shared metrics, if any."""
        x = x + self.attn(self.ln_1(x), m)                    # attention sees u = ln_1(x)
        return x + self.mlp(self.ln_2(x))


def init_weights(model, n_layer):
    """nanoGPT's initialisation, as damcha_numpy.init_params: N(0, 0.02) for every Linear and
    Embedding weight and the static metric, zero biases, the residual projections c_proj
    N(0, 0.02 / sqrt(2 n_layer)), then each module's init_extra() if it has one. metric_init="identity"
    then sets every static metric, or every generator's last bias, so that every m_i is I."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    # in the order of model.named_parameters() (a module's own, then its children's): a seed gives one model
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if name.endswith("c_proj"):
            nn.init.normal_(own["weight"], mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if "metric" in own:
            nn.init.normal_(own["metric"], mean=0.0, std=0.02)
        if hasattr(module, "init_extra"):
            module.init_extra()
    config = model.config
    if config.metric_init == "identity":   # M_ii = I, M_ij = 0 (so RowSum gives 0 with blocks="offdiag")
        D, H = config.n_embd, config.n_head
        eye = torch.eye(D) if config.gen_out == "full" else torch.eye(D // H).expand(H, -1, -1)   # M (D, D) or m (H, dh, dh)
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
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if device_type == "cuda" else {}))


def shares_metric(config):
    """Section 3.4: one generator (or static metric) for the whole stack, owned by the model."""
    return config.share and issubclass(ATTENTION[config.attn], DamchaAttention)


def stack_forward(owner, x):
    """owner.h, a stack of Blocks, on x (B, T, D) -> (B, T, D). A shared generator (owner.gen) runs
    once, on layer 0's attention input u (that LayerNorm is recomputed in the block: cheap)."""
    m = compute_metric(owner, owner.h[0].ln_1(x), owner.config) if shares_metric(owner.config) else None
    for block in owner.h:
        x = block(x, m)
    return x


PEAK_FLOPS = 989e12   # dense bfloat16 FLOP/s of one H100 / H200 SXM GPU: estimate_mfu's yardstick


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
        """Without the position embeddings by default, as nanoGPT; wte stays: it is also the lm_head."""
        n_params = sum(p.numel() for p in self.parameters())
        return n_params - self.wpe.weight.numel() if non_embedding else n_params

    def forward(self, idx, targets=None):
        """idx (B, T) int64 -> (logits (B, T, V), mean cross-entropy or None)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))                 # (B, T, D)
        x = stack_forward(self, x)
        logits = F.linear(self.ln_f(x), self.wte.weight)              # lm_head tied to wte (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return configure_optimizers(self, weight_decay, learning_rate, betas, device_type)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilisation of fwdbwd_per_iter sequences in dt seconds against PEAK_FLOPS, as
        nanoGPT (PaLM, appendix B): 6 FLOPs per parameter and token plus 12 L T D for attention.
        A parameter counts once a token, so gen_out="full" (its last layer runs folded) reads high."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        return flops_per_token * T * fwdbwd_per_iter / dt / PEAK_FLOPS

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, t), each conditioned on the last block_size."""
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


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's schedule: linear warm-up over warmup_iters, cosine decay to min_lr at lr_decay_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)
