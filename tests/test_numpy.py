"""Tests of damcha_numpy.py: every *_backward against central differences (float64), the whole
model against finite differences and against an independent implementation of the model
(tests/spec_reference.py), causality, folding, block masks, initialisation, training and sampling,
and its one-line refusals of bad input.

    python -m pytest -q tests/test_numpy.py
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import damcha_numpy as dn
from common import cli, fails, limit_memory, one_line_error
from spec_reference import reference_forward, reference_random_params

# three layers: with two, a shared metric gets dm from one layer only, and its sum over layers goes untested
BASE = dict(vocab_size=7, block_size=6, n_layer=3, n_head=2, n_embd=8, gen_width=5)
VARIANTS = {
    "damcha": {},
    "unshared": dict(share=False),
    "static": dict(adaptive=False),
    "static_unshared_folded": dict(adaptive=False, share=False, gen_out="folded"),
    "static_unshared_offdiag": dict(adaptive=False, share=False, blocks="offdiag"),
    "folded": dict(gen_out="folded"),
    "diag": dict(blocks="diag"),
    "offdiag": dict(blocks="offdiag"),
    "depth1": dict(gen_depth=1),
    "depth3_unshared": dict(gen_depth=3, share=False),
    "no_bias": dict(bias=False),
    "mha": dict(attn="mha"),
    "mha_no_bias": dict(attn="mha", bias=False),
}


def close(analytic, numeric):
    # the gradient check's bar: within 1e-8 + 1e-5 |g|
    return np.all(np.abs(analytic - numeric) <= 1e-8 + 1e-5 * np.abs(numeric))


def check_op(forward, backward, inputs, seed=0):
    """forward(**inputs) -> (out, cache); backward(dout, cache) -> {name: grad}. Checks each grad
    against central differences of sum(out * dout), with a random dout."""
    out, cache = forward(**inputs)
    dout = np.random.default_rng(seed).normal(size=np.shape(out))
    grads = backward(dout, cache)
    assert set(grads) == set(inputs)
    for name, x in inputs.items():
        numeric = dn.numerical_gradient(lambda: np.sum(forward(**inputs)[0] * dout), x)
        assert np.abs(numeric).max() > 1e-6, f"{name}: the check would be vacuous"
        assert close(grads[name], numeric), f"{name}: max err {np.abs(grads[name] - numeric).max():.2e}"


rng = np.random.default_rng(0)
randn = lambda *shape: rng.normal(size=shape)


def test_embedding_backward():
    idx = np.array([[0, 2, 2], [1, 0, 3]])   # repeated rows must accumulate
    check_op(lambda weight: dn.embedding_forward(weight, idx),
             lambda d, c: {"weight": dn.embedding_backward(d, c)}, dict(weight=randn(5, 4)))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_backward(bias):
    inputs = dict(x=randn(2, 3, 4), weight=randn(5, 4)) | (dict(bias=randn(5)) if bias else {})
    names = list(inputs)
    check_op(dn.linear_forward, lambda d, c: dict(zip(names, dn.linear_backward(d, c))), inputs)


def test_layernorm_backward():
    check_op(dn.layernorm_forward, lambda d, c: dict(zip(["x", "weight", "bias"], dn.layernorm_backward(d, c))),
             dict(x=randn(2, 3, 6), weight=randn(6), bias=randn(6)))


def test_gelu_backward():
    check_op(dn.gelu_forward, lambda d, c: {"x": dn.gelu_backward(d, c)}, dict(x=3 * randn(4, 5)))


def test_cross_entropy_backward():
    targets = np.array([[1, 0, 3], [2, 2, 0]])
    check_op(lambda logits: dn.cross_entropy_forward(logits, targets),
             lambda d, c: {"logits": dn.cross_entropy_backward(d, c)}, dict(logits=randn(2, 3, 4)))


def test_prefix_mean_backward():
    check_op(dn.prefix_mean_forward, lambda d, c: {"z": dn.prefix_mean_backward(d, c)}, dict(z=randn(2, 5, 3)))


def test_generator_backward():
    def forward(c, w0, b0, w1, b1, w2):
        return dn.generator_forward(c, [(w0, b0), (w1, b1), (w2, None)])

    def backward(d, cache):
        dc, ((dw0, db0), (dw1, db1), (dw2, _)) = dn.generator_backward(d, cache)
        return dict(c=dc, w0=dw0, b0=db0, w1=dw1, b1=db1, w2=dw2)

    check_op(forward, backward, dict(c=randn(2, 3, 4), w0=randn(5, 4), b0=randn(5), w1=randn(5, 5),
                                     b1=randn(5), w2=randn(6, 5)))


@pytest.mark.parametrize("blocks", ["all", "diag", "offdiag"])
def test_block_mask_backward(blocks):
    # a mask that leaves out every block would make the check vacuous: H = 3 keeps some of each
    check_op(lambda M: dn.block_mask_forward(M, blocks), lambda d, c: {"M": dn.block_mask_backward(d, c)},
             dict(M=randn(2, 3, 2, 3, 2)))


def test_rowsum_backward():
    check_op(dn.rowsum_forward, lambda d, c: {"M": dn.rowsum_backward(d, c)}, dict(M=randn(2, 3, 3, 2, 3, 2)))


@pytest.mark.parametrize("static", [False, True])
def test_metric_query_backward(static):
    m = randn(3, 2, 2) if static else randn(2, 4, 3, 2, 2)
    check_op(dn.metric_query_forward, lambda d, c: dict(zip(["x", "m"], dn.metric_query_backward(d, c))),
             dict(x=randn(2, 4, 3, 2), m=m))


def test_scores_backward():
    check_op(dn.scores_forward, lambda d, c: dict(zip(["q", "k"], dn.scores_backward(d, c))),
             dict(q=randn(2, 2, 4, 3), k=randn(2, 2, 4, 3)))


def test_causal_softmax_backward():
    check_op(dn.causal_softmax_forward, lambda d, c: {"S": dn.causal_softmax_backward(d, c)}, dict(S=randn(2, 2, 4, 4)))


def test_attn_values_backward():
    check_op(dn.attn_values_forward, lambda d, c: dict(zip(["A", "v"], dn.attn_values_backward(d, c))),
             dict(A=randn(2, 2, 4, 4), v=randn(2, 2, 4, 3)))


def layer_params(config, prefix):
    """The random float64 parameters of one layer's keys, as views into a shared dict."""
    params = reference_random_params(config, seed=3)
    return params, {k: v for k, v in params.items() if k.startswith(prefix)}


