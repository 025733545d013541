"""Decoding over a KV cache sharded across ranks: each rank attends over its own KVCache, and
the partial states are merged exactly with merge_across."""

from __future__ import annotations

import numpy as np

from .. import _spec, registry
from ..backends.base import AttnCall
from ..kv_cache import KVCache
from ._comm import check_comm, collective_check
from ._options import options_of
from ._ring import merge_across


@_spec.front_door
@_spec.keywords_checked
def attention_with_sharded_kvcache(q, cache, comm, k=None, v=None, *, start_pos=None,
                                   batch_idx=None, rope=None, causal=True, scale=None,
                                   window=None, softcap=None, alibi_slopes=None, sinks=None,
                                   return_lse=False, backend=None):
    """``attnlib.attention_with_kvcache`` over one sequence per batch row whose tokens are split
    across the ranks' caches: the same result on every rank.

    Each rank holds its own ``attnlib.KVCache`` (same heads, head dims and dtype on every rank);
    the sequence of batch row ``b`` is rank 0's tokens of that row, then rank 1's, and so on:
    rank ``r``'s position ``p`` is global position ``off_r + p`` with ``off_r`` the lengths
    (``cache.lengths``, after this call's appends) of ranks ``0..r-1`` together. ``k``, ``v``
    (with ``start_pos``, ``batch_idx``) are appended to this rank's cache as
    ``attention_with_kvcache`` does; a decoding loop appends new tokens on the last rank, which
    holds the tail. Every rank passes the same ``q (B, Sq, Hq, D)``; query row ``i`` sits at
    global position ``total - Sq + i`` (``total``: the lengths of every rank together), and
    ``causal`` (bottom-right, the default), ``window`` and ``alibi_slopes`` use global
    positions. Returns ``out (B, Sq, Hq, Dv)`` in the cache's dtype, and with ``return_lse``
    ``lse (B, Hq, Sq)``, equal to ``attention_with_kvcache`` over one cache holding the whole
    sequence: each rank attends over its own tokens (``return_lse``), then :func:`merge_across`.
    ``sinks`` (float32 ``(Hq,)``) join rank 0's state only, so the merge counts them once.

    ``rope=`` is not taken (ArgumentError): a rank's cache does not know the global position of
    the tokens it writes; rotate q and k with ``attnlib.rope`` at their global positions first.

    Collective: shapes, dtypes, options and the caches' geometry are compared across ranks, and
    a local error (e.g. ``CacheOverflowError`` on the rank that appends) or a mismatch raises the
    same error on every rank, before any cache changes; ``Sq`` larger than a sequence's total
    length is a ShapeError on every rank.
    """

    def local():
        check_comm(comm)
        _spec.check_no_rope(rope)
        _spec.check_cache_instance(cache, KVCache)
        be = cache.backend
        _spec.check_cache_backend(
            backend, None if backend is None else registry.get_backend(backend), be)
        need_lse = _spec.check_bool(return_lse, "return_lse")
        b, sq, hq, d = _spec.check_cache_query(q, cache.dtype, cache.head_dim, cache.n_kv_heads,
                                               cache.max_batch_size, batch_idx is not None)
        opts = options_of(_spec.attn_options(d, hq, b, scale=scale, causal=causal,
                                             window=window, softcap=softcap,
                                             alibi_slopes=alibi_slopes, sinks=sinks,
                                             top_left=False))
        _spec.check_kv_given(k, v, start_pos)
        if k is None:
            rows = cache._rows(batch_idx, "batch_idx", b)
            write, new_len, lo = None, cache._len[rows], cache._lo[rows]
        else:
            write = cache._plan(k, v, start_pos, batch_idx, b)
            rows, new_len, lo = write.rows, write.new_len, np.minimum(write.new_lo, write.new_len)
        _spec.check_readable(q, "q", be)
        desc = [("q shape", "ShapeError", tuple(q.shape)),
                ("dtype", "DTypeError", str(cache.dtype)),
                ("cache heads and head dims", "ShapeError",
                 (cache.n_kv_heads, cache.head_dim, cache.head_dim_v)),
                *opts.describe(),
                ("return_lse", "ArgumentError", need_lse)]
        # the sinks join rank 0's state only, so the merge counts them once
        fields = dict(causal_hi=np.zeros(b, np.int64) if opts.causal else None,
                      options=opts.block_options(comm.Get_rank() == 0),
                      ring=cache.max_seq_len if cache.ring else 0, need_lse=True)
        return desc, (be, write, rows, np.asarray(new_len, np.int64),
                      np.asarray(lo, np.int64), fields)

    name = "attention_with_sharded_kvcache"
    be, write, rows, new_len, lo, fields = collective_check(comm, name, local)
    lengths = np.stack(comm.allgather(new_len))  # (P, B): every rank's length after appends
    b, sq, hq = q.shape[:3]
    collective_check(comm, name, lambda: ([], _spec.check_sharded_held(lengths, sq)))
    # -- every check passed on every rank: only now touch the cache
    if write is not None:
        cache._commit(write, None)
    rank = comm.Get_rank()
    off, total = lengths[:rank].sum(axis=0), lengths.sum(axis=0)
    if sq == 0 or b == 0:
        acc = np.float64 if cache.dtype == np.float64 else np.float32
        out = np.zeros((b, sq, hq, cache.head_dim_v), cache.dtype)
        lse = np.full((b, hq, sq), -np.inf, acc)
    else:
        call = AttnCall(
            q=q, k=cache.k, v=cache.v,
            q_batch=np.arange(b, dtype=np.int64), q_row0=np.zeros(b, dtype=np.int64),
            q_len=np.full(b, sq, dtype=np.int64),
            k_batch=rows.copy(), k_row0=lo % cache.max_seq_len, k_len=new_len - lo,
            q_pos0=total - sq, k_pos0=off + lo, **fields)
        out, lse = be.attention(call)
    out, lse = merge_across(out, lse, comm, backend=be)
    return (out, lse) if return_lse else out
