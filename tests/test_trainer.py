"""
The trainer, train_char.py: its settings (config files, flags, --help, --mode=config, one-line
errors), training and exact resume, the schedule, micro-batches and DDP on two CPU processes, the
loss estimate and the rows of a batch, a stop by a signal or a non-finite loss, sizes that cannot
fit, and the closed pipe and output encoding a shell may hand it.

    python -m pytest -q tests/test_trainer.py

Most runs are in-process (tc.main) with a one-layer, 32-wide model (common.TINY); the command line
itself, torchrun included, runs as a subprocess where exit codes and tracebacks are the point.
"""
import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

import damcha_torch
import data.prepare as prep
import device
import eval_char as ec
import train_char as tc
from data import dataset
from run_folder import read_jsonl
import shell
from shell import DIVERGED, note_signals, raise_noted, signals_as_ctrl_c
from common import (ENV, ROOT, TINY, cli, digest, fails, limit_memory, one_line_error, run, run_eval,
                    start, stopped_during_start_up, text_file, wait_for)


def test_config_types_files_and_order(tmp_path):
    config_file = tmp_path / 'c.py'
    config_file.write_text('"""a config file"""\nbatch_size = 3\nlearning_rate = 1\ndataset = "text8"\n')
    cfg, given = tc.parse_config([str(config_file), '--batch_size=5', '--compile=True', '--beta2=0',
                                  '--start=123', '--n_layer=3'])
    assert (cfg['batch_size'], cfg['learning_rate'], cfg['dataset']) == (5, 1.0, 'text8')
    assert type(cfg['learning_rate']) is float and type(cfg['beta2']) is float   # int accepted for float
    assert cfg['compile'] is True and cfg['start'] == '123' and cfg['n_layer'] == 3
    assert given == {'batch_size', 'learning_rate', 'dataset', 'compile', 'beta2', 'start', 'n_layer'}
    assert all(f in tc.DEFAULTS for f in tc.MODEL_KEYS)   # every GPTConfig field is a setting
    assert tc.parse_config(['--compile'])[0]['compile'] is True   # a bare boolean flag sets it
    later = tmp_path / 'd.py'
    later.write_text('batch_size = 7\n')
    # in the order given: a config file after a flag overrides it, and a later file an earlier one
    assert tc.parse_config(['--batch_size=5', str(config_file)])[0]['batch_size'] == 3
    assert tc.parse_config([str(config_file), str(later)])[0]['batch_size'] == 7
    assert tc.parse_config([str(later), str(config_file)])[0]['batch_size'] == 3


def test_a_whole_float_is_not_an_int_and_nan_is_not_a_number(tmp_path):
    """An int setting refuses 3.0, from a flag or a file; a config file can give nan (a flag cannot:
    its text is a Python literal), and a checked number refuses it."""
    fast = f'--out_dir={tmp_path / "out"}', '--max_iters=1'   # a check that let it through fails fast
    assert 'batch_size=3.0: expected int, not float' in fails('--batch_size=3.0', *fast)
    for text, message in [('batch_size = 3.0', 'batch_size=3.0: expected int, not float'),
                          ('learning_rate = float("nan")', 'learning_rate must be a finite number, not nan')]:
        config_file = tmp_path / 'c.py'
        config_file.write_text(text + '\n')
        assert message in fails(str(config_file), *fast)


def test_help_prints_the_docstring_and_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        tc.main(['--batch_size=3', '--help'])   # the defaults, not the settings given before --help
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(tc.__doc__.strip())
    lines = out.split('--key=value):\n')[1].splitlines()
    assert [line.split()[0] for line in lines] == [f'{k}={v!r}' for k, v in tc.DEFAULTS.items()]
    for line, (k, v) in zip(lines, tc.DEFAULTS.items()):   # each with a description, the comment beside its default
        assert line.startswith(f'  {k}={v!r}  ') and len(line.removeprefix(f'  {k}={v!r}').split()) >= 2, line
    described = dict(line.split(maxsplit=1) for line in lines)
    assert described["lr_decay_iters=2000"] == "iteration where the decay reaches min_lr; unless set, max_iters"
    assert described["snapshot_iters=''"].endswith('in out_dir/snapshot-<iter>.pt (a notebook reads them)')   # three lines
    assert described["n_head=4"].startswith('H, heads')   # from GPTConfig's fields, in damcha_torch.py


def test_bad_settings_are_one_line_errors(tmp_path):
    assert "did you mean 'batch_size'" in fails('--batchsize=3')
    assert 'expected int' in fails('--batch_size=1.5')
    assert 'expected int' in fails('--batch_size=many')
    assert 'expected int, not bool' in fails('--batch_size=True')
    assert 'expected bool' in fails('--compile=yes')
    assert 'mode must be one of' in fails('--mode=fly')
    assert 'must be positive' in fails('--batch_size=0')
    assert 'no such config file' in fails('config/none.py')
    assert '--key=value' in fails('--max_iters')
    assert "unknown setting 'compil' in --compil; did you mean 'compile'?" in fails('--compil')
    for pattern in ('out-{attn.x}', 'out-{n_layer[0]}', 'out-{}'):
        assert 'braces must hold a setting' in fails(f'--out_dir={pattern}')
    assert 'comma-separated whole numbers' in fails('--snapshot_iters=0,half', f'--out_dir={tmp_path / "out"}')
    assert "outside this run's iterations" in fails('--snapshot_iters=0,2001', f'--out_dir={tmp_path / "out"}')
    broken = tmp_path / 'broken.py'
    broken.write_text('batch_size = = 3\n')
    assert 'SyntaxError' in fails(broken)
    unknown = tmp_path / 'unknown.py'
    unknown.write_text('batch_sise = 3\n')
    assert 'unknown setting' in fails(unknown)


