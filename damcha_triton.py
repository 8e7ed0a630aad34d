"""
damcha_triton.py: DAMCHA attention (the paper's Eqs. 5-7, as docs/model.md writes them) as fused
Triton kernels, with a hand-written flash-attention-2 style backward pass.

    o = damcha_attention(x, m, v)
    x  (B, H, T, dh)   the head slices x_i of the layer input u: the keys, and the queries' inputs
    m  (B, T, H, dh, dh) per-token metrics m_i[b, t], or (H, dh, dh) for a static metric
    v  (B, H, T, dh)   the values
    o  (B, H, T, dh)   = F.scaled_dot_product_attention(q, x, v, is_causal=True), q[b, h, t] = x[b, h, t] @ m[b, t, h]

The forward kernel forms each query q_t = x_t m_t from the tile of m it loads for its block of
positions, then runs causal attention with an online softmax: the (B, H, T, T) scores never reach
global memory; it keeps the row logsumexp, from which the backward recomputes the attention
probabilities block by block (Dao, "FlashAttention-2", 2023), and q (B, H, T, dh), 1/dh the size
of m, so that the backward reads m once only, where it forms dx. The backward kernels stop at dq;
the op's autograd formula forms dm = x^T dq in torch (as large as m for per-token metrics: an
elementwise product, which torch.compile can fuse into the sum over layers of a shared m).

Constraints (damcha_attention raises ValueError outside them): 1 <= dh <= 128, a power of two or
not (the kernels pad the feature axis to DH, the next power of two >= 16, as tl.dot needs K >= 16);
any T; x, m and v of one dtype, float32, bfloat16 or float16 (under torch.autocast they are cast
to its dtype); CUDA tensors, or CPU float32 or float16 tensors under Triton's interpreter, which
runs the same kernels in Python. The interpreter is chosen by TRITON_INTERPRET=1 in the environment
when this module is imported (tests/test_triton.py sets it itself when there is no GPU):
    python -m pytest -q tests/test_triton.py         # the checks: interpreter on a CPU, or the GPU
    python -m pytest -q tests/test_sm90_compile.py   # every kernel compiled for sm_90, no GPU needed
    python lab/bench_triton_gpu.py                   # correctness, speed and memory on a GPU
float32 products are IEEE float32 unless torch's float32 matmul precision allows TF32
(torch.backends.cuda.matmul.fp32_precision = "tf32", or the older allow_tf32); then they are TF32,
as torch's float32 matmuls are.

The op is a torch.library custom op (damcha::attention, with its backward damcha::attention_backward),
so torch.compile(fullgraph=True) traces a model through it without a graph break. Needs Triton >= 3.0
(tl.dot's input_precision), hence torch >= 2.4, the first release built with it.
"""
import contextlib
import math
import os

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)     # the kernels use exp2: exp(s) = exp2(s * log2(e))
MAX_DH = 128                  # beyond this the (BLOCK, DH) float32 tiles outgrow the registers
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")   # as Triton reads it
M_STAGES = 3                  # tiles of m in flight in the loops over its rows (software pipelining), by default
# the interpreter's one config: BLOCK and the forward's M_STAGES; DAMCHA_INTERPRETER_CONFIG=64,6 runs
# a GPU's tile on a CPU (tests/test_triton.py checks the GPU's block sizes so, at every precision)
INTERPRETER_CONFIG = tuple(int(n) for n in os.environ.get("DAMCHA_INTERPRETER_CONFIG", f"16,{M_STAGES}").split(","))


# ----------------------------------------------------------------------------------------------
# Autotuning. Each kernel tries a few tiles and warp counts per (dh, T, dtype) on its first launch
# and keeps the fastest. 16-bit tiles are larger: their dots run on the tensor cores and their
# tiles take half the registers. The float32 dots in IEEE mode run on the CUDA cores with about
# twice the registers: float32 is for checking, not speed. Their operands are held whole along dh,
# so in the backward's dq kernel only 16-row blocks over 8 warps fit the registers at dh = 64
# (none does at dh = 128). tests/test_sm90_compile.py compiles every config kept here for sm_90
# and checks that none spills registers in 16-bit and that every float32 kernel has one config that
# does not spill at dh = 64. The forward also tries M_STAGES = 6 tiles of m in flight instead of 3
# for per-token metrics: the loop that streams m then has more than twice the loads in flight per
# program (5 ahead, not 2) in the same registers and shared memory, since its buffers reuse those of
# the attention loop, which holds 6 such tiles (3 stages of a key and a value tile; the test checks
# that the resources match).
# Under the interpreter, one config, with blocks of 16 so that small tests cross several blocks
# (INTERPRETER_CONFIG), whatever the dtype.

