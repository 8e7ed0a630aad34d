"""
baselines.py: the attention baselines that DAMCHA is compared against besides MHA, both multi-head
attention whose heads are mixed before and after the softmax: ComposedAttention, the attention
class that damcha_torch.GPT takes for GPTConfig(attn="tha") and GPTConfig(attn="dcmha")
(lab/variants.ATTENTIONS). They use MHA's c_attn (rows [q; k; v]) and c_proj, so with the
mixing at the identity they are MHA (tests/test_lab_baselines.py):

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
Their initialisation is GPT's (damcha_torch.init_weights), which calls their init_weights for
what they own beyond the Linear weights.

    from damcha_torch import GPTConfig
    from lab.variants import build
    model = build(GPTConfig(attn="dcmha"))
"""
import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from damcha_torch import init_residual


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


def mixing_macs(config):
    """Multiply-adds per token and layer that the head mixing adds to MHA's
    (lab/counts.flops_per_token), the per-(t, s) terms over the T / 2 keys a causal query meets
    on average."""
    D, T, H, R = config.n_embd, config.block_size, config.n_head, DCMHA_RANK
    if config.attn == "tha":
        return T * H * H                                    # two H x H mixes at every (t, s)
    # the dynamic weights (dyn_fc, dyn_proj, dyn_gate), then at every (t, s) two compositions of
    # 2 R H (query-wise) + 2 R H (key-wise) + 2 H (gates)
    return 20 * H * D + 32 * R * H * H + (4 * R + 2) * H * T


class ComposedAttention(nn.Module):
    """Talking-Heads (attn="tha") or DCMHA (attn="dcmha") attention, the module at h.{l}.attn."""

    def __init__(self, config):
        super().__init__()
        D, H = config.n_embd, config.n_head
        self.c_attn = nn.Linear(D, 3 * D, bias=config.bias)          # rows [q; k; v], as MHA's
        if config.attn == "tha":
            self.pre_mix = nn.Parameter(torch.zeros(H, H))           # logits mixed by I + pre_mix
            self.post_mix = nn.Parameter(torch.zeros(H, H))          # probabilities by I + post_mix
        else:
            C = 4 * H
            self.dyn_fc = nn.Linear(D, 4 * C, bias=config.bias)
            self.dyn_proj = nn.Parameter(torch.empty(4, 2 * DCMHA_RANK * H, C))
            self.dyn_gate = nn.Linear(D, 4 * H, bias=config.bias)
        self.c_proj = nn.Linear(D, D, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def init_weights(self):
        """Called by GPT's init_weights after every Linear is N(0, 0.02): THA's mixes stay zero as
        built; DCMHA's dyn_proj is N(0, 0.02) and its gates dyn_gate zero (tanh(0) = 0: the
        compositions start near the identity, i.e. near MHA, and every weight has a gradient);
        c_proj starts as every residual projection."""
        if self.config.attn == "dcmha":
            nn.init.normal_(self.dyn_proj, mean=0.0, std=0.02)
            nn.init.zeros_(self.dyn_gate.weight)
        init_residual(self.c_proj, self.config)

    def forward(self, u, m=None):
        """u (B, T, D), the normalised layer input; m unused (DAMCHA's metrics). -> y (B, T, D)"""
        B, T, D = u.size()
        H = self.config.n_head
        q, k, v = (a.view(B, T, H, D // H).transpose(1, 2) for a in self.c_attn(u).split(D, dim=2))
        y = self.composed_attention(q, k, v, u)                      # (B, H, T, dh)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, D)))

    def composed_attention(self, q, k, v, u):
        """Softmax attention whose heads are mixed before and after the softmax. q, k, v
        (B, H, T, dh), u (B, T, D). The mixing needs the (B, H, T, T) logits and probabilities
        themselves."""
        T = q.size(2)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))                     # (B, H, T, T)
        if self.config.attn == "tha":
            logits = logits + torch.einsum("nm,bmts->bnts", self.pre_mix, logits)
            probs = F.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            # the masked probabilities are 0, and mixing heads at one (t, s) keeps them 0
            probs = probs + torch.einsum("nm,bmts->bnts", self.post_mix, probs)
        else:
            pre, post = self.dynamic_weights(u)
            # the mask comes after the pre-softmax composition, and the masked probabilities are
            # zeroed after the post-softmax one, as in DCFormer
            probs = F.softmax(compose(logits, *pre).masked_fill(~causal, float("-inf")), dim=-1)
            probs = compose(probs, *post).masked_fill(~causal, 0.0)
        probs = F.dropout(probs, self.config.attn_dropout, self.training)
        return probs @ v                                                             # (B, H, T, dh)

    def dynamic_weights(self, u):
        """DCMHA's weights, computed from the block input u (B, T, D) by a small MLP, for the four
        compositions: w1 (RMS-normalised over the heads), w2 and the tanh gate d. Returns
        (pre, post), each a pair (query, key) of compose's arguments."""
        B, T, _ = u.shape
        H, R = self.config.n_head, DCMHA_RANK
        hidden = F.gelu(self.dyn_fc(u), approximate="tanh").view(B, T, 4, -1)       # (B, T, 4, C)
        w = torch.einsum("btgc,goc->btgo", hidden, self.dyn_proj).view(B, T, 4, 2, R, H)
        w1, w2 = w.unbind(3)                                                # (B, T, 4, R, H)
        w1 = w1 * torch.rsqrt(w1.pow(2).mean(-1, keepdim=True) + 1e-6)
        d = torch.tanh(self.dyn_gate(u)).view(B, T, 4, H)
        # composition g: 0 and 1 before the softmax (query-wise, key-wise), 2 and 3 after it
        weights = lambda g: tuple(a[:, :, g] for a in (w1, w2, d))
        return (weights(0), weights(1)), (weights(2), weights(3))
