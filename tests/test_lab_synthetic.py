"""synthetic.py: the synthetic tasks have the structure its docstring states (and the formulas,
written out entry by entry), train and test samples are distinct, the summary's gains are paired
by seed, the models are at equal parameter count and a seed draws the weights it always drew, a
tiny training run gives finite numbers, and the committed sweep is complete.

    python -m pytest -q tests/test_lab_synthetic.py
"""
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from common import cli, fails, limit_memory, one_line_error
from lab import synthetic as syn

RESULTS = Path(__file__).resolve().parent.parent / "results" / "synthetic"


def swap_subspace(a, b, h, d_e):
    """a with subspace h of every token taken from b."""
    out = a.clone()
    out[..., h * d_e:(h + 1) * d_e] = b[..., h * d_e:(h + 1) * d_e]
    return out


def targets(x, teacher, lam):
    return syn.combine(syn.teacher_terms(x.double(), {k: v.double() for k, v in teacher.items()}), lam)[:, 0]


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_lambda_zero_has_no_cross_subspace_terms(lam):
    # y is additive over the subspaces, y = sum_h f_h(x^(h)), exactly when swapping one subspace
    # between two samples leaves y(a) + y(b) unchanged: true at lambda = 0, false with cross terms
    d_e = 4
    teacher = syn.make_teacher(d_e, 1, seed=1)
    g = torch.Generator().manual_seed(0)
    a, b = syn.sample_tokens(64, d_e, g), syn.sample_tokens(64, d_e, g)
    worst = 0.0
    for h in range(syn.H):
        before = targets(a, teacher, lam) + targets(b, teacher, lam)
        after = targets(swap_subspace(a, b, h, d_e), teacher, lam) + targets(swap_subspace(b, a, h, d_e), teacher, lam)
        worst = max(worst, (before - after).abs().max().item())
    if lam == 0.0:
        assert worst < 1e-10
    else:
        assert worst > 1e-2


def test_within_terms_see_their_own_subspace_only():
    d_e = 4
    teacher = syn.make_teacher(d_e, 2, seed=2)
    g = torch.Generator().manual_seed(1)
    a, b = syn.sample_tokens(32, d_e, g), syn.sample_tokens(32, d_e, g)
    terms = syn.teacher_terms(a, teacher)                              # (N, 2, H, H)
    for h in range(syn.H):
        moved = syn.teacher_terms(swap_subspace(a, b, h, d_e), teacher)
        for k in range(syn.H):
            # term_kk reads subspace k only; term_kg (g != k) reads k (query) and g (keys, values)
            same = torch.allclose(moved[:, :, k, k], terms[:, :, k, k], atol=1e-6)
            assert same == (k != h)


def test_teacher_and_combine_written_out():
    """teacher_terms and combine against their formulas, one entry at a time:
    term[n, k, h, g] = sum_t softmax_t(beta x_T^h . A_hg x_t^g / d_e) (r_k^g . x_t^g / sqrt(d_e)), with
    x_T the last token, and y_k = sum_h [term_hh + lam / (H - 1) sum_{g != h} term_hg]."""
    d_e, n_out, H = 3, 2, syn.H
    teacher = {k: v.double() for k, v in syn.make_teacher(d_e, n_out, seed=3).items()}
    x = syn.sample_tokens(2, d_e, torch.Generator().manual_seed(4)).double()
    xs = x.view(2, syn.T, H, d_e)
    terms = syn.teacher_terms(x, teacher)
    for n in range(2):
        for h in range(H):
            for g in range(H):
                scores = torch.stack([syn.BETA * xs[n, -1, h] @ teacher["A"][h, g] @ xs[n, t, g] / d_e
                                      for t in range(syn.T)])
                for k in range(n_out):
                    values = torch.stack([teacher["r"][k, g] @ xs[n, t, g] / math.sqrt(d_e) for t in range(syn.T)])
                    assert torch.isclose(terms[n, k, h, g], torch.softmax(scores, 0) @ values, rtol=1e-12)
    lam = 0.3
    y = syn.combine(terms, lam)
    for n in range(2):
        for k in range(n_out):
            want = sum(terms[n, k, h, h] + lam / (H - 1) * sum(terms[n, k, h, g] for g in range(H) if g != h)
                       for h in range(H))
            assert torch.isclose(y[n, k], want, rtol=1e-12)


