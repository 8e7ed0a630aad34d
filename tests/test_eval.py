"""
eval_char.py: whole-split bpc (every target scored once, for any stride), mix's two corpora,
sampling (its own settings, prompts as bytes, from a file, each sample printed as it is made),
plots of several runs (written whole, never through a link), and its one-line refusals.

    python -m pytest -q tests/test_eval.py
"""
import contextlib
import json
import os
import pathlib
import resource
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import damcha_torch
import data.prepare as prep
import eval_char as ec
import train_char as tc
from run_folder import read_jsonl
from common import (ENV, ROOT, TINY, as_spare_user, cli, digest, fails, fails_eval, limit_memory,
                    one_line_error, run, run_eval, shared_folder, stopped_during_start_up, text_file)


def test_eval_help_names_the_checkpoints_settings_and_its_own_defaults(capsys):
    """eval_char.py -h and --help: its own docstring, then each of its own settings with its default
    (not a value given before the flag), then the settings a checkpoint supplies (the data's and
    the model's, every GPTConfig field), without the defaults a run read from a checkpoint never
    uses; each with a description, and exit status 0."""
    for flag in ('-h', '--help'):
        with pytest.raises(SystemExit) as e:
            ec.main(['--stride=3', flag])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(ec.__doc__.strip())
        own, saved = (part.splitlines() for part in out.split('--key=value):\n')[1:])
        assert [line.split()[0] for line in own[:-1]] == [f'{k}={ec.DEFAULTS[k]!r}' for k in ec.OWN]
        assert [line.split()[0] for line in saved] == ec.FROM_CHECKPOINT
        assert {'dataset', 'seed', 'n_layer', 'gen_out', 'vocab_size'} <= set(ec.FROM_CHECKPOINT)
        assert set(ec.FROM_CHECKPOINT) | set(ec.OWN) == set(ec.DEFAULTS)
        settings = out.removeprefix(ec.__doc__.strip())
        assert 'n_layer=' not in settings and 'gen_out=' not in settings   # defaults never used
        shown = [f'{k}={ec.DEFAULTS[k]!r}' for k in ec.OWN] + ec.FROM_CHECKPOINT
        for line, setting in zip(own[:-1] + saved, shown):   # each with a description
            assert line.startswith(f'  {setting}  '), line
            assert len(line.removeprefix(f'  {setting}').split()) >= 2, line


def test_ctrl_c_during_start_up_is_one_line(trained, tmp_path):
    """Ctrl-C while eval_char.py imports torch, once at its first line and twice 10 ms apart half a
    second later: one line, status 130, never a traceback."""
    for delay, twice in ((0, False), (0.5, True)):
        stopped_during_start_up(tmp_path, 'eval_char.py', f'--out_dir={trained}', delay=delay, twice=twice)


def test_eval_scores_every_token_once(trained, tmp_path, monkeypatch, capsys):
    # a shorter Shakespeare keeps this fast; its vocabulary is a subset of the model's; other data
    # than the run's, so scored only when asked
    small = tmp_path / 'small.txt'
    small.write_bytes(open(prep.BUNDLED, 'rb').read()[:20000])
    monkeypatch.setattr(prep, 'BUNDLED', str(small))
    results = []
    for stride in (0, 5, 16):
        run_eval('--mode=eval', f'--out_dir={trained}', f'--stride={stride}', f'--data_dir={tmp_path}', '--batch_size=64',
                 '--other_data=True')
        out, err = capsys.readouterr()
        results.append(json.loads(out))
        assert 'shakespeare has no test split' in err
    for r, stride in zip(results, (16, 5, 16)):
        assert r['stride'] == stride and r['val_tokens'] == 2000 - 1 and 'test_bpc' not in r
        assert r['val_bpc'] == pytest.approx(r['val_loss'] / np.log(2)) and 1 < r['val_bpc'] < 7
    assert abs(results[0]['val_bpc'] - results[1]['val_bpc']) < 0.2
    assert results[2] == results[0]   # stride = block_size is the default's non-overlapping windows


