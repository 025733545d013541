"""The KV cache (contract §4) and the paged KV cache (contract §8)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._quant import FORMATS, KVFormat, format_of
from ..errors import ArgumentError, CacheOverflowError, DTypeError, ShapeError
from ._arrays import (
    BFLOAT16,
    check_array,
    check_float_dtype,
    check_int,
    check_seqlens,
    host,
    is_array,
    is_device_array,
    parse_dtype,
)
from ._calls import add_batch_dim

# ---- the KV cache (contract §4) ---------------------------------------------------------------

def check_cache_geometry(n_kv_heads: Any, head_dim: Any, head_dim_v: Any,
                         dtype: Any) -> tuple[int, int, int, np.dtype]:
    """(n_kv_heads, head_dim, head_dim_v, dtype) of a KV cache, contiguous or paged; head_dim_v
    None means head_dim."""
    hkv = check_int(n_kv_heads, "n_kv_heads", minimum=1)
    d = check_int(head_dim, "head_dim", minimum=1)
    dv = d if head_dim_v is None else check_int(head_dim_v, "head_dim_v", minimum=1)
    return hkv, d, dv, parse_dtype(dtype)

def check_cache_rows(index: Any, name: str, b: int | None, max_batch_size: int) -> np.ndarray:
    """Cache rows as int64: ``None`` is every row (or the first ``b``), else an int, a list /
    tuple of ints or an int array ``(b,)``, each in ``[0, max_batch_size)``."""
    if index is None:
        return np.arange(max_batch_size if b is None else b, dtype=np.int64)
    if is_array(index):
        idx = host(index)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise ArgumentError(
                f"{name} must be an int array (B,), got {idx.dtype} {idx.shape}"
            )
        idx = idx.astype(np.int64)
    elif isinstance(index, (list, tuple)):
        idx = np.array([check_int(i, name) for i in index], dtype=np.int64)
    else:
        idx = np.array([check_int(index, name)], dtype=np.int64)
    if b is not None and idx.shape != (b,):
        raise ShapeError(f"{name} has shape {idx.shape}; expected ({b},)")
    if idx.size and (idx.min() < 0 or idx.max() >= max_batch_size):
        raise ArgumentError(
            f"{name}={idx.tolist()} has entries outside [0, {max_batch_size})"
        )
    return idx


def check_distinct_rows(rows: np.ndarray) -> None:
    """A write names each cache row at most once."""
    if rows.shape[0] > 1 and len(np.unique(rows)) != rows.shape[0]:
        raise ArgumentError(f"batch_idx={rows.tolist()} writes one cache row twice")


def check_cache_kv(k: Any, v: Any, b: int | None, dtype: np.dtype, n_kv_heads: int,
                   head_dim: int, head_dim_v: int, max_batch_size: int) -> int:
    """New keys ``(B, S_new, n_kv_heads, head_dim)`` and values ``(..., head_dim_v)`` of the
    cache's dtype; ``b``: q's batch when there is a q. Returns B."""
    for name, x, d in (("k", k, head_dim), ("v", v, head_dim_v)):
        check_array(x, name, ndim=4)
        if np.dtype(x.dtype) != dtype:
            raise DTypeError(f"{name} has dtype {x.dtype}; this cache holds {dtype}")
        if x.shape[2] != n_kv_heads or x.shape[3] != d:
            raise ShapeError(
                f"{name} has shape {tuple(x.shape)}; expected "
                f"(B, S_new, {n_kv_heads}, {d})"
            )
    if tuple(k.shape[:2]) != tuple(v.shape[:2]):
        raise ShapeError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    if b is not None and k.shape[0] != b:
        raise ShapeError(f"k has batch {k.shape[0]} but q has {b}")
    if k.shape[0] > max_batch_size:
        raise ShapeError(f"k has batch {k.shape[0]} > max_batch_size={max_batch_size}")
    return k.shape[0]


def check_start_pos(start_pos: Any, b: int) -> np.ndarray:
    """``start_pos`` (an int or an int array ``(b,)``, each >= 0) as int64 ``(b,)``."""
    if type(start_pos) is int:  # the common case, without the generic checks' cost
        if start_pos < 0:
            raise ArgumentError(f"start_pos={start_pos} must be >= 0")
        return np.full(b, start_pos, dtype=np.int64)
    if is_array(start_pos):
        sp = host(start_pos)
        if sp.dtype.kind not in "iu":
            raise ArgumentError(f"start_pos has dtype {sp.dtype}; expected an int or int array")
        if sp.shape != (b,):
            raise ArgumentError(f"start_pos has shape {sp.shape}; expected ({b},)")
        sp = sp.astype(np.int64)
        if (sp < 0).any():
            raise ArgumentError(f"start_pos={sp.tolist()} must be >= 0 in every row")
        return sp
    sp_int = check_int(start_pos, "start_pos")
    if sp_int < 0:
        raise ArgumentError(f"start_pos={sp_int} must be >= 0")
    return np.full(b, sp_int, dtype=np.int64)


def _first(bad: np.ndarray) -> int:
    """Index of the first offending row, for the error message."""
    return int(np.flatnonzero(bad)[0])


def check_cache_write(rows: np.ndarray, start: np.ndarray, cur: np.ndarray, lo: np.ndarray,
                      n_new: int, cap: int, ring: bool) -> tuple[np.ndarray, np.ndarray]:
    """Writing ``n_new`` tokens at ``start`` into cache ``rows`` that hold positions
    ``[lo, cur)``: no gap; within ``cap`` slots (``ring=False``), or at most ``cap`` tokens and
    no position the ring no longer holds. Returns (new lengths, new first held positions)."""
    gap = start > cur
    if gap.any():
        i = _first(gap)
        raise ArgumentError(
            f"start_pos={int(start[i])} for cache row {int(rows[i])} leaves a gap: that row "
            f"holds {int(cur[i])} tokens, so start_pos must be <= {int(cur[i])}"
        )
    end = start + n_new
    if not ring:
        over = end > cap
        if over.any():
            i = _first(over)
            raise CacheOverflowError(
                f"writing {n_new} tokens at start_pos={int(start[i])} into cache row "
                f"{int(rows[i])} needs {int(end[i])} slots > max_seq_len={cap} (ring=False); "
                "the cache is unchanged"
            )
        return end, lo.copy()
    if n_new > cap:
        raise CacheOverflowError(
            f"k has {n_new} new tokens but a ring cache holds at most max_seq_len={cap} "
            "per update; the cache is unchanged"
        )
    stale = start < lo
    if stale.any():
        i = _first(stale)
        raise ArgumentError(
            f"start_pos={int(start[i])} for cache row {int(rows[i])} rewrites a position no "
            f"longer held (this ring holds positions {int(lo[i])}..{int(cur[i]) - 1})"
        )
    return end, np.maximum(lo, end - cap)


def check_cache_append_one(row: int, cur: int, lo: int, n_new: int, cap: int,
                           ring: bool) -> tuple[int, int]:
    """:func:`check_cache_write` for one cache row appending at its length (the decode step),
    on plain ints; a failing check raises through :func:`check_cache_write`."""
    end = cur + n_new
    if ring:
        if n_new > cap:
            _raise_append(row, cur, lo, n_new, cap, ring)
        return end, max(lo, end - cap)
    if end > cap:
        _raise_append(row, cur, lo, n_new, cap, ring)
    return end, lo


def _raise_append(row: int, cur: int, lo: int, n_new: int, cap: int, ring: bool) -> None:
    one = np.array([cur], np.int64)
    check_cache_write(np.array([row], np.int64), one, one, np.array([lo], np.int64), n_new,
                      cap, ring)


def check_cache_query(q: Any, dtype: np.dtype, head_dim: int, n_kv_heads: int,
                      max_batch_size: int, rows_given: bool) -> tuple[int, int, int, int]:
    """q ``(B, Sq, Hq, head_dim)`` of the cache's dtype, ``Hq`` a multiple of ``n_kv_heads``,
    ``B <= max_batch_size`` unless ``batch_idx`` maps it. Returns q's shape."""
    check_array(q, "q", ndim=4)
    check_cache_query_kind(q, dtype, head_dim, n_kv_heads)
    b, sq, hq, d = q.shape
    if b > max_batch_size and not rows_given:
        raise ShapeError(f"q has batch {b} > max_batch_size={max_batch_size}")
    return b, sq, hq, d


