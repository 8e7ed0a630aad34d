"""
Tests of reproduce.py: a tiny sweep (one seed, a few iterations, a one-layer model) writes the
per-run logs and eval JSON, summary.json and summary.md with a row per variant, DAMCHA at MHA's
parameter count within 5%, the float16 weight snapshots of the run named by --snapshot, and a
rerun skips every finished run. A device the machine lacks is refused before any download. A
diverged run is recorded in JSON without infinity; SIGTERM stops the sweep's training run, and the
same command resumes it.

    python -m pytest -q tests/test_reproduce.py
"""
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import train_char
from common import ENV, ROOT, lab_runs_in_process, sigint_default, wait_for
from lab import reproduce
from run_folder import RunFolder, read_jsonl

VARIANTS = ('mha', 'damcha', 'damcha_static')


def sweep_args(tmp_path, variants=VARIANTS):
    # batch 1024: the whole-split evaluations run in batches of batch_size and are most of the time
    return ['--seeds=1', '--max_iters=6', '--eval_interval=3', '--eval_iters=2', '--n_layer=1', '--n_embd=32',
            '--n_head=2', '--block_size=16', '--batch_size=1024', '--max_new_tokens=5', '--device=cpu',
            f"--variants={','.join(variants)}", f"--results={tmp_path / 'results'}",
            f"--out_root={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}"]


@pytest.fixture(scope='module', autouse=True)
def settings_resolved_once():
    """reproduce.train_char_settings, a train_char.py --mode=config subprocess and most of the time of
    a rerun that only summarizes, run once per distinct config files and flags in this module: what
    it returns depends on them alone. A call that fails is not kept, and fails again when repeated."""
    resolve, resolved = reproduce.train_char_settings, {}

    def once(files, settings):
        key = json.dumps([list(files), settings], sort_keys=True)
        if key not in resolved:
            resolved[key] = json.dumps(resolve(files, settings))
        return json.loads(resolved[key])   # a fresh copy: a caller may change what it is given
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reproduce, 'train_char_settings', once)
        yield


@pytest.fixture
def in_process(monkeypatch, capfd):
    """reproduce.main(argv) in this process (its train_char.py and eval_char.py runs are still
    subprocesses, which do not inherit tests/test_kernel.py's TRITON_INTERPRET), returning what it
    and its subprocesses printed to stdout."""
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)

    def main(argv):
        capfd.readouterr()
        reproduce.main(argv)
        return capfd.readouterr().out
    return main


@pytest.mark.slow
def test_tiny_sweep_and_rerun(tmp_path, in_process):
    in_process(sweep_args(tmp_path))
    results = tmp_path / 'results'
    for v in VARIANTS:
        assert (results / f'{v}-seed1.log.jsonl').read_text().strip()
        evaluation = json.loads((results / f'{v}-seed1.eval.json').read_text())
        assert math.isfinite(evaluation['val_bpc']) and evaluation['iter'] == 6
    summary = json.loads((results / 'summary.json').read_text())
    rows = {r['variant']: r for r in summary['rows']}
    assert list(rows) == list(VARIANTS)
    for r in rows.values():
        assert r['runs'] == 1 and math.isfinite(r['val_bpc_mean']) and r['test_bpc_mean'] is None   # no test split
    assert abs(rows['damcha']['params'] / rows['mha']['params'] - 1) <= 0.05
    assert rows['damcha']['within_5pct'] and not rows['damcha_static']['within_5pct']
    table = (results / 'summary.md').read_text()
    for v in VARIANTS:
        assert f'| {v} |' in table
    assert 'not within 5%' in table and 'damcha_static' in table.split('\n')[-2]

    # --snapshot=damcha-seed1 (the default): weights at 0, 2.5%, 10%, 30% and 100% of the 6 iterations
    snapshots = results / 'snapshots'
    assert sorted(p.name for p in snapshots.iterdir()) == ['damcha-seed1']
    assert sorted(p.name for p in (snapshots / 'damcha-seed1').iterdir()) == [
        f'snapshot-{i}.pt' for i in (0, 1, 2, 6)]
    start, end = (torch.load(snapshots / 'damcha-seed1' / f'snapshot-{i}.pt', weights_only=True) for i in (0, 6))
    final = torch.load(tmp_path / 'out' / 'damcha-seed1' / 'ckpt.pt', weights_only=True)['model']
    assert end['iter_num'] == 6 and end['model'].keys() == final.keys()
    for k, w in final.items():
        assert end['model'][k].dtype == torch.float16 and torch.equal(end['model'][k], w.half())
    assert any(not torch.equal(start['model'][k], end['model'][k]) for k in final)

    out = in_process(sweep_args(tmp_path))
    assert out.count('skip ') == len(VARIANTS) and 'train ' not in out


def test_a_split_sweep_summarizes_the_runs_the_other_process_finished_meanwhile(tmp_path, monkeypatch):
    """Two processes side by side, --variants=damcha and --variants=mha,damcha_static: while damcha
    trains, the other finishes mha and damcha_static's seed 1 of 2. damcha's process, finishing last,
    must write every row, in the table's order. The runs are stand-ins that write eval JSON."""
    lab_runs_in_process(monkeypatch)   # train_char.py --mode=config, which gives the settings

    def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, *rest, **kw):
        for name, bpc in ((run, 4.0), ('mha-seed1', 3.0), ('mha-seed2', 3.1), ('damcha_static-seed1', 5.0)):
            write_run(pathlib.Path(results), name, bpc, [(0, bpc + 1), (10, bpc)])
        return dict(val_bpc=4.0)
    monkeypatch.setattr(reproduce, 'train_and_evaluate', train_and_evaluate)
    reproduce.main(sweep_args(tmp_path, variants=('damcha',)) + ['--seeds=2'])
    rows = json.loads((tmp_path / 'results' / 'summary.json').read_text())['rows']
    assert [(r['variant'], r['val_bpc']) for r in rows] == [('mha', [3.0, 3.1]), ('damcha', [4.0, 4.0]),
                                                             ('damcha_static', [5.0])]