def test_data_shapes_and_labels():
    x_tr, y_tr, x_te, y_te = syn.regression_data(0.6, d_e=4, seed=0, n_train=512, n_test=128)
    assert x_tr.shape == (512, syn.T, 16) and y_tr.shape == (512,) and y_te.shape == (128,)
    assert abs(y_tr.mean().item()) < 1e-5 and abs(y_tr.std().item() - 1) < 1e-5    # standardised
    raw_tr, raw_te = (syn.combine(syn.teacher_terms(x, syn.make_teacher(4, 1, 0)), 0.6)[:, 0] for x in (x_tr, x_te))
    assert torch.allclose(y_te, (raw_te - raw_tr.mean()) / raw_tr.std(), atol=1e-6)   # by the training set's statistics
    assert not (x_te[:, None] == x_tr[None]).all(-1).all(-1).any()                 # no test sample is a training one
    x_tr, c_tr, _, _ = syn.classification_data(8, seed=0, n_train=2048, n_test=16)
    assert x_tr.shape == (2048, syn.T, 32)
    teacher = syn.make_teacher(8, syn.K, seed=0)
    assert torch.equal(c_tr, syn.combine(syn.teacher_terms(x_tr, teacher), syn.CLS_LAMBDA).argmax(1))
    assert not torch.equal(c_tr, syn.combine(syn.teacher_terms(x_tr, teacher), 0.0).argmax(1))
    counts = torch.bincount(c_tr, minlength=syn.K)
    assert len(counts) == syn.K and counts.min() > 2048 / syn.K / 3     # every class occurs, none rare


def test_summary_gains():
    """DAMCHA's gain over MHA, paired by seed: (mha - damcha) / mha of the test MSE, damcha - mha of
    the accuracy; damcha_ahead counts the seeds where the gain is positive."""
    rows = []
    for seed, (mse, acc) in enumerate([((1.0, 0.5), (0.5, 0.6)), ((2.0, 2.5), (0.4, 0.3)), ((1.0, 1.0), (0.5, 0.5))]):
        for model, i in (("mha", 0), ("damcha", 1)):
            common = dict(seed=seed, model=model, params=100, gen_width=8)
            rows += [dict(common, task="regression", x=0.5, test_mse=mse[i]),
                     dict(common, task="classification", x=8, test_acc=acc[i])]
    regression, classification = syn.summarize(rows)
    # the third seed is a tie: a gain of 0, not a seed where DAMCHA is ahead
    assert regression["gain_mean"] == pytest.approx((0.5 - 0.25) / 3) and regression["damcha_ahead"] == 1
    assert regression["mha_mean"] == pytest.approx(4 / 3) and regression["damcha_mean"] == pytest.approx(4 / 3)
    assert classification["gain_mean"] == pytest.approx(0.0) and classification["damcha_ahead"] == 1
    assert classification["gain_std"] == pytest.approx(math.sqrt(0.01))


@pytest.mark.parametrize("d_e", syn.DIMS)
def test_equal_parameter_count(d_e):
    D = syn.H * d_e
    for n_out in (1, syn.K):
        mha = syn.num_params(syn.SetModel(syn.model_config("mha", D), n_out))
        damcha = syn.num_params(syn.SetModel(syn.model_config("damcha", D), n_out))
        assert abs(damcha / mha - 1) < 0.05, (d_e, n_out, mha, damcha)


def test_prediction_is_read_at_the_last_position():
    torch.manual_seed(0)
    model = syn.SetModel(syn.model_config("damcha", 16), 1)
    with torch.no_grad():
        for p in model.parameters():                                     # away from the near-zero init
            p.normal_(0.0, 0.3)
    x = torch.randn(2, syn.T, 16)
    y = model(x)
    x2 = x.clone()
    x2[:, -1] += torch.randn(16)          # only the last token changes
    assert y.shape == (2, 1) and (model(x2) - y).abs().min() > 1e-4
    x3 = x.clone()
    x3[:, 0] += torch.randn(16)           # the first token, seen by the last
    assert (model(x3) - y).abs().min() > 1e-4