@pytest.mark.parametrize("variant", ["damcha", "static", "folded", "diag", "mha"])
def test_metric_and_attention_backward(variant):
    """metric_forward and attention_forward together, as block 0 of an unshared model runs them."""
    config = dn.GPTConfig(**BASE, **VARIANTS[variant], share=False)
    params, own = layer_params(config, "h.0.attn.")

    def forward(u, **_):
        m, cache_metric = dn.metric_forward(params, "h.0.attn.", config, u) if config.attn == "damcha" else (None, None)
        y, cache_attn = dn.attention_forward(params, "h.0.attn.", config, u, m)
        return y, (cache_metric, cache_attn)

    def backward(dy, cache):
        cache_metric, cache_attn = cache
        du, dm, grads = dn.attention_backward(dy, cache_attn)
        if cache_metric is not None:
            du_metric, metric_grads = dn.metric_backward(dm, cache_metric)
            grads.update(metric_grads)
            du = du + (0 if du_metric is None else du_metric)
        return grads | {"u": du}

    check_op(forward, backward, dict(u=randn(2, 5, 8)) | own)


def test_mlp_backward():
    config = dn.GPTConfig(**BASE)
    params, own = layer_params(config, "h.0.mlp.")
    check_op(lambda x, **_: dn.mlp_forward(params, "h.0.mlp.", x),
             lambda d, c: (lambda dx, g: g | {"x": dx})(*dn.mlp_backward(d, c)),
             dict(x=randn(2, 3, 8)) | own)