def test_a_split_study_summarizes_what_the_other_process_finished(tmp_path, monkeypatch):
    """The study's regimes split over processes: in the LR sweep another variant joins the summary
    once its whole grid is done (damcha, not static with one rate), with the rate and parameter count
    a run of it alone gives; in regime one_pass, once it has a chosen rate and a finished seed (damcha,
    not proj, which has no rate)."""
    lab_runs_in_process(monkeypatch)   # train_char.py --mode=config, which gives the settings
    args = ['--study=2x2', '--max_iters=4', '--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16',
            '--device=cpu', f"--out_root={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}"]
    others = {'sweep_one_pass': [('damcha-lr0.001', 2.5), ('damcha-lr0.002', 2.4), ('static-lr0.001', 2.7)],
              'one_pass': [('damcha-seed1', 2.1), ('proj-seed1', 2.2)]}

    def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, *rest, **kw):
        for name, bpc in [(run, 2.0)] + others[os.path.basename(results)]:
            write_run(pathlib.Path(results), name, bpc, [(0, bpc + 1), (10, bpc)])
        return dict(val_bpc=2.0)
    monkeypatch.setattr(reproduce, 'train_and_evaluate', train_and_evaluate)
    lr_args = ['--regime=sweep_one_pass', '--lr_grid=1e-3,2e-3']
    reproduce.main(args + lr_args + ['--variants=mha', f"--results={tmp_path / 'split'}"])
    lr = json.loads((tmp_path / 'split' / 'sweep_one_pass' / 'summary.json').read_text())
    assert list(lr['held_out_bpc']) == ['mha', 'damcha'] and lr['chosen_lr'] == {'mha': 0.001, 'damcha': 0.002}
    others['sweep_one_pass'] = []
    reproduce.main(args + lr_args + ['--variants=mha,damcha', f"--results={tmp_path / 'alone'}"])
    params = lambda where: [line for line in (tmp_path / where / 'sweep_one_pass' / 'summary.md').read_text().splitlines()
                            if line.startswith('| damcha |')][0].split('|')[2]
    assert params('split') == params('alone')

    (tmp_path / 'split' / 'sweep_one_pass' / 'summary.json').write_text(json.dumps(dict(chosen_lr=dict(mha=1e-3, damcha=2e-3,
                                                                                               static=1e-3))))
    reproduce.main(args + ['--regime=one_pass', '--variants=mha', '--seeds=2', f"--results={tmp_path / 'split'}"])
    rows = json.loads((tmp_path / 'split' / 'one_pass' / 'summary.json').read_text())['rows']
    assert [(r['variant'], r['runs']) for r in rows] == [('mha', 2), ('damcha', 1)]


def test_copies_of_one_command_share_its_runs(tmp_path, monkeypatch):
    """A run another process holds (its claim.lock) is skipped, not trained twice nor refused; once
    that process has let go, the next copy of the command trains it."""
    lab_runs_in_process(monkeypatch)   # train_char.py --mode=config, which gives the settings
    trained = []

    def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, *rest, **kw):
        trained.append(run)
        write_run(pathlib.Path(results), run, 2.0, [(0, 3.0), (10, 2.0)])
        return dict(val_bpc=2.0)
    monkeypatch.setattr(reproduce, 'train_and_evaluate', train_and_evaluate)
    (tmp_path / 'results' / 'sweep_one_pass').mkdir(parents=True)
    (tmp_path / 'results' / 'sweep_one_pass' / 'summary.json').write_text(json.dumps(dict(chosen_lr=dict(mha=1e-3, damcha=2e-3))))
    args = ['--study=2x2', '--regime=one_pass', '--seeds=2', '--variants=mha,damcha', '--max_iters=4', '--n_layer=1',
            '--n_embd=32', '--n_head=2', '--block_size=16', '--device=cpu', f"--out_root={tmp_path / 'out'}",
            f"--data_dir={tmp_path / 'data'}", f"--results={tmp_path / 'results'}"]
    other = reproduce.claim(str(tmp_path / 'out' / 'one_pass' / 'damcha-seed1'))   # another process's
    reproduce.main(args)
    assert trained == ['mha-seed1', 'mha-seed2', 'damcha-seed2']
    other.close()
    reproduce.main(args)
    assert trained[3:] == ['damcha-seed1']
    rows = json.loads((tmp_path / 'results' / 'one_pass' / 'summary.json').read_text())['rows']
    assert [(r['variant'], r['runs']) for r in rows] == [('mha', 2), ('damcha', 2)]


def test_a_link_as_claim_lock_or_a_result_is_refused_and_left_alone(tmp_path):
    """A symbolic link as a run's claim.lock, or where the study writes a result, is refused in one
    line naming it: the file it points to keeps every byte and the link stays."""
    victim = tmp_path / 'thesis.txt'
    victim.write_text('years of work')
    out, results = tmp_path / 'out' / 'mha-seed1', tmp_path / 'results'
    out.mkdir(parents=True)
    results.mkdir()
    (out / 'claim.lock').symlink_to(victim)
    with pytest.raises(SystemExit, match=f'error: {out}/claim.lock is a symbolic link: refusing to write through'):
        reproduce.claim(str(out))
    (results / 'summary.md').symlink_to(victim)
    with pytest.raises(SystemExit, match=f'error: {results}/summary.md is a symbolic link: refusing to write'):
        reproduce.lr_summary(['mha'], [1e-3], dict(mha=1), str(results), 'abc')
    assert victim.read_text() == 'years of work' and (out / 'claim.lock').is_symlink()
    assert (results / 'summary.md').is_symlink()


def test_three_passes_dropout_at_the_rates_of_its_own_length_retrains_only_what_changed(tmp_path, monkeypatch):
    """three_passes_dropout_own_rates trains at sweep_three_passes_dropout's rates; a run of
    three_passes_dropout at the same rate and seed is that run (copied with its log), one at another
    rate is trained."""
    lab_runs_in_process(monkeypatch)   # train_char.py --mode=config, which gives the settings
    trained = []

    def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, *rest, **kw):
        trained.append((run, settings['learning_rate']))
        write_run(pathlib.Path(results), run, 2.0, [(0, 3.0), (10, 2.0)])
        return dict(val_bpc=2.0)
    monkeypatch.setattr(reproduce, 'train_and_evaluate', train_and_evaluate)
    study = tmp_path / 'results'
    for sweep, rates in (('sweep_one_pass', dict(mha=4e-3, proj=2e-3)),
                         ('sweep_three_passes_dropout', dict(mha=4e-3, proj=4e-3))):
        (study / sweep).mkdir(parents=True)
        (study / sweep / 'summary.json').write_text(json.dumps(dict(chosen_lr=rates)))
    first = study / 'three_passes_dropout'
    first.mkdir()
    for v, lr in (('mha', 4e-3), ('proj', 2e-3)):
        (first / f'{v}-seed1.log.jsonl').write_text(json.dumps(dict(iter=0, time=0.0, val_bpc=3.0, val_loss=2.0, train_loss=2.0)) + '\n')
        (first / f'{v}-seed1.eval.json').write_text(json.dumps(dict(val_bpc=2.5 if v == 'mha' else 2.4, iter=4, commit='first',
                                                                    learning_rate=lr, min_lr=lr / 10, seed=1)))
    reproduce.main(['--study=2x2', '--regime=three_passes_dropout_own_rates', '--seeds=1', '--variants=mha,proj',
                    '--max_iters=4', '--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--device=cpu',
                    f"--out_root={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}", f'--results={study}'])
    assert trained == [('proj-seed1', 4e-3)]
    again = study / 'three_passes_dropout_own_rates'
    copied = json.loads((again / 'mha-seed1.eval.json').read_text())
    assert copied['commit'] == 'first' and copied['val_bpc'] == 2.5
    rows = {r['variant']: r for r in json.loads((again / 'summary.json').read_text())['rows']}
    assert rows['proj']['lr'] == 4e-3 and rows['proj']['diff_equal_steps'][0] == pytest.approx(2.0 - 2.5)


