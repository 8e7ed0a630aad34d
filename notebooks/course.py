"""notebooks/course.py: small helpers the notebooks share, kept out of their cells so that each cell
shows one idea: exercise checks and their grades, softmax and entropy rows, the scores of one
damcha_numpy attention layer (notebooks 01 and 02), 95% t intervals (notebooks 04 to 06, kept here
so that no cell shows a standard error before notebook 05's exercise asks for one), and notebook
06's plots. Plain functions, no
state.

    import course        # the notebooks put notebooks/ on sys.path and import it

An exercise is a cell (tagged "exercise") that holds a stub, `def name(args):`, a docstring and
`raise NotImplementedError`, for the learner to fill in. Its check cell (tagged "check") calls

    course.check("01.2", lambda: name(inputs), course.close_to(expected, 1e-10))

on inputs the notebook has not printed, and prints one line: not attempted yet, pass or FAIL.
"""
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import damcha_numpy as dn      # the notebooks put the repository root on sys.path first


NOT_ATTEMPTED = "not attempted yet — write your answer in the cell above"


def check(name, attempt, grade):
    """Grade an exercise and print one line, "exercise <name>: ...": not attempted yet while
    attempt() raises NotImplementedError (the stub as given); FAIL when it raises anything else (its
    type and message), returns None, or grade(result) says no; pass otherwise. grade(result) returns
    (ok, detail), detail saying how close the result came. Never raises: a notebook runs on."""
    try:
        result = attempt()
    except NotImplementedError:
        print(f"exercise {name}: {NOT_ATTEMPTED}")
        return
    except Exception as error:                       # the learner's code failed: say how, no traceback
        print(f"exercise {name}: FAIL, your code raised {type(error).__name__}: {error}")
        return
    if result is None:
        ok, detail = False, "it returned None (is a return statement missing?)"
    else:
        try:
            ok, detail = grade(result)
        except NotANumber as error:
            ok, detail = False, str(error)
        except Exception as error:                   # a result the grader cannot read
            ok, detail = False, f"the result could not be graded ({type(error).__name__}: {error})"
    print(f"exercise {name}: {'pass' if ok else 'FAIL'}, {detail}")


class NotANumber(ValueError):
    """A result that is not a number or an array of numbers; its message says what it is."""


def _as_array(result, what):
    """result as a float array, or NotANumber saying what it was instead."""
    try:
        return np.asarray(result, dtype=float)
    except (TypeError, ValueError):
        what_it_is = f"{what} is of type {type(result).__name__}, not an array of numbers"
        raise NotANumber(what_it_is) from None


def close_to(expected, tolerance, names=None):
    """A grade: the result has expected's shape and differs from it by at most `tolerance` in every
    entry. With a tuple of arrays for expected, the result must be a tuple of as many arrays, each
    graded so, named by `names` in the detail."""
    several = isinstance(expected, tuple)
    wanted = expected if several else (expected,)
    names = names or (["the result"] if not several else [f"part {k}" for k in range(len(wanted))])

    def grade(result):
        if several and (not isinstance(result, (tuple, list)) or len(result) != len(wanted)):
            kind = type(result).__name__
            return False, f"a result of type {kind} where a tuple of {len(wanted)} arrays is expected"
        parts, ok = [], True
        for name, got, want in zip(names, result if several else (result,), wanted):
            got, want = _as_array(got, name), np.asarray(want, dtype=float)
            if got.shape != want.shape:
                return False, f"{name} has shape {got.shape} where {want.shape} is expected"
            error = float(np.max(np.abs(got - want))) if want.size else 0.0
            ok = ok and error <= tolerance
            parts.append((f"{name}: " if several else "") + f"max |error| = {error:.1e}")
        return ok, "; ".join(parts) + f" (tolerance {tolerance:.0e})"
    return grade


def within(expected, tolerance):
    """A grade: the result is one number, at most `tolerance` from expected."""
    def grade(result):
        value = _as_array(result, "the result")
        if value.shape != ():
            return False, f"an array of shape {value.shape} where one number is expected"
        error = abs(float(value) - expected)
        return error <= tolerance, f"|error| = {error:.1e} (tolerance {tolerance:.0e})"
    return grade


