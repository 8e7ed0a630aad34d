"""notebooks/course.py: small helpers the notebooks share, kept out of their cells so that each cell
shows one idea: exercise grading, softmax and entropy rows, and notebook 05's plots. Plain functions, no state.

    import course        # the notebooks put notebooks/ on sys.path and import it
"""
import math

import matplotlib.pyplot as plt
import numpy as np


def grade(name, error, tolerance, what="max |error|"):
    """Print an exercise's verdict: pass when error <= tolerance, with the size of the error."""
    verdict = "pass" if error <= tolerance else "FAIL"
    print(f"exercise {name}: {verdict}, {what} = {error:.1e} (tolerance {tolerance:.0e})")



def softmax_rows(S):
    """Softmax over the last axis; -inf entries (masked keys) get probability 0."""
    e = np.exp(S - S.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def entropy_bits(A):
    """The entropy in bits of each attention row of A (..., T): 0 for one key, log2(t + 1) uniform."""
    A = np.asarray(A, float)
    logs = np.log2(np.where(A > 0, A, 1.0))
    return -(A * logs).sum(-1)


# ---- notebook 05: the 2x2 study's plots -------------------------------------------------------

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
        left.scatter([k] * len(r["val_bpc"]), r["val_bpc"], color=colors[v], s=18)
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
        ax.set(title=f"minus MHA, {title}, 95% t interval")
    diffs[0].set_ylabel("bpc minus MHA's (negative: better)")
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
    regimes = " (filled: regime %s, open: regime %s)" % tuple(summaries) if len(summaries) == 2 else ""
    ax.set(xlabel="paired difference in whole-val bpc (negative: the change helps)", title="the 2x2's sides" + regimes)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()


def factors_plot(factors, colors):
    """The 2x2 of passes x dropout, one panel per variant: its difference to MHA in each cell with the
    95% t interval, one line per dropout level. Parallel lines: the factors do not interact."""
    rows = factors["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 3.6), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        for dropout, cells, style, shift in (("no dropout", ("i", "iii"), "-", -0.02), ("dropout 0.1", ("iv", "ii"), "--", 0.02)):
            means = [row["cells"][r][0] for r in cells]
            halves = [row["cells"][r][1] or 0.0 for r in cells]
            x = [shift, 1 + shift]   # apart, so that the two levels' intervals do not hide each other
            ax.errorbar(x, means, yerr=halves, fmt="o" + style, color=colors[row["variant"]],
                        mfc="white" if style == "--" else None, capsize=3, label=dropout)
            for xr, mean, r in zip(x, means, cells):
                ax.annotate(f" {r}", (xr, mean), fontsize=8)
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
    ax.set(ylabel="whole-val bpc minus MHA's (negative: better)",
           title="the difference to MHA, same seeds, 95% t intervals")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()


def fmt_interval(mean, half):
    """'+0.0123 [-0.0040, +0.0286]': a mean and its 95% interval; the mean alone from one seed."""
    return f"{mean:+.4f}" + ("" if half is None else f" [{mean - half:+.4f}, {mean + half:+.4f}]")