def _configs(*options):
    """(BLOCK, num_warps, num_stages) or, for the forward, (BLOCK, num_warps, num_stages, M_STAGES)
    -> triton.Configs."""
    if INTERPRETED:
        block, m_stages = INTERPRETER_CONFIG
        options = [(block, 1, 1, m_stages)[:len(options[0])]]
    configs = []
    for block, warps, stages, *m_stages in options:
        meta = {"BLOCK": block}
        if m_stages:
            meta["M_STAGES"] = m_stages[0]
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    return configs


def _keep_for_dtype(configs, named_args, **kwargs):
    """The configs for x's dtype and the padded head size DH: BLOCK >= 64 for 16-bit, <= 32 for
    float32; at DH = 128 only the configs that fit the registers (BLOCK = 64 over 8 warps for
    16-bit, BLOCK = 16 for float32; ptxas spills the others, tests/test_sm90_compile.py). A
    static metric is not streamed: only the configs with the default M_STAGES. The interpreter's
    one config is kept, as it is there to check any tile at any precision."""
    if INTERPRETED:
        return configs
    wide = named_args["x_ptr"].dtype.itemsize == 4
    kept = [c for c in configs if (c.kwargs["BLOCK"] <= 32) == wide]
    if not kwargs.get("PER_TOKEN", True):
        kept = [c for c in kept if c.kwargs.get("M_STAGES", M_STAGES) == M_STAGES]
    if kwargs["DH"] == 128:
        kept = [c for c in kept if (c.kwargs["BLOCK"] == 16 if wide else c.kwargs["BLOCK"] == 64 and c.num_warps == 8)]
    return kept


def _autotune(*options, key=("dh", "T", "PRECISION")):
    # the choice is kept per key and per dtype of the tensor arguments: kernels that take both
    # kinds of metric add PER_TOKEN to their key, or a static launch would reuse the per-token
    # choice; PRECISION, as float32 with TF32 allowed runs other instructions than without
    return triton.autotune(configs=_configs(*options), key=list(key),
                           prune_configs_by={"early_config_prune": _keep_for_dtype})


# (BLOCK, num_warps, num_stages[, M_STAGES]): 16-bit first, then float32
FWD_CONFIGS = ((64, 4, 3, 3), (64, 4, 3, 6), (64, 8, 3, 3), (64, 8, 3, 6), (128, 8, 3, 3), (32, 8, 2, 3), (16, 4, 2, 3))
BWD_CONFIGS = ((64, 4, 3), (64, 8, 2), (32, 8, 2), (16, 4, 2), (16, 8, 2))


# ----------------------------------------------------------------------------------------------
# Building blocks shared by the kernels. Offsets are 64-bit: the row offsets into m reach
# T * H * dh^2, over 2^31 at T = 8192, D = 2048.

@triton.jit
def _load_rows(base, rows, cols, stride_t, stride_d, T, dh):
    # rows (R,) of a (T, dh) matrix at base -> (R, DH); positions >= T and features >= dh read 0,
    # so the zero padding adds nothing to any dot product below
    return tl.load(base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_d,
                   mask=(rows < T)[:, None] & (cols < dh)[None, :], other=0.0)


@triton.jit
def _store_rows(base, tile, rows, cols, stride_t, stride_d, T, dh):
    tl.store(base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_d,
             tile.to(base.dtype.element_ty), mask=(rows < T)[:, None] & (cols < dh)[None, :])


@triton.jit
def _program(H, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    # one program per (b * H + h, block of positions): b * H + h on grid axis 0, which CUDA allows
    # up to 2^31 - 1 (axes 1 and 2 stop at 65,535). Programs start in the order of axis 1; the
    # longest go first, so that the short ones fill in at the end: of the blocks of queries the
    # last (they meet every key before them), of the blocks of keys (KEYS) the first (every later
    # query meets them)
    bh = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1) if KEYS else tl.num_programs(1) - 1 - tl.program_id(1)
    return bh, bh // H, bh % H, block * BLOCK