def test_command_line_errors_have_no_traceback(data_dir, monkeypatch, capsys):
    """Each is one line on stderr and nothing on stdout: the config a run prints comes after the data.
    The first runs as a process; the others in this process, where main's SystemExit holds the one
    line that Python prints (exit status 1) and main itself must print nothing."""
    result = cli('--no_such_flag=1', '--out_dir=/nonexistent/never-written')
    assert result.returncode == 1 and 'unknown setting' in result.stderr, result.stderr
    assert result.stderr.strip().count('\n') == 0 and 'Traceback' not in result.stderr, result.stderr
    assert result.stdout == '', result.stdout
    prep.prepare('shakespeare', str(data_dir))   # so that the prompt's run says only its error
    monkeypatch.chdir(ROOT)   # as cli runs it, without tests/test_kernel.py's TRITON_INTERPRET
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    capsys.readouterr()
    for args, words in [(['--max_iters=ten'], 'expected int'),
                        (['--dataset=no/such/file.txt'], 'neither'),
                        ([f'--data_dir={data_dir}', '--start=' + 'a' * 65], 'longer than the model'),
                        (['--n_embd=30', '--n_head=4'], 'divisible'), (['--n_head=0'], 'at least 1'),
                        (['--kernel=triton', '--device=cpu'], 'kernel=triton needs'),
                        (['--n_embd=30', '--n_head=4', '--mode=config'], 'divisible'),   # as the run would
                        (['--dataset=no/such/file.txt', '--mode=config'], 'neither')]:
        assert words in fails(*args, '--out_dir=/nonexistent/never-written')
        assert capsys.readouterr() == ('', ''), args


def test_the_interpreted_kernel_is_refused_in_16_bit(monkeypatch):
    """Triton's interpreter (the kernel on a CPU) trains in float32 only: bf16 is one line, not a
    traceback from inside the op. On CUDA every dtype is the kernel's (checked here without one)."""
    if importlib.util.find_spec('triton') is None:   # found, not imported: tests/test_kernel.py picks its mode first
        pytest.skip("needs the triton package")
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    with pytest.raises(SystemExit, match="which cannot train in bfloat16; use --dtype=float32"):
        device.check_kernel('triton', 'cpu', 'bfloat16')
    device.check_kernel('triton', 'cpu', 'float32')
    for dtype in ('float32', 'bfloat16', 'float16'):
        device.check_kernel('triton', 'cuda', dtype)


def test_config_mode_prints_the_composed_settings(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)   # the config files' paths, as typed in the repository
    capsys.readouterr()
    run('config/text8.py', 'config/mha.py', '--mode=config', '--n_layer=2')
    cfg = json.loads(capsys.readouterr().out)   # a dataset file, a model file, then flags, in that order
    assert (cfg['dataset'], cfg['attn'], cfg['n_layer'], cfg['max_iters']) == ('text8', 'mha', 2, 50000)
    assert cfg['out_dir'] == 'out-text8-mha'   # out-text8-{attn}
    assert 'braces must hold' in fails('--out_dir=out-{nope}', '--mode=config')


