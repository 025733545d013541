"""The numba backend's small primitives: softmax / logsumexp, merge_states, RoPE.

float16 / bfloat16 compute in float32, float64 in float64. Rows run in parallel and each row in a
fixed order of blocks, so the result does not depend on the thread count or the scheduling
(bitwise reproducible).

float32 rows are the hot path and are memory-bound, so they stream: a row is read in blocks of
``_BLOCK`` elements that stay in L1 between the block's max and its sum of exponentials (online
max / sum across blocks). Both loops are vectorised by LLVM: the block max is an integer max / min
over order-preserving keys of the float bits (a float max that must skip NaN does not vectorise;
the keys also show a NaN or +inf, which make the whole row NaN, so the exponential never sees
one), and the exponential is a branch-free polynomial (numba has no vector ``exp`` without
SVML) of about 17 vector instructions per 16 elements: on one core it takes about as long as
DRAM takes to deliver the row (bench/RESULTS.md). The fastmath flags allow
reassociation and contraction only, never ``nnan`` / ``ninf``: exp(-inf) is still 0.
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
# exp(r) ~ 1 + r * (_Q0 + r * (_Q1 + r * (_Q2 + r * (_Q3 + r * _Q4)))) on |r| <= ln(2) / 2:
# a degree-5 near-minimax fit, relative error 9.2e-8 (1.7e-7 with float32 evaluation)
_Q0 = np.float32(0.9999997019767761)
_Q1 = np.float32(0.4999914765357971)
_Q2 = np.float32(0.1666763722896576)
_Q3 = np.float32(0.04189816117286682)
_Q4 = np.float32(0.008290344849228859)
_I32 = ir.IntType(32)


def compute_dtype(dtype) -> np.dtype:
    """float64 stays float64; float32, float16 and bfloat16 compute in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@intrinsic
def _pow2_f32(typingctx, n):
    """``2.0 ** n`` as float32 for an integer -126 <= n <= 127: the exponent bits, bitcast."""
    sig = types.float32(n)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, _I32)
        elif v.type.width < 32:
            v = builder.sext(v, _I32)
        bits = builder.shl(builder.add(v, ir.Constant(_I32, 127)), ir.Constant(_I32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


def _flip(builder, bits):
    """``bits ^ ((bits >> 31) & 0x7fffffff)``: its own inverse."""
    sign = builder.ashr(bits, ir.Constant(_I32, 31))
    return builder.xor(bits, builder.and_(sign, ir.Constant(_I32, 0x7FFFFFFF)))


@intrinsic
def _key_f32(typingctx, v):
    """A float32 as an int32 whose signed order is the float order (-inf < finite < +inf);
    +NaN keys lie above +inf's, -NaN keys below -inf's. Integer max / min reductions
    vectorise, where a float max that must ignore NaN does not."""
    sig = types.int32(v)

    def codegen(context, builder, signature, args):
        return _flip(builder, builder.bitcast(args[0], _I32))

    return sig, codegen


@intrinsic
def _unkey_f32(typingctx, k):
    """The float32 of a :func:`_key_f32` key."""
    sig = types.float32(k)

    def codegen(context, builder, signature, args):
        return builder.bitcast(_flip(builder, args[0]), ir.FloatType())

    return sig, codegen


_KEY_NEG_INF = np.int32(np.array(-np.inf, np.float32).view(np.int32) ^ 0x7FFFFFFF)
_KEY_POS_INF = np.int32(np.array(np.inf, np.float32).view(np.int32))


@njit(inline="always", fastmath=_FM)
def _exp_nonpos(t):
    """float32 ``exp(t)`` for ``-inf <= t <= 0`` (never NaN: callers leave NaN rows out):
    Cephes' range reduction by ln 2 in two steps, then the degree-5 polynomial ``_Q``
    (about 2 ulp); results below the smallest normal float32 are 0. Branch-free, so loops
    over it vectorise."""
    ni = np.int32(t * _LOG2E - _HALF)  # round to nearest for t <= 0 (truncation toward 0)
    nf = np.float32(ni)
    r = (t - nf * _LN2_HI) - nf * _LN2_LO
    e = (_Q0 + r * (_Q1 + r * (_Q2 + r * (_Q3 + r * _Q4)))) * r + _F1
    return _F0 if t < _EXP_LO else e * _pow2_f32(ni)


@njit(inline="always")
def _max_keys(a, m):
    """(max, min) of :func:`_key_f32` over a contiguous block and the float32 ``m``: two integer
    reductions in vector registers. A NaN shows as a max above +inf's key or a min below
    -inf's."""
    hi = lo = _key_f32(m)
    for j in range(a.size):
        k = _key_f32(a[j])
        hi = k if k > hi else hi
        lo = k if k < lo else lo
    return hi, lo


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


@njit(parallel=True, fastmath=_FM)
def _softmax_rows_f32(x, out, lse, block_m, want_p):
    """float32 rows, one read of x: per block of ``_BLOCK`` elements the block max (through
    integer keys: a NaN or +inf ends the row, whose result is NaN), then (against the running
    max ``m``, rescaling the running sum by exp(m - m') when it grows) the block's sum of
    exp(x - m). For softmax the block's exponentials go to ``out`` as they are summed and the
    max they used to ``block_m``; a last pass scales each block by exp(m_block - m) / l
    (re-read from cache while a row fits L2)."""
    n = x.shape[1]
    for r in prange(x.shape[0]):
        xr = x[r]
        m = np.float32(NEG_INF)
        acc = 0.0  # float64 running sum of exp(x - m)
        nan_row = False
        for bi, b0 in enumerate(range(0, n, _BLOCK)):
            b1 = min(b0 + _BLOCK, n)
            blk = xr[b0:b1]
            hi, lo = _max_keys(blk, m)
            if hi >= _KEY_POS_INF or lo < _KEY_NEG_INF:
                # NaN propagates; +inf - +inf is NaN, as the float64 reference gives
                nan_row = True
                break
            mb = _unkey_f32(hi)
            if mb == NEG_INF:  # only -inf so far: exp(-inf) adds nothing
                if want_p:
                    out[r, b0:b1] = _F0
                    block_m[r, bi] = NEG_INF
                continue
            if mb > m:
                if acc != 0.0:  # (no call to exp for the row's first block)
                    acc *= math.exp(float(m) - float(mb))
                m = mb
            if want_p:
                block_m[r, bi] = m
                acc += _sum_exp_store_f32(blk, m, out[r, b0:b1])
            else:
                acc += _sum_exp_f32(blk, m)
        if nan_row:
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
