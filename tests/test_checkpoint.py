"""
Checkpoints read back, checkpoint.py: a checkpoint damaged on disk (a flipped byte, a truncation),
damaged inside (wrong types, non-finite weights, a bad optimizer or random state, an unsafe
pickle) or that no longer fits the settings given is refused in one line and left as it is; a
resume in a copy of a run leaves the original alone.

    python -m pytest -q tests/test_checkpoint.py
"""
import json
import os
import pickle
import shutil

import torch

import eval_char as ec
import train_char as tc
from common import (TINY, as_spare_user, cli, copy_of, digest, fails, fails_eval, flip, one_line_error, run, run_eval,
                    shared_folder)


def test_bad_checkpoints_are_refused_and_kept(trained, tmp_path):
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    cases = {'garbage': b'not a checkpoint at all', 'truncated': (trained / 'ckpt.pt').read_bytes()[:5000]}
    for name, content in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / 'ckpt.pt').write_bytes(content)
    for name, content in dict(foreign={'model': ckpt['model']},
                              mismatched=ckpt | {'model_args': ckpt['model_args'] | {'n_embd': 64}}).items():
        (tmp_path / name).mkdir()
        torch.save(content, tmp_path / name / 'ckpt.pt')
    expected = dict(garbage='not a readable checkpoint', truncated='not a readable checkpoint',
                    foreign='not a checkpoint of train_char.py', mismatched='do not fit the model')
    for name, words in expected.items():
        before = digest(tmp_path / name / 'ckpt.pt')
        assert words in fails('--init_from=resume', f'--out_dir={tmp_path / name}', '--max_iters=40')
        for mode in ('eval', 'sample'):
            assert words in fails_eval(f'--mode={mode}', f'--out_dir={tmp_path / name}')
        assert digest(tmp_path / name / 'ckpt.pt') == before
    assert 'no checkpoint at' in fails('--init_from=resume', f'--out_dir={tmp_path / "empty"}')


def test_bad_input_with_an_existing_checkpoint_leaves_it_alone(trained, corpora):
    before = digest(trained / 'ckpt.pt')
    out = f'--out_dir={trained}'
    assert 'exists: continue it with --init_from=resume' in fails(*TINY, out, '--max_iters=40')
    assert "do not fit the model with n_embd=64 (the checkpoint's: 32)" in fails('--init_from=resume', out,
                                                                                  '--max_iters=40', '--n_embd=64')
    data, _ = corpora   # a config file's model settings are given too: the message names them
    (data / 'deeper.py').write_text('n_layer = 2\n')
    assert "with n_layer=2 (the checkpoint's: 1)" in fails(str(data / 'deeper.py'), '--init_from=resume', out,
                                                           '--max_iters=40')
    assert f"out_dir {data / 'deeper.py'} is a file, not a folder" in fails(*TINY, '--dataset=text8', f'--data_dir={data}',
                                                                           f"--out_dir={data / 'deeper.py'}")
    assert 'divisible' in fails('--init_from=resume', out, '--max_iters=40', '--n_head=5')
    assert 'raise max_iters' in fails('--init_from=resume', out)
    assert 'neither' in fails('--init_from=resume', out, '--max_iters=40', '--dataset=nothing.txt')
    assert 'expected float' in fails('--init_from=resume', out, '--learning_rate=fast')
    assert 'longer than the model' in fails_eval('--mode=sample', out, '--start=' + 'a' * 17)
    assert "outside the model's 80-symbol vocabulary: '\\x00'" in fails_eval('--mode=sample', out, '--start=a\x00')
    assert 'cannot read the prompt' in fails_eval('--mode=sample', out, '--start=FILE:/no/such/prompt')
    assert 'stride=17 is larger than block_size=16' in fails_eval('--mode=eval', out, '--stride=17')
    assert digest(trained / 'ckpt.pt') == before

    # text8 knows only a-z and space
    run(*TINY, '--dataset=text8', f'--data_dir={data}', f'--out_dir={data / "t8"}', '--max_iters=1')
    message = fails_eval('--mode=sample', f'--out_dir={data / "t8"}', '--start=ROMEO:')
    assert "27-symbol vocabulary: ':' 'E' 'M' 'O' 'R'" in message


