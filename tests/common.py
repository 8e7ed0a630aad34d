"""Helpers shared by the tests."""
import contextlib
import hashlib
import io
import signal
import subprocess
import sys
import types

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


def lab_runs_in_process(monkeypatch):
    """lab/reproduce.py's commands `python lab/train.py ARGS` and `python lab/eval.py ARGS` (its
    training runs, their evaluations, its --mode=config calls) run as train_char.main(ARGS) and
    eval_char.main(ARGS) in this process, with lab.variants imported as those two files import it:
    the same settings, checkpoints and printed lines, and the exit status a process would have, without
    a torch import per run. Other commands (git) still run. For the tests of what reproduce.py does
    with its runs; tests/test_reproduce.py's test_tiny_sweep_and_rerun and tests/test_integrity.py run
    them as the processes they are."""
    import lab.variants  # noqa: F401  (registers the lab's attentions)
    from lab import reproduce
    import eval_char
    import train_char
    mains = {reproduce.TRAIN_CHAR: train_char.main, reproduce.EVAL_CHAR: eval_char.main}

    def status(main, argv):
        try:
            main(argv)
        except SystemExit as e:   # as Python ends a process on it: a message goes to stderr, with status 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            return 1 if isinstance(e.code, str) else e.code or 0
        return 0

    def run(cmd, **kwargs):   # subprocess.run, for the two scripts: stdout and stderr captured when piped
        if cmd[:1] != [sys.executable] or cmd[1] not in mains:
            return subprocess.run(cmd, **kwargs)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.ExitStack() as piped:
            if kwargs.get('stdout') == subprocess.PIPE:
                piped.enter_context(contextlib.redirect_stdout(out))
            if kwargs.get('stderr') == subprocess.PIPE:
                piped.enter_context(contextlib.redirect_stderr(err))
            returncode = status(mains[cmd[1]], cmd[2:])
        return subprocess.CompletedProcess(cmd, returncode, out.getvalue(), err.getvalue())

    monkeypatch.delenv('TRITON_INTERPRET', raising=False)   # as the processes run: tests/test_triton.py may set it
    monkeypatch.setattr(reproduce, 'subprocess', types.SimpleNamespace(run=run, PIPE=subprocess.PIPE))
    monkeypatch.setattr(reproduce, 'run_to_the_end', lambda cmd: run(cmd).returncode)