# The commands that wrote the committed results (README), each with its folder under results/
COMMITTED = [('charlevel/shakespeare', ['--device=cpu']),
             ('study2x2/sweep_one_pass', ['--study=2x2', '--regime=sweep_one_pass', '--lr_grid=1e-3,2e-3,4e-3,8e-3',
                                          '--device=cpu']),
             ('study2x2/one_pass', ['--study=2x2', '--regime=one_pass', '--device=cpu', '--snapshot=damcha_full-seed1']),
             ('study2x2/three_passes_dropout', ['--study=2x2', '--regime=three_passes_dropout', '--device=cpu']),
             ('study2x2/one_pass_dropout', ['--study=2x2', '--regime=one_pass_dropout', '--variants=mha,proj,damcha',
                                            '--device=cpu']),
             ('study2x2/three_passes', ['--study=2x2', '--regime=three_passes', '--variants=mha,proj,damcha',
                                        '--device=cpu']),
             ('study2x2/sweep_three_passes_dropout', ['--study=2x2', '--regime=sweep_three_passes_dropout',
                                                      '--variants=mha,proj,damcha', '--lr_grid=1e-3,2e-3,4e-3,8e-3',
                                                      '--device=cpu']),
             ('study2x2/sweep_d256', ['--study=2x2', '--regime=sweep_d256', '--variants=mha,proj,damcha',
                                      '--lr_grid=1e-3,2e-3,4e-3,8e-3', '--device=cpu']),
             ('study2x2/three_passes_dropout_own_rates', ['--study=2x2', '--regime=three_passes_dropout_own_rates',
                                                          '--variants=mha,proj,damcha', '--device=cpu']),
             ('study2x2/d256_three_passes_dropout', ['--study=2x2', '--regime=d256_three_passes_dropout',
                                                     '--variants=mha,proj,damcha', '--seeds=3', '--device=cpu'])]


@pytest.mark.slow
def test_committed_summaries_are_what_a_rerun_writes(tmp_path, capsys, monkeypatch):
    """Rerun on a copy of results/, every run is skipped and each summary is written again: it must
    come out as committed (the studies' summary.json byte for byte: an unchanged one keeps the
    commit it was written at). A change to the code that changes a summary (a default setting, a
    statistic) must come with the summary rewritten. (train_char.py --mode=config, which gives the
    settings, runs in this process.)"""
    lab_runs_in_process(monkeypatch)
    shutil.copytree(os.path.join(ROOT, 'results'), tmp_path / 'results', ignore=shutil.ignore_patterns('snapshots'))
    without_commit = lambda path: {k: v for k, v in json.loads(open(path).read()).items() if k != 'commit'}
    for folder, args in COMMITTED:
        where = tmp_path / 'results' / folder
        results = where if folder.startswith('charlevel') else where.parent
        reproduce.main([*args, f'--results={results}', f"--out_root={tmp_path / 'out'}"])
        assert 'done ' not in capsys.readouterr().out
        committed = os.path.join(ROOT, 'results', folder)
        assert without_commit(where / 'summary.json') == without_commit(os.path.join(committed, 'summary.json')), folder
        if folder.startswith('study'):
            assert (where / 'summary.json').read_bytes() == open(os.path.join(committed, 'summary.json'), 'rb').read()
        assert (where / 'summary.md').read_text() == open(os.path.join(committed, 'summary.md')).read(), folder
    for name in ('factors.json', 'factors.md', 'changes.json', 'changes.md'):   # which each seed regime writes
        written = tmp_path / 'results' / 'study2x2' / name
        assert written.read_bytes() == open(os.path.join(ROOT, 'results', 'study2x2', name), 'rb').read(), name

    # the same results asked for with other settings: refused, not summarized beside them
    charlevel = f"--results={tmp_path / 'results' / 'charlevel' / 'shakespeare'}"
    for more, words in ((['--max_iters=5'], 'ran with iter=10000, not 5 as asked now'),
                        (['--block_size=32'], 'ran with block_size=64, not 32')):
        with pytest.raises(SystemExit, match=words):
            reproduce.main(['--device=cpu', charlevel, f"--out_root={tmp_path / 'out'}", *more])
    study = [f"--results={tmp_path / 'results' / 'study2x2'}", f"--out_root={tmp_path / 'out'}"]
    lr_summary = tmp_path / 'results' / 'study2x2' / 'sweep_one_pass' / 'summary.json'
    lr = json.loads(lr_summary.read_text())
    lr_summary.write_text(json.dumps(lr | {'chosen_lr': lr['chosen_lr'] | {'mha': 0.002}}))   # chosen anew since
    with pytest.raises(SystemExit, match='mha-seed1 ran with learning_rate=0.004, not 0.002'):
        reproduce.main(['--study=2x2', '--regime=one_pass', '--device=cpu', *study])
    lr_summary.write_text(json.dumps(lr))
    with pytest.raises(SystemExit, match='ran with block_size=64, not 32'):
        reproduce.main(['--study=2x2', '--regime=one_pass', '--device=cpu', '--block_size=32', *study])
    mha_run = tmp_path / 'results' / 'study2x2' / 'one_pass' / 'mha-seed1.eval.json'
    recorded = mha_run.read_text()
    mha_run.write_text(json.dumps(json.loads(recorded) | {'seed': 2}))   # another seed's run under this name
    with pytest.raises(SystemExit, match='mha-seed1 ran with seed=2, not 1'):
        reproduce.main(['--study=2x2', '--regime=one_pass', '--device=cpu', *study])
    mha_run.write_text(recorded)
    other = tmp_path / 'results' / 'study2x2' / 'one_pass' / 'damcha-seed1.eval.json'   # a variant this process does not run
    other.write_text(json.dumps(json.loads(other.read_text()) | {'params': 123}))
    with pytest.raises(SystemExit, match='damcha-seed1 ran with params=123, not '):
        reproduce.main(['--study=2x2', '--regime=one_pass', '--device=cpu', '--variants=mha', *study])
    damcha = tmp_path / 'results' / 'charlevel' / 'shakespeare' / 'damcha-seed1.eval.json'   # another variant's
    damcha.write_text(json.dumps(json.loads(damcha.read_text()) | {'params': 123}))   # as a run of another model records
    with pytest.raises(SystemExit, match='damcha-seed1 ran with params=123, not '):
        reproduce.main(['--device=cpu', '--variants=mha', charlevel, f"--out_root={tmp_path / 'out'}"])
    damcha.write_text('')
    with pytest.raises(SystemExit, match='damcha-seed1.eval.json is not readable JSON'):
        reproduce.main(['--device=cpu', '--variants=mha', charlevel, f"--out_root={tmp_path / 'out'}"])
    (tmp_path / 'results' / 'study2x2' / 'one_pass' / 'mha-seed1.eval.json').write_text('{"iter": 18')   # a damaged one
    with pytest.raises(SystemExit, match='mha-seed1.eval.json is not readable JSON'):
        reproduce.main(['--study=2x2', '--regime=one_pass', '--device=cpu', *study])
    for damaged in ('"x"', '0'):
        lr_summary.write_text('{"chosen_lr": {"mha": %s}}' % damaged)
        with pytest.raises(SystemExit, match='is damaged: its chosen_lr should map variants to learning rates'):
            reproduce.main(['--study=2x2', '--regime=three_passes_dropout', '--device=cpu', *study])


