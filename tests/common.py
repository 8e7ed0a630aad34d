"""Helpers shared by the tests: the tiny model's settings (TINY), the scripts run in-process (run,
fails) or as processes (cli, start, one_line_error), small stand-in datasets (make_corpora,
text_file), and the comparisons of the model tests (rel_err, MetricSizedOutputs)."""
import contextlib
import hashlib
import io
import os
import pathlib
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import tempfile
import types
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import data.prepare as prep
import eval_char as ec
import train_char as tc
from damcha_torch import GPT, GPTConfig
from run_folder import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a pid above any pid_max (at most 2 ** 22): never a live process's, as a dead run's partial
# file names it
NO_PID = 2 ** 22 + 1
TINY = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4', '--gen_width=16',
        '--eval_iters=2', '--log_interval=5', '--max_new_tokens=20', '--device=cpu', '--compile=False',
        '--warmup_iters=2']


ENV = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'} | {'PYTHONUNBUFFERED': '1'}


def run(*argv, main=tc.main):
    main([str(a) for a in argv])


def run_eval(*argv):
    run(*argv, main=ec.main)


def fails(*argv, main=tc.main):
    """one_line_error's checks, in this process: main(argv) ends in a SystemExit whose message is one
    'error: ' line (which Python prints as the process's last line, with exit status 1), and prints
    no traceback before it. Returns the line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    message = e.value.code
    assert isinstance(message, str) and message.startswith('error: ') and '\n' not in message, message
    assert 'Traceback' not in err.getvalue(), err.getvalue()[-2000:]
    return message


def fails_eval(*argv):
    return fails(*argv, main=ec.main)


def cli(*args, script='train_char.py', timeout=120, env=ENV, preexec_fn=None):
    """A script run as a process, with what it printed; preexec_fn: as subprocess takes it (limit_memory)."""
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, timeout=timeout,
                          env=env, preexec_fn=preexec_fn, text=not any(isinstance(a, bytes) for a in args))


def start(*args, script='train_char.py', stderr=os.devnull):
    """A script (train_char.py) in the background, as from a terminal that Ctrl-C can reach
    (sigint_default); its stdout (log lines) to read, stderr to a file (by default discarded)."""
    with open(stderr, 'w') as err:
        return subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=ENV, text=True,
                                stdout=subprocess.PIPE, stderr=err, preexec_fn=sigint_default)


def wait_for(proc, prefix):
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the run ended before printing {prefix!r}: exit status {proc.wait()}")


def handles_sigterm(pid):
    """Whether process pid has a handler of its own for SIGTERM (Linux: /proc/<pid>/status), which
    Python has not by itself: a script's first line (shell.quit_on_signals) has run."""
    with open(f'/proc/{pid}/status') as f:
        caught = next(line for line in f if line.startswith('SigCgt:')).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def stopped_during_start_up(tmp_path, script, *args, delay=0.0, twice=False, ready=None):
    """Ctrl-C sent to `script args` delay seconds after its first line set its handlers (or once
    the file `ready` exists), and again 10 ms later if twice: it ends with status 130 and one
    line, 'interrupted', never a traceback. Before that first line is the interpreter's own
    start-up, which no script can change."""
    if not os.path.exists('/proc/self/status'):
        pytest.skip('needs /proc/<pid>/status to see when the handlers are in place')
    err = tmp_path / 'stderr'
    proc = start(*args, script=script, stderr=err)
    while not (ready.exists() if ready else handles_sigterm(proc.pid)):
        assert proc.poll() is None, err.read_text()[-2000:]
        time.sleep(0.001)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    if twice:
        time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
    status, text = proc.wait(timeout=120), err.read_text()
    proc.stdout.close()
    assert status == 130 and 'Traceback' not in text and text.count('interrupted') == 1, (status, text[-2000:])
    assert text.strip().splitlines()[-1].startswith('interrupted'), text[-2000:]


def one_line_error(result, words):
    """A failed run whose stderr ends in one 'error: ' line holding words, with no traceback."""
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''
    assert result.returncode == 1 and last.startswith('error: ') and words in last, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr, result.stderr[-2000:]
    return last


def iters(path):
    return [e['iter'] for e in read_jsonl(path)]


def make_corpora(folder, monkeypatch, serve_url=None, as_prepared=False):
    """Small stand-ins for enwik8 (random bytes) and text8 (random a-z and space), zipped into
    folder/<name>.zip, or folder/<name>/<name>.zip where prepare() looks for them when
    as_prepared; SOURCES then expects their sizes and checksums. Returns the contents."""
    rng = np.random.default_rng(0)
    contents = dict(enwik8=rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(),
                    text8=bytes(rng.choice(list(b' abcdefghijklmnopqrstuvwxyz'), 4000).astype(np.uint8)))
    for name, data in contents.items():
        where = os.path.join(folder, name) if as_prepared else folder
        os.makedirs(where, exist_ok=True)
        with zipfile.ZipFile(os.path.join(where, f'{name}.zip'), 'w', zipfile.ZIP_DEFLATED) as z:
            z.writestr(name, data)
        algorithm = prep.SOURCES[name]['digest'][0]
        url = f'{serve_url}/{name}.zip' if serve_url else 'http://127.0.0.1:9/unreachable.zip'
        monkeypatch.setitem(prep.SOURCES, name, dict(prep.SOURCES[name], url=url, size=len(data),
                                                   digest=(algorithm, hashlib.new(algorithm, data).hexdigest())))
    return contents


