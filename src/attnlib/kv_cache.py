"""KVCache: a pre-allocated key/value cache on the backend's device, optionally a ring buffer.

Bookkeeping lives on the host: per cache row, ``lengths`` (absolute positions written so far)
and ``_lo``, the first position still held. Held positions are always the contiguous range
``[_lo, lengths)``; position ``p`` lives in slot ``p % max_seq_len``. A write of positions
``[s, e)`` keeps the old positions ``[_lo, s)`` whose slots it does not overwrite, which are
exactly those ``>= e - max_seq_len``, so ``_lo = max(_lo, e - max_seq_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from . import _plans, _quant, _spec, registry
from ._common import RoPE, check_rope, empty_lse, pick_backend
from .backends.base import AttnCall, Backend, RopeSpec

__all__ = ["KVCache", "attention_with_kvcache"]


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

    ``kv_dtype`` (``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"int8"``; default: ``dtype``) stores
    K and V in 8 bits with one float32 scale per (token, kv head) in ``k_scales`` / ``v_scales``
    ``(max_batch_size, max_seq_len, n_kv_heads)`` (None when not quantized), set when the token
    is written: ``scale = absmax / the format's largest value`` (RoPE applied first). The new
    k, v and q keep ``dtype``; attention reads ``scale * stored`` inside its kernels, and
    :meth:`dequantized` returns those values. A ring buffer keeps each token's scale in its slot.
    """

    def __init__(self, max_batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int, *,
                 head_dim_v: int | None = None, dtype: Any = "float32", ring: bool = False,
                 backend: str | Backend | None = None, queue: Any = None,
                 kv_dtype: Any = None) -> None:
        self.max_batch_size = _spec.check_int(max_batch_size, "max_batch_size", minimum=1)
        self.max_seq_len = _spec.check_int(max_seq_len, "max_seq_len", minimum=1)
        self.n_kv_heads, self.head_dim, self.head_dim_v, self.dtype = _spec.check_cache_geometry(
            n_kv_heads, head_dim, head_dim_v, dtype)
        self.ring = _spec.check_bool(ring, "ring")
        self.kv_format = _spec.check_kv_dtype(kv_dtype, self.dtype)
        #: the dtype K and V are stored in (``dtype`` unless quantized)
        self.kv_dtype = self.dtype if self.kv_format is None else self.kv_format.dtype
        self.backend = pick_backend(backend, (), self.dtype, queue=queue)
        shape = (self.max_batch_size, self.max_seq_len, self.n_kv_heads)
        self.k = self.backend.cache_alloc(shape + (self.head_dim,), self.kv_dtype)
        self.v = self.backend.cache_alloc(shape + (self.head_dim_v,), self.kv_dtype)
        self.k_scales = self.v_scales = None
        if self.kv_format is not None:
            self.k_scales = self.backend.cache_alloc(shape, np.dtype(np.float32))
            self.v_scales = self.backend.cache_alloc(shape, np.dtype(np.float32))
        self._len = np.zeros(self.max_batch_size, dtype=np.int64)
        self._lo = np.zeros(self.max_batch_size, dtype=np.int64)
        #: repeat-call entries of attention_with_kvcache (see _fast_key)
        self._fast = _plans.table(owner=self)

    def __repr__(self) -> str:
        return (f"KVCache(max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, dtype={self.dtype}, ring={self.ring}, "
                f"kv_dtype={self.kv_dtype}, backend={self.backend.name!r})")

    @property
    def lengths(self) -> np.ndarray:
        """Tokens written per cache row (absolute positions; may exceed max_seq_len in a ring)."""
        return self._len.copy()

    @property
    def held_from(self) -> np.ndarray:
        """The first position each row still holds (0 unless a ring has wrapped)."""
        return self._lo.copy()

    @_spec.front_door
    def reset(self, batch_index: Any = None) -> None:
        """Forget everything (``None``), or the rows given by an int or a sequence of ints."""
        rows = self._rows(batch_index, "batch_index", None)
        self._len[rows] = 0
        self._lo[rows] = 0

    @_spec.front_door
    def update(self, k: Any, v: Any, start_pos: Any, *, batch_idx: Any = None) -> None:
        """Write ``k (B, S_new, Hkv, D)``, ``v (B, S_new, Hkv, Dv)`` at ``start_pos`` (an int or
        an int array ``(B,)``); sets each row's length to ``start_pos + S_new``. Writing before
        the current length rewrites (rollback); a gap is an ArgumentError."""
        self._commit(self._plan(k, v, start_pos, batch_idx), None)

    def dequantized(self, batch_index: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """The values attention reads, as float64 numpy arrays (for checks): ``k (rows,
        max_seq_len, n_kv_heads, head_dim)`` and ``v (..., head_dim_v)`` of the cache rows given
        by ``batch_index`` (None: every row), in slot order (a ring's position ``p`` in slot
        ``p % max_seq_len``): ``scale * stored`` when quantized, else the stored values."""
        rows = self._rows(batch_index, "batch_index", None)
        read = self.backend.cache_read
        k, v = read(self.k)[rows], read(self.v)[rows]
        if self.kv_format is None:
            return k.astype(np.float64), v.astype(np.float64)
        return (_quant.dequantize(k, read(self.k_scales)[rows]),
                _quant.dequantize(v, read(self.v_scales)[rows]))

    # ---- internals ------------------------------------------------------------------------------
    def _rows(self, index: Any, name: str, b: int | None) -> np.ndarray:
        return _spec.check_cache_rows(index, name, b, self.max_batch_size)

    def _plan(self, k: Any, v: Any, start_pos: Any, batch_idx: Any,
              b: int | None = None) -> _Write:
        b = _spec.check_cache_kv(k, v, b, self.dtype, self.n_kv_heads, self.head_dim,
                                 self.head_dim_v, self.max_batch_size)
        rows = self._rows(batch_idx, "batch_idx", b)
        _spec.check_distinct_rows(rows)
        start, end, lo = self._place(rows, start_pos, k.shape[1])
        return _Write(k, v, rows, start, end, lo)

    def _place(self, rows: np.ndarray, start_pos: Any,
               n_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checks of a write of ``n_new`` tokens into ``rows`` (distinct) at ``start_pos``
        (None: each row's length): (start, new lengths, new first held positions)."""
        cur = self._len[rows]
        start = cur.copy() if start_pos is None else _spec.check_start_pos(start_pos,
                                                                            rows.shape[0])
        end, lo = _spec.check_cache_write(rows, start, cur, self._lo[rows], n_new,
                                          self.max_seq_len, self.ring)
        return start, end, lo

    def _commit(self, w: _Write, rope: RopeSpec | None) -> None:
        if w.k.shape[1] > 0:
            self.backend.cache_write(self.k, w.k, w.rows, w.start, rope, self.k_scales)
            self.backend.cache_write(self.v, w.v, w.rows, w.start, None, self.v_scales)
        self._len[w.rows] = w.new_len
        self._lo[w.rows] = np.minimum(w.new_lo, w.new_len)


@_spec.front_door
@_spec.keywords_checked
def attention_with_kvcache(q: Any, cache: KVCache, k: Any = None, v: Any = None, *,
                           start_pos: Any = None, batch_idx: Any = None, rope: RoPE | None = None,
                           causal: bool = True, scale: float | None = None,
                           window: tuple[int | None, int | None] | None = None,
                           softcap: float | None = None, alibi_slopes: Any = None,
                           sinks: Any = None, return_lse: bool = False,
                           backend: str | Backend | None = None) -> Any:
    """Append ``k``, ``v`` (if given) at ``start_pos`` (default: the current lengths), then attend
    ``q (B, Sq, Hq, D)`` over each sequence's held tokens (FlashAttention's
    ``flash_attn_with_kvcache``).

    Query row ``i`` of sequence ``b`` sits at absolute position ``len_b - Sq + i`` (``len_b``:
    the length after the append); causal (bottom-right, the default) lets it see held keys at
    positions ``<= len_b - Sq + i``; RoPE (``rope=attnlib.RoPE(...)``) rotates q and the new k at
    these positions before writing and attending. ``batch_idx (B,)`` maps batch rows to cache
    rows. ``sinks`` (float32 ``(Hq,)``): attention sinks, as in ``attention``. Every check runs
    before the cache is touched: a failing call leaves it unchanged.
    """
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks)
    fast_key = None
    if type(cache) is KVCache and backend is None:
        fast_key = _fast_key(q, k, v, rope, options, return_lse, start_pos, batch_idx)
        entry = cache._fast.get(fast_key) if fast_key is not None else None
        if entry is not None:
            res = entry.run(cache, q, k, v, start_pos, batch_idx, sinks)
            if res is not None:
                return res
    _spec.check_cache_instance(cache, KVCache)
    be = cache.backend
    _spec.check_cache_backend(backend, None if backend is None else registry.get_backend(backend),
                              be)
    return_lse = _spec.check_bool(return_lse, "return_lse")
    b, sq, hq, d = _spec.check_cache_query(q, cache.dtype, cache.head_dim, cache.n_kv_heads,
                                           cache.max_batch_size, batch_idx is not None)
    options = _spec.attn_options(d, hq, b, top_left=False, **options)
    rope_spec = check_rope(rope, d)
    _spec.check_kv_given(k, v, start_pos)
    if k is None:
        rows = cache._rows(batch_idx, "batch_idx", b)
        write, new_len, lo = None, cache._len[rows], cache._lo[rows]
    else:
        write = cache._plan(k, v, start_pos, batch_idx, b)
        rows, new_len, lo = write.rows, write.new_len, np.minimum(write.new_lo, write.new_len)
    _spec.check_held(rows, new_len, sq)
    call = AttnCall(
        q=q, k=cache.k, v=cache.v,
        q_batch=np.arange(b, dtype=np.int64), q_row0=np.zeros(b, dtype=np.int64),
        q_len=np.full(b, sq, dtype=np.int64),
        k_batch=rows.copy(), k_row0=lo % cache.max_seq_len, k_len=new_len - lo,
        q_pos0=new_len - sq, k_pos0=lo.copy(),
        causal_hi=None if options.causal is None else np.zeros(b, dtype=np.int64),
        options=options, ring=cache.max_seq_len if cache.ring else 0, need_lse=return_lse,
        k_scales=cache.k_scales, v_scales=cache.v_scales,
    )
    # the cache's backend was chosen, and its dtype checked, at construction: only q's array kind
    # is left to check (the decode hot path skips the full backend resolution)
    _spec.check_readable(q, "q", be)
    # -- everything is checked: only now touch the cache
    if write is not None:
        cache._commit(write, rope_spec)
    if rope_spec is not None:
        positions = (new_len - sq)[:, None] + np.arange(sq, dtype=np.int64)[None, :]
        call = replace(call, q=be.rope(q, positions, rope_spec))
    if sq == 0 or b == 0:
        out = np.zeros((b, sq, hq, cache.head_dim_v), cache.dtype)
        lse = empty_lse(call, b, sq)
    else:
        out, lse = be.attention(call)
        if fast_key is not None:  # every check passed: repeat calls of this key may skip them
            if len(cache._fast) >= _FAST_MAX:
                cache._fast.clear()
            cache._fast[fast_key] = _FastEntry(cache, call, b, sq, k, rope_spec, return_lse,
                                               hq)
    return (out, lse) if return_lse else out



# ---- repeat calls ------------------------------------------------------------------------------
_FAST_MAX = 64


def _fast_key(q, k, v, rope, options, return_lse, start_pos=None,
              batch_idx=None) -> tuple | None:
    """Everything the checks of :func:`attention_with_kvcache` read besides the cache's state
    (lengths) and the values of ``start_pos`` / ``batch_idx`` (checked per call, see
    ``_FastEntry._mapped``) and of ``sinks`` (checked per call): q's (and the new k, v's) type,
    shape, dtype and strides, RoPE's settings, the options
    (:func:`~._spec.option_key`), return_lse, the types of start_pos and batch_idx. None
    (no repeat entry) for options of other types."""
    opts = _spec.option_key(options, per_call=("sinks",))
    if opts is None or type(return_lse) not in (bool, np.bool_):
        return None
    try:
        kv = None if k is None and v is None else (
            type(k), k.shape, k.dtype, k.strides, type(v), v.shape, v.dtype, v.strides)
        if rope is not None:
            rope = (type(rope), rope.theta, rope.interleaved, rope.rotary_dim)
        return (type(q), q.shape, q.dtype, q.strides, kv, rope, opts, return_lse,
                type(start_pos), type(batch_idx))
    except (AttributeError, TypeError):
        return None


def _frozen_fields_ok() -> bool:
    """AttnCall is a plain frozen dataclass (no __post_init__, no slots): an instance can be
    made from another's attribute dict."""
    names = {f.name for f in fields(AttnCall)}
    return (not hasattr(AttnCall, "__post_init__") and not hasattr(AttnCall, "__slots__")
            and names == set(_CALL_FIELDS))


_CALL_FIELDS = ("q", "k", "v", "q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len",
                "q_pos0", "k_pos0", "causal_hi", "options", "mask_view", "ring", "dense",
                "need_lse", "block_table", "page_size", "k_scales", "v_scales")


_COPY_CALL = _frozen_fields_ok()

class _FastEntry:
    """What a successful call fixed for its key: the batch, query rows, the new tokens, RoPE,
    and the AttnCall fields that do not depend on the cache's lengths (the key fixes everything
    else the front door checks). ``run`` runs the checks that depend on the cache's lengths and
    on the values of ``start_pos`` / ``batch_idx`` (``_mapped``), the same _spec checks the
    full path runs (a failing one raises its error, the cache untouched), and builds the
    AttnCall from them. An append goes through the backend's ``cache_append`` first (one launch
    on backends that fuse it)."""

    __slots__ = ("be", "b", "sq", "n_new", "rope", "need_lse", "fields", "consts", "rows",
                 "fused", "hq", "sinks")

    def __init__(self, cache: KVCache, call: AttnCall, b: int, sq: int, k, rope, need_lse,
                 hq: int):
        self.be = cache.backend
        self.b, self.sq, self.hq = b, sq, hq
        self.n_new = None if k is None else int(k.shape[1])
        self.rope, self.need_lse = rope, need_lse
        # an append (with RoPE: q rows = new tokens): the backend's fused append, if any
        self.fused = (self.be.cache_append if self.n_new and (rope is None or self.n_new == sq)
                      else None)
        self.fields = {f: getattr(call, f) for f in (
            "options", "mask_view", "ring", "dense", "need_lse")}
        sinks = call.options.sinks
        self.sinks = None if sinks is None else sinks.tobytes()
        self.rows = np.arange(b, dtype=np.int64)
        # q_batch, q_row0, q_len, k_batch, causal_hi: fixed by the key
        self.consts = (self.rows, np.zeros(b, np.int64), np.full(b, sq, np.int64),
                       None if call.causal_hi is None else np.zeros(b, np.int64))

    def run(self, cache: KVCache, q: Any, k: Any, v: Any, start_pos: Any = None,
            batch_idx: Any = None, sinks: Any = None) -> Any:
        b, sq, cap, n_new = self.b, self.sq, cache.max_seq_len, self.n_new
        # the key fixes only whether sinks are given: their values are checked every call
        options = self.fields["options"]
        if sinks is not None:
            sinks = _spec.check_sinks(sinks, self.hq)
            if sinks.tobytes() != self.sinks:
                options = replace(options, sinks=sinks)
        rows = self.rows
        if start_pos is not None or batch_idx is not None:
            rows, start, new_len, lo_arr = self._mapped(cache, start_pos, batch_idx)
            _spec.check_held(rows, new_len, sq)
            k_row0, k_len, q_pos0, k_pos0 = lo_arr % cap, new_len - lo_arr, new_len - sq, lo_arr
        elif b == 1:  # the decode step: the same checks on plain ints
            length, lo = int(cache._len[0]), int(cache._lo[0])
            start = length
            if n_new is not None:
                length, lo = _spec.check_cache_append_one(0, length, lo, n_new, cap, cache.ring)
            _spec.check_held_one(0, length, sq)
            per = np.array([[lo % cap], [length - lo], [length - sq], [lo], [start], [length]],
                           np.int64)
            k_row0, k_len, q_pos0, k_pos0, start, new_len = per
            lo_arr = k_pos0
        else:
            if n_new is None:
                new_len, lo_arr = cache._len[:b].copy(), cache._lo[:b].copy()
            else:
                start, new_len, lo_arr = cache._place(rows, None, n_new)
            _spec.check_held(rows, new_len, sq)
            k_row0, k_len, q_pos0, k_pos0 = lo_arr % cap, new_len - lo_arr, new_len - sq, lo_arr
        be = self.be
        q_rot = None
        if n_new:  # everything is checked: only now touch the cache (as _commit does)
            if self.fused is not None:
                q_rot = self.fused(cache.k, cache.v, k, v, q, rows, start, self.rope,
                                   cache.k_scales, cache.v_scales)
            if q_rot is None:
                be.cache_write(cache.k, k, rows, start, self.rope, cache.k_scales)
                be.cache_write(cache.v, v, rows, start, None, cache.v_scales)
        if n_new is not None:  # lo <= new_len here (as np.minimum in _commit)
            if rows is self.rows:
                cache._len[:b], cache._lo[:b] = new_len, lo_arr
            else:
                cache._len[rows], cache._lo[rows] = new_len, lo_arr
        q_batch, q_row0, q_len, chi = self.consts
        values = dict(self.fields, q=q, k=cache.k, v=cache.v, q_batch=q_batch.copy(),
                      q_row0=q_row0.copy(), q_len=q_len.copy(), k_batch=rows.copy(),
                      k_row0=k_row0, k_len=k_len, q_pos0=q_pos0, k_pos0=k_pos0,
                      causal_hi=None if chi is None else chi.copy(), options=options,
                      k_scales=cache.k_scales, v_scales=cache.v_scales)
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

    def _mapped(self, cache: KVCache, start_pos: Any,
                batch_idx: Any) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray]:
        """The cache's own checks of ``batch_idx`` and ``start_pos`` (a failing one raises the
        front door's error, the cache untouched): (cache rows, start, new lengths, first held
        positions)."""
        rows = self.rows
        if batch_idx is not None:
            rows = cache._rows(batch_idx, "batch_idx", self.b)
            if self.n_new is not None:
                _spec.check_distinct_rows(rows)
        if self.n_new is None:
            return rows, None, cache._len[rows], cache._lo[rows]
        start, end, lo = cache._place(rows, start_pos, self.n_new)
        return rows, start, end, np.minimum(lo, end)
