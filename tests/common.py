"""Helpers shared by the tests."""
import hashlib
import signal

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
