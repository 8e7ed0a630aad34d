"""
synthetic.py: the paper's synthetic tasks (arXiv 2610.13261, Appendix I, Figures 12-13), DAMCHA
against MHA at equal parameter count, on tasks built so that predicting the target needs
attention across four feature subspaces, one per head.

    python lab/synthetic.py              # the whole sweep, 2 worker processes
    python lab/synthetic.py --quick      # a smoke run: 1 seed, a few steps, results to /tmp
    python lab/synthetic.py --workers=1 --steps=200 --out=/tmp/syn
    python lab/synthetic.py --steps=6000 --lambdas=0,0.6,1 --dims= --out=results/synthetic/long
                                         # the longer-training check of the regression

Settings are --key=value (configurator.py): quick, out, workers (at most one per job), steps, batch, lr,
n_layer, seeds, lambdas and dims (comma lists; empty skips the task).

The paper (Appendix I) describes the tasks' structure; the formulas below are ours, and the paper's may differ.

Data. A sample is a sequence of T = 8 tokens x_1 .. x_T, i.i.d. N(0, I) in R^D, D = 4 d_e, each
split into four subspaces x_t^(h) in R^{d_e}, h = 0..3 (coordinates h d_e .. (h+1) d_e - 1). A
planted "teacher" attention, drawn once per seed, reads the last token as the query:

    s_t^{hg} = beta x_T^(h)T A_hg x_t^(g) / d_e       score of token t, query subspace h, key subspace g
    v_t^{g}  = r_g . x_t^(g) / sqrt(d_e)              value of token t, read from subspace g
    term_hg  = sum_t softmax_t(s^{hg})_t v_t^{g}      (t over all T tokens, the last included)

A_hg has N(0, 1) entries and r_g is N(0, I) (each score and value then has unit variance), beta = 2.
term_hh is a within-subspace interaction (query, key and value all in subspace h); term_hg with
g != h is a cross-subspace one: subspace h of the query decides which tokens count, by subspace g.

  regression:      y = sum_h [ term_hh + lambda / 3 * sum_{g != h} term_hg ],  lambda in {0, 0.2, .., 1},
                   d_e = 8 (D = 32). With lambda = 0, y is a sum of four functions, each of one
                   subspace of the tokens only (no cross-subspace term); at lambda = 1 each query
                   subspace's three cross terms together have the coefficient of its within term (they
                   then carry about a quarter of y's variance: they partly average out). y is
                   standardised with the training set's mean and std, so a test MSE of 1 is
                   predicting the mean.
  classification:  K = 4 classes, label = argmax_k y^k, where y^k is the regression target at
                   lambda = 1 with its own value readouts r_g^k (the scores A_hg are shared by the
                   classes); d_e in {4, 8, 12, 16, 20} (D = 16 .. 80). Chance is about 1/4.

Models. The project's own transformer blocks, damcha_torch.Block with GPTConfig(attn="damcha" or
"mha", n_head=4, n_layer=2, n_embd=D): the features go in directly (no token embedding, no input
layer), so in the first layer head h owns subspace h; no position embedding (the task is a set plus
a query, the last token). The model is causal, so the prediction is read at the last position,
which attends to every token: ln_f, then a linear head (1 output, or K logits). DAMCHA shares one
metric generator over the stack (share=True, as GPT does) with gen_out="folded" (f outputs m, the
same function class as "full": RowSum is linear), P = 2; its width w is lab/counts.equal_params_width's,
so that DAMCHA and MHA have equal parameter counts (within 5%; checked, and recorded per row).

Training: AdamW (damcha_torch.configure_optimizers: lr 3e-3, weight decay 0.01 on the matrices,
betas (0.9, 0.99)), cosine decay to 10% (train_char.get_lr, no warm-up), batch 64,
`steps` steps on a fixed training set of 16384 samples, 2048 fresh test samples. Each seed draws
the teacher, the data and the initialisation; DAMCHA and MHA see the same data (paired), and the
relative gain of a seed is (MSE_mha - MSE_damcha) / MSE_mha (positive: DAMCHA better).

Output (--out, default results/synthetic): runs.csv (one row per task, x, seed, model),
summary.json (the settings, and per point the mean and std over the seeds). The committed
results/synthetic/ holds the default sweep (1500 steps), results/synthetic/long/ the regression
at three lambdas trained 4x longer (6000 steps), to see whether the trend over lambda holds.
"""
import csv
import io
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
if ROOT not in sys.path:   # run as a file (python lab/synthetic.py): the book's modules are in the root
    sys.path.insert(0, ROOT)

