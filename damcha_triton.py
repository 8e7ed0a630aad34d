"""
damcha_triton.py: DAMCHA attention (Eqs. 5-7 of docs/model.md) as fused Triton kernels, with a
hand-written flash-attention-2 style backward pass.

    o = damcha_attention(x, m, v)
    x  (B, H, T, dh)   the head slices x_i of the layer input u: the keys, and the queries' inputs
    m  (B, T, H, dh, dh) per-token metrics m_i[b, t], or (H, dh, dh) for a static metric
    v  (B, H, T, dh)   the values
    o  (B, H, T, dh)   = F.scaled_dot_product_attention(q, x, v, is_causal=True), q[b, h, t] = x[b, h, t] @ m

The forward kernel forms each query q_t = x_t m_t from the tile of m it loads for its block of
positions, then runs causal attention with an online softmax: neither q nor the (B, H, T, T) scores
ever reach global memory; it keeps the row logsumexp, from which the backward recomputes the
attention probabilities block by block (Dao, "FlashAttention-2", 2023). The backward recomputes q
once into a (B, H, T, dh) buffer and writes dm, as large as m for per-token metrics.

Constraints (damcha_attention raises ValueError outside them): 1 <= dh <= 128, a power of two or
not (the kernels pad the feature axis to DH, the next power of two >= 16, as tl.dot needs K >= 16);
any T; x, m and v of one dtype, float32, bfloat16 or float16 (under torch.autocast they are cast
to its dtype); CUDA tensors, or CPU float32 tensors under Triton's interpreter, which runs the
same kernels in Python. The interpreter is chosen by TRITON_INTERPRET=1 in the environment when
this module is imported (tests/test_triton.py sets it itself when there is no GPU):
    python -m pytest -q tests/test_triton.py         # the checks: interpreter on a CPU, or the GPU
    python bench_triton_gpu.py                       # correctness, speed and memory on a GPU
float32 products are IEEE float32 unless torch.backends.cuda.matmul.allow_tf32 is set; then they
are TF32, as torch's float32 matmuls are.
"""
import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)     # the kernels use exp2: exp(s) = exp2(s * log2(e))
MAX_DH = 128                  # beyond this the (BLOCK, DH) float32 tiles outgrow the registers


# ----------------------------------------------------------------------------------------------
# Building blocks shared by the kernels

@triton.jit
def _load_rows(base, rows, cols, stride_t, stride_d, T, dh):
    # rows (R,) of a (T, dh) matrix at base -> (R, DH); positions >= T and features >= dh read 0,
    # so the zero padding adds nothing to any dot product below
    return tl.load(base + rows[:, None] * stride_t + cols[None, :] * stride_d,
                   mask=(rows < T)[:, None] & (cols < dh)[None, :], other=0.0)


@triton.jit
def _store_rows(base, tile, rows, cols, stride_t, stride_d, T, dh):
    tl.store(base + rows[:, None] * stride_t + cols[None, :] * stride_d, tile.to(base.dtype.element_ty),
             mask=(rows < T)[:, None] & (cols < dh)[None, :])


@triton.jit
def _metric_query(x_base, m_base, rows, cols, stride_xt, stride_xd, stride_mt, stride_md, stride_me,
                  T, dh, BLOCK: tl.constexpr, DH: tl.constexpr):
    # Eq. 5, the query side: q_t = x_t @ m_t for the positions `rows` -> (BLOCK, DH) in float32.
    # Every position has its own (dh, dh) matrix, so this is a batch of vector-matrix products,
    # not a matmul: it walks the rows d of m_t, q_t += x_t[d] m_t[d, :]. A static metric is the
    # same loop with m's strides over b and t set to 0.
    q = tl.zeros((BLOCK, DH), dtype=tl.float32)
    for d in range(dh):
        x_d = tl.load(x_base + rows * stride_xt + d * stride_xd, mask=rows < T, other=0.0)   # (BLOCK,) x_t[d]
        m_d = _load_rows(m_base + d * stride_md, rows, cols, stride_mt, stride_me, T, dh)     # (BLOCK, DH) m_t[d, :]
        q += x_d.to(tl.float32)[:, None] * m_d.to(tl.float32)
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


