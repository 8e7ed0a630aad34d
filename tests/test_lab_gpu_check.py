"""
tests/test_lab_gpu_check.py: lab/bench_triton_gpu.py, the one-shot GPU check: its smoke run, its
rows and checks (each computes what it names, and fails on a wrong gradient), its time budgets,
its strict JSON, and its cheap check of offsets past 2^31 (on a GPU at the real size).

    python -m pytest -q tests/test_lab_gpu_check.py
"""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

# the interpreter must be chosen before damcha_triton defines its kernels, hence the late imports
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import damcha_triton
from common import GRAD_TOL, off_in_dx
from damcha_torch import GPTConfig
from damcha_triton import damcha_attention
from lab.bench_triton_gpu import last_rows_errors, last_rows_ok, torch_path
from lab.counts import flops_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not damcha_triton.INTERPRETED:
    pytest.skip("damcha_triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)
requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


def test_the_last_rows_check_of_large_offsets():
    """The GPU's check of offsets past 2^31 at a size the interpreter runs: its cheap float64
    reference (the last positions' queries only) agrees with the kernels in float32."""
    err = last_rows_errors(damcha_attention, 1, 2, 40, 8, 16, torch.float32)
    assert all(e < GRAD_TOL for e in err.values()) and set(err) == {"o", "dx", "dm"}, err


def test_the_large_offsets_row_fails_on_a_wrong_dx(capsys):
    from lab import bench_triton_gpu as bench
    wrong_dx = off_in_dx(damcha_attention, 1e-1)
    bench.check_large_offsets(wrong_dx, bench.Budget(60), shape=(1, 2, 40, 8, 16), dtype=torch.float32)
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] is False and row["err_triton"]["o"] < 1e-6 and row["err_triton"]["dx"] > 5e-2
    assert row["offsets_past_2_31"] is False   # 40 * 2 * 8^2 is far below 2^31


@pytest.mark.slow
def test_bench_triton_gpu_smoke(tmp_path):
    """python bench_triton_gpu.py --smoke --profile=True with the busy section: every section runs
    and prints JSON rows; its checks pass, each timed model row is profiled once all are timed (no
    profiler attached while a row is timed), train_char.py's compiled step runs for each path
    with its profile written, and its train_char.py run with --kernel=triton exits 0. It runs as a
    user runs it, without TRITON_INTERPRET: the script chooses the interpreter itself on a CPU."""
    root = os.path.dirname(damcha_triton.__file__)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "lab/bench_triton_gpu.py", "--smoke", "--profile=True", "--budget_busy=100",
                           "--compile_modes=default", f"--busy_dir={tmp_path}"], capture_output=True,
                          text=True, cwd=root, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    kinds = [row["kind"] for row in rows]
    assert kinds[0] == "setup" and kinds[-1] == "done" and {"check", "op", "model", "busy", "train"} <= set(kinds)
    assert not [row for row in rows if "error" in row]
    assert all(row["ok"] for row in rows if row["kind"] == "check")
    assert [row["offsets_past_2_31"] for row in rows if "offsets_past_2_31" in row] == [False]   # the GPU's check, small
    assert all("BLOCK" in config for row in rows if row["kind"] == "check" for config in row["configs"].values())
    ops = [row for row in rows if row["kind"] == "op"]
    # torch_compiled runs in the first dtype on a GPU, every dtype on a CPU: smoke has float32 alone
    assert {row["impl"] for row in ops} == {"read_m", "torch", "triton", "torch_compiled"}
    assert all(row["m_GBps"] > 0 if row["impl"] == "read_m" else row["fwd_ms"] > 0 for row in ops)
    assert all("BLOCK" in config for row in ops if row["impl"] == "triton" for config in row["configs"].values())
    kernel_rows = [row for row in ops if row["impl"] == "triton"]
    assert kernel_rows and all(max(row["vs_torch"].values()) < 1e-4 for row in kernel_rows)   # float32
    assert [row["rc"] for row in rows if row["kind"] == "train"] == [0]
    assert next(row for row in rows if row.get("name") == "matmul")["ms"] > 0
    profiled = [row for row in rows if row["kind"] == "profile"]
    timed = [row for row in rows if row["kind"] == "model" and "ms_per_step" in row]
    assert [row["name"] for row in profiled] == [row["name"] for row in timed] and timed
    assert all(0 < row["host_ms"] for row in timed)
    position = {id(row): i for i, row in enumerate(rows)}
    assert max(position[id(row)] for row in rows if row["kind"] == "model") < min(position[id(row)] for row in profiled)
    assert all(row["total_ms"] >= row["top"][0][1] > 0 for row in profiled)
    busy = [row for row in rows if row["kind"] == "busy"]
    assert [row["name"] for row in busy] == ["mha", "damcha/torch", "damcha/triton"]
    assert all(row["ms_per_step"] > 0 and row["device_ms"] > 0 and row["kernels"] > 0 for row in busy)
    targets = next(row for row in rows if row["kind"] == "busy_targets")
    assert targets["paths"] == sorted(row["name"] for row in busy) and targets["min_busy"] > 0
    profiles = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert [p["name"] for p in profiles] == [row["name"] for row in busy]
    assert all(p["top"] and p["host_top"] for p in profiles)
    assert len(list(tmp_path.glob("smoke-*-default.txt"))) == 3
    agreement = next(row for row in rows if row.get("name") == "grad_agreement")
    bar = GRAD_TOL if agreement["dtype"] == "float32" else 5e-2   # on a GPU both paths run in bf16
    assert agreement["max_rel_err"] < bar and position[id(agreement)] < position[id(timed[0])]