@triton.jit
def _metric_row_pointers(m_base, rows, cols, stride_mt, stride_me, T, dh):
    # for the loops over the rows d of the per-token metrics: m_t[0, :] (BLOCK, DH) of each
    # position, which row d offsets by d * stride_md, and its mask
    return (m_base + rows.to(tl.int64)[:, None] * stride_mt + cols[None, :] * stride_me,
            (rows < T)[:, None] & (cols < dh)[None, :])


@triton.jit
def _metric_query(x_base, m_base, rows, cols, stride_xt, stride_xd, stride_mt, stride_md, stride_me,
                  T, dh, BLOCK: tl.constexpr, DH: tl.constexpr, PER_TOKEN: tl.constexpr, PRECISION: tl.constexpr,
                  M_STAGES: tl.constexpr):
    # Eq. 5, the query side: q_t = x_t @ m_t for the positions `rows` -> (BLOCK, DH) in float32
    if PER_TOKEN:
        # every position has its own (dh, dh) matrix: a batch of vector-matrix products, not a
        # matmul. Walk the rows d of m_t, q_t += x_t[d] m_t[d, :], M_STAGES loads ahead
        m_ptrs, mask = _metric_row_pointers(m_base, rows, cols, stride_mt, stride_me, T, dh)
        x_ptrs = x_base + rows.to(tl.int64) * stride_xt                                   # x_t[0] (BLOCK,)
        q = tl.zeros((BLOCK, DH), dtype=tl.float32)
        for d in tl.range(0, dh, num_stages=M_STAGES):
            x_d = tl.load(x_ptrs + d * stride_xd, mask=rows < T, other=0.0)                # (BLOCK,) x_t[d]
            m_d = tl.load(m_ptrs + d * stride_md, mask=mask, other=0.0)                    # (BLOCK, DH) m_t[d, :]
            q += x_d.to(tl.float32)[:, None] * m_d.to(tl.float32)
    else:
        # one (dh, dh) matrix for the head: one matmul
        x = _load_rows(x_base, rows, cols, stride_xt, stride_xd, T, dh)                      # (BLOCK, DH)
        m = _load_rows(m_base, cols, cols, stride_md, stride_me, dh, dh)                      # (DH, DH)
        q = tl.dot(x, m, input_precision=PRECISION)
    return q


# ----------------------------------------------------------------------------------------------
# Forward

