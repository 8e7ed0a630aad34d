"""Helpers shared by the tests."""
import hashlib
import signal

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from damcha_torch import GPT, GPTConfig


def rel_err(a, b):
    """max |a - b| / max |b|, in float64, of two tensors (any dtype, any device) or arrays."""
    a, b = (t.detach().double() if torch.is_tensor(t) else torch.tensor(np.asarray(t, dtype=np.float64))
            for t in (a, b))
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def digest(path):
    """The MD5 of a file's bytes: equal digests mean a file was left exactly as it was."""
    with open(path, 'rb') as f:
        return hashlib.md5(f.read()).hexdigest()


def sigint_default():
    """preexec_fn for a child that a test stops with Ctrl-C (SIGINT): Python ignores SIGINT for
    good if it starts with it ignored, which it inherits when pytest was started in the background
    (nohup, `&` in a script)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class MetricSizedOutputs(TorchDispatchMode):
    """Records the name of every operation whose output has `numel` entries."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                self.ops.append(func.overloadpacket.__name__)
        return out


def check_attention_dropout_is_its_own_setting(fields, attn):
    """With every nn.Dropout module (embedding, residual, MLP) switched off, a model of these
    fields in training mode computes its eval-mode function when attn_dropout is 0, and another
    one when it is not (tests/test_torch.py for the book's attentions, test_baselines.py for the lab's)."""
    idx = torch.randint(fields["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(18))
    outputs = {}
    for attn_dropout in (0.0, 0.5):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**fields, attn=attn, dropout=0.5, attn_dropout=attn_dropout)).train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.eval()
        outputs[attn_dropout] = model(idx)[0], model.eval()(idx)[0]
    assert torch.equal(*outputs[0.0])
    assert not torch.allclose(*outputs[0.5])