def text_file(path, seed, size=200_000):
    """A text file of random lowercase words, different for each seed."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.choice(list(b'abcdefghij '), size).astype(np.uint8).tobytes())
    return path


def copy_of(checkpointed, tmp_path, name='copy'):
    shutil.copytree(checkpointed, tmp_path / name)
    return tmp_path / name


def flip(path, entry_size, value=None):
    """Overwrite, in place, the stored entry of `entry_size` bytes of a checkpoint's zip archive:
    every float set to `value`, or, without one, a single bit of its first byte."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.file_size == entry_size)
    with open(path, 'r+b') as f:
        f.seek(info.header_offset + 26)
        name, extra = struct.unpack('<HH', f.read(4))
        f.seek(info.header_offset + 30 + name + extra)
        data = struct.pack('<f', value) * (entry_size // 4) if value is not None else bytes([f.read(1)[0] ^ 1])
        f.seek(info.header_offset + 30 + name + extra)
        f.write(data)


def limit_memory(size):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (size, size))


SPARE_UID = 65534   # nobody: the other user of the cross-user tests, which need root to become it


def as_spare_user(fn):
    """fn() in a forked child running as SPARE_UID (the modules it needs already imported: the
    interpreter itself may live where that user cannot read), for the cross-user tests, which run
    as root: ('returned', its value) or ('raised', 'ExceptionName: message')."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(SPARE_UID)
            os.setuid(SPARE_UID)
            try:
                result = ('returned', fn())
            except BaseException as e:   # SystemExit included: its message is the result
                result = ('raised', f"{type(e).__name__}: {e.code if isinstance(e, SystemExit) else e}")
            os.write(write, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, 'rb') as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def shared_folder():
    """A fresh folder that every user may enter (0755, under /tmp), unlike pytest's tmp_path under
    a root-only folder: a cross-user test's files are then kept from the other user by their own
    mode alone. The caller removes it."""
    folder = tempfile.mkdtemp(prefix='damcha-shared-')
    os.chmod(folder, 0o755)
    return pathlib.Path(folder)


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
    one when it is not (tests/test_model.py for the book's attentions, test_lab_baselines.py for the lab's)."""
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
    eval_char.main(ARGS) in this process, with the lab's attentions as those two files pass them:
    the same settings, checkpoints and printed lines, and the exit status a process would have, without
    a torch import per run. Other commands (git) still run. For the tests of what reproduce.py does
    with its runs; tests/test_lab_reproduce.py's test_tiny_sweep_and_rerun and its SIGTERM test run
    them as the processes they are."""
    from lab import reproduce
    from lab.variants import ATTENTIONS
    mains = {reproduce.TRAIN_CHAR: lambda argv: tc.main(argv, attentions=ATTENTIONS),
             reproduce.EVAL_CHAR: lambda argv: ec.main(argv, attentions=ATTENTIONS)}

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

    monkeypatch.delenv('TRITON_INTERPRET', raising=False)   # as the processes run: tests/test_kernel.py may set it
    monkeypatch.setattr(reproduce, 'subprocess', types.SimpleNamespace(run=run, PIPE=subprocess.PIPE))
    monkeypatch.setattr(reproduce, 'run_to_the_end', lambda cmd: run(cmd).returncode)


# ---- the kernel's tests ------------------------------------------------------------------------

FWD_TOL, GRAD_TOL = 1e-4, 1e-3                       # float32 against float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def attention_inputs(B, H, T, dh, static, seed=0, dtype=torch.float32):
    """x, m, v as the model hands them to attention, and an output gradient dO: x and v (B, H, T, dh)
    views of (B, T, H, dh); m (B, T, H, dh, dh), or (H, dh, dh) when static, scaled so that the
    scores are O(1). Drawn on the CPU, so the same on every device, then moved to DEVICE."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, T, H, dh), (*((H,) if static else (B, T, H)), dh, dh), (B, T, H, dh), (B, H, T, dh)]
    x, m, v, do = (torch.randn(*shape, generator=g) for shape in shapes)
    return [t.to(device=DEVICE, dtype=dtype) for t in (x.transpose(1, 2), m / dh ** 0.5, v.transpose(1, 2), do)]


def torch_attention(x, m, v):
    """What the kernel computes, as damcha_torch's kernel="torch" does: q = x m (Eq. 5), then causal
    SDPA with keys x (Eqs. 5-7)."""
    q = torch.einsum("bhtd,hde->bhte" if m.dim() == 3 else "bhtd,bthde->bhte", x, m)
    return F.scaled_dot_product_attention(q, x, v, is_causal=True)


def off_in_dx(op, scale):
    """op with its output and dm unchanged and dx off by scale * x: a wrong kernel the checks must catch."""
    return lambda x, m, v: op(x, m, v) + scale * (x - x.detach())


def output_and_grads(op, x, m, v, do):
    """op(x, m, v) and the gradients of sum(op * dO) for x, m and v."""
    x, m, v = (t.detach().requires_grad_() for t in (x, m, v))
    o = op(x, m, v)
    (o * do).sum().backward()
    return o, x.grad, m.grad, v.grad


def check_against_float64(x, m, v, do):
    """The kernel's output and gradients against the torch path's in float64."""
    from damcha_triton import damcha_attention   # once the test file has chosen the interpreter
    got = output_and_grads(damcha_attention, x, m, v, do)
    want = output_and_grads(torch_attention, *(t.double() for t in (x, m, v, do)))
    for name, a, b, tol in zip(("o", "dx", "dm", "dv"), got, want, (FWD_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL)):
        assert a.dtype == x.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.2e}"
