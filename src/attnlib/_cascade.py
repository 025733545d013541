"""Cascade attention for paged calls whose sequences share a prompt (FlashInfer's cascade idea).

Sequences forked from one prompt hold the same leading full pages in their block tables. Read
per sequence, those pages are read once per sequence; here they are read once per group: the
query rows of the group's sequences attend over the shared pages together (consecutive rows of
its members as one sequence of many rows, non-causal), each sequence attends over its own
remaining pages with the call's rules, and the partial states are merged. All of it is one call
of partial states (:meth:`~attnlib.backends.base.Backend.attention_parts`) over the call's query
rows R = B * Sq seen ``P`` times:

* part 0: every sequence over its own keys (a group's members past their shared pages);
* part 1 + c: chunk c of each group's shared pages (the backend's ``parts_limits`` cut the
  prefix into chunks of keys and its rows into runs of rows; a kernel that groups at most 16
  packed rows reads the prefix once per 16 of them); rows of no group, or past their group's
  chunks, sit in sequences without keys (empty states: out 0, lse -inf).

The states are float32 (float64 for float64), so a float16 / bfloat16 output is rounded once,
after the merge, as the plain call rounds it; the call's sinks are folded in once, after the
merge. On the OpenCL backend the states and the merge stay on the device (merge.cl), device
queries included; numpy and numba merge on the host in float64.

It applies only where it is exact: every query row of a sequence in a group sees every shared
key with no position-dependent term, i.e. no ALiBi, no mask, causal rows at or past the
prefix's last position, a window that cuts no shared key for any row. A sequence that fails this
stays on the plain path (the group keeps the others). The block table must be a host array and
the query rows must be viewable as one (1, B * Sq) batch (a C-contiguous device query).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np

from . import registry
from .backends.base import AttnCall, Backend

#: the shortest shared prefix, in tokens, that the cascade takes on (at least one full page);
#: below it the extra call and merge cost more than the prefix reads they save. None disables.
MIN_PREFIX_TOKENS: int | None = 512


def attention(be: Backend, call: AttnCall):
    """``be.attention(call)`` for a paged call, with shared prefixes read once per group."""
    groups = groups_of(call, MIN_PREFIX_TOKENS)
    if not groups:
        return be.attention(call)
    parts, n_parts = parts_call(call, groups, *be.parts_limits(call))
    res = be.attention_parts(parts, n_parts)
    if res is None:
        res = _merged_on_host(be, parts, n_parts)
        if res is None:
            return be.attention(call)
    out, lse = res
    return out, (lse if call.need_lse else None)


def parts_call(call: AttnCall, groups: list[tuple[np.ndarray, int]], row_cap: int | None,
               key_cap: int | None) -> tuple[AttnCall, int]:
    """The :meth:`Backend.attention_parts` call of ``call``'s cascade over ``groups`` (of
    :func:`groups_of`) and its number of parts; ``row_cap`` / ``key_cap``: the backend's
    :meth:`~attnlib.backends.base.Backend.parts_limits`. The prefix parts depend only on the
    call's rows, the groups and the limits, so decode steps reuse them (:func:`_prefix_parts`);
    part 0 and the block table are made per call."""
    bq, sq_arr, hq, _ = call.q.shape
    ps, n_seq = call.page_size, call.n_seq
    table = np.asarray(call.block_table)
    flat0 = call.q_batch * sq_arr + call.q_row0
    group_of = np.full(n_seq, -1, np.int64)
    shared = np.zeros(n_seq, np.int64)  # shared pages of each sequence
    for g, (members, n_pages) in enumerate(groups):
        group_of[members], shared[members] = g, n_pages
    max_shared = int(shared.max())
    chunk = max_shared if key_cap is None else max(1, -(-int(key_cap) // ps))  # pages
    rows_cap = bq * sq_arr if row_cap is None else max(1, int(row_cap) // (hq // call.n_kv_heads))
    key = (bq * sq_arr, ps, chunk, rows_cap, call.options.window_left,
           call.options.window_right, call.causal_hi is None, flat0.tobytes(),
           call.q_len.tobytes(), group_of.tobytes(), tuple((int(m[0]), n) for m, n in groups))
    with _lock:
        pre = _memo.get(key)
    if pre is None:
        pre = _prefix_parts(call, groups, flat0, group_of, chunk, rows_cap)
        _remember(key, pre)
    fields, src_row, src_col, n_parts = pre
    # part 0: every sequence over its own pages; a member's table row starts past the prefix
    own_len = call.k_len - shared * ps
    own = dict(q_batch=np.zeros(n_seq, np.int64), q_row0=flat0, q_len=call.q_len,
               k_row0=call.k_row0, k_len=own_len, q_pos0=call.q_pos0,
               k_pos0=call.k_pos0 + shared * ps, causal_hi=call.causal_hi)
    width = max(int(np.max(-(-(call.k_row0 + own_len) // ps))), min(chunk, max_shared))
    tkey = ("table", id(table), width, key)
    with _lock:
        hit = _memo.get(tkey) if _kept(table) else None
    if hit is not None and hit[0] is table:
        new_table = hit[1]
    else:
        rows = np.concatenate([np.arange(n_seq), src_row])
        cols = np.concatenate([shared, src_col])[:, None] + np.arange(width)
        new_table = np.where(cols < table.shape[1], table[rows[:, None], np.minimum(
            cols, table.shape[1] - 1)], -1).astype(np.int32)
        if _kept(table):
            new_table.flags.writeable = False
            _remember(tkey, (table, new_table))
    per_seq = {k: (None if v is None else np.concatenate([v, fields[k]]))
               for k, v in own.items()}
    parts = replace(call, k_batch=np.zeros(new_table.shape[0], np.int64),
                    block_table=new_table, need_lse=True, dense=False, **per_seq)
    return parts, n_parts


#: what recent calls derived from their block tables and rows: prefix parts
#: (:func:`_prefix_parts`), and from a kept table (:func:`_kept`: a PagedKVCache keeps one
#: while no page changes) the parts' block table and the groups before the visibility check
_memo: OrderedDict[tuple, Any] = OrderedDict()
_MEMO_MAX = 64
_lock = threading.Lock()


def _kept(table: np.ndarray) -> bool:
    """A table that cannot change while it lives (a PagedKVCache's: read-only, owning its
    memory), so that what is derived from it may be found again by its identity; a caller's
    table may be rewritten in place between calls."""
    return not table.flags.writeable and table.base is None


def _remember(key: tuple, value: Any) -> None:
    with _lock:
        _memo[key] = value
        while len(_memo) > _MEMO_MAX:
            _memo.popitem(last=False)


def _prefix_parts(call: AttnCall, groups: list[tuple[np.ndarray, int]], flat0: np.ndarray,
                  group_of: np.ndarray, chunk: int, rows_cap: int) -> tuple:
    """Parts 1.. of :func:`parts_call`: chunk c (``chunk`` pages) of every group's prefix in
    part 1 + c, its members' consecutive rows in runs of at most ``rows_cap`` rows (and fewer
    where a window would hide a chunk's key from a run's row); rows of no group, or past their
    group's chunks, in sequences without keys. Returns (per-sequence fields, their table rows'
    source sequence and first column, number of parts)."""
    ps, n_rows = call.page_size, int(call.q.shape[0] * call.q.shape[1])
    wl, wr = call.options.window_left, call.options.window_right
    order = np.argsort(flat0, kind="stable")
    row_group = np.repeat(group_of[order], call.q_len[order])  # the group of each flat row
    n_chunks = np.array([-(-n // chunk) for _, n in groups] + [0])  # [-1]: rows of no group
    cols = ("q_batch", "q_row0", "q_len", "k_len", "q_pos0", "k_pos0", "causal_hi", "src_row",
            "src_col")
    out: list[tuple] = []
    for c in range(int(n_chunks.max())):
        label = np.where(n_chunks[row_group] > c, row_group, -1)
        edges = np.flatnonzero(np.diff(label)) + 1
        for a, b in zip([0, *edges.tolist()], [*edges.tolist(), n_rows]):
            g = int(label[a])
            if g < 0:  # rows that see no key in this part
                cap, keys, k0, q0, src, col = rows_cap, 0, 0, 0, 0, 0
            else:
                members, n_pages = groups[g]
                col = c * chunk
                keys, k0 = (min(col + chunk, n_pages) - col) * ps, col * ps
                # every row of a run sees every key of the chunk: rows at q0 .. q0 + len - 1,
                # kpos - qpos within [-window left, min(keys - 1, window right)]
                shift = 0 if wr is None else max(0, keys - 1 - wr)
                q0 = k0 + shift
                cap = rows_cap if wl is None else max(1, min(rows_cap, wl + 1 - shift))
                src = int(members[0])
            out += [(c + 1, r0, min(cap, b - r0), keys, q0, k0, max(keys - 1, 0), src, col)
                    for r0 in range(a, b, cap)]
    arr = np.array(out, np.int64).reshape(-1, len(cols))
    fields = {k: arr[:, i] for i, k in enumerate(cols[:7])}
    fields["k_row0"] = np.zeros(arr.shape[0], np.int64)
    if call.causal_hi is None:
        fields["causal_hi"] = None
    return fields, arr[:, 7], arr[:, 8], 1 + int(n_chunks.max())


def _merged_on_host(be: Backend, parts: AttnCall,
                    n_parts: int) -> tuple[np.ndarray, np.ndarray] | None:
    """:meth:`Backend.attention_parts` from :meth:`Backend.attention_state` (host queries):
    the states merged with the reference ``merge_states``, in float64, the sinks folded in as
    one more state (0, sink)."""
    q = parts.q
    if not isinstance(q, np.ndarray):
        return None
    b, s, hq, d = q.shape
    state = be.attention_state(replace(parts, q=np.broadcast_to(q.reshape(1, b * s, hq, d),
                                                              (n_parts, b * s, hq, d)),
                                       options=replace(parts.options, sinks=None)))
    if state is None:
        return None
    out, lse = (np.asarray(be.to_numpy(x), np.float64) for x in state)
    outs, lses = [o[None] for o in out], [x[None] for x in lse]
    sinks = parts.options.sinks
    if sinks is not None:
        outs.append(np.zeros_like(outs[0]))
        lses.append(np.broadcast_to(sinks.astype(np.float64)[None, :, None],
                                    lses[0].shape))
    m_out, m_lse = registry.get_backend("numpy").merge_states(outs, lses)
    dv = out.shape[3]
    wide = np.float64 if parts.dtype == np.float64 else np.float32
    m_lse = np.ascontiguousarray(m_lse[0].reshape(hq, b, s).transpose(1, 0, 2), wide)
    return m_out.reshape(b, s, hq, dv).astype(parts.dtype), m_lse


def groups_of(call: AttnCall, min_prefix_tokens: int | None) -> list[tuple[np.ndarray, int]]:
    """The groups the cascade takes: (member sequences, shared full pages), each with >= 2
    members and a prefix of >= ``min_prefix_tokens`` tokens. Sequences are grouped by their
    first page; a group's prefix is the leading run of page ids all its members hold as full
    pages; a member whose rows would not all see the whole prefix leaves the group."""
    table = call.block_table
    if (min_prefix_tokens is None or call.n_seq < 2 or not isinstance(table, np.ndarray)
            or not _rows_viewable(call.q) or call.options.alibi is not None
            or call.mask_view is not None or call.ring or call.page_size < 1):
        return []
    ps = call.page_size
    full = call.k_len // ps
    key = ("groups", id(table), table.shape, min_prefix_tokens, full.tobytes(),
           call.q_len.tobytes(), call.k_row0.tobytes())
    with _lock:
        hit = _memo.get(key) if _kept(table) else None
    if hit is not None and hit[0] is table:
        shared = hit[1]
    else:
        shared = _shared_pages(table, full, call.q_len, call.k_row0, ps, min_prefix_tokens)
        if _kept(table):
            _remember(key, (table, shared))
    groups = []
    for members, n_pages in shared:
        members = members[_sees_prefix(call, members, n_pages * ps)]
        if members.size >= 2:
            groups.append((members, n_pages))
    return groups


def _shared_pages(table: np.ndarray, full: np.ndarray, q_len: np.ndarray, k_row0: np.ndarray,
                  ps: int, min_prefix_tokens: int) -> list[tuple[np.ndarray, int]]:
    """:func:`groups_of` before the visibility check: sequences with query rows grouped by
    their first page, with the leading run of full pages all of them hold."""
    cand = np.flatnonzero((q_len > 0) & (full >= 1) & (k_row0 == 0))
    by_first: dict[int, list[int]] = {}
    for s in cand.tolist():
        by_first.setdefault(int(table[s, 0]), []).append(s)
    groups = []
    for first in by_first.values():
        if len(first) < 2:
            continue
        members = np.array(first, np.int64)
        width = int(full[members].min())
        same = (table[members, :width] == table[members[0], :width]).all(axis=0)
        n_pages = width if same.all() else int(np.argmin(same))
        if n_pages >= 1 and n_pages * ps >= min_prefix_tokens:
            groups.append((members, n_pages))
    return groups


def _rows_viewable(q: Any) -> bool:
    """The query rows can be seen as one (1, B * Sq) batch: numpy (copied where needed) or a
    C-contiguous device array."""
    return isinstance(q, np.ndarray) or bool(getattr(getattr(q, "flags", None), "c_contiguous",
                                                     False))


def _sees_prefix(call: AttnCall, s: np.ndarray, n_keys: int) -> np.ndarray:
    """Per sequence ``s``: does every query row see every one of the first ``n_keys`` keys?"""
    first_q, last_q = call.q_pos0[s], call.q_pos0[s] + call.q_len[s] - 1
    first_k, last_k = call.k_pos0[s], call.k_pos0[s] + n_keys - 1
    ok = np.ones(s.size, bool)
    if call.causal_hi is not None:
        ok &= last_k - first_q <= call.causal_hi[s]
    if call.options.window_left is not None:
        ok &= first_k - last_q >= -call.options.window_left
    if call.options.window_right is not None:
        ok &= last_k - first_q <= call.options.window_right
    return ok
