"""
tests/test_kernel_sm90.py: every Triton kernel of damcha_triton.py compiled for an H100 / H200
(sm_90) on a machine without a GPU, and the resources ptxas gave each one.

Run: python -m pytest -q -s tests/test_kernel_sm90.py        (-s prints the table)
     DAMCHA_SM90_FULL=1 python -m pytest -q -s tests/test_kernel_sm90.py    the full matrix
     python tests/test_kernel_sm90.py [--full] [--part=K/N]    the table alone (its K-th of N parts),
                                                                one JSON line a row

How: Triton compiles for whatever target its active driver names. A stand-in driver whose target is
GPUTarget("cuda", 90, 32) makes kernel.warmup(...) run the whole pipeline (Triton IR, PTX, and
ptxas to a cubin) with no GPU and no CUDA driver; Triton's bundled cuobjdump -res-usage then reads
the registers and the stack frame of each cubin (a spill lands in the stack frame, so 0 bytes of
stack means no spills), and the kernel's metadata its shared memory. The launches compiled are the
op's own (damcha_triton._forward_plan and _backward_plan on meta tensors at B = 2, T = 1024,
H = 12: same strides, hence the same specialisation), for every autotuning config the op may pick.

The matrix: every kernel (the forward and _bwd_dq for per-token and static metrics, _bwd_prep,
_bwd_dkdv), each dh in {16, 32, 64, 128} once in 16-bit: bfloat16 at 16, 64 and 128, float16 at
32 (float16 compiles to the same code as bfloat16 bar the conversions, and keeps the same
configs); and float32 at dh = 64 (float32 may spill in some configs, but at dh = 64 every kernel
must have one config that does not). DAMCHA_SM90_FULL=1 compiles every dtype at every dh. The
compiles run in a child process: pytest's process may already have chosen Triton's interpreter
(tests/test_kernel.py does), and the stand-in driver must not leak into other tests; two
children, each compiling every other (dtype, dh) pair, use both cores of a CI machine. Skipped
only when Triton's ptxas or cuobjdump is missing.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DHS = (16, 32, 64, 128)
B, T, H = 2, 1024, 12                                  # the model's layout; B only sets strides


def matrix(full):
    """(dtype name, dh) pairs to compile."""
    if full:
        return [(dtype, dh) for dtype in ("bfloat16", "float16", "float32") for dh in DHS]
    return [("bfloat16", 16), ("bfloat16", 64), ("bfloat16", 128), ("float16", 32), ("float32", 64)]


def compile_rows(full, part=0, parts=1):
    """Compile every kernel launch of the op for sm_90, for the part-th of every `parts` (dtype, dh)
    pairs; yield one dict per compiled kernel."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import MockTensor

    class Sm90(DriverBase):
        """Only what compiling needs: a target, a device and stream number. Launches would fail."""
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_benchmarker(self):
            raise RuntimeError("the stand-in sm_90 driver compiles only")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    triton.runtime.driver.set_active(Sm90())
    import damcha_triton
    cuobjdump = triton.knobs.nvidia.cuobjdump.path

    def resources(cubin):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}

    for dtype_name, dh in matrix(full)[part::parts]:
        dtype = getattr(torch, dtype_name)
        for metric in ("per_token", "static"):
            meta = dict(device="meta", dtype=dtype)
            x = torch.empty(B, T, H, dh, **meta).transpose(1, 2)          # (B, H, T, dh) as the model's
            m = torch.empty(B, T, H, dh, dh, **meta) if metric == "per_token" else torch.empty(H, dh, dh, **meta)
            (o, lse, q), launches = damcha_triton._forward_plan(x, m, x)
            launches += damcha_triton._backward_plan(o, x, m, x, o, lse, q)[1]
            for kernel, _, args, constants in launches:
                name = kernel.fn.__name__ if isinstance(kernel, Autotuner) else kernel.__name__
                if metric == "static" and "PER_TOKEN" not in constants:
                    continue                                             # the same kernel as per_token's
                args = [MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
                if isinstance(kernel, Autotuner):
                    nargs = dict(zip(kernel.arg_names, args))
                    configs = [c.all_kwargs() for c in damcha_triton._keep_for_dtype(kernel.configs, nargs, **constants)]
                    kernel = kernel.fn
                else:
                    configs = [{}]
                for config in configs:
                    start = time.perf_counter()
                    compiled = kernel.warmup(*args, grid=(1,), **constants, **config)
                    seconds = time.perf_counter() - start
                    yield dict(kernel=name + (f"/{metric}" if "PER_TOKEN" in constants else ""), dtype=dtype_name,
                               dh=dh, block=config.get("BLOCK", constants.get("BLOCK")),
                               warps=compiled.metadata.num_warps, stages=compiled.metadata.num_stages,
                               m_stages=config.get("M_STAGES", constants.get("M_STAGES")),
                               **resources(compiled.asm["cubin"]), smem=compiled.metadata.shared,
                               compile_s=round(seconds, 2))


def tools_missing():
    """Why Triton's ptxas or cuobjdump cannot be found, or None."""
    try:
        import triton
        for tool in (triton.knobs.nvidia.ptxas, triton.knobs.nvidia.cuobjdump):
            if not os.access(tool.path, os.X_OK):
                return f"{tool.path} is not executable"
    except Exception as e:            # the knob raises when the binary is nowhere to be found
        return f"Triton's ptxas / cuobjdump not found: {e}"
    return None


def table(rows):
    head = f"{'kernel':<20} {'dtype':<9} {'dh':>4} {'BLOCK':>5} {'warps':>5} {'stages':>6} {'m_stages':>8} {'regs':>5} " \
           f"{'spill B':>7} {'smem B':>7} {'compile s':>9}"
    lines = [head] + [f"{r['kernel']:<20} {r['dtype']:<9} {r['dh']:>4} {r['block']:>5} {r['warps']:>5} "
                      f"{r['stages']:>6} {r['m_stages'] or '-':>8} {r['reg']:>5} {r['stack'] + r['local']:>7} {r['smem']:>7} {r['compile_s']:>9}"
                      for r in rows]
    return "\n".join(lines)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_and_fits_the_registers(tmp_path):
    reason = tools_missing()
    if reason:
        pytest.skip(reason)
    full = os.environ.get("DAMCHA_SM90_FULL") == "1"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)                     # compile from scratch, every time
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")              # Triton's default, said so: no warning about it
    start = time.perf_counter()
    children = [subprocess.Popen([sys.executable, __file__, f"--part={k}/2"] + (["--full"] if full else []), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    rows = []
    for child in children:
        out, err = child.communicate(timeout=900)
        assert child.returncode == 0, err[-3000:]
        rows += [json.loads(line) for line in out.splitlines()]
    rows.sort(key=lambda r: matrix(full).index((r["dtype"], r["dh"])))   # the table in the matrix's order
    print(f"\n{table(rows)}\n{len(rows)} kernels compiled for sm_90 in {time.perf_counter() - start:.0f} s")
    want = {(dtype, dh) for dtype, dh in matrix(full)}
    assert {(r["dtype"], r["dh"]) for r in rows} == want
    kernels = {"_attn_fwd/per_token", "_attn_fwd/static", "_bwd_prep", "_bwd_dkdv", "_bwd_dq/per_token", "_bwd_dq/static"}
    for pair in want:
        assert {r["kernel"] for r in rows if (r["dtype"], r["dh"]) == pair} == kernels, pair
    for r in rows:
        assert r["reg"] > 0 and r["smem"] <= 227 * 1024, r              # sm_90: 227 KiB of shared memory a block
        if r["dtype"] != "float32":
            assert r["stack"] == 0 and r["local"] == 0, f"register spills: {r}"
    # the forward's deeper pipeline over m (M_STAGES 6) costs no more registers or shared memory
    deep = [r for r in rows if r["kernel"] == "_attn_fwd/per_token" and r["m_stages"] == 6]
    assert deep
    for r in deep:
        twin = next(t for t in rows if t["m_stages"] == 3 and all(t[k] == r[k] for k in
                    ("kernel", "dtype", "dh", "block", "warps", "stages")))
        assert (r["reg"], r["smem"]) == (twin["reg"], twin["smem"]), (r, twin)
    # float32 may spill in some configs, and autotuning keeps whichever runs fastest, spilling or
    # not; but at the model's dh = 64 each kernel must have a config that does not spill
    for kernel in kernels:
        fp32 = [r for r in rows if r["kernel"] == kernel and (r["dtype"], r["dh"]) == ("float32", 64)]
        assert any(r["stack"] == 0 and r["local"] == 0 for r in fp32), f"every float32 config spills: {fp32}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    part, parts = next((a.removeprefix("--part=") for a in sys.argv[1:] if a.startswith("--part=")), "0/1").split("/")
    for row in compile_rows("--full" in sys.argv[1:], int(part), int(parts)):
        print(json.dumps(row), flush=True)