def test_split_loss_is_the_mean_over_every_target(monkeypatch):
    """split_loss against the loss written out, with a bigram stand-in model (logits from the
    previous token only, so the context a window gives does not matter): every target of a split
    of 103 ids, mapped through lut, scored once, for several strides and batch sizes."""
    W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    class Bigram(torch.nn.Module):
        def forward(self, x, y):
            return W[x], None
    data = np.random.default_rng(0).integers(0, 5, 103).astype(np.uint8)
    lut = np.array([7, 1, 3, 0, 5])                         # the split's ids -> a model's 8-symbol vocabulary
    ids = torch.from_numpy(lut[data.astype(np.int64)])
    want = torch.nn.functional.cross_entropy(W[ids[:-1]], ids[1:]).item()
    monkeypatch.setattr(ec, 'tqdm', lambda it, **_: it)
    for stride in (0, 1, 5, 16):
        for batch_size in (1, 3):
            loss, count = ec.split_loss(Bigram(), data, lut, dict(block_size=16, stride=stride, batch_size=batch_size),
                                          'cpu', contextlib.nullcontext())
            assert count == 102 and loss == pytest.approx(want, rel=1e-6), (stride, batch_size)   # float32 logits


def test_mix_training_and_eval_report_both_corpora(corpora, capsys, monkeypatch):
    data, _ = corpora
    out = data / 'out'
    run(*TINY, '--dataset=mix', f'--data_dir={data}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=2')
    entry = read_jsonl(out / 'log.jsonl')[-1]
    assert entry['val_loss'] == pytest.approx((entry['val_loss_enwik8'] + entry['val_loss_text8']) / 2)
    assert {'val_bpc_enwik8', 'val_bpc_text8', 'train_loss_enwik8', 'train_loss_text8'} <= set(entry)
    assert f"val bpc {entry['val_bpc']:.4f}, enwik8 {entry['val_bpc_enwik8']:.4f}, text8 " in capsys.readouterr().out
    scored = []   # each split's ids, as eval hands them to split_loss
    split_loss = ec.split_loss
    monkeypatch.setattr(ec, 'split_loss', lambda model, ids, *a: scored.append((a[-1], np.array(ids))) or
                        split_loss(model, ids, *a))
    run_eval('--mode=eval', f'--out_dir={out}')
    result = json.loads(capsys.readouterr().out)
    for split in ('val', 'test'):
        assert result[f'{split}_tokens_enwik8'] == result[f'{split}_tokens_text8'] == 199
        assert result[f'{split}_loss'] == pytest.approx((result[f'{split}_loss_enwik8'] + result[f'{split}_loss_text8']) / 2)
        assert result[f'{split}_bpc'] == pytest.approx(result[f'{split}_loss'] / np.log(2))
        assert result[f'{split}_bpc'] == pytest.approx((result[f'{split}_bpc_enwik8'] + result[f'{split}_bpc_text8']) / 2)
    assert [desc for desc, _ in scored] == ['enwik8 val', 'text8 val', 'enwik8 test', 'text8 test']
    for desc, ids in scored:
        name, split = desc.split()
        assert np.array_equal(ids, np.fromfile(data / name / f'{split}.bin', dtype=np.uint8)), desc


def test_sampling_says_it_runs_uncompiled(trained, capsys):
    """compile=True serves eval; sampling says it runs uncompiled."""
    run_eval('--mode=sample', f'--out_dir={trained}', '--compile=True', '--max_new_tokens=5')
    out, err = capsys.readouterr()
    assert 'note: compile=True applies to --mode=eval; sampling runs the model uncompiled' in err and out


