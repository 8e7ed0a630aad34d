"""
tests/test_lab_bench.py: runs bench.py's parts on tiny models, for their results' form, not their speed,
and checks the lab's counts (lab/counts.py): parameter-matched widths, training FLOPs and MFU.

Run: python -m pytest -q tests/test_lab_bench.py      (the peak memory of each model is measured in a
fresh Python process)
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import cli, limit_memory, one_line_error
from damcha_torch import GPTConfig
from lab import bench, counts
from lab.variants import build

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("gen_out, gen_depth", [("folded", 2), ("full", 2), ("folded", 3)])
def test_equal_params_width_matches_mha_within_5_percent(gen_out, gen_depth):
    fields = dict(TINY, n_embd=32, n_layer=4, gen_out=gen_out, gen_depth=gen_depth)
    target = counts.count_params(dict(fields, attn="mha"))
    w = counts.equal_params_width(target, fields)
    error = lambda w: abs(counts.count_params(dict(fields, gen_width=w)) - target)
    assert error(w) / target < 0.05
    assert all(error(w) <= error(v) for v in (w - 1, w + 1) if v >= 1)     # the nearest width


@pytest.mark.parametrize("gen_out", ["folded", "full"])
def test_both_generator_outputs_are_at_mhas_parameter_count(gen_out):
    """bench's damcha and damcha_<the other gen_out> rows: each its own width, MHA's count within 5%."""
    group, _ = bench.groups(dict(bench.DEFAULTS, quick=True, gen_out=gen_out))
    other = "full" if gen_out == "folded" else "folded"
    mha = counts.count_params(group["mha"])
    for name in ("damcha", f"damcha_{other}"):
        assert abs(counts.count_params(group[name]) / mha - 1) < 0.05, name
    assert group["damcha"]["gen_width"] != group[f"damcha_{other}"]["gen_width"]


def test_equal_params_width_needs_a_width_to_trade():
    with pytest.raises(ValueError, match="no generator width"):
        counts.equal_params_width(10**9, dict(TINY, gen_depth=1))


def test_count_params_is_get_num_params():
    for fields in (dict(TINY, attn="mha"), dict(TINY), dict(TINY, share=False, gen_out="folded"),
                   dict(TINY, attn="proj", mlp_hidden=7), dict(TINY, attn="dcmha"), dict(TINY, attn="tha")):
        assert counts.count_params(fields) == build(GPTConfig(**fields)).get_num_params(), fields


# ----------------------------------------------------------------------------------------------
# Training FLOPs and MFU (lab/counts.py); TINY_FLOPS has three layers

TINY_FLOPS = dict(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, gen_width=6)


def test_flops_count_generator_and_metric():
    flops = lambda **variant: counts.flops_per_token(GPTConfig(**TINY_FLOPS, **variant))
    D, w, L, dh = TINY_FLOPS["n_embd"], TINY_FLOPS["gen_width"], TINY_FLOPS["n_layer"], 4
    generator = 6 * (D * w + w * D * dh)                             # per token, folded last layer
    assert flops(share=True) - flops(adaptive=False) == generator
    assert flops(share=False) - flops(adaptive=False) == L * generator
    assert flops(gen_out="folded") == flops(share=True)
    shared = GPTConfig(**TINY_FLOPS, share=True)
    mfu = counts.estimate_mfu(shared, fwdbwd_per_iter=4, dt=1e-3)
    assert mfu == pytest.approx(counts.flops_per_token(shared) * 8 * 4 / 1e-3 / 989e12)


def test_flops_count_causal_attention():
    # 6 per multiply-add: c_attn, c_proj and the MLP (12 D^2), q k^T and A v over the T / 2 keys
    # a causal query meets on average (2 D T / 2), the tied lm_head (D V)
    D, L, T, V = TINY_FLOPS["n_embd"], TINY_FLOPS["n_layer"], TINY_FLOPS["block_size"], TINY_FLOPS["vocab_size"]
    assert counts.flops_per_token(GPTConfig(**TINY_FLOPS, attn="mha")) == 6 * (L * (12 * D * D + 2 * D * T // 2) + D * V)
    # DAMCHA with a static metric: c_v, c_proj and the MLP (10 D^2), the queries q = x m (D dh), the same attention
    static = counts.flops_per_token(GPTConfig(**TINY_FLOPS, adaptive=False))
    assert static == 6 * (L * (10 * D * D + D * (D // TINY_FLOPS["n_head"]) + 2 * D * T // 2) + D * V)


def test_mfu_peak_by_dtype():
    config = GPTConfig(**TINY_FLOPS)
    flops = counts.flops_per_token(config) * TINY_FLOPS["block_size"] * 4 / 1e-3
    assert counts.estimate_mfu(config, 4, 1e-3, "float16") == pytest.approx(flops / 989e12)
    assert counts.estimate_mfu(config, 4, 1e-3, torch.bfloat16) == pytest.approx(flops / 989e12)
    assert counts.estimate_mfu(config, 4, 1e-3, "float32") == pytest.approx(flops / 66.9e12)
    assert counts.estimate_mfu(config, 4, 1e-3, peak=1e12) == pytest.approx(flops / 1e12)


def test_mfu_of_float32_follows_tf32():
    """torch.float32 counts at the TF32 peak exactly when float32 matmuls may use TF32
    (damcha_triton.tf32_matmuls). In a fresh process: the setting is process-wide, and importing
    damcha_triton here would fix its interpreter mode before tests/test_triton.py chooses it."""
    pytest.importorskip("triton")
    code = ("import torch\nfrom lab import counts\nfrom damcha_torch import GPTConfig\n"
            f"config = GPTConfig(**{TINY_FLOPS!r})\n"
            "flops = counts.flops_per_token(config) * config.block_size * 4 / 1e-3\n"
            "for precision in ('highest', 'high'):\n"
            "    torch.set_float32_matmul_precision(precision)\n"
            "    print(round(flops / counts.estimate_mfu(config, 4, 1e-3, torch.float32) / 1e12, 1))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["66.9", "494.5"]                  # IEEE float32, then TF32 allowed


@pytest.fixture(scope="module")
def rows():
    """bench.measure's rows for a tiny MHA and DAMCHA (each model's memory in a fresh process)."""
    group = {"mha": (dict(TINY, attn="mha"), 2), "damcha": (dict(TINY, gen_width=8), 2)}
    return bench.measure(group, "mha", "cpu", torch.float32, repeats=2)


def test_measure_rows_are_json_with_the_required_keys(rows):
    assert [row["name"] for row in rows] == ["mha", "damcha"]
    for row in rows:
        parsed = json.loads(json.dumps(row))
        assert {"name", "params", "tokens_per_sec", "peak_mb", "throughput_vs_mha", "peak_vs_mha"} <= parsed.keys()
        assert parsed["tokens_per_sec"] > 0 and parsed["peak_mb"] >= 0 and parsed["rss_peak_mb"] > 0
    assert rows[0]["throughput_vs_mha"] == 1.0
    assert rows[0]["params"] == counts.count_params(dict(TINY, attn="mha"))


def test_measure_computes_its_ratios_from_the_times(monkeypatch):
    """bench.measure's arithmetic with times (s) and memory set by hand: tokens/s from the median
    step, throughput_vs_mha the median over rounds of mha's time over the model's (not the ratio
    of the medians), peak_vs_mha the ratio of the peaks above the 'before' of each process."""
    times = {"mha": [1.0, 3.0, 10.0], "damcha": [4.0, 1.0, 2.0]}   # per-round ratios 0.25, 3, 5: median 3
    monkeypatch.setattr(bench, "time_alternately", lambda steps, repeats, device: times)
    peaks = iter([(170.0, 180.0), (170.0, 185.0)])                   # (before, peak) in a fresh process each
    monkeypatch.setattr(bench, "fresh_process_peak_memory", lambda *a: next(peaks))
    group = {"mha": (dict(TINY, attn="mha"), 2), "damcha": (dict(TINY, gen_width=8), 2)}
    mha, damcha = bench.measure(group, "mha", "cpu", torch.float32, repeats=3)
    assert (mha["tokens_per_sec"], mha["ms_per_step"], mha["peak_mb"]) == (round(2 * 16 / 3.0), 3000.0, 10.0)
    assert (damcha["tokens_per_sec"], damcha["ms_per_step"], damcha["ms_min"]) == (2 * 16 / 2.0, 2000.0, 1000.0)
    assert (damcha["throughput_vs_mha"], damcha["peak_vs_mha"], damcha["rss_peak_mb"]) == (3.0, 1.5, 185.0)


def test_numpy_vs_torch_and_parts_from_the_times(monkeypatch):
    monkeypatch.setattr(bench, "time_alternately", lambda steps, repeats, device: {"numpy_f64": [0.3, 0.3], "torch_f64": [0.1, 0.1]})
    numpy_row, torch_row = bench.numpy_vs_torch(repeats=2)
    tokens = bench.NUMPY_BATCH * bench.NUMPY_FIELDS["block_size"]
    assert numpy_row["time_vs_torch"] == 3.0 and numpy_row["tokens_per_sec"] == round(tokens / 0.3)
    assert torch_row["ms_per_step"] == 100.0
    parts = dict(generator=[0.001, 0.002, 0.010], metric=[0.004] * 3, attention=[0.003] * 3, mha_qk=[0.001] * 3)
    monkeypatch.setattr(bench, "time_alternately", lambda steps, repeats, device: parts)
    row = bench.cost_breakdown(dict(TINY, gen_width=8), 2, "cpu", torch.float32, repeats=3)
    assert (row["generator_ms"], row["metric_ms"], row["attention_ms"], row["mha_qk_ms"]) == (2.0, 4.0, 3.0, 1.0)


def test_cost_breakdown_times_every_part():
    row = bench.cost_breakdown(dict(TINY, gen_width=8), 2, "cpu", torch.float32, repeats=2)
    assert {"name", "params", "tokens_per_sec", "peak_mb"} <= row.keys()
    assert all(row[f"{part}_ms"] > 0 for part in ("generator", "metric", "attention", "mha_qk"))
    json.dumps(row)


def test_numpy_vs_torch_rows():
    numpy_row, torch_row = bench.numpy_vs_torch(repeats=2)
    assert (numpy_row["name"], torch_row["name"]) == ("numpy_f64", "torch_f64")
    assert numpy_row["params"] == torch_row["params"] and numpy_row["time_vs_torch"] > 0
    json.dumps([numpy_row, torch_row])


def test_time_alternately_times_every_step_in_alternating_order():
    order = []
    times = bench.time_alternately({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3, "cpu",
                                   warmup=1)
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]          # warm-up, then reversed every other round
    assert all(len(t) == 3 and min(t) >= 0 for t in times.values())


def test_summary_lines(rows):
    parts = bench.cost_breakdown(dict(TINY, gen_width=8), 2, "cpu", torch.float32, repeats=2)
    lines = bench.summarize(rows + [parts, dict(name="numpy_f64", time_vs_torch=2.5)])
    assert lines[0].startswith("damcha vs mha:") and "generator width 8" in lines[0]
    assert lines[-1].startswith("numpy / torch") and "2.50x, met" in lines[-1]


def test_memory_report_compares_full_and_folded(monkeypatch, capsys):
    # the fresh-process measurement itself runs in test_measure_rows_...; here its numbers are
    # given, (before, peak) in MiB, to check what the report makes of them
    peaks = {("full", True): (100.0, 300.0), ("folded", True): (100.0, 200.0),
             ("full", False): (100.0, 500.0), ("folded", False): (100.0, 250.0)}
    monkeypatch.setattr(bench, "fresh_process_peak_memory",
                        lambda fields, batch_size, device: peaks[fields["gen_out"], fields["share"]])
    lines = bench.memory_report(dict(TINY, gen_width=8), 2, "cpu")
    assert len(lines) == 8 and lines[0].startswith("B=2") and "'share': True" in lines[0]
    assert lines[3] == "  full / folded peak: 1.500 (model and step: 2.000)"
    assert lines[7] == "  full / folded peak: 2.000 (model and step: 2.667)"
    monkeypatch.setattr(bench, "memory_report", lambda fields, batch_size, device: [f"measured on {device}"])
    bench.main(["--memory", "--device=cpu"])   # the one setting --memory takes
    assert capsys.readouterr().out == "measured on cpu\n"


@pytest.mark.parametrize("args, message", [
    (["--n_head=3"], "n_head (3) must divide n_embd (128)"),
    (["--device=gpu"], "device must be one of cpu, cuda"),
    (["--batch_size=0"], "batch_size must be positive"),
    (["--repeats=-1"], "repeats must be zero or more"),
    (["--quick", "--workers=1"], "unknown setting 'workers'"),
    (["--quick", "1"], "no such config file"),
    (["--memory", "--batch_size=2", "--quick"], "it takes --device only, drop --batch_size, --quick"),
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(SystemExit) as refused:
        bench.main(args)
    assert message in str(refused.value)


def test_bad_setting_gives_one_line_not_a_traceback():
    out = subprocess.run([sys.executable, "lab/bench.py", "--n_head=3"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == "error: n_head (3) must divide n_embd (128)\n"


def test_a_block_out_of_memory_is_one_line():
    """A block too big for memory under ulimit -v, here in the fresh process that measures a train
    step's memory, ends bench.py in one line naming the settings to lower."""
    out = cli("--quick", "--block_size=1000000", "--repeats=1", script="lab/bench.py",
              preexec_fn=limit_memory(3 * 10**9))
    one_line_error(out, "out of memory (")
    assert "lower block_size, batch_size, n_embd, n_layer or sweep_batch" in out.stderr
