"""KVCache: a pre-allocated key/value cache on the backend's device, optionally a ring buffer.

Bookkeeping lives on the host: per cache row, ``lengths`` (absolute positions written so far)
and ``_lo``, the first position still held. Held positions are always the contiguous range
``[_lo, lengths)``; position ``p`` lives in slot ``p % max_seq_len``. A write of positions
``[s, e)`` keeps the old positions ``[_lo, s)`` whose slots it does not overwrite, which are
exactly those ``>= e - max_seq_len``, so ``_lo = max(_lo, e - max_seq_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from . import _spec, registry
from ._api import check_rope, pick_backend
from .backends.base import AttnCall, RopeSpec
from .errors import ArgumentError, CacheOverflowError, DTypeError, ShapeError

__all__ = ["KVCache", "attention_with_kvcache"]


def _first(bad: np.ndarray) -> int:
    """Index of the first offending row, for the error message."""
    return int(np.flatnonzero(bad)[0])


@dataclass(frozen=True)
class _Write:
    """A validated write: nothing of it has touched the cache yet."""

    k: object
    v: object
    rows: np.ndarray
    start: np.ndarray
    new_len: np.ndarray
    new_lo: np.ndarray


class KVCache:
    """Keys and values for autoregressive decoding, allocated once on the backend's device.

    ``k`` buffer ``(max_batch_size, max_seq_len, n_kv_heads, head_dim)``, ``v`` buffer
    ``(..., head_dim_v)``. ``ring=False``: writing past ``max_seq_len`` raises
    ``CacheOverflowError`` and changes nothing. ``ring=True``: position ``p`` lives in slot
    ``p % max_seq_len``; ``lengths`` keeps counting absolute positions and only the last
    ``max_seq_len`` are held (sliding-window decoding, as in Mistral). ``queue=`` (a
    ``pyopencl.CommandQueue``) is short for ``backend=attnlib.get_backend("opencl",
    queue=queue)``: the buffers live in that queue's context and the work is enqueued there.
    """

    def __init__(self, max_batch_size, max_seq_len, n_kv_heads, head_dim, *, head_dim_v=None,
                 dtype="float32", ring=False, backend=None, queue=None):
        self.max_batch_size = _spec.check_int(max_batch_size, "max_batch_size", minimum=1)
        self.max_seq_len = _spec.check_int(max_seq_len, "max_seq_len", minimum=1)
        self.n_kv_heads = _spec.check_int(n_kv_heads, "n_kv_heads", minimum=1)
        self.head_dim = _spec.check_int(head_dim, "head_dim", minimum=1)
        self.head_dim_v = (self.head_dim if head_dim_v is None
                           else _spec.check_int(head_dim_v, "head_dim_v", minimum=1))
        self.dtype = _spec.parse_dtype(dtype)
        self.ring = _spec.check_bool(ring, "ring")
        self.backend = pick_backend(backend, (), self.dtype, queue=queue)
        shape = (self.max_batch_size, self.max_seq_len, self.n_kv_heads)
        self.k = self.backend.cache_alloc(shape + (self.head_dim,), self.dtype)
        self.v = self.backend.cache_alloc(shape + (self.head_dim_v,), self.dtype)
        self._len = np.zeros(self.max_batch_size, dtype=np.int64)
        self._lo = np.zeros(self.max_batch_size, dtype=np.int64)
        #: repeat-call entries of attention_with_kvcache (see _fast_key)
        self._fast: dict = {}

    def __repr__(self) -> str:
        return (f"KVCache(max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, dtype={self.dtype}, ring={self.ring}, "
                f"backend={self.backend.name!r})")

    @property
    def lengths(self) -> np.ndarray:
        """Tokens written per cache row (absolute positions; may exceed max_seq_len in a ring)."""
        return self._len.copy()

    @property
    def held_from(self) -> np.ndarray:
        """The first position each row still holds (0 unless a ring has wrapped)."""
        return self._lo.copy()

    def reset(self, batch_index=None) -> None:
        """Forget everything (``None``), or the rows given by an int or a sequence of ints."""
        rows = self._rows(batch_index, "batch_index", None)
        self._len[rows] = 0
        self._lo[rows] = 0

    def update(self, k, v, start_pos, *, batch_idx=None) -> None:
        """Write ``k (B, S_new, Hkv, D)``, ``v (B, S_new, Hkv, Dv)`` at ``start_pos`` (an int or
        an int array ``(B,)``); sets each row's length to ``start_pos + S_new``. Writing before
        the current length rewrites (rollback); a gap is an ArgumentError."""
        self._commit(self._plan(k, v, start_pos, batch_idx), None)

    # ---- internals ------------------------------------------------------------------------------
    def _rows(self, index, name: str, b: int | None) -> np.ndarray:
        if index is None:
            return np.arange(self.max_batch_size if b is None else b, dtype=np.int64)
        if _spec.is_array(index):
            idx = _spec.host(index)
            if idx.dtype.kind not in "iu" or idx.ndim != 1:
                raise ArgumentError(
                    f"{name} must be an int array (B,), got {idx.dtype} {idx.shape}"
                )
            idx = idx.astype(np.int64)
        elif isinstance(index, (list, tuple)):
            idx = np.array([_spec.check_int(i, name) for i in index], dtype=np.int64)
        else:
            idx = np.array([_spec.check_int(index, name)], dtype=np.int64)
        if b is not None and idx.shape != (b,):
            raise ShapeError(f"{name} has shape {idx.shape}; expected ({b},)")
        if idx.size and (idx.min() < 0 or idx.max() >= self.max_batch_size):
            raise ArgumentError(
                f"{name}={idx.tolist()} has entries outside [0, {self.max_batch_size})"
            )
        return idx

    def _check_kv(self, k, v, b: int | None = None) -> int:
        for name, x, d in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            _spec.check_array(x, name, ndim=4)
            if np.dtype(x.dtype) != self.dtype:
                raise DTypeError(f"{name} has dtype {x.dtype}; this cache holds {self.dtype}")
            if x.shape[2] != self.n_kv_heads or x.shape[3] != d:
                raise ShapeError(
                    f"{name} has shape {tuple(x.shape)}; expected "
                    f"(B, S_new, {self.n_kv_heads}, {d})"
                )
        if tuple(k.shape[:2]) != tuple(v.shape[:2]):
            raise ShapeError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
        if b is not None and k.shape[0] != b:
            raise ShapeError(f"k has batch {k.shape[0]} but q has {b}")
        if k.shape[0] > self.max_batch_size:
            raise ShapeError(f"k has batch {k.shape[0]} > max_batch_size={self.max_batch_size}")
        return k.shape[0]

    def _start(self, start_pos, rows: np.ndarray) -> np.ndarray:
        b = rows.shape[0]
        if start_pos is None:
            return self._len[rows].copy()
        if _spec.is_array(start_pos):
            sp = _spec.host(start_pos)
            if sp.dtype.kind not in "iu":
                raise ArgumentError(f"start_pos has dtype {sp.dtype}; expected an int or int array")
            if sp.shape != (b,):
                raise ArgumentError(f"start_pos has shape {sp.shape}; expected ({b},)")
            sp = sp.astype(np.int64)
        else:
            sp = np.full(b, _spec.check_int(start_pos, "start_pos"), dtype=np.int64)
        if (sp < 0).any():
            raise ArgumentError(f"start_pos={sp.tolist()} must be >= 0")
        return sp

    def _plan(self, k, v, start_pos, batch_idx, b: int | None = None) -> _Write:
        b = self._check_kv(k, v, b)
        rows = self._rows(batch_idx, "batch_idx", b)
        if len(np.unique(rows)) != b:
            raise ArgumentError(f"batch_idx={rows.tolist()} writes one cache row twice")
        start = self._start(start_pos, rows)
        n_new = k.shape[1]
        cur, lo = self._len[rows], self._lo[rows]
        gap = start > cur
        if gap.any():
            i = _first(gap)
            raise ArgumentError(
                f"start_pos={int(start[i])} for cache row {int(rows[i])} leaves a gap: that row "
                f"holds {int(cur[i])} tokens, so start_pos must be <= {int(cur[i])}"
            )
        end = start + n_new
        cap = self.max_seq_len
        if not self.ring:
            over = end > cap
            if over.any():
                i = _first(over)
                raise CacheOverflowError(
                    f"writing {n_new} tokens at start_pos={int(start[i])} into cache row "
                    f"{int(rows[i])} needs {int(end[i])} slots > max_seq_len={cap} (ring=False); "
                    "the cache is unchanged"
                )
            return _Write(k, v, rows, start, end, lo.copy())
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
        return _Write(k, v, rows, start, end, np.maximum(lo, end - cap))

    def _commit(self, w: _Write, rope: RopeSpec | None) -> None:
        if w.k.shape[1] > 0:
            self.backend.cache_write(self.k, w.k, w.rows, w.start, rope)
            self.backend.cache_write(self.v, w.v, w.rows, w.start, None)
        self._len[w.rows] = w.new_len
        self._lo[w.rows] = np.minimum(w.new_lo, w.new_len)


def attention_with_kvcache(q, cache, k=None, v=None, *, start_pos=None, batch_idx=None,
                           rope=None, causal=True, scale=None, window=None, softcap=None,
                           alibi_slopes=None, return_lse=False, backend=None):
    """Append ``k``, ``v`` (if given) at ``start_pos`` (default: the current lengths), then attend
    ``q (B, Sq, Hq, D)`` over each sequence's held tokens (FlashAttention's
    ``flash_attn_with_kvcache``).

    Query row ``i`` of sequence ``b`` sits at absolute position ``len_b - Sq + i`` (``len_b``:
    the length after the append); causal (bottom-right, the default) lets it see held keys at
    positions ``<= len_b - Sq + i``; RoPE (``rope=attnlib.RoPE(...)``) rotates q and the new k at
    these positions before writing and attending. ``batch_idx (B,)`` maps batch rows to cache
    rows. Every check runs before the cache is touched: a failing call leaves it unchanged.
    """
    fast_key = None
    if type(cache) is KVCache and backend is None and alibi_slopes is None:
        fast_key = _fast_key(q, k, v, rope, causal, scale, window, softcap, return_lse,
                             start_pos, batch_idx)
        entry = cache._fast.get(fast_key) if fast_key is not None else None
        if entry is not None:
            res = entry.run(cache, q, k, v, start_pos, batch_idx)
            if res is not None:
                return res
    if not isinstance(cache, KVCache):
        raise ArgumentError(f"cache must be an attnlib.KVCache, got {type(cache).__name__}")
    be = cache.backend
    if backend is not None and registry.get_backend(backend) is not be:
        raise ArgumentError(
            f"backend={backend!r} differs from the cache's backend {be.name!r}; attention over a "
            "cache runs where the cache lives"
        )
    return_lse = _spec.check_bool(return_lse, "return_lse")
    _spec.check_array(q, "q", ndim=4)
    if np.dtype(q.dtype) != cache.dtype:
        raise DTypeError(f"q has dtype {q.dtype}; this cache holds {cache.dtype}")
    b, sq, hq, d = q.shape
    if d != cache.head_dim:
        raise ShapeError(f"q has head dim {d}; this cache holds head_dim={cache.head_dim}")
    if hq < 1 or hq % cache.n_kv_heads:
        raise ShapeError(f"q has {hq} heads; need a multiple of n_kv_heads={cache.n_kv_heads}")
    if b > cache.max_batch_size and batch_idx is None:
        raise ShapeError(f"q has batch {b} > max_batch_size={cache.max_batch_size}")
    causal = _spec.check_causal(causal, allow_top_left=False)
    left, right = _spec.check_window(window)
    rope_spec = check_rope(rope, d)
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (or both left out)")
    if k is None:
        if start_pos is not None:
            raise ArgumentError("start_pos was given without k and v; there is nothing to write")
        rows = cache._rows(batch_idx, "batch_idx", b)
        write, new_len, lo = None, cache._len[rows], cache._lo[rows]
    else:
        write = cache._plan(k, v, start_pos, batch_idx, b)
        rows, new_len, lo = write.rows, write.new_len, np.minimum(write.new_lo, write.new_len)
    short = new_len < sq
    if short.any():
        i = _first(short)
        raise ShapeError(
            f"q has Sq={sq} rows but cache row {int(rows[i])} holds only {int(new_len[i])} "
            "tokens; Sq must be <= each sequence's length"
        )
    call = AttnCall(
        q=q, k=cache.k, v=cache.v,
        q_batch=np.arange(b, dtype=np.int64), q_row0=np.zeros(b, dtype=np.int64),
        q_len=np.full(b, sq, dtype=np.int64),
        k_batch=rows.copy(), k_row0=lo % cache.max_seq_len, k_len=new_len - lo,
        q_pos0=new_len - sq, k_pos0=lo.copy(),
        causal_hi=None if causal is None else np.zeros(b, dtype=np.int64),
        scale=_spec.check_scale(scale, d), window_left=left, window_right=right,
        softcap=_spec.check_softcap(softcap), alibi=_spec.check_alibi(alibi_slopes, b, hq),
        ring=cache.max_seq_len if cache.ring else 0, need_lse=return_lse,
    )
    # the cache's backend was chosen, and its dtype checked, at construction: only q's array kind
    # is left to check (the decode hot path skips the full backend resolution)
    if _spec.is_device_array(q) and not be.owns(q):
        raise ArgumentError(
            f"q is a {type(q).__module__}.{type(q).__name__} array, which the cache's backend "
            f"{be.name!r} cannot read"
        )
    # -- everything is checked: only now touch the cache
    if write is not None:
        cache._commit(write, rope_spec)
    if rope_spec is not None:
        positions = (new_len - sq)[:, None] + np.arange(sq, dtype=np.int64)[None, :]
        call = replace(call, q=be.rope(q, positions, rope_spec))
    if sq == 0 or b == 0:
        out = np.zeros((b, sq, hq, cache.head_dim_v), cache.dtype)
        lse = np.full((b, hq, sq), -np.inf, np.float64 if cache.dtype == np.float64 else np.float32)
    else:
        out, lse = be.attention(call)
        if fast_key is not None:  # every check passed: repeat calls of this key may skip them
            if len(cache._fast) >= _FAST_MAX:
                cache._fast.clear()
            cache._fast[fast_key] = _FastEntry(cache, call, b, sq, k, rope_spec, return_lse)
    return (out, lse) if return_lse else out



# ---- repeat calls ------------------------------------------------------------------------------
_FAST_MAX = 64
_NONE = type(None)
#: per-call values whose checks depend only on (type, value): the key holds both, so True and 1
#: (equal and of one hash) never share an entry
_SIMPLE = (bool, int, float, _NONE, str, np.bool_, np.float64, np.float32)


def _fast_key(q, k, v, rope, causal, scale, window, softcap, return_lse, start_pos=None,
              batch_idx=None) -> tuple | None:
    """Everything the checks of :func:`attention_with_kvcache` read besides the cache's state
    (lengths) and the values of ``start_pos`` / ``batch_idx`` (checked per call, see
    ``_FastEntry._mapped``): q's (and the new k, v's) type, shape, dtype and strides, every
    option by type and value, the types of start_pos and batch_idx. None (no repeat entry) for
    options of other types."""
    tc, ts, tf, tl = type(causal), type(scale), type(softcap), type(return_lse)
    if tc not in _SIMPLE or ts not in _SIMPLE or tf not in _SIMPLE or tl not in _SIMPLE:
        return None
    try:
        kv = None if k is None and v is None else (
            type(k), k.shape, k.dtype, k.strides, type(v), v.shape, v.dtype, v.strides)
        if window is not None:
            if type(window) not in (tuple, list) or any(type(w) not in _SIMPLE for w in window):
                return None
            window = (type(window), tuple(map(type, window)), tuple(window))
        if rope is not None:
            rope = (type(rope), rope.theta, rope.interleaved, rope.rotary_dim)
        return (type(q), q.shape, q.dtype, q.strides, kv, rope, tc, causal, ts, scale, window,
                tf, softcap, tl, return_lse, type(start_pos), type(batch_idx))
    except (AttributeError, TypeError):
        return None


def _frozen_fields_ok() -> bool:
    """AttnCall is a plain frozen dataclass (no __post_init__, no slots): an instance can be
    made from another's attribute dict."""
    names = {f.name for f in fields(AttnCall)}
    return (not hasattr(AttnCall, "__post_init__") and not hasattr(AttnCall, "__slots__")
            and names == set(_CALL_FIELDS))


