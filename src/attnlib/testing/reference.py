"""The conformance oracle: naive dense attention written straight from contract §2.

Independent of every backend's code (the numpy backend included). Scores are materialised in
full, so it is for small sizes only. Every function takes and returns numpy arrays in the bshd
layout and computes in float64, unless ``dtype`` asks for the naive same-dtype run of the
accuracy rule (:func:`naive_attention`): then every intermediate is rounded to that dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "attend",
    "dense_visibility",
    "reference_attention",
    "reference_call",
    "seq_call",
    "naive_attention",
    "reference_varlen",
    "reference_softmax",
    "reference_logsumexp",
    "reference_rope",
]


def _rounder(dtype):
    """Compute in float64 (float64 / float32) or float32 (narrower) and round to ``dtype``."""
    dtype = np.dtype(dtype)
    work = np.float64 if dtype.itemsize >= 4 else np.float32

    def rnd(x):
        return np.asarray(x).astype(dtype).astype(work)

    return rnd, work


def dense_visibility(sq, sk, *, causal=False, window=None):
    """contract §2 literally: bool (Sq, Sk), True where key j is visible to query row i."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    off = sk - sq
    vis = np.ones((sq, sk), dtype=bool)
    if causal is True or causal == "bottom_right":
        vis &= j <= i + off
    elif causal == "top_left":
        vis &= j <= i
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            vis &= i + off - left <= j
        if right is not None and right >= 0:
            vis &= j <= i + off + right
    return vis


def attend(q, k, v, qpos, kpos, visible, *, scale, softcap=None, alibi=None, additive=None,
           sinks=None, dtype=np.float64):
    """One sequence: q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv); positions (Sq,), (Sk,).

    ``visible`` broadcasts to (Hq, Sq, Sk); ``alibi`` (Hq,) slopes; ``additive`` broadcasts to
    (Hq, Sq, Sk); ``sinks`` (Hq,) logits in every row's denominator (contract §10).
    Returns out (Sq, Hq, Dv) and lse (Hq, Sq) as float64 arrays holding values
    rounded to ``dtype`` (lse: to float32 at most, as the contract returns it).
    """
    rnd, work = _rounder(dtype)
    q, k, v = (rnd(np.asarray(a, dtype=np.float64)) for a in (q, k, v))
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    kh = np.repeat(k, group, axis=1) if sk else np.zeros((0, hq, k.shape[2]), work)
    vh = np.repeat(v, group, axis=1) if sk else np.zeros((0, hq, dv), work)
    visible = np.broadcast_to(np.asarray(visible, dtype=bool), (hq, sq, sk))
    # -- 1. s = scale * q.k
    s = rnd(np.einsum("ihd,jhd->hij", q, kh) * work(scale)) if sk else np.zeros((hq, sq, 0), work)
    # -- 2. softcap
    if softcap is not None:
        s = rnd(work(softcap) * np.tanh(s / work(softcap)))
    # -- 3. ALiBi: the distance between absolute positions
    if alibi is not None:
        dist = np.abs(np.asarray(qpos)[:, None] - np.asarray(kpos)[None, :]).astype(work)
        s = rnd(s - np.asarray(alibi, dtype=np.float32).astype(work)[:, None, None] * dist)
    # -- 4. additive mask; -inf excludes
    if additive is not None:
        add = np.broadcast_to(np.asarray(additive, dtype=np.float64), (hq, sq, sk))
        visible = visible & (add != -np.inf)
        s = rnd(s + add.astype(work))
    # -- 7. softmax over visible keys only: invisible keys are skipped, never multiplied by 0
    s = np.where(visible, s, -np.inf)
    any_vis = visible.any(axis=2)
    m = np.where(any_vis, np.max(s, axis=2, initial=-np.inf), 0.0)
    sink = None
    if sinks is not None:
        # -- 10. m = max(sink_h, max_j s_ij); exp(sink_h - m) joins the denominator
        sink = np.asarray(sinks, dtype=np.float32).astype(work)[:, None]  # (Hq, 1)
        m = np.where(any_vis, np.maximum(m, sink), sink)
        any_vis = np.ones_like(any_vis)  # every row has the sink: lse = sink when no key
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = rnd(np.exp(s - m[:, :, None]))
        p = np.where(visible, p, 0.0)
        l_sum = rnd(p.sum(axis=2))
        if sink is not None:
            l_sum = rnd(l_sum + rnd(np.exp(sink - m)))
        vclean = np.where(np.isfinite(vh), vh, 0.0)
        acc = np.einsum("hij,jhd->hid", p, vclean)
        # keys whose v is not finite: add their terms only where they are visible
        bad = np.flatnonzero(~np.isfinite(vh).all(axis=(1, 2)))
        for j in bad:
            vj = np.where(np.isfinite(vh[j]), 0.0, vh[j])  # the finite part is in acc already
            term = p[:, :, j, None] * vj[:, None, :]
            acc = acc + np.where(visible[:, :, j, None], term, 0.0)
        acc = rnd(acc)
        out = np.where(any_vis[:, :, None], rnd(acc / l_sum[:, :, None]), 0.0)
        lse_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        lse = np.where(any_vis, m + np.log(l_sum), -np.inf)
        lse = lse.astype(np.dtype(dtype)).astype(lse_dtype).astype(np.float64)
    return out.transpose(1, 0, 2), lse