def test_a_damaged_checkpoint_is_refused_and_left_as_it_is(checkpointed, tmp_path):
    """A checkpoint changed on disk after it was saved (its embedding's floats forged to 3e4, which
    are finite; one flipped bit) fails its archive's CRC-32: sampling, evaluating and resuming each
    refuse it in one line, and nothing overwrites it."""
    wte = torch.load(checkpointed / 'ckpt.pt', weights_only=True)['model']['wte.weight']
    for name, value in (('forged', 3e4), ('flipped', None)):
        out = copy_of(checkpointed, tmp_path, name)
        flip(out / 'ckpt.pt', wte.numel() * 4, value)
        before = digest(out / 'ckpt.pt')
        if value is not None:   # as a user meets it: the process's one line, its exit status
            one_line_error(cli('--mode=sample', f'--out_dir={out}', script='eval_char.py'),
                           f'{out}/ckpt.pt is damaged: its entry archive/data/0 fails its CRC-32 check')
        assert 'fails its CRC-32 check' in fails(f'--out_dir={out}', main=ec.main)
        assert 'fails its CRC-32 check' in fails(f'--out_dir={out}', '--init_from=resume', '--max_iters=12')
        assert 'ckpt.pt exists: continue it with --init_from=resume' in fails(*TINY, f'--out_dir={out}')
        assert digest(out / 'ckpt.pt') == before


