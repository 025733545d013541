"""The numpy reference backend: the oracle every other backend is measured against.

Everything is computed in float64, straight from the contract in :mod:`attnlib.backends.base`.
Scores are materialised, but only one query-row chunk of one head at a time, so the workspace
stays under ``_WORKSPACE_BYTES`` whatever the sequence lengths are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _quant
from .base import AttnCall, Backend, HostPages, RopeSpec

# Each chunk holds a few (rows, k_len) float64 arrays: scores, visibility, probabilities.
_WORKSPACE_BYTES = 256 * 2**20
_ARRAYS_PER_CHUNK = 6


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64, copy=False)


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _rows_per_chunk(k_len: int) -> int:
    return max(1, _WORKSPACE_BYTES // (_ARRAYS_PER_CHUNK * 8 * max(k_len, 1)))


class NumpyBackend(HostPages, Backend):
    """Float64-accumulating reference. Exact, slow, and the oracle of the conformance suite."""

    name = "numpy"
    description = "numpy reference (float64 accumulation, the oracle)"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def auto_priority(cls) -> int:
        return 10

    def info(self) -> dict:
        return {"numpy": np.__version__}

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, call: AttnCall) -> tuple[np.ndarray, np.ndarray]:
        out, lse = self.attention_state(call)
        return out.astype(call.dtype), lse.astype(_acc_dtype(call.dtype))

    def attention_state(self, call: AttnCall) -> tuple[np.ndarray, np.ndarray]:
        """The state in float64, whatever the dtype (the reference accumulates in float64)."""
        bq, sq_arr, hq, _ = call.q.shape
        out = np.zeros((bq, sq_arr, hq, call.v.shape[3]), dtype=np.float64)
        lse = np.full((bq, hq, sq_arr), -np.inf, dtype=np.float64)
        for s in range(call.n_seq):
            n_q, n_k = int(call.q_len[s]), int(call.k_len[s])
            if n_q == 0:
                continue
            if n_k:  # else out = 0, lse = -inf already
                self._sequence(call, s, out, lse)
            if call.options.sinks is not None:  # each head's sink, folded in once all keys are in
                qb, rows_q = int(call.q_batch[s]), slice(int(call.q_row0[s]),
                                                         int(call.q_row0[s]) + n_q)
                out[qb, rows_q], lse[qb, :, rows_q] = fold_sinks(
                    out[qb, rows_q], lse[qb, :, rows_q], call.options.sinks)
        return out, lse

    def _sequence(self, call: AttnCall, s: int, out: np.ndarray, lse: np.ndarray) -> None:
        """Sequence ``s``'s rows (it has keys) into ``out``, ``lse`` (float64), without sinks."""
        q, k, v = call.q, call.k, call.v
        group = q.shape[2] // k.shape[2]
        n_q, n_k = int(call.q_len[s]), int(call.k_len[s])
        qb, q0 = int(call.q_batch[s]), int(call.q_row0[s])
        rows = int(call.k_row0[s]) + np.arange(n_k)
        if call.ring:
            rows %= call.ring
        kb = int(call.k_batch[s])
        k_seq, v_seq, ksc, vsc = k, v, call.k_scales, call.v_scales
        if call.block_table is not None:
            k_seq, v_seq, ksc, vsc, rows, kb = _paged_rows(call, s, rows)
        qpos = int(call.q_pos0[s]) + np.arange(n_q)
        kpos = int(call.k_pos0[s]) + np.arange(n_k)
        for h in range(q.shape[2]):
            hk = h // group
            qs = _f64(q[qb, q0:q0 + n_q, h, :])
            if call.quantized:  # the reference reads scale * stored, exact in float64
                ks = _quant.dequantize(k_seq[kb][rows, hk, :], ksc[kb][rows, hk])
                vs = _quant.dequantize(v_seq[kb][rows, hk, :], vsc[kb][rows, hk])
            else:
                ks = _f64(k_seq[kb][rows, hk, :])
                vs = _f64(v_seq[kb][rows, hk, :])
            step = _rows_per_chunk(n_k)
            for i0 in range(0, n_q, step):
                i1 = min(n_q, i0 + step)
                o, m = self._rows(call, s, h, qs[i0:i1], ks, vs, qpos[i0:i1], kpos, i0)
                out[qb, q0 + i0:q0 + i1, h, :] = o
                lse[qb, h, q0 + i0:q0 + i1] = m

    def _rows(self, call: AttnCall, s: int, h: int, qs, ks, vs, qpos, kpos, i0: int):
        """Reference softmax attention for one chunk of query rows of one head."""
        d = kpos[None, :] - qpos[:, None]
        vis = np.ones(d.shape, dtype=bool)
        if call.causal_hi is not None:
            vis &= d <= int(call.causal_hi[s])
        if call.options.window_left is not None:
            vis &= d >= -call.options.window_left
        if call.options.window_right is not None:
            vis &= d <= call.options.window_right
        with np.errstate(all="ignore"):
            sc = (qs @ ks.T) * call.options.scale
            if call.options.softcap is not None:
                sc = call.options.softcap * np.tanh(sc / call.options.softcap)
            if call.options.alibi is not None:
                sc = sc - float(call.options.alibi[s, h]) * np.abs(d)
            if call.mask_view is not None:
                m = np.asarray(call.mask_view[s, h, i0:i0 + len(qpos), :])
                if call.options.mask_kind == "bool":
                    vis &= m
                else:
                    mf = m.astype(np.float64)
                    vis &= mf != -np.inf
                    sc = sc + mf
            sc = np.where(vis, sc, -np.inf)
            mx = np.max(sc, axis=1)
            empty = mx == -np.inf
            mx_safe = np.where(empty, 0.0, mx)
            p = np.where(vis, np.exp(sc - mx_safe[:, None]), 0.0)
            denom = p.sum(axis=1)
            # Keys hidden from a row must not leak NaN/inf from v into it, so bad v rows are
            # added only where they are visible.
            bad = ~np.isfinite(vs).all(axis=1)
            if bad.any():
                o = p[:, ~bad] @ vs[~bad]
                for j in np.flatnonzero(bad):
                    sel = vis[:, j]
                    o[sel] += p[sel, j][:, None] * vs[j][None, :]
            else:
                o = p @ vs
            o = o / np.where(empty, 1.0, denom)[:, None]
            o[empty] = 0.0
            lse = np.where(empty, -np.inf, mx_safe + np.log(denom))
        return o, lse

    # ---- online-softmax primitives -------------------------------------------------------------
    def softmax(self, x: Any, axis: int, log: bool) -> np.ndarray:
        xf = _f64(x)
        with np.errstate(all="ignore"):
            if xf.shape[axis] == 0:
                if log:
                    return np.full(np.delete(xf.shape, axis), -np.inf, _acc_dtype(x.dtype))
                return np.zeros(xf.shape, dtype=x.dtype)
            m = np.max(xf, axis=axis, keepdims=True)
            m_safe = np.where(m == -np.inf, 0.0, m)
            e = np.exp(xf - m_safe)
            total = e.sum(axis=axis, keepdims=True)
            if log:
                lse = np.where(m == -np.inf, -np.inf, m_safe + np.log(total))
                return np.squeeze(lse, axis=axis).astype(_acc_dtype(x.dtype))
            p = np.where(m == -np.inf, 0.0, e / np.where(total == 0, 1.0, total))
        return np.ascontiguousarray(p.astype(x.dtype))

    def merge_states(self, outs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
        dtype = np.dtype(outs[0].dtype)
        ls = np.stack([_f64(x) for x in lses])  # (n, B, H, Sq)
        with np.errstate(all="ignore"):
            m = ls.max(axis=0)
            empty = m == -np.inf
            w = np.where(ls == -np.inf, 0.0, np.exp(ls - np.where(empty, 0.0, m)))
            total = w.sum(axis=0)
            lse = np.where(empty, -np.inf, m + np.log(total))
            wn = w / np.where(empty, 1.0, total)  # (n, B, H, Sq)
            acc = np.zeros(np.shape(outs[0]), dtype=np.float64)
            # Only empty states (lse = -inf) are left out, whatever their out holds. A state
            # whose weight is NaN (a NaN lse) or underflows to 0 is still multiplied in, so
            # NaN / inf from a visible key reaches the result as in one-shot attention.
            for wi, li, oi in zip(wn, ls, outs):
                wt = np.transpose(wi, (0, 2, 1))[..., None]  # (B, Sq, H, 1)
                held = np.transpose(li != -np.inf, (0, 2, 1))[..., None]
                acc += np.where(held, wt * _f64(oi), 0.0)
        return acc.astype(dtype), lse.astype(_acc_dtype(dtype))

    def rope(self, x: Any, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
        return rope_reference(_f64(x), positions, spec).astype(x.dtype)

    # ---- KV cache -----------------------------------------------------------------------------
    def cache_alloc(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def cache_write(self, buf, src, rows, start_pos, rope: RopeSpec | None,
                    scales=None) -> None:
        cap = buf.shape[1]
        n_new = src.shape[1]
        for b in range(src.shape[0]):
            pos = int(start_pos[b]) + np.arange(n_new)
            chunk = src[b]
            if rope is not None:
                chunk = self.rope(chunk[None], pos[None], rope)[0]
            if scales is not None:
                chunk, scales[int(rows[b]), pos % cap] = _quant.quantize(
                    chunk, _quant.format_of(buf.dtype))
            buf[int(rows[b]), pos % cap] = chunk


def fold_sinks(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """The state ``(out (S, Hq, Dv), lse (Hq, S))`` merged with ``(0, sinks[h])``, in float64:
    ``lse' = log(exp(lse) + exp(sink))``, ``out' = out exp(lse - lse')``; an empty row (lse
    -inf) gives (0, sink)."""
    sk = sinks.astype(np.float64)[:, None]
    lse = np.asarray(lse, np.float64)
    with np.errstate(all="ignore"):
        m = np.maximum(lse, sk)
        w = np.where(lse == -np.inf, 0.0, np.exp(lse - m))
        total = w + np.exp(sk - m)
        new_lse = m + np.log(total)
        new_out = np.asarray(out, np.float64) * (w / total).T[:, :, None]  # (S, Hq, Dv)
    return new_out, new_lse


def _paged_rows(call: AttnCall, s: int, rows: np.ndarray):
    """Sequence ``s``'s keys of a paged call as (k, v, k_scales, v_scales, rows, batch): the
    pools (and scale pools, None when not quantized) seen as one batch of ``num_pages *
    page_size`` rows, and the flat row of each logical row (page indices clamped into the pool,
    as every backend does for a table it did not check)."""
    ps = call.page_size
    n_pages = call.k.shape[0]
    table = np.asarray(call.block_table)[s]
    pages = np.clip(table[np.minimum(rows // ps, table.shape[0] - 1)].astype(np.int64), 0,
                    n_pages - 1)
    flat = pages * ps + rows % ps
    k = np.asarray(call.k).reshape((1, n_pages * ps) + tuple(call.k.shape[2:]))
    v = np.asarray(call.v).reshape((1, n_pages * ps) + tuple(call.v.shape[2:]))
    ksc = vsc = None
    if call.quantized:
        ksc = np.asarray(call.k_scales).reshape((1, n_pages * ps, -1))
        vsc = np.asarray(call.v_scales).reshape((1, n_pages * ps, -1))
    return k, v, ksc, vsc, flat, 0


def rope_reference(x: np.ndarray, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """Rotary embedding in float64: ``x (B, S, H, D)``, ``positions (B, S)``."""
    r = spec.rotary_dim
    half = r // 2
    inv_freq = spec.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / r)
    ang = positions.astype(np.float64)[..., None] * inv_freq  # (B, S, half)
    cos, sin = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    out = np.array(x, dtype=np.float64, copy=True)
    if spec.interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = a * cos - b * sin
        out[..., 1:r:2] = a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:r]
        out[..., :half] = a * cos - b * sin
        out[..., half:r] = a * sin + b * cos
    return out