_CALL_FIELDS = ("q", "k", "v", "q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len",
                "q_pos0", "k_pos0", "causal_hi", "scale", "window_left", "window_right",
                "softcap", "alibi", "mask_view", "mask_kind", "ring", "dense", "need_lse",
                "block_table", "page_size")


_COPY_CALL = _frozen_fields_ok()

class _FastEntry:
    """What a successful call fixed for its key: the batch, query rows, the new tokens, RoPE,
    and the AttnCall fields that do not depend on the cache's lengths. ``run`` repeats the
    length-dependent checks, and those of ``start_pos`` / ``batch_idx`` values (``_mapped``; a
    failing one hands the call to the full path, which raises the error), and builds the
    AttnCall from them. An append goes through the backend's ``cache_append`` first (one launch
    on backends that fuse it)."""

    __slots__ = ("be", "b", "sq", "n_new", "rope", "need_lse", "fields", "consts", "rows",
                 "fused")

    def __init__(self, cache: KVCache, call: AttnCall, b: int, sq: int, k, rope, need_lse):
        self.be = cache.backend
        self.b, self.sq = b, sq
        self.n_new = None if k is None else int(k.shape[1])
        self.rope, self.need_lse = rope, need_lse
        # an append (with RoPE: q rows = new tokens): the backend's fused append, if any
        self.fused = (self.be.cache_append if self.n_new and (rope is None or self.n_new == sq)
                      else None)
        self.fields = {f: getattr(call, f) for f in (
            "scale", "window_left", "window_right", "softcap", "alibi", "mask_view",
            "mask_kind", "ring", "dense", "need_lse")}
        self.rows = np.arange(b, dtype=np.int64)
        # q_batch, q_row0, q_len, k_batch, causal_hi: fixed by the key
        self.consts = (self.rows, np.zeros(b, np.int64), np.full(b, sq, np.int64),
                       None if call.causal_hi is None else np.zeros(b, np.int64))

    def run(self, cache: KVCache, q, k, v, start_pos=None, batch_idx=None):
        b, sq, cap, n_new = self.b, self.sq, cache.max_seq_len, self.n_new
        rows = self.rows
        if start_pos is not None or batch_idx is not None:
            got = self._mapped(cache, start_pos, batch_idx)
            if got is None:
                return None  # a check fails (or an unusual argument): the full path
            rows, start, new_len, lo_arr = got
            if (new_len < sq).any():
                return None
            k_row0, k_len, q_pos0, k_pos0 = lo_arr % cap, new_len - lo_arr, new_len - sq, lo_arr
        elif b == 1:
            length, lo = int(cache._len[0]), int(cache._lo[0])
            start = length
            if n_new is not None:
                length += n_new
                if not cache.ring and length > cap:
                    return None  # overflow: the full path raises CacheOverflowError
                if cache.ring:
                    lo = max(lo, length - cap)
            if length < sq:
                return None  # the full path raises ShapeError
            per = np.array([[lo % cap], [length - lo], [length - sq], [lo], [start], [length]],
                           np.int64)
            k_row0, k_len, q_pos0, k_pos0, start, new_len = per
            lo_arr = k_pos0
        else:
            new_len, lo_arr = cache._len[:b].copy(), cache._lo[:b].copy()
            if n_new is not None:
                start = new_len
                new_len = start + n_new
                if not cache.ring and (new_len > cap).any():
                    return None
                if cache.ring:
                    lo_arr = np.maximum(lo_arr, new_len - cap)
            if (new_len < sq).any():
                return None
            k_row0, k_len, q_pos0, k_pos0 = lo_arr % cap, new_len - lo_arr, new_len - sq, lo_arr
        be = self.be
        q_rot = None
        if n_new:  # everything is checked: only now touch the cache (as _commit does)
            if self.fused is not None:
                q_rot = self.fused(cache.k, cache.v, k, v, q, rows, start, self.rope)
            if q_rot is None:
                be.cache_write(cache.k, k, rows, start, self.rope)
                be.cache_write(cache.v, v, rows, start, None)
        if n_new is not None:  # lo <= new_len here (as np.minimum in _commit)
            if rows is self.rows:
                cache._len[:b], cache._lo[:b] = new_len, lo_arr
            else:
                cache._len[rows], cache._lo[rows] = new_len, lo_arr
        q_batch, q_row0, q_len, chi = self.consts
        values = dict(self.fields, q=q, k=cache.k, v=cache.v, q_batch=q_batch.copy(),
                      q_row0=q_row0.copy(), q_len=q_len.copy(), k_batch=rows.copy(),
                      k_row0=k_row0, k_len=k_len, q_pos0=q_pos0, k_pos0=k_pos0,
                      causal_hi=None if chi is None else chi.copy())
        if q_rot is not None:
            values["q"] = q_rot
        elif self.rope is not None:
            positions = q_pos0[:, None] + np.arange(sq, dtype=np.int64)[None, :]
            values["q"] = be.rope(q, positions, self.rope)
        if _COPY_CALL:
            call = object.__new__(AttnCall)
            call.__dict__.update(values)
        else:  # pragma: no cover
            call = AttnCall(**values)
        out, lse = be.attention(call)
        return (out, lse) if self.need_lse else out

    def _mapped(self, cache: KVCache, start_pos, batch_idx):
        """The checks of ``KVCache._plan`` / the front door for a call with ``start_pos`` or
        ``batch_idx``, on plain ints and int numpy arrays only: (cache rows, start, new
        lengths, first held positions), or None (a failing check or another argument kind:
        the full path raises or serves it)."""
        b, n_new, cap = self.b, self.n_new, cache.max_seq_len
        rows = self.rows
        if batch_idx is not None:
            rows = _plain_ints(batch_idx, b)
            if rows is None or rows.min() < 0 or rows.max() >= cache.max_batch_size:
                return None
            if n_new is not None and b > 1 and np.unique(rows).size != b:
                return None  # one cache row written twice
        cur, lo = cache._len[rows], cache._lo[rows]
        if n_new is None:
            return None if start_pos is not None else (rows, None, cur, lo)
        start = cur if start_pos is None else _plain_ints(start_pos, b, scalar=True)
        if start is None or (start < 0).any() or (start > cur).any():
            return None  # a gap
        end = start + n_new
        if cache.ring:
            if n_new > cap or (start < lo).any():
                return None  # too many tokens, or a position no longer held
            lo = np.maximum(lo, end - cap)
        elif (end > cap).any():
            return None  # overflow
        return rows, start, end, np.minimum(lo, end)


def _plain_ints(x, b: int, scalar: bool = False) -> np.ndarray | None:
    """``x`` as a fresh int64 array (b,) when it is an int numpy array of that shape, a list or
    tuple of b ints (batch_idx), or a single int (one row, or any b with ``scalar``: start_pos);
    None for anything else (the full path checks it)."""
    t = type(x)
    if t is np.ndarray:
        return x.astype(np.int64) if x.dtype.kind in "iu" and x.shape == (b,) else None
    if t is int or t is np.int64:
        return np.full(b, x, np.int64) if scalar or b == 1 else None
    if (t is list or t is tuple) and not scalar and len(x) == b and all(
            type(i) is int for i in x):
        return np.array(x, np.int64)
    return None