def test_sampling_settings_and_compile_are_eval_chars_own(trained, tmp_path, capsys):
    """The trainer's settings for its end-of-run sample (TINY: 20 new characters) stay with it, and
    so does compile (the GPU configs set it; the run may be evaluated on a CPU)."""
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    (tmp_path / 'run').mkdir()
    torch.save(ckpt | {'config': ckpt['config'] | {'compile': True, 'num_samples': 3}}, tmp_path / 'run' / 'ckpt.pt')
    run_eval('--mode=sample', f"--out_dir={tmp_path / 'run'}", '--start=ROMEO:')
    out, err = capsys.readouterr()
    sample = out.removesuffix('\n---------------\n')
    assert sample.startswith('ROMEO:') and len(sample) == len('ROMEO:') + ec.DEFAULTS['max_new_tokens'] == 506
    assert 'compile=True' not in err and out.count('---------------') == 1


def test_sample_from_a_file_prompt(trained, tmp_path, capsys):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('Ham.\n')
    run_eval('--mode=sample', f'--out_dir={trained}', f'--start=FILE:{prompt}', '--max_new_tokens=30', '--seed=1')
    first = capsys.readouterr().out
    assert first.startswith('Ham.\n') and first.endswith('---------------\n')
    run_eval('--mode=sample', f'--out_dir={trained}', f'--start=FILE:{prompt}', '--max_new_tokens=30', '--seed=1')
    assert capsys.readouterr().out == first   # the seed fixes the sample


def test_samples_are_printed_as_they_are_generated(trained, monkeypatch, capsys):
    """eval_char.py --mode=sample prints and flushes each sample before it generates the next, so
    a long run of samples shows them one by one rather than all at the end."""
    seen, flushes = [], []   # at each generate: what was printed, and how often stdout was flushed

    class Recording(damcha_torch.GPT):
        def generate(self, *args, **kwargs):
            seen.append((capsys.readouterr().out, len(flushes)))
            return super().generate(*args, **kwargs)

    class Stdout:
        def write(self, text):
            return real.write(text)

        def flush(self):
            flushes.append(1)
            real.flush()
    real = sys.stdout
    monkeypatch.setattr(sys, 'stdout', Stdout())
    monkeypatch.setattr(ec, 'GPT', Recording)
    run_eval('--mode=sample', f'--out_dir={trained}', '--start=ROMEO:', '--num_samples=3', '--max_new_tokens=5')
    seen.append((capsys.readouterr().out, len(flushes)))
    assert seen[0] == ('', 0)
    for k, (printed, flushed) in enumerate(seen[1:]):   # after each sample: that sample, printed and flushed
        assert printed.startswith('ROMEO:') and printed.endswith('\n---------------\n') and len(printed) == 6 + 5 + 17
        assert flushed >= k + 1