# first: its excepthook makes memory too short to import torch one line, not a traceback
from shell import die, one_line_errors

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import configure
from damcha_torch import (Block, CausalSelfAttention, DamchaAttention, Generator, GPTConfig,
                          configure_optimizers, init_weights)
from run_folder import to_json, write_text
from train_char import get_lr
from lab.counts import count_params, equal_params_width

H = 4                                    # subspaces = heads
T = 8                                    # tokens per sample
BETA = 2.0                               # teacher's inverse temperature
K = 4                                    # classes
LAMBDAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DIMS = (4, 8, 12, 16, 20)
REG_DIM = 8                              # d_e of the regression task
CLS_LAMBDA = 1.0
N_TRAIN, N_TEST = 16384, 2048
DEFAULTS = dict(steps=1500, batch=64, lr=3e-3, n_layer=2, seeds=3)
SETTINGS = dict(DEFAULTS, quick=False, out="", workers=2, lambdas=",".join(map(str, LAMBDAS)),
                dims=",".join(map(str, DIMS)))


# ----------------------------------------------------------------------------------------------
# Data

def make_teacher(d_e, n_out=1, seed=0):
    """The planted attention: A (H, H, d_e, d_e), scores A_hg, and r (n_out, H, d_e), value readouts."""
    g = torch.Generator().manual_seed(seed)
    return {"A": torch.randn(H, H, d_e, d_e, generator=g), "r": torch.randn(n_out, H, d_e, generator=g)}


def teacher_terms(x, teacher):
    """x (N, T, H*d_e) -> term (N, n_out, H, H): term[n, k, h, g] = sum_t softmax_t(s^{hg}) v_t^{g, k}."""
    N, T_, D = x.shape
    d_e = D // H
    xs = x.view(N, T_, H, d_e)
    q = xs[:, -1]                                                    # (N, H, d_e): the last token
    s = BETA * torch.einsum("nha,hgab,ntgb->nhgt", q, teacher["A"], xs) / d_e   # (N, H, H, T)
    p = torch.softmax(s, dim=-1)
    v = torch.einsum("ntgb,kgb->nkgt", xs, teacher["r"]) / math.sqrt(d_e)      # (N, n_out, H, T)
    return torch.einsum("nhgt,nkgt->nkhg", p, v)


def combine(terms, lam):
    """sum_h [term_hh + lam / (H - 1) * sum_{g != h} term_hg]: terms (N, n_out, H, H) -> (N, n_out)."""
    eye = torch.eye(H, dtype=terms.dtype)
    weight = eye + lam / (H - 1) * (1 - eye)
    return (terms * weight).sum(dim=(-1, -2))


def sample_tokens(n, d_e, generator):
    return torch.randn(n, T, H * d_e, generator=generator)


def regression_data(lam, d_e=REG_DIM, seed=0, n_train=N_TRAIN, n_test=N_TEST):
    """(x_train, y_train, x_test, y_test); y standardised by the training set's mean and std."""
    teacher = make_teacher(d_e, 1, seed)
    g = torch.Generator().manual_seed(10_000 + seed)
    x_tr, x_te = sample_tokens(n_train, d_e, g), sample_tokens(n_test, d_e, g)
    y_tr, y_te = (combine(teacher_terms(x, teacher), lam)[:, 0] for x in (x_tr, x_te))
    mu, sd = y_tr.mean(), y_tr.std()
    return x_tr, (y_tr - mu) / sd, x_te, (y_te - mu) / sd


