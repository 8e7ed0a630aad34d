"""
variants.py: the lab's attentions, added to the book's damcha_torch.ATTENTION when this module is
imported, so that GPTConfig(attn=...) builds them and the book's trainer trains them
(python lab/train.py, python lab/eval.py):

  "tha", "dcmha"  Talking-Heads and DCMHA, the baselines of lab/baselines.py
  "proj"          the 2x2 study's projected adaptive metric: DAMCHA's metric on MHA's projections,
                  q_i = (u W_q^T)_i m_i, k_i = (u W_k^T)_i, v from MHA's c_attn (rows [q; k; v]).
                  With m_i = I it is MHA (tests/test_variants.py)

    import lab.variants
    from damcha_torch import GPT, GPTConfig
    model = GPT(GPTConfig(attn="proj", metric_init="identity"))
"""
import torch.nn as nn

from damcha_torch import ATTENTION, DamchaAttention
from lab.baselines import ComposedAttention


class ProjectedAttention(DamchaAttention):
    """attn="proj": DAMCHA attention whose head inputs are MHA's projections. The metric (shared,
    per layer or static, as GPTConfig says) acts on the projected query: x_i = (u W_q^T)_i, and
    the keys are (u W_k^T)_i."""

    def add_projections(self, config):
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)   # rows [q; k; v], as MHA's

    def heads(self, u):
        B, T, D = u.size()
        return tuple(a.view(B, T, self.config.n_head, D // self.config.n_head) for a in self.c_attn(u).split(D, dim=2))


ATTENTION.update(tha=ComposedAttention, dcmha=ComposedAttention, proj=ProjectedAttention)