def test_a_checkpoint_past_the_asked_iterations_is_refused_not_evaluated(tmp_path, monkeypatch):
    """Its bpc would be summarized beside the smaller max_iters asked now."""
    lab_runs_in_process(monkeypatch)   # train_char.py --mode=config, which gives the settings
    (tmp_path / 'out' / 'mha-seed1').mkdir(parents=True)
    torch.save(dict(iter_num=10), tmp_path / 'out' / 'mha-seed1' / 'ckpt.pt')
    with pytest.raises(SystemExit, match='ckpt.pt is at iter 10, past the max_iters=5 asked now'):
        reproduce.main(['--device=cpu', '--variants=mha', '--seeds=1', '--max_iters=5',
                        f"--results={tmp_path / 'results'}", f"--out_root={tmp_path / 'out'}"])
    assert not os.listdir(tmp_path / 'results')


def test_settings_reproduce_sets_for_each_run_are_refused():
    for args, words in ((['--seed=42'], '--seed: reproduce.py decides it: it sets it for each run (--seeds)'),
                        (['--out_dir=x'], '--out_dir: reproduce.py decides it'),
                        (['--always_save_checkpoint=False'], 'it evaluates each run at its last iteration'),
                        (['--snapshot_iters=0'], 'it sets it for the run named by --snapshot'),
                        (['--init_from=resume'], '--init_from: reproduce.py decides it'),
                        (['--mode=eval'], '--mode: reproduce.py decides it'),
                        (['--min_lr=1e-4', '--study=2x2'], "--min_lr: the study takes each variant's rate"),
                        (['seed=3'], 'seed=3: options are written --key=value'),
                        (['--learning_rate=1e-3', '--study=2x2'], "the study takes each variant's rate from its LR sweep")):
        with pytest.raises(SystemExit, match=re.escape(words)):
            reproduce.parse_options(args)
    assert reproduce.parse_options(['--learning_rate=1e-3'])[1] == {'learning_rate': '1e-3'}   # the sweep takes it


def test_options_that_would_be_dropped_are_refused():
    """An option that would change nothing is refused, not dropped: the study's options without
    --study (which would start the long sweep instead), a --snapshot that names no run."""
    for args, words in ((['--regime=three_passes_dropout'], '--regime is the 2x2 study\'s: add --study=2x2'),
                        (['--lr_grid=9'], '--lr_grid is the 2x2 study\'s: add --study=2x2'),
                        (['--snapshot=bogus'], "snapshot='bogus' names no run of these settings (runs are named like mha-seed1)"),
                        (['--snapshot=damcha-seed4'], "names no run of these settings"),
                        (['--study=2x2', '--regime=sweep_one_pass', '--snapshot=mha-seed1'], "(runs are named like mha-lr0.001)")):
        with pytest.raises(SystemExit, match=re.escape(words)):
            reproduce.parse_options(args)
    assert reproduce.parse_options(['--snapshot=damcha-seed3'])[0]['snapshot'] == 'damcha-seed3'
    assert reproduce.parse_options(['--study=2x2', '--regime=sweep_one_pass', '--snapshot=proj-lr0.002'])[0]['snapshot'] == 'proj-lr0.002'
    assert reproduce.parse_options(['--snapshot='])[0]['snapshot'] == ''


@pytest.mark.slow
def test_study_2x2_lr_sweep_then_one_pass(tmp_path, in_process, monkeypatch):
    """--study=2x2: the LR sweep trains on the training split's own 90/5/5 split (never val) at the
    full corpus's vocabulary, chooses a rate per variant, and regime one_pass trains at it, records the
    commit, evaluates the Table 3 model with blocks=diag and offdiag, and writes the paired intervals.
    Its runs and their evaluations are calls in this process (lab_runs_in_process)."""
    lab_runs_in_process(monkeypatch)
    args = ['--study=2x2', '--seeds=1', '--max_iters=4', '--eval_interval=2', '--eval_iters=1', '--n_layer=1',
            '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=1024', '--max_new_tokens=2', '--device=cpu',
            '--variants=mha,damcha_full', f"--results={tmp_path / 'results'}", f"--out_root={tmp_path / 'out'}",
            f"--data_dir={tmp_path / 'data'}"]
    assert 'run the learning-rate sweep first' in refusal(*args, '--regime=one_pass')
    in_process(args + ['--regime=sweep_one_pass', '--lr_grid=1e-3,3e-3'])
    lr = json.loads((tmp_path / 'results' / 'sweep_one_pass' / 'summary.json').read_text())
    for v in ('mha', 'damcha_full'):
        scores = lr['held_out_bpc'][v]
        assert lr['chosen_lr'][v] == float(min(scores, key=scores.get))
        run_eval = json.loads((tmp_path / 'results' / 'sweep_one_pass' / f'{v}-lr0.001.eval.json').read_text())
        assert run_eval['dataset'].endswith('shakespeare_train.txt') and run_eval['commit']
    [held_out_meta] = (tmp_path / 'data').glob('shakespeare_train-*/meta.json')   # a text file's folder: <stem>-<digest>
    held_out = json.loads(held_out_meta.read_text())['splits']
    train = json.loads((tmp_path / 'data' / 'shakespeare' / 'meta.json').read_text())['splits']['train']
    assert sum(held_out.values()) == train   # the held-out slice is part of the training split
    in_process(args + ['--regime=one_pass'])
    summary = json.loads((tmp_path / 'results' / 'one_pass' / 'summary.json').read_text())
    rows = {r['variant']: r for r in summary['rows']}
    assert rows['mha']['lr'] == lr['chosen_lr']['mha'] and rows['damcha_full']['runs'] == 1
    assert abs(rows['damcha_full']['rel_params_vs_mha']) < 0.02
    assert len(rows['damcha_full']['val_bpc_diag']) == len(rows['damcha_full']['val_bpc_offdiag']) == 1
    [run_eval] = [json.loads(p.read_text()) for p in (tmp_path / 'results' / 'one_pass').glob('damcha_full-*.eval.json')]
    assert len({run_eval['val_bpc'], run_eval['val_bpc_diag'], run_eval['val_bpc_offdiag']}) == 3   # three models scored
    assert rows['mha']['diff_equal_steps'] == [0.0, None]
    assert in_process(args + ['--regime=one_pass']).count('skip ') == 2