@pytest.mark.parametrize("variant", ["damcha", "mha"])
def test_block_backward(variant):
    """A residual block, in both roles of a shared stack: owner of the generator, and user of
    metrics made elsewhere (whose gradient it must hand back as dm)."""
    config = dn.GPTConfig(**BASE, **VARIANTS[variant])
    params, own = layer_params(config, "h.0.")
    own |= {k: v for k, v in params.items() if k.startswith("gen.")}
    check_op(lambda x, **_: dn.block_forward(params, config, 0, x),
             lambda d, c: (lambda dx, dm, g: g | {"x": dx})(*dn.block_backward(d, c)),
             dict(x=randn(2, 5, 8)) | own)
    if variant == "damcha":
        check_op(lambda x, m, **_: dn.block_forward(params, config, 1, x, m),
                 lambda d, c: (lambda dx, dm, g: g | {"x": dx, "m": dm})(*dn.block_backward(d, c)),
                 dict(x=randn(2, 5, 8), m=randn(2, 5, 2, 4, 4)) | {k: v for k, v in params.items() if k.startswith("h.1.")})


@pytest.fixture(params=list(VARIANTS))
def variant(request):
    config = dn.GPTConfig(**BASE, **VARIANTS[request.param])
    params = reference_random_params(config, seed=1)
    r = np.random.default_rng(2)
    idx, targets = r.integers(0, config.vocab_size, (2, 2, config.block_size))
    return request.param, config, params, idx, targets


def test_matches_independent_reference(variant):
    _, config, params, idx, targets = variant
    assert set(params) == set(dn.init_params(config)), "parameter names differ from the reference's"
    logits, loss, _ = dn.forward(params, config, idx, targets)
    ref_logits, ref_loss = reference_forward(params, config, idx, targets)
    assert np.abs(logits - ref_logits).max() <= 1e-10 * np.abs(ref_logits).max()
    assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)


# every parameter in these; in the other variants the parameters whose code the variants change: the
# attention, the generator and each ln_1, which receives the attention's du (the MLP, ln_2, ln_f and
# the embeddings run the same code in every variant)
FULL_GRADCHECK = ("damcha", "no_bias", "mha")


def test_gradcheck_whole_model(variant):
    name, config, params, idx, targets = variant
    names = list(params) if name in FULL_GRADCHECK else [
        k for k in params if ".attn." in k or k.startswith("gen.") or ".ln_1." in k]
    report = dn.gradcheck(config, params, idx, targets, names=names)
    assert set(report) == set(names)
    assert max(report.values()) <= 1.0, {k: v for k, v in report.items() if v > 1}


@pytest.mark.parametrize("name", ["damcha", "unshared", "static", "mha"])
def test_causality(name):
    config = dn.GPTConfig(**BASE, **VARIANTS[name])
    params = reference_random_params(config, seed=4)
    idx = np.random.default_rng(5).integers(0, config.vocab_size, (2, config.block_size))
    logits = dn.forward(params, config, idx)[0]
    for t in range(config.block_size - 1):
        changed = idx.copy()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % config.vocab_size
        new_logits = dn.forward(params, config, changed)[0]
        assert np.array_equal(new_logits[:, :t + 1], logits[:, :t + 1])
        assert not np.allclose(new_logits[:, t + 1:], logits[:, t + 1:])


def fold(weight, config):
    """Sum the full output's rows (i a, j b) over the block column j -> rows (i a b)."""
    H, dh = config.n_head, config.n_embd // config.n_head
    return weight.reshape(H, dh, H, dh, *weight.shape[1:]).sum(2).reshape(H * dh * dh, *weight.shape[1:])


@pytest.mark.parametrize("extra", [{}, dict(share=False, gen_depth=1), dict(adaptive=False)])
def test_folded_equals_full(extra):
    full = dn.GPTConfig(**BASE, **extra)
    folded = dn.GPTConfig(**BASE, **extra, gen_out="folded")
    params = reference_random_params(full, seed=6)
    folded_params = dict(params)
    for name, value in params.items():
        if "gen." in name and f"gen.{full.gen_depth - 1}." in name:
            folded_params[name] = fold(value, full)
        elif name.endswith("metric"):
            folded_params[name] = fold(value.reshape(-1), full).reshape(full.n_head, 4, 4)
    assert {k: v.shape for k, v in folded_params.items()} == {k: v.shape for k, v in dn.init_params(folded).items()}
    idx = np.random.default_rng(7).integers(0, full.vocab_size, (2, full.block_size))
    np.testing.assert_allclose(dn.forward(folded_params, folded, idx)[0], dn.forward(params, full, idx)[0],
                               rtol=1e-12, atol=1e-12)