def test_the_schedule_follows_max_iters_unless_set(tmp_path):
    """lr_decay_iters and warmup_iters left unset follow max_iters (a run of 200 iterations decays
    over 200 and warms up over 20, not the defaults' 2000 and 100); set, in a flag or a config
    file, they are kept. The defaults themselves are a run of 2000 iterations."""
    cfg, _ = tc.parse_config([])
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['warmup_iters']) == (2000, 2000, 100)
    cfg, given = tc.parse_config(['--max_iters=200'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (200, 20) and given == {'max_iters'}
    assert tc.parse_config(['--max_iters=5000'])[0]['warmup_iters'] == 100
    cfg, _ = tc.parse_config(['--max_iters=200', '--lr_decay_iters=150', '--warmup_iters=0'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (150, 0)
    cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', 'mha.py')])   # 50,000 iterations, 1,000 of warm-up
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['warmup_iters']) == (50000, 50000, 1000)
    cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', 'mha.py'), '--max_iters=100'])
    assert (cfg['lr_decay_iters'], cfg['warmup_iters']) == (100, 1000)   # the config file's warm-up, set there


def test_the_quick_start_config_is_a_short_run_of_a_smaller_model(capsys):
    """config/quick.py, the README's first command: the bundled corpus, a smaller model than the
    defaults' (fewer, narrower layers: the run is meant to take about a minute of one core), the
    same 2000 iterations with the schedule following them, into its own out_dir."""
    tc.main([os.path.join(ROOT, 'config', 'quick.py'), '--mode=config'])
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg['dataset'], cfg['out_dir'], cfg['attn']) == ('shakespeare', 'out-quick', 'damcha')
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['warmup_iters']) == (2000, 2000, 100)
    assert (cfg['n_layer'], cfg['n_embd'], cfg['learning_rate']) == (2, 64, 4e-3)
    assert cfg['n_layer'] * cfg['n_embd'] < tc.DEFAULTS['n_layer'] * tc.DEFAULTS['n_embd'] / 2
    assert not cfg['compile'] and cfg['device'] == 'auto' and cfg['max_new_tokens'] == 500


def test_a_closed_pipe_ends_quietly():
    """`python train_char.py --mode=config | head` and the like: a reader that goes away is not an
    error. No message, the status of a process ended by SIGPIPE (128 + 13). Here the reader is gone
    before the first write."""
    for script, args in [('train_char.py', ['--mode=config']), ('train_char.py', ['--help']),
                         ('eval_char.py', ['--help'])]:
        env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
        proc = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141 and err == '', (script, args, proc.returncode, err)


def test_a_run_says_where_it_resumes_and_where_its_data_are(tmp_path, capsys):
    """A run prints where its dataset was prepared (a text file: <data_dir>/<its stem>-<digest>/), and
    a line before it generates the sample after training; a resumed run prints the checkpoint and
    iteration it starts from, says in one line when its checkpoint's lr_decay_iters is no longer
    max_iters, and in another when it changes the checkpoint's schedule (the rate jumps), but not
    when it keeps it."""
    text = tmp_path / 'notes.txt'
    text.write_bytes(b'hello world, ' * 300)
    out = tmp_path / 'out'
    both = io.StringIO()   # stdout and stderr in the order printed
    with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
        run(*TINY, f'--dataset={text}', f'--data_dir={tmp_path / "data"}', f'--out_dir={out}', '--max_iters=4',
            '--eval_interval=2')
    printed = both.getvalue()
    where = prep.text_file_dir(str(text), str(tmp_path / 'data'))
    assert re.fullmatch(r'notes-[0-9a-f]{8}', os.path.basename(where)) and os.path.dirname(where) == str(tmp_path / 'data')
    assert f"data: {text} prepared in {where}\n" in printed and 'resuming' not in printed
    assert 'note: lr_decay_iters' not in printed   # it followed max_iters
    assert printed.index("done: iter 4") < printed.index("sampling 1 x 20 characters on cpu\n") < printed.index(
        "sample:\n")
    run(f'--out_dir={out}', '--init_from=resume', '--max_iters=6')
    printed, err = capsys.readouterr()
    assert printed.startswith(f"resuming from {out / 'ckpt.pt'} at iter 4\n")
    assert "note: lr_decay_iters=4 is not max_iters=6" in err   # the checkpoint's schedule, kept
    assert 'schedule' not in err
    run(f'--out_dir={out}', '--init_from=resume', '--max_iters=10', '--lr_decay_iters=10')
    notes = [line for line in capsys.readouterr().err.splitlines() if 'schedule' in line]
    rates = [e['lr'] for e in read_jsonl(out / 'train_log.jsonl')]
    assert rates[6] > rates[5] and notes == [
        f"note: the schedule is not the checkpoint's (lr_decay_iters 4 -> 10): the rate at iter 6 is "
        f"{rates[6]:.2e}, where the checkpoint's schedule has {rates[5]:.2e}; the val loss may worsen "
        "before it improves"]


def test_auto_precision_is_float32_off_cuda():
    for name in ('cpu', 'mps'):
        dtype, ctx = device.autocast_for(name, 'auto')
        assert dtype == 'float32' and isinstance(ctx, contextlib.nullcontext)
    dtype, ctx = device.autocast_for('cpu', 'bfloat16')
    assert dtype == 'bfloat16' and isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16


@pytest.mark.parametrize('corpus', ['enwik8', 'text8', 'mix'])
def test_gpu_configs_state_their_equal_parameter_counts(corpus):
    counts = {}
    for attn in ('damcha', 'mha'):   # a dataset file, then a model file
        path = os.path.join(ROOT, 'config', f'{attn}.py')
        cfg, _ = tc.parse_config([os.path.join(ROOT, 'config', f'{corpus}.py'), path])
        assert (cfg['dataset'], cfg['attn'], cfg['out_dir']) == (corpus, attn, f'out-{corpus}-{attn}')
        with torch.device('meta'):   # shapes only: no memory, no time
            model = damcha_torch.GPT(damcha_torch.GPTConfig(**{k: cfg[k] for k in tc.MODEL_KEYS} | {'vocab_size': len(
                prep.SOURCES['text8']['vocab']) if corpus == 'text8' else 256}))
        counts[attn] = sum(p.numel() for p in model.parameters())
        with open(path) as f:
            assert f'{counts[attn]:,} parameters' in f.read()
    assert abs(counts['damcha'] - counts['mha']) < 0.0004 * counts['mha']


def test_command_line_train_resume_sample(tmp_path, data_dir, capsys):
    """The first session of a user: 60 iterations log a falling val loss and a checkpoint, a resume
    continues to 90, and sampling prints text after the prompt. The first run is the command itself,
    a process; the resume and the sampling are its main(argv) in this process."""
    out = tmp_path / 'out'
    common = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--learning_rate=1e-2']
    result = cli(*common, '--max_iters=60', '--eval_interval=30')
    assert result.returncode == 0, result.stderr
    val = [e['val_loss'] for e in read_jsonl(out / 'log.jsonl')]
    assert len(val) == 3 and val[0] > val[1] > val[2], val
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 60
    assert 'sample:' in result.stdout and ' tokens/s' in result.stdout
    assert 'mfu' not in result.stdout   # a GPU's peak: not printed for a CPU run

    capsys.readouterr()
    run(*common, '--init_from=resume', '--max_iters=90', '--num_samples=2')
    stdout = capsys.readouterr().out
    assert f"resuming from {out / 'ckpt.pt'} at iter 60" in stdout
    assert stdout.count('sample:\n') == 2, stdout[-500:]   # --num_samples
    assert [e['iter'] for e in read_jsonl(out / 'log.jsonl')] == [0, 30, 60, 90]
    rates = [e['lr'] for e in read_jsonl(out / 'train_log.jsonl')]
    assert len(rates) == 90 and rates[0] < rates[10] > rates[89]   # warm-up, then decay
    assert [e['lr'] for e in read_jsonl(out / 'log.jsonl')][:3] == [rates[0], rates[30], rates[60]]

    tc.main(['--init_from=resume', f'--out_dir={out}', '--mode=config', '--max_iters=120'])   # the run a resume would be
    shown = json.loads(capsys.readouterr().out)
    assert (shown['n_embd'], shown['block_size'], shown['max_iters'], shown['learning_rate']) == (32, 16, 120, 1e-2)
    for more, words in (([], 'raise max_iters'), (['--max_iters=120', '--n_embd=64'], 'do not fit the model with n_embd=64')):
        with pytest.raises(SystemExit, match=words):   # refused, as the resume itself would be
            tc.main(['--init_from=resume', f'--out_dir={out}', '--mode=config', *more])
    capsys.readouterr()
    assert 'do not fit the model with n_embd=64' in fails('--init_from=resume', f'--out_dir={out}', '--max_iters=120',
                                                          '--n_embd=64')
    assert capsys.readouterr().out == ''   # before the data are loaded and the settings printed

    run_eval('--mode=sample', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=40', '--num_samples=2')
    samples = capsys.readouterr().out.split('---------------\n')
    assert len(samples) == 3 and all(s.startswith('ROMEO:') and len(s) > 40 for s in samples[:2])


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, data_dir):
    common = [*TINY, f'--data_dir={data_dir}', '--eval_interval=4', '--dropout=0.1',
              '--gradient_accumulation_steps=2', '--lr_decay_iters=8', '--max_new_tokens=1']
    run(*common, f'--out_dir={tmp_path / "a"}', '--max_iters=8')
    run(*common, f'--out_dir={tmp_path / "b"}', '--max_iters=4')
    for log in ('log.jsonl', 'train_log.jsonl'):   # as if b had run on past its checkpoint, then crashed
        with open(tmp_path / 'b' / log, 'a') as f:
            f.write(json.dumps(dict(iter=5, loss=0.0, val_loss=0.0)) + '\n')
    run(f'--out_dir={tmp_path / "b"}', '--init_from=resume', '--max_iters=8')
    a, b = (read_jsonl(tmp_path / d / 'train_log.jsonl') for d in 'ab')
    assert [e['iter'] for e in b] == list(range(8))
    assert a == b                                    # every loss and learning rate, bit for bit
    a, b = (read_jsonl(tmp_path / d / 'log.jsonl') for d in 'ab')
    assert [(e['val_loss'], e['tokens']) for e in a] == [(e['val_loss'], e['tokens']) for e in b]
    assert all(x['time'] <= y['time'] for x, y in zip(b, b[1:]))   # the clock carries on from the checkpoint


def test_each_step_follows_the_schedule_clips_and_keeps_the_best(tmp_path, data_dir, monkeypatch):
    """Every iteration's learning rate, logged and given to every parameter group of the optimizer,
    is nanoGPT's schedule (written out here: linear warm-up, cosine to min_lr, then min_lr), or
    learning_rate throughout with decay_lr=False; the gradients are clipped to grad_clip at every
    step, and with always_save_checkpoint=False the checkpoint is the best evaluation's (losses
    set by hand)."""
    val = iter([3.0, 2.0, 2.5, 2.2])   # the evaluations at iters 0, 4, 8 and 12
    monkeypatch.setattr(tc, 'estimate_loss', lambda *a: dict(train_loss=1.0, val_loss=(v := next(val)), val_bpc=v))
    norms = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda p, max_norm: norms.append(max_norm) or clip(p, max_norm))
    stepped = []   # per optimizer step, the lr of each parameter group
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: stepped.append({g['lr'] for g in optimizer.param_groups}))
    out = tmp_path / 'out'
    try:
        run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=12', '--eval_interval=4',
            '--warmup_iters=2', '--lr_decay_iters=10', '--learning_rate=1e-3', '--min_lr=1e-4',
            '--always_save_checkpoint=False', '--grad_clip=0.5')
        schedule, stepped[:] = stepped[:], []
        val = iter([3.0, 2.0, 1.0])   # the evaluations at iters 0, 2 and 3
        run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "flat"}', '--max_iters=3', '--eval_interval=2',
            '--decay_lr=False', '--learning_rate=1e-3', '--min_lr=1e-4')
    finally:
        hook.remove()
    def lr(it):
        if it < 2:
            return 1e-3 * (it + 1) / 3
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(it - 2, 8) / 8)) * 9e-4
    logged = [e['lr'] for e in read_jsonl(out / 'train_log.jsonl')]
    assert logged == pytest.approx([lr(it) for it in range(12)], rel=1e-12)
    assert [group_lrs.pop() for group_lrs in schedule if len(group_lrs) == 1] == logged   # one lr for all groups
    assert [e['lr'] for e in read_jsonl(tmp_path / 'flat' / 'train_log.jsonl')] == [1e-3] * 3
    assert stepped == [{1e-3}] * 3
    assert norms == [0.5] * 12 + [1.0] * 3   # the flat run clips at the default grad_clip
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert (ckpt['iter_num'], ckpt['best_val_loss']) == (4, 2.0)
    val = iter([3.0, 2.0, 2.5])   # always_save_checkpoint=True: the last evaluation's weights, the best loss
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "always"}', '--max_iters=8', '--eval_interval=4')
    ckpt = torch.load(tmp_path / 'always' / 'ckpt.pt', weights_only=True)
    assert (ckpt['iter_num'], ckpt['best_val_loss']) == (8, 2.0)