def test_bench_refuses_a_bad_train_config_before_any_section(capsys):
    """The train rows come last: a config file they would fail on is refused before the GPU time;
    so is a busy shape or compile mode the busy section does not know."""
    from lab import bench_triton_gpu
    with pytest.raises(SystemExit, match="train rows' command would fail: missing.py: no such config file"):
        bench_triton_gpu.main(["--smoke", "--train_configs=missing.py"])
    with pytest.raises(SystemExit, match="busy_shapes or compile_modes: huge, fast unknown"):
        bench_triton_gpu.main(["--smoke", "--busy_shapes=shipped,huge", "--compile_modes=fast"])
    assert capsys.readouterr().out == ""   # no row printed


def test_a_row_with_a_nan_is_still_strict_json(capsys):
    """A kernel that returns NaN gives errors that are NaN: the row must still parse as JSON, which
    has no NaN (Python's json.loads accepts it; parse_constant makes it refuse, as jq would)."""
    from lab import bench_triton_gpu

    def refuse(name):
        raise ValueError(f"bare {name} in the output")
    bench_triton_gpu.emit(kind="check", ok=False, err_triton={"o": float("nan"), "dx": 0.5},
                          times=[float("inf"), 1.0])
    row = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert row["err_triton"] == {"o": "nan", "dx": 0.5} and row["times"] == ["inf", 1.0]


def test_a_profile_that_records_nothing_is_an_error():
    """A profiler that recorded no kernels must not read as a step of 0 ms."""
    from lab import bench_triton_gpu
    with pytest.raises(RuntimeError, match="recorded no kernels"):
        bench_triton_gpu.profile_step(lambda: None)