def classification_data(d_e, seed=0, lam=CLS_LAMBDA, n_train=N_TRAIN, n_test=N_TEST):
    """(x_train, labels_train, x_test, labels_test), labels = argmax over K teacher outputs."""
    teacher = make_teacher(d_e, K, seed)
    g = torch.Generator().manual_seed(20_000 + seed)
    x_tr, x_te = sample_tokens(n_train, d_e, g), sample_tokens(n_test, d_e, g)
    y_tr, y_te = (combine(teacher_terms(x, teacher), lam).argmax(dim=1) for x in (x_tr, x_te))
    return x_tr, y_tr, x_te, y_te


# ----------------------------------------------------------------------------------------------
# Models

def model_config(attn, D, n_layer=DEFAULTS["n_layer"]):
    """GPTConfig of the blocks; DAMCHA's generator width is solved for equal parameter count with
    MHA (lab/counts.equal_params_width on the GPT of the same blocks: that GPT and SetModel differ by
    the same parameters, embeddings against head, for both attentions)."""
    fields = dict(vocab_size=1, block_size=T, n_layer=n_layer, n_head=H, n_embd=D)
    if attn == "mha":
        return GPTConfig(**fields, attn="mha")
    damcha = dict(fields, attn="damcha", gen_out="folded", gen_depth=2)
    width = equal_params_width(count_params(dict(fields, attn="mha")), damcha)
    return GPTConfig(**damcha, gen_width=width)


class SetModel(nn.Module):
    """Features (B, T, D) -> a stack of damcha_torch Blocks -> ln_f -> linear head, read at the
    last position (the model is causal: only that position sees every token)."""

    def __init__(self, config, n_out):
        super().__init__()
        self.config = config
        attention = DamchaAttention if config.attn == "damcha" else CausalSelfAttention
        self.h = nn.ModuleList([Block(config, attention) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, n_out)
        if config.attn == "damcha":                                  # adaptive and shared
            self.gen = Generator(config)                             # as in GPT
        init_weights(self)                                           # GPT's init

    def forward(self, x):
        """x (B, T, D) -> (B, n_out): GPT's stack, its shared generator run on layer 0's input."""
        m = self.gen(self.h[0].ln_1(x)) if self.config.attn == "damcha" else None
        for block in self.h:
            x = block(x, m)                                          # (B, T, D)
        return self.head(self.ln_f(x[:, -1]))                        # (B, n_out)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Training

def train(attn, data, task, seed, steps=DEFAULTS["steps"], batch=DEFAULTS["batch"], lr=DEFAULTS["lr"],
          n_layer=DEFAULTS["n_layer"]):
    """Train one model on data = (x_train, y_train, x_test, y_test). task: "regression" (MSE) or
    "classification" (cross-entropy over K). Returns a dict of the run's numbers: test_mse (and
    for classification test_acc), train_loss (mean of the last 50 steps), params, gen_width, seconds."""
    x_tr, y_tr, x_te, y_te = data
    D = x_tr.size(-1)
    config = model_config(attn, D, n_layer)
    torch.manual_seed(seed)
    model = SetModel(config, 1 if task == "regression" else K)
    opt = configure_optimizers(model, 0.01, lr, (0.9, 0.99), "cpu")
    g = torch.Generator().manual_seed(30_000 + seed)
    loss_fn = (lambda out, y: F.mse_loss(out[:, 0], y)) if task == "regression" else F.cross_entropy
    losses = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = get_lr(step, lr, 0, steps, lr / 10)        # cosine decay to 10%
        idx = torch.randint(x_tr.size(0), (batch,), generator=g)
        loss = loss_fn(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):   # diverged: run_jobs stops the sweep on this run's train_loss
            break
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x_te[i:i + 512]) for i in range(0, x_te.size(0), 512)])
    row = dict(params=num_params(model), gen_width=config.gen_width if attn == "damcha" else None,
               train_loss=statistics.fmean(losses[-50:]), seconds=round(time.time() - t0, 2))
    if task == "regression":
        row["test_mse"] = F.mse_loss(out[:, 0], y_te).item()
    else:
        row["test_loss"] = F.cross_entropy(out, y_te).item()
        row["test_acc"] = (out.argmax(1) == y_te).float().mean().item()
    return row


