"""Every notebook in notebooks/ runs top to bottom without an error and shows at least one plot,
and every exercise in it is one a learner must solve, with a check that can tell.

A notebook added later is picked up by the glob. Each one is executed from a fresh kernel, in
memory (the committed file is not rewritten), with notebooks/ as the working directory, as Jupyter
would run it, and what it prints must be what the committed file shows: the same text and the same
numbers, so that a change to the code that moves a number fails here until the notebook is run
again, and its prose read again, and committed. The same numbers on any x86-64 machine and BLAS:
the few printed quantities whose digits depend on the CPU (finite-difference noise, the end of a
long float32 computation) are listed in MACHINE_DEPENDENT, each with the bound it must meet and
why, and are held to that bound instead of to their committed digits. The committed file must also
hold the outputs of a run: every code cell executed, no error among the outputs, no placeholder
text left in any cell, and every figure at least 400 pixels wide (readable on GitHub and in
JupyterLab).

The exercises (notebooks/course.py says what one is): each stub holds no answer and its check says
"not attempted" as committed; the same kernel that runs a notebook then redefines each exercise
with its reference answer from notebooks/solutions.py, whose check must pass, and with each wrong
answer of WRONG_ANSWERS, whose check must fail; and no expression or constant of a reference
answer appears in a cell above its check.

    python -m pytest -q tests/test_notebooks.py
"""
import ast
import base64
import inspect
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
sys.path.insert(0, str(NOTEBOOK_DIR))
import course      # noqa: E402  (notebooks/: the exercises' checks)
import solutions   # noqa: E402  (notebooks/: their reference answers)


MIN_FIGURE_WIDTH = 400                         # pixels, as displayed
PLACEHOLDER = re.compile(r"PLACEHOLDER|TODO|FIXME")
NUM = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
NUMBER = re.compile(NUM)
SECONDS = re.compile(r"\s*m?s\b")              # after a number: a timing, which no two runs share
ROUNDING = 1e-6                                # below this, a printed number is a rounding error (a check's residual)


@dataclass(frozen=True)
class Bounded:
    """A printed quantity whose digits depend on the CPU and the BLAS. `pattern` finds it in a cell's
    text; its group "value" must be at most `bound` in size, and it and the group "name" (where the
    noise peaked, if the line says) may differ between machines. `why` says why it is not exact."""
    pattern: str
    bound: float
    why: str


# How a rerun's print is held to the committed one (disagreements, same_print): the words exactly;
# each number to its committed digits (to 1%, or to one unit of its last digit, which another CPU's
# rounding may move); a timing (a number followed by s or ms) not at all; two numbers below ROUNDING,
# residuals of an identity (1e-16 and the like), always agree; and the quantities listed here, per
# notebook, only to their bound, in the committed outputs and the rerun alike: their digits are
# noise that depends on the CPU and the BLAS.
NUM_OR_HIDDEN = rf"(?:{NUM}|<machine-dependent>)"   # a number of a line whose other numbers are bounded first
MACHINE_DEPENDENT = {
    "03_backward_walkthrough.ipynb": [
        Bounded(rf"(?:max \|analytic - numeric\||values \+ query \+ key +max \|total - numeric\|) = (?P<value>{NUM})", 1e-7,
                "central differences (eps = 1e-6) err by rounding noise, whose digits follow the BLAS's order "
                "of additions; the prose promises a few 1e-8 at most"),
        Bounded(rf"worst \|analytic - numeric\| / \(1e-8 \+ 1e-5 \|numeric\|\) = (?P<value>{NUM}) \((?P<name>[\w.]+)\)",
                1.0, "dn.gradcheck's worst ratio is that noise over the check's bar, and the parameter where it "
                     "peaks moves with it (0.028 at gen.1.weight on one machine, 0.031 at h.0.mlp.c_proj.weight on "
                     "another); the cell says a ratio <= 1 passes"),
        Bounded(rf"largest error (?P<value>{NUM}) \((?P<name>[^)]*)\)", 1e-7,
                "the largest of the errors above, and the check it is in"),
        Bounded(rf"largest gradient entry (?P<value>{NUM}) \((?P<name>[^)]*)\)", 1e-5,
                "the largest error relative to its check's gradient, and where: within the checks' relative bar"),
    ],
    "04_synthetic_tasks.ipynb": [
        Bounded(rf"(?:train MSE \(last 50 steps\)|test MSE) (?P<value>{NUM})", 1.0,
                "the tiny live run: 150 float32 training steps, whose last digits follow the CPU's matmul "
                "kernels; on the standardised target, learning anything beats predicting the mean, MSE 1"),
    ],
    "05_training_results.ipynb": [
        Bounded(rf"the float32 checkpoint: {NUM}; difference (?P<value>{NUM})", 1e-4,
                "the float16 snapshot's score minus the committed one, both of 158,827 targets in float32: a "
                "difference in the last printed digit, which another CPU's rounding moves; the prose says it "
                "costs nothing measurable, below the results tables' 4 decimals"),
    ],
    "06_what_helps_2x2.ipynb": [
        Bounded(rf"(?P<value>{NUM}) bpc", 10.0,
                "Section 1's live pair: 250 float32 training steps per model, whose last digits follow the CPU's "
                "matmul kernels and grow through training; a bpc and a per-seed difference, below uniform guessing's "
                "log2 of the vocabulary; the prose states neither their digits nor their sign"),
        Bounded(rf"(?P<value>{NUM}) \[{NUM_OR_HIDDEN}, {NUM_OR_HIDDEN}\] \(live", 2.0,
                "the live pair's mean difference, over its three seeds"),
        Bounded(rf"{NUM_OR_HIDDEN} \[(?P<value>{NUM}), {NUM_OR_HIDDEN}\] \(live", 5.0,
                "the live pair's 95% interval, low end: three seeds give a wide one"),
        Bounded(rf"{NUM_OR_HIDDEN} \[{NUM_OR_HIDDEN}, (?P<value>{NUM})\] \(live", 5.0,
                "the live pair's 95% interval, high end"),
    ],
}


