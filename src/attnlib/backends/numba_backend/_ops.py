"""The numba backend's small primitives: softmax / logsumexp, merge_states, RoPE.

float16 / bfloat16 compute in float32, float64 in float64. Rows run in parallel and each row in a
fixed order of blocks, so the result does not depend on the thread count or the scheduling
(bitwise reproducible).

float32 rows are the hot path and are memory-bound, so they stream: a row is read in blocks of
``_BLOCK`` elements that stay in L1 between the block's max and its sum of exponentials (online
max / sum across blocks), and the exponential is a polynomial that LLVM vectorises (numba has no
vector ``exp`` without SVML). Its fastmath flags allow reassociation and contraction only, never
``nnan`` / ``ninf``: NaN still propagates and exp(-inf) is still 0.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from ._cache import njit

NEG_INF = -np.inf
_FM = {"contract", "reassoc", "afn"}
_BLOCK = 2048  # float32 elements: 8 KiB, re-read from L1 by the block's second loop

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO; n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.33654)  # below: the result is under the smallest normal float32
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)


def compute_dtype(dtype) -> np.dtype:
    """float64 stays float64; float32, float16 and bfloat16 compute in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@intrinsic
def _pow2_f32(typingctx, n):
    """``2.0 ** n`` as float32 for an integer -126 <= n <= 127: the exponent bits, bitcast."""
    sig = types.float32(n)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, i32)
        elif v.type.width < 32:
            v = builder.sext(v, i32)
        bits = builder.shl(builder.add(v, ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=_FM)
def _exp_nonpos(t):
    """float32 ``exp(t)`` for ``t <= 0``, -inf or NaN (Cephes' expf: range reduction by ln 2 and
    a degree-7 polynomial, about 1 ulp); results below the smallest normal float32 are 0.
    Branch-free, so loops over it vectorise."""
    ni = np.int32(t * _LOG2E - _HALF)  # round to nearest for t <= 0 (truncation toward 0)
    nf = np.float32(ni)
    r = (t - nf * _LN2_HI) - nf * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e = (p * (r * r) + r + _F1) * _pow2_f32(ni)
    e = _F0 if t < _EXP_LO else e
    return t if t != t else e


@njit(inline="always")
def _max_f32(a, m):
    """max(m, max a) over a contiguous block; NaN never wins (``v > m`` is false), so the lane
    order does not matter. Eight independent running maxima, one vector register: LLVM does
    not vectorise a single select-based max reduction without ``nnan``."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = m
    n8 = a.size - a.size % 8
    for j in range(0, n8, 8):
        v = a[j]
        m0 = v if v > m0 else m0
        v = a[j + 1]
        m1 = v if v > m1 else m1
        v = a[j + 2]
        m2 = v if v > m2 else m2
        v = a[j + 3]
        m3 = v if v > m3 else m3
        v = a[j + 4]
        m4 = v if v > m4 else m4
        v = a[j + 5]
        m5 = v if v > m5 else m5
        v = a[j + 6]
        m6 = v if v > m6 else m6
        v = a[j + 7]
        m7 = v if v > m7 else m7
    for j in range(n8, a.size):
        v = a[j]
        m0 = v if v > m0 else m0
    for v in (m1, m2, m3, m4, m5, m6, m7):
        m0 = v if v > m0 else m0
    return m0


@njit(inline="always", fastmath=_FM)
def _sum_exp_f32(a, m):
    """sum exp(a - m) over a contiguous block (float32 partial sums in vector lanes)."""
    s = _F0
    for j in range(a.size):
        s += _exp_nonpos(a[j] - m)
    return s


@njit(inline="always", fastmath=_FM)
def _sum_exp_store_f32(a, m, out):
    """``out = exp(a - m)`` over a contiguous block, returning its sum."""
    s = _F0
    for j in range(a.size):
        e = _exp_nonpos(a[j] - m)
        out[j] = e
        s += e
    return s


@njit(inline="always", fastmath=_FM)
def _scale_f32(out, c):
    for j in range(out.size):
        out[j] *= c


@njit(inline="always")
def _any_nan(a):
    for j in range(a.size):
        if a[j] != a[j]:
            return True
    return False


@njit(parallel=True, fastmath=_FM)
def _softmax_rows_f32(x, out, lse, block_m, want_p):
    """float32 rows, one read of x: per block of ``_BLOCK`` elements the block max, then
    (against the running max ``m``, rescaling the running sum by exp(m - m') when it grows)
    the block's sum of exp(x - m). For softmax the block's exponentials go to ``out`` as they
    are summed and the max they used to ``block_m``; a last pass scales each block by
    exp(m_block - m) / l (re-read from cache while a row fits L2). NaN never wins a max and
    poisons the sum."""
    n = x.shape[1]
    for r in prange(x.shape[0]):
        xr = x[r]
        m = np.float32(NEG_INF)
        acc = 0.0  # float64 running sum of exp(x - m)
        nan_seen = False
        for bi, b0 in enumerate(range(0, n, _BLOCK)):
            b1 = min(b0 + _BLOCK, n)
            blk = xr[b0:b1]
            mb = _max_f32(blk, m)
            if mb == NEG_INF:
                # only -inf and NaN so far: exp(-inf) adds nothing, NaN decides the row
                nan_seen = nan_seen or _any_nan(blk)
                if want_p:
                    out[r, b0:b1] = _F0
                    block_m[r, bi] = NEG_INF
                continue
            if mb > m:
                acc *= math.exp(float(m) - float(mb))
                m = mb
            if want_p:
                block_m[r, bi] = m
                acc += _sum_exp_store_f32(blk, m, out[r, b0:b1])
            else:
                acc += _sum_exp_f32(blk, m)
        if nan_seen or m == np.inf:
            # NaN propagates; +inf - +inf is NaN, as the float64 reference gives
            lse[r] = np.nan
            if want_p:
                out[r, :] = np.nan
        elif m == NEG_INF:
            lse[r] = NEG_INF
            if want_p:
                out[r, :] = _F0
        else:
            lse[r] = float(m) + math.log(acc)
            if want_p:
                for bi, b0 in enumerate(range(0, n, _BLOCK)):
                    c = np.float32(math.exp(float(block_m[r, bi]) - float(m)) / acc)
                    _scale_f32(out[r, b0:min(b0 + _BLOCK, n)], c)


@njit(parallel=True)
def _softmax_rows(x, out, lse, want_p):
    """float64 rows: one streaming pass of online max / sum per row (``m``, ``l`` rescaled by
    exp(m - m')), then, for softmax, one pass writing ``exp(x - m) / l``."""
    for r in prange(x.shape[0]):
        m = NEG_INF
        acc = 0.0
        for j in range(x.shape[1]):
            xj = x[r, j]
            if xj == NEG_INF:
                continue  # contributes exp(-inf) = 0; also avoids -inf - (-inf)
            if xj > m:
                acc = acc * math.exp(m - xj) + 1.0
                m = xj
            else:
                acc += math.exp(xj - m)  # NaN xj lands here and poisons the row
        if m == np.inf:
            # +inf - +inf: NaN, as the float64 reference gives
            lse[r] = np.nan
            if want_p:
                for j in range(x.shape[1]):
                    out[r, j] = np.nan
        elif acc == 0.0:
            lse[r] = NEG_INF
            if want_p:
                for j in range(x.shape[1]):
                    out[r, j] = 0.0
        else:
            lse[r] = m + math.log(acc)
            if want_p:
                inv = 1.0 / acc
                for j in range(x.shape[1]):
                    out[r, j] = math.exp(x[r, j] - m) * inv


def softmax(x: np.ndarray, axis: int, log: bool) -> np.ndarray:
    cdt = compute_dtype(x.dtype)
    moved = np.moveaxis(x, axis, -1)
    lead = moved.shape[:-1]
    n = moved.shape[-1]
    if n == 0:
        if log:
            return np.full(lead, -np.inf, cdt)
        return np.zeros(x.shape, x.dtype)
    rows = np.ascontiguousarray(moved, dtype=cdt).reshape(-1, n)
    lse = np.empty(rows.shape[0], cdt)
    out = np.empty(rows.shape if not log else (0, 0), cdt)
    if rows.shape[0]:
        if cdt == np.float32:
            nblocks = -(-n // _BLOCK) if not log else 0
            block_m = np.empty((rows.shape[0] if not log else 0, nblocks), cdt)
            _softmax_rows_f32(rows, out, lse, block_m, not log)
        else:
            _softmax_rows(rows, out, lse, not log)
    if log:
        return lse.reshape(lead)
    p = np.moveaxis(out.reshape(*lead, n), -1, axis)
    return np.ascontiguousarray(p.astype(x.dtype, copy=False))


@njit(parallel=True)
def _merge_rows(outs, w, live, acc):
    """``acc[b, s, h] = sum_i w[i, b, h, s] * outs[i][b, s, h]`` over the live states, in state
    order (the first live one assigned); rows (b, s) in
    parallel, each head's Dv values a contiguous inner loop."""
    nb, sq, nh, dv = acc.shape
    for bs in prange(nb * sq):
        b = bs // sq
        s = bs - b * sq
        for h in range(nh):
            dst = acc[b, s, h]
            first = True
            for i in range(len(outs)):
                if live[i, b, h, s]:
                    wi = w[i, b, h, s]
                    src = outs[i][b, s, h]
                    if first:
                        for d in range(dv):
                            dst[d] = wi * src[d]
                        first = False
                    else:
                        for d in range(dv):
                            dst[d] += wi * src[d]
            if first:
                dst[:] = 0.0


def merge_states(outs: list[np.ndarray], lses: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``lse = log sum exp(lse_i)``, ``out = sum exp(lse_i - lse) out_i``; empty states (lse
    = -inf) contribute nothing (not even NaN they may hold), all empty gives (0, -inf). The
    weights are per (b, h, s) and small; the outputs stream once through ``_merge_rows``."""
    dtype = np.dtype(outs[0].dtype)
    cdt = compute_dtype(dtype)
    ls = np.stack([np.asarray(x, dtype=cdt) for x in lses])  # (n, B, H, Sq)
    with np.errstate(all="ignore"):
        m = ls.max(axis=0)
        empty = m == -np.inf
        m_safe = np.where(empty, 0.0, m).astype(cdt)
        w = np.exp(ls - m_safe)  # exp(-inf) = 0 for empty states
        total = w.sum(axis=0)
        lse = np.where(empty, -np.inf, m_safe + np.log(total)).astype(cdt)
        wn = (w / np.where(empty, 1.0, total)).astype(cdt)
    live = ls != -np.inf
    acc = np.empty(np.shape(outs[0]), dtype=cdt)
    if acc.size:
        _merge_rows(tuple(np.ascontiguousarray(o, dtype=cdt) for o in outs), wn, live, acc)
    return acc.astype(dtype, copy=False), lse


def rope(x: np.ndarray, positions: np.ndarray, spec) -> np.ndarray:
    """Rotate ``x (B, S, H, D)`` at ``positions (B, S)``: the reference's float64 rotation (RoPE
    is memory-bound and tiny beside attention), one rounding to x's dtype at the end."""
    from ..numpy_backend import rope_reference

    out = rope_reference(np.asarray(x, dtype=np.float64), np.asarray(positions), spec)
    return np.ascontiguousarray(out.astype(x.dtype, copy=False))