@triton.jit
def _attn_fwd(x_ptr, m_ptr, v_ptr, o_ptr, lse_ptr,
              stride_xb, stride_xh, stride_xt, stride_xd,
              stride_mb, stride_mt, stride_mh, stride_md, stride_me,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_ob, stride_oh, stride_ot, stride_od,
              H, T, dh, qk_scale,
              BLOCK: tl.constexpr, DH: tl.constexpr, PRECISION: tl.constexpr):
    # one program per (query block, b * H + h)
    start_m = tl.program_id(0) * BLOCK
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    x_base = x_ptr + b * stride_xb + h * stride_xh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    rows = start_m + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    q = _metric_query(x_base, m_ptr + b * stride_mb + h * stride_mh, rows, cols, stride_xt, stride_xd,
                      stride_mt, stride_md, stride_me, T, dh, BLOCK, DH).to(x_ptr.dtype.element_ty)
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
# Backward. With P = softmax(S) and dO the output gradient, from O = P V and S = q k^T / sqrt(dh):
#   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) where D_t = rowsum(dO_t * O_t) = sum_s P_ts dP_ts,
#   dq = dS k / sqrt(dh),  dk = dS^T q / sqrt(dh).
# Three kernels: _bwd_prep (q and D once), _bwd_dkdv (one program per key block, looping over the
# queries that see it), _bwd_dq (one program per query block, looping over its keys, then through
# q = x m to dx and dm). dx collects two parts, x being both the keys and the queries' input.

@triton.jit
def _bwd_prep(x_ptr, m_ptr, o_ptr, do_ptr, q_ptr, delta_ptr,
              stride_xb, stride_xh, stride_xt, stride_xd,
              stride_mb, stride_mt, stride_mh, stride_md, stride_me,
              stride_ob, stride_oh, stride_ot, stride_od,
              stride_dob, stride_doh, stride_dot, stride_dod,
              H, T, dh, BLOCK: tl.constexpr, DH: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = start_m + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    # q = x m once for the whole backward, into a (B*H, T, DH) buffer in x's dtype, rounded as the
    # forward rounded it: _bwd_dkdv needs every query block for each key block, and recomputing q
    # there would reread m (dh times the size of x) once per key block
    q = _metric_query(x_ptr + b * stride_xb + h * stride_xh, m_ptr + b * stride_mb + h * stride_mh, rows, cols,
                      stride_xt, stride_xd, stride_mt, stride_md, stride_me, T, dh, BLOCK, DH)
    _store_rows(q_ptr + bh * T * DH, q, rows, cols, DH, 1, T, DH)
    o = _load_rows(o_ptr + b * stride_ob + h * stride_oh, rows, cols, stride_ot, stride_od, T, dh)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, rows, cols, stride_dot, stride_dod, T, dh)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)            # D_t = rowsum(dO_t * O_t)
    tl.store(delta_ptr + bh * T + rows, delta, mask=rows < T)


@triton.jit
def _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, keys, start_m, cols,
                    stride_dot, stride_dod, T, dh, qk_scale,
                    BLOCK: tl.constexpr, DH: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # the contributions of queries start_m .. start_m + BLOCK to this key block's dk and dv, worked
    # in transposed form (keys along rows) so that both land as (keys, DH) tiles
    rows = start_m + tl.arange(0, BLOCK)
    q = _load_rows(q_base, rows, cols, DH, 1, T, DH)                              # (BLOCK, DH)
    do = _load_rows(do_base, rows, cols, stride_dot, stride_dod, T, dh)           # (BLOCK, DH)
    lse = tl.load(lse_base + rows, mask=rows < T, other=float("inf"))             # padded queries: P = 0
    delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale           # S^T (keys, queries), log2 units
    if CAUSAL:
        s_t = tl.where(rows[None, :] >= keys[:, None], s_t, float("-inf"))
    p_t = tl.math.exp2(s_t - lse[None, :])                                        # P^T, recomputed
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)                 # O = P V    -> dV = P^T dO
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                     # O = P V    -> dP^T = V dO^T
    ds_t = p_t * (dp_t - delta[None, :])                                          # P = softmax(S) -> dS
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)                  # S = q k^T  -> dk = dS^T q
    return dk, dv