# Per notebook, per exercise (the stub's function name), the wrong answers its check must fail:
# (what the mistake is, the source of a def with the exercise's name and signature).
WRONG_ANSWERS = {
    "01_cross_head_metric.ipynb": {
        "two_steps_back": [
            ("one step back, angle omega", """
def two_steps_back(omega, beta):
    a = omega
    return beta * np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
"""),
            ("the column-vector rotation, which turns a row forward", """
def two_steps_back(omega, beta):
    a = 2 * omega
    return beta * np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]])
"""),
            ("beta left out", """
def two_steps_back(omega, beta):
    a = 2 * omega
    return np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
"""),
            ("a forgotten return (None)", """
def two_steps_back(omega, beta):
    a = 2 * omega
    beta * np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
"""),
        ],
    },
    "02_what_the_metric_expresses.ipynb": {
        "zeroed_query_row": [
            ("t keys instead of t + 1", """
def zeroed_query_row(t):
    return np.full(t, 1.0 / t)
"""),
            ("all the attention on the query's own position", """
def zeroed_query_row(t):
    return np.eye(t + 1)[t]
"""),
            ("the row of t = 6, a constant", """
def zeroed_query_row(t):
    return np.full(7, 1 / 7)
"""),
            ("the right row as a column, shape (t + 1, 1)", """
def zeroed_query_row(t):
    return np.full((t + 1, 1), 1.0 / (t + 1))
"""),
        ],
        "diagonal_only_row": [
            ("H + 1 in place of H", """
def diagonal_only_row(S_row, H):
    e = np.exp(S_row / (H + 1) - (S_row / (H + 1)).max())
    return e / e.sum()
"""),
            ("H - 1 in place of H", """
def diagonal_only_row(S_row, H):
    e = np.exp(S_row / (H - 1) - (S_row / (H - 1)).max())
    return e / e.sum()
"""),
            ("the scores multiplied by H", """
def diagonal_only_row(S_row, H):
    e = np.exp(S_row * H - (S_row * H).max())
    return e / e.sum()
"""),
            ("the full model's row, unchanged", """
def diagonal_only_row(S_row, H):
    e = np.exp(S_row - S_row.max())
    return e / e.sum()
"""),
        ],
    },
    "03_backward_walkthrough.ipynb": {
        "causal_softmax_backward": [
            ("the weighted mean left out", """
def causal_softmax_backward(dA, A):
    return A * dA
"""),
            ("the factor A left out", """
def causal_softmax_backward(dA, A):
    return dA - (dA * A).sum(-1, keepdims=True)
"""),
            ("summed over the queries instead of the keys", """
def causal_softmax_backward(dA, A):
    return A * (dA - (dA * A).sum(-2, keepdims=True))
"""),
            ("a forgotten return (None)", """
def causal_softmax_backward(dA, A):
    dS = A * (dA - (dA * A).sum(-1, keepdims=True))
"""),
        ],
        "scores_backward": [
            ("the 1/sqrt(dh) left out", """
def scores_backward(dS, q, k):
    return dS @ k, dS.swapaxes(-1, -2) @ q
"""),
            ("divided by dh instead of sqrt(dh)", """
def scores_backward(dS, q, k):
    return dS @ k / q.shape[-1], dS.swapaxes(-1, -2) @ q / q.shape[-1]
"""),
            ("dk without the transpose, dS q", """
def scores_backward(dS, q, k):
    scale = 1 / math.sqrt(q.shape[-1])
    return dS @ k * scale, dS @ q * scale
"""),
            ("the transpose on dq instead of dk: dS^T k and dS q", """
def scores_backward(dS, q, k):
    scale = 1 / math.sqrt(q.shape[-1])
    return dS.swapaxes(-1, -2) @ k * scale, dS @ q * scale
"""),
            ("dq and dk returned in the wrong order", """
def scores_backward(dS, q, k):
    scale = 1 / math.sqrt(q.shape[-1])
    return dS.swapaxes(-1, -2) @ q * scale, dS @ k * scale
"""),
            ("a forgotten return (None)", """
def scores_backward(dS, q, k):
    scale = 1 / math.sqrt(q.shape[-1])
    dq, dk = dS @ k * scale, dS.swapaxes(-1, -2) @ q * scale
"""),
        ],
        "masked_rowsum_backward": [
            ("the mask ignored: every block gets dm_i", """
def masked_rowsum_backward(dm, blocks):
    H = dm.shape[-3]
    return dm[..., None, :] * np.ones((H, 1, H, 1))
"""),
            ("diag and offdiag swapped", """
def masked_rowsum_backward(dm, blocks):
    H = dm.shape[-3]
    kappa = {"all": np.ones((H, H)), "diag": 1 - np.eye(H), "offdiag": np.eye(H)}[blocks]
    return dm[..., None, :] * kappa[:, None, :, None]
"""),
            ("divided by H, the backward of a mean", """
def masked_rowsum_backward(dm, blocks):
    H = dm.shape[-3]
    kappa = {"all": np.ones((H, H)), "diag": np.eye(H), "offdiag": 1 - np.eye(H)}[blocks]
    return dm[..., None, :] * kappa[:, None, :, None] / H
"""),
            ("dm itself: the wrong shape", """
def masked_rowsum_backward(dm, blocks):
    return dm
"""),
            ("a forgotten return (None)", """
def masked_rowsum_backward(dm, blocks):
    H = dm.shape[-3]
    dM = dm[..., None, :] * np.ones((H, 1, H, 1))
"""),
        ],
        "prefix_mean_backward": [
            ("a forward cumsum, the sum over t <= s", """
def prefix_mean_backward(dc, counts):
    return np.cumsum(dc / counts, axis=1)
"""),
            ("the 1/(t+1) left out", """
def prefix_mean_backward(dc, counts):
    return np.cumsum(dc[:, ::-1], axis=1)[:, ::-1]
"""),
            ("divided by the counts after the sum", """
def prefix_mean_backward(dc, counts):
    return np.cumsum(dc[:, ::-1], axis=1)[:, ::-1] / counts
"""),
        ],
    },
    # ---- 04 to 06 ----
    "04_synthetic_tasks.ipynb": {
        "paired_gain": [
            ("the gain of the two means, unpaired", """
def paired_gain(mse_mha, mse_damcha):
    return float(1 - np.mean(mse_damcha) / np.mean(mse_mha))
"""),
            ("relative to DAMCHA's MSE instead of MHA's", """
def paired_gain(mse_mha, mse_damcha):
    mha, damcha = np.asarray(mse_mha), np.asarray(mse_damcha)
    return float(np.mean((mha - damcha) / damcha))
"""),
            ("a percentage instead of a fraction", """
def paired_gain(mse_mha, mse_damcha):
    mha, damcha = np.asarray(mse_mha), np.asarray(mse_damcha)
    return float(100 * np.mean((mha - damcha) / mha))
"""),
            ("the constant the table prints at lambda = 1 (after the check)", """
def paired_gain(mse_mha, mse_damcha):
    return 0.26
"""),
            ("each seed's gain, not their mean (the wrong shape)", """
def paired_gain(mse_mha, mse_damcha):
    mha, damcha = np.asarray(mse_mha), np.asarray(mse_damcha)
    return (mha - damcha) / mha
"""),
            ("a forgotten return (None)", """
def paired_gain(mse_mha, mse_damcha):
    mha, damcha = np.asarray(mse_mha), np.asarray(mse_damcha)
    np.mean((mha - damcha) / mha)
"""),
        ],
    },
    "05_training_results.ipynb": {
        "paired_t": [
            ("the standard deviation with n, not n - 1 (ddof=0)", """
def paired_t(first, second):
    d = np.asarray(first) - np.asarray(second)
    return float(d.mean() / (d.std() / math.sqrt(len(d))))
"""),
            ("unpaired: the two groups' own spreads", """
def paired_t(first, second):
    a, b = np.asarray(first), np.asarray(second)
    return float((a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
"""),
            ("the standard deviation, not the standard error (no sqrt(n))", """
def paired_t(first, second):
    d = np.asarray(first) - np.asarray(second)
    return float(d.mean() / d.std(ddof=1))
"""),
            ("second - first", """
def paired_t(first, second):
    d = np.asarray(second) - np.asarray(first)
    return float(d.mean() / (d.std(ddof=1) / math.sqrt(len(d))))
"""),
            ("the constant the notebook prints for DAMCHA - MHA", """
def paired_t(first, second):
    return 3.11
"""),
            ("a forgotten return (None)", """
def paired_t(first, second):
    d = np.asarray(first) - np.asarray(second)
    d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
"""),
        ],
    },
    "06_what_helps_2x2.ipynb": {
        "equal_time_difference": [
            ("the two runs' last estimates: equal steps again", """
def equal_time_difference(first, second):
    return float(np.asarray(first)[-1, 1] - np.asarray(second)[-1, 1])
"""),
            ("the last evaluation at or before the common time, not the line between two", """
def equal_time_difference(first, second):
    first, second = np.asarray(first), np.asarray(second)
    t = min(first[-1, 0], second[-1, 0])
    return float(first[first[:, 0] <= t][-1, 1] - second[second[:, 0] <= t][-1, 1])
"""),
            ("the time and the bpc columns swapped", """
def equal_time_difference(first, second):
    first, second = np.asarray(first), np.asarray(second)
    t = min(first[-1, 1], second[-1, 1])
    return float(np.interp(t, first[:, 1], first[:, 0]) - np.interp(t, second[:, 1], second[:, 0]))
"""),
            ("second - first", """
def equal_time_difference(first, second):
    first, second = np.asarray(first), np.asarray(second)
    t = min(first[-1, 0], second[-1, 0])
    return float(np.interp(t, second[:, 0], second[:, 1]) - np.interp(t, first[:, 0], first[:, 1]))
"""),
            ("a forgotten return (None)", """
def equal_time_difference(first, second):
    first, second = np.asarray(first), np.asarray(second)
    t = min(first[-1, 0], second[-1, 0])
    float(np.interp(t, first[:, 0], first[:, 1]) - np.interp(t, second[:, 0], second[:, 1]))
"""),
        ],
        "factor_effects": [
            ("the sums without the 1/2", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r] for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    return dict(passes=three + three_dropout - one - one_dropout, dropout=one_dropout + three_dropout - one - three,
                interaction=(three_dropout - one_dropout) - (three - one))
"""),
            ("the interaction's sign flipped", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r] for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    return dict(passes=(three + three_dropout - one - one_dropout) / 2, dropout=(one_dropout + three_dropout - one - three) / 2,
                interaction=(three - one) - (three_dropout - one_dropout))
"""),
            ("each seed given the mean effect: the right means, no spread over the seeds", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r] for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    n = len(one)
    return dict(passes=np.full(n, np.mean(three + three_dropout - one - one_dropout) / 2),
                dropout=np.full(n, np.mean(one_dropout + three_dropout - one - three) / 2),
                interaction=np.full(n, np.mean((three_dropout - one_dropout) - (three - one))))
"""),
            ("passes and dropout swapped", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r] for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    return dict(passes=(one_dropout + three_dropout - one - three) / 2, dropout=(three + three_dropout - one - one_dropout) / 2,
                interaction=(three_dropout - one_dropout) - (three - one))
"""),
            ("the means over the seeds, not one value per seed (the wrong shape)", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r].mean() for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    return dict(passes=(three + three_dropout - one - one_dropout) / 2, dropout=(one_dropout + three_dropout - one - three) / 2,
                interaction=(three_dropout - one_dropout) - (three - one))
"""),
            ("a forgotten return (None)", """
def factor_effects(d):
    one, one_dropout, three, three_dropout = (d[r] for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    dict(passes=(three + three_dropout - one - one_dropout) / 2, dropout=(one_dropout + three_dropout - one - three) / 2,
         interaction=(three_dropout - one_dropout) - (three - one))
"""),
        ],
        "welch_interval": [
            ("the pooled interval: one spread for both samples, n_a + n_b - 2 degrees of freedom", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    pooled = ((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2)
    return float(a.mean() - b.mean()), float(t_975(len(a) + len(b) - 2) * math.sqrt(pooled * (1 / len(a) + 1 / len(b))))
"""),
            ("paired over the seeds the two share", """
def welch_interval(first, second, t_975, welch_dof):
    n = min(len(first), len(second))
    d = np.asarray(first)[:n] - np.asarray(second)[:n]
    return float(d.mean()), float(t_975(n - 1) * d.std(ddof=1) / math.sqrt(n))
"""),
            ("the normal's 1.96 instead of Welch's t", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    return float(a.mean() - b.mean()), float(1.96 * math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
"""),
            ("the variances with n, not n - 1 (ddof=0)", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    va, vb = a.var() / len(a), b.var() / len(b)
    return float(a.mean() - b.mean()), float(t_975(welch_dof(va, vb, len(a), len(b))) * math.sqrt(va + vb))
"""),
            ("the samples' variances, not their means' squared standard errors (no division by n)", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    va, vb = a.var(ddof=1), b.var(ddof=1)
    return float(a.mean() - b.mean()), float(t_975(welch_dof(va, vb, len(a), len(b))) * math.sqrt(va + vb))
"""),
            ("the standard errors summed, not their squares (no root of the summed variances)", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    return float(a.mean() - b.mean()), float(t_975(welch_dof(va, vb, len(a), len(b))) * (math.sqrt(va) + math.sqrt(vb)))
"""),
            ("the smaller sample's n - 1 degrees of freedom", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    return float(a.mean() - b.mean()), float(t_975(min(len(a), len(b)) - 1) * math.sqrt(va + vb))
"""),
            ("a forgotten return (None)", """
def welch_interval(first, second, t_975, welch_dof):
    a, b = np.asarray(first), np.asarray(second)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    (float(a.mean() - b.mean()), float(t_975(welch_dof(va, vb, len(a), len(b))) * math.sqrt(va + vb)))
"""),
        ],
    },
}


def tags(cell):
    return cell.get("metadata", {}).get("tags", [])


@dataclass(frozen=True)
class Exercise:
    """An exercise of a notebook: the function its stub defines, the stub's cell, its check's cell,
    and the check's label ("01.2")."""
    name: str
    stub: int
    check: int
    label: str


CHECK_CALL = re.compile(r"course\.check\(\s*[\"'](?P<label>\d\d\.\d+)[\"']")


def exercises(nb):
    """The exercises of a notebook, found by their cells' tags: each "check" cell grades the
    "exercise" cell before it (an untagged cell of inputs may stand between them)."""
    found, stub = [], None
    for n, cell in enumerate(nb.cells):
        if "exercise" in tags(cell):
            assert stub is None, f"cell {n}: an exercise cell follows cell {stub}'s with no check between"
            stub = n
        if "check" in tags(cell):
            assert stub is not None, f"cell {n}: a check cell with no exercise cell before it"
            label = CHECK_CALL.search(cell.source)
            assert label, f"cell {n}: a check cell without a course.check(\"NN.k\", ...) call"
            name = stub_function(nb.cells[stub].source).name
            found.append(Exercise(name, stub, n, label.group("label")))
            stub = None
    assert stub is None, f"cell {stub}: an exercise cell with no check cell after it"
    return found


def stub_function(source):
    """The one function an exercise cell defines."""
    tree = ast.parse(source)
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef), \
        f"an exercise cell must hold one def and nothing else:\n{source}"
    return tree.body[0]


def normalized(code):
    """Code without its spacing and with one kind of quote, for finding one text in another."""
    return re.sub(r"\s+", "", code).replace('"', "'")


def answer_fragments(function):
    """What of a reference answer must not be on screen before its check: every expression of its
    body of at least 8 characters (a name, an attribute or a constant alone does not count), and
    every number it writes other than the small integers and 0.5."""
    tree = stub_function(inspect.getsource(function))
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    expressions, numbers = set(), set()
    for node in (sub for statement in body for sub in ast.walk(statement)):
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and not (value == 0.5 or (float(value).is_integer() and abs(value) <= 10)):
                numbers.add(repr(value))
        elif isinstance(node, ast.expr) and not isinstance(node, (ast.Name, ast.Attribute)):
            text = normalized(ast.unparse(node))
            if len(text) >= 8:
                expressions.add(text)
    return expressions, numbers


def on_screen(cell):
    """A cell's source and the text its outputs show."""
    outputs = "".join(out.get("text", "") or out.get("data", {}).get("text/plain", "")
                      for out in cell.get("outputs", []))
    return cell.source + "\n" + outputs


def test_check_prints_one_line_for_each_outcome(capsys):
    def stub():
        raise NotImplementedError
    grade = course.close_to(np.eye(2), 1e-8)
    cases = [(stub, "not attempted yet — write your answer in the cell above"),
             (lambda: np.eye(2), "pass, max |error| = 0.0e+00 (tolerance 1e-08)"),
             (lambda: 2 * np.eye(2), "FAIL, max |error| = 1.0e+00 (tolerance 1e-08)"),
             (lambda: np.eye(3), "FAIL, the result has shape (3, 3) where (2, 2) is expected"),
             (lambda: None, "FAIL, it returned None (is a return statement missing?)"),
             (lambda: "eye", "FAIL, the result is of type str, not an array of numbers"),
             (lambda: np.ones(2) @ np.ones(3), "FAIL, your code raised ValueError: matmul: Input operand 1")]
    for attempt, line in cases:
        course.check("00.1", attempt, grade)
        assert capsys.readouterr().out.startswith("exercise 00.1: " + line)
    course.check("00.2", lambda: 0.26, course.within(0.31, 0.01))
    course.check("00.2", lambda: np.ones(2), course.within(0.31, 0.01))
    pair = course.close_to((np.eye(2), 2 * np.eye(2)), 1e-8, names=("dx", "dm"))
    course.check("00.3", lambda: (np.eye(2), np.eye(2)), pair)
    course.check("00.3", lambda: np.eye(2), pair)
    assert capsys.readouterr().out.splitlines() == [
        "exercise 00.2: FAIL, |error| = 5.0e-02 (tolerance 1e-02)",
        "exercise 00.2: FAIL, an array of shape (2,) where one number is expected",
        "exercise 00.3: FAIL, dx: max |error| = 0.0e+00; dm: max |error| = 1.0e+00 (tolerance 1e-08)",
        "exercise 00.3: FAIL, a result of type ndarray where a tuple of 2 arrays is expected"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_exercises_are_stubs_with_a_reference_and_wrong_answers(path):
    """Each exercise cell defines a function that raises NotImplementedError after its docstring;
    solutions.py holds the reference answer of the same name and signature; WRONG_ANSWERS lists at
    least two wrong answers for it, and nothing for an exercise the notebook does not have."""
    nb = nbformat.read(path, as_version=4)
    found = exercises(nb)
    labels = [ex.label for ex in found]
    assert labels == [f"{path.name[:2]}.{k}" for k in range(1, len(found) + 1)], \
        f"{path.name}: the checks' labels {labels} do not count 1, 2, ... in the notebook's number"
    for ex in found:
        stub = stub_function(nb.cells[ex.stub].source)
        body = stub.body[1:] if ast.get_docstring(stub) else None
        assert body and len(body) == 1 and ast.unparse(body[0]) == "raise NotImplementedError", \
            f"{path.name}, cell {ex.stub}: the stub must be a docstring and `raise NotImplementedError`"
        assert hasattr(solutions, ex.name), f"{path.name}: solutions.py has no {ex.name}"
        reference = stub_function(inspect.getsource(getattr(solutions, ex.name)))
        assert ast.unparse(reference.args) == ast.unparse(stub.args), \
            f"{path.name}: {ex.name}'s signature differs from the reference's"
        wrong = WRONG_ANSWERS.get(path.name, {}).get(ex.name, [])
        assert len(wrong) >= 2, f"{path.name}: WRONG_ANSWERS lists {len(wrong)} wrong answers for {ex.name}, not 2"
        for label, source in wrong:
            assert stub_function(source).name == ex.name, f"{path.name}: {label!r} does not define {ex.name}"
    unknown = set(WRONG_ANSWERS.get(path.name, {})) - {ex.name for ex in found}
    assert not unknown, f"{path.name}: WRONG_ANSWERS lists exercises it does not have: {sorted(unknown)}"


def test_wrong_answers_are_for_notebooks_that_exist():
    assert set(WRONG_ANSWERS) <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_path_to_the_answers(path):
    """No code cell reaches solutions.py (by import, call or file); text may name it only after the
    last check, as where to read the answers."""
    nb = nbformat.read(path, as_version=4)
    last_check = max([ex.check for ex in exercises(nb)], default=-1)
    reaching = [n for n, cell in enumerate(nb.cells)
                if "solutions" in cell.source and (cell.cell_type == "code" or n < last_check)]
    assert not reaching, f"{path.name}: cells that name solutions: {reaching}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_check_says_not_attempted_as_committed(path):
    nb = nbformat.read(path, as_version=4)
    for ex in exercises(nb):
        shown = printed(nb)[ex.check]
        assert shown == f"exercise {ex.label}: {course.NOT_ATTEMPTED}\n", \
            f"{path.name}, cell {ex.check}: the committed check prints {shown!r}"


def answers_on_screen(nb):
    """(cell, exercise, what of its reference answer the cell shows) for each cell above a check
    that shows an expression of the reference answer's body (in its source, spacing and quotes
    aside) or a number the body writes (in its source or printed output)."""
    found = []
    for ex in exercises(nb):
        expressions, numbers = answer_fragments(getattr(solutions, ex.name))
        for n, cell in enumerate(nb.cells[:ex.check]):
            code = normalized(cell.source)
            shown = [e for e in expressions if e in code]
            shown += [x for x in numbers if re.search(rf"(?<![\d.]){re.escape(x)}(?!\d)", on_screen(cell))]
            if shown:
                found.append((n, ex.name, shown))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_answer_on_screen_before_its_check(path):
    shown = answers_on_screen(nbformat.read(path, as_version=4))
    assert not shown, f"{path.name}: reference answers on screen before their checks (cell, exercise, what): {shown}"


def test_an_answer_on_screen_is_found():
    """The search above finds a reference answer's line, or a part of it, written in a markdown
    cell above its check, as a learner would see it."""
    path = NOTEBOOK_DIR / "03_backward_walkthrough.ipynb"
    nb = nbformat.read(path, as_version=4)
    ex = next(ex for ex in exercises(nb) if ex.name == "causal_softmax_backward")
    assert not answers_on_screen(nb)
    for leak in ("This is `A * (dA - (dA * A).sum(-1, keepdims=True))`.", "Subtract `(dA*A).sum(-1,keepdims=True)`."):
        nb.cells[ex.stub - 1].source += "\n" + leak
        assert [(n, name) for n, name, _ in answers_on_screen(nb)] == [(ex.stub - 1, ex.name)]
        nb.cells[ex.stub - 1].source = nb.cells[ex.stub - 1].source[:-len(leak) - 1]


def images(nb):
    return [out for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def displayed_width(out):
    """The width in pixels at which a PNG output is shown: the width its metadata asks for (retina
    figures are stored at twice it), else the width in the PNG's header (IHDR: bytes 16-19)."""
    png = base64.b64decode(out["data"]["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", "not a PNG"
    width = struct.unpack(">I", png[16:20])[0]
    return out.get("metadata", {}).get("image/png", {}).get("width", width)


def printed(nb):
    """Per code cell, the text it printed or returned (not a figure's "<Figure ...>" line)."""
    return {n: "".join(out.text if out.output_type == "stream" else out.data["text/plain"]
                       for out in cell.outputs
                       if out.output_type == "stream" or ("text/plain" in out.get("data", {}) and "image/png" not in out.data))
            for n, cell in enumerate(nb.cells) if cell.cell_type == "code"}


def last_digit(number):
    """One unit of the last digit a number was printed with ("0.07" -> 0.01, "2.4e-05" -> 1e-06), or
    None for a whole number, a count, which has no rounding to differ in."""
    mantissa, _, exponent = number.lower().partition("e")
    if "." not in mantissa and not exponent:
        return None
    return 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def same_print(committed, rerun):
    """Whether two printed texts agree: the same words (spacing aside: a rounded zero may print as
    -0.00), and each number the same to 1%, or to one unit of its last printed digit (a number
    printed from floats may round the other way on another CPU), or both below ROUNDING; a number
    followed by "s" or "ms" is a timing and may be anything. A whole number must be the same to 1%."""
    def split(text):
        words, numbers, at = [], [], 0
        for match in NUMBER.finditer(text):
            words.append(re.sub(r"\s+", " ", text[at:match.start()]))
            timing = SECONDS.match(text, match.end()) is not None
            numbers.append(None if timing else match.group())
            at = match.end()
        return words + [re.sub(r"\s+", " ", text[at:])], numbers

    def agree(a, b):
        if a is None or b is None:
            return True
        x, y = float(a), float(b)
        units = [u for u in (last_digit(a), last_digit(b)) if u is not None]
        return (abs(x - y) <= 0.01 * max(abs(x), abs(y)) or max(abs(x), abs(y)) < ROUNDING
                or (len(units) == 2 and abs(x - y) <= max(units) * (1 + 1e-9)))
    (words_a, numbers_a), (words_b, numbers_b) = split(committed), split(rerun)
    return words_a == words_b and all(agree(a, b) for a, b in zip(numbers_a, numbers_b))


def disagreements(committed, rerun, bounded=()):
    """What keeps a cell's rerun text from agreeing with its committed text, [] when nothing does:
    each quantity of `bounded` (a notebook's MACHINE_DEPENDENT list), in either text, beyond its
    bound; and, with those quantities taken out of both, any difference same_print finds."""
    problems, texts = [], []
    for which, text in (("committed", committed), ("this run", rerun)):
        for quantity in bounded:
            for match in reversed(list(re.finditer(quantity.pattern, text))):
                if not abs(float(match.group("value"))) <= quantity.bound:
                    problems.append(f"{which}: {match.group()!r} is beyond its bound {quantity.bound:g} ({quantity.why})")
                spans = sorted((match.span(g) for g in ("value", "name") if g in match.re.groupindex), reverse=True)
                for start, end in spans:
                    text = text[:start] + "<machine-dependent>" + text[end:]
        texts.append(text)
    if not same_print(*texts):
        problems.append("a word or an exactly compared number differs")
    return problems


def test_same_print_tells_a_moved_number_from_a_timing():
    assert same_print("loss 2.413, ran in 5.1 s, err 3e-16", "loss 2.414, ran in 9.8 s, err 7e-15")
    assert not same_print("loss 2.413", "loss 2.513")
    assert not same_print("MHA is ahead", "DAMCHA is ahead")
    assert not same_print("took 5 steps", "took 6 steps")


def test_same_print_lets_the_last_digit_round_the_other_way():
    assert same_print("cos 0.06, rank 25.48, diff -0.0040, 2.4e-05", "cos 0.07, rank 25.49, diff -0.0039, 2.5e-05")
    assert same_print("cos(m, I):  0.00", "cos(m, I): -0.00")
    assert not same_print("cos 0.06", "cos 0.08")
    assert not same_print("diff -0.0040", "diff -0.0042")
    assert not same_print("7 of 16 heads", "8 of 16 heads")     # a count has no last digit to round


def test_a_machine_dependent_number_is_held_to_its_bound_and_the_rest_to_its_digits():
    # notebook 03's dn.gradcheck line as committed, and as a rerun on an AMD EPYC (OpenBLAS 0.3.31) printed it
    line = "dn.gradcheck, folded  : 32 parameter arrays, worst |analytic - numeric| / (1e-8 + 1e-5 |numeric|) = {} ({})\n"
    nb03 = MACHINE_DEPENDENT["03_backward_walkthrough.ipynb"]
    committed, elsewhere = line.format("0.028", "gen.1.weight"), line.format("0.031", "h.0.mlp.c_proj.weight")
    assert not same_print(committed, elsewhere)                 # digit by digit, the failure on that machine
    assert disagreements(committed, elsewhere, nb03) == []
    assert disagreements(committed, elsewhere.replace("32 parameter", "33 parameter"), nb03)   # an exact number moved
    assert disagreements(committed, elsewhere.replace("folded", "shared"), nb03)                # a word changed
    assert disagreements(committed, line.format("1.7", "gen.1.weight"), nb03)                   # beyond its bound
    assert disagreements(line.format("2.5", "gen.1.weight"), elsewhere, nb03)                   # committed beyond it
    assert disagreements(committed, elsewhere, []) == ["a word or an exactly compared number differs"]


@pytest.mark.parametrize("name", sorted(MACHINE_DEPENDENT))
def test_machine_dependent_quantities_are_printed_within_their_bounds(name):
    """Each listed quantity is printed by its notebook (a list entry that matches nothing would hide
    nothing and check nothing), and the committed value meets its bound."""
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    texts = printed(nb).values()
    for quantity in MACHINE_DEPENDENT[name]:
        assert any(re.search(quantity.pattern, text) for text in texts), f"{name}: nothing printed matches {quantity.pattern!r}"
    problems = [p for text in texts for p in disagreements(text, text, MACHINE_DEPENDENT[name])]
    assert not problems, f"{name}: " + "\n".join(problems)


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    unrun = [n for n, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} have not been executed; commit the notebook with its outputs"
    assert images(nb), f"{path.name}: the committed outputs hold no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_placeholder_text(path):
    nb = nbformat.read(path, as_version=4)
    left = [(n, match.group()) for n, cell in enumerate(nb.cells) for match in [PLACEHOLDER.search(cell.source)] if match]
    assert not left, f"{path.name}: cells with placeholder text (cell, text): {left}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_committed_error(path):
    nb = nbformat.read(path, as_version=4)
    errors = [(n, out.get("ename") or "traceback on stderr") for n, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.outputs
              if out.output_type == "error" or (out.output_type == "stream" and "Traceback" in out.get("text", ""))]
    assert not errors, f"{path.name}: committed outputs hold errors (cell, error): {errors}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_figures_are_wide_enough(path):
    nb = nbformat.read(path, as_version=4)
    narrow = [(n, displayed_width(out)) for n, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {}) and displayed_width(out) < MIN_FIGURE_WIDTH]
    assert not narrow, f"{path.name}: figures narrower than {MIN_FIGURE_WIDTH} px (cell, width): {narrow}"


def run_and_grade(path):
    """Execute a notebook as committed, cell by cell in one kernel, in memory, with notebooks/ as the
    working directory; right after each check cell, redefine its exercise with the reference answer
    and then each wrong answer, rerun the check after each, and put the stub back. Returns the run
    notebook and, per answer tried, (exercise, the answer's label, the verdict it needs, the line
    printed). Raises CellExecutionError, with the failing cell and its traceback, on an error."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                      # judge this run's outputs, not the committed ones
        if cell.cell_type == "code":
            cell.outputs = []
    checks = {ex.check: ex for ex in exercises(nb)}
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    graded = []
    with client.setup_kernel():
        for n, cell in enumerate(nb.cells):
            client.execute_cell(cell, n)
            if n not in checks:
                continue
            ex = checks[n]
            answers = [("the reference answer", inspect.getsource(getattr(solutions, ex.name)), "pass")]
            answers += [(label, source, "FAIL")
                        for label, source in WRONG_ANSWERS.get(path.name, {}).get(ex.name, [])]
            stub = nb.cells[ex.stub]
            for label, source, verdict in answers:
                client.execute_cell(nbformat.v4.new_code_cell(source), ex.stub)
                rerun = client.execute_cell(nbformat.v4.new_code_cell(cell.source), n)
                graded.append((ex, label, verdict, "".join(out.get("text", "") for out in rerun.outputs)))
            client.execute_cell(nbformat.v4.new_code_cell(stub.source), ex.stub)
            nb.cells[ex.stub], nb.cells[n] = stub, cell      # execute_cell put each cell it ran in their place
    return nb, graded


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_and_plots_and_grades_every_answer(path):
    """The notebook as committed: it runs, plots, prints what the committed file shows (every check:
    not attempted); and each check passes the reference answer and fails each wrong one."""
    committed = printed(nbformat.read(path, as_version=4))
    nb, graded = run_and_grade(path)
    assert images(nb), f"{path.name}: no cell produced a plot (image/png output)"
    for n, text in printed(nb).items():
        problems = disagreements(committed[n], text, MACHINE_DEPENDENT.get(path.name, []))
        assert not problems, (
            f"{path.name}, cell {n} prints what its committed output does not show ({'; '.join(problems)}): run the "
            f"notebook, read its prose against the new numbers, and commit it.\ncommitted:\n{committed[n]}\nthis run:\n{text}")
    for ex in exercises(nb):
        assert printed(nb)[ex.check] == f"exercise {ex.label}: {course.NOT_ATTEMPTED}\n"
    wrong = [f"{ex.label} ({ex.name}) with {label}: {line.strip()!r} where {verdict} is due"
             for ex, label, verdict, line in graded if not line.startswith(f"exercise {ex.label}: {verdict},")]
    assert not wrong, f"{path.name}: checks that misjudge an answer:\n" + "\n".join(wrong)