def check_cache_query_kind(q: Any, dtype: np.dtype, head_dim: int, n_kv_heads: int) -> None:
    """A 4-D q of a cache (KVCache or PagedKVCache): the cache's dtype and head_dim, ``Hq`` a
    multiple of ``n_kv_heads``."""
    if np.dtype(q.dtype) != dtype:
        raise DTypeError(f"q has dtype {q.dtype}; this cache holds {dtype}")
    hq, d = q.shape[2], q.shape[3]
    if d != head_dim:
        raise ShapeError(f"q has head dim {d}; this cache holds head_dim={head_dim}")
    if hq < 1 or hq % n_kv_heads:
        raise ShapeError(f"q has {hq} heads; need a multiple of n_kv_heads={n_kv_heads}")


def check_cache_instance(cache: Any, cls: type) -> None:
    """``cache`` is an instance of the cache class ``cls`` (KVCache or PagedKVCache)."""
    if not isinstance(cache, cls):
        raise ArgumentError(f"cache must be an attnlib.{cls.__name__}, got {type(cache).__name__}")


def check_cache_backend(backend: Any, chosen: Any, be: Any) -> None:
    """``backend=`` beside a cache (``chosen``: what it names) must be the cache's ``be``."""
    if backend is not None and chosen is not be:
        raise ArgumentError(
            f"backend={backend!r} differs from the cache's backend {be.name!r}; attention over a "
            "cache runs where the cache lives"
        )