def test_study_contrasts_pair_runs_of_the_same_seed():
    """The 2x2's sides are paired differences over the seeds both variants finished; a side with a
    variant missing is left out."""
    evals = {f'{v}-seed{s}': dict(val_bpc=bpc + 0.1 * s + 0.01 * (v == 'static') * s, commit='c')
             for v, bpc in (('mha', 2.0), ('damcha', 2.1), ('static', 2.3), ('proj', 2.05)) for s in (1, 2, 3)}
    del evals['proj-seed3']
    sides = {(c['first'], c['second']): c for c in reproduce.study_contrasts(evals, seeds=3)}
    assert set(sides) == {('damcha', 'proj'), ('static', 'mha'), ('damcha', 'static'), ('proj', 'mha'),
                          ('damcha - proj', 'static - mha')}
    # the interaction over seeds 1 and 2: (0.05 - (0.3 + 0.01 s)) per seed
    assert sides['damcha - proj', 'static - mha']['runs'] == 2
    assert sides['damcha - proj', 'static - mha']['diff'][0] == pytest.approx(0.05 - 0.315)
    assert sides['damcha', 'proj']['runs'] == 2
    assert sides['damcha', 'proj']['diff'] == (pytest.approx(0.05), pytest.approx(0.0, abs=1e-12))
    mean, half = sides['static', 'mha']['diff']
    assert sides['static', 'mha']['runs'] == 3 and mean == pytest.approx(0.32) and half > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_missing_device_is_refused_before_any_download(tmp_path):
    p = subprocess.run([sys.executable, 'lab/reproduce.py', '--dataset=enwik8', '--device=cuda',
                        f"--data_dir={tmp_path / 'data'}", f"--results={tmp_path / 'results'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == ["error: device=cuda, but this machine has no CUDA device"]
    assert not (tmp_path / 'data').exists() and not (tmp_path / 'results').exists()


def refusal(*argv):
    """The one line reproduce.main exits with for argv."""
    with pytest.raises(SystemExit) as e:
        reproduce.main(list(argv))
    assert isinstance(e.value.code, str) and '\n' not in e.value.code, e.value.code
    return e.value.code


def test_settings_that_would_run_nothing_or_fail_late_are_refused_first(tmp_path, monkeypatch):
    """A sweep of nothing would rewrite the committed summary as an empty table; a bad model or
    results folder would fail after the data are prepared: each is one line, before anything runs.
    (train_char.py --mode=config, whose one line a bad model setting is, runs in this process.)"""
    lab_runs_in_process(monkeypatch)
    results = f"--results={tmp_path / 'results'}"
    assert 'seeds must be positive, not 0' in refusal('--seeds=0', results)
    assert 'variants names no variant' in refusal('--variants=', results)
    assert 'variants names no variant' in refusal('--variants=,', results)
    for grid in ('abc', '-1e-3', 'nan', ''):
        assert f"lr_grid={grid!r}: give positive learning rates" in refusal('--study=2x2', '--regime=sweep_one_pass', f'--lr_grid={grid}')
    assert 'takes no --dataset' in refusal('--study=2x2', '--regime=sweep_one_pass', '--dataset=notes.txt')
    assert 'n_embd (30) must be divisible by n_head (4)' in refusal('--n_embd=30', '--device=cpu', results)
    (tmp_path / 'a_file').write_text('')
    assert 'Not a directory' in refusal('--device=cpu', '--variants=mha', '--seeds=1', f"--data_dir={tmp_path / 'data'}",
                                    f"--results={tmp_path / 'a_file' / 'results'}")
    assert not (tmp_path / 'results').exists()


def test_only_a_diverged_run_is_recorded_as_diverged(tmp_path):
    """In the LR sweep a run that diverges (train_char.py's exit status DIVERGED) is recorded as
    failed with val bpc inf; a run that fails for any other reason stops the sweep."""
    tiny = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, max_iters=20, eval_interval=10,
                eval_iters=1, device='cpu', data_dir=str(tmp_path / 'data'), gen_width=8)
    opts = dict(snapshot='', device='cpu')
    (tmp_path / 'results').mkdir()
    with pytest.raises(SystemExit, match='training bad failed .* once that is fixed, the same command resumes it'):
        reproduce.train_and_evaluate('bad', str(tmp_path / 'bad'), (), tiny | dict(vocab_size=2), 20, opts,
                                     str(tmp_path / 'results'), 'too small a vocabulary', may_diverge=True)
    assert not (tmp_path / 'results' / 'bad.eval.json').exists()
    result = reproduce.train_and_evaluate('hot', str(tmp_path / 'hot'), (), tiny | dict(learning_rate=1e30), 20, opts,
                                          str(tmp_path / 'results'), 'a learning rate that diverges', may_diverge=True)
    assert result == dict(failed=True, val_bpc=float('inf'))
    assert json.loads((tmp_path / 'results' / 'hot.eval.json').read_text())['failed'] is True


@pytest.mark.slow
def test_the_lab_trains_proj_through_the_books_trainer(tmp_path, monkeypatch):
    """The study's proj runs as attn=proj through lab/train.py and lab/eval.py, the book's trainer and
    evaluator with the lab's attentions registered; the book's own trainer refuses it in one line."""
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)   # the training subprocesses run the torch path
    tiny = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, max_iters=2, eval_interval=2, eval_iters=1,
                device='cpu', data_dir=str(tmp_path / 'data'), gen_width=8, max_new_tokens=2, attn='proj',
                metric_init='identity', mlp_hidden=40)
    book = subprocess.run([sys.executable, 'train_char.py', *reproduce.flags(tiny), '--mode=config'], cwd=ROOT,
                          capture_output=True, text=True)
    assert book.returncode != 0 and "'proj'" in book.stderr and book.stderr.strip().count('\n') == 0, book.stderr
    (tmp_path / 'results').mkdir()
    result = reproduce.train_and_evaluate('proj-seed1', str(tmp_path / 'out'), (), tiny, 2,
                                          dict(snapshot='', device='cpu'), str(tmp_path / 'results'), 'proj')
    assert result['iter'] == 2 and math.isfinite(result['val_bpc'])
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    assert (ckpt['model_args']['attn'], ckpt['model_args']['mlp_hidden']) == ('proj', 40)
    assert 'h.0.attn.c_attn.weight' in ckpt['model'] and 'gen.1.bias' in ckpt['model']


