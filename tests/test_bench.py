"""
tests/test_bench.py: runs bench.py's parts on tiny models, for their results' form, not their speed.

Run: python -m pytest -q tests/test_bench.py      (about 15 seconds on two CPU cores: the peak
memory of each model is measured in a fresh Python process)
"""
import argparse
import json

import pytest
import torch

import bench
import damcha_torch

TINY = dict(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16)
ARGS = argparse.Namespace(device="cpu", repeats=2)


@pytest.mark.parametrize("gen_out, gen_depth", [("folded", 2), ("full", 2), ("folded", 3)])
def test_equal_params_width_matches_mha_within_5_percent(gen_out, gen_depth):
    fields = dict(TINY, n_embd=32, n_layer=4, gen_out=gen_out, gen_depth=gen_depth)
    target = damcha_torch.count_params(dict(fields, attn="mha"))
    w = damcha_torch.equal_params_width(target, fields)
    error = lambda w: abs(damcha_torch.count_params(dict(fields, gen_width=w)) - target)
    assert error(w) / target < 0.05
    assert all(error(w) <= error(v) for v in (w - 1, w + 1) if v >= 1)     # the nearest width


def test_equal_params_width_needs_a_width_to_trade():
    with pytest.raises(ValueError, match="no generator width"):
        damcha_torch.equal_params_width(10**9, dict(TINY, gen_depth=1))


def test_measure_rows_are_json_with_the_required_keys():
    group = {"mha": (dict(TINY, attn="mha"), 2), "damcha": (dict(TINY, gen_width=8), 2)}
    rows = bench.measure(group, "mha", ARGS, torch.float32)
    assert [row["name"] for row in rows] == ["mha", "damcha"]
    for row in rows:
        parsed = json.loads(json.dumps(row))
        assert {"name", "params", "tokens_per_sec", "peak_mb", "throughput_vs_mha", "peak_vs_mha"} <= parsed.keys()
        assert parsed["tokens_per_sec"] > 0 and parsed["peak_mb"] >= 0 and parsed["rss_peak_mb"] > 0
    assert rows[0]["throughput_vs_mha"] == 1.0
    assert rows[0]["params"] == damcha_torch.count_params(dict(TINY, attn="mha"))


def test_cost_breakdown_times_every_part():
    row = bench.cost_breakdown(dict(TINY, gen_width=8), 2, ARGS, torch.float32)
    assert {"name", "params", "tokens_per_sec", "peak_mb"} <= row.keys()
    assert all(row[f"{part}_ms"] > 0 for part in ("generator", "metric", "attention", "mha_qk"))
    json.dumps(row)


def test_numpy_vs_torch_rows():
    numpy_row, torch_row = bench.numpy_vs_torch(ARGS)
    assert (numpy_row["name"], torch_row["name"]) == ("numpy_f64", "torch_f64")
    assert numpy_row["params"] == torch_row["params"] and numpy_row["time_vs_torch"] > 0
    json.dumps([numpy_row, torch_row])