def check_kv_given(k: Any, v: Any, start_pos: Any) -> None:
    """``k`` and ``v`` together or neither; ``start_pos`` only with them."""
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (or both left out)")
    if k is None and start_pos is not None:
        raise ArgumentError("start_pos was given without k and v; there is nothing to write")


def check_held(rows: np.ndarray, new_len: np.ndarray, sq: int) -> None:
    """Each cache row holds at least Sq tokens (after the append)."""
    short = new_len < sq
    if short.any():
        i = _first(short)
        raise ShapeError(
            f"q has Sq={sq} rows but cache row {int(rows[i])} holds only {int(new_len[i])} "
            "tokens; Sq must be <= each sequence's length"
        )


def check_held_one(row: int, length: int, sq: int) -> None:
    """:func:`check_held` for one cache row, on plain ints."""
    if length < sq:
        check_held(np.array([row], np.int64), np.array([length], np.int64), sq)


def check_readable(x: Any, name: str, be: Any) -> None:
    """A device array ``x`` must belong to the backend ``be`` (the cache's)."""
    if is_device_array(x) and not be.owns(x):
        raise ArgumentError(
            f"{name} is a {type(x).__module__}.{type(x).__name__} array, which the cache's "
            f"backend {be.name!r} cannot read"
        )


# ---- the paged KV cache (contract §8) ---------------------------------------------------------
def check_int_list(x: Any, name: str) -> np.ndarray:
    """An int, a list/tuple of ints or a 1-D int array as int64 (B,) (ids, lengths)."""
    if is_array(x):
        a = host(x)
        if a.dtype.kind not in "iu" or a.ndim != 1:
            raise ArgumentError(f"{name} must be an int or ints (B,), got {a.dtype} {a.shape}")
        return a.astype(np.int64)
    if isinstance(x, (list, tuple)):
        if all(type(i) is int for i in x):  # plain ints (not bool): a decode step's ids
            return np.array(x, np.int64)
        return np.array([check_int(i, f"{name}[{n}]") for n, i in enumerate(x)], np.int64)
    return np.array([check_int(x, name)], np.int64)


def check_sids(sids: Any, known: Any, name: str = "sids") -> np.ndarray:
    """Sequence ids of a paged cache: each one live (in ``known``), none twice."""
    ids = check_int_list(sids, name)
    for i in ids.tolist():
        if i not in known:
            raise ArgumentError(
                f"{name} holds {i}, which is not a live sequence of this cache (unknown or freed)"
            )
    if np.unique(ids).size != ids.size:
        raise ArgumentError(f"{name}={ids.tolist()} names a sequence twice; ids must be distinct")
    return ids


def check_sid(sid: Any, known: Any, name: str = "sid") -> int:
    """One live sequence id of a paged cache."""
    sid = check_int(sid, name)
    if sid not in known:
        raise ArgumentError(
            f"{name}={sid} is not a live sequence of this cache (unknown or freed)"
        )
    return sid


def check_packed(x: Any, name: str, n_seq: int, cu: Any, cu_name: str, heads: int, dim: int,
                 dtype: np.dtype, heads_name: str = "n_kv_heads",
                 dim_name: str = "head_dim") -> np.ndarray:
    """``x`` either ``(n_seq, S, heads, dim)`` (``cu`` None) or packed ``(total, heads, dim)``
    split by ``cu`` (int (n_seq + 1,)); returns int64 (n_seq,) rows per sequence. dtype exact."""
    check_array(x, name, ndim=4 if cu is None else 3)
    if np.dtype(x.dtype) != dtype:
        raise DTypeError(f"{name} has dtype {x.dtype}; this cache holds {dtype} (nothing is cast)")
    if tuple(x.shape[-2:]) != (heads, dim):
        lead = "(B, S, " if cu is None else "(total, "
        raise ShapeError(
            f"{name} has shape {tuple(x.shape)}; expected {lead}{heads_name}={heads}, "
            f"{dim_name}={dim})"
        )
    if cu is None:
        if x.shape[0] != n_seq:
            raise ShapeError(f"{name} has batch {x.shape[0]} but {n_seq} sequence ids were given")
        return np.full(n_seq, x.shape[1], np.int64)
    c = check_seqlens(cu, cu_name, x.shape[0])
    if c.shape[0] != n_seq + 1:
        raise ArgumentError(
            f"{cu_name} has {c.shape[0] - 1} sequences but {n_seq} sequence ids were given"
        )
    return np.diff(c)


