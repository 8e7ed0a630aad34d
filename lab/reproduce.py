"""
reproduce.py: the paper's character-level comparison, MHA against DCMHA, DAMCHA and
DAMCHA's ablations at equal parameter count, several seeds each, scored on the full splits.

    python lab/reproduce.py                       # bundled Shakespeare, 5 variants x 3 seeds, on the CPU
    python lab/reproduce.py --seeds=5 --variants=mha,damcha --max_iters=4000
                                  # --max_iters=0 (the default): 10,000 on shakespeare, the config
                                  # files' on the other datasets, the regime's in the study
    python lab/reproduce.py --dataset=text8 --device=cuda      # enwik8, text8, mix: for a GPU
    python lab/reproduce.py --n_layer=2 --batch_size=8         # any other --key=value goes to train_char.py

Variants (every run is `python lab/train.py ...`, the book's train_char.py with the lab's attentions
registered, in a subprocess, then `lab/eval.py` (eval_char.py) on its ckpt; the settings come from
`lab/train.py ... --mode=config`, so this script never imports the trainer):
    mha              attn=mha, the baseline whose parameter count the others match
    dcmha            attn=dcmha (Xiao et al. 2024); no width to trade, so its count is what it is
    damcha           the shared folded generator, its width solved by lab/counts.equal_params_width
    damcha_static    adaptive=False, a learned constant metric: no generator, so fewer parameters
    damcha_unshared  share=False, a generator per layer, its width solved likewise
Counts are GPT.get_num_params() (lab/counts.count_params); summary.md flags each variant that is not
within 5% of MHA's count rather than hiding it.

Model and schedule: on shakespeare, train_char.py's defaults (4 layers, 4 heads, D = 128, T = 64,
batch 12) for 10,000 iterations (7.7M characters, ~5 passes over the corpus), lr decayed to the end.
The sweep's runs are independent: split over processes with --variants (each process summarises
every finished variant). On enwik8, text8 and mix: config/<dataset>.py followed by config/mha.py
(mha, dcmha) or config/damcha.py (the DAMCHA variants): 12 x 512, T = 512, 50k iterations.

Output, under --results (default results/charlevel/<dataset>/): <variant>-seed<k>.log.jsonl (the
run's eval curve) and <variant>-seed<k>.eval.json (eval_char.py: bpc of the whole val
split, and of the test split where the dataset has one), summary.json and summary.md; and for the
run named by --snapshot (default damcha-seed1) its weights in float16 at 0, 2.5, 10, 30 and 100% of
training, in snapshots/<run>/snapshot-<iter>.pt (train_char --snapshot_iters). Checkpoints
go to --out_root (default out-reproduce/<dataset>/<variant>-seed<k>/). A run whose eval JSON
exists is skipped, so an interrupted sweep continues where it stopped; a finished run that its
eval JSON says ran with other iterations, context or parameter count than asked now (in the
study, also another rate or seed) is refused, not summarized beside these settings. A run whose
checkpoint exists but is not yet evaluated resumes from it. The train_char settings it decides
(seed, out_dir, init_from, mode, snapshot_iters, always_save_checkpoint; in the study,
learning_rate and min_lr) are refused as flags.

The 2x2 study (--study=2x2): what in DAMCHA helps or hurts, at MHA's parameter count.
Variants (STUDY below): mha; damcha (own slice, adaptive, folded as train_char runs it); static
(own slice, one identity-initialised metric per layer, MLP width solved); proj (attn=proj of
lab/variants.py: MHA's projections with the shared adaptive metric, identity-initialised, DAMCHA's
generator width, MLP width solved); damcha_full (gen_out=full, the paper's form and its Table 3
model, also evaluated with blocks=diag and offdiag).
    python lab/reproduce.py --study=2x2 --regime=sweep_one_pass          # LR sweep (--lr_grid, 1 seed), held-out slice of train
    python lab/reproduce.py --study=2x2 --regime=one_pass                # one pass (1,860 iters), 5 seeds at the chosen rates
    python lab/reproduce.py --study=2x2 --regime=three_passes_dropout    # 6,000 iters (~3 passes) with dropout 0.1, 5 seeds
    python lab/reproduce.py --study=2x2 --regime=three_passes --variants=mha,proj,damcha       # 6,000 iters, no dropout
    python lab/reproduce.py --study=2x2 --regime=one_pass_dropout --variants=mha,proj,damcha   # 1,860 iters, dropout 0.1
    python lab/reproduce.py --study=2x2 --regime=sweep_three_passes_dropout --variants=mha,proj,damcha --lr_grid=1e-3,2e-3,4e-3,8e-3
                                                       # the LR sweep at three_passes_dropout's 6,000 iterations
    python lab/reproduce.py --study=2x2 --regime=three_passes_dropout_own_rates --variants=mha,proj,damcha
                                                       # three_passes_dropout at the rates of the sweep above
    python lab/reproduce.py --study=2x2 --regime=sweep_d256 --variants=mha,proj,damcha --lr_grid=1e-3,2e-3,4e-3,8e-3
    python lab/reproduce.py --study=2x2 --regime=d256_three_passes_dropout --variants=mha,proj,damcha --seeds=3
                                                       # D = 256, 6 layers, at sweep_d256's rates
Results under results/study2x2/<regime>/ (each eval JSON records the commit), checkpoints under
out-study/2x2/<regime>/; finished runs are skipped, so each command resumes; copies of one command
started side by side share its runs (each skips the run another is training); and rerun on finished
results it only rewrites summary.md / summary.json (paired differences to MHA with 95% t intervals
at equal steps and at equal wall-clock, the train/val gap, the blocks evaluations).
"""
import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/reproduce.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

from configurator import configure
from damcha_torch import GPTConfig
from lab.counts import count_params, equal_params_width
from notebooks.course import t_quantile
from data.dataset import load_dataset
from device import pick_device
from run_folder import SNAPSHOT, RunFolder, atomic_write, open_lock, read_jsonl, to_json, write_text
from shell import DIVERGED, Interrupted, die, exit_status, signals_as_ctrl_c

TRAIN_CHAR = os.path.join(ROOT, 'lab', 'train.py')   # train_char.py with the lab's attentions registered
EVAL_CHAR = os.path.join(ROOT, 'lab', 'eval.py')     # eval_char.py likewise
VARIANTS = dict(mha=dict(attn='mha'), dcmha=dict(attn='dcmha'), damcha=dict(attn='damcha'),
                damcha_static=dict(attn='damcha', adaptive=False),
                damcha_unshared=dict(attn='damcha', share=False))
OPTIONS = dict(dataset='shakespeare', seeds=3, variants=','.join(VARIANTS), max_iters=0, device='auto',
               results='', out_root='', snapshot='damcha-seed1', study='', regime='one_pass',
               lr_grid='1e-3,2e-3,4e-3')