@triton.jit
def _fwd_block(q, row_max, row_sum, acc, x_base, v_base, rows, start_n, cols, stride_xt, stride_xd,
               stride_vt, stride_vd, T, dh, qk_scale,
               BLOCK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # One key block of the online softmax: fold keys start_n .. start_n + BLOCK into the running
    # row maximum, row sum and unnormalised output of the query block.
    keys = start_n + tl.arange(0, BLOCK)
    k = _load_rows(x_base, keys, cols, stride_xt, stride_xd, T, dh)     # (BLOCK, DH): keys are x itself
    v = _load_rows(v_base, keys, cols, stride_vt, stride_vd, T, dh)     # (BLOCK, DH)
    # Eq. 5: S = q k^T / sqrt(dh), here in log2 units (qk_scale = log2(e) / sqrt(dh))   (BLOCK, BLOCK)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if CAUSAL:                       # only the diagonal block holds keys later than some query
        s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
    # Eq. 6 online: rescale what has been summed so far to the new maximum (Milakov & Gimelshein
    # 2018). Key 0 is in every row's first block, so the maximum is finite from the start.
    new_max = tl.maximum(row_max, tl.max(s, 1))
    p = tl.math.exp2(s - new_max[:, None])                             # (BLOCK, BLOCK)
    alpha = tl.math.exp2(row_max - new_max)                            # (BLOCK,)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)   # Eq. 7
    return new_max, row_sum, acc


@_autotune(*FWD_CONFIGS, key=("dh", "T", "PER_TOKEN", "PRECISION"))
@triton.jit
def _attn_fwd(x_ptr, m_ptr, v_ptr, o_ptr, lse_ptr, q_ptr,
              stride_xb, stride_xh, stride_xt, stride_xd,
              stride_mb, stride_mt, stride_mh, stride_md, stride_me,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_ob, stride_oh, stride_ot, stride_od,
              H, T, dh, qk_scale,
              BLOCK: tl.constexpr, DH: tl.constexpr, PER_TOKEN: tl.constexpr, PRECISION: tl.constexpr,
              M_STAGES: tl.constexpr):
    bh, b, h, start_m = _program(H, BLOCK, False)
    rows = start_m + tl.arange(0, BLOCK)
    x_base = x_ptr + b * stride_xb + h * stride_xh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    cols = tl.arange(0, DH)
    q = _metric_query(x_base, m_ptr + b * stride_mb + h * stride_mh, rows, cols, stride_xt, stride_xd,
                      stride_mt, stride_md, stride_me, T, dh, BLOCK, DH, PER_TOKEN, PRECISION,
                      M_STAGES).to(x_ptr.dtype.element_ty)
    # q, rounded as the dots below use it, for the backward: (B*H, T, dh) contiguous
    _store_rows(q_ptr + bh * T * dh, q, rows, cols, dh, 1, T, dh)
    row_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK, DH), dtype=tl.float32)
    # the key blocks strictly before the diagonal are visible to every query of the block: no mask
    for start_n in range(0, start_m, BLOCK):
        row_max, row_sum, acc = _fwd_block(q, row_max, row_sum, acc, x_base, v_base, rows, start_n, cols,
                                           stride_xt, stride_xd, stride_vt, stride_vd, T, dh, qk_scale,
                                           BLOCK, False, PRECISION)
    row_max, row_sum, acc = _fwd_block(q, row_max, row_sum, acc, x_base, v_base, rows, start_m, cols,
                                       stride_xt, stride_xd, stride_vt, stride_vd, T, dh, qk_scale,
                                       BLOCK, True, PRECISION)
    o = acc / row_sum[:, None]                                          # Eqs. 6-7: O = softmax(S) V
    _store_rows(o_ptr + b * stride_ob + h * stride_oh, o, rows, cols, stride_ot, stride_od, T, dh)
    # the row logsumexp in base 2, lse_t = log2 sum_s exp2(S_ts log2(e)), so that the backward
    # recomputes P = exp2(S log2(e) - lse). Rows past T were computed on zero padding: not stored.
    tl.store(lse_ptr + bh * T + rows, row_max + tl.math.log2(row_sum), mask=rows < T)


# ----------------------------------------------------------------------------------------------
# Backward. With P = softmax(S) (Eq. 6) and dO the output gradient, from O = P V (Eq. 7) and
# S = q k^T / sqrt(dh) (Eq. 5):
#   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) where delta_t = rowsum(dO_t * O_t) = sum_s P_ts dP_ts,
#   dq = dS k / sqrt(dh),  dk = dS^T q / sqrt(dh).
# Three kernels: _bwd_prep (delta), _bwd_dkdv (one program per key block, looping over the queries
# that see it), _bwd_dq (one program per query block, looping over its keys, then through q = x m
# to dx). dx collects two parts, x being both the keys and the queries' input. The kernels write
# dq, not dm: _backward forms dm = x^T dq in torch, where torch.compile can fuse it.

@triton.jit
def _bwd_prep(o_ptr, do_ptr, delta_ptr,
              stride_ob, stride_oh, stride_ot, stride_od,
              stride_dob, stride_doh, stride_dot, stride_dod,
              H, T, dh, BLOCK: tl.constexpr, DH: tl.constexpr):
    bh, b, h, start_m = _program(H, BLOCK, False)
    rows = start_m + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    o = _load_rows(o_ptr + b * stride_ob + h * stride_oh, rows, cols, stride_ot, stride_od, T, dh)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, rows, cols, stride_dot, stride_dod, T, dh)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)            # delta_t = rowsum(dO_t * O_t)
    tl.store(delta_ptr + bh * T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, keys, start_m, cols,
                    stride_dot, stride_dod, T, dh, qk_scale,
                    BLOCK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # the contributions of queries start_m .. start_m + BLOCK to this key block's dk and dv, worked
    # in transposed form (keys along rows) so that both land as (keys, DH) tiles
    rows = start_m + tl.arange(0, BLOCK)
    q = _load_rows(q_base, rows, cols, dh, 1, T, dh)                              # (BLOCK, DH)
    do = _load_rows(do_base, rows, cols, stride_dot, stride_dod, T, dh)           # (BLOCK, DH)
    lse = tl.load(lse_base + rows, mask=rows < T, other=float("inf"))             # padded queries: P = 0
    delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale           # S^T (keys, queries), log2 units
    if CAUSAL:
        s_t = tl.where(rows[None, :] >= keys[:, None], s_t, float("-inf"))
    p_t = tl.math.exp2(s_t - lse[None, :])                                        # P^T, recomputed
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)                 # Eq. 7, O = P V    -> dV = P^T dO
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                     # Eq. 7, O = P V    -> dP^T = V dO^T
    ds_t = p_t * (dp_t - delta[None, :])                                          # Eq. 6, P = softmax(S) -> dS
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)                  # Eq. 5, S = q k^T  -> dk = dS^T q
    return dk, dv