def test_estimate_loss_scores_each_split_on_its_own_tokens(tmp_path):
    """A stand-in model whose loss is the mean target id: each split's loss is the mean of its own
    tokens (a file whose train part is one byte and whose val part another)."""
    text = tmp_path / 'two.txt'
    text.write_bytes(b'a' * 900 + b'b' * 100)   # 90 / 5 / 5: train all 'a' (id 0), val all 'b' (id 1)
    components, _ = dataset.load_dataset(str(text), str(tmp_path / 'data'))
    class MeanTarget(torch.nn.Module):
        def forward(self, x, y):
            return None, y.double().mean()
    cfg = dict(seed=0, eval_iters=3, batch_size=4, gradient_accumulation_steps=2, block_size=8)
    losses = tc.estimate_loss(MeanTarget(), components, cfg, 'cpu', contextlib.nullcontext())
    assert (losses['train_loss'], losses['val_loss'], losses['val_bpc']) == (0.0, 1.0, 1 / math.log(2))


def test_micro_batches_change_neither_the_training_nor_the_estimates(tmp_path, data_dir):
    """4 rows an iteration as one micro-batch or as two of 2: the same steps, and the same loss
    estimates in log.jsonl (each evaluation scores one iteration's rows per batch)."""
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2', '--max_new_tokens=1']
    run(*common, f'--out_dir={tmp_path / "one"}')
    run(*common, '--batch_size=2', '--gradient_accumulation_steps=2', f'--out_dir={tmp_path / "two"}')
    for log in ('train_log.jsonl', 'log.jsonl'):
        one, two = (read_jsonl(tmp_path / d / log) for d in ('one', 'two'))
        for key in ('loss', 'train_loss', 'val_loss'):
            if key in one[0]:
                np.testing.assert_allclose([e[key] for e in two], [e[key] for e in one], rtol=1e-5)


def test_a_resume_takes_this_runs_weight_decay_and_betas(tmp_path, data_dir, monkeypatch):
    out = tmp_path / 'out'
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=2')
    optimizers = []
    restore = tc.checkpoint.restore
    monkeypatch.setattr(tc.checkpoint, 'restore', lambda ckpt, optimizer, *a: optimizers.append(optimizer) or restore(ckpt, optimizer, *a))
    run(f'--out_dir={out}', '--init_from=resume', '--max_iters=4', '--weight_decay=0.0', '--beta1=0.5', '--beta2=0.9')
    decay, no_decay = optimizers[0].param_groups
    assert decay['weight_decay'] == no_decay['weight_decay'] == 0.0
    assert decay['betas'] == no_decay['betas'] == (0.5, 0.9)