@pytest.fixture
def one_thread():
    """One thread, as run_point trains, and the process's count back afterwards: a later test
    comparing an in-process run with a subprocess's needs the same count in both."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_run_is_finite(one_thread):
    settings = dict(steps=5, batch=16, lr=3e-3, n_layer=1)
    reg = syn.regression_data(1.0, d_e=4, seed=0, n_train=256, n_test=64)
    cls = syn.classification_data(4, seed=0, n_train=256, n_test=64)
    rows = []
    for attn in ("mha", "damcha"):
        r = syn.train(attn, reg, "regression", 0, **settings)
        assert math.isfinite(r["test_mse"]) and math.isfinite(r["train_loss"])
        rows.append(dict(task="regression", x=1.0, seed=0, model=attn, **r))
        c = syn.train(attn, cls, "classification", 0, **settings)
        assert math.isfinite(c["test_loss"]) and 0.0 <= c["test_acc"] <= 1.0
        rows.append(dict(task="classification", x=4, seed=0, model=attn, **c))
    assert abs(rows[2]["params"] / rows[0]["params"] - 1) < 0.05
    summary = syn.summarize(rows)
    assert {p["task"] for p in summary} == {"regression", "classification"}
    assert all(math.isfinite(p["gain_mean"]) for p in summary)


def test_train_loss_is_the_last_50_steps_and_both_models_share_seed_and_data(one_thread, monkeypatch):
    """A run's train_loss is the mean of its last 50 steps' losses; run_point trains MHA and DAMCHA
    with the point's seed on the very same data, so that their gains are paired."""
    reg = syn.regression_data(1.0, d_e=4, seed=0, n_train=256, n_test=64)
    recorded = []
    mse = syn.F.mse_loss
    monkeypatch.setattr(syn.F, "mse_loss", lambda *a: recorded.append((r := mse(*a)).detach().item()) or r)
    row = syn.train("mha", reg, "regression", 0, steps=60, batch=16, lr=3e-3, n_layer=1)
    steps = recorded[:-1]                                            # the last call is the test MSE
    assert len(steps) == 60 and row["train_loss"] == pytest.approx(sum(steps[-50:]) / 50, rel=1e-12)
    calls = []
    monkeypatch.setattr(syn, "train", lambda attn, data, task, seed, **kw: calls.append((attn, data, seed)) or {})
    syn.run_point(("regression", 0.5, 3, dict(steps=1)))
    (a, data_a, seed_a), (b, data_b, seed_b) = calls
    assert (a, b) == ("mha", "damcha") and seed_a == seed_b == 3 and data_a is data_b


