"""PagedKVCache: keys and values in a pool of fixed-size pages (contract §8).

The pool ``k_pages (num_pages, page_size, Hkv, D)`` / ``v_pages (..., Dv)`` lives on the backend's
device; the bookkeeping lives on the host: per live sequence its page list (its block table row)
and length, per page a reference count, and a stack of free pages. Token ``t`` of a sequence lives
in slot ``t % page_size`` of page ``pages[t // page_size]`` (vLLM's and FlashInfer's layout), and
a sequence of length ``L`` holds exactly ``ceil(L / page_size)`` pages.

``fork`` shares pages (reference counts, no copy). An append that writes into a shared partial
last page first copies that page (copy-on-write); full pages are never written again, shared or
not. Every method validates its whole call (ids, shapes, dtypes, and the pages the whole batch
needs, copies-on-write included) before it touches anything, so a refused call changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import _cascade, _quant, _spec, registry
from ._common import check_rope, device_contiguous, empty_lse, pick_backend
from .backends.base import AttnCall, Backend, RopeSpec

__all__ = ["PagedKVCache", "attention_with_paged_kvcache", "paged_attention"]


@dataclass(frozen=True)
class _Append:
    """A validated append: nothing of it has touched the cache yet."""

    sids: np.ndarray
    k: object  # packed (T, Hkv, D)
    v: object
    new_len: np.ndarray  # per sequence, after the append
    tables: list  # per sequence (first, pages): its page list from index first on, after it
    taken: list  # pages taken from the free stack (its last len(taken) entries)
    cow_src: np.ndarray  # shared partial pages copied ...
    cow_dst: np.ndarray  # ... into these fresh pages
    slots: np.ndarray  # int64 (T,): flat slot page * page_size + slot of each new token
    positions: np.ndarray  # int64 (T,): absolute position of each new token


class PagedKVCache:
    """A paged key/value cache for many sequences (vLLM's PagedAttention, FlashInfer's paged
    KV cache): ``k_pages (num_pages, page_size, n_kv_heads, head_dim)`` and ``v_pages (...,
    head_dim_v)`` are allocated once on the backend's device (``queue=`` a
    ``pyopencl.CommandQueue``: the OpenCL backend on it); their memory order is the backend's
    (numba: each kv head's rows of a page contiguous, a strided view of that shape).

    ``new_sequence()`` returns an int id (never reused); ``append(sids, k, v)`` adds ``k (B,
    S_new, Hkv, D)`` per id, or packed ``(total, Hkv, D)`` with ``cu_seqlens=`` (int (B + 1,));
    ``fork(sid)`` starts a sequence sharing every page of ``sid`` (no copy; a shared partial last
    page is copied on the next append to it); ``truncate(sid, length)`` keeps the first
    ``length`` tokens and releases pages no longer used; ``free(sid)`` releases all of its
    pages. A page returns to the pool when no sequence holds it. ``block_table(sids)`` is the
    int32 ``(B, max_pages)`` table (vLLM's ``block_tables``; -1 past each sequence's last page).

    ``kv_dtype`` (``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"int8"``; default: ``dtype``) stores
    the pages in 8 bits with the float32 scale pools ``k_scales`` / ``v_scales`` ``(num_pages,
    page_size, n_kv_heads)`` beside them (None when not quantized): one scale per (token, kv
    head), set when the token is written (``absmax / the format's largest value``, after RoPE),
    in the same slot as the token, so fork, copy-on-write and truncate keep them together.
    Attention reads ``scale * stored`` inside its kernels; :meth:`dequantized` returns those
    values, and ``paged_attention(..., k_scales=, v_scales=)`` reads the pools directly.

    Errors: an append needing more pages than are free is a ``CacheOverflowError``; an unknown or
    freed id, a duplicate id in one call, a length beyond a sequence's length are
    ``ArgumentError``; k / v of another dtype are a ``DTypeError``. A refused call changes
    nothing, in any sequence.
    """

    def __init__(self, num_pages, page_size, n_kv_heads, head_dim, *, head_dim_v=None,
                 dtype="float32", backend=None, queue=None, kv_dtype=None):
        self.num_pages = _spec.check_int(num_pages, "num_pages", minimum=1)
        self.page_size = _spec.check_int(page_size, "page_size", minimum=1)
        self.n_kv_heads, self.head_dim, self.head_dim_v, self.dtype = _spec.check_cache_geometry(
            n_kv_heads, head_dim, head_dim_v, dtype)
        self.kv_format = _spec.check_kv_dtype(kv_dtype, self.dtype)
        #: the dtype the pages are stored in (``dtype`` unless quantized)
        self.kv_dtype = self.dtype if self.kv_format is None else self.kv_format.dtype
        self.backend: Backend = pick_backend(backend, (), self.dtype, queue=queue)
        shape = (self.num_pages, self.page_size, self.n_kv_heads)
        self.k_pages = self.backend.page_alloc(shape + (self.head_dim,), self.kv_dtype)
        self.v_pages = self.backend.page_alloc(shape + (self.head_dim_v,), self.kv_dtype)
        self.k_scales = self.v_scales = None
        if self.kv_format is not None:
            self.k_scales = self.backend.cache_alloc(shape, np.dtype(np.float32))
            self.v_scales = self.backend.cache_alloc(shape, np.dtype(np.float32))
        self._refs = np.zeros(self.num_pages, np.int64)
        # a stack: pages are taken from its end, so a fresh cache hands out 0, 1, 2, ...
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._next_id = 0
        # block tables of recent calls by their sequence ids (a decode step's table changes once
        # a page, and building one is a Python loop over every page); emptied whenever a
        # sequence's pages change
        self._tables: dict[tuple[int, ...], np.ndarray] = {}

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"head_dim_v={self.head_dim_v}, dtype={self.dtype}, "
                f"kv_dtype={self.kv_dtype}, backend={self.backend.name!r})")

    # ---- bookkeeping -----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """``num_pages`` minus the distinct pages live sequences hold (nothing is reserved)."""
        return len(self._free)

    def new_sequence(self) -> int:
        """A new sequence id: it holds 0 tokens and no page."""
        sid = self._next_id
        self._next_id += 1
        self._pages[sid] = []
        self._len[sid] = 0
        return sid

    def fork(self, sid) -> int:
        """A new sequence sharing every page of ``sid`` (reference counted; no data copied)."""
        s = _spec.check_sid(sid, self._pages)
        child = self.new_sequence()
        self._pages[child] = list(self._pages[s])
        self._len[child] = self._len[s]
        for p in self._pages[s]:
            self._refs[p] += 1
        return child

    @_spec.front_door
    def truncate(self, sid, length) -> None:
        """Keep the first ``length`` tokens of ``sid`` (rollback, as in speculative decoding);
        pages it no longer needs are released (freed when no other sequence holds them)."""
        s = _spec.check_sid(sid, self._pages)
        length = _spec.check_int(length, "length", minimum=0)
        _spec.check_truncate_length(length, s, self._len[s])
        keep = -(-length // self.page_size)
        self._release(self._pages[s][keep:])
        del self._pages[s][keep:]
        self._len[s] = length
        self._tables.clear()

    def free(self, sid) -> None:
        """Forget ``sid``; its pages go back to the pool when no other sequence holds them."""
        s = _spec.check_sid(sid, self._pages)
        self._release(self._pages.pop(s))
        del self._len[s]
        self._tables.clear()

    @_spec.front_door
    def lengths(self, sids) -> np.ndarray:
        """Tokens held per sequence: int64 ``(B,)``."""
        ids = _spec.check_sids(sids, self._pages)
        return np.array([self._len[i] for i in ids.tolist()], np.int64)

    @_spec.front_door
    def block_table(self, sids) -> np.ndarray:
        """int32 ``(B, max_pages)``, ``max_pages`` the most pages any of them holds; -1 past
        each sequence's last page."""
        ids = _spec.check_sids(sids, self._pages)
        return self._table(ids.tolist()).copy()

    def dequantized(self, sids) -> tuple[np.ndarray, np.ndarray]:
        """The values attention reads for the sequences ``sids``, as float64 numpy arrays (for
        checks): packed ``k (total, n_kv_heads, head_dim)`` and ``v (..., head_dim_v)``, each
        sequence's tokens in order, one after another (split them by :meth:`lengths`):
        ``scale * stored`` when quantized, else the stored values."""
        ids = _spec.check_sids(sids, self._pages)
        ps, read = self.page_size, self.backend.cache_read
        slots = [np.asarray(self._pages[i], np.int64)[np.arange(self._len[i]) // ps] * ps
                 + np.arange(self._len[i]) % ps for i in ids.tolist()]
        flat = _cat(slots)
        out = []
        for pool, scales in ((self.k_pages, self.k_scales), (self.v_pages, self.v_scales)):
            x = read(pool)
            x = x.reshape((-1,) + x.shape[2:])[flat]
            if scales is None:
                out.append(x.astype(np.float64))
            else:
                sc = read(scales)
                out.append(_quant.dequantize(x, sc.reshape((-1,) + sc.shape[2:])[flat]))
        return out[0], out[1]

    @_spec.front_door
    def append(self, sids, k, v, *, cu_seqlens=None) -> None:
        """Append ``k (B, S_new, Hkv, D)``, ``v (B, S_new, Hkv, Dv)`` to the B sequences
        ``sids``, or packed ``k (total, Hkv, D)`` split by ``cu_seqlens`` (int32 ``(B + 1,)``,
        as in ``attention_varlen``). A shared partial last page is copied first (copy-on-write).
        """
        ids = _spec.check_sids(sids, self._pages)
        self._commit(self._plan(ids, k, v, cu_seqlens, "cu_seqlens"), None)

    # ---- internals -------------------------------------------------------------------------------
    def _table(self, ids: list[int]) -> np.ndarray:
        """The block table of ``ids`` (never to be written: it is kept for the next call)."""
        key = tuple(ids)
        table = self._tables.get(key)
        if table is None:
            width = max((len(self._pages[i]) for i in ids), default=0)
            table = np.full((len(ids), width), -1, np.int32)
            for row, i in enumerate(ids):
                table[row, :len(self._pages[i])] = self._pages[i]
            table.flags.writeable = False  # calls may keep what they derive from it by identity
            if len(self._tables) >= 16:
                self._tables.clear()
            self._tables[key] = table
        return table

    def _release(self, pages: list[int]) -> None:
        for p in reversed(pages):  # the sequence's first page ends on top of the stack
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def _plan(self, ids: np.ndarray, k, v, cu, cu_name: str) -> _Append:
        """Check an append whole (shapes, dtypes, and the pages the batch needs, copies-on-write
        included) and decide every page and slot, touching nothing."""
        n_seq = ids.shape[0]
        _spec.check_kv_given(k, v, None)
        n_new = _spec.check_packed(k, "k", n_seq, cu, cu_name, self.n_kv_heads, self.head_dim,
                                   self.dtype)
        n_v = _spec.check_packed(v, "v", n_seq, cu, cu_name, self.n_kv_heads, self.head_dim_v,
                                 self.dtype, dim_name="head_dim_v")
        _spec.check_paged_kv_agree(k, v, n_new, n_v)
        _spec.check_paged_kv_arrays(k, v, self.backend)
        ps = self.page_size
        refs: dict[int, int] = {}  # reference counts this append changes
        n_free = len(self._free)
        taken = 0
        plans, cows, new_len = [], {}, np.zeros(n_seq, np.int64)
        for b, s in enumerate(ids.tolist()):
            pages, length, n = self._pages[s], self._len[s], int(n_new[b])
            new_len[b] = length + n
            first = length // ps  # the first page this append writes (the partial last one)
            if n and length % ps and refs.get(pages[-1], int(self._refs[pages[-1]])) > 1:
                last = pages[-1]
                refs[last] = refs.get(last, int(self._refs[last])) - 1
                cows[b] = last
                taken += 1
            extra = -(-(length + n) // ps) - len(pages)
            taken += extra
            plans.append((first, extra))
        _spec.check_pages_free(taken, n_free, self.num_pages)
        # pages come off the end of the free stack in pop order
        fresh = self._free[len(self._free) - taken:][::-1]
        it = iter(fresh)
        src, dst, tails, slots, positions = [], [], [], [], []
        for b, s in enumerate(ids.tolist()):
            first, extra = plans[b]
            tail = self._pages[s][first:]  # the pages from `first` on, after the append
            if b in cows:
                tail[0] = next(it)
                src.append(cows[b])
                dst.append(tail[0])
            tail.extend(next(it) for _ in range(extra))
            tails.append((first, tail))
            n = int(n_new[b])
            if n:
                pos = self._len[s] + np.arange(n, dtype=np.int64)
                slots.append(np.asarray(tail, np.int64)[pos // ps - first] * ps + pos % ps)
                positions.append(pos)
        return _Append(ids, self._packed(k), self._packed(v), new_len, tails, fresh,
                       np.asarray(src, np.int64), np.asarray(dst, np.int64), _cat(slots),
                       _cat(positions))

    def _packed(self, x):
        """k or v as packed ``(T, H, D)`` (a batched ``(B, S, H, D)`` is flattened)."""
        if len(x.shape) == 3:
            return x
        b, s, h, d = x.shape
        if not isinstance(x, np.ndarray) and not x.flags.c_contiguous:
            x = device_contiguous(x, self.backend)
        return x.reshape((b * s, h, d))

    def _commit(self, w: _Append, rope: RopeSpec | None) -> None:
        be = self.backend
        if w.cow_src.size:  # copies first: a later write of this call may go into a source
            for pool in (self.k_pages, self.v_pages, self.k_scales, self.v_scales):
                if pool is not None:
                    be.copy_pages(pool, w.cow_src, w.cow_dst)
        if w.slots.size:
            be.cache_write_slots(self.k_pages, w.k, w.slots, w.positions, rope, self.k_scales)
            be.cache_write_slots(self.v_pages, w.v, w.slots, w.positions, None, self.v_scales)
        if w.taken:
            del self._free[len(self._free) - len(w.taken):]
        for p in w.taken:
            self._refs[p] = 1
        for p in w.cow_src.tolist():
            self._refs[p] -= 1  # never to 0: another sequence still holds it
        for b, s in enumerate(w.sids.tolist()):
            first, tail = w.tables[b]
            if tail or first < len(self._pages[s]):
                self._pages[s][first:] = tail
                self._tables.clear()
            self._len[s] = int(w.new_len[b])


def _cat(parts: list) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _options(d: int, hq: int, n_seq: int, **options):
    """The call's checked options (``options``: its option keywords) and its causal bound (0:
    bottom-right, keys up to the row)."""
    options = _spec.attn_options(d, hq, n_seq, top_left=False, **options)
    return dict(options=options,
                causal_hi=None if options.causal is None else np.zeros(n_seq, np.int64))


def _finish(be: Backend, call: AttnCall, packed: bool, return_lse: bool):
    q = call.q
    if q.shape[1] == 0 or q.shape[0] == 0 or call.n_seq == 0:
        out = np.zeros(tuple(q.shape[:3]) + (call.head_dim_v,), call.dtype)
        lse = empty_lse(call, q.shape[0], q.shape[1])
    else:
        out, lse = _cascade.attention(be, call)
    if packed:
        out = out[0]
        lse = None if lse is None else lse[0]
    return (out, lse) if return_lse else out


@_spec.front_door
@_spec.keywords_checked
def attention_with_paged_kvcache(q, cache, sids, k=None, v=None, *, cu_seqlens_q=None, rope=None,
                                 causal=True, scale=None, window=None, softcap=None,
                                 alibi_slopes=None, sinks=None, return_lse=False, backend=None):
    """Append ``k``, ``v`` (if given) to each sequence ``sids`` of ``cache``, then attend ``q``
    over its tokens (contract §8, with the rules of ``attention_with_kvcache``; FlashInfer's
    ``BatchPrefillWithPagedKVCacheWrapper`` / vLLM's paged attention in one call).

    ``q (B, Sq, Hq, D)`` with ``k (B, S_new, Hkv, D)``, or packed ``q (total_q, Hq, D)`` with
    ``cu_seqlens_q`` (int32 ``(B + 1,)``), ``k (total_q, Hkv, D)`` split by the same
    ``cu_seqlens_q``: prefill chunks of some sequences and decode steps of others in one call.
    Query row ``i`` of sequence ``b`` sits at position ``len_b - Sq_b + i`` (``len_b`` after the
    append); causal is bottom-right; ``rope=attnlib.RoPE(...)`` rotates q and the new k at their
    positions (fused into the write where the backend can). Returns ``out`` shaped like q with
    ``Dv``, and with ``return_lse`` the LSE ``(B, Hq, Sq)`` or, packed, ``(Hq, total_q)``.
    ``sinks`` (float32 ``(Hq,)``): attention sinks, as in ``attention``.
    Every check runs before the cache is touched: a refused call changes nothing.

    Sequences of the call that hold the same leading full pages (forks of one prompt) read them
    once for all of them where that is exact (cascade: no ALiBi, every row seeing the whole
    shared prefix; float32 partial states, merged on the device on OpenCL; see
    ``attnlib._cascade``); the result is the same.
    """
    _spec.check_cache_instance(cache, PagedKVCache)
    be = cache.backend
    _spec.check_cache_backend(backend, None if backend is None else registry.get_backend(backend),
                              be)
    return_lse = _spec.check_bool(return_lse, "return_lse")
    ids = _spec.check_sids(sids, cache._pages)
    n_seq = ids.shape[0]
    q4, q_batch, q_row0, q_len = _spec.paged_queries(q, cu_seqlens_q, n_seq)
    _spec.check_cache_query_kind(q4, cache.dtype, cache.head_dim, cache.n_kv_heads)
    hq, d = q4.shape[2], q4.shape[3]
    _spec.check_readable(q, "q", be)
    opts = _options(d, hq, n_seq, scale=scale, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
    rope_spec = check_rope(rope, d)
    _spec.check_kv_given(k, v, None)
    write = None
    if k is None:
        new_len = cache.lengths(ids)
    else:
        write = cache._plan(ids, k, v, cu_seqlens_q, "cu_seqlens_q")
        new_len = write.new_len
    _spec.check_query_rows(q_len, new_len, "sequence")
    # -- everything is checked: only now touch the cache
    if write is not None:
        cache._commit(write, rope_spec)
    table = cache._table(ids.tolist())
    zeros = np.zeros(n_seq, np.int64)
    call = AttnCall(q=q4, k=cache.k_pages, v=cache.v_pages, q_batch=q_batch, q_row0=q_row0,
                    q_len=q_len, k_batch=zeros, k_row0=zeros.copy(), k_len=new_len.copy(),
                    q_pos0=new_len - q_len, k_pos0=zeros.copy(), need_lse=return_lse,
                    block_table=table, page_size=cache.page_size, k_scales=cache.k_scales,
                    v_scales=cache.v_scales, **opts)
    if rope_spec is not None and q4.shape[1] and q4.shape[0]:
        positions = np.zeros(q4.shape[:2], np.int64)
        for s in range(n_seq):
            r0, n = int(q_row0[s]), int(q_len[s])
            positions[q_batch[s], r0:r0 + n] = new_len[s] - n + np.arange(n)
        call = replace(call, q=be.rope(q4, positions, rope_spec))
    return _finish(be, call, cu_seqlens_q is not None, return_lse)


@_spec.front_door
@_spec.keywords_checked
def paged_attention(q, k_pages, v_pages, block_table, seq_lens, *, cu_seqlens_q=None, causal=True,
                    scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
                    return_lse=False, backend=None, k_scales=None, v_scales=None):
    """Attention over a caller-owned page pool (the stateless form, for engines that manage
    pages themselves; vLLM's and FlashAttention's ``block_table`` / ``seq_lens`` names).

    ``k_pages (num_pages, page_size, Hkv, D)``, ``v_pages (..., Dv)``; sequence ``b`` holds
    ``seq_lens[b]`` tokens, token ``t`` in slot ``t % page_size`` of page
    ``block_table[b, t // page_size]`` (int32 ``(B, max_pages)``). ``q`` is ``(B, Sq, Hq, D)``
    or packed ``(total_q, Hq, D)`` with ``cu_seqlens_q``; query row ``i`` of sequence ``b`` sits
    at position ``seq_lens[b] - Sq_b + i`` and causal is bottom-right, as in
    ``attention_with_paged_kvcache``. A numpy ``block_table`` is checked entry by entry (a -1 or
    an out-of-range page where a sequence needs one: ``ArgumentError``); a device table is taken
    as given, and no kernel reads outside the pool whatever it holds (page indices are clamped;
    the result for a sequence with such entries is unspecified). ``sinks`` (float32 ``(Hq,)``):
    attention sinks, as in ``attention``. With a host table, shared leading full pages are read
    once per group of sequences, as in ``attention_with_paged_kvcache``.

    Quantized pools (contract §10; a ``PagedKVCache(kv_dtype=...)``'s pages): ``k_pages`` /
    ``v_pages`` of ``ml_dtypes.float8_e4m3fn``, ``ml_dtypes.float8_e5m2`` or ``int8`` with
    ``k_scales`` / ``v_scales`` float32 ``(num_pages, page_size, Hkv)``; the keys read are
    ``k_scales[..., None] * k_pages`` (likewise v), dequantized inside the kernel; q (any float
    dtype) sets the compute and output dtype. Pools of those dtypes without scales, or scales
    with float pools, are a ``DTypeError``.
    """
    return_lse = _spec.check_bool(return_lse, "return_lse")
    _spec.check_array(k_pages, "k_pages", ndim=4)
    _spec.check_array(v_pages, "v_pages", ndim=4)
    n_seq = int(block_table.shape[0]) if _spec.is_array(block_table) and \
        len(block_table.shape) == 2 else -1
    if n_seq < 0:
        _spec.check_array(block_table, "block_table", ndim=2)
    q4, q_batch, q_row0, q_len = _spec.paged_queries(q, cu_seqlens_q, n_seq)
    if k_scales is None and v_scales is None:
        _spec.check_unscaled_pools(k_pages, v_pages)
        dtype = _spec.check_qkv(q4, k_pages, v_pages, ndim=4)
    else:
        dtype = _spec.check_scale_pools(q4, k_pages, v_pages, k_scales, v_scales)
    _spec.check_heads(q4.shape, k_pages.shape, v_pages.shape, ("q", "k_pages", "v_pages"))
    _spec.check_page_pool(k_pages)
    num_pages, page_size = int(k_pages.shape[0]), int(k_pages.shape[1])
    table, lens = _spec.check_page_table(block_table, seq_lens, n_seq, num_pages, page_size)
    _spec.check_query_rows(q_len, lens, "sequence")
    hq, d = q4.shape[2], q4.shape[3]
    opts = _options(d, hq, n_seq, scale=scale, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
    arrays = (q, k_pages, v_pages, table) + (() if k_scales is None else (k_scales, v_scales))
    be = pick_backend(backend, arrays, dtype)
    zeros = np.zeros(n_seq, np.int64)
    call = AttnCall(q=q4, k=k_pages, v=v_pages, q_batch=q_batch, q_row0=q_row0, q_len=q_len,
                    k_batch=zeros, k_row0=zeros.copy(), k_len=lens, q_pos0=lens - q_len,
                    k_pos0=zeros.copy(), need_lse=return_lse, block_table=table,
                    page_size=page_size, k_scales=k_scales, v_scales=v_scales, **opts)
    return _finish(be, call, cu_seqlens_q is not None, return_lse)