def test_bench_reports_a_failing_implementation_and_times_the_others(capsys):
    """An op that raises in bench_triton_gpu.py's op rows becomes one error row; the rest are timed."""
    from lab import bench_triton_gpu
    def broken(x, m, v):
        raise RuntimeError("no kernel\nfor this")
    bench_triton_gpu.op_rows({"torch": torch_path, "broken": broken}, (1, 2, 8, 4), [torch.float32], None,
                             bench_triton_gpu.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["metric"], r["impl"]) for r in rows if "error" in r] == [("per_token", "broken"), ("static", "broken")]
    assert all(r["error"] == "RuntimeError: no kernel for this" for r in rows if "error" in r)
    assert [(r["metric"], r["impl"]) for r in rows if "fwd_ms" in r] == [("per_token", "torch"), ("static", "torch")]
    bench_triton_gpu.op_rows({"torch": broken, "other": torch_path}, (1, 2, 8, 4), [torch.float32], None,
                             bench_triton_gpu.Budget(60))   # the torch path itself: no ratios to it
    timed = [r for r in map(json.loads, capsys.readouterr().out.splitlines()) if "fwd_ms" in r]
    assert [r["impl"] for r in timed] == ["other", "other"] and all(r["fwd_speedup_vs_torch"] is None for r in timed)
    # the model rows: a gradient agreement or a step that raises is one error row each, and the rest run
    def oom(*args, **kwargs):
        raise RuntimeError("out of memory")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_triton_gpu, "grad_agreement", oom)
        patch.setattr(bench_triton_gpu, "matmul_row", lambda *a: None)
        patch.setattr(bench_triton_gpu, "step_row", oom)
        fields = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
        bench_triton_gpu.model_rows(fields, 1, None, bench_triton_gpu.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [r["name"] for r in rows if r.get("error") == "RuntimeError: out of memory"]
    assert errors == ["grad_agreement", "mha", "damcha/torch", "damcha/triton"]   # compiled steps: no GPU


def test_bench_rows_compute_what_they_name(monkeypatch, capsys):
    """bench_triton_gpu.py's arithmetic, with times set by hand (ms): the bandwidth on m is m's
    bytes over the forward's time, in GB (1e9) per second; the speedups are the torch path's time
    over each; tokens/s and the MFU of a step (6 FLOPs per parameter and token as the model
    counts them) and of a matmul (2 per multiply-add)."""
    from lab import bench_triton_gpu as bench
    times = iter([1e-6, 3e-6, 0.5e-6, 2e-6, 4e-6])   # torch fwd, fwd+bwd; fake fwd, fwd+bwd; the read of m
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: next(times))
    monkeypatch.setattr(bench, "METRICS", {"per_token": False})
    bench.op_rows({"torch": torch_path, "fake": torch_path}, (1, 2, 4, 8), [torch.float32], 4.096e12, bench.Budget(60))
    rows = {r["impl"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    # m (B, T, H, dh, dh) = (1, 4, 2, 8, 8) in float32 is 2048 bytes: read in 4e-6 ms, 512 GB/s
    assert rows["read_m"]["m_GBps"] == 512.0 and rows["read_m"]["m_bandwidth_vs_peak"] == 0.125
    assert (rows["torch"]["m_GBps"], rows["torch"]["m_bandwidth_vs_peak"], rows["torch"]["m_bandwidth_vs_read"]) == (2048.0, 0.5, 4.0)
    assert (rows["fake"]["fwd_speedup_vs_torch"], rows["fake"]["fwd_bwd_speedup_vs_torch"], rows["fake"]["m_GBps"]) == (2.0, 1.5, 4096.0)
    assert rows["torch"]["vs_torch"] is None and rows["fake"]["vs_torch"] == dict(o=0.0, dx=0.0, dm=0.0, dv=0.0)
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 4e-6)
    wrong_dx = off_in_dx(torch_path, 1e-1)
    bench.op_rows({"torch": torch_path, "wrong": wrong_dx}, (1, 2, 4, 8), [torch.float16], 4.096e12, bench.Budget(60))
    rows = {r["impl"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["wrong"]["vs_torch"]["o"] < 1e-6 < 1e-2 < rows["wrong"]["vs_torch"]["dx"]
    assert rows["read_m"]["m_GBps"] == 256.0   # 1024 bytes of float16 m in 4e-6 ms

    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 100.0)
    config = dict(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16, gen_width=8)
    row, _ = bench.step_row(config, torch.zeros(2, 16, dtype=torch.long, device=DEVICE), False, peak_flops=1e9)
    assert row["tokens_per_s"] == 320 and row["mfu"] == round(flops_per_token(GPTConfig(**config)) * 32 / 0.1 / 1e9, 3)
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep=60: 1.0)
    bench.matmul_row(1, 4, 8, peak_flops=1e6)
    assert json.loads(capsys.readouterr().out)["mfu"] == 2 * 4 * 8 * 32 / 1e-3 / 1e6


def test_busy_targets_are_the_issues_targets(capsys):
    """The busy section's targets from its rows: every path busy >= 0.9, the kernel path's step
    over the torch path's, DAMCHA's faster path's tokens/s over MHA's, MHA's MFU."""
    from lab import bench_triton_gpu as bench
    rows = [dict(name="mha", ms_per_step=10.0, busy=0.95, tokens_per_s=1000, mfu=0.3),
            dict(name="damcha/torch", ms_per_step=12.0, busy=0.97, tokens_per_s=800, mfu=0.2),
            dict(name="damcha/triton", ms_per_step=11.0, busy=0.85, tokens_per_s=900, mfu=0.2),
            dict(name="damcha/triton", error="RuntimeError")]
    bench.busy_targets(rows, "shipped", "default")
    row = json.loads(capsys.readouterr().out)
    assert (row["min_busy"], row["all_busy_90"], row["kernel_vs_torch_ms"], row["damcha_vs_mha_tokens"],
            row["mha_mfu"]) == (0.85, False, round(11 / 12, 3), 0.9, 0.3)
    bench.busy_targets(rows[:2], "shipped", "default")   # the kernel path failed: no ratio to it
    row = json.loads(capsys.readouterr().out)
    assert row["all_busy_90"] and row["kernel_vs_torch_ms"] is None and row["damcha_vs_mha_tokens"] == 0.8


def test_bench_checks_fail_on_one_wrong_gradient_and_keep_their_budget(capsys):
    """A check row is ok only if the output and every gradient are; a spent budget skips a row
    without running it."""
    from lab import bench_triton_gpu as bench
    wrong_dx = off_in_dx(torch_path, 1e-2)
    bench.checks(wrong_dx, [(1, 2, 20, 8)], [torch.float32], bench.Budget(60))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and not any(r["ok"] for r in rows) and all(r["err_triton"]["o"] < 1e-6 for r in rows)
    def never(x, m, v):
        raise AssertionError("a skipped row ran")
    bench.checks(never, [(1, 2, 20, 8)], [torch.float32], bench.Budget(-1))
    assert all(json.loads(line)["skipped"] == "time budget" for line in capsys.readouterr().out.splitlines())
    # in 16-bit the bar is the torch path's own error against float64: the kernel wrong in dx fails
    # it, and the torch path itself, scored as the kernel, has exactly its (non-zero) errors
    bench.checks(off_in_dx(torch_path, 5e-2), [(1, 2, 20, 8)], [torch.float16], bench.Budget(60))
    assert not any(json.loads(line)["ok"] for line in capsys.readouterr().out.splitlines())
    bench.checks(torch_path, [(1, 2, 20, 8)], [torch.float16], bench.Budget(60))
    for r in map(json.loads, capsys.readouterr().out.splitlines()):
        assert r["ok"] and r["err_triton"] == r["err_torch"] and min(r["err_torch"].values()) > 0
    assert bench.rel_err(torch.tensor([2.0]), torch.tensor([1.0])) == 1.0
    assert bench.rel_err(torch.tensor([9.0, 0.0]), torch.tensor([1.0, 2.0])) == 4.0   # max |a - b| / max |b|
    assert bench.last_rows_ok(dict(o=0.0, dx=0.0, dm=0.0))
    assert not any(bench.last_rows_ok(dict(dict(o=0.0, dx=0.0, dm=0.0), **{n: 1.0})) for n in ("o", "dx", "dm"))
    # each shape in every dtype before the next shape: a budget that runs out cuts shapes, not a dtype
    bench.checks(torch_path, [(1, 2, 8, 8), (1, 2, 7, 12)], [torch.float32, torch.float64], bench.Budget(60))
    order = [(r["dh"], r["dtype"]) for r in map(json.loads, capsys.readouterr().out.splitlines())]
    assert order == [(8, "float32")] * 2 + [(8, "float64")] * 2 + [(12, "float32")] * 2 + [(12, "float64")] * 2


@requires_cuda
def test_offsets_past_2_to_31_cuda():
    """T * H * dh^2 = 8192 * 24 * 128^2 > 2^31: the row offsets into m need 64 bits. The output,
    dm and dx of bench_triton_gpu's last-rows check (an output gradient on the last 16 positions)."""
    err = last_rows_errors(damcha_attention, 1, 24, 8192, 128, 16, torch.bfloat16)
    assert last_rows_ok(err), err


def test_bench_budgets_end_at_the_whole_checks_deadline(monkeypatch, capsys):
    """No section of bench_triton_gpu.py starts a row past --budget_total: a section's budget ends
    at the deadline if that comes first, a train row is not started with less than a row's time
    left, and the op rows time torch_compiled only after the plain rows of both dtypes."""
    from lab import bench_triton_gpu as bench
    now = time.time()
    assert bench.Budget(60, deadline=now - 1).over() and not bench.Budget(60).over()
    assert bench.Budget(60, deadline=now + 10).end <= now + 10 < bench.Budget(60, deadline=math.inf).end
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a train row started past the deadline"))
    bench.train_rows(["config/enwik8.py"], 30, False, bench.Budget(60, deadline=time.time() + bench.TRAIN_ROW_S - 5))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kernel"], r["skipped"]) for r in rows] == [("triton", "time budget"), ("torch", "time budget")]
    for budget_s, deadline_s in ((40, 300), (200, 110)):   # the section's budget short, or the deadline
        timeouts = []
        monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: timeouts.append(k["timeout"]) or
                            subprocess.CompletedProcess(a, 0, "", ""))
        bench.train_rows(["config/enwik8.py"], 30, False, bench.Budget(budget_s, deadline=time.time() + deadline_s))
        assert [json.loads(line)["rc"] for line in capsys.readouterr().out.splitlines()] == [0, 0]   # both rows ran
        assert len(timeouts) == 2 and all(t <= deadline_s for t in timeouts)                     # none past the deadline
    monkeypatch.setattr(bench, "DEVICE", "cuda")
    plan = bench.op_plan({"torch": 0, "torch_compiled": 0, "triton": 0}, [torch.bfloat16, torch.float32])
    assert plan == [("per_token", torch.bfloat16, ["torch", "triton"]), ("per_token", torch.float32, ["torch", "triton"]),
                    ("per_token", torch.bfloat16, ["torch_compiled"]),
                    ("static", torch.bfloat16, ["torch", "triton"]), ("static", torch.float32, ["torch", "triton"])]