def test_the_snapshot_run_resumes_with_the_snapshots_still_ahead(tmp_path, monkeypatch):
    """An interrupted snapshot run (damcha-seed1 by default) resumes: its snapshots from before the
    checkpoint were written by the first run, and the resume asks only for those of this
    max_iters still ahead, not for iterations it has passed, nor for the checkpoint's list, which
    was planned for another max_iters (train_char.py refuses a list past max_iters)."""
    tiny = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, eval_interval=3, eval_iters=1,
                device='cpu', data_dir=str(tmp_path / 'data'), gen_width=8, lr_decay_iters=6, max_new_tokens=2)
    out = tmp_path / 'out'
    lab_runs_in_process(monkeypatch)   # the interrupted run, and reproduce.py's resume below, in this process
    train_char.main([*reproduce.flags(tiny), f'--out_dir={out}', '--max_iters=3', '--snapshot_iters=0,1'])
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)   # as if planned for 10 iterations, stopped at 3
    torch.save(dict(ckpt, config=dict(ckpt['config'], max_iters=10, snapshot_iters='0,1,10')), out / 'ckpt.pt')
    (tmp_path / 'results').mkdir()
    result = reproduce.train_and_evaluate('damcha-seed1', str(out), (), tiny | dict(max_iters=6), 6,
                                          dict(snapshot='damcha-seed1', device='cpu'), str(tmp_path / 'results'), 'resumed')
    assert result['iter'] == 6 and math.isfinite(result['val_bpc'])
    assert sorted(p.name for p in (tmp_path / 'results' / 'snapshots' / 'damcha-seed1').iterdir()) == [
        'snapshot-0.pt', 'snapshot-1.pt', 'snapshot-6.pt']


def test_ctrl_c_waits_for_the_training_run_to_stop(tmp_path):
    """Ctrl-C reaches reproduce.py and its train_char.py child together; reproduce.py waits for the
    child to finish its own shutdown instead of killing it mid-way (subprocess.run kills after 0.25 s)."""
    child = ("import signal, sys, time\n"
             "def stop(*_):\n"
             "    time.sleep(1)\n"
             "    open(sys.argv[1], 'w').write('stopped')\n"
             "    sys.exit(130)\n"
             "signal.signal(signal.SIGINT, stop)\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")
    marker = tmp_path / 'marker'
    driver = ("import sys\nfrom lab import reproduce\n"
              f"try:\n    sys.exit(reproduce.run_to_the_end([sys.executable, '-c', {child!r}, {str(marker)!r}]))\n"
              "except KeyboardInterrupt:\n    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, '-c', driver], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_default)   # Ctrl-C reaches both, as in a terminal
    assert proc.stdout.readline() == 'ready\n'
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert marker.read_text() == 'stopped'


def test_statistics_against_tabulated_values():
    """Student's t quantiles from the tables (two-sided 95%), and the interval and std they make."""
    for dof, t in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281)):
        assert reproduce.t_quantile(0.975, dof) == pytest.approx(t, abs=1e-3)
    mean, half = reproduce.interval([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.3027 * 0.1 / math.sqrt(3), rel=1e-4)
    assert reproduce.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)   # the sample std, n - 1


def write_run(results, run, val_bpc, log=()):
    (results / f'{run}.eval.json').write_text(json.dumps(dict(val_bpc=val_bpc, commit='c')))
    (results / f'{run}.log.jsonl').write_text(''.join(
        json.dumps(dict(time=t, val_bpc=v, val_loss=v * math.log(2), train_loss=v * math.log(2) - 0.1)) + '\n'
        for t, v in log))


def test_a_run_is_finished_once_its_eval_json_is_written(tmp_path, capsys):
    """The eval JSON, written last, marks a finished run; a run with only its copied log is not."""
    write_run(tmp_path, 'done', 2.0)
    os.remove(tmp_path / 'done.log.jsonl')
    assert reproduce.skip_finished('done', str(tmp_path / 'done.eval.json'), {})
    assert 'skip done' in capsys.readouterr().out
    write_run(tmp_path, 'half', 2.0)
    os.remove(tmp_path / 'half.eval.json')
    assert not reproduce.skip_finished('half', str(tmp_path / 'half.eval.json'), {})


def test_lr_summary_chooses_once_the_whole_grid_is_done(tmp_path, capsys):
    write_run(tmp_path, 'mha-lr0.001', 2.0)
    reproduce.lr_summary(['mha'], [1e-3, 2e-3], {'mha': 1}, str(tmp_path), 'c')
    assert json.loads((tmp_path / 'summary.json').read_text())['chosen_lr'] == {}
    write_run(tmp_path, 'mha-lr0.002', 1.9)
    reproduce.lr_summary(['mha'], [1e-3, 2e-3], {'mha': 1}, str(tmp_path), 'c')
    assert json.loads((tmp_path / 'summary.json').read_text())['chosen_lr'] == {'mha': 0.002}