def test_plot_of_several_runs(trained, tmp_path):
    png = tmp_path / 'bpc.png'
    run_eval('--mode=plot', f'--out_dir={trained}, {trained}', f'--plot_file={png}')   # a space after the comma
    with open(png, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    import matplotlib.pyplot as plt
    log = read_jsonl(trained / 'log.jsonl')
    by_tokens, by_time = plt.gcf().axes   # val bpc against tokens, and against minutes: a line per run
    for ax, x in ((by_tokens, [e['tokens'] for e in log]), (by_time, [e['time'] / 60 for e in log])):
        assert len(ax.lines) == 2
        for line in ax.lines:
            assert list(line.get_xdata()) == x and list(line.get_ydata()) == [e['val_bpc'] for e in log]
    plt.close('all')
    for d in ('first', 'second'):
        (tmp_path / d).mkdir()
        shutil.copy(trained / 'log.jsonl', tmp_path / d)
    run_eval('--mode=plot', f"--out_dir={tmp_path / 'first'},{tmp_path / 'second'}")   # no plot_file: the first run's folder
    assert os.path.exists(tmp_path / 'first' / 'bpc.png') and not os.path.exists(tmp_path / 'second' / 'bpc.png')
    assert 'log.jsonl' in fails_eval('--mode=plot', f'--out_dir={tmp_path}')
    damaged = tmp_path / 'damaged'
    damaged.mkdir()
    entries = (trained / 'log.jsonl').read_text().splitlines()
    for key in ('val_bpc', 'tokens', 'time'):
        first = json.loads(entries[0])
        del first[key]
        (damaged / 'log.jsonl').write_text('\n'.join([json.dumps(first)] + entries[1:]) + '\n')
        assert 'has an entry without val_bpc, tokens or time' in fails_eval('--mode=plot', f'--out_dir={damaged}')


def test_an_unwritable_plot_file_is_one_line(trained, tmp_path):
    """A plot_file in a folder that does not exist, or one that is itself a folder: the system's
    reason in one line, and nothing made."""
    missing = tmp_path / 'no' / 'bpc.png'
    message = fails_eval('--mode=plot', f'--out_dir={trained}', f'--plot_file={missing}')
    assert f'no folder {missing.parent} to write {missing} in' in message and 'partial' not in message
    folder = tmp_path / 'bpc.png'
    folder.mkdir()
    assert 'Is a directory' in fails_eval('--mode=plot', f'--out_dir={trained}', f'--plot_file={folder}')
    assert sorted(os.listdir(tmp_path)) == ['bpc.png'] and os.listdir(folder) == []


def test_a_plot_is_written_whole_and_never_through_a_link(trained, tmp_path):
    """A plot past the file-size limit (as a full disk would stop it) leaves the old plot whole
    and no partial file; a link where the plot belongs is refused in one line naming it, and the
    file it points to is unchanged."""
    png = tmp_path / 'bpc.png'
    run_eval('--mode=plot', f'--out_dir={trained}', f'--plot_file={png}')
    before = digest(png)
    assert os.path.getsize(png) > 16384
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    result = subprocess.run([sys.executable, 'eval_char.py', '--mode=plot', f'--out_dir={trained}',
                             f'--plot_file={png}'], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=120, preexec_fn=limit)
    one_line_error(result, 'the file size limit (ulimit -f) was reached')
    assert digest(png) == before and os.listdir(tmp_path) == ['bpc.png']
    victim = tmp_path / 'thesis.svg'
    victim.write_text('years of work')
    link = tmp_path / 'bpc.svg'
    link.symlink_to(victim)
    assert f'{link} is a symbolic link: refusing to write through it; remove it' in fails_eval(
        '--mode=plot', f'--out_dir={trained}', f'--plot_file={link}')
    assert victim.read_text() == 'years of work' and link.is_symlink()


def test_eval_runs_the_model_without_dropout(trained, tmp_path, monkeypatch, capsys):
    """eval scores the model in eval mode: with dropout set (--dropout and --attn_dropout 0.5), the
    result is the same on every run, and the same as without dropout."""
    small = tmp_path / 'small.txt'   # a shorter Shakespeare keeps this fast (other data: a flag)
    small.write_bytes(open(prep.BUNDLED, 'rb').read()[:20000])
    monkeypatch.setattr(prep, 'BUNDLED', str(small))
    results = []
    for dropout in (0.5, 0.5, 0.0):
        run_eval('--mode=eval', f'--out_dir={trained}', f'--data_dir={tmp_path}', '--batch_size=64',
                 f'--dropout={dropout}', f'--attn_dropout={dropout}', '--other_data=True')
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1] == results[2] and results[0]['val_tokens'] == 2000 - 1


def test_eval_refuses_a_split_too_short_for_one_window(trained, tmp_path, capsys):
    """A scored window is block_size + 1 tokens: a val split of exactly block_size (16) tokens is
    refused in one line, not a traceback from the scoring; one of 17 is scored."""
    text = tmp_path / 'short.txt'
    text.write_bytes(b'abcd' * 80)   # 90 / 5 / 5 of 320: val and test 16 tokens each
    other = f'--dataset={text}', f'--data_dir={tmp_path}', '--other_data=True'   # not the run's data
    message = fails_eval('--mode=eval', f'--out_dir={trained}', *other)
    assert message == f'error: the val split of {text} has 16 tokens, too few for block_size=16'
    text.write_bytes(b'abcd' * 85)   # of 340: 17 each
    run_eval('--mode=eval', f'--out_dir={trained}', *other)
    result = json.loads(capsys.readouterr().out)
    assert result['val_tokens'] == result['test_tokens'] == 16


