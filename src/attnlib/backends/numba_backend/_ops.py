"""The numba backend's small primitives: softmax / logsumexp, merge_states, RoPE.

float16 / bfloat16 compute in float32, float64 in float64; every loop runs in a fixed order
(bitwise reproducible).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._cache import njit

NEG_INF = -np.inf


def compute_dtype(dtype) -> np.dtype:
    """float64 stays float64; float32, float16 and bfloat16 compute in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@njit(parallel=True)
def _softmax_rows(x, out, lse, want_p):
    """One streaming pass of online max / sum per row (``m``, ``l`` rescaled by exp(m - m')),
    then, for softmax, one pass writing ``exp(x - m) / l``."""
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
        _softmax_rows(rows, out, lse, not log)
    if log:
        return lse.reshape(lead)
    p = np.moveaxis(out.reshape(*lead, n), -1, axis)
    return np.ascontiguousarray(p.astype(x.dtype, copy=False))


def merge_states(outs: list[np.ndarray], lses: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``lse = log sum exp(lse_i)``, ``out = sum exp(lse_i - lse) out_i``; empty states (lse
    = -inf) contribute nothing, all empty gives (0, -inf)."""
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
        acc = np.zeros(np.shape(outs[0]), dtype=cdt)
        for li, wi, oi in zip(ls, wn, outs):
            wt = np.transpose(wi, (0, 2, 1))[..., None]  # (B, Sq, H, 1)
            live = np.transpose(li != -np.inf, (0, 2, 1))[..., None]
            acc += np.where(live, wt * np.asarray(oi, dtype=cdt), 0.0)
    return acc.astype(dtype), lse


def rope(x: np.ndarray, positions: np.ndarray, spec) -> np.ndarray:
    """Rotate ``x (B, S, H, D)`` at ``positions (B, S)``: the reference's float64 rotation (RoPE
    is memory-bound and tiny beside attention), one rounding to x's dtype at the end."""
    from ..numpy_backend import rope_reference

    out = rope_reference(np.asarray(x, dtype=np.float64), np.asarray(positions), spec)
    return np.ascontiguousarray(out.astype(x.dtype, copy=False))