def test_diag_plus_offdiag_is_all():
    u = randn(2, 5, 8)
    metrics = {}
    for blocks in ["all", "diag", "offdiag"]:
        config = dn.GPTConfig(**BASE, blocks=blocks)
        metrics[blocks] = dn.metric_forward(reference_random_params(config, seed=8), "", config, u)[0]
    np.testing.assert_allclose(metrics["diag"] + metrics["offdiag"], metrics["all"], rtol=1e-12, atol=1e-12)
    assert not np.allclose(metrics["diag"], metrics["all"])


@pytest.mark.parametrize("fields, bound", [
    (dict(), 0.25), (dict(attn="mha"), 0.25),                       # generator, MHA: close to uniform
    (dict(adaptive=False, gen_out="folded"), 0.6), (dict(adaptive=False), 1.5),   # static: further off
], ids=["generator", "mha", "static_folded", "static_full"])
def test_init_uniform_attention_and_live_generator(fields, bound):
    """At init (default config sizes) attention is within docs/model.md's bounds of uniform, yet
    every generator parameter receives a non-zero gradient."""
    config = dn.GPTConfig(vocab_size=80, **fields)
    params = dn.init_params(config, seed=0)
    r = np.random.default_rng(0)
    idx, targets = r.integers(0, config.vocab_size, (2, 4, config.block_size))
    _, _, cache = dn.forward(params, config, idx, targets)
    for block in cache["blocks"]:
        A = block["attn"][2]["softmax"]                           # (B, H, T, T)
        T = config.block_size
        ratio = A * np.arange(1, T + 1)[:, None]                  # A[t, s] / (1 / (t + 1))
        assert np.abs(ratio - 1)[..., np.tril(np.ones((T, T), dtype=bool))].max() < bound
    grads = dn.backward(params, config, cache)
    for name in params:
        if name.startswith("gen."):
            assert np.abs(grads[name]).max() > 0, name


def test_bad_input():
    config = dn.GPTConfig(**BASE)
    params = dn.init_params(config)
    with pytest.raises(ValueError, match="exceeds block_size"):
        dn.forward(params, config, np.zeros((1, config.block_size + 1), dtype=int))
    with pytest.raises(ValueError, match="divisible"):
        dn.GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="gen_out='full'"):
        dn.GPTConfig(blocks="diag", gen_out="folded")
    with pytest.raises(ValueError, match="targets"):
        dn.backward(params, config, dn.forward(params, config, np.zeros((1, 3), dtype=int))[2])
    for dropout in ("dropout", "attn_dropout"):
        with pytest.raises(ValueError, match=f"supports {dropout}=0 only"):
            dn.GPTConfig(**{dropout: 0.1})


def test_config_has_the_torch_fields_but_the_kernel():
    # a torch GPTConfig, less its kernel, builds the NumPy model of the same settings (tests/test_kernel.py
    # does). Imported here: the rest of this file needs NumPy only
    import dataclasses
    import damcha_torch
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]
    assert names(dn.GPTConfig) == [name for name in names(damcha_torch.GPTConfig) if name != "kernel"]


def test_overfits_one_batch():
    config = dn.GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16, gen_width=16)
    params = dn.init_params(config, seed=0)
    r = np.random.default_rng(0)
    x, y = r.integers(0, 11, (2, 4, 16))
    state, losses = {}, []
    for _ in range(150):
        _, loss, cache = dn.forward(params, config, x, y)
        losses.append(loss)
        dn.adamw_step(params, dn.backward(params, config, cache), state, lr=1e-2, weight_decay=0.0)
    assert losses[0] > 2.0 and losses[-1] < 0.1 * losses[0]


def test_get_batch_targets_are_the_next_tokens():
    data = np.arange(50, dtype=np.uint8)
    x, y = dn.get_batch(data, 8, 6, np.random.default_rng(0))
    assert x.shape == y.shape == (8, 6)
    assert np.array_equal(y, x + 1)   # the corpus counts up: every target is the token after its input
    x, y = dn.get_batch(data[:7], 4, 6, np.random.default_rng(0))   # one window: the whole corpus
    assert (x == np.arange(6)).all() and (y == np.arange(1, 7)).all()
    x, _ = dn.get_batch(data, 400, 6, np.random.default_rng(0))
    assert sorted(set(x[:, 0].tolist())) == list(range(44))   # every start, the last (43) included