def test_a_damaged_optimizer_or_saved_number_is_called_damaged_not_divergence(checkpointed, tmp_path):
    """A negative Adam exp_avg_sq (which would make the loss nan, read as a diverged run), a moment
    of the wrong shape or a step count below 1 (a traceback at the first step), model_args without
    a model field, an infinite elapsed time: one line that
    says the checkpoint is damaged, exit status 1 (not the divergence's 3), the file untouched.
    A min_lr above learning_rate is refused; what eval_char.py writes is JSON without NaN."""
    ckpt = torch.load(checkpointed / 'ckpt.pt', weights_only=True)
    state = {k: dict(s) for k, s in ckpt['optimizer']['state'].items()}
    negative, shape, step = ({k: dict(s) for k, s in state.items()} for _ in range(3))
    negative[0]['exp_avg_sq'] = -negative[0]['exp_avg_sq'] - 1
    shape[0]['exp_avg'] = shape[0]['exp_avg'][:2]
    step[0]['step'] = torch.tensor(-1.0)   # Adam would divide by zero at 0, go wrong below
    cases = dict(negative=(dict(ckpt, optimizer=dict(ckpt['optimizer'], state=negative)), 'negative exp_avg_sq'),
                 shape=(dict(ckpt, optimizer=dict(ckpt['optimizer'], state=shape)), 'its optimizer state has a moment'),
                 step=(dict(ckpt, optimizer=dict(ckpt['optimizer'], state=step)), 'a step count below 1'),
                 fields=(dict(ckpt, model_args={k: v for k, v in ckpt['model_args'].items() if k != 'attn'}),
                         'its model_args lack attn'),
                 elapsed=(dict(ckpt, elapsed=float('inf')), 'elapsed should be numbers of at least 0, and finite'))
    for name, (bad, words) in cases.items():
        (tmp_path / name).mkdir()
        torch.save(bad, tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        args = f'--out_dir={tmp_path / name}', '--init_from=resume', '--max_iters=12'
        last = fails(*args)
        assert words in last and 'damaged' in last and digest(tmp_path / name / 'ckpt.pt') == before
    assert 'min_lr=1.0 is above learning_rate=0.001' in fails(*TINY, f'--out_dir={tmp_path / "never"}', '--min_lr=1.0',
                                                              '--learning_rate=1e-3')
    overflow = dict(ckpt['model'], **{'ln_f.weight': torch.full_like(ckpt['model']['ln_f.weight'], 3e38)})   # finite
    (tmp_path / 'overflow').mkdir()
    torch.save(dict(ckpt, model=overflow), tmp_path / 'overflow' / 'ckpt.pt')
    last = fails(f'--out_dir={tmp_path / "overflow"}', main=ec.main)
    assert 'the val loss of shakespeare is ' in last and last.endswith(": the model's outputs are not finite numbers"), last


def test_checkpoints_damaged_inside_are_refused_before_they_are_used(tmp_path, data_dir):
    """A checkpoint that loads but holds a wrong-typed or negative count, a non-finite weight or optimizer
    moment (bytes overwritten inside a tensor), a weight too few or too many, a vocabulary that is
    not byte values or longer than the embedding, a wrong-typed saved setting or one of the right
    type that no flag may have (batch_size=0), is one line at resume, and never changed."""
    good = tmp_path / 'good'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={good}', '--eval_interval=4', '--max_iters=4'])
    ckpt = torch.load(good / 'ckpt.pt', weights_only=True)
    weight = ckpt['model']['wte.weight'].clone()
    weight[3, 5] = float('nan')                  # one entry
    damaged = {'iter_num': dict(ckpt, iter_num=-4), 'tokens': dict(ckpt, tokens=True),
               'best_val_loss': dict(ckpt, best_val_loss='x'), 'elapsed': dict(ckpt, elapsed=float('nan')), 'weight': dict(ckpt, model=dict(ckpt['model'], **{'wte.weight': weight}))}
    moments = {k: dict(s) for k, s in ckpt['optimizer']['state'].items()}
    moments[0]['exp_avg_sq'] = moments[0]['exp_avg_sq'] * float('inf')
    damaged['moment'] = dict(ckpt, optimizer=dict(ckpt['optimizer'], state=moments))
    damaged['missing'] = dict(ckpt, model={k: v for k, v in ckpt['model'].items() if k != 'ln_f.weight'})
    damaged['extra'] = dict(ckpt, model=dict(ckpt['model'], extra=torch.zeros(1)))
    vocab = ckpt['vocab']
    for k, bad in enumerate([bytes(vocab).decode('latin-1'), [], vocab[:-1] + vocab[:1], vocab[:-1] + [256],
                             vocab[:-1] + [-1], vocab[:-1] + ['z']]):   # a string, none, a repeat, not bytes
        damaged[f'vocab{k}'] = dict(ckpt, vocab=bad)
    damaged['setting'] = dict(ckpt, config=dict(ckpt['config'], learning_rate='x'))
    damaged['setting_bool'] = dict(ckpt, config=dict(ckpt['config'], warmup_iters=True))
    damaged['setting_model'] = dict(ckpt, model_args=dict(ckpt['model_args'], n_layer='2'))
    ranges = dict(range_batch=('batch_size', 0, 'batch_size must be positive, not 0'),
                  range_eval=('eval_interval', 0, 'eval_interval must be positive, not 0'),
                  range_beta=('beta1', 1.5, 'beta1=1.5 must be at least 0 and below 1'),
                  range_seed=('seed', -1, 'seed=-1 must be a whole number'))
    for name, (key, value, _) in ranges.items():   # the right type, a value no flag may have
        damaged[name] = dict(ckpt, config=dict(ckpt['config'], **{key: value}))
    unused = next(b for b in range(256) if b not in vocab)
    damaged['vocab_longer'] = dict(ckpt, vocab=vocab + [unused])   # more symbols than the embedding has rows
    for name, bad in damaged.items():
        (tmp_path / name).mkdir()
        torch.save(bad, tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        message = fails('--init_from=resume', f'--out_dir={tmp_path / name}', f'--data_dir={data_dir}', '--max_iters=8')
        if name in ('missing', 'extra'):
            assert "the checkpoint's weights do not fit the model" in message, message
        elif name in ranges:
            assert f'is damaged: a setting it saved fails its check ({ranges[name][2]}' in message, message
        elif name == 'vocab_longer':
            assert f"its vocab has {len(vocab) + 1} symbols, more than the model's vocab_size={len(vocab)}" in message
        elif name.startswith('vocab'):
            assert 'is damaged: vocab should be a list of distinct byte values' in message, message
        elif name.startswith('setting'):
            setting = dict(setting='learning_rate', setting_bool='warmup_iters', setting_model='n_layer')[name]
            assert f'is damaged: its saved settings {setting} are not' in message, message
        else:
            assert 'is damaged: ' + ('it holds weights or optimizer state that are not finite' if name in ('weight', 'moment')
                                     else f'{name} should be numbers of at least 0') in message, message
        assert digest(tmp_path / name / 'ckpt.pt') == before
    message = fails('--mode=eval', f"--out_dir={tmp_path / 'range_batch'}", main=ec.main)   # eval_char checks alike
    assert 'is damaged: a setting it saved fails its check (batch_size must be positive, not 0)' in message


def test_a_damaged_random_state_is_one_line_at_resume(tmp_path, data_dir):
    """The batch generator's and torch's saved states are only read when the optimizer is restored,
    after the checks above: whatever is wrong with them (not a dict, a tensor cut short, a per-process
    entry of the wrong shape, no entry at all) is the same one line, and the checkpoint is left as it was."""
    good = tmp_path / 'good'
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={good}', '--eval_interval=4', '--max_iters=4'])
    ckpt = torch.load(good / 'ckpt.pt', weights_only=True)
    rng = ckpt['rng']
    damaged = dict(not_a_dict=5, short=dict(rng, batches=rng['batches'][:10]),
                   float_state=dict(rng, batches=rng['batches'].float()), triple=dict(rng, torch=[(1, 2, 3)]),
                   no_list=dict(rng, torch=None), empty=dict(rng, torch=[]))
    for name, bad in damaged.items():
        (tmp_path / name).mkdir()
        torch.save(dict(ckpt, rng=bad), tmp_path / name / 'ckpt.pt')
        before = digest(tmp_path / name / 'ckpt.pt')
        message = fails('--init_from=resume', f'--out_dir={tmp_path / name}', f'--data_dir={data_dir}', '--max_iters=8')
        assert "the checkpoint's optimizer or RNG state does not fit this run" in message, (name, message)
        assert digest(tmp_path / name / 'ckpt.pt') == before


def test_a_resume_in_a_copy_of_a_run_leaves_the_original_alone(tmp_path, data_dir, monkeypatch, capsys):
    """The checkpoint remembers its out_dir, mode and init_from, but they are never taken from it:
    a copied run resumed in the default out_dir carries on there, and eval_char.py without --mode evaluates."""
    tc.main([*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "a"}', '--eval_interval=4', '--max_iters=4'])
    shutil.copytree(tmp_path / 'a', tmp_path / 'out-shakespeare')
    before = digest(tmp_path / 'a' / 'ckpt.pt')
    monkeypatch.chdir(tmp_path)
    tc.main(['--init_from=resume', '--max_iters=8'])
    assert digest(tmp_path / 'a' / 'ckpt.pt') == before
    assert torch.load(tmp_path / 'out-shakespeare' / 'ckpt.pt', weights_only=True)['iter_num'] == 8
    capsys.readouterr()
    ec.main([])
    assert json.loads(capsys.readouterr().out)['iter'] == 8


def test_damaged_checkpoints_get_one_line_that_recommends_nothing_unsafe(tmp_path):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'empty' / 'ckpt.pt').write_bytes(b'')
    (tmp_path / 'random').mkdir()
    (tmp_path / 'random' / 'ckpt.pt').write_bytes(bytes(range(256)) * 8)
    assert 'ckpt.pt is empty (0 bytes), not a checkpoint' in fails('--mode=sample', f'--out_dir={tmp_path / "empty"}', main=ec.main)
    last = fails('--mode=sample', f'--out_dir={tmp_path / "random"}', main=ec.main)
    assert 'is not a readable checkpoint' in last and 'weights_only' not in last and 'UnpicklingError' in last, last
    assert 'weights_only' not in json.dumps(fails('--init_from=resume', f'--out_dir={tmp_path / "random"}'))
    (tmp_path / 'pickle').mkdir()   # a plain pickle (protocol 4), which torch.load warns about before refusing
    (tmp_path / 'pickle' / 'ckpt.pt').write_bytes(pickle.dumps({'model': print}, protocol=4))
    result = cli('--mode=sample', f'--out_dir={tmp_path / "pickle"}', script='eval_char.py')   # the process: the warning too
    one_line_error(result, 'is not a readable checkpoint')
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (tmp_path / 'code').mkdir()   # torch.save'd, holding a function: torch advises allowing it, we do not
    torch.save({'model': print}, tmp_path / 'code' / 'ckpt.pt')
    last = fails('--mode=sample', f'--out_dir={tmp_path / "code"}', main=ec.main)
    assert 'is not a readable checkpoint' in last and 'Unsupported global' in last and 'safe_globals' not in last and 'weights_only' not in last, last


def test_a_negative_elapsed_of_an_older_version_loads_a_nan_one_is_damaged(checkpointed, tmp_path, capsys):
    """A wall clock that stepped back under an older version saved a negative elapsed: eval and a
    resume take the checkpoint, note the number in one line and count it as 0; a NaN elapsed stays
    damaged."""
    out = copy_of(checkpointed, tmp_path)
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    torch.save(ckpt | {'elapsed': -3562.0}, out / 'ckpt.pt')
    note = 'holds a negative training time, elapsed=-3562.0 s (a wall clock that stepped back'
    capsys.readouterr()
    run_eval(f'--out_dir={out}', '--batch_size=1024')
    assert note in capsys.readouterr().err
    run('--init_from=resume', f'--out_dir={out}', '--max_iters=10')
    assert note in capsys.readouterr().err
    resumed = torch.load(out / 'ckpt.pt', weights_only=True)
    assert resumed['iter_num'] == 10 and 0 <= resumed['elapsed'] < 600
    torch.save(ckpt | {'elapsed': float('nan')}, out / 'ckpt.pt')
    assert 'is damaged: elapsed should be numbers of at least 0, and finite' in fails_eval(f'--out_dir={out}')


def test_a_legacy_or_unreadable_checkpoint_is_named_not_called_damaged(checkpointed, tmp_path):
    """An old-format (non-zip) torch.save checkpoint has no CRC-32s to check: refused in one line
    rather than used unverified. A checkpoint the user may not read says so, not "damaged" (read
    by the spare user when the tests run as root, who ignores file modes). A record of its data of
    the wrong form is damaged."""
    ckpt = torch.load(checkpointed / 'ckpt.pt', weights_only=True)
    (tmp_path / 'legacy').mkdir()
    torch.save(ckpt, tmp_path / 'legacy' / 'ckpt.pt', _use_new_zipfile_serialization=False)
    one_line_error(cli('--mode=sample', f'--out_dir={tmp_path / "legacy"}', script='eval_char.py'),
                   f'{tmp_path / "legacy"}/ckpt.pt is not a zip-format checkpoint of train_char.py')
    assert 'not a zip-format checkpoint' in fails('--init_from=resume', f'--out_dir={tmp_path / "legacy"}',
                                                  '--max_iters=12')
    (tmp_path / 'record').mkdir()
    torch.save(ckpt | {'data': dict(ckpt['data'], corpora='shakespeare')}, tmp_path / 'record' / 'ckpt.pt')
    assert 'is damaged: its record of its data' in fails_eval(f'--out_dir={tmp_path / "record"}')
    folder = shared_folder()
    try:
        shutil.copy(checkpointed / 'ckpt.pt', folder / 'ckpt.pt')
        os.chmod(folder / 'ckpt.pt', 0o600)
        if os.geteuid() == 0:
            result = as_spare_user(lambda: fails_eval('--mode=sample', f'--out_dir={folder}'))
        else:
            os.chmod(folder / 'ckpt.pt', 0)
            result = 'returned', fails_eval('--mode=sample', f'--out_dir={folder}')
        assert result == ('returned', f'error: cannot read {folder}/ckpt.pt: permission denied'), result
    finally:
        shutil.rmtree(folder)