def test_ddp_on_two_cpu_processes_matches_one_process(tmp_path, data_dir):
    common = [*TINY, f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=4', '--log_interval=2',
              '--gradient_accumulation_steps=2', '--max_new_tokens=1']
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             'train_char.py', *common, f'--out_dir={tmp_path / "ddp"}'],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('sample:') == 1      # only rank 0 logs and samples
    run(*common, f'--out_dir={tmp_path / "one"}')
    ddp, one = (read_jsonl(tmp_path / d / 'train_log.jsonl') for d in ('ddp', 'one'))
    assert [e['iter'] for e in ddp] == [0, 1, 2, 3]
    np.testing.assert_allclose([e['loss'] for e in ddp], [e['loss'] for e in one], rtol=1e-4)
    ckpt = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 4 and len(ckpt['rng']['torch']) == 2   # both processes' RNG states


def test_ddp_ranks_waiting_for_missing_data_stop_in_one_line(tmp_path):
    """Rank 0 refuses a missing dataset in one line; rank 1, waiting for rank 0 to prepare the
    data, then says so in one line rather than a traceback from the broken process group."""
    # torchrun stops the other ranks once one fails; checking every 2 s, it leaves rank 1 the
    # time to say why it stopped
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             '--monitor-interval=2', 'train_char.py', *TINY, '--gradient_accumulation_steps=2',
                             f'--dataset={tmp_path / "missing.txt"}', f'--out_dir={tmp_path / "out"}'],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "is neither shakespeare" in result.stderr
    assert "error: rank 0 stopped before the data were ready" in result.stderr
    assert "RuntimeError" not in result.stderr


def test_snapshots_asked_for_at_a_resume_lie_ahead_of_it(trained, tmp_path):
    """Snapshots before the checkpoint's iteration would never be written: refused, not skipped;
    so are those the checkpoint keeps asking for past a lowered max_iters, saying where they come from."""
    message = fails('--init_from=resume', f'--out_dir={trained}', '--max_iters=40', '--snapshot_iters=5,30')
    assert "snapshot_iters (given): [5] outside this run's iterations 20..40" in message and 'sets others' not in message
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    (tmp_path / 'run').mkdir()
    torch.save(ckpt | {'config': ckpt['config'] | {'snapshot_iters': '30,60'}}, tmp_path / 'run' / 'ckpt.pt')
    assert ("snapshot_iters (the checkpoint's): [60] outside this run's iterations 0..40; --snapshot_iters= sets "
            "others, or none") in fails('--init_from=resume', f"--out_dir={tmp_path / 'run'}", '--max_iters=40')


def test_non_finite_loss_stops_and_keeps_the_checkpoint(trained, monkeypatch, tmp_path, capsys):
    """One line, the exit status that tells reproduce.py the run diverged, the checkpoint untouched."""
    class Diverging(damcha_torch.GPT):
        def forward(self, idx, targets=None, **kwargs):
            logits, loss = super().forward(idx, targets, **kwargs)
            return logits, loss * float('nan') if self.training else loss

    before = digest(trained / 'ckpt.pt')
    monkeypatch.setattr(tc, 'GPT', Diverging)   # the trainer's model
    with pytest.raises(SystemExit) as e:
        run('--init_from=resume', f'--out_dir={trained}', '--max_iters=40')
    assert e.value.code == DIVERGED
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith('error: the training loss became nan at iter 20') and 'iter 20) is the last good checkpoint' in message
    assert digest(trained / 'ckpt.pt') == before
    monkeypatch.setattr(tc, 'GPT', damcha_torch.GPT)   # training is fine, the evaluation is not
    monkeypatch.setattr(tc, 'estimate_loss', lambda *a: dict(train_loss=1.0, val_loss=float('inf'), val_bpc=0.0))
    shutil.copytree(trained, tmp_path / 'copy')        # it trains on: the shared run's logs stay as they are
    with pytest.raises(SystemExit) as e:
        run('--init_from=resume', f'--out_dir={tmp_path / "copy"}', '--max_iters=40')
    assert e.value.code == DIVERGED
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith('error: the val loss became inf at iter 30')
    assert digest(tmp_path / 'copy' / 'ckpt.pt') == before


def test_rows_cover_every_window_and_an_empty_prompt_is_a_newline():
    data = np.arange(18, dtype=np.uint8)                    # block_size 16: two windows of 17 tokens
    x, y = tc.get_batch([dataset.Corpus('bytes', '', dict(train=data), None)], 'train', 2000, 16, torch.Generator().manual_seed(0), 'cpu')
    assert set(x[:, 0].tolist()) == {0, 1} and (y == x + 1).all()
    assert dataset.encode('', [10, 32, 97], 8) == [0]          # a newline where there is one,
    assert dataset.encode('', [32, 97], 8) == [0]              # else a space (text8)


def test_batches_are_the_rows_their_generator_draws(tmp_path):
    """get_batch gathers its rows all at once; they are those of its definition, drawn from the
    same generator: per row a corpus uniformly, then a start uniformly over that split's windows,
    the corpus's ids through its lut. Memory-mapped and in-memory splits alike, and the generator
    is left where the definition leaves it (a resume draws on from there)."""
    rng = np.random.default_rng(3)
    rng.integers(0, 5, 1000, dtype=np.uint8).tofile(tmp_path / 'train.bin')
    mapped = np.memmap(tmp_path / 'train.bin', dtype=np.uint8, mode='r')
    corpora = [dataset.Corpus('mapped', '', dict(train=mapped), None),
               dataset.Corpus('array', '', dict(train=rng.integers(0, 3, 700, dtype=np.uint8)),
                              np.array([7, 5, 9]))]
    generator = torch.Generator().manual_seed(1)
    x, y = tc.get_batch(corpora, 'train', 300, 16, generator, 'cpu')
    drawn = torch.Generator().manual_seed(1)
    which = torch.randint(2, (300,), generator=drawn).tolist()
    uniform = torch.rand(300, generator=drawn, dtype=torch.float64).tolist()
    assert set(which) == {0, 1} and torch.equal(generator.get_state(), drawn.get_state())
    for row, (c, u) in enumerate(zip(which, uniform)):
        split, lut = corpora[c].splits['train'], corpora[c].lut
        start = int(u * (len(split) - 16))
        ids = split[start:start + 17].astype(np.int64)
        ids = ids if lut is None else lut[ids]
        assert x[row].tolist() == ids[:-1].tolist() and y[row].tolist() == ids[1:].tolist(), row
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.int64


