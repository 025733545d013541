"""Cascade attention for paged calls whose sequences share a prompt (FlashInfer's cascade idea).

Sequences forked from one prompt hold the same leading full pages in their block tables. Read
per sequence, those pages are read once per sequence; here they are read once per group: the
query rows of every sequence of the group attend over the shared pages together (one sequence of
many rows, non-causal), each sequence attends over its own remaining pages with the call's rules,
and the two partial states are merged with the reference ``merge_states`` (numpy, in float64:
host arrays of a few rows per sequence). The result is the plain call's, ``out`` and ``lse``,
within the accuracy rule.

It applies only where it is exact: every query row of a sequence in a group sees every shared
key with no position-dependent term, i.e. no ALiBi, causal rows at or past the prefix's last
position, a window that cuts no shared key for any row. A sequence that fails this stays on the
plain path (the group keeps the others). Host tables and host queries only: a device-resident
table or query runs the plain call.

float32 and float64 only. Backends return partial outputs in the input dtype, so for float16 and
bfloat16 both partial states would be rounded before the merge rounds again: about one unit in
the last place, which the accuracy rule (twice the naive same-dtype error) does not always allow.
Those calls run the plain call until attention can return float32 partial states.
"""

from __future__ import annotations

from dataclasses import replace

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
    ps = call.page_size
    k_row0, k_pos0, k_len = call.k_row0.copy(), call.k_pos0.copy(), call.k_len.copy()
    for members, n_pages in groups:
        k_row0[members] += n_pages * ps
        k_pos0[members] += n_pages * ps
        k_len[members] -= n_pages * ps
    # every sequence over its own keys (the group's members past their shared pages); the
    # call's sinks are folded in here and not in the prefix call, so the merge counts them once
    out, lse = be.attention(replace(call, k_row0=k_row0, k_pos0=k_pos0, k_len=k_len,
                                    need_lse=True))
    # every group's rows together over its shared pages: one sequence per group
    bq, sq_arr, hq, d = call.q.shape
    rows_of = [np.concatenate([call.q_batch[s] * sq_arr + call.q_row0[s]
                               + np.arange(call.q_len[s]) for s in members.tolist()])
               for members, _ in groups]
    n_rows = np.array([r.size for r in rows_of], np.int64)
    rows = np.concatenate(rows_of)
    q = np.asarray(call.q)
    q_group = q.reshape((1, bq * sq_arr, hq, d))[:, rows]
    n_pages = np.array([n for _, n in groups], np.int64)
    table = np.full((len(groups), int(n_pages.max())), -1, np.int32)
    for g, (members, n) in enumerate(groups):
        table[g, :n] = call.block_table[members[0], :n]
    zeros = np.zeros(len(groups), np.int64)
    prefix = AttnCall(q=q_group, k=call.k, v=call.v, q_batch=zeros, q_row0=np.cumsum(n_rows)
                      - n_rows, q_len=n_rows, k_batch=zeros.copy(), k_row0=zeros.copy(),
                      k_len=n_pages * ps, q_pos0=n_pages * ps, k_pos0=zeros.copy(),
                      causal_hi=None, options=replace(call.options, causal=None, window_left=None,
                                                      window_right=None, sinks=None),
                      need_lse=True,
                      block_table=table, page_size=ps, k_scales=call.k_scales,
                      v_scales=call.v_scales)
    p_out, p_lse = be.attention(prefix)
    # the two partial states of each group row, merged on the host (the cascade runs only for
    # host queries) with the reference merge, in float64
    b_idx, r_idx = rows // sq_arr, rows % sq_arr
    own_out = np.asarray(out)[b_idx, r_idx][None]
    own_lse = np.asarray(lse)[b_idx, :, r_idx].T[None]
    m_out, m_lse = registry.get_backend("numpy").merge_states(
        [np.asarray(p_out, own_out.dtype), own_out], [np.asarray(p_lse), own_lse])
    out, lse = np.array(out), np.array(lse)
    out[b_idx, r_idx] = np.asarray(m_out)[0].astype(call.dtype)
    lse[b_idx, :, r_idx] = np.asarray(m_lse)[0].T
    return out, (lse if call.need_lse else None)


def groups_of(call: AttnCall, min_prefix_tokens: int | None) -> list[tuple[np.ndarray, int]]:
    """The groups the cascade takes: (member sequences, shared full pages), each with >= 2
    members and a prefix of >= ``min_prefix_tokens`` tokens. Sequences are grouped by their
    first page; a group's prefix is the leading run of page ids all its members hold as full
    pages; a member whose rows would not all see the whole prefix leaves the group."""
    table = call.block_table
    if (min_prefix_tokens is None or call.n_seq < 2 or not isinstance(table, np.ndarray)
            or not isinstance(call.q, np.ndarray) or call.options.alibi is not None
            or call.mask_view is not None or call.ring or call.page_size < 1
            or call.dtype not in (np.float32, np.float64)):
        return []
    ps = call.page_size
    full = call.k_len // ps
    cand = np.flatnonzero((call.q_len > 0) & (full >= 1) & (call.k_row0 == 0))
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
        if n_pages < 1 or n_pages * ps < min_prefix_tokens:
            continue
        members = members[_sees_prefix(call, members, n_pages * ps)]
        if members.size >= 2:
            groups.append((members, n_pages))
    return groups


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
