"""
reproduce.py: the paper's character-level comparison (issue 7), MHA against DCMHA, DAMCHA and
DAMCHA's ablations at equal parameter count, several seeds each, scored on the full splits.

    python reproduce.py                           # bundled Shakespeare, 5 variants x 3 seeds, on the CPU
    python reproduce.py --seeds=5 --variants=mha,damcha --max_iters=4000
    python reproduce.py --dataset=text8 --device=cuda      # enwik8, text8, mix: for a GPU
    python reproduce.py --n_layer=2 --batch_size=8         # any other --key=value goes to train_char.py

Variants (every run is `python train_char.py ...` in a subprocess, then `--mode=eval` on its ckpt;
the settings come from `train_char.py ... --mode=config`, so this script never imports the trainer):
    mha              attn=mha, the baseline whose parameter count the others match
    dcmha            attn=dcmha (Xiao et al. 2024); no width to trade, so its count is what it is
    damcha           the shared folded generator, its width solved by damcha_torch.equal_params_width
    damcha_static    adaptive=False, a learned constant metric: no generator, so fewer parameters
    damcha_unshared  share=False, a generator per layer, its width solved likewise
Counts are GPT.get_num_params() (damcha_torch.count_params); summary.md flags each variant that is not
within 5% of MHA's count rather than hiding it.

Model and schedule: on shakespeare, train_char.py's defaults (4 layers, 4 heads, D = 128, T = 64,
batch 12) for 10,000 iterations (7.7M characters, ~5 passes over the corpus), lr decayed to the end.
Measured on 2 idle CPU cores, ms per iteration: mha 38, damcha_static 35, damcha 58,
damcha_unshared 65, dcmha 80; so a run takes 6 (mha) to 13 (dcmha) minutes, DAMCHA's about 10,
plus ~10 s of eval, and the default sweep (5 variants x 3 seeds) about 2.5 hours. Two processes
side by side with one thread each and the variants split between them (OMP_NUM_THREADS=1 ...
--variants=mha,dcmha,damcha_static, and --variants=damcha,damcha_unshared) did it in 1 h 45 min.
On enwik8, text8 and mix: config/<dataset>.py followed by config/mha.py (mha, dcmha) or
config/damcha.py (the DAMCHA variants): 12 x 512, T = 512, 50k iterations.

Output, under --results (default results/charlevel/<dataset>/): <variant>-seed<k>.log.jsonl (the
run's eval curve) and <variant>-seed<k>.eval.json (train_char --mode=eval: bpc of the whole val
split, and of the test split where the dataset has one), summary.json and summary.md; and for the
run named by --snapshot (default damcha-seed1) its weights in float16 at 0, 2.5, 10, 30 and 100% of
training, in snapshots/<run>/snapshot-<iter>.pt (train_char --snapshot_iters). Checkpoints
go to --out_root (default out-reproduce/<dataset>/<variant>-seed<k>/). A run whose eval JSON
exists is skipped, so an interrupted sweep continues where it stopped; a run whose checkpoint
exists but is not yet evaluated resumes from it.
"""
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from configurator import configure, die
from damcha_torch import GPTConfig, count_params, equal_params_width
from data.prepare import atomic_write, load_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_CHAR = os.path.join(HERE, 'train_char.py')
VARIANTS = dict(mha=dict(attn='mha'), dcmha=dict(attn='dcmha'), damcha=dict(attn='damcha'),
                damcha_static=dict(attn='damcha', adaptive=False),
                damcha_unshared=dict(attn='damcha', share=False))
OPTIONS = dict(dataset='shakespeare', seeds=3, variants=','.join(VARIANTS), max_iters=0, device='auto',
               results='', out_root='', snapshot='damcha-seed1')
# the run named by --snapshot also keeps its weights at these fractions of max_iters, in
# <results>/snapshots/<run>/: notebooks/04 plots its learned metric over training from them
SNAPSHOT_AT = (0, 0.025, 0.1, 0.3, 1)
CPU_ITERS = 10000   # shakespeare's default: DAMCHA's run takes about 10 minutes on 2 CPU cores


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
    opts, _ = configure(OPTIONS, own, doc=__doc__)
    for v in opts['variants'].split(','):
        if v and v not in VARIANTS:
            die(f"unknown variant {v!r}; the variants are {', '.join(VARIANTS)}")
    return opts, passthrough