def seq_call(q, k, v, *, q_batch, q_row0, q_len, k_batch, k_row0, k_len, q_pos0, k_pos0,
             causal=False, ring=0, window=(None, None), softcap=None, alibi=None, scale=None,
             need_lse=True):
    """A backend-level AttnCall from per-sequence lists (for driving kernels below the API):
    bottom-right causal (``causal_hi`` 0), ``window`` as (left, right) key offsets or None,
    ``alibi`` (n_seq, Hq) slopes, ``ring`` the ring-buffer length (0: none)."""
    from attnlib.backends.base import AttnCall, AttnOptions

    i64 = lambda x: np.asarray(x, np.int64)  # noqa: E731
    n = len(q_len)
    options = AttnOptions(
        scale=float(scale if scale is not None else 1.0 / np.sqrt(q.shape[3])),
        causal="bottom_right" if causal else None, window_left=window[0],
        window_right=window[1], softcap=softcap,
        alibi=None if alibi is None else np.asarray(alibi, np.float32))
    return AttnCall(
        q=q, k=k, v=v, q_batch=i64(q_batch), q_row0=i64(q_row0), q_len=i64(q_len),
        k_batch=i64(k_batch), k_row0=i64(k_row0), k_len=i64(k_len), q_pos0=i64(q_pos0),
        k_pos0=i64(k_pos0), causal_hi=np.zeros(n, np.int64) if causal else None,
        options=options, ring=ring, need_lse=need_lse)