def solves(X, Y, tolerance):
    """A grade: the result is a matrix m that maps each row of X to the same row of Y, X m = Y, to
    `tolerance` in every entry. For an answer defined by what it does to given vectors: the check
    states that property, and does not compute the answer itself."""
    X, Y = np.asarray(X, dtype=float), np.asarray(Y, dtype=float)
    shape = (X.shape[-1], Y.shape[-1])

    def grade(result):
        m = _as_array(result, "the result")
        if m.shape != shape:
            return False, f"the result has shape {m.shape} where {shape} is expected"
        error = float(np.max(np.abs(X @ m - Y)))
        return error <= tolerance, f"max |x m - wanted| = {error:.1e} over {len(X)} rows (tolerance {tolerance:.0e})"
    return grade


def softmax_rows(S):
    """Softmax over the last axis; -inf entries (masked keys) get probability 0."""
    e = np.exp(S - S.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def entropy_bits(A):
    """The entropy in bits of each attention row of A (..., T): 0 for one key, log2(t + 1) uniform."""
    A = np.asarray(A, float)
    logs = np.log2(np.where(A > 0, A, 1.0))
    return -(A * logs).sum(-1)


# ---- notebooks 01 and 02: one attention layer of damcha_numpy, read for its scores ---------------

def maxdiff(a, b):
    """max |a - b| over all entries, as a float."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def metrics(params, config, u):
    """The metric m of a DAMCHA layer on the input u (B, T, D): (B, T, H, dh, dh) from the generator,
    or (H, dh, dh) for a static metric."""
    return dn.metric_forward(params, "", config, u)[0]


def attention(params, config, u):
    """(y, S, A): a one-layer model's attention output (B, T, D), its pre-softmax scores and its
    attention (B, H, T, T), read from dn.attention_forward's cache; MHA when config.attn is "mha"."""
    m = metrics(params, config, u) if config.attn == "damcha" else None
    y, (_, _, cache) = dn.attention_forward(params, "h.0.attn.", config, u, m)
    q, k, _ = cache["scores"]
    return y, dn.scores_forward(q, k)[0], cache["softmax"]


def scores(params, config, u):
    """The pre-softmax scores (B, H, T, T) of attention(params, config, u)."""
    return attention(params, config, u)[1]


def head_slice(i, dh):
    """The columns of u that form head i's slice x_i."""
    return slice(i * dh, (i + 1) * dh)


def block_diag(blocks):
    """The (H dh, H dh) matrix with the H blocks (dh, dh) on its diagonal and zeros elsewhere."""
    dh = len(blocks[0])
    out = np.zeros((len(blocks) * dh, len(blocks) * dh))
    for i, block in enumerate(blocks):
        out[head_slice(i, dh), head_slice(i, dh)] = block
    return out


def perturbed(params, std=0.3, seed=1):
    """params plus an N(0, std) offset: init_params draws weights from N(0, 0.02), and the offset
    makes the generator's effect visible."""
    r = np.random.default_rng(seed)
    return {k: v + r.normal(0.0, std, v.shape) for k, v in params.items()}


# ---- notebook 06: the 2x2 study's plots -------------------------------------------------------

def half_bar(half):
    """An interval's half-width as matplotlib's xerr/yerr of one point; none for a single seed."""
    return None if half is None else [[half], [half]]


def compare_plot(by_variant, variants, colors):
    """Three panels: each seed's whole-val bpc and the mean; the paired difference to MHA with its 95% t
    interval at equal steps; the same at equal wall-clock (its own scale: those intervals are wider), left
    out for a regime whose runs shared the machine, whose summary has no such column."""
    timed = all("diff_equal_time" in by_variant[v] for v in variants)
    fig, (left, *diffs) = plt.subplots(1, 2 + timed, figsize=(9 + 4 * timed, 3.8),
                                       gridspec_kw=dict(width_ratios=[1.2] + [1] * (1 + timed)))
    for k, v in enumerate(variants):
        r = by_variant[v]
        n = len(r["val_bpc"])   # the seeds spread a little along x, so that equal scores do not hide each other
        left.scatter(k + np.linspace(-0.12, 0.12, n) if n > 1 else [k], r["val_bpc"], color=colors[v], s=18)
        left.plot([k - 0.25, k + 0.25], [r["val_bpc_mean"]] * 2, color=colors[v], lw=2)
    left.set_xticks(range(len(variants)), variants, rotation=20)
    left.set(ylabel="whole-val bpc", title="each seed, and the mean")
    others = [v for v in variants if v != "mha"]
    for ax, key, title in zip(diffs, ("diff_equal_steps", "diff_equal_time"), ("at equal steps", "at equal wall-clock")):
        for k, v in enumerate(others):
            mean, half = by_variant[v][key]
            ax.errorbar([k], [mean], yerr=half_bar(half), fmt="o", color=colors[v], capsize=3)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(range(len(others)), others, rotation=20)
        ax.set_xlim(-0.5, len(others) - 0.5)             # the points off the spines
        ax.set(title=f"minus MHA, {title}, 95% t interval", ylabel="bpc minus MHA's (negative: better)")
    for ax in (left, *diffs):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()


def sides_plot(summaries, colors):
    """The 2x2's contrasts, labelled by the factor they change, with their 95% t intervals: filled markers
    for the first regime, open ones for the second ({regime: summary})."""
    names = [c["contrast"] for c in next(iter(summaries.values()))["contrasts"]]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(names) + 1.0))
    for n, (regime, summary) in enumerate(summaries.items()):
        for c in summary["contrasts"]:
            k = names.index(c["contrast"]) + 0.2 * (n - (len(summaries) - 1) / 2)
            mean, half = c["diff"]
            ax.errorbar([mean], [k], xerr=half_bar(half), fmt="os"[n % 2],
                        color=colors.get(c["first"], "k"), mfc="white" if n else None, capsize=3)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(names)), [n.replace("interaction: ", "interaction:\n") for n in names], fontsize=9)
    ax.invert_yaxis()
    regimes = " (filled: %s, open: %s)" % tuple(summaries) if len(summaries) == 2 else ""
    ax.set(xlabel="paired difference in whole-val bpc (negative: the change helps)", title="the 2x2's sides" + regimes)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()