def run_point(job):
    """One (task, x, seed): both models on the same data. Returns two rows."""
    task, x, seed, settings = job
    torch.set_num_threads(1)
    data = regression_data(x, seed=seed) if task == "regression" else classification_data(x, seed=seed)
    rows = []
    for attn in ("mha", "damcha"):
        row = train(attn, data, task, seed, **settings)
        rows.append(dict(task=task, x=x, seed=seed, model=attn, **row))
    return rows


def summarize(rows):
    """Per (task, x): mean and std over seeds of the metric of each model and of the paired
    relative gain of DAMCHA over MHA (test MSE: (mha - damcha) / mha; accuracy: damcha - mha)."""
    out = []
    for task, metric in (("regression", "test_mse"), ("classification", "test_acc")):
        xs = sorted({r["x"] for r in rows if r["task"] == task})
        for x in xs:
            by = {(r["seed"], r["model"]): r for r in rows if r["task"] == task and r["x"] == x}
            seeds = sorted({s for s, _ in by})
            mha = [by[s, "mha"][metric] for s in seeds]
            dam = [by[s, "damcha"][metric] for s in seeds]
            if task == "regression":
                gain = [(a - b) / a for a, b in zip(mha, dam)]
            else:
                gain = [b - a for a, b in zip(mha, dam)]
            sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
            out.append(dict(task=task, x=x, metric=metric, seeds=len(seeds),
                            mha_mean=statistics.fmean(mha), mha_std=sd(mha),
                            damcha_mean=statistics.fmean(dam), damcha_std=sd(dam),
                            gain_mean=statistics.fmean(gain), gain_std=sd(gain),
                            damcha_ahead=sum(g > 0 for g in gain),
                            params_mha=by[seeds[0], "mha"]["params"], params_damcha=by[seeds[0], "damcha"]["params"],
                            gen_width=by[seeds[0], "damcha"]["gen_width"]))
    return out


def parse_list(key, text, kind):
    """A comma list of numbers from a setting: '0,0.5,1' -> (0.0, 0.5, 1.0); '' -> ()."""
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        die(f"{key}={text!r}: expected a comma list of {kind.__name__}s")


def read_settings(argv):
    """-> (settings of configure, lambdas, dims, out_dir); bad input ends in one line (die)."""
    cfg, given = configure(SETTINGS, argv, positive=("steps", "batch", "lr", "n_layer", "seeds", "workers"), doc=__doc__)
    lambdas, dims = parse_list("lambdas", cfg["lambdas"], float), parse_list("dims", cfg["dims"], int)
    if any(d < 1 for d in dims):
        die(f"dims must be positive, not {cfg['dims']}")
    check_memory(max(dims, default=1), cfg["n_layer"])
    if not all(math.isfinite(lam) for lam in lambdas):
        die(f"lambdas must be finite numbers, not {cfg['lambdas']}")
    if cfg["quick"]:
        overridden = sorted(given & {"steps", "seeds", "lambdas", "dims"})
        if overridden:
            die(f"--quick sets steps, seeds, lambdas and dims itself: drop {', '.join('--' + k for k in overridden)}")
        cfg["steps"], cfg["seeds"], lambdas, dims = 20, 1, (0.0, 1.0), (4, 8)
    if not lambdas and not dims:   # nothing to run would still rewrite the results as empty
        die("lambdas and dims are both empty: there is nothing to run")
    out_dir = cfg["out"] or ("/tmp/synthetic_quick" if cfg["quick"] else os.path.join(ROOT, "results", "synthetic"))
    try:   # made now: a folder that cannot be written would otherwise lose every job's result at the end
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        die(f"out={out_dir}: {e.strerror or e}")
    return cfg, lambdas, dims, out_dir


