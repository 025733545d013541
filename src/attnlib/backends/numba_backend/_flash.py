"""FlashAttention forward on the CPU with numba: query blocks x key blocks, online softmax.

One *task* is ``(sequence, kv head, block of packed query rows, key range)``. Packed rows put the
``G = Hq // Hkv`` query heads that share a kv head side by side (row ``r`` is query row ``r // G``
of head ``kvh * G + r % G``), so one K/V tile load serves the whole GQA group, and a decode step
(one query row) still gives BLAS an ``M = G`` matrix. Per key tile (FlashAttention-2, Alg. 1):

    S = Q_blk @ K_blk^T (BLAS gemm on contiguous float32 / float64 tiles)
    -> softcap, ALiBi, mask, positional (causal / window) masking
    -> m_new = max(m, rowmax S); P = exp(S - m_new); l = l * exp(m - m_new) + rowsum P
    -> O = O * exp(m - m_new) + P @ V_blk (gemm)

Key tiles that causal / window hide from every row of the block are never visited. Only
``BLOCK_M x BLOCK_N`` score tiles exist: no Sq x Sk buffer. Tasks are dealt round-robin to
``n_workers`` prange workers; each output row is produced by exactly one task, in a fixed key
order, so results are bitwise reproducible. Split-key tasks (decode) write partial states
``(O, m, l)`` that :func:`merge_partials` combines in a fixed order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# 'nnan' / 'ninf' stay off: -inf marks hidden keys and NaN must propagate from visible ones.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}
# rowmax only: a NaN it misses still reaches the row through exp(NaN) (see _row_max).
FASTMATH_MAX = {"contract", "reassoc", "nsz", "arcp", "afn", "nnan"}

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = -np.inf
BIG = 1 << 62  # "unbounded" for window sides and causal_hi


@njit(cache=True, fastmath=FASTMATH_MAX, inline="always")
def _row_max(s, base, n):
    mx = NEG_INF
    for j in range(n):
        x = s[base + j]
        mx = x if x > mx else mx
    return mx


@njit(cache=True, fastmath=FASTMATH)
def _exp_row_f32(s, p, e_bits, e_val, base, n, mu):
    """p[base:base+n] = exp(s[...] - mu), vectorisable: 2**x = 2**round(x) * poly(frac).

    The 2**k factor is built from exponent bits (``e_bits`` is an int32 view of ``e_val``);
    x < -126 gives 0 and NaN stays NaN. Degree-7 Taylor on |f| <= 1/2: rel. error < 1e-8.
    """
    acc = np.float32(0.0)
    for j in range(n):
        x = (s[base + j] - mu) * np.float32(LOG2E)
        xc = x if x > np.float32(-127.0) else np.float32(-127.0)  # NaN -> -127 for the bits
        fi = np.rint(xc)
        f = (x - fi) * np.float32(LN2)
        poly = np.float32(1.0 / 5040.0)
        poly = poly * f + np.float32(1.0 / 720.0)
        poly = poly * f + np.float32(1.0 / 120.0)
        poly = poly * f + np.float32(1.0 / 24.0)
        poly = poly * f + np.float32(1.0 / 6.0)
        poly = poly * f + np.float32(0.5)
        poly = poly * f + np.float32(1.0)
        poly = poly * f + np.float32(1.0)
        p[base + j] = np.float32(0.0) if x < np.float32(-126.0) else poly
        e_bits[j] = (np.int32(fi) + np.int32(127)) << np.int32(23)
    for j in range(n):
        y = p[base + j] * e_val[j]
        p[base + j] = y
        acc += y
    return acc


@njit(cache=True, fastmath=FASTMATH)
def _exp_row_f64(s, p, e_bits, e_val, base, n, mu):
    acc = 0.0
    for j in range(n):
        y = math.exp(s[base + j] - mu)
        p[base + j] = y
        acc += y
    return acc


@njit(cache=True, fastmath=FASTMATH)
def _load_rows(src, b, row0, nrows, ring, h, dst, width):
    """dst[t*width + d] = src[b, row(t), h, d]; row wraps at ``ring`` (ring-buffer caches)."""
    for t in range(nrows):
        r = row0 + t
        if ring > 0 and r >= ring:
            r -= ring
        base = t * width
        for d in range(width):
            dst[base + d] = src[b, r, h, d]


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def flash_forward(q, k, v, seq, tasks, g, scale, wl, wr, softcap, alibi, mask, ring,
                  block_m, block_n, n_workers, out, lse, part_o, part_ml):
    """Run every task; see the module docstring.

    ``seq`` int64 (n_seq, 9): q_batch, q_row0, q_len, k_batch, k_row0, k_len, q_pos0, k_pos0,
    causal_hi (BIG when not causal). ``tasks`` int64 (n_tasks, 6): seq, kv head, first packed
    row, packed rows, first key, key end; column 6 (if >= 0) is a partial-state slot.
    ``alibi`` (n_seq, Hq) or (0, 0); ``mask`` additive (n_seq, Hq, Sq, Sk) view or (0,0,0,0).
    """
    dt = out.dtype
    d_qk = q.shape[3]
    d_v = v.shape[3]
    n_tasks = tasks.shape[0]
    use_alibi = alibi.shape[0] > 0
    use_mask = mask.shape[0] > 0
    for w in prange(n_workers):
        qt = np.zeros(block_m * d_qk, dt)
        kt = np.zeros(block_n * d_qk, dt)
        vt = np.zeros(block_n * d_v, dt)
        st = np.zeros(block_m * block_n, dt)
        pt = np.zeros(block_m * block_n, dt)
        pv = np.zeros(block_m * d_v, dt)
        ot = np.zeros(block_m * d_v, dt)
        m_i = np.empty(block_m, dt)
        l_i = np.empty(block_m, dt)
        alpha = np.empty(block_m, dt)
        e_val = np.zeros(block_n, np.float32)
        e_bits = e_val.view(np.int32)
        e_val64 = np.zeros(1, np.float64)
        e_bits64 = e_val64.view(np.int64)
        for t in range(w, n_tasks, n_workers):
            s = tasks[t, 0]
            kvh = tasks[t, 1]
            r0 = tasks[t, 2]
            nr = tasks[t, 3]
            j_begin = tasks[t, 4]
            j_end = tasks[t, 5]
            slot = tasks[t, 6]
            qb = seq[s, 0]
            qrow0 = seq[s, 1]
            kb = seq[s, 3]
            krow0 = seq[s, 4]
            qpos0 = seq[s, 6]
            kpos0 = seq[s, 7]
            chi = seq[s, 8]
            hi = chi if chi < wr else wr
            # -- load the query block (scaled), packed rows r = i * G + head-in-group
            for rr in range(nr):
                r = r0 + rr
                i = r // g
                h = kvh * g + r % g
                base = rr * d_qk
                for d in range(d_qk):
                    qt[base + d] = q[qb, qrow0 + i, h, d] * scale
            qpos_lo = qpos0 + r0 // g
            qpos_hi = qpos0 + (r0 + nr - 1) // g
            # -- key range that some row of the block can see (tile skipping)
            j_lo = j_begin
            if wl < BIG:
                j_lo = max(j_lo, qpos_lo - wl - kpos0)
            j_hi = j_end
            if hi < BIG:
                j_hi = min(j_hi, qpos_hi + hi - kpos0 + 1)
            for rr in range(nr):
                m_i[rr] = NEG_INF
                l_i[rr] = 0.0
            for x in range(nr * d_v):
                ot[x] = 0.0
            qmat = qt[: nr * d_qk].reshape((nr, d_qk))
            for jb in range(j_lo, j_hi, block_n):
                n = min(block_n, j_hi - jb)
                _load_rows(k, kb, krow0 + jb, n, ring, kvh, kt, d_qk)
                _load_rows(v, kb, krow0 + jb, n, ring, kvh, vt, d_v)
                smat = st[: nr * n].reshape((nr, n))
                np.dot(qmat, kt[: n * d_qk].reshape((n, d_qk)).T, smat)
                kpos_lo = kpos0 + jb
                kpos_hi = kpos_lo + n - 1
                full = kpos_hi - qpos_lo <= hi and kpos_lo - qpos_hi >= -wl and not use_mask
                # -- score modifiers: softcap, ALiBi, mask, then causal / window
                for rr in range(nr):
                    r = r0 + rr
                    i = r // g
                    h = kvh * g + r % g
                    qpos = qpos0 + i
                    base = rr * n
                    if softcap > 0.0:
                        for j in range(n):
                            st[base + j] = softcap * math.tanh(st[base + j] / softcap)
                    if use_alibi:
                        slope = alibi[s, h]
                        for j in range(n):
                            st[base + j] -= slope * abs(qpos - (kpos_lo + j))
                    if use_mask:
                        for j in range(n):
                            mv = mask[s, h, i, jb + j]
                            st[base + j] = NEG_INF if mv == NEG_INF else st[base + j] + mv
                    if not full:
                        # visible iff -wl <= kpos - qpos <= hi
                        lo = max(0, qpos - wl - kpos_lo) if wl < BIG else 0
                        up = min(n, qpos + hi - kpos_lo + 1) if hi < BIG else n
                        up = max(up, 0)
                        lo = min(lo, n)
                        for j in range(lo):
                            st[base + j] = NEG_INF
                        for j in range(up, n):
                            st[base + j] = NEG_INF
                    # -- online softmax: new max, rescale factor, probabilities
                    m_new = max(m_i[rr], _row_max(st, base, n))
                    mu = m_new if m_new != NEG_INF else 0.0
                    alpha[rr] = math.exp(m_i[rr] - mu)
                    if out.itemsize == 4:
                        rs = _exp_row_f32(st, pt, e_bits, e_val, base, n, mu)
                    else:
                        rs = _exp_row_f64(st, pt, e_bits64, e_val64, base, n, mu)
                    l_i[rr] = l_i[rr] * alpha[rr] + rs
                    m_i[rr] = m_new
                # -- O = O * alpha + P @ V
                pmat = pt[: nr * n].reshape((nr, n))
                pvmat = pv[: nr * d_v].reshape((nr, d_v))
                clean = full
                if not full:
                    clean = True
                    for x in range(n * d_v):
                        if not math.isfinite(vt[x]):
                            clean = False
                            break
                if clean:
                    np.dot(pmat, vt[: n * d_v].reshape((n, d_v)), pvmat)
                else:
                    # a non-finite v in a partly hidden tile: skip hidden keys, never 0 * NaN
                    for x in range(nr * d_v):
                        pv[x] = 0.0
                    for rr in range(nr):
                        for j in range(n):
                            if st[rr * n + j] != NEG_INF:
                                pj = pt[rr * n + j]
                                for d in range(d_v):
                                    pv[rr * d_v + d] += pj * vt[j * d_v + d]
                for rr in range(nr):
                    a = alpha[rr]
                    base = rr * d_v
                    for d in range(d_v):
                        ot[base + d] = ot[base + d] * a + pv[base + d]
            # -- epilogue: out = O / l, lse = m + log(l); a row that saw nothing: 0, -inf
            for rr in range(nr):
                r = r0 + rr
                i = r // g
                h = kvh * g + r % g
                li = l_i[rr]
                base = rr * d_v
                if slot >= 0:
                    for d in range(d_v):
                        part_o[slot, rr, d] = ot[base + d]
                    part_ml[slot, rr, 0] = m_i[rr]
                    part_ml[slot, rr, 1] = li
                    continue
                if li == 0.0:
                    for d in range(d_v):
                        out[qb, qrow0 + i, h, d] = 0.0
                    lse[qb, h, qrow0 + i] = NEG_INF
                else:
                    inv = 1.0 / li
                    for d in range(d_v):
                        out[qb, qrow0 + i, h, d] = ot[base + d] * inv
                    lse[qb, h, qrow0 + i] = m_i[rr] + math.log(li)
    return 0
