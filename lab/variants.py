"""
variants.py: the lab's attentions, by the names GPTConfig.attn gives them, and the GPT of any
attn name. Each is a class that damcha_torch.GPT takes as its `attention` (the book's extension
point); the lab's trainer and evaluator (python lab/train.py, python lab/eval.py) hand ATTENTIONS
to the book's:

  "tha", "dcmha"  Talking-Heads and DCMHA, the baselines of lab/baselines.py
  "proj"          the 2x2 study's projected adaptive metric: DAMCHA's metric on MHA's projections,
                  q_i = (u W_q^T)_i m_i, k_i = (u W_k^T)_i, v from MHA's c_attn (rows [q; k; v]).
                  With m_i = I it is MHA (tests/test_lab_variants.py)

    from damcha_torch import GPTConfig
    from lab.variants import build
    model = build(GPTConfig(attn="proj", metric_init="identity"))
"""
import torch.nn as nn

from damcha_torch import GPT, DamchaAttention
from lab.baselines import ComposedAttention


class ProjectedAttention(DamchaAttention):
    """attn="proj": DAMCHA attention whose head inputs are MHA's projections. The metric (shared,
    per layer or static, as GPTConfig says) acts on the projected query: x_i = (u W_q^T)_i, and
    the keys are (u W_k^T)_i. Its modules are DAMCHA's with MHA's c_attn in place of c_v, built
    in that order (so a seed draws the weights it always drew)."""

    def __init__(self, config):
        nn.Module.__init__(self)                                     # not DAMCHA's c_v
        D = config.n_embd
        self.c_attn = nn.Linear(D, 3 * D, bias=config.bias)          # rows [q; k; v], as MHA's
        self.add_own_metric(config)
        self.c_proj = nn.Linear(D, D, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config

    def forward(self, u, m=None):
        """As DamchaAttention.forward, with the query inputs, keys and values from c_attn."""
        if m is None:
            m = self.own_metrics(u)
        B, T, D = u.size()
        H = self.config.n_head
        x, k, v = (a.view(B, T, H, D // H) for a in self.c_attn(u).split(D, dim=2))
        return self.attend(x, k, v, m)                               # Eqs. 5-8, DAMCHA's


ATTENTIONS = {"proj": ProjectedAttention, "tha": ComposedAttention, "dcmha": ComposedAttention}


def build(config):
    """The GPT of GPTConfig config, for any attn name: the book's ("damcha", "mha") or the lab's."""
    return GPT(config, ATTENTIONS.get(config.attn))