@_autotune(*BWD_CONFIGS)
@triton.jit
def _bwd_dkdv(x_ptr, v_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
              stride_xb, stride_xh, stride_xt, stride_xd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_dob, stride_doh, stride_dot, stride_dod,
              stride_dkb, stride_dkh, stride_dkt, stride_dkd,
              stride_dvb, stride_dvh, stride_dvt, stride_dvd,
              H, T, dh, sm_scale, qk_scale,
              BLOCK: tl.constexpr, DH: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, start_n = _program(H, BLOCK, True)                     # a block of keys
    keys = start_n + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    k = _load_rows(x_ptr + b * stride_xb + h * stride_xh, keys, cols, stride_xt, stride_xd, T, dh)
    v = _load_rows(v_ptr + b * stride_vb + h * stride_vh, keys, cols, stride_vt, stride_vd, T, dh)
    dk = tl.zeros((BLOCK, DH), dtype=tl.float32)
    dv = tl.zeros((BLOCK, DH), dtype=tl.float32)
    q_base = q_ptr + bh * T * dh
    do_base = do_ptr + b * stride_dob + h * stride_doh
    # causality: only queries t >= start_n see these keys; the diagonal block needs the mask
    dk, dv = _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr + bh * T, delta_ptr + bh * T, keys, start_n,
                             cols, stride_dot, stride_dod, T, dh, qk_scale, BLOCK, True, PRECISION)
    for start_m in range(start_n + BLOCK, T, BLOCK):
        dk, dv = _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr + bh * T, delta_ptr + bh * T, keys,
                                 start_m, cols, stride_dot, stride_dod, T, dh, qk_scale, BLOCK, False, PRECISION)
    # the 1/sqrt(dh) of S, applied once; dk is the key side of dx, to which _bwd_dq adds the query side
    _store_rows(dk_ptr + b * stride_dkb + h * stride_dkh, dk * sm_scale, keys, cols, stride_dkt, stride_dkd, T, dh)
    _store_rows(dv_ptr + b * stride_dvb + h * stride_dvh, dv, keys, cols, stride_dvt, stride_dvd, T, dh)


@triton.jit
def _bwd_dq_block(dq, q, do, lse, delta, x_base, v_base, rows, start_n, cols,
                  stride_xt, stride_xd, stride_vt, stride_vd, T, dh, qk_scale,
                  BLOCK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    keys = start_n + tl.arange(0, BLOCK)
    k = _load_rows(x_base, keys, cols, stride_xt, stride_xd, T, dh)             # (BLOCK, DH)
    v = _load_rows(v_base, keys, cols, stride_vt, stride_vd, T, dh)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale            # S, log2 units
    if CAUSAL:
        s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
    p = tl.math.exp2(s - lse[:, None])                                          # P, recomputed
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                     # Eq. 7, O = P V    -> dP = dO V^T
    ds = p * (dp - delta[:, None])                                              # Eq. 6, P = softmax(S) -> dS
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)                  # Eq. 5, S = q k^T  -> dq = dS k
    return dq