def check_memory(d_e, n_layer):
    """Refuse, before allocating it, a task that cannot fit in this machine's memory: the teacher's
    scores (H * H * d_e^2 floats) and the model's weights, gradients and Adam moments (4 x its
    parameters) are less than one of its runs holds."""
    fields = dict(vocab_size=1, block_size=T, n_layer=n_layer, n_head=H, n_embd=H * d_e, attn="mha")
    need = 4 * (H * H * d_e**2 + 4 * count_params(fields))
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        die(f"dims={d_e} asks for more than {need / 2**30:,.0f} GiB (the teacher's scores and the model's weights "
            f"and optimizer), and this machine has {have / 2**30:,.0f} GiB: give smaller dims")


def run_jobs(jobs, workers):
    """run_point over the jobs, in `workers` processes; the rows of all, in any order. A diverged
    run stops them all at once (the pool's with-block ends its workers): its numbers would read as
    a result in the summary, and a lower --lr needs every run again."""
    t0 = time.time()
    rows = []

    def done(r):
        for row in r:
            if not math.isfinite(row["train_loss"]):
                die(f"{row['model']} on {row['task']} x={row['x']} seed={row['seed']} diverged (train loss "
                    f"{row['train_loss']}); stopped, nothing written; try a lower --lr")
        print(f"[{time.time() - t0:6.0f}s] {r[0]['task']} x={r[0]['x']} seed={r[0]['seed']} done", flush=True)
    if workers > 1:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap_unordered(run_point, jobs):
                rows += r
                done(r)
    else:
        for job in jobs:
            r = run_point(job)
            rows += r
            done(r)
    return rows


def write_results(rows, meta, out_dir):
    """runs.csv and summary.json in out_dir; the summary, one line per point, to stdout."""
    rows.sort(key=lambda r: (r["task"], r["x"], r["seed"], r["model"]))
    os.makedirs(out_dir, exist_ok=True)
    fields = ["task", "x", "seed", "model", "params", "gen_width", "train_loss", "test_mse", "test_loss",
              "test_acc", "seconds"]
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=fields)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: r.get(k) for k in fields})
    write_text(os.path.join(out_dir, "runs.csv"), table.getvalue())   # whole, never through a link
    summary = summarize(rows)
    write_text(os.path.join(out_dir, "summary.json"), to_json({"settings": meta, "points": summary}, indent=1))
    for p in summary:
        print(f"{p['task']:14s} x={p['x']:<4} mha {p['mha_mean']:.4f}±{p['mha_std']:.4f} "
              f"damcha {p['damcha_mean']:.4f}±{p['damcha_std']:.4f} gain {p['gain_mean']:+.4f}±{p['gain_std']:.4f} "
              f"params {p['params_mha']}/{p['params_damcha']} w={p['gen_width']}")


def main(argv):
    cfg, lambdas, dims, out_dir = read_settings(argv)
    settings = {k: cfg[k] for k in ("steps", "batch", "lr", "n_layer")}
    jobs = [("regression", lam, s, settings) for lam in lambdas for s in range(cfg["seeds"])]
    jobs += [("classification", d, s, settings) for d in dims for s in range(cfg["seeds"])]
    jobs.sort(key=lambda j: -(j[1] if j[0] == "classification" else REG_DIM))   # the big ones first
    workers = min(cfg["workers"], len(jobs))   # a worker more is a process and a torch more, idle
    if workers < cfg["workers"]:
        print(f"note: {len(jobs)} job(s), so {workers} worker(s), not workers={cfg['workers']}",
              file=sys.stderr)
    t0 = time.time()
    rows = run_jobs(jobs, workers)
    meta = dict(settings, seeds=cfg["seeds"], T=T, H=H, beta=BETA, K=K, reg_dim=REG_DIM, cls_lambda=CLS_LAMBDA,
                n_train=N_TRAIN, n_test=N_TEST, lambdas=list(lambdas), dims=list(dims), workers=workers,
                wall_seconds=round(time.time() - t0, 1), torch=torch.__version__,
                command="python lab/synthetic.py " + " ".join(argv))
    write_results(rows, meta, out_dir)
    print(f"wall time {time.time() - t0:.0f} s -> {out_dir}")


if __name__ == "__main__":
    with one_line_errors("batch, dims or n_layer"):   # a run out of memory, in a worker or here
        main(sys.argv[1:])