def factors_plot(factors, colors):
    """The 2x2 of passes x dropout, one panel per variant: its difference to MHA in each cell with the
    95% t interval, one line per dropout level. Parallel lines: the factors do not interact."""
    rows = factors["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 3.6), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        for dropout, cells, style, shift in (("no dropout", ("one_pass", "three_passes"), "-", -0.07),
                                             ("dropout 0.1", ("one_pass_dropout", "three_passes_dropout"), "--", 0.07)):
            means = [row["cells"][r][0] for r in cells]
            halves = [row["cells"][r][1] or 0.0 for r in cells]
            x = [shift, 1 + shift]   # apart, so that the two levels' intervals do not hide each other
            ax.errorbar(x, means, yerr=halves, fmt="o" + style, color=colors[row["variant"]],
                        mfc="white" if style == "--" else None, capsize=3, label=dropout)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks([0, 1], ["one pass", "about three passes"])
        ax.set_xlim(-0.3, 1.3)
        ax.set(title=f"{row['variant']} - mha, {len(row['seeds'])} seeds, 95% t intervals")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("whole-val bpc minus MHA's (negative: better)")
    fig.tight_layout()


def regimes_plot(by_regime, variants, colors):
    """Each variant's paired difference to MHA, with its 95% t interval, regime by regime
    ({label: {variant: summary row}}): one column per regime, the variants side by side in it."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for n, v in enumerate(variants):
        shift = 0.12 * (n - (len(variants) - 1) / 2)
        shown = [(k, rows[v]["diff_equal_steps"]) for k, rows in enumerate(by_regime.values()) if v in rows]
        for k, (mean, half) in shown:
            ax.errorbar([k + shift], [mean], yerr=half_bar(half), fmt="o",
                        color=colors[v], capsize=3, label=v if k == shown[0][0] else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(by_regime)), list(by_regime))
    ax.set_xlim(-0.5, len(by_regime) - 0.5)
    ax.set(xlabel="regime: model size and the sweep that chose the rates",
           ylabel="whole-val bpc minus MHA's (negative: better)",
           title="the difference to MHA, same seeds, 95% t intervals")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()


def fmt_interval(mean, half):
    """'+0.0123 [-0.0040, +0.0286]': a mean and its 95% interval; the mean alone from one seed."""
    return f"{mean:+.4f}" + ("" if half is None else f" [{mean - half:+.4f}, {mean + half:+.4f}]")


# ---- notebooks 04 to 06: intervals, and the 2x2 study's committed results --------------------

def t_half(std, n):
    """The half-width of the 95% t interval of a mean of n values whose sample standard deviation
    (with n - 1) is std: T_975[n - 1] standard errors, a standard error being std / sqrt(n)."""
    return T_975[n - 1] * np.asarray(std, float) / math.sqrt(n)


def t_interval(values, axis=-1):
    """(mean, half-width) of the 95% t interval of the mean of values along axis (the seeds):
    notebook 04's primer, Section 0. Arrays when values has more than one dimension."""
    values = np.asarray(values, float)
    return values.mean(axis), t_half(values.std(axis, ddof=1), values.shape[axis])