@_autotune(*BWD_CONFIGS, key=("dh", "T", "PER_TOKEN", "PRECISION"))
@triton.jit
def _bwd_dq(x_ptr, m_ptr, v_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dx_ptr, dq_ptr,
            stride_xb, stride_xh, stride_xt, stride_xd,
            stride_mb, stride_mt, stride_mh, stride_md, stride_me,
            stride_vb, stride_vh, stride_vt, stride_vd,
            stride_dob, stride_doh, stride_dot, stride_dod,
            stride_dkb, stride_dkh, stride_dkt, stride_dkd,
            stride_dxb, stride_dxh, stride_dxt, stride_dxd,
            stride_dqb, stride_dqh, stride_dqt, stride_dqd,
            H, T, dh, sm_scale, qk_scale,
            BLOCK: tl.constexpr, DH: tl.constexpr, PER_TOKEN: tl.constexpr, PRECISION: tl.constexpr,
            M_STAGES: tl.constexpr):
    bh, b, h, start_m = _program(H, BLOCK, False)                    # a block of queries
    rows = start_m + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    x_base = x_ptr + b * stride_xb + h * stride_xh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    q = _load_rows(q_ptr + bh * T * dh, rows, cols, dh, 1, T, dh)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, rows, cols, stride_dot, stride_dod, T, dh)
    lse = tl.load(lse_ptr + bh * T + rows, mask=rows < T, other=float("inf"))
    delta = tl.load(delta_ptr + bh * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros((BLOCK, DH), dtype=tl.float32)
    for start_n in range(0, start_m, BLOCK):
        dq = _bwd_dq_block(dq, q, do, lse, delta, x_base, v_base, rows, start_n, cols, stride_xt, stride_xd,
                           stride_vt, stride_vd, T, dh, qk_scale, BLOCK, False, PRECISION)
    dq = _bwd_dq_block(dq, q, do, lse, delta, x_base, v_base, rows, start_m, cols, stride_xt, stride_xd,
                       stride_vt, stride_vd, T, dh, qk_scale, BLOCK, True, PRECISION)
    dq = dq * sm_scale                                          # (BLOCK, DH), with the 1/sqrt(dh) of S
    # Eq. 5, q_t = x_t m_t. dq is stored for _backward, which forms dm_t = x_t^T dq_t from it
    _store_rows(dq_ptr + b * stride_dqb + h * stride_dqh, dq, rows, cols, stride_dqt, stride_dqd, T, dh)
    # and dx_t = dq_t m_t^T, the query side of dx
    m_base = m_ptr + b * stride_mb + h * stride_mh
    if PER_TOKEN:
        # row by row of m_t, M_STAGES loads ahead: dx_t[d] = sum_e dq_t[e] m_t[d, e]
        m_ptrs, mask = _metric_row_pointers(m_base, rows, cols, stride_mt, stride_me, T, dh)
        dx_query = tl.zeros((BLOCK, DH), dtype=tl.float32)
        for d in tl.range(0, dh, num_stages=M_STAGES):
            m_d = tl.load(m_ptrs + d * stride_md, mask=mask, other=0.0).to(tl.float32)    # (BLOCK, DH) m_t[d, :]
            dx_query = tl.where(cols[None, :] == d, tl.sum(dq * m_d, 1)[:, None], dx_query)
    else:
        # one matrix per head: dx = dq m^T is one matmul (dq rounded to the inputs' dtype, as torch's
        # 16-bit path rounds it: a 16-bit tensor-core dot)
        m = _load_rows(m_base, cols, cols, stride_md, stride_me, dh, dh)                      # (DH, DH)
        dx_query = tl.dot(dq.to(m.dtype), tl.trans(m), input_precision=PRECISION)
    # x is the keys and the queries' input: dx = dk (from _bwd_dkdv) + dq m^T
    dk = _load_rows(dk_ptr + b * stride_dkb + h * stride_dkh, rows, cols, stride_dkt, stride_dkd, T, dh)
    _store_rows(dx_ptr + b * stride_dxb + h * stride_dxh, dk + dx_query, rows, cols, stride_dxt, stride_dxd, T, dh)


# ----------------------------------------------------------------------------------------------
# The op

PREP_BLOCK = 16 if INTERPRETED else 64


def _options(x):
    """The kernels' shared constants for x (B, H, T, dh): DH, the feature axis padded to a power of
    two >= 16 (tl.dot's smallest K), and the precision of float32 dots."""
    return dict(DH=max(16, triton.next_power_of_2(x.shape[-1])), PRECISION=_precision(x.dtype))


def _grid(x):
    B, H, T, dh = x.shape
    return lambda meta: (B * H, triton.cdiv(T, meta["BLOCK"]))


def tf32_matmuls():
    """Whether CUDA's float32 matmuls may run in TF32 (torch.set_float32_matmul_precision("high")).
    Where torch has fp32_precision, "none" defers to the setting for all backends, and reading the
    legacy allow_tf32 raises once fp32_precision has been set."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return matmul.allow_tf32
    precision = matmul.fp32_precision
    return (torch.backends.fp32_precision if precision == "none" else precision) == "tf32"


def _precision(dtype):
    """"ieee" or "tf32" for float32 dots, following torch's setting for float32 matmuls on CUDA."""
    return "tf32" if dtype == torch.float32 and tf32_matmuls() else "ieee"   # 16-bit dots ignore it


def _metric_strides(m):
    """m's strides over (b, t, h, d, e); a static (H, dh, dh) metric is a per-token one whose
    strides over b and t are 0."""
    return tuple(m.stride()) if m.dim() == 5 else (0, 0, *m.stride())


def _heads_like(x, dtype):
    """An empty (B, H, T, dh) tensor laid out as (B, T, H, dh), as the model's heads are."""
    B, H, T, dh = x.shape
    return torch.empty(B, T, H, dh, device=x.device, dtype=dtype).transpose(1, 2)


def _on_device(x):
    """Launch on x's GPU, whichever is current (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _forward_plan(x, m, v):
    """The forward's outputs (o, lse, q), allocated, and its kernel launches as a list of
    (kernel, grid, args, constants); tests/test_sm90_compile.py compiles these very launches."""
    B, H, T, dh = x.shape
    o, lse, q = _attention_fake(x, m, v)
    launches = [(_attn_fwd, _grid(x), (x, m, v, o, lse, q, *x.stride(), *_metric_strides(m), *v.stride(), *o.stride(),
                                       H, T, dh, LOG2E / math.sqrt(dh)), dict(PER_TOKEN=m.dim() == 5, **_options(x)))]
    return (o, lse, q), launches


def _backward_plan(do, x, m, v, o, lse, q):
    """The backward's outputs (dx, dq, dv) and its scratch, allocated, and its kernel launches."""
    B, H, T, dh = x.shape
    options = _options(x)
    sm_scale = 1.0 / math.sqrt(dh)
    dx, dq, dv = _attention_backward_fake(do, x, m, v, o, lse, q)
    delta = torch.empty(B, H, T, device=x.device, dtype=torch.float32)
    dk = _heads_like(x, torch.float32)    # float32: the two parts of dx are added before rounding
    launches = [
        # delta_t = rowsum(dO_t * O_t)
        (_bwd_prep, (B * H, triton.cdiv(T, PREP_BLOCK)), (o, do, delta, *o.stride(), *do.stride(), H, T, dh),
         dict(BLOCK=PREP_BLOCK, DH=options["DH"])),
        # O = P V and P = softmax(q x^T / sqrt(dh)), from the side of the keys x: dv, and dk
        (_bwd_dkdv, _grid(x), (x, v, q, do, lse, delta, dk, dv, *x.stride(), *v.stride(), *do.stride(), *dk.stride(),
                               *dv.stride(), H, T, dh, sm_scale, sm_scale * LOG2E), options),
        # the same, from the side of the queries: dq; then q = x m: dx = dk + dq m^T
        (_bwd_dq, _grid(x), (x, m, v, q, do, lse, delta, dk, dx, dq, *x.stride(), *_metric_strides(m),
                             *v.stride(), *do.stride(), *dk.stride(), *dx.stride(), *dq.stride(),
                             H, T, dh, sm_scale, sm_scale * LOG2E),
         dict(PER_TOKEN=m.dim() == 5, M_STAGES=M_STAGES, **options)),
    ]
    return (dx, dq, dv), launches


def _launch(launches, x):
    with _on_device(x):
        for kernel, grid, args, constants in launches:
            kernel[grid](*args, **constants)


@torch.library.custom_op("damcha::attention", mutates_args=())
def _attention(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> o (B, H, T, dh), the row logsumexp lse (B, H, T) in base 2, and q = x m (B, H, T, dh)."""
    outputs, launches = _forward_plan(x, m, v)
    _launch(launches, x)
    return outputs


@_attention.register_fake
def _attention_fake(x, m, v):
    B, H, T, dh = x.shape
    lse = torch.empty(B, H, T, device=x.device, dtype=torch.float32)
    return _heads_like(x, x.dtype), lse, torch.empty(B, H, T, dh, device=x.device, dtype=x.dtype)


@torch.library.custom_op("damcha::attention_backward", mutates_args=())
def _attention_backward(do: torch.Tensor, x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx, dq, dv for the output gradient do: the gradients for x and v, and for the queries
    q = x m, from which _backward forms m's."""
    outputs, launches = _backward_plan(do, x, m, v, o, lse, q)
    _launch(launches, x)
    return outputs


@_attention_backward.register_fake
def _attention_backward_fake(do, x, m, v, o, lse, q):
    # dq in x's dtype, as torch's 16-bit path has it, and laid out as x, so that dm below comes out
    # in m's layout; nothing of m's size
    return _heads_like(x, x.dtype), _heads_like(x, x.dtype), _heads_like(v, v.dtype)


def _setup_context(ctx, inputs, output):
    x, m, v = inputs
    o, lse, q = output
    ctx.save_for_backward(x, m, v, o, lse, q)
    ctx.mark_non_differentiable(lse, q)


def _backward(ctx, do, dlse, dq_output):
    x, m = ctx.saved_tensors[:2]
    dx, dq, dv = _attention_backward(do, *ctx.saved_tensors)
    # Eq. 5, q_t = x_t m_t -> dm_t = x_t^T dq_t, here in torch rather than in the opaque op, so that
    # torch.compile sees it. With a shared m every layer adds such a dm to m's gradient; for
    # per-token metrics it is as large as m. As an elementwise product (an outer product per
    # position and head, as damcha_torch.MetricQuery writes it) inductor can fuse the L layers' dm
    # into their sum and store none of them; as outputs of the op they may all stay alive until
    # the sum (results/gpu/)
    x, dq = x.transpose(1, 2), dq.transpose(1, 2)                     # (B, T, H, dh), as m's axes
    if m.dim() == 5:
        dm = x.unsqueeze(-1) * dq.unsqueeze(-2)                       # (B, T, H, dh, dh)
    else:
        dm = torch.einsum("bthd,bthe->hde", x, dq)                    # (H, dh, dh), summed over b, t: one matmul
    return dx, dm, dv


_attention.register_autograd(_backward, setup_context=_setup_context)


def damcha_attention(x, m, v):
    """DAMCHA causal attention, Eqs. 5-7. x, v (B, H, T, dh); m (B, T, H, dh, dh) or (H, dh, dh)
    -> o (B, H, T, dh), laid out as (B, T, H, dh) in memory so that o.transpose(1, 2) is
    contiguous. Any strides are accepted; a unit stride along dh makes the loads coalesce."""
    if x.dim() != 4 or v.shape != x.shape:
        raise ValueError(f"x and v must both be (B, H, T, dh), got {tuple(x.shape)} and {tuple(v.shape)}")
    B, H, T, dh = x.shape
    if tuple(m.shape) not in ((B, T, H, dh, dh), (H, dh, dh)):
        raise ValueError(f"m must be (B, T, H, dh, dh) = {(B, T, H, dh, dh)} or (H, dh, dh) = {(H, dh, dh)}, "
                         f"got {tuple(m.shape)}")
    if dh > MAX_DH:
        raise ValueError(f"head size dh = {dh} is above the kernels' limit of {MAX_DH}")
    if not (x.device == m.device == v.device):
        raise ValueError(f"x, m and v must be on one device, got {x.device}, {m.device} and {v.device}")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, m, v = x.to(dtype), m.to(dtype), v.to(dtype)
    if not (x.dtype == m.dtype == v.dtype):
        raise ValueError(f"x, m and v must have one dtype, got {x.dtype}, {m.dtype} and {v.dtype}")
    if x.device.type == "cuda":
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"on CUDA the kernels take float32, bfloat16 or float16, not {x.dtype}")
    elif not INTERPRETED:
        raise ValueError(f"tensors on {x.device} need Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before importing triton")
    elif x.dtype not in (torch.float32, torch.float16):   # its bfloat16 dots come out wrong
        raise ValueError(f"Triton's interpreter runs the kernels in float32 or float16, not {x.dtype}")
    return _attention(x, m, v)[0]