def test_seed_summary_pairs_each_seed_with_mha(tmp_path, capsys):
    """Differences to MHA seed by seed: at equal steps (the final val bpc), and at equal time (the
    logged val estimates interpolated at the earlier of the two finishing times)."""
    write_run(tmp_path, 'mha-seed1', 2.0, [(0, 3.0), (10, 2.0)])
    write_run(tmp_path, 'mha-seed2', 2.2, [(0, 3.0), (10, 2.2)])
    write_run(tmp_path, 'damcha-seed1', 2.1, [(0, 3.0), (20, 2.1)])    # at t = 10: 2.55
    write_run(tmp_path, 'damcha-seed2', 2.2, [(0, 3.0), (10, 2.2)])
    variants = ['mha', 'damcha']
    reproduce.seed_summary(variants, 2, {v: {} for v in variants}, {v: 100 for v in variants},
                           {v: 1e-3 for v in variants}, str(tmp_path), 'one_pass', 'c')
    rows = {r['variant']: r for r in json.loads((tmp_path / 'summary.json').read_text())['rows']}
    damcha = rows['damcha']
    assert damcha['val_bpc'] == [2.1, 2.2] and damcha['val_bpc_mean'] == pytest.approx(2.15)
    steps, time_ = damcha['diff_equal_steps'], damcha['diff_equal_time']
    assert steps[0] == pytest.approx(0.05) and steps[1] == pytest.approx(12.7062 * 0.05, rel=1e-4)   # stdev(0.1, 0) / sqrt(2) = 0.05
    assert time_[0] == pytest.approx((0.55 + 0.0) / 2)
    assert damcha['gap_mean'] == pytest.approx(0.1 / math.log(2)) and damcha['minutes'] == pytest.approx(15 / 60)
    assert rows['mha']['diff_equal_steps'] == [0.0, 0.0]
    # a regime whose runs shared the machine: its times are load, so no equal-time difference nor minutes
    reproduce.seed_summary(variants, 2, {v: {} for v in variants}, {v: 100 for v in variants},
                           {v: 1e-3 for v in variants}, str(tmp_path), 'three_passes', 'c')
    rows = {r['variant']: r for r in json.loads((tmp_path / 'summary.json').read_text())['rows']}
    assert 'diff_equal_time' not in rows['damcha'] and 'minutes' not in rows['damcha']
    assert rows['damcha']['diff_equal_steps'][0] == pytest.approx(0.05)
    table = (tmp_path / 'summary.md').read_text()
    assert '| diff, equal steps | gap |' in table and 'equal time |' not in table


def test_factor_effects_of_passes_and_dropout(tmp_path, capsys):
    """Each factor's effect on a variant's difference to MHA, over the seeds that finished all four
    cells: d = variant - mha per regime; passes and dropout are the mean changes across the other
    factor's two levels, the interaction the change of the passes effect with dropout."""
    # proj - mha in each cell, plus 0.001 * seed in three_passes_dropout
    d = dict(one_pass=0.06, one_pass_dropout=0.10, three_passes=0.00, three_passes_dropout=-0.03)
    for regime, diff in d.items():
        (tmp_path / regime).mkdir()
        for s in (1, 2, 3):
            bpc = dict(mha=2.5 + 0.01 * s, damcha=2.6 + 0.01 * s,
                       proj=2.5 + 0.01 * s + diff + 0.001 * s * (regime == 'three_passes_dropout'))
            for v in ('mha', 'proj', 'damcha'):
                if not (regime == 'three_passes' and v == 'proj' and s == 3):   # proj's third seed has not finished all four
                    (tmp_path / regime / f'{v}-seed{s}.eval.json').write_text(json.dumps(dict(val_bpc=bpc[v], commit='c')))
    reproduce.factor_effects(str(tmp_path))
    rows = {r['variant']: r for r in json.loads((tmp_path / 'factors.json').read_text())['rows']}
    proj = rows['proj']
    assert proj['seeds'] == [1, 2]
    assert proj['diffs']['one_pass_dropout'] == [pytest.approx(0.10), pytest.approx(0.10)]
    assert proj['effects']['passes'][0] == pytest.approx((0.00 - 0.03 + 0.0015 - 0.06 - 0.10) / 2)
    assert proj['effects']['dropout'][0] == pytest.approx((0.10 - 0.03 + 0.0015 - 0.06 - 0.00) / 2)
    assert proj['effects']['interaction'][0] == pytest.approx((-0.03 + 0.0015 - 0.10) - (0.00 - 0.06))
    assert proj['effects']['passes'][1] > 0   # seeds 1 and 2 differ in three_passes_dropout: an interval of some width
    assert rows['damcha']['seeds'] == [1, 2, 3]
    assert all(rows['damcha']['effects'][k] == [pytest.approx(0.0), pytest.approx(0.0, abs=1e-12)]
               for k in ('passes', 'dropout', 'interaction'))
    assert '| proj - mha | 2 |' in (tmp_path / 'factors.md').read_text()
    (tmp_path / 'three_passes' / 'mha-seed1.eval.json').unlink()
    (tmp_path / 'three_passes' / 'mha-seed2.eval.json').unlink()
    (tmp_path / 'three_passes' / 'mha-seed3.eval.json').unlink()
    (tmp_path / 'factors.json').unlink()
    reproduce.factor_effects(str(tmp_path))   # no seed has every cell: nothing is written
    assert not (tmp_path / 'factors.json').exists()


def test_the_larger_model_trains_at_the_rates_of_its_own_sweep(tmp_path):
    """Regime d256_three_passes_dropout takes its rates from sweep_d256, not from the small model's sweep."""
    study = tmp_path / 'study'
    for sweep, rate in (('sweep_one_pass', 0.004), ('sweep_d256', 0.001)):
        (study / sweep).mkdir(parents=True)
        (study / sweep / 'summary.json').write_text(json.dumps({'chosen_lr': {'mha': rate}}))
    assert reproduce.chosen_rates(str(study), 'sweep_d256') == {'mha': 0.001}
    assert reproduce.RATES_FROM['d256_three_passes_dropout'] == 'sweep_d256'
    assert reproduce.REGIMES['d256_three_passes_dropout']['n_embd'] == 256
    (study / 'sweep_d256' / 'summary.json').unlink()
    with pytest.raises(SystemExit, match=r'sweep_d256.summary\.json does not exist: run the learning-rate sweep first '
                                         r'\(--regime=sweep_d256\)'):
        reproduce.main(['--study=2x2', '--regime=d256_three_passes_dropout', '--variants=mha', '--device=cpu',
                        f'--results={study}', f"--out_root={tmp_path / 'out'}"])