@pytest.fixture(scope='module')
def byte_model(tmp_path_factory, data_dir):
    """A model of a corpus that is not UTF-8 (bytes 0xfe and 0xff) and has no newline or space."""
    folder = tmp_path_factory.mktemp('bytes')
    corpus = folder / 'raw.bin'
    corpus.write_bytes(b'ab\xffcd\xfe' * 400)
    tc.main([*TINY, f'--dataset={corpus}', f'--data_dir={data_dir}', f'--out_dir={folder / "out"}',
             '--max_iters=1', '--start=a'])
    return folder


def test_prompts_are_bytes(byte_model, data_dir, capsys):
    out = f'--out_dir={byte_model / "out"}'
    prompt = byte_model / 'prompt'
    prompt.write_bytes(b'a\xff')   # a FILE: prompt is read as bytes, UTF-8 or not
    capsys.readouterr()
    ec.main(['--mode=sample', out, f'--start=FILE:{prompt}'])
    assert capsys.readouterr().out.startswith('a\ufffd')
    # typed bytes that are not UTF-8 too: Python hands them to main as sys.argv does, surrogate-escaped
    ec.main(['--mode=sample', out, os.fsdecode(b'--start=c\xfe')])
    assert capsys.readouterr().out.startswith('c\ufffd')
    typed = byte_model / 'typed'   # the trainer too, a process typed bytes: its lock file names the command as typed
    result = cli(*TINY, f'--dataset={byte_model / "raw.bin"}', f'--data_dir={data_dir}', f'--out_dir={typed}',
                 '--max_iters=1', b'--start=c\xfe')
    assert result.returncode == 0 and b'--start=c\xfe' in (typed / 'train.lock').read_bytes(), result.stderr[-2000:]
    config = byte_model / 'surrogate.py'
    config.write_text('start = "\\ud800"\n')   # a str that has no bytes
    assert 'the prompt cannot be written as bytes' in fails('--mode=sample', out, config, main=ec.main)
    assert "outside the model's 6-symbol vocabulary: b'\\x80'" in fails('--mode=sample', out, '--start=a\udc80', main=ec.main)
    # with no prompt given, an empty --start stands for a newline or a space, which this corpus lacks
    assert 'the dataset has neither a newline nor a space' in fails(*TINY, f'--dataset={byte_model / "raw.bin"}',
                                                                    f'--data_dir={data_dir}', f'--out_dir={byte_model / "never"}')
    assert not os.path.exists(byte_model / 'never')   # out_dir is made (and locked) once the input is checked


def test_a_dataset_too_big_for_memory_names_the_dataset_not_the_eval_settings(tmp_path, trained):
    """Evaluated on a text file whose preparation cannot fit under ulimit -v, a run ends in one line
    naming the dataset and the limit, not batch_size or block_size, which had no part in it."""
    big = tmp_path / 'big.txt'
    with open(big, 'wb') as f:   # 400 MB of zero bytes, sparse: its token ids need 3.2 GB as int64
        f.truncate(400 * 10**6)
    result = cli(f'--out_dir={trained}', f'--dataset={big}', f'--data_dir={tmp_path / "data"}',
                 script='eval_char.py', preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, f'out of memory preparing or loading the dataset {big} (')
    assert 'ulimit -v' in result.stderr and 'lower' not in result.stderr