@triton.jit
def _bwd_dkdv(x_ptr, v_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, dx_ptr, dv_ptr,
              stride_xb, stride_xh, stride_xt, stride_xd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_dob, stride_doh, stride_dot, stride_dod,
              stride_dxb, stride_dxh, stride_dxt, stride_dxd,
              stride_dvb, stride_dvh, stride_dvt, stride_dvd,
              H, T, dh, sm_scale, qk_scale,
              BLOCK: tl.constexpr, DH: tl.constexpr, PRECISION: tl.constexpr):
    # one program per (key block, b * H + h)
    start_n = tl.program_id(0) * BLOCK
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    keys = start_n + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    k = _load_rows(x_ptr + b * stride_xb + h * stride_xh, keys, cols, stride_xt, stride_xd, T, dh)
    v = _load_rows(v_ptr + b * stride_vb + h * stride_vh, keys, cols, stride_vt, stride_vd, T, dh)
    dk = tl.zeros((BLOCK, DH), dtype=tl.float32)
    dv = tl.zeros((BLOCK, DH), dtype=tl.float32)
    q_base = q_ptr + bh * T * DH
    do_base = do_ptr + b * stride_dob + h * stride_doh
    # causality: only queries t >= start_n see these keys; the diagonal block needs the mask
    dk, dv = _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr + bh * T, delta_ptr + bh * T, keys, start_n,
                             cols, stride_dot, stride_dod, T, dh, qk_scale, BLOCK, DH, True, PRECISION)
    for start_m in range(start_n + BLOCK, T, BLOCK):
        dk, dv = _bwd_dkdv_block(dk, dv, k, v, q_base, do_base, lse_ptr + bh * T, delta_ptr + bh * T, keys,
                                 start_m, cols, stride_dot, stride_dod, T, dh, qk_scale, BLOCK, DH, False, PRECISION)
    # the 1/sqrt(dh) of S, applied once; dk is the key side of dx, to which _bwd_dq adds the query side
    _store_rows(dx_ptr + b * stride_dxb + h * stride_dxh, dk * sm_scale, keys, cols, stride_dxt, stride_dxd, T, dh)
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
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                     # O = P V    -> dP = dO V^T
    ds = p * (dp - delta[:, None])                                              # P = softmax(S) -> dS
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)                  # S = q k^T  -> dq = dS k
    return dq