def test_welch_interval_of_two_independent_samples():
    """Equal sizes and variances: Welch's degrees of freedom are 2(n - 1), here t(0.975, 4) = 2.7764."""
    mean, half = reproduce.welch_interval([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert mean == pytest.approx(1.0) and half == pytest.approx(2.7764 * math.sqrt(2 / 3), rel=1e-4)
    assert reproduce.welch_interval([2.0], [1.0, 2.0]) == (pytest.approx(0.5), None)


def test_changes_from_three_passes_dropout_pair_the_rates_by_seed_and_compare_the_scales_unpaired(tmp_path):
    """Each contrast in three_passes_dropout (5 seeds), at the rates of the longer sweep (3 of the
    same seeds: their change is paired) and in the larger model (3 seeds of its own: the change of
    the means, Welch); nothing is written before three_passes_dropout and another have a seed of both
    sides of a contrast."""
    def write(regime, diffs, variants=('mha', 'proj')):
        (tmp_path / regime).mkdir(exist_ok=True)
        for s, diff in enumerate(diffs, 1):
            for v, bpc in zip(variants, (2.3 + 0.01 * s, 2.3 + 0.01 * s + diff)):
                (tmp_path / regime / f'{v}-seed{s}.eval.json').write_text(json.dumps(dict(val_bpc=bpc, commit='c')))
    write('three_passes_dropout', [-0.020, -0.030, -0.010, -0.025, -0.015])
    reproduce.changes_from_three_passes_dropout(str(tmp_path))
    assert not (tmp_path / 'changes.json').exists()
    write('three_passes_dropout_own_rates', [0.010, -0.010, 0.020])
    write('d256_three_passes_dropout', [-0.050, -0.040, -0.060])
    reproduce.changes_from_three_passes_dropout(str(tmp_path))
    [row] = json.loads((tmp_path / 'changes.json').read_text())['rows']
    assert row['contrast'] == 'proj - mha' and [len(row['diffs'][r]) for r in (
        'three_passes_dropout', 'three_passes_dropout_own_rates', 'd256_three_passes_dropout')] == [5, 3, 3]
    per_seed = [0.010 + 0.020, -0.010 + 0.030, 0.020 + 0.010]       # own rates - first rates, seed by seed
    assert row['change']['three_passes_dropout_own_rates'] == pytest.approx(list(reproduce.interval(per_seed)))
    assert row['change']['d256_three_passes_dropout'] == pytest.approx([-0.050 - (-0.020), reproduce.welch_interval(
        [-0.050, -0.040, -0.060], [-0.020, -0.030, -0.010, -0.025, -0.015])[1]])
    assert '| proj - mha | 5, -0.0200 [' in (tmp_path / 'changes.md').read_text()

    # damcha's seeds against MHA's give damcha - proj as damcha's bpc minus proj's, seed by seed
    write('three_passes_dropout', [0.10, 0.12, 0.08, 0.11, 0.09], variants=('mha', 'damcha'))
    write('d256_three_passes_dropout', [0.10, 0.12, 0.08], variants=('mha', 'damcha'))
    reproduce.changes_from_three_passes_dropout(str(tmp_path))
    rows = {r['contrast']: r for r in json.loads((tmp_path / 'changes.json').read_text())['rows']}
    assert list(rows) == ['proj - mha', 'damcha - mha', 'damcha - proj']
    assert rows['damcha - proj']['diffs']['d256_three_passes_dropout'] == pytest.approx([0.150, 0.160, 0.140])
    assert rows['damcha - proj']['diffs']['three_passes_dropout_own_rates'] == []
    assert rows['damcha - proj']['change']['d256_three_passes_dropout'] == pytest.approx(list(reproduce.welch_interval(
        [0.150, 0.160, 0.140], [0.120, 0.150, 0.090, 0.135, 0.105])))
    assert '| damcha - proj | 5, +0.1200 [' in (tmp_path / 'changes.md').read_text()


def test_a_diverged_study_run_is_recorded_in_json_without_infinity(tmp_path, monkeypatch):
    """The LR sweep records a diverged run's val bpc, infinite, as null in its eval JSON (strict
    JSON), and reads it back as infinite (never the chosen rate). The run is a call in this process
    (tests/test_reproduce.py's test_only_a_diverged_run_is_recorded_as_diverged runs it as a process)."""
    lab_runs_in_process(monkeypatch)
    tiny = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=4, max_iters=20, eval_interval=10,
                eval_iters=1, device='cpu', data_dir=str(tmp_path / 'data'), gen_width=8, learning_rate=1e30)
    (tmp_path / 'results').mkdir()
    reproduce.train_and_evaluate('hot', str(tmp_path / 'hot'), (), tiny, 20, dict(snapshot='', device='cpu'),
                                 str(tmp_path / 'results'), 'a learning rate that diverges', may_diverge=True)
    text = (tmp_path / 'results' / 'hot.eval.json').read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f'{c} in JSON')) == dict(failed=True, val_bpc=None)
    assert reproduce.read_evals(str(tmp_path / 'results'))['hot']['val_bpc'] == float('inf')


@pytest.mark.slow
def test_sigterm_to_reproduce_stops_its_training_run_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    """kill -TERM on lab/reproduce.py alone: it passes the signal on to its train_char.py run, which
    stops as on Ctrl-C (saying where), and ends with status 143, leaving no run behind that holds
    the out_dir. Stopped before the run's first periodic checkpoint, the run saved one where it
    stopped: the same command resumes it there and trains to the end (here in this process, its
    runs too: lab_runs_in_process)."""
    # 2,000 iterations: an idle machine runs 100 of this model in 0.2 s, before the signal lands
    args = ['lab/reproduce.py', '--seeds=1', '--variants=mha', '--max_iters=2000', '--eval_interval=2000',
            '--log_interval=5', '--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=4',
            '--max_new_tokens=5', '--device=cpu', f"--results={tmp_path / 'results'}", f"--out_root={tmp_path / 'out'}",
            f"--data_dir={tmp_path / 'data'}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_for(proc, 'iter 5:')   # the training run's line, on the stdout it shares
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and 'Traceback' not in stderr, stderr[-2000:]
    assert 'interrupted at iter ' in stderr and stderr.strip().endswith(
        'interrupted: finished runs are kept, and the same command resumes the rest'), stderr[-2000:]
    out = tmp_path / 'out' / 'mha-seed1'
    with RunFolder(str(out)) as folder:
        folder.lock()   # no training run is left holding it
    saved = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']
    assert 5 <= saved < 2000, saved
    lab_runs_in_process(monkeypatch)
    capsys.readouterr()
    reproduce.main(args[1:])
    assert f'resuming from {out}/ckpt.pt at iter {saved}' in capsys.readouterr().out
    assert [e['iter'] for e in read_jsonl(out / 'train_log.jsonl')] == list(range(2000))