# The 2x2 study (--study=2x2): how queries and keys are formed (own slice, or projected)
# x whether the metric is static or adaptive, each at MHA's parameter count, plus the paper's
# Table 3 model. `trade` names the width solved for MHA's count: the generator's, or the MLP's
# (the projected adaptive metric keeps own-slice DAMCHA's generator width and gives MLP width).
STUDY = dict(
    mha=dict(fields=dict(attn='mha'), trade=None),                   # projected, static (m absorbed in W_q)
    damcha=dict(fields=dict(attn='damcha'), trade='gen_width'),      # own slice, adaptive, folded
    static=dict(fields=dict(attn='damcha', adaptive=False, share=False, metric_init='identity'), trade='mlp_hidden'),
    proj=dict(fields=dict(attn='proj', metric_init='identity'), trade='mlp_hidden'),
    damcha_full=dict(fields=dict(attn='damcha', gen_out='full'), trade='gen_width'),   # Table 3, also eval diag/offdiag
)
# regimes, named for what they hold: "one_pass" one pass over the training split (1,429,444 characters
# / (12 x 64) = 1,861 iterations), "three_passes_dropout" about three passes with dropout 0.1;
# "three_passes" and "one_pass_dropout" complete the 2x2 of passes x dropout. "sweep_one_pass" is the
# learning-rate sweep at one pass (one seed per rate, scored on a held-out slice of the training
# split), whose rates the 2x2 trains at; "sweep_three_passes_dropout" the sweep again at
# three_passes_dropout's schedule, and "three_passes_dropout_own_rates" that regime again at the rates
# it chose (SAME_AS: a run whose rate did not change is three_passes_dropout's);
# "d256_three_passes_dropout" one step up in scale (D256: ~3 passes in 2,800 iterations, dropout 0.1)
# at the rates of its own short sweep "sweep_d256" (one pass)
D256 = dict(n_embd=256, n_head=8, n_layer=6, block_size=128)
REGIMES = dict(sweep_one_pass=dict(max_iters=1860, eval_interval=100),
               one_pass=dict(max_iters=1860, eval_interval=100),
               three_passes_dropout=dict(max_iters=6000, eval_interval=250, dropout=0.1),
               three_passes=dict(max_iters=6000, eval_interval=250),
               one_pass_dropout=dict(max_iters=1860, eval_interval=100, dropout=0.1),
               sweep_three_passes_dropout=dict(max_iters=6000, eval_interval=250, dropout=0.1),
               sweep_d256=dict(max_iters=930, eval_interval=100, dropout=0.1, **D256),
               d256_three_passes_dropout=dict(max_iters=2800, eval_interval=200, dropout=0.1, **D256))
SWEEPS = ('sweep_one_pass', 'sweep_three_passes_dropout', 'sweep_d256')   # the regimes that sweep the rates
# the sweep whose rates a regime trains at; "sweep_one_pass" for the others
RATES_FROM = dict(d256_three_passes_dropout='sweep_d256',
                  three_passes_dropout_own_rates='sweep_three_passes_dropout')
# regimes whose runs were made two at a time beside other work: their wall-clock times are load, not
# cost, so their summaries leave out the equal-wall-clock difference and the minutes (lab/bench.py times)
SHARED_MACHINE = ('three_passes', 'one_pass_dropout', 'three_passes_dropout_own_rates', 'd256_three_passes_dropout')
# a regime with another's settings: its finished run at the same rate and seed is this one's
SAME_AS = dict(three_passes_dropout_own_rates='three_passes_dropout')
REGIMES |= {regime: REGIMES[other] for regime, other in SAME_AS.items()}
# the run named by --snapshot also keeps its weights at these fractions of max_iters, in
# <results>/snapshots/<run>/: notebooks/04 plots its learned metric over training from them
SNAPSHOT_AT = (0, 0.025, 0.1, 0.3, 1)
CPU_ITERS = 10000   # shakespeare's default: about 5 passes over the corpus
# train_char settings this script decides, refused as flags: why
REFUSED = dict(seed='it sets it for each run (--seeds)', out_dir='it sets it for each run (--out_root)',
               init_from='it sets it for each run', mode='it sets it for each run',
               snapshot_iters='it sets it for the run named by --snapshot',
               always_save_checkpoint='it evaluates each run at its last iteration')


def config_files(dataset, fields):
    """config/<dataset>.py and config/mha.py or config/damcha.py for the GPU datasets, relative to
    the repository; none elsewhere (train_char's defaults)."""
    if dataset not in ('enwik8', 'text8', 'mix'):
        return []
    return [f'config/{dataset}.py', f"config/{'damcha' if fields['attn'] == 'damcha' else 'mha'}.py"]


def flags(d):
    return [f'--{k}={v}' for k, v in d.items()]


def mean_std(values):
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean, std):
    return 'n/a' if mean is None else f'{mean:.4f}' + ('' if std is None else f' ± {std:.4f}')


def parse_options(argv):
    """(this script's options, the --key=value settings it passes on to train_char.py)."""
    own, passthrough = [], {}
    for arg in argv:
        key, eq, value = arg.removeprefix('--').partition('=')
        if arg in ('-h', '--help') or key in OPTIONS:
            own.append(arg)
        elif arg.startswith('--') and eq:
            passthrough[key] = value
        else:
            die(f"{arg}: options are written --key=value")
    opts, given = configure(OPTIONS, own, positive=('seeds',), non_negative=('max_iters',), doc=__doc__)
    for key in passthrough:
        if key in REFUSED:
            die(f"--{key}: reproduce.py decides it: {REFUSED[key]}")
        if opts['study'] and key in ('learning_rate', 'min_lr'):
            die(f"--{key}: the study takes each variant's rate from its LR sweep (--regime=sweep_one_pass, --lr_grid)")
    if opts['study'] not in ('', '2x2'):
        die(f"study must be '' (the character-level sweep) or '2x2', not {opts['study']!r}")
    if opts['regime'] not in REGIMES:
        die(f"regime must be one of {', '.join(REGIMES)}, not {opts['regime']!r}")
    for key in ('regime', 'lr_grid'):   # without --study they would be dropped, and the long sweep run instead
        if key in given and not opts['study']:
            die(f"--{key} is the 2x2 study's: add --study=2x2")
    table = STUDY if opts['study'] else VARIANTS
    if opts['study'] and 'variants' not in given:
        opts['variants'] = ','.join(STUDY)
    if opts['study'] and 'seeds' not in given:
        opts['seeds'] = 5
    for v in opts['variants'].split(','):
        if v and v not in table:
            die(f"unknown variant {v!r}; the variants are {', '.join(table)}")
    if not any(opts['variants'].split(',')):   # nothing to run would still rewrite the summary
        die(f"variants names no variant; the variants are {', '.join(table)}")
    if opts['study'] and opts['regime'] in SWEEPS:
        if opts['dataset'] != 'shakespeare':
            die("the learning-rate sweep scores a held-out slice of the bundled corpus: it takes no --dataset")
        try:
            grid = [float(r) for r in opts['lr_grid'].split(',') if r]
        except ValueError:
            grid = []
        if not grid or not all(math.isfinite(r) and r > 0 for r in grid):
            die(f"lr_grid={opts['lr_grid']!r}: give positive learning rates, comma-separated, e.g. 1e-3,2e-3,4e-3")
        opts['lr_grid'] = sorted(grid)   # parsed once, here
    if 'snapshot' in given and opts['snapshot']:   # a name that matches no run would keep no snapshots
        names = [v for v in opts['variants'].split(',') if v]
        tags = ([f'lr{lr:g}' for lr in opts['lr_grid']] if opts['study'] and opts['regime'] in SWEEPS
                else [f'seed{s}' for s in range(1, opts['seeds'] + 1)])
        if opts['snapshot'] not in {f'{v}-{t}' for v in names for t in tags}:
            die(f"snapshot={opts['snapshot']!r} names no run of these settings (runs are named like "
                f"{names[0]}-{tags[0]}); give one, or --snapshot= for none")
    pick_device(opts['device'], 0)     # a device this machine lacks is refused before any download
    return opts, passthrough