def train_char_settings(files, settings):
    """The settings train_char.py resolves from these config files and flags, typed (--mode=config)."""
    p = subprocess.run([sys.executable, TRAIN_CHAR, *(os.path.join(HERE, f) for f in files), *flags(settings),
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


def checkpoint_iter(out_dir):
    """The iteration of out_dir/ckpt.pt, or None when there is none."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location='cpu', weights_only=True)['iter_num']
    except Exception as e:   # torch.load raises many kinds for a damaged file; all mean the same
        die(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it to train its run again")


def train_and_evaluate(run, out_dir, files, settings, max_iters, opts, results, note):
    """Train one run through train_char.py (resuming its checkpoint if there is one), evaluate it,
    and keep its log, eval JSON and any weight snapshots under results."""
    trained = checkpoint_iter(out_dir)
    if trained is not None and trained >= max_iters:
        print(f"{run}: trained, {out_dir}/ckpt.pt is at max_iters; evaluating it", flush=True)
    else:
        cmd = [sys.executable, TRAIN_CHAR, *(os.path.join(HERE, f) for f in files)]
        cmd += flags(settings | dict(out_dir=out_dir, init_from='scratch' if trained is None else 'resume'))
        if run == opts['snapshot']:
            cmd.append('--snapshot_iters=' + ','.join(str(round(f * max_iters)) for f in SNAPSHOT_AT))
        print(f"train {run} ({note}): {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode:
            die(f"training {run} failed (its output is above); rerun to resume it")
    evaluation = subprocess.run([sys.executable, TRAIN_CHAR, '--mode=eval', f'--out_dir={out_dir}',
                                 f"--device={opts['device']}"], stdout=subprocess.PIPE, text=True)
    if evaluation.returncode:
        die(f"evaluating {run} failed (its output is above)")
    result = json.loads(evaluation.stdout)
    shutil.copyfile(os.path.join(out_dir, 'log.jsonl'), os.path.join(results, run + '.log.jsonl'))
    snapshots = sorted(f for f in os.listdir(out_dir) if f.startswith('snapshot-'))
    if snapshots:
        os.makedirs(os.path.join(results, 'snapshots', run), exist_ok=True)
        for f in snapshots:
            shutil.copyfile(os.path.join(out_dir, f), os.path.join(results, 'snapshots', run, f))
    with atomic_write(os.path.join(results, run + '.eval.json')) as f:   # last: it marks the run done
        f.write((json.dumps(result, indent=2) + '\n').encode())
    return result


def summary_rows(variants, runs, params, typed, opts, results):
    """Per variant: its parameter count against MHA's and the bpc of every finished seed."""
    rows = []
    for name in variants:
        evals = []
        for seed in range(1, opts['seeds'] + 1):
            path = os.path.join(results, f'{name}-seed{seed}.eval.json')
            if os.path.exists(path):
                with open(path) as f:
                    evals.append(json.load(f))
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
    with open(os.path.join(results, 'summary.json'), 'w') as f:
        json.dump(dict(dataset=dataset, seeds=opts['seeds'], rows=rows), f, indent=2)
    lines = [f"Character-level comparison on {dataset}: {opts['seeds']} seed(s), mean ± sample std over seeds "
             f"of the bits per character of the whole split (train_char.py --mode=eval).", '',
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
    with open(os.path.join(results, 'summary.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def main(argv):
    opts, passthrough = parse_options(argv)
    dataset, variants = opts['dataset'], [v for v in opts['variants'].split(',') if v]
    results = opts['results'] or os.path.join(HERE, 'results', 'charlevel', os.path.basename(dataset))
    out_root = opts['out_root'] or os.path.join(HERE, 'out-reproduce', os.path.basename(dataset))
    runs, params, typed = plan(opts, passthrough, variants)
    os.makedirs(results, exist_ok=True)
    for seed in range(1, opts['seeds'] + 1):
        for name in variants:
            run = f'{name}-seed{seed}'
            eval_path = os.path.join(results, run + '.eval.json')
            if os.path.exists(eval_path):
                print(f"skip {run}: {eval_path} exists", flush=True)
                continue
            t0 = time.time()
            result = train_and_evaluate(run, os.path.join(out_root, run), config_files(dataset, VARIANTS[name]),
                                        runs[name] | dict(seed=seed), typed[name]['max_iters'], opts, results,
                                        f'{params[name]:,} parameters')
            print(f"done {run} in {time.time() - t0:.0f} s: val bpc {result['val_bpc']:.4f}"
                  + (f", test bpc {result['test_bpc']:.4f}" if 'test_bpc' in result else ''), flush=True)
    rows = summary_rows(variants, runs, params, typed, opts, results)
    write_summary(rows, runs, opts, results)
    bad = [r['variant'] for r in rows if r['val_bpc_mean'] is not None and not math.isfinite(r['val_bpc_mean'])]
    if bad:
        die(f"non-finite val bpc: {', '.join(bad)}")


if __name__ == '__main__':
    main(sys.argv[1:])