@triton.jit
def _bwd_dq(x_ptr, m_ptr, v_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, dx_ptr, dm_ptr,
            stride_xb, stride_xh, stride_xt, stride_xd,
            stride_mb, stride_mt, stride_mh, stride_md, stride_me,
            stride_vb, stride_vh, stride_vt, stride_vd,
            stride_dob, stride_doh, stride_dot, stride_dod,
            stride_dxb, stride_dxh, stride_dxt, stride_dxd,
            stride_dmb, stride_dmt, stride_dmh, stride_dmd,
            H, T, dh, sm_scale, qk_scale,
            BLOCK: tl.constexpr, DH: tl.constexpr, PER_TOKEN: tl.constexpr, PRECISION: tl.constexpr):
    # one program per (query block, b * H + h)
    pid_m = tl.program_id(0)
    start_m = pid_m * BLOCK
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = start_m + tl.arange(0, BLOCK)
    cols = tl.arange(0, DH)
    x_base = x_ptr + b * stride_xb + h * stride_xh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    q = _load_rows(q_ptr + bh * T * DH, rows, cols, DH, 1, T, DH)
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
    # Eq. 5, q_t = x_t m_t, row by row of m_t:
    #   dx_t[d] = sum_e dq_t[e] m_t[d, e]   (dx_t = dq_t m_t^T)
    #   dm_t[d, :] = x_t[d] dq_t            (dm_t = x_t^T dq_t, an outer product per position)
    # A static metric is shared by every (b, t): its gradient is the sum of those outer products,
    # here summed over this block's positions (sum_t x_t[d] dq_t) and stored as one partial per
    # (b, h, query block) for damcha_attention to add up in a fixed order (no atomics).
    m_base = m_ptr + b * stride_mb + h * stride_mh
    dx_query = tl.zeros((BLOCK, DH), dtype=tl.float32)
    for d in range(dh):
        m_d = _load_rows(m_base + d * stride_md, rows, cols, stride_mt, stride_me, T, dh).to(tl.float32)
        dx_query = tl.where(cols[None, :] == d, tl.sum(dq * m_d, 1)[:, None], dx_query)
        x_d = tl.load(x_base + rows * stride_xt + d * stride_xd, mask=rows < T, other=0.0).to(tl.float32)
        if PER_TOKEN:
            _store_rows(dm_ptr + b * stride_dmb + h * stride_dmh + d * stride_dmd, x_d[:, None] * dq, rows, cols,
                        stride_dmt, 1, T, dh)
        else:
            tl.store(dm_ptr + ((bh * tl.num_programs(0) + pid_m) * dh + d) * dh + cols,
                     tl.sum(x_d[:, None] * dq, 0), mask=cols < dh)
    # x is the keys and the queries' input: dx = dk (already in dx, from _bwd_dkdv) + dq m^T
    dx_base = dx_ptr + b * stride_dxb + h * stride_dxh
    dk = _load_rows(dx_base, rows, cols, stride_dxt, stride_dxd, T, dh)
    _store_rows(dx_base, dk + dx_query, rows, cols, stride_dxt, stride_dxd, T, dh)


# ----------------------------------------------------------------------------------------------
# The op

INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)   # TRITON_INTERPRET=1 at import


def _launch(x, block):
    """(grid, kernel options) for x (B, H, T, dh): one program per block of positions and (b, h);
    the feature axis padded to DH, a power of two >= 16 (tl.dot's smallest K). The defaults keep
    the 16-bit kernels free of register spills on sm_90 for dh <= 128 (ptxas, Triton 3.9). float32
    in IEEE mode does its dots on the CUDA cores, with about twice the registers, hence the smaller
    tiles (its dq kernel still spills a little at dh = 64): float32 is for checking, not speed."""
    B, H, T, dh = x.shape
    DH = max(16, triton.next_power_of_2(dh))
    if x.dtype == torch.float32:
        options = dict(BLOCK=block or 32, num_warps=8, num_stages=2)
    else:
        options = dict(BLOCK=block or 64, num_warps=4 if DH <= 64 else 8, num_stages=3)
    return (triton.cdiv(T, options["BLOCK"]), B * H), dict(options, DH=DH)


def _metric_strides(m):
    """m's strides over (b, t, h, d, e); a static (H, dh, dh) metric is a per-token one whose
    strides over b and t are 0."""
    return tuple(m.stride()) if m.dim() == 5 else (0, 0, *m.stride())


def _heads_like(x, dtype):
    """An empty (B, H, T, dh) tensor laid out as (B, T, H, dh), as the model's heads are."""
    B, H, T, dh = x.shape
    return torch.empty(B, T, H, dh, device=x.device, dtype=dtype).transpose(1, 2)


def _precision(dtype):
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"            # TF32 for float32 operands; Triton ignores it for 16-bit ones


def _forward(x, m, v, block):
    B, H, T, dh = x.shape
    grid, options = _launch(x, block)
    o = _heads_like(x, x.dtype)
    lse = torch.empty(B, H, T, device=x.device, dtype=torch.float32)
    _attn_fwd[grid](x, m, v, o, lse, *x.stride(), *_metric_strides(m), *v.stride(), *o.stride(),
                    H, T, dh, LOG2E / math.sqrt(dh), PRECISION=_precision(x.dtype), **options)
    return o, lse