def test_eval_is_held_to_the_data_its_checkpoint_records(tmp_path, monkeypatch, capsys):
    """A run on notes.txt, evaluated from another folder holding another notes.txt: one line that
    they are not its data, and a score of them only with --other_data=True; from a folder without
    one, the run's own file at its recorded path; the file appended to is noticed. A checkpoint of
    an older version, which records no digests, is evaluated with a note."""
    for folder, seed in (('a', 0), ('b', 5)):
        text_file(tmp_path / folder / 'notes.txt', seed=seed, size=20_000)
    (tmp_path / 'c').mkdir()
    out, flags = f'--out_dir={tmp_path / "out"}', (f'--data_dir={tmp_path / "data"}', '--batch_size=64')
    monkeypatch.chdir(tmp_path / 'a')
    run(*TINY, '--dataset=notes.txt', out, *flags, '--max_iters=2', '--eval_interval=2')

    def scores(*argv):   # (its JSON, its stderr)
        capsys.readouterr()
        run_eval(out, *flags, *argv)
        printed, err = capsys.readouterr()
        return json.loads(printed), err
    good, _ = scores()
    monkeypatch.chdir(tmp_path / 'b')
    message = fails_eval(out, *flags)
    assert message.startswith(f"error: notes.txt, prepared in {prep.text_file_dir('notes.txt', str(tmp_path / 'data'))}, "
                              f"is not the data {tmp_path / 'out'}/ckpt.pt was trained on (notes.txt, "
                              f"{tmp_path / 'a' / 'notes.txt'}): its test.bin, train.bin, val.bin differ"), message
    other, err = scores('--other_data=True')
    assert other['val_bpc'] != good['val_bpc'] and '--other_data=True: they are scored' in err
    monkeypatch.chdir(tmp_path / 'c')
    found, err = scores()
    assert found == good | {'dataset': str(tmp_path / 'a' / 'notes.txt')}
    assert f"note: the dataset notes.txt is not here: reading the run's {tmp_path / 'a' / 'notes.txt'}\n" in err
    with open(tmp_path / 'a' / 'notes.txt', 'ab') as f:
        f.write(b'abc ' * 100)
    assert 'its test.bin, train.bin, val.bin differ' in fails_eval(out, *flags)
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k != 'data'}, tmp_path / 'out' / 'ckpt.pt')
    monkeypatch.chdir(tmp_path / 'a')   # the name as given is all it has
    _, err = scores()
    assert 'records no digests of its data (saved by an older version)' in err


def test_a_checkpoint_never_decides_where_data_are_written(tmp_path, capsys):
    """A checkpoint's saved data_dir is read from where it holds the checkpoint's data, never
    prepared into: re-saved to name a shared folder, with its dataset a 0600 file, eval prepares in
    the data_dir given, into a folder (and files) that only the file's owner may read: the spare
    user, when the tests run as root, reads a 0644 file beside it but not the prepared split."""
    folder = shared_folder()
    try:
        secret = text_file(folder / 'secret.txt', seed=3, size=20_000)
        secret.chmod(0o600)
        out = tmp_path / 'out'
        run(*TINY, f'--dataset={secret}', f'--data_dir={folder / "mine"}', f'--out_dir={out}', '--max_iters=2',
            '--eval_interval=2')
        capsys.readouterr()
        run_eval(f'--out_dir={out}', '--batch_size=64')   # its data_dir holds its data: nothing prepared
        assert 'prepared' not in capsys.readouterr().err
        shared = folder / 'shared'
        shared.mkdir()
        shared.chmod(0o777)
        ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
        torch.save(ckpt | {'config': ckpt['config'] | {'data_dir': str(shared)}}, out / 'ckpt.pt')
        run_eval(f'--out_dir={out}', f'--data_dir={folder / "user"}', '--batch_size=64')
        prepared = pathlib.Path(prep.text_file_dir(str(secret), str(folder / 'user')))
        assert os.listdir(shared) == [] and f'prepared {prepared}' in capsys.readouterr().err
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [prepared, *prepared.iterdir()]}
        assert modes.keys() == {prepared.name, 'train.bin', 'val.bin', 'test.bin', 'meta.json'}
        assert all(mode & 0o077 == 0 for mode in modes.values()), modes
        public = folder / 'public.txt'
        public.write_text('x')
        public.chmod(0o644)
        if os.geteuid() == 0:
            assert as_spare_user(public.read_text) == ('returned', 'x')
            kind, why = as_spare_user((prepared / 'train.bin').read_bytes)
            assert kind == 'raised' and why.startswith('PermissionError'), why
    finally:
        shutil.rmtree(folder)