def reference_call(call, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """out (Bq, Sq, Hq, Dv), lse (Bq, Hq, Sq) of a backend-level ``AttnCall`` (sequences, row
    offsets, positions, ring buffer, causal / window bounds, softcap, ALiBi, sinks; no masks)
    from :func:`attend` per sequence: ``dtype`` float64 for the reference, the inputs' dtype for
    the naive same-dtype run. For checking kernels driven below the API."""
    q, k, v = call.q, call.k, call.v
    bq, sq_arr, hq, _ = q.shape
    out = np.zeros((bq, sq_arr, hq, v.shape[3]))
    lse = np.full((bq, hq, sq_arr), -np.inf)
    for s in range(call.n_seq):
        qb, qr, ql = int(call.q_batch[s]), int(call.q_row0[s]), int(call.q_len[s])
        kb, kr, kl = int(call.k_batch[s]), int(call.k_row0[s]), int(call.k_len[s])
        rows = kr + np.arange(kl)
        if call.ring:
            rows = np.where(rows >= call.ring, rows - call.ring, rows)
        qpos = call.q_pos0[s] + np.arange(ql)
        kpos = call.k_pos0[s] + np.arange(kl)
        dd = kpos[None, :] - qpos[:, None]
        vis = np.ones((ql, kl), bool)
        if call.causal_hi is not None:
            vis &= dd <= call.causal_hi[s]
        if call.options.window_left is not None:
            vis &= -call.options.window_left <= dd
        if call.options.window_right is not None:
            vis &= dd <= call.options.window_right
        o, ls = attend(q[qb, qr:qr + ql], k[kb, rows], v[kb, rows], qpos, kpos, vis,
                       scale=call.options.scale, softcap=call.options.softcap,
                       alibi=None if call.options.alibi is None else call.options.alibi[s],
                       sinks=call.options.sinks, dtype=dtype)
        out[qb, qr:qr + ql] = o
        lse[qb, :, qr:qr + ql] = ls
    return out, lse


def _bhsd_to_bshd(x):
    return None if x is None else np.swapaxes(np.asarray(x), 1, 2)


def reference_attention(q, k, v, *, scale=None, causal=False, window=None, mask=None,
                        softcap=None, alibi_slopes=None, sinks=None, layout="bshd",
                        dtype=np.float64):
    """contract §2 on dense inputs: returns (out, lse) as float64, in ``layout``."""
    if layout == "bhsd":
        q, k, v = (_bhsd_to_bshd(a) for a in (q, k, v))
    q, k, v = (np.asarray(a) for a in (q, k, v))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    vis = dense_visibility(sq, sk, causal=causal, window=window)
    qpos = np.arange(sq) + (sk - sq)
    kpos = np.arange(sk)
    mask4 = None
    if mask is not None:
        mask4 = np.broadcast_to(np.asarray(mask), (b, hq, sq, sk))
    outs, lses = [], []
    for bi in range(b):
        visible = vis[None]
        additive = None
        if mask4 is not None:
            if mask4.dtype == bool:
                visible = visible & mask4[bi]
            else:
                additive = mask4[bi]
        slopes = None
        if alibi_slopes is not None:
            al = np.asarray(alibi_slopes, dtype=np.float32)
            slopes = al if al.ndim == 1 else al[bi]
        o, lse = attend(q[bi], k[bi], v[bi], qpos, kpos, visible, scale=scale, softcap=softcap,
                        alibi=slopes, additive=additive, sinks=sinks, dtype=dtype)
        outs.append(o)
        lses.append(lse)
    out = np.stack(outs)
    lse = np.stack(lses)
    if layout == "bhsd":
        out = _bhsd_to_bshd(out)
    return out, lse


def naive_attention(q, k, v, **kw):
    """The accuracy rule's ``naive_same_dtype``: the reference computed in q's dtype."""
    return reference_attention(q, k, v, dtype=np.asarray(q).dtype, **kw)


def reference_varlen(q, k, v, cu_q, cu_k, *, scale=None, causal=False, window=None,
                     softcap=None, alibi_slopes=None, sinks=None, dtype=np.float64):
    """attention_varlen by its definition: each sequence is a separate dense call."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    hq = q.shape[1]
    out = np.zeros((q.shape[0], hq, v.shape[2]))
    lse = np.full((hq, q.shape[0]), -np.inf)
    for bi in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[bi], cu_q[bi + 1], cu_k[bi], cu_k[bi + 1]
        slopes = None
        if alibi_slopes is not None:
            al = np.asarray(alibi_slopes)
            slopes = al if al.ndim == 1 else al[bi:bi + 1]
        o, s = reference_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale=scale,
                                   causal=causal, window=window, softcap=softcap,
                                   alibi_slopes=slopes, sinks=sinks, dtype=dtype)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = s[0]
    return out, lse


def reference_softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(x - m)
    total = e.sum(axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, e / np.where(total > 0, total, 1.0), np.where(np.isnan(total),
                                                                               np.nan, 0.0))


def reference_logsumexp(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return np.squeeze(m, axis=axis) + np.log(np.exp(x - m).sum(axis=axis))


def reference_rope(x, positions, *, theta=10000.0, interleaved=False, rotary_dim=None):
    """Plain rotate-half (GPT-NeoX) or adjacent-pair (GPT-J) rotary embedding, float64, bshd."""
    x = np.asarray(x, dtype=np.float64)
    b, s, _, d = x.shape
    r = d if rotary_dim is None else rotary_dim
    pos = np.broadcast_to(np.asarray(positions, dtype=np.float64), (b, s))
    inv_freq = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    ang = pos[:, :, None, None] * inv_freq  # (B, S, 1, r/2)
    cos, sin = np.cos(ang), np.sin(ang)
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        a, bb = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = a * cos - bb * sin
        out[..., 1::2] = a * sin + bb * cos
    else:
        # rotate_half: [x1, x2] -> [-x2, x1]
        cos2 = np.concatenate([cos, cos], axis=-1)
        sin2 = np.concatenate([sin, sin], axis=-1)
        half = np.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
        out = rot * cos2 + half * sin2
    return np.concatenate([out, rest], axis=-1)


class CacheModel:
    """contract §4 as a plain model: which absolute position each slot holds, in float64.

    ``slot_pos[b, slot]`` is the absolute position written there last (-1: never). A position
    ``p`` is held by sequence ``b`` iff ``p < lengths[b]`` and its slot still holds ``p``.
    """

    def __init__(self, max_batch, max_seq, hkv, d, dv, ring=False, dtype=np.float64):
        self.max_seq, self.ring = max_seq, ring
        self.dtype = np.dtype(dtype)  # the cache stores rotated keys in its own dtype
        self.k = np.zeros((max_batch, max_seq, hkv, d))
        self.v = np.zeros((max_batch, max_seq, hkv, dv))
        self.slot_pos = np.full((max_batch, max_seq), -1, np.int64)
        self.lengths = np.zeros(max_batch, np.int64)

    def update(self, rows, k, v, start_pos, rope=None):
        """Write k, v (B, S, Hkv, D) at ``start_pos`` (B,) into cache rows ``rows`` (B,)."""
        k = np.asarray(k, dtype=np.float64)
        for b, (row, sp) in enumerate(zip(rows, start_pos)):
            pos = sp + np.arange(k.shape[1])
            kb = k[b:b + 1]
            if rope is not None:
                kb = reference_rope(kb, pos[None], **rope).astype(self.dtype).astype(np.float64)
            slots = pos % self.max_seq
            self.k[row, slots] = kb[0]
            self.v[row, slots] = np.asarray(v[b], dtype=np.float64)
            self.slot_pos[row, slots] = pos
            self.lengths[row] = sp + k.shape[1]

    def reset(self, rows=None):
        rows = slice(None) if rows is None else rows
        self.lengths[rows] = 0
        self.slot_pos[rows] = -1

    def held(self, row):
        """(positions, slots) of the keys sequence ``row`` holds, in position order."""
        n = int(self.lengths[row])
        pos = np.arange(max(0, n - self.max_seq), n)
        slots = pos % self.max_seq
        ok = self.slot_pos[row, slots] == pos
        return pos[ok], slots[ok]

    def attend(self, q, rows, *, scale=None, causal=True, window=None, softcap=None,
               alibi_slopes=None, rope=None, sinks=None, dtype=np.float64):
        """attention_with_kvcache after the append: q (B, Sq, Hq, D) -> (out, lse) float64."""
        q = np.asarray(q, dtype=np.float64)
        b_n, sq, hq, d = q.shape
        scale = 1.0 / np.sqrt(d) if scale is None else scale
        outs, lses = [], []
        for b, row in enumerate(rows):
            kpos, slots = self.held(row)
            qpos = int(self.lengths[row]) - sq + np.arange(sq)
            qb = q[b]
            if rope is not None:
                qb = reference_rope(qb[None], qpos[None], **rope)[0]
            d_ = kpos[None, :] - qpos[:, None]
            vis = np.ones(d_.shape, bool)
            if causal:
                vis &= d_ <= 0
            if window is not None:
                left, right = window
                if left is not None and left >= 0:
                    vis &= -left <= d_
                if right is not None and right >= 0:
                    vis &= d_ <= right
            slopes = None
            if alibi_slopes is not None:
                al = np.asarray(alibi_slopes, np.float32)
                slopes = al if al.ndim == 1 else al[b]
            o, s = attend(qb, self.k[row, slots], self.v[row, slots], qpos, kpos, vis[None],
                          scale=scale, softcap=softcap, alibi=slopes, sinks=sinks, dtype=dtype)
            outs.append(o)
            lses.append(s)
        return np.stack(outs), np.stack(lses)