def fake_forward(seen, z):
    """A stand-in for dn.forward: logits z at the last position, and at every other position logits
    that put all the mass on token 0; it records the token ids it is given."""
    def forward(params, config, idx):
        seen.append(idx.copy())
        logits = np.zeros((*idx.shape, len(z)))
        logits[:, :, 0] = 50.0
        logits[:, -1] = z
        return logits, None, None
    return forward


def test_generate_samples_the_last_position_at_the_temperature(monkeypatch):
    z = np.array([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr(dn, "forward", fake_forward([], z))
    config = dn.GPTConfig(vocab_size=4, block_size=4, n_head=2, n_embd=8)
    n = 20000
    out = dn.generate(None, config, np.zeros((n, 2), dtype=np.int64), 1, np.random.default_rng(0), temperature=0.5)
    freq = np.bincount(out[:, -1], minlength=4) / n
    p = np.exp(z / 0.5) / np.exp(z / 0.5).sum()
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / n)), (freq, p)


def test_generate_conditions_on_the_last_block_size_tokens(monkeypatch):
    seen = []
    monkeypatch.setattr(dn, "forward", fake_forward(seen, np.zeros(4)))
    config = dn.GPTConfig(vocab_size=4, block_size=4, n_head=2, n_embd=8)
    prompt = np.array([[1, 2, 3, 1, 2, 3]])
    out = dn.generate(None, config, prompt, 3, np.random.default_rng(0))
    assert out.shape == (1, 9) and np.array_equal(out[:, :6], prompt)
    for s, idx in enumerate(seen):
        assert np.array_equal(idx, out[:, :6 + s][:, -4:])