def train_char_settings(files, settings):
    """The settings train_char.py resolves from these config files and flags, typed (--mode=config)."""
    p = subprocess.run([sys.executable, TRAIN_CHAR, *(os.path.join(ROOT, f) for f in files), *flags(settings),
                        '--mode=config'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        die(p.stderr.strip().removeprefix('error: '))
    return json.loads(p.stdout)


def plan(opts, passthrough, variants):
    """Every variant's train_char flags, parameter count and typed settings. DAMCHA's generator
    width is solved for MHA's count; the vocabulary size is the dataset's."""
    dataset = opts['dataset']
    common = dict(dataset=dataset, device=opts['device'])
    max_iters = opts['max_iters'] or (0 if config_files(dataset, dict(attn='mha')) else CPU_ITERS)
    if max_iters:
        common |= dict(max_iters=max_iters, lr_decay_iters=max_iters)
    common |= passthrough
    runs, params, typed, resolved = {}, {}, {}, {}
    for name in ['mha'] + [v for v in variants if v != 'mha']:
        settings = common | VARIANTS[name]
        files = tuple(config_files(dataset, settings))
        if files not in resolved:   # one train_char call per pair of config files; the variants differ in fields
            resolved[files] = train_char_settings(files, common)
        cfg = resolved[files] | VARIANTS[name]
        fields = {f.name: cfg[f.name] for f in dataclasses.fields(GPTConfig)}
        if not fields['vocab_size']:
            fields['vocab_size'] = len(load_dataset(cfg['dataset'], cfg['data_dir'])[1])
        if name.startswith('damcha') and fields['adaptive']:
            fields['gen_width'] = settings['gen_width'] = equal_params_width(params['mha'], fields)
        runs[name], params[name] = settings, count_params(fields)
        typed[name] = {k: cfg[k] for k in settings | dict(max_iters=0)}
        typed[name] |= {k: v for k, v in fields.items() if k != 'vocab_size'}
    return runs, params, typed


def read_json(path):
    """A JSON file this script wrote, or a one-line error if it was damaged since."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        die(f"{path} is not readable JSON ({e}); restore or delete it "
            "(a deleted eval JSON: the run is evaluated again)")


def ran_as_planned(run, eval_path, planned):
    """A finished run's eval JSON, refused unless the run ran as planned now (the settings in
    `planned` that its eval JSON records; older ones record fewer, a diverged run no iteration):
    its bpc goes into a summary beside these settings."""
    result = read_json(eval_path)
    for key, want in planned.items():
        if key in result and result[key] != want:
            die(f"{eval_path}: {run} ran with {key}={result[key]}, not {want} as asked now; "
                "give its settings, or another --results and --out_root")
    return result


def skip_finished(run, eval_path, planned):
    """Whether run is finished (its eval JSON exists, and it ran as planned)."""
    if not os.path.exists(eval_path):
        return False
    ran_as_planned(run, eval_path, planned)
    print(f"skip {run}: {eval_path} exists", flush=True)
    return True


def claim(out_dir):
    """Hold out_dir/claim.lock (an exclusive flock, which the kernel releases when this process ends
    in any way) while this process trains and evaluates the run, or None when another process of this
    script holds it: copies of one command, started side by side, share its runs."""
    os.makedirs(out_dir, exist_ok=True)
    held = open_lock(os.path.join(out_dir, 'claim.lock'))   # never through a link, nor truncating
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        return None
    return held


def copy_file(source, target):
    """shutil.copyfile, written as the project writes every file (atomic_write): whole or not at
    all, and never through a link at target."""
    with open(source, 'rb') as f, atomic_write(target) as copy:
        shutil.copyfileobj(f, copy)


def same_run(eval_path, planned):
    """Whether eval_path is a finished run's eval JSON that records this run's rate and seed, and
    every other setting of planned that it records, as planned."""
    if not os.path.exists(eval_path):
        return False
    result = read_json(eval_path)
    return all(k in result for k in ('learning_rate', 'min_lr', 'seed')) and all(
        result.get(k, v) == v for k, v in planned.items())


def checkpoint_iter(out_dir):
    """The iteration of out_dir/ckpt.pt, or None when there is none."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location='cpu', weights_only=True)['iter_num']
    except Exception as e:   # torch.load raises many kinds for a damaged file; all mean the same
        die(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it to train its run again")


def evaluate_checkpoint(run, out_dir, device, *more):
    """eval_char.py on out_dir: bpc of the whole val split, and test where there is one."""
    evaluation = subprocess.run([sys.executable, EVAL_CHAR, f'--out_dir={out_dir}',
                                 f"--device={device}", *more], stdout=subprocess.PIPE, text=True)
    if evaluation.returncode:
        die(f"evaluating {run} failed (its output is above)")
    return json.loads(evaluation.stdout)


def run_to_the_end(cmd):
    """Run cmd and return its exit status. On Ctrl-C, which reaches the child too, wait for the child
    to finish its own shutdown (subprocess.run would kill it after a quarter of a second), then stop.
    SIGTERM or SIGHUP sent to this process alone is passed on first, so the child stops as it would
    (saying where), never left training as an orphan that holds its out_dir."""
    with subprocess.Popen(cmd) as child:
        try:
            return child.wait()
        except KeyboardInterrupt as e:
            if isinstance(e, Interrupted):   # a child that got it too ignores a second one
                child.send_signal(e.args[0])
            child.wait()
            raise


def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, note, blocks=(), extra=None,
                       may_diverge=False):
    """Train one run through train_char.py (resuming its checkpoint if there is one), evaluate it,
    and keep its log, eval JSON and any weight snapshots under results. blocks: also evaluate with
    these RowSum blocks (val_bpc_<blocks>); extra: keys added to the eval JSON. may_diverge: a run
    that stops on a non-finite loss is recorded (failed, val_bpc inf) rather than ending the sweep."""
    trained = checkpoint_iter(out_dir)
    if trained is not None and trained > max_iters:   # its bpc would be summarized beside max_iters
        die(f"{out_dir}/ckpt.pt is at iter {trained}, past the max_iters={max_iters} asked now; "
            "give its settings, or another --out_root")
    logs = [os.path.join(out_dir, n) for n in ('log.jsonl', 'train_log.jsonl')]
    if os.path.isdir(out_dir):   # a run killed before its first checkpoint may have saved snapshots too
        logs += [os.path.join(out_dir, n) for n in os.listdir(out_dir) if re.fullmatch(SNAPSHOT, n)]
    if trained is None and any(os.path.exists(p) for p in logs):   # train_char.py keeps them from a new run
        with RunFolder(out_dir) as folder:
            folder.lock()   # refused in one line while another process trains this run
            print(f"note: {run} was stopped before its first checkpoint; its logs and snapshots in {out_dir} "
                  "are removed and it starts again", flush=True)
            for path in filter(os.path.exists, logs):
                os.remove(path)
    if trained == max_iters:
        print(f"{run}: trained, {out_dir}/ckpt.pt is at max_iters; evaluating it", flush=True)
    else:
        cmd = [sys.executable, TRAIN_CHAR, *(os.path.join(ROOT, f) for f in files)]
        cmd += flags(settings | dict(out_dir=out_dir, init_from='scratch' if trained is None else 'resume'))
        if run == opts['snapshot']:   # of this max_iters, those still ahead (a resume has written the others)
            ahead = [i for i in (round(f * max_iters) for f in SNAPSHOT_AT) if trained is None or i > trained]
            cmd.append('--snapshot_iters=' + ','.join(map(str, ahead)))
        print(f"train {run} ({note}): {' '.join(cmd[1:])}", flush=True)
        returncode = run_to_the_end(cmd)
        if returncode:
            if not (may_diverge and returncode == DIVERGED):
                die(f"training {run} failed (its output above says why); "
                    "once that is fixed, the same command resumes it")
            result = dict(failed=True, val_bpc=float('inf')) | (extra or {})
            # val_bpc: null (read_evals)
            write_text(os.path.join(results, run + '.eval.json'), to_json(result, indent=2) + '\n')
            return result
    result = evaluate_checkpoint(run, out_dir, opts['device'])
    if os.path.isabs(result['dataset']):   # a file made for the study: where it is in the checkout, not on this machine
        result['dataset'] = os.path.relpath(result['dataset'], ROOT)
    for b in blocks:
        result[f'val_bpc_{b}'] = evaluate_checkpoint(run, out_dir, opts['device'], f'--blocks={b}')['val_bpc']
    result |= extra or {}
    copy_file(os.path.join(out_dir, 'log.jsonl'), os.path.join(results, run + '.log.jsonl'))
    snapshots = sorted(f for f in os.listdir(out_dir) if f.startswith('snapshot-'))
    if snapshots:
        os.makedirs(os.path.join(results, 'snapshots', run), exist_ok=True)
        for f in snapshots:
            copy_file(os.path.join(out_dir, f), os.path.join(results, 'snapshots', run, f))
    # last: it marks the run done
    write_text(os.path.join(results, run + '.eval.json'), to_json(result, indent=2) + '\n')
    return result


def summary_rows(variants, runs, params, typed, opts, results):
    """Per variant: its parameter count against MHA's and the bpc of every finished seed."""
    rows = []
    for name in variants:
        evals = []
        for seed in range(1, opts['seeds'] + 1):
            path = os.path.join(results, f'{name}-seed{seed}.eval.json')
            if os.path.exists(path):   # also another process's variant: it joins these settings' summary
                evals.append(ran_as_planned(f'{name}-seed{seed}', path, sweep_planned(name, typed, params)))
        rel = params[name] / params['mha'] - 1
        files = config_files(opts['dataset'], VARIANTS[name])
        row = dict(variant=name, params=params[name], rel_params_vs_mha=rel, within_5pct=abs(rel) <= 0.05,
                   gen_width=runs[name].get('gen_width'), runs=len(evals),
                   config_file=' '.join(files) or None, settings=typed[name])
        for split in ('val', 'test'):
            values = [e[f'{split}_bpc'] for e in evals if f'{split}_bpc' in e]
            row[f'{split}_bpc_mean'], row[f'{split}_bpc_std'] = mean_std(values)
            row[f'{split}_bpc'] = values
        rows.append(row)
    return rows


def write_summary(rows, runs, opts, results):
    dataset = opts['dataset']
    settings = {k: v for k, v in runs['mha'].items() if k != 'attn'}
    write_text(os.path.join(results, 'summary.json'),
               to_json(dict(dataset=dataset, seeds=opts['seeds'], rows=rows), indent=2))
    lines = [f"Character-level comparison on {dataset}: {opts['seeds']} seed(s), mean ± sample std over seeds "
             f"of the bits per character of the whole split (eval_char.py).", '',
             f"Settings: `{' '.join(flags(settings))}`"
             + (f" after config/{dataset}.py and config/mha.py or config/damcha.py"
                if config_files(dataset, runs['mha']) else '')
             + "; params: GPT.get_num_params(), without the position embedding.", '',
             '| variant | params | rel. params vs MHA | val bpc | test bpc | runs |', '|---|---|---|---|---|---|']
    for r in rows:
        lines.append(f"| {r['variant']} | {r['params']:,} | {r['rel_params_vs_mha']:+.2%}"
                     f"{'' if r['within_5pct'] else ' (not within 5%)'} | {fmt(r['val_bpc_mean'], r['val_bpc_std'])} "
                     f"| {fmt(r['test_bpc_mean'], r['test_bpc_std'])} | {r['runs']} |")
    off = [r for r in rows if not r['within_5pct']]
    lines.append('')
    lines.append('Not within 5% of MHA\'s parameter count (nothing to trade for it): '
                 + ', '.join(f"{r['variant']} ({r['rel_params_vs_mha']:+.1%})" for r in off) + '.' if off else
                 'Every variant is within 5% of MHA\'s parameter count.')
    write_text(os.path.join(results, 'summary.md'), '\n'.join(lines) + '\n')
    print('\n'.join(lines))


# ----------------------------------------------------------------------------------------------
# The 2x2 study (--study=2x2)

def git_commit():
    """The commit these runs come from, with '+dirty' when tracked files differ from it."""
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        return 'unknown'
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ('+dirty' if dirty else '')


def write_study_summary(path, summary):
    """summary.json, unless it already says the same but for the commit that wrote it: summarizing
    finished runs again leaves a checkout's committed results as they were."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = None
    but_commit = lambda d: {k: v for k, v in d.items() if k != 'commit'}
    if isinstance(old, dict) and but_commit(old) == but_commit(json.loads(to_json(summary))):
        return
    write_text(path, to_json(summary, indent=2))


def interval(diffs):
    """(mean, half-width of the 95% t interval) of paired differences; half-width None below 2."""
    if not diffs:
        return None, None
    if len(diffs) < 2:
        return diffs[0], None
    return statistics.mean(diffs), t_quantile(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


def welch_interval(first, second):
    """(mean of first - mean of second, half-width of Welch's 95% t interval) of two independent
    samples; half-width None when either has fewer than 2 values."""
    if len(first) < 2 or len(second) < 2:
        return statistics.mean(first) - statistics.mean(second), None
    va, vb = statistics.variance(first) / len(first), statistics.variance(second) / len(second)
    dof = (va + vb) ** 2 / (va ** 2 / (len(first) - 1) + vb ** 2 / (len(second) - 1))
    return statistics.mean(first) - statistics.mean(second), t_quantile(0.975, dof) * math.sqrt(va + vb)


def training_split_file(folder, data_dir):
    """The bundled corpus's training split written as a text file: train_char splits a file
    90/5/5, so the LR sweep's val is a held-out slice of the training split, never the real val."""
    path = os.path.join(folder, 'shakespeare_train.txt')
    if not os.path.exists(path):
        components, vocab = load_dataset('shakespeare', data_dir)
        os.makedirs(folder, exist_ok=True)
        with atomic_write(path) as f:
            f.write(bytes(bytearray(vocab[i] for i in components[0].splits['train'].tolist())))
    return path


def study_plan(opts, passthrough, variants, dataset, vocab_size):
    """Every study variant's train_char settings and parameter count, its width solved for MHA's."""
    common = dict(dataset=dataset, device=opts['device']) | REGIMES[opts['regime']]
    common |= dict(max_iters=opts['max_iters']) if opts['max_iters'] else {}
    common |= dict(lr_decay_iters=common['max_iters']) | ({'vocab_size': vocab_size} if vocab_size else {})
    common |= passthrough
    cfg = train_char_settings((), common)
    base = {f.name: cfg[f.name] for f in dataclasses.fields(GPTConfig)}
    base['vocab_size'] = base['vocab_size'] or len(load_dataset(cfg['dataset'], cfg['data_dir'])[1])
    target = count_params(base | STUDY['mha']['fields'])
    runs, params = {}, {}
    for name in variants:
        trade, fields = STUDY[name]['trade'], base | STUDY[name]['fields']
        settings = common | STUDY[name]['fields']
        if trade == 'mlp_hidden' and fields['adaptive']:   # projected: own-slice DAMCHA's generator
            fields['gen_width'] = settings['gen_width'] = equal_params_width(target, fields | dict(attn='damcha'))
        if trade:
            fields[trade] = settings[trade] = equal_params_width(target, fields, trade)
        runs[name], params[name] = settings, count_params(fields)
    return runs, params, cfg


def read_evals(results):
    """{run name: eval JSON} of every finished run under results."""
    out = {}
    for f in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if f.endswith('.eval.json'):
            out[f.removesuffix('.eval.json')] = result = read_json(os.path.join(results, f))
            if result.get('failed'):   # a diverged run: its val_bpc, infinite, is written as null
                result['val_bpc'] = math.inf
    return out


def chosen_rates(root, sweep='sweep_one_pass'):
    """{variant: learning rate} chosen by the LR sweep (its summary.json), or a one-line error."""
    path = os.path.join(root, sweep, 'summary.json')
    if not os.path.exists(path):
        die(f"{path} does not exist: run the learning-rate sweep first (--regime={sweep})")
    summary = read_json(path)
    rates = summary.get('chosen_lr') if isinstance(summary, dict) else None
    if not (isinstance(rates, dict) and all(type(r) in (int, float) and r > 0 for r in rates.values())):
        die(f"{path} is damaged: its chosen_lr should map variants to learning rates; rerun --regime={sweep} to rewrite it")
    return rates


def lr_summary(variants, grid, params, results, commit):
    """Held-out bpc of each variant at each rate; the chosen rate is the lowest's."""
    evals = read_evals(results)
    lines = ['Learning-rate sweep: one seed, scored on a held-out slice of the training split (the 90-95% '
             'part of the first 90% of the corpus), never on val.', '',
             '| variant | params | ' + ' | '.join(f'lr {lr:g}' for lr in grid) + ' | chosen |',
             '|---|---|' + '---|' * len(grid) + '---|']
    chosen, table = {}, {}
    for name in variants:
        table[name] = {f'{lr:g}': evals[f'{name}-lr{lr:g}']['val_bpc'] for lr in grid if f'{name}-lr{lr:g}' in evals}
        if len(table[name]) == len(grid):
            best = min(grid, key=lambda lr: table[name][f'{lr:g}'])
            chosen[name] = best
        cells = [f"{table[name][f'{lr:g}']:.4f}" if f'{lr:g}' in table[name] else '...' for lr in grid]
        note = '' if name not in chosen else f"{chosen[name]:g}" + (' (edge of the grid)' if chosen[name] in (grid[0], grid[-1]) else '')
        lines.append(f"| {name} | {params[name]:,} | " + ' | '.join(cells) + f' | {note} |')
    write_study_summary(os.path.join(results, 'summary.json'),
                        dict(grid=grid, held_out_bpc=table, chosen_lr=chosen, commit=commit))
    write_text(os.path.join(results, 'summary.md'), '\n'.join(lines) + '\n')
    print('\n'.join(lines))


def fmt_interval(mean, half):
    return 'n/a' if mean is None else f'{mean:+.4f}' + ('' if half is None else f' [{mean - half:+.4f}, {mean + half:+.4f}]')


def seed_summary(variants, seeds, runs, params, rates, results, regime, commit):
    """Per variant: whole-val bpc, paired differences to MHA at equal steps and at equal wall-clock
    (each pair's val estimates from log.jsonl interpolated at the earlier finishing time), with 95%
    t intervals, the train/val gap (last logged estimates) and the run time; a regime that ran on a
    shared machine (SHARED_MACHINE) without the last two."""
    evals = read_evals(results)
    logs = {run: read_jsonl(os.path.join(results, run + '.log.jsonl')) for run in evals}
    rows = []
    for name in variants:
        done = [s for s in range(1, seeds + 1) if f'{name}-seed{s}' in evals]
        val = [evals[f'{name}-seed{s}']['val_bpc'] for s in done]
        paired = [s for s in done if f'mha-seed{s}' in evals]
        steps = [evals[f'{name}-seed{s}']['val_bpc'] - evals[f'mha-seed{s}']['val_bpc'] for s in paired]
        clock = []
        for s in paired:
            a, b = logs[f'{name}-seed{s}'], logs[f'mha-seed{s}']
            t = min(a[-1]['time'], b[-1]['time'])
            at = lambda log: float(np.interp(t, [e['time'] for e in log], [e['val_bpc'] for e in log]))
            clock.append(at(a) - at(b))
        gaps = [(logs[f'{name}-seed{s}'][-1]['val_loss'] - logs[f'{name}-seed{s}'][-1]['train_loss']) / math.log(2)
                for s in done]
        row = dict(variant=name, lr=rates.get(name), params=params[name],
                   rel_params_vs_mha=params[name] / params['mha'] - 1, runs=len(done), val_bpc=val,
                   val_bpc_mean=mean_std(val)[0], val_bpc_std=mean_std(val)[1],
                   diff_equal_steps=interval(steps), diff_equal_time=interval(clock),
                   gap_mean=mean_std(gaps)[0], minutes=mean_std([logs[f'{name}-seed{s}'][-1]['time'] / 60 for s in done])[0],
                   settings={k: v for k, v in runs[name].items() if k not in ('dataset', 'device')})
        if regime in SHARED_MACHINE:
            del row['diff_equal_time'], row['minutes']
        for b in ('diag', 'offdiag'):
            values = [evals[f'{name}-seed{s}'][f'val_bpc_{b}'] for s in done if f'val_bpc_{b}' in evals[f'{name}-seed{s}']]
            if values:
                row[f'val_bpc_{b}'] = values
        rows.append(row)
    contrasts = study_contrasts(evals, seeds)
    write_study_summary(os.path.join(results, 'summary.json'),
                        dict(regime=regime, seeds=seeds, commit=commit, run_commits=sorted({e['commit'] for e in evals.values()}),
                             rows=rows, contrasts=contrasts))
    timed = regime not in SHARED_MACHINE
    lines = [f"2x2 study, regime {regime}: {REGIMES[regime]}; whole-val bpc, mean ± std over seeds; paired "
             "differences to MHA (same seed, same batches) with 95% t intervals; "
             + ("equal time: each pair's val estimates (log.jsonl) at the earlier finishing time; " if timed else
                "no equal-time column: the runs shared the machine, so their times are load; ")
             + "gap: val - train estimate at the end, bpc.", '',
             '| variant | lr | params vs MHA | runs | val bpc | diff, equal steps | '
             + ('diff, equal time | gap | minutes |' if timed else 'gap |'), '|---|---|---|---|---|---|' + '---|---|---|' * timed
             + '---|' * (not timed)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['lr']:g} | {r['rel_params_vs_mha']:+.2%} | {r['runs']} | "
                     f"{fmt(r['val_bpc_mean'], r['val_bpc_std'])} | {fmt_interval(*r['diff_equal_steps'])} | "
                     + (f"{fmt_interval(*r['diff_equal_time'])} | " if timed else '')
                     + f"{fmt(r['gap_mean'], None)} |" + (f" {fmt(r['minutes'], None)} |" if timed else ''))
    if contrasts:
        lines += ['', 'The 2x2 read along its sides: paired differences (same seed, same batches) at equal steps, '
                  'val bpc, with 95% t intervals; negative: the first is better.', '',
                  '| contrast | first - second | runs | difference |', '|---|---|---|---|']
        lines += [f"| {c['contrast']} | ({c['first']}) - ({c['second']}) | {c['runs']} | {fmt_interval(*c['diff'])} |"
                  if ' - ' in c['first'] else f"| {c['contrast']} | {c['first']} - {c['second']} | {c['runs']} | "
                  f"{fmt_interval(*c['diff'])} |" for c in contrasts]
    for r in rows:
        for b in ('diag', 'offdiag'):
            if f'val_bpc_{b}' in r:
                lines.append(f"\n{r['variant']} evaluated with blocks={b}: val bpc "
                             f"{fmt(*mean_std(r[f'val_bpc_{b}']))} (trained with all blocks: {fmt(r['val_bpc_mean'], None)})")
    write_text(os.path.join(results, 'summary.md'), '\n'.join(lines) + '\n')
    print('\n'.join(lines))


# the sides of the 2x2: each effect measured twice, once in each row or column of the other factor
CONTRASTS = (('own slice instead of projected q, k (adaptive metric)', 'damcha', 'proj'),
             ('own slice instead of projected q, k (static metric)', 'static', 'mha'),
             ('adaptive metric instead of static (own slice)', 'damcha', 'static'),
             ('adaptive metric instead of static (projected q, k)', 'proj', 'mha'),
             ('full generator output instead of folded (Table 3 model)', 'damcha_full', 'damcha'))


def study_contrasts(evals, seeds):
    """CONTRASTS as paired differences of whole-val bpc over the seeds both variants finished, and
    the interaction: the first two contrasts' difference, seed by seed (how much the adaptive
    metric changes the cost of the own slice; equally, how much the own slice changes the effect
    of the adaptive metric)."""
    out, per_seed = [], {}
    for contrast, first, second in CONTRASTS:
        both = [s for s in range(1, seeds + 1) if f'{first}-seed{s}' in evals and f'{second}-seed{s}' in evals]
        if both:
            diffs = [evals[f'{first}-seed{s}']['val_bpc'] - evals[f'{second}-seed{s}']['val_bpc'] for s in both]
            per_seed[first, second] = dict(zip(both, diffs))
            out.append(dict(contrast=contrast, first=first, second=second, runs=len(both), diff=interval(diffs)))
    a, b = per_seed.get(('damcha', 'proj'), {}), per_seed.get(('static', 'mha'), {})
    both = sorted(set(a) & set(b))
    if both:
        out.append(dict(contrast='interaction: (damcha - proj) - (static - mha)', first='damcha - proj',
                        second='static - mha', runs=len(both), diff=interval([a[s] - b[s] for s in both])))
    return out


# the 2x2 of passes x dropout: the regime of each cell, (passes, dropout)
CELLS = dict(one_pass=('one pass', 'no dropout'), one_pass_dropout=('one pass', 'dropout 0.1'),
             three_passes=('three passes', 'no dropout'), three_passes_dropout=('three passes', 'dropout 0.1'))


def seeds_in(evals):
    """The seed numbers of the runs in {regime: {run name: eval JSON}}, in order."""
    return sorted({int(run.rsplit('-seed', 1)[1]) for runs in evals.values() for run in runs if '-seed' in run})


def factor_effects(root):
    """What passes (about 3 against 1) and dropout (0.1 against 0) do to each variant's difference
    to MHA, d_r = variant - mha at the same seed in regime r. Per seed, with d_1, d_1d, d_3, d_3d the
    cells one_pass, one_pass_dropout, three_passes, three_passes_dropout: passes = (d_3 + d_3d - d_1
    - d_1d) / 2, dropout = (d_1d + d_3d - d_1 - d_3) / 2, interaction = (d_3d - d_1d) - (d_3 - d_1)
    (how much dropout changes the effect of passes), each with its 95% t interval over the seeds that
    finished all eight runs. The regimes' runs are independent, so joining them by seed number
    correlates nothing: each contrast's spread over seeds is its own. Writes factors.md and
    factors.json (with each cell's per-seed differences) under root once a seed has every cell."""
    evals = {r: read_evals(os.path.join(root, r)) for r in CELLS}
    rows = []
    for name in ('proj', 'damcha'):
        runs = lambda s: [f'{v}-seed{s}' for v in (name, 'mha')]
        done = [s for s in seeds_in(evals) if all(run in evals[r] for r in CELLS for run in runs(s))]
        if not done:
            continue
        d = {r: [evals[r][f'{name}-seed{s}']['val_bpc'] - evals[r][f'mha-seed{s}']['val_bpc'] for s in done] for r in CELLS}
        d1, d1d, d3, d3d = d['one_pass'], d['one_pass_dropout'], d['three_passes'], d['three_passes_dropout']
        effects = dict(passes=[(d3[k] + d3d[k] - d1[k] - d1d[k]) / 2 for k in range(len(done))],
                       dropout=[(d1d[k] + d3d[k] - d1[k] - d3[k]) / 2 for k in range(len(done))],
                       interaction=[(d3d[k] - d1d[k]) - (d3[k] - d1[k]) for k in range(len(done))])
        rows.append(dict(variant=name, seeds=done, diffs=d, cells={r: interval(d[r]) for r in CELLS},
                         effects={k: interval(v) for k, v in effects.items()}))
    if not rows:
        return
    write_study_summary(os.path.join(root, 'factors.json'), dict(cells=CELLS, rows=rows, commit=git_commit()))
    lines = ['Passes x dropout: whole-val bpc of each variant minus MHA\'s at the same seed, in each cell '
             '(regime), and the effect of each factor on that difference, with 95% t intervals over the '
             'seeds that finished every cell. Negative: the factor helps the variant against MHA.', '',
             '| variant | seeds | ' + ' | '.join(f'{p}, {q} ({r})' for r, (p, q) in CELLS.items())
             + ' | passes | dropout | interaction |', '|---|---|' + '---|' * (len(CELLS) + 3)]
    lines += [f"| {row['variant']} - mha | {len(row['seeds'])} | "
              + ' | '.join(fmt_interval(*row['cells'][r]) for r in CELLS) + ' | '
              + ' | '.join(fmt_interval(*row['effects'][k]) for k in ('passes', 'dropout', 'interaction')) + ' |'
              for row in rows]
    write_text(os.path.join(root, 'factors.md'), '\n'.join(lines) + '\n')
    print('\n'.join(lines))


# three_passes_dropout changed in one thing: the rates chosen at its own length
# (three_passes_dropout_own_rates, that regime again by SAME_AS: the same seeds, initialisation and
# batches, so its changes are paired), or the model's size (d256_three_passes_dropout)
BASE = 'three_passes_dropout'
CHANGES = dict(three_passes_dropout_own_rates='rates chosen at 6,000 iterations',
               d256_three_passes_dropout='D = 256, 6 layers, context 128')


def changes_from_three_passes_dropout(root):
    """Whether each contrast (a variant's bpc minus another's at the same seed) moves from
    three_passes_dropout when the rates are chosen at that regime's length
    (three_passes_dropout_own_rates: same seeds, so the per-seed change, with its paired 95% t
    interval) or when the model is larger (d256_three_passes_dropout: other runs, so the difference
    of the two regimes' means, with Welch's 95% t interval). damcha - proj is the own slice's cost
    with the adaptive metric on both sides, free of MHA's seeds. Writes changes.md and changes.json
    under root once three_passes_dropout and one of the others have a seed of both sides."""
    evals = {r: read_evals(os.path.join(root, r)) for r in (BASE, *CHANGES)}
    rows = []
    for first, second in (('proj', 'mha'), ('damcha', 'mha'), ('damcha', 'proj')):
        d = {r: {s: evals[r][f'{first}-seed{s}']['val_bpc'] - evals[r][f'{second}-seed{s}']['val_bpc']
                 for s in seeds_in(evals) if f'{first}-seed{s}' in evals[r] and f'{second}-seed{s}' in evals[r]}
             for r in evals}
        if not d[BASE] or not any(d[r] for r in CHANGES):
            continue
        change = {r: interval([d[r][s] - d[BASE][s] for s in d[r] if s in d[BASE]]) if SAME_AS.get(r) == BASE
                  else welch_interval(list(d[r].values()), list(d[BASE].values())) if d[r] else (None, None)
                  for r in CHANGES}
        rows.append(dict(contrast=f'{first} - {second}', diffs={r: list(v.values()) for r, v in d.items()},
                         cells={r: interval(list(v.values())) for r, v in d.items()}, change=change))
    if not rows:
        return
    write_study_summary(os.path.join(root, 'changes.json'), dict(changes=CHANGES, rows=rows, commit=git_commit()))
    cell = lambda diffs, mean_half: f"{len(diffs)}, {fmt_interval(*mean_half)}" if diffs else ''
    lines = ['three_passes_dropout (about three passes with dropout 0.1) changed in its rates '
             '(three_passes_dropout_own_rates) or in its model size (d256_three_passes_dropout, at the rates of '
             'its own sweep): whole-val bpc of one variant minus another\'s at the same seed, with 95% t '
             'intervals (seeds, difference), and its change from three_passes_dropout: '
             'three_passes_dropout_own_rates per seed (paired), d256_three_passes_dropout as the difference of '
             'the means (Welch). Negative change: the change favours the first variant more.', '',
             f'| contrast | {BASE} | ' + ' | '.join(f'{r} ({what}) | change' for r, what in CHANGES.items()) + ' |',
             '|---|---|' + '---|---|' * len(CHANGES)]
    lines += [f"| {row['contrast']} | {cell(row['diffs'][BASE], row['cells'][BASE])} | "
              + ' | '.join(f"{cell(row['diffs'][r], row['cells'][r])} | "
                           + (fmt_interval(*row['change'][r]) if row['diffs'][r] else '') for r in CHANGES) + ' |'
              for row in rows]
    write_text(os.path.join(root, 'changes.md'), '\n'.join(lines) + '\n')
    print('\n'.join(lines))


def study(opts, passthrough):
    """The 2x2 study: a sweep regime (SWEEPS) sweeps the learning rates, the others train every
    variant at its chosen rate for --seeds seeds; results in <results>/<regime>/, checkpoints in <out_root>/<regime>/."""
    variants = [v for v in opts['variants'].split(',') if v]
    if 'mha' not in variants:
        die("the study's differences are to MHA: include mha in --variants")
    regime = opts['regime']
    root = opts['results'] or os.path.join(ROOT, 'results', 'study' + opts['study'])
    out_root = os.path.join(opts['out_root'] or os.path.join(ROOT, 'out-study', opts['study']), regime)
    results = os.path.join(root, regime)
    commit = git_commit()
    seeds, grid = range(1, opts['seeds'] + 1), opts['lr_grid']
    if regime in SWEEPS:
        dataset = training_split_file(out_root, passthrough.get('data_dir', ''))
        vocab_size = len(load_dataset(opts['dataset'], passthrough.get('data_dir', ''))[1])
        jobs_of = lambda names: [(f'{n}-lr{lr:g}', n, dict(learning_rate=lr, min_lr=lr / 10, seed=1))
                                 for lr in grid for n in names]
        # another variant joins the summary with every rate of the grid done, which keeps its chosen rate
        complete = lambda v: len(finished(results, [f'{v}-lr{lr:g}' for lr in grid])) == len(grid)
    else:
        dataset, vocab_size = opts['dataset'], 0
        rates = chosen_rates(root, RATES_FROM.get(regime, 'sweep_one_pass'))
        missing = [v for v in variants if v not in rates]
        if missing:
            die(f"the LR sweep has chosen no rate yet for {', '.join(missing)}: finish "
                f"--regime={RATES_FROM.get(regime, 'sweep_one_pass')} first")
        jobs_of = lambda names: [(f'{n}-seed{s}', n, dict(learning_rate=rates[n], min_lr=rates[n] / 10, seed=s))
                                 for s in seeds for n in names]
        # another variant joins the summary with a chosen rate and a finished seed
        complete = lambda v: v in rates and finished(results, [f'{v}-seed{s}' for s in seeds])
    runs, params, cfg = study_plan(opts, passthrough, variants, dataset, vocab_size)
    # what an eval JSON records of its run's settings (params: since this script records it)
    planned = lambda name, extra: dict(iter=cfg['max_iters'], block_size=cfg['block_size'],
                                       params=params[name], **extra)
    os.makedirs(results, exist_ok=True)
    for run, name, extra in jobs_of(variants):
        settings = runs[name] | extra
        if skip_finished(run, os.path.join(results, run + '.eval.json'), planned(name, extra)):
            continue
        same = os.path.join(root, SAME_AS.get(regime, regime), run)
        if regime in SAME_AS and same_run(same + '.eval.json', planned(name, extra)):
            print(f"{run}: regime {SAME_AS[regime]}'s run had these settings; its results are copied", flush=True)
            copy_file(same + '.log.jsonl', os.path.join(results, run + '.log.jsonl'))
            copy_file(same + '.eval.json', os.path.join(results, run + '.eval.json'))   # last: it marks the run done
            continue
        held = claim(os.path.join(out_root, run))
        if held is None:
            print(f"skip {run}: another process is training it", flush=True)
            continue
        with held:
            if skip_finished(run, os.path.join(results, run + '.eval.json'), planned(name, extra)):
                continue   # the other process finished it between the two looks
            t0 = time.time()
            blocks = ('diag', 'offdiag') if regime not in SWEEPS and settings.get('gen_out') == 'full' else ()
            result = train_and_evaluate(run, os.path.join(out_root, run), (), settings, cfg['max_iters'],
                                        opts, results, f'{params[name]:,} parameters', blocks,
                                        dict(commit=commit, variant=name, params=params[name], **extra),
                                        may_diverge=regime in SWEEPS)
        print(f"done {run} in {time.time() - t0:.0f} s: val bpc {result['val_bpc']:.4f}", flush=True)
    summarized = [v for v in STUDY if v in variants or complete(v)]   # looked up now, after training
    if summarized != variants:
        runs, params, _ = study_plan(opts, passthrough, summarized, dataset, vocab_size)
    others = [v for v in summarized if v not in variants]   # another process's: they join this summary
    for run, name, extra in jobs_of(others):
        if os.path.exists(os.path.join(results, run + '.eval.json')):
            ran_as_planned(run, os.path.join(results, run + '.eval.json'), planned(name, extra))
    if regime in SWEEPS:
        lr_summary(summarized, grid, params, results, commit)
    else:
        seed_summary(summarized, opts['seeds'], runs, params, rates, results, regime, commit)
        factor_effects(root)
        changes_from_three_passes_dropout(root)


def main(argv):
    opts, passthrough = parse_options(argv)
    try:
        with signals_as_ctrl_c():   # SIGTERM and SIGHUP too, passed on to the training run (run_to_the_end)
            if opts['study']:
                opts['snapshot'] = opts['snapshot'] if opts['snapshot'] != 'damcha-seed1' else ''
                study(opts, passthrough)
            else:
                sweep(opts, passthrough)
    except KeyboardInterrupt as e:   # Ctrl-C reaches train_char.py too; its checkpoint is whole (atomic writes)
        print("interrupted: finished runs are kept, and the same command resumes the rest", file=sys.stderr)
        raise SystemExit(exit_status(e))
    except OSError as e:        # a results folder that cannot be made, a full disk: the system's reason
        die(e)


def finished(results, runs):
    """Those of the named runs whose eval JSON is in results. A summary covers the variants asked
    for and every other one with finished runs, looked up once training is over: of a sweep split
    over processes (--variants=...), the one that finishes last then writes every row."""
    return [run for run in runs if os.path.exists(os.path.join(results, run + '.eval.json'))]


def sweep_planned(name, typed, params):
    """What a sweep run's eval JSON records of its settings, as planned now: its iterations and
    context (eval_char.py's), and its parameter count (recorded by this script; the committed runs
    predate it), which any other model setting changes."""
    return dict(iter=typed[name]['max_iters'], block_size=typed[name]['block_size'], params=params[name])


def sweep(opts, passthrough):
    """The character-level comparison: every variant for --seeds seeds, then the summary."""
    dataset, variants = opts['dataset'], [v for v in opts['variants'].split(',') if v]
    results = opts['results'] or os.path.join(ROOT, 'results', 'charlevel', os.path.basename(dataset))
    out_root = opts['out_root'] or os.path.join(ROOT, 'out-reproduce', os.path.basename(dataset))
    runs, params, typed = plan(opts, passthrough, variants)
    os.makedirs(results, exist_ok=True)
    for seed in range(1, opts['seeds'] + 1):
        for name in variants:
            run = f'{name}-seed{seed}'
            if skip_finished(run, os.path.join(results, run + '.eval.json'), sweep_planned(name, typed, params)):
                continue
            t0 = time.time()
            result = train_and_evaluate(run, os.path.join(out_root, run), config_files(dataset, VARIANTS[name]),
                                        runs[name] | dict(seed=seed), typed[name]['max_iters'], opts, results,
                                        f'{params[name]:,} parameters', extra=dict(params=params[name]))
            print(f"done {run} in {time.time() - t0:.0f} s: val bpc {result['val_bpc']:.4f}"
                  + (f", test bpc {result['test_bpc']:.4f}" if 'test_bpc' in result else ''), flush=True)
    seeds = range(1, opts['seeds'] + 1)
    summarized = [v for v in VARIANTS if v in variants or finished(results, [f'{v}-seed{s}' for s in seeds])]
    if summarized != variants:
        runs, params, typed = plan(opts, passthrough, summarized)
    rows = summary_rows(summarized, runs, params, typed, opts, results)
    write_summary(rows, runs, opts, results)
    bad = [r['variant'] for r in rows if r['val_bpc_mean'] is not None and not math.isfinite(r['val_bpc_mean'])]
    if bad:
        die(f"non-finite val bpc: {', '.join(bad)}")


if __name__ == '__main__':
    main(sys.argv[1:])