class HostReads(TorchDispatchMode):
    """Counts the ops that bring a tensor's value to the host as a Python number (.item(), float(),
    bool(), an `if` on a tensor): on a GPU each waits for the device to finish its queue."""
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.equal.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_a_training_step_waits_for_no_device(tmp_path, data_dir, monkeypatch):
    """A training step reads no tensor's value back to the host, so a GPU never idles waiting for
    it: a run of 6 iterations does as many such reads as a run of 2, whose evaluations, log lines
    and checkpoint (at the start and the end) are the same. The batch, the loss kept for the log,
    the clipping and the optimizer's step all stay on the device. The optimizer is built as on
    CUDA (fused AdamW): the CPU's own reads its step count each step, on the host that runs it.
    (What a CPU cannot see: a .tolist() or .cpu() of a device tensor.)"""
    configure = damcha_torch.GPT.configure_optimizers
    monkeypatch.setattr(damcha_torch.GPT, 'configure_optimizers',
                        lambda self, *a: configure(self, *a[:-1], 'cuda'))
    counts = []
    for iters in (2, 6):
        with HostReads() as reads:
            run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / str(iters)}', f'--max_iters={iters}',
                f'--eval_interval={iters}', '--log_interval=100')
        counts.append(reads.count)
    assert counts[0] == counts[1] > 0, counts   # > 0: the evaluations' checks are seen


def test_compile_mode_reaches_torch_compile_and_needs_compile(tmp_path, data_dir, monkeypatch):
    """--compile_mode is torch.compile's mode (reduce-overhead: CUDA graphs); without
    --compile=True it would do nothing, so it is refused rather than dropped."""
    modes = []
    monkeypatch.setattr(torch, 'compile', lambda model, mode=None: modes.append(mode) or model)
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "run"}', '--max_iters=2', '--compile=True',
        '--compile_mode=reduce-overhead')
    assert modes == ['reduce-overhead']
    assert 'compile_mode=max-autotune needs compile=True' in fails(*TINY, '--compile_mode=max-autotune')
    assert "compile_mode must be one of default, reduce-overhead," in fails('--compile_mode=fast')


def test_sizes_that_cannot_fit_are_one_line(checkpointed, tmp_path, data_dir):
    """Sizes that cannot fit in memory are refused before anything is allocated (a batch, the
    samples after training, eval's windows); a batch that runs out of memory
    all the same (here under a 3 GB address-space limit, ulimit -v) is one line naming the
    settings to lower; a prompt file is read no further than the context (/dev/zero)."""
    out = f'--out_dir={tmp_path / "never"}'
    assert 'batch_size=3000000 asks for more than' in fails(*TINY, f'--data_dir={data_dir}', out, '--batch_size=3000000')
    assert 'num_samples=100000000 asks for more than' in fails(*TINY, f'--data_dir={data_dir}', out, '--num_samples=100000000')
    assert 'batch_size=100000000 asks for more than' in fails(f'--out_dir={checkpointed}', '--batch_size=100000000', main=ec.main)
    assert "outside the model's 80-symbol vocabulary: '\\x00'" in fails('--mode=sample', f'--out_dir={checkpointed}',
                                                                         '--start=FILE:/dev/zero', main=ec.main)
    result = subprocess.run([sys.executable, 'train_char.py', *TINY, f'--data_dir={data_dir}', out, '--batch_size=100000',
                             '--max_iters=2'], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, 'out of memory (')
    assert 'lower batch_size (raise gradient_accumulation_steps)' in result.stderr


def test_memory_too_short_to_import_torch_is_one_line(tmp_path):
    """Under a memory limit (ulimit -v) too low to load torch, train_char.py and eval_char.py end in
    one line that says so and names the limit, before any handler of theirs is in place."""
    for script in ('train_char.py', 'eval_char.py'):
        result = cli(f'--out_dir={tmp_path}', script=script, preexec_fn=limit_memory(400 * 2**20))
        one_line_error(result, 'out of memory loading the libraries (')
        assert 'the memory limit (ulimit -v) of 400 MiB: raise the limit' in result.stderr, script


def test_a_dataset_too_big_for_memory_names_the_dataset_not_the_model(tmp_path):
    """A text file whose preparation cannot fit under ulimit -v is one line naming the dataset and
    the limit, not the model's settings (batch_size, n_layer ...), which had no part in it."""
    big = tmp_path / 'big.txt'
    with open(big, 'wb') as f:   # 400 MB of zero bytes, sparse: its token ids need 3.2 GB as int64
        f.truncate(400 * 10**6)
    result = cli(*TINY, f'--dataset={big}', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path / "out"}',
                 preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, f'out of memory preparing or loading the dataset {big} (')
    assert 'ulimit -v' in result.stderr and 'lower' not in result.stderr


def test_compile_without_a_cpp_compiler_is_one_line(tmp_path):
    """--compile=True on a CPU with no C++ compiler (none on the PATH, CXX unset), which Inductor
    needs there, is one line saying so, before the run starts (eval_char.py checks alike)."""
    bare = tmp_path / 'bin'   # a PATH with Python alone
    bare.mkdir()
    os.symlink(sys.executable, bare / 'python')
    env = {k: v for k, v in ENV.items() if k not in ('CC', 'CXX')} | {'PATH': str(bare)}
    message = '--compile=True needs a working C++ compiler (none found'
    one_line_error(cli(*TINY, '--compile=True', f'--out_dir={tmp_path / "out"}', env=env), message)


def test_a_config_file_that_is_no_file_is_named_for_what_it_is(tmp_path):
    """A directory or a FIFO given as a config file is named as such (a FIFO is never opened, so
    nothing waits on it), and -x, a single dash, as an option mistyped. Every script parses its
    settings with configurator.py: the process is damcha_numpy.py's, the quickest to start."""
    one_line_error(cli(str(tmp_path), script='damcha_numpy.py'), f'{tmp_path} is a directory, not a config file')
    os.mkfifo(tmp_path / 'fifo')
    assert 'fifo is a FIFO (named pipe), not a config file' in fails(str(tmp_path / 'fifo'))
    assert '-x: no such option (options are written --key=value' in fails('-x')