def test_main_trains_and_samples(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_bytes("ROMÉO: to be or not to be, that is the question.\n".encode() * 40)   # É: two bytes
    run = subprocess.run([sys.executable, "damcha_numpy.py", f"--data={corpus}", "--iters=60", "--eval_every=30", "--warmup=5", "--lr=1e-2",
                          "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=16", "--gen_width=8", "--start=ROMÉO:"],
                         capture_output=True, text=True, cwd=dn.__file__.rsplit("/", 1)[0], timeout=300)
    assert run.returncode == 0, run.stderr
    val = [float(line.split("val loss")[1].split("|")[0]) for line in run.stdout.splitlines() if "val loss" in line]
    assert len(val) == 3 and val[-1] < 0.7 * val[0]
    sample = run.stdout.split("-" * 60 + "\n")[1][:-1]
    assert sample.startswith("ROMÉO:") and len("ROMÉO:") + 150 <= len(sample) <= len("ROMÉO:") + 300   # 300 bytes
    # text drawn uniformly from the 22 symbols would have about 9% of its character pairs in the corpus
    pairs = [sample[i:i + 2] for i in range(len(sample) - 1)]
    assert sum(p in corpus.read_text() for p in pairs) > 0.4 * len(pairs)


def test_main_trains_on_the_first_nine_tenths_and_scores_the_last(tmp_path, monkeypatch, capsys):
    """Every batch main draws comes from its split: training from the first 90% of the corpus, the
    printed val loss from the last 10% (8 batches per evaluation)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 8)
    drawn = []
    get_batch = dn.get_batch
    monkeypatch.setattr(dn, "get_batch", lambda data, *args: drawn.append(data) or get_batch(data, *args))
    dn.main([f"--data={corpus}", "--iters=2", "--eval_every=1", "--n_layer=1", "--n_embd=8", "--n_head=2",
             "--block_size=8", "--gen_width=4", "--batch_size=2", "--start=a"])
    assert capsys.readouterr().out.count("val loss") == 3
    data = dn.load_corpus(corpus)[0]
    n = int(0.9 * len(data))
    splits = ["val" if np.array_equal(d, data[n:]) else "train" if np.array_equal(d, data[:n]) else "?" for d in drawn]
    assert splits == (["val"] * 8 + ["train"]) * 2 + ["val"] * 8


def test_main_rejects_bad_flags(tmp_path):
    """Each bad flag ends main with a one-line message (SystemExit with a string: exit status 1, the
    message on stderr); the script itself is run for the first one."""
    short = tmp_path / "short.txt"
    short.write_bytes(b"ROMEO: hi\n" * 3)
    run = subprocess.run([sys.executable, "damcha_numpy.py", "--n_layre=2"], capture_output=True, text=True,
                         cwd=dn.__file__.rsplit("/", 1)[0], timeout=60)
    assert run.returncode == 1 and "did you mean 'n_layer'" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    for flag, message in [("--n_layre=2", "did you mean 'n_layer'"), ("--n_layer=two", "expected int"),
                          ("--vocab_size=500", "unknown setting 'vocab_size'"),   # the corpus decides it
                          ("--qk=proj", "unknown setting 'qk'"),   # NumPy has the paper's model only
                          ("--n_embd=10", "divisible"),
                          ("--start=ROMEO\u00e9", "not in the corpus"), ("--data=/nonexistent.txt", "no such file"),
                          ("--eval_every=0", "must be positive"), ("--n_head=0", "at least 1"),
                          (f"--data={short}", "shorter than block_size")]:
        with pytest.raises(SystemExit) as refused:
            dn.main([flag])
        assert isinstance(refused.value.code, str) and message in refused.value.code, flag
        assert "\n" not in refused.value.code.strip(), flag


def test_damcha_numpy_checks_before_training_and_stops_on_a_non_finite_loss(tmp_path):
    tiny = ['--n_layer=1', '--block_size=8', '--iters=20', '--eval_every=10', '--warmup=1']
    result = cli('--start=', *tiny, script='damcha_numpy.py')
    assert result.returncode == 1 and 'iter' not in result.stdout, result.stdout   # before any training
    assert result.stderr.strip() == 'error: --start is empty: the sample after training needs at least one character to follow'
    result = cli('--lr=1e30', *tiny, script='damcha_numpy.py')
    assert result.returncode == 1 and result.stderr.strip() == \
        'error: the training loss became nan at iter 1; stopped; try a lower --lr', result.stderr[-2000:]
    main = dn.main
    for lr in ('nan', '-1', '0', 'inf'):
        assert fails(f'--lr={lr}', main=main).startswith('error: lr')
    assert 'seed must be a whole number' in fails('--seed=-1', main=main)
    empty = tmp_path / 'empty.txt'
    empty.write_bytes(b'')
    assert fails(f'--data={empty}', main=main) == f'error: --data={empty}: the file is empty'
    if os.path.exists('/proc/self/mem'):   # a file that exists but fails to read (EIO)
        assert fails('--data=/proc/self/mem', main=main).startswith('error: --data=/proc/self/mem: cannot read it')
    assert fails('--start=ROMEO: hello', '--block_size=8', main=main) == \
        "error: --start is 12 bytes, longer than the model's block_size of 8: it would not see the beginning"
    result = cli('--start=ROMEO:', '--block_size=6', '--n_layer=1', '--iters=1', '--eval_every=1', '--warmup=1',
                 script='damcha_numpy.py')   # as long as the context: taken
    assert result.returncode == 0, result.stderr[-2000:]


def test_data_that_is_no_file_or_too_big_and_a_batch_out_of_memory_are_one_line(tmp_path):
    """--data given /dev/null, a directory or a FIFO is named for what it is (the FIFO is never
    opened, so nothing waits on it); a file too big to read under ulimit -v names the file and the
    limit; a batch out of memory names the settings to lower."""
    os.mkfifo(tmp_path / "fifo")
    kinds = (("/dev/null", "a device or socket"), (tmp_path, "a directory"), (tmp_path / "fifo", "a FIFO"))
    for path, kind in kinds:
        one_line_error(cli(f"--data={path}", script="damcha_numpy.py", timeout=30), f"--data={path} is {kind}")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:   # 100 MB of zero bytes, sparse: its token ids need 800 MB as int64
        f.truncate(100 * 10**6)
    limit = limit_memory(600 * 2**20)
    one_line_error(cli(f"--data={big}", script="damcha_numpy.py", preexec_fn=limit),
                   f"out of memory reading --data={big} (")
    tiny = ["--n_layer=1", "--block_size=8", "--n_embd=8", "--n_head=2", "--gen_width=4", "--iters=1"]
    result = cli("--batch_size=1000000000", *tiny, script="damcha_numpy.py", preexec_fn=limit)
    one_line_error(result, "out of memory (")
    assert "lower batch_size, block_size, n_embd or n_layer" in result.stderr