def t_quantile(p, dof):
    """The p-quantile (p > 0.5) of Student's t with dof degrees of freedom: bisection on its CDF,
    the density integrated by Simpson's rule (no scipy needed)."""
    c = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    pdf = lambda x: c * (1 + x * x / dof) ** (-(dof + 1) / 2)

    def cdf(x, n=2000):
        h = x / n
        return 0.5 + h / 3 * (pdf(0) + pdf(x) + sum((4 if k % 2 else 2) * pdf(k * h) for k in range(1, n)))
    lo, hi = 0.0, 100.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_975(dof):
    """Student's 0.975 quantile for dof degrees of freedom, any dof > 0, a whole number or not:
    t_975(4) is T_975[4]. lab/reproduce.py's intervals use the same t_quantile."""
    return t_quantile(0.975, dof)


# Student's t, the 0.975 quantile by degrees of freedom, for the course's 3 and 5 seeds: a 95% t
# interval of n seeds' mean is mean +- T_975[n - 1] standard errors.
T_975 = {dof: t_975(dof) for dof in (2, 4)}


def welch_dof(se2_a, se2_b, n_a, n_b):
    """The Welch-Satterthwaite degrees of freedom of a difference of two independent means, from each
    mean's squared standard error (se2_a, se2_b) and its number of values (n_a, n_b): no whole number in
    general, between the smaller group's n - 1 and n_a + n_b - 2."""
    return (se2_a + se2_b) ** 2 / (se2_a ** 2 / (n_a - 1) + se2_b ** 2 / (n_b - 1))


# The 2x2 study's results (lab/reproduce.py --study=2x2 writes them): notebooks 05 and 06 read them here.
STUDY2X2 = Path(__file__).resolve().parent.parent / "results" / "study2x2"


def study2x2(regime):
    """A regime's summary.json of the 2x2 study, parsed, with its rows also by variant: rows[v]."""
    summary = json.loads((STUDY2X2 / regime / "summary.json").read_text())
    return dict(summary, by_variant={r["variant"]: r for r in summary["rows"]})


def paired_cases(regimes=("one_pass", "three_passes_dropout")):
    """The 2x2 study's paired comparisons with MHA, equal steps: per regime and variant, (the
    variant's per-seed whole-val bpc, MHA's, lab/reproduce.py's (mean, half-width) of the 95% t
    interval of their per-seed difference, and the t statistic that interval implies)."""
    cases = []
    for regime in regimes:
        rows = study2x2(regime)["by_variant"]
        for v in (v for v in rows if v != "mha"):
            mean, half = rows[v]["diff_equal_steps"]
            n = len(rows[v]["val_bpc"])
            cases.append((rows[v]["val_bpc"], rows["mha"]["val_bpc"], (mean, half), mean / (half / T_975[n - 1])))
    return cases