def _backward(do, x, m, v, o, lse, block):
    B, H, T, dh = x.shape
    grid, options = _launch(x, block)
    DH = options["DH"]
    precision = _precision(x.dtype)
    sm_scale = 1.0 / math.sqrt(dh)
    # the forward's q = x m (Eq. 5), not kept, is recomputed once; D_t = rowsum(dO_t * O_t)
    q = torch.empty(B * H, T, DH, device=x.device, dtype=x.dtype)       # zero-padded to DH
    delta = torch.empty(B, H, T, device=x.device, dtype=torch.float32)
    _bwd_prep[grid](x, m, o, do, q, delta, *x.stride(), *_metric_strides(m), *o.stride(), *do.stride(),
                    H, T, dh, **options)
    # O = P V and P = softmax(q x^T / sqrt(dh)), from the side of the keys x: dv, and dk into dx
    dx = _heads_like(x, torch.float32)    # float32: the two parts of dx are added before rounding
    dv = _heads_like(v, v.dtype)
    _bwd_dkdv[grid](x, v, q, do, lse, delta, dx, dv, *x.stride(), *v.stride(), *do.stride(), *dx.stride(),
                    *dv.stride(), H, T, dh, sm_scale, sm_scale * LOG2E, PRECISION=precision, **options)
    # the same, from the side of the queries: dq; then q = x m: dx += dq m^T, dm = x^T dq
    if m.dim() == 5:
        dm = torch.empty_like(m, memory_format=torch.contiguous_format)
        dm_strides = dm.stride()[:4]
    else:
        dm = torch.empty(B, H, grid[0], dh, dh, device=x.device, dtype=torch.float32)   # partial sums
        dm_strides = (0, 0, 0, 0)        # unused: the kernel indexes the partials itself
    _bwd_dq[grid](x, m, v, q, do, lse, delta, dx, dm, *x.stride(), *_metric_strides(m), *v.stride(),
                  *do.stride(), *dx.stride(), *dm_strides, H, T, dh, sm_scale, sm_scale * LOG2E,
                  PER_TOKEN=m.dim() == 5, PRECISION=precision, **options)
    if m.dim() == 3:
        dm = dm.sum(dim=(0, 2)).to(m.dtype)                              # (H, dh, dh): sum over b, blocks
    return dx.to(x.dtype), dm, dv


class DamchaAttention(torch.autograd.Function):
    """o = softmax(causal(q x^T / sqrt(dh))) v with q = x m, on the Triton kernels above."""

    @staticmethod
    def forward(ctx, x, m, v, block):
        o, lse = _forward(x, m, v, block)
        ctx.save_for_backward(x, m, v, o, lse)
        ctx.block = block
        return o

    @staticmethod
    def backward(ctx, do):
        x, m, v, o, lse = ctx.saved_tensors
        dx, dm, dv = _backward(do, x, m, v, o, lse, ctx.block)
        return dx, dm, dv, None


def damcha_attention(x, m, v, block=None):
    """DAMCHA causal attention, Eqs. 5-7. x, v (B, H, T, dh); m (B, T, H, dh, dh) or (H, dh, dh)
    -> o (B, H, T, dh), laid out as (B, T, H, dh) in memory so that o.transpose(1, 2) is
    contiguous. Any strides are accepted; a unit stride along dh makes the loads coalesce.
    block: the tile of queries and keys each program handles, a power of two >= 16; None picks
    64 for 16-bit inputs and 32 for float32."""
    if x.dim() != 4 or v.shape != x.shape:
        raise ValueError(f"x and v must both be (B, H, T, dh), got {tuple(x.shape)} and {tuple(v.shape)}")
    B, H, T, dh = x.shape
    if tuple(m.shape) not in ((B, T, H, dh, dh), (H, dh, dh)):
        raise ValueError(f"m must be (B, T, H, dh, dh) = {(B, T, H, dh, dh)} or (H, dh, dh) = {(H, dh, dh)}, "
                         f"got {tuple(m.shape)}")
    if dh > MAX_DH:
        raise ValueError(f"head size dh = {dh} is above the kernels' limit of {MAX_DH}")
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
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
    elif x.dtype != torch.float32:
        raise ValueError(f"Triton's interpreter runs the kernels in float32 only, not {x.dtype}")
    return DamchaAttention.apply(x, m, v, block)