def test_committed_sweep_is_complete():
    summary = json.loads((RESULTS / "summary.json").read_text())
    points = summary["points"]
    reg = {p["x"]: p for p in points if p["task"] == "regression"}
    cls = {p["x"]: p for p in points if p["task"] == "classification"}
    assert sorted(reg) == list(syn.LAMBDAS) and sorted(cls) == list(syn.DIMS)
    for p in points:
        assert p["seeds"] >= 3
        assert abs(p["params_damcha"] / p["params_mha"] - 1) < 0.05
        assert all(math.isfinite(p[k]) for k in ("mha_mean", "damcha_mean", "gain_mean", "gain_std"))
    assert (RESULTS / "runs.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["--workers", "1"], "options are written --key=value"),
    (["--workers=0"], "workers must be positive"),
    (["--lambdas=0,x"], "expected a comma list of floats"),
    (["--dims=4,0"], "dims must be positive"),
    (["--steps=2.5"], "expected int"),
    (["--lambdas=", "--dims="], "there is nothing to run"),     # it would rewrite the results as empty
    (["--lambdas=0,nan", "--dims="], "lambdas must be finite numbers"),
    (["--quick", "--steps=500", "--seeds=5"], "drop --seeds, --steps"),
    (["--out=/dev/null/results"], "out=/dev/null/results: "),  # refused before any training, not after
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(SystemExit) as refused:
        syn.read_settings(args)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_diverged_run_stops_the_sweep_before_anything_is_written(tmp_path, one_thread, monkeypatch):
    points = []
    run_point = syn.run_point
    monkeypatch.setattr(syn, "run_point", lambda job: points.append(job) or run_point(job))
    with pytest.raises(SystemExit, match="mha on classification x=8 seed=0 diverged .train loss nan.; stopped"):
        syn.main(["--lr=1e6", "--lambdas=", "--dims=4,8", "--steps=3", "--seeds=1", "--workers=1", f"--out={tmp_path}"])
    assert len(points) == 1 and list(tmp_path.iterdir()) == []   # at once: x=4 never ran
    finite = dict(task="classification", x=4, seed=0, train_loss=1.0)   # any model of a point may diverge
    monkeypatch.setattr(syn, "run_point", lambda job: [dict(finite, model="mha"), dict(finite, model="damcha", train_loss=math.nan)])
    with pytest.raises(SystemExit, match="damcha on classification x=4 seed=0 diverged"):
        syn.run_jobs([("classification", 4, 0, {})], 1)


def test_settings_lists_and_quick(tmp_path):
    out = str(tmp_path / "x")
    cfg, lambdas, dims, out_dir = syn.read_settings(["--workers=1", "--lambdas=0,0.6,1", "--dims=", f"--out={out}"])
    assert (cfg["workers"], lambdas, dims, out_dir) == (1, (0.0, 0.6, 1.0), (), out)
    cfg, lambdas, dims, _ = syn.read_settings(["--quick", f"--out={out}"])
    assert (cfg["steps"], cfg["seeds"], lambdas, dims) == (20, 1, (0.0, 1.0), (4, 8))


def test_set_model_has_gpts_initialisation():
    torch.manual_seed(0)
    model = syn.SetModel(syn.model_config("damcha", 64, n_layer=4), 1)
    params = dict(model.named_parameters())
    assert abs(params["h.0.mlp.c_fc.weight"].std().item() / 0.02 - 1) < 0.05
    assert abs(params["h.0.attn.c_proj.weight"].std().item() / (0.02 / math.sqrt(8)) - 1) < 0.1
    assert abs(params["gen.1.weight"].std().item() / 0.02 - 1) < 0.05
    assert all(torch.equal(p, torch.zeros_like(p)) for name, p in params.items()
               if name.endswith("bias") and "ln" not in name)


# state_dict digests (sha256 of keys and bytes, first 16 hex digits) of SetModel(model_config(attn,
# 8, 2), 4) after torch.manual_seed(0), and the next torch.rand(1), as the code before GPT took an
# attention class drew them: the committed sweep's models are drawn as they were
SEEDED = {"mha": ("c34471e5a163b036", 0.9066072702), "damcha": ("778bd429b2f3f238", 0.6153969169)}


@pytest.mark.parametrize("attn", SEEDED)
def test_a_seed_draws_the_model_it_always_drew(attn):
    torch.manual_seed(0)
    model = syn.SetModel(syn.model_config(attn, 8, 2), 4)
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    digest, next_draw = SEEDED[attn]
    assert (h.hexdigest()[:16], f"{torch.rand(1).item():.10f}") == (digest, f"{next_draw:.10f}")


def test_dims_that_cannot_fit_are_one_line(tmp_path):
    """synthetic.py refuses dims that cannot fit in memory before allocating them, in one line."""
    assert 'dims=100000 asks for more than' in fails('--dims=100000', f'--out={tmp_path / "syn"}', main=syn.main)


def test_a_batch_out_of_memory_is_one_line(tmp_path):
    """A batch too big for memory under ulimit -v ends synthetic.py in one line naming the
    settings to lower."""
    result = cli("--batch=10000000", "--lambdas=0", "--dims=", "--seeds=1", "--steps=2", "--workers=1",
                 f"--out={tmp_path}", script="lab/synthetic.py", preexec_fn=limit_memory(3 * 10**9))
    one_line_error(result, "out of memory (")
    assert "lower batch, dims or n_layer" in result.stderr


def test_workers_are_capped_at_the_number_of_jobs(tmp_path, one_thread, capsys):
    """One job with --workers=6 runs in one process, says so, and records 1 worker."""
    syn.main(["--lambdas=0", "--dims=", "--seeds=1", "--steps=2", "--workers=6", f"--out={tmp_path}"])
    assert "note: 1 job(s), so 1 worker(s), not workers=6" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["workers"] == 1
