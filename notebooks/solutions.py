"""notebooks/solutions.py: the reference answers to the notebooks' exercises.

Each exercise cell of a notebook holds a stub, a function that raises NotImplementedError, for you
to write; the check after it grades what your function returns. The function of the same name here
is the reference answer: read it only after trying. The notebooks never import this file; the tests
(tests/test_notebooks.py) put each answer here in place of its stub, and its check must pass.

    python -c "import solutions"      # from notebooks/: it imports NumPy and nothing else
"""
import math

import numpy as np


# ---- 01 to 03: the formulation, what it expresses, the backward pass ------------------------------

def two_steps_back(omega, beta):
    """01, exercise 1: a metric that makes the query of t attend to t - 2. Rows are vectors, so m
    acts from the right, x m; the matrix that turns a row vector back by an angle a is
    [[cos a, -sin a], [sin a, cos a]] (the column-vector rotation by +a, transposed twice)."""
    a = 2 * omega
    return beta * np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])


def zeroed_query_row(t):
    """02, exercise 1: head 0's attention row at query t when its slice of u_t is zero. Every score
    (0 m) . x_s / sqrt(dh) is 0, so the softmax over the t + 1 keys s <= t is uniform."""
    return np.full(t + 1, 1.0 / (t + 1))


def diagonal_only_row(S_row, H):
    """02, exercise 2: the attention row the diagonal-only ablation gives, from the full model's
    scores S_row (one query, its keys s <= t). With the blocks of a row equal, the diagonal block
    is m_i / H, so every score is divided by H."""
    z = S_row / H
    e = np.exp(z - z.max())
    return e / e.sum()


def causal_softmax_backward(dA, A):
    """03, exercise 1: per row, dS_r = A_r (dA_r - sum_s dA_s A_s); masked entries have A = 0."""
    return A * (dA - (dA * A).sum(-1, keepdims=True))


def scores_backward(dS, q, k):
    """03, exercise 2: S_ts = sum_e q_te k_se / sqrt(dh). q_te enters row t of S with the factor
    k_se / sqrt(dh), k_se enters column s with q_te / sqrt(dh): dq = dS k / sqrt(dh), dk = dS^T q / sqrt(dh)."""
    scale = 1 / math.sqrt(q.shape[-1])
    return dS @ k * scale, dS.swapaxes(-1, -2) @ q * scale


def masked_rowsum_backward(dm, blocks):
    """03, exercise 3: m_i = sum_j kappa_ij M_ij, so block M_ij gets kappa_ij dm_i: dm_i broadcast along
    the block row, times the mask (ones, the identity, or ones off the diagonal)."""
    H = dm.shape[-3]
    kappa = {"all": np.ones((H, H)), "diag": np.eye(H), "offdiag": 1 - np.eye(H)}[blocks]
    return dm[..., None, :] * kappa[:, None, :, None]


def prefix_mean_backward(dc, counts):
    """03, exercise 4: c_t = sum_{s<=t} z_s / (t+1), so dz_s = sum_{t>=s} dc_t / (t+1): divide by the
    counts, then a cumulative sum from the last position back to the first."""
    return np.cumsum((dc / counts)[:, ::-1], axis=1)[:, ::-1]


# ---- 04 to 06: the numbers of the runs ----------------------------------------------------------

def paired_gain(mse_mha, mse_damcha):
    """04, exercise 1: each seed's relative gain (MSE_MHA - MSE_DAMCHA) / MSE_MHA, the two models of
    a seed having seen the same teacher and data, then the mean over the seeds. Not the gain of the
    two means, 1 - mean(MSE_DAMCHA) / mean(MSE_MHA): that pools the seeds before pairing them."""
    mha, damcha = np.asarray(mse_mha, float), np.asarray(mse_damcha, float)
    return float(np.mean((mha - damcha) / mha))


def paired_t(first, second):
    """05, exercise 1: how many standard errors the mean of the per-seed differences lies from
    zero. The standard error of a mean of n values is their standard deviation (with n - 1, the
    sample's) over sqrt(n)."""
    diffs = np.asarray(first, float) - np.asarray(second, float)
    standard_error = diffs.std(ddof=1) / math.sqrt(len(diffs))
    return float(diffs.mean() / standard_error)


def equal_time_difference(first, second):
    """06, exercise 1: first's validation estimate minus second's at the longest wall-clock time both
    runs reached, the earlier of their finishing times. The run that finished first is read at its
    end; the other between the two evaluations around that time, on the straight line between them
    (np.interp, which holds a log at its last value past its end)."""
    a, b = np.asarray(first, float), np.asarray(second, float)
    t = min(a[-1, 0], b[-1, 0])
    return float(np.interp(t, a[:, 0], a[:, 1]) - np.interp(t, b[:, 0], b[:, 1]))


def factor_effects(d):
    """06, exercise 2: from d[regime], one variant's per-seed differences to MHA (NumPy arrays) in
    the four cells (one_pass, one_pass_dropout, three_passes, three_passes_dropout), each seed's
    effect of passes and of dropout (the change averaged over the other factor's two levels) and
    their interaction (how much dropout changes the effect of passes)."""
    one, one_dropout, three, three_dropout = (
        np.asarray(d[r], float) for r in ("one_pass", "one_pass_dropout", "three_passes", "three_passes_dropout"))
    return dict(passes=(three + three_dropout - one - one_dropout) / 2,
                dropout=(one_dropout + three_dropout - one - three) / 2,
                interaction=(three_dropout - one_dropout) - (three - one))


def welch_interval(first, second, t_975, welch_dof):
    """06, exercise 3: (mean, half-width) of Welch's 95% interval of mean(first) - mean(second), two
    independent samples (notebook 04's primer). The variance of a difference of independent means is the
    sum of their variances; each mean's is estimated by its squared standard error, its sample's variance
    (n - 1) over n. The half-width is Student's quantile times the root of that sum, at the
    Welch-Satterthwaite degrees of freedom that welch_dof computes from the two (no whole number in general)."""
    a, b = np.asarray(first, float), np.asarray(second, float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    dof = welch_dof(va, vb, len(a), len(b))
    return float(a.mean() - b.mean()), float(t_975(dof) * math.sqrt(va + vb))