def check_query_rows(q_len: np.ndarray, k_len: np.ndarray, what: str) -> None:
    """More query rows than a sequence holds is a ShapeError (contract §4 and §8)."""
    short = k_len < q_len
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise ShapeError(
            f"q has {int(q_len[i])} rows for {what} {i} but it holds only {int(k_len[i])} "
            "tokens; query rows must be <= each sequence's length"
        )


def check_page_table(block_table: Any, seq_lens: Any, n_seq: int, num_pages: int,
                     page_size: int) -> tuple[Any, np.ndarray]:
    """``paged_attention``'s caller-owned ``block_table`` (int32/int64 ``(B, max_pages)``) and
    ``seq_lens`` (int ``(B,)``, read to the host). A host table is checked entry by entry: every
    page a sequence needs must be in ``[0, num_pages)``. A device table is taken as given (the
    kernels clamp page indices into the pool). Returns (table, int64 seq_lens)."""
    check_array(block_table, "block_table", ndim=2)
    if np.dtype(block_table.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise DTypeError(f"block_table has dtype {block_table.dtype}; expected int32 (or int64)")
    if block_table.shape[0] != n_seq:
        raise ShapeError(
            f"block_table has shape {tuple(block_table.shape)}; expected ({n_seq}, max_pages)"
        )
    check_array(seq_lens, "seq_lens", ndim=1)
    lens = host(seq_lens)
    if lens.dtype.kind not in "iu":
        raise DTypeError(f"seq_lens has dtype {lens.dtype}; expected int32")
    if lens.shape != (n_seq,):
        raise ShapeError(f"seq_lens has shape {lens.shape}; expected ({n_seq},)")
    lens = lens.astype(np.int64)
    cap = int(block_table.shape[1]) * page_size
    bad = (lens < 0) | (lens > cap)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ArgumentError(
            f"seq_lens[{i}] = {int(lens[i])}; expected 0 <= seq_lens <= max_pages * page_size "
            f"= {cap}"
        )
    if isinstance(block_table, np.ndarray):
        need = -(-lens // page_size)
        used = np.arange(block_table.shape[1])[None, :] < need[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bad.any():
            b, j = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(
                f"block_table[{b}, {j}] = {int(block_table[b, j])}, but sequence {b} holds "
                f"{int(lens[b])} tokens and needs that page; expected a page in "
                f"[0, {num_pages})"
            )
    return block_table, lens


def check_truncate_length(length: int, sid: int, held: int) -> None:
    """``truncate`` only shortens: ``length`` at most the ``held`` tokens of sequence ``sid``."""
    if length > held:
        raise ArgumentError(
            f"length={length} is beyond sequence {sid}'s length {held}; truncate only "
            "shortens"
        )


def check_paged_kv_agree(k: Any, v: Any, n_k: np.ndarray, n_v: np.ndarray) -> None:
    """k and v of one append agree in every dim but the last (rows per sequence included)."""
    if tuple(k.shape[:-2]) != tuple(v.shape[:-2]) or not np.array_equal(n_k, n_v):
        raise ShapeError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they "
                         "must agree in every dim but the last")


def check_paged_kv_arrays(k: Any, v: Any, be: Any) -> None:
    """k and v both numpy arrays or both device arrays of the cache's backend ``be``."""
    if is_device_array(k) != is_device_array(v) or (is_device_array(k) and not be.owns(k)):
        raise ArgumentError(
            f"k and v must both be numpy arrays or both arrays of the cache's backend "
            f"{be.name!r}, got {type(k).__name__} and {type(v).__name__}"
        )


def check_pages_free(taken: int, n_free: int, num_pages: int) -> None:
    """An append needing ``taken`` pages (copies-on-write included) fits the ``n_free`` free."""
    if taken > n_free:
        raise CacheOverflowError(
            f"this append needs {taken} free pages (copies-on-write included) but "
            f"{n_free} of {num_pages} are free; the cache is unchanged"
        )


def paged_queries(q: Any, cu_seqlens_q: Any,
                  n_seq: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """q ``(B, Sq, Hq, D)`` or packed ``(total_q, Hq, D)`` with ``cu_seqlens_q``, for ``n_seq``
    sequences: (q as 4-D, q_batch, q_row0, q_len)."""
    if cu_seqlens_q is None:
        check_array(q, "q", ndim=4)
        if q.shape[0] != n_seq:
            raise ShapeError(f"q has batch {q.shape[0]} but there are {n_seq} sequences")
        return (q, np.arange(n_seq, dtype=np.int64), np.zeros(n_seq, np.int64),
                np.full(n_seq, q.shape[1], np.int64))
    check_array(q, "q", ndim=3)
    c = check_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    if c.shape[0] != n_seq + 1:
        raise ArgumentError(
            f"cu_seqlens_q has {c.shape[0] - 1} sequences but there are {n_seq}"
        )
    return (add_batch_dim(q), np.zeros(n_seq, np.int64), c[:-1].copy(), np.diff(c))


def check_page_pool(k_pages: Any) -> None:
    """A caller-owned pool ``(num_pages, page_size, Hkv, D)`` has a page and a slot."""
    if int(k_pages.shape[1]) < 1 or int(k_pages.shape[0]) < 1:
        raise ShapeError(f"k_pages has shape {tuple(k_pages.shape)}; expected at least one "
                         "page of at least one slot")


# ---- quantized KV caches (contract §10) -------------------------------------------------------
def check_kv_dtype(kv_dtype: Any, dtype: np.dtype) -> KVFormat | None:
    """A cache's ``kv_dtype``: None or ``dtype`` itself (K and V stored as ``dtype``: None), or
    one of the 8-bit formats of :data:`attnlib._quant.FORMATS` by name or numpy dtype."""
    if kv_dtype is None:
        return None
    if isinstance(kv_dtype, str) and kv_dtype in FORMATS:
        return FORMATS[kv_dtype]
    try:
        dt = BFLOAT16 if kv_dtype in ("bfloat16", "bf16") else np.dtype(kv_dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is not None:
        if dt == dtype:
            return None
        fmt = format_of(dt)
        if fmt is not None:
            return fmt
    raise DTypeError(
        f"kv_dtype={kv_dtype!r} is not supported; expected {', '.join(map(repr, FORMATS))} or "
        f"the cache's dtype {dtype}"
    )


def check_scale_pools(q: Any, k_pages: Any, v_pages: Any, k_scales: Any,
                      v_scales: Any) -> np.dtype:
    """``paged_attention`` over quantized pools: q of a float dtype (returned: the compute
    dtype), k_pages and v_pages of one 8-bit format, and float32 scale pools ``(num_pages,
    page_size, Hkv)``; all of one kind of array (numpy, or one backend's device arrays)."""
    dtype = check_float_dtype(q, "q")
    if (k_scales is None) != (v_scales is None):
        raise ArgumentError("k_scales and v_scales must be given together (or both left out)")
    fmt = format_of(k_pages.dtype)
    if fmt is None or np.dtype(v_pages.dtype) != fmt.dtype:
        raise DTypeError(
            f"k_scales / v_scales were given but k_pages has dtype {k_pages.dtype} and v_pages "
            f"{v_pages.dtype}; scaled pools hold one of {', '.join(FORMATS)}"
        )
    want = tuple(int(n) for n in k_pages.shape[:3])
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        check_array(s, name, ndim=3)
        if np.dtype(s.dtype) != np.float32:
            raise DTypeError(f"{name} has dtype {s.dtype}; expected float32")
        if tuple(int(n) for n in s.shape) != want:
            raise ShapeError(
                f"{name} has shape {tuple(s.shape)}; expected (num_pages, page_size, Hkv) = "
                f"{want}"
            )
    kinds = [is_device_array(x) for x in (q, k_pages, v_pages, k_scales, v_scales)]
    if len(set(kinds)) > 1:
        raise ArgumentError(
            "q, k_pages, v_pages, k_scales and v_scales must all be numpy arrays or all device "
            "arrays of one backend, got " + ", ".join("device" if d else "numpy" for d in kinds)
        )
    return dtype


def check_unscaled_pools(k_pages: Any, v_pages: Any) -> None:
    """Pools of an 8-bit format need their scales: without them they are a DTypeError that
    says so (float pools go on to the usual q, k, v dtype checks)."""
    for name, pool in (("k_pages", k_pages), ("v_pages", v_pages)):
        if format_of(pool.dtype) is not None:
            raise DTypeError(
                f"{name} has dtype {pool.dtype}, a quantized format: pass k_scales and v_scales "
                "(float32, (num_pages, page_size, Hkv))"
            )