def test_sighup_stops_a_run_as_ctrl_c_does(tmp_path, data_dir):
    """SIGHUP (a closed terminal) prints the line Ctrl-C prints (where the run stopped, where a
    resume starts, the command), with status 128 + its number; SIGTERM's test is the run folder's
    test_ctrl_c_before_the_first_checkpoint_then_sigterm_and_resumes_give_the_uninterrupted_history."""
    out = tmp_path / 'out'
    proc = subprocess.Popen([sys.executable, 'train_char.py', *TINY, '--max_iters=100000', f'--data_dir={data_dir}',
                             f'--out_dir={out}', '--eval_interval=5'], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(proc, 'eval 5:')
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=60)
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    assert proc.returncode == 128 + signal.SIGHUP and 'Traceback' not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f'interrupted at iter {saved}: a resume starts from {out}/ckpt.pt at iter {saved}: '
                           'python train_char.py '), last
    assert last.endswith(f' --init_from=resume --out_dir={out}') and saved >= 5, last


def test_an_output_encoding_without_a_characters_never_fails_a_finished_run(tmp_path, data_dir, monkeypatch):
    """PYTHONIOENCODING=ascii: the sample after training, and eval_char.py's, print '?' for the
    characters ascii lacks; the run ends with status 0. The training run is a process; eval_char's
    main then runs here, with the stdout such a process has: a text stream to ascii."""
    corpus = tmp_path / 'fr.txt'
    corpus.write_text('café crème, éléphant à côté; ' * 200)
    env = dict(ENV, PYTHONIOENCODING='ascii')
    out = tmp_path / 'out'
    result = subprocess.run([sys.executable, 'train_char.py', *TINY, f'--dataset={corpus}', f'--data_dir={data_dir}',
                             f'--out_dir={out}', '--max_iters=2', '--start=é'], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and 'sample:\n?' in result.stdout, result.stderr[-2000:]
    ascii_stdout = io.TextIOWrapper(io.BytesIO(), encoding='ascii')   # as Python makes it for PYTHONIOENCODING=ascii
    monkeypatch.setattr(sys, 'stdout', ascii_stdout)
    ec.main(['--mode=sample', f'--out_dir={out}', '--start=é'])
    ascii_stdout.flush()
    assert ascii_stdout.buffer.getvalue().startswith(b'?')


def test_input_that_is_not_what_it_claims_is_named_in_one_line(tmp_path, data_dir):
    """A config file that exits, nan as a number, a FIFO or a directory as a dataset, a file that
    cannot be read: one 'error: ' line each, that says what the input is and why it cannot be used."""
    never = f'--out_dir={tmp_path / "never"}'
    (tmp_path / 'exits.py').write_text('raise SystemExit(0)\n')
    one_line_error(cli(str(tmp_path / 'exits.py'), never), 'exits.py: exits (SystemExit: 0) instead of setting values')
    one_line_error(cli(*TINY, '--dataset=/proc/self/mem', f'--data_dir={data_dir}', never),
                   'cannot read the dataset /proc/self/mem: Input/output error')
    assert 'learning_rate must be a finite number, not nan' in fails('--learning_rate=nan', never)
    assert 'temperature must be a finite number, not -inf' in fails('--temperature=-inf', never, main=ec.main)
    os.mkfifo(tmp_path / 'fifo')
    assert 'is a FIFO (named pipe), not a regular file' in fails(*TINY, f'--dataset={tmp_path / "fifo"}', never)
    assert 'is a directory, not a regular file' in fails(*TINY, f'--dataset={tmp_path}', never)
    assert not os.path.exists(tmp_path / 'never')


def test_a_signal_in_the_loop_waits_for_a_step_boundary_and_ctrl_c_again_stops_at_once(monkeypatch):
    """In the training loop (shell.note_signals) a signal is noted for the next step boundary;
    another signal, or Ctrl-C again sooner than AGAIN_S, is ignored; Ctrl-C again AGAIN_S or more
    later stops at once, and so does a signal noted when the loop ends (raise_noted); once
    stopping, the process is deaf to further signals until the handlers before are back."""
    before = signal.getsignal(signal.SIGINT)
    with signals_as_ctrl_c():
        noted = note_signals()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(os.getpid(), sig)
        assert noted == [signal.SIGTERM]
        monkeypatch.setattr(shell, 'AGAIN_S', 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == before
    with signals_as_ctrl_c(), pytest.raises(shell.Interrupted) as e:
        noted = note_signals()
        os.kill(os.getpid(), signal.SIGHUP)
        raise_noted(noted)
    assert e.value.args == (signal.SIGHUP,)


def test_ctrl_c_at_any_moment_of_start_up_is_one_line(tmp_path, data_dir):
    """Ctrl-C while torch is imported (at once, 0.3 s and 1 s after the script's first line), twice
    10 ms apart, and twice while a config file runs: each time one line, status 130, never a
    traceback, also from a second press that lands in the first one's exit."""
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "out"}']
    for delay, twice in ((0, False), (0.3, False), (1.0, True)):
        stopped_during_start_up(tmp_path, 'train_char.py', *args, delay=delay, twice=twice)
    ready = tmp_path / 'ready'
    (tmp_path / 'slow.py').write_text(f"open({str(ready)!r}, 'w').close()\n__import__('time').sleep(60)\n")
    stopped_during_start_up(tmp_path, 'train_char.py', str(tmp_path / 'slow.py'), *args, twice=True, ready=ready)


def test_settings_are_checked_where_they_are_parsed(tmp_path, data_dir, capsys):
    assert 'beta1=2.0 must be at least 0 and below 1' in fails('--beta1=2', f'--out_dir={tmp_path / "never"}')
    (tmp_path / 'afile').write_text('')
    capsys.readouterr()
    assert 'is a file, not a folder' in fails(*TINY, f'--data_dir={data_dir}', f"--out_dir={tmp_path / 'afile'}")
    assert 'config:' not in capsys.readouterr().out   # refused before the run prints its settings
    assert "plot_file='bpc.xyz': end it in a format matplotlib writes: " in fails(
        '--mode=plot', f'--out_dir={tmp_path}', '--plot_file=bpc.xyz', main=ec.main)
    assert 'beta2=1.0 must be at least 0 and below 1' in fails('--beta2=1')
    assert 'beta1=-0.5' in fails('--beta1=-0.5')
    assert 'seed=-1 must be a whole number from 0 to 2**32 - 1' in fails('--seed=-1')
    assert 'seed=4294967296' in fails(f'--seed={2**32}')
    assert "out_dir=',' names no folder" in fails('--mode=plot', '--out_dir=,', main=ec.main)
    assert "out_dir='' names no folder" in fails('--out_dir=')
    for name in ('cpu:abc', 'cuda:x', 'mps:1'):
        assert f"device must be auto, cpu, cuda, cuda:N or mps, not '{name}'" in fails(f'--device={name}')
    assert 'max_iters must be positive, not 0' in fails('--max_iters=0')
    assert 'learning_rate must be a finite number, not inf' in fails('--learning_rate=1e999')
    assert "end it in a format" in fails('--mode=plot', f'--out_dir={tmp_path}', '--plot_file=bpc', main=ec.main)
    assert not os.path.exists(tmp_path / 'never')


def test_a_clock_that_steps_back_or_stands_still_changes_no_saved_number(tmp_path, data_dir, monkeypatch, capsys):
    """Durations come from the monotonic clock: a wall clock stepping back an hour at every reading
    changes nothing saved, and a monotonic clock that stands still (its resolution) ends no run in
    a division by zero; its rates are 0."""
    wall = iter(range(10**9, 0, -3600))
    monkeypatch.setattr(tc, 'time', types.SimpleNamespace(time=lambda: next(wall), monotonic=lambda: 100.0))
    out = tmp_path / 'out'
    run(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=10', '--eval_interval=5')
    printed = capsys.readouterr().out
    assert '0.0 ms/iter, 0 tokens/s' in printed and 'done: iter 10, 0 s of training' in printed
    assert torch.load(out / 'ckpt.pt', weights_only=True)['elapsed'] == 0.0
    assert [(e['time'], e['tokens_per_sec']) for e in read_jsonl(out / 'log.jsonl')] == [(0.0, 0.0)] * 3


def test_a_resume_is_held_to_the_data_its_checkpoint_records(tmp_path, monkeypatch, capsys):
    """A checkpoint records its dataset as given, the text file's absolute path and the digests of
    the splits it trained on. A moved clone (another folder holding a copy of the file) and the
    file moved elsewhere hold the same data and resume; a file appended to is other data: the
    resume refuses in one line, and trains on it with --other_data=True, saying so."""
    monkeypatch.chdir(tmp_path)
    text_file(tmp_path / 'a' / 'notes.txt', seed=0, size=20_000)
    common = [*TINY, '--eval_interval=2', f'--data_dir={tmp_path / "data"}', '--out_dir=../out']
    monkeypatch.chdir(tmp_path / 'a')
    run(*common, '--dataset=notes.txt', '--max_iters=2')
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    meta = prep.prepare(str(tmp_path / 'a' / 'notes.txt'), str(tmp_path / 'data'))
    assert (ckpt['data']['dataset'], ckpt['data']['path']) == ('notes.txt', str(tmp_path / 'a' / 'notes.txt'))
    assert ckpt['data']['corpora'] == [dict(name='notes.txt', vocab=meta['vocab'], sha256=meta['sha256'],
                                            meta_sha256=meta['self_sha256'])]
    shutil.copytree(tmp_path / 'a', tmp_path / 'b')   # a moved clone: notes.txt, relative, is a copy
    monkeypatch.chdir(tmp_path / 'b')
    run(*common, '--init_from=resume', '--max_iters=4')
    moved = tmp_path / 'elsewhere.txt'
    shutil.move(tmp_path / 'a' / 'notes.txt', moved)
    run(*common, '--init_from=resume', '--max_iters=6', f'--dataset={moved}')
    with open(moved, 'ab') as f:   # the same characters, more of them: other splits
        f.write(moved.read_bytes()[:1000])
    before = digest(tmp_path / 'out' / 'ckpt.pt')
    message = fails(*common, '--init_from=resume', '--max_iters=8', f'--dataset={moved}')
    assert 'is not the data ../out/ckpt.pt was trained on (' in message and 'give --other_data=True' in message
    assert digest(tmp_path / 'out' / 'ckpt.pt') == before
    capsys.readouterr()
    run(*common, '--init_from=resume', '--max_iters=8', f'--dataset={moved}', '--other_data=True')
    assert '--other_data=True: they are trained on' in capsys.readouterr().err
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 8 and ckpt['data']['path'] == str(moved)
    assert ckpt['data']['corpora'][0]['sha256'] == prep.prepare(str(moved), str(tmp_path / 'data'))['sha256']


def test_a_split_truncated_or_rewritten_under_a_running_run_changes_nothing(tmp_path):
    """A run reads private copies of its splits: train.bin truncated, then rewritten with ids past
    the vocabulary, while the run trains, neither ends it (through a memory map: SIGBUS, or an
    IndexError)."""
    text = text_file(tmp_path / 'notes.txt', seed=1, size=20_000)
    data = tmp_path / 'data'
    proc = start(*TINY, f'--dataset={text}', f'--data_dir={data}', f'--out_dir={tmp_path / "out"}',
                 '--max_iters=120', '--eval_interval=60', '--log_interval=1')
    wait_for(proc, 'iter 2:')
    train = pathlib.Path(prep.text_file_dir(str(text), str(data))) / 'train.bin'
    with open(train, 'r+b') as f:   # in place, as another process would
        f.truncate(100)
    wait_for(proc, 'iter 20:')
    with open(train, 'r+b') as f:
        f.truncate(0)
        f.write(b'\xff' * 18_000)
    printed = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and 'done: iter 120' in printed, printed[-2000:]


def test_a_config_file_may_import_a_module_to_compute_a_value(tmp_path):
    """A module a config file imports (import math, to compute a setting) is no setting of its
    own; its assignments are read as ever."""
    config = tmp_path / 'computed.py'
    config.write_text('import math\nlearning_rate = math.sqrt(1e-6)\n')
    cfg, given = tc.parse_config([str(config)])
    assert cfg['learning_rate'] == 1e-3 and 'math' not in cfg and 'learning_rate' in given
