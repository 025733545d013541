"""contract §8: PagedKVCache, attention_with_paged_kvcache and paged_attention against a plain
model of each sequence's tokens, the contiguous KVCache and plain attention on the same tokens.

Every cache starts with its free pages shuffled (each page taken by a one-token sequence, then
freed in random order), so the pages of one sequence are neither adjacent nor in order.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, randn, rng_for, unsupported_ok
from attnlib.testing.reference import naive_attention, reference_attention, reference_rope
from attnlib.testing.tolerance import as_f64, check_attention

HKV, HQ, D = 2, 4, 16


class Paged:
    """A real PagedKVCache and a plain model of it (float64 tokens per sequence), driven
    together. The model also keeps, per sequence, the pages it holds (from block_table), so
    that the pool's reference counts and free pages are checked after every step."""

    def __init__(self, backend, num_pages, page_size, *, hq=HQ, hkv=HKV, d=D, dv=D,
                 dtype="float32", seed="paged", scatter=True):
        import attnlib

        self.backend = backend
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
        self.rng = rng_for(seed, num_pages, page_size, hq, hkv, d, dv, str(dtype))
        self.hq, self.hkv, self.d, self.dv = hq, hkv, d, dv
        self.num_pages, self.page_size = num_pages, page_size
        self.cache = attnlib.PagedKVCache(num_pages, page_size, hkv, d, head_dim_v=dv,
                                          dtype=self.dtype, backend=backend)
        self.k: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.rotated: dict[int, np.ndarray] = {}  # per token: k was rotated (RoPE) on the way in
        if scatter:
            self.scatter()

    def scatter(self):
        """Shuffle the free stack: every free page goes to a one-token sequence, freed in random
        order."""
        n = self.cache.num_free_pages
        if n == 0:
            return
        sids = [self.cache.new_sequence() for _ in range(n)]
        k, v = self.kv(n, 1)
        self.cache.append(sids, k, v)
        for i in self.rng.permutation(n):
            self.cache.free(sids[i])
        assert self.cache.num_free_pages == n

    def kv(self, b, s):
        return (randn(self.rng, (b, s, self.hkv, self.d), self.dtype),
                randn(self.rng, (b, s, self.hkv, self.dv), self.dtype))

    def new(self, n=1):
        sids = [self.cache.new_sequence() for _ in range(n)]
        for s in sids:
            self.k[s] = np.zeros((0, self.hkv, self.d))
            self.v[s] = np.zeros((0, self.hkv, self.dv))
            self.rotated[s] = np.zeros(0, bool)
        return sids

    def fork(self, sid):
        child = self.cache.fork(sid)
        self.k[child], self.v[child] = self.k[sid].copy(), self.v[sid].copy()
        self.rotated[child] = self.rotated[sid].copy()
        return child

    def truncate(self, sid, length):
        self.cache.truncate(sid, length)
        self.k[sid], self.v[sid] = self.k[sid][:length], self.v[sid][:length]
        self.rotated[sid] = self.rotated[sid][:length]

    def free(self, sid):
        self.cache.free(sid)
        del self.k[sid], self.v[sid], self.rotated[sid]

    def _model_append(self, sid, k, v, rope):
        pos = len(self.k[sid]) + np.arange(k.shape[0])
        k = np.asarray(k, np.float64)
        if rope is not None:
            k = reference_rope(k[None], pos[None], **rope)[0].astype(self.dtype)
        self.k[sid] = np.concatenate([self.k[sid], np.asarray(k, np.float64)])
        self.v[sid] = np.concatenate([self.v[sid], np.asarray(v, np.float64)])
        self.rotated[sid] = np.concatenate([self.rotated[sid],
                                            np.full(k.shape[0], rope is not None)])

    def new_tokens(self, lens):
        """Packed k, v for ``lens`` new tokens per sequence and their cu_seqlens."""
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        k, v = self.kv(1, int(cu[-1]))
        return k[0], v[0], cu

    def append(self, sids, lens, *, packed=None):
        """Append ``lens[b]`` tokens to ``sids[b]``: batched when all lens are equal (unless
        ``packed``), else packed with cu_seqlens."""
        lens = list(lens)
        if packed is None:
            packed = len(set(lens)) > 1
        if packed:
            k, v, cu = self.new_tokens(lens)
            self.cache.append(sids, k, v, cu_seqlens=cu)
            parts = [(k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]) for b in range(len(sids))]
        else:
            k, v = self.kv(len(sids), lens[0])
            self.cache.append(sids, k, v)
            parts = list(zip(k, v))
        for s, (kb, vb) in zip(sids, parts):
            self._model_append(s, kb, vb, None)
        self.check()

    def attend(self, sids, q_lens, new_lens=None, *, packed=True, rope=None, **kw):
        """attention_with_paged_kvcache (packed q with cu_seqlens_q, or batched) with
        ``new_lens`` appended tokens (packed: then new_lens == q_lens); checked per sequence
        against plain attention on the model's tokens."""
        import attnlib

        n = len(sids)
        k = v = None
        if packed:
            cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            q = randn(self.rng, (int(cu[-1]), self.hq, self.d), self.dtype)
            if new_lens is not None:
                assert list(new_lens) == list(q_lens)
                k, v, _ = self.new_tokens(q_lens)
            out, lse = attnlib.attention_with_paged_kvcache(
                q, self.cache, sids, k, v, cu_seqlens_q=cu, return_lse=True,
                rope=None if rope is None else attnlib.RoPE(**rope), backend=self.backend, **kw)
            assert out.shape == (cu[-1], self.hq, self.dv) and out.dtype == self.dtype
            assert lse.shape == (self.hq, cu[-1])
            rows = [(q[cu[b]:cu[b + 1]], slice(cu[b], cu[b + 1])) for b in range(n)]
            new = None if k is None else [(k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]])
                                          for b in range(n)]
        else:
            sq = q_lens[0]
            q = randn(self.rng, (n, sq, self.hq, self.d), self.dtype)
            if new_lens is not None:
                k, v = self.kv(n, new_lens[0])
            out, lse = attnlib.attention_with_paged_kvcache(
                q, self.cache, sids, k, v, return_lse=True,
                rope=None if rope is None else attnlib.RoPE(**rope), backend=self.backend, **kw)
            assert out.shape == (n, sq, self.hq, self.dv) and out.dtype == self.dtype
            assert lse.shape == (n, self.hq, sq)
            rows = [(q[b], b) for b in range(n)]
            new = None if k is None else list(zip(k, v))
        if new is not None:
            for s, (kb, vb) in zip(sids, new):
                self._model_append(s, kb, vb, rope)
        for b, (s, (qb, at)) in enumerate(zip(sids, rows)):
            kw_b = dict(kw)
            if kw.get("alibi_slopes") is not None and np.ndim(kw["alibi_slopes"]) == 2:
                kw_b["alibi_slopes"] = kw["alibi_slopes"][b]
            if packed:
                got, got_lse = out[at], lse[:, at]
            else:
                got, got_lse = out[at], lse[at]
            self.check_rows(s, qb, got, got_lse, rope, **kw_b)
        self.check()
        return out, lse

    def check_rows(self, sid, q, out, lse, rope=None, causal=True, **kw):
        """One sequence's rows against plain attention over the model's tokens (bottom-right:
        row i sits at position len - Sq + i)."""
        length, sq = len(self.k[sid]), q.shape[0]
        q64 = np.asarray(q, np.float64)
        if rope is not None:
            q64 = reference_rope(q64[None], (length - sq + np.arange(sq))[None], **rope)[0]
        k, v = self.k[sid][None], self.v[sid][None]
        ref, ref_lse = reference_attention(q64[None], k, v, causal=causal, **kw)
        naive = naive_lse = None
        if self.dtype != np.float64:
            naive, naive_lse = naive_attention(q64[None].astype(self.dtype), k.astype(self.dtype),
                                               v.astype(self.dtype), causal=causal, **kw)
        check_attention(as_f64(out)[None], None if lse is None else as_f64(lse)[None], ref,
                        naive, ref_lse, naive_lse)

    def check(self):
        """Lengths, block tables, free pages and the pool's contents against the model."""
        cache = self.cache
        sids = list(self.k)
        if not sids:
            assert cache.num_free_pages == self.num_pages
            return
        lengths = cache.lengths(sids)
        assert lengths.tolist() == [len(self.k[s]) for s in sids]
        table = cache.block_table(sids)
        assert table.dtype == np.int32
        need = -(-lengths // self.page_size)
        assert table.shape == (len(sids), int(need.max(initial=0)))
        held = set()
        for b in range(len(sids)):
            row = table[b]
            assert (row[need[b]:] == -1).all() and (row[:need[b]] >= 0).all()
            assert (row[:need[b]] < self.num_pages).all()
            assert len(set(row[:need[b]].tolist())) == need[b]
            held.update(row[:need[b]].tolist())
        assert cache.num_free_pages == self.num_pages - len(held)
        kp, vp = self.pools()
        for b, s in enumerate(sids):
            n = int(lengths[b])
            pos = np.arange(n)
            pages = table[b][pos // self.page_size]
            got_k = kp[pages, pos % self.page_size]
            got_v = vp[pages, pos % self.page_size]
            # rotated keys: the backend's rotation may round differently in the last bits
            rot = self.rotated[s]
            got_k = got_k.astype(np.float64)
            assert np.array_equal(got_k[~rot], self.k[s][~rot]), f"k of sequence {s}"
            eps = float(np.finfo(np.float32).eps) if self.dtype == np.float64 else \
                8 * float(ml_dtypes.finfo(self.dtype).eps)
            np.testing.assert_allclose(got_k[rot], self.k[s][rot], rtol=eps, atol=eps,
                                       err_msg=f"rotated k of sequence {s}")
            assert np.array_equal(got_v.astype(np.float64), self.v[s]), f"v of sequence {s}"

    def pools(self):
        import attnlib

        return attnlib.to_numpy(self.cache.k_pages), attnlib.to_numpy(self.cache.v_pages)

    def state(self):
        """Everything a refused call must leave unchanged (lengths, tables, free pages, pool
        contents)."""
        sids = list(self.k)
        kp, vp = self.pools()
        return (self.cache.lengths(sids).tolist(), self.cache.block_table(sids).tolist(),
                self.cache.num_free_pages, kp.tobytes(), vp.tobytes())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_then_decode_mixed_batches(attnlib_backend, dtype):
    if unsupported_ok(attnlib_backend, dtype):
        import attnlib
        from attnlib.errors import UnsupportedError

        with pytest.raises(UnsupportedError):
            attnlib.PagedKVCache(4, 4, HKV, D, dtype=dtype, backend=attnlib_backend)
        return
    p = Paged(attnlib_backend, 24, 4, dv=11, dtype=dtype)
    a, b, c = p.new(3)
    p.attend([a, b], [7, 5], [7, 5])  # prefill two sequences in one packed call
    p.attend([a, b, c], [1, 1, 6], [1, 1, 6])  # decode two while the third prefills
    p.attend([c, a], [2, 3])  # queries without new tokens
    p.attend([a, b, c], [1, 1, 1], [1, 1, 1], packed=False)  # batched decode step
    p.attend([b, c], [2, 2], [3, 3], packed=False, causal=False)  # Sq != S_new


def test_pages_are_scattered(attnlib_backend):
    p = Paged(attnlib_backend, 16, 2)
    a, b = p.new(2)
    p.append([a, b], [7, 9])
    table = p.cache.block_table([a, b])
    for row in table:
        pages = row[row >= 0]
        assert (np.diff(pages) != 1).any(), "a sequence's pages should not be adjacent here"
    p.attend([a, b], [3, 1])


@pytest.mark.parametrize("opts", [
    dict(window=(3, 0)),
    dict(softcap=2.5, scale=0.3),
    dict(alibi=True),
    dict(causal=False, window=(2, 1)),
    dict(rope=dict(theta=10000.0, interleaved=False, rotary_dim=None)),
    dict(rope=dict(theta=500.0, interleaved=True, rotary_dim=8)),
], ids=["window", "softcap", "alibi", "noncausal-window", "rope", "rope-gptj"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_options(attnlib_backend, opts, heads):
    hq, hkv = heads
    p = Paged(attnlib_backend, 20, 3, hq=hq, hkv=hkv, d=D, dv=7)
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = (p.rng.random((2, hq)) * 0.5).astype(np.float32)
    a, b = p.new(2)
    p.attend([a, b], [8, 4], [8, 4], **kw)
    p.attend([a, b], [1, 3], [1, 3], **kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"][0]
    p.attend([b, a], [1, 1], [1, 1], packed=False, **kw)


def test_same_as_contiguous_cache(attnlib_backend):
    """The same tokens in a KVCache and a PagedKVCache give the same attention."""
    import attnlib

    p = Paged(attnlib_backend, 30, 4, dv=9)
    sids = p.new(3)
    contiguous = attnlib.KVCache(3, 40, HKV, D, head_dim_v=9, backend=attnlib_backend)
    rope = attnlib.RoPE(theta=1000.0)
    for n_new, sq in ((11, 11), (1, 1), (3, 2)):
        k, v = p.kv(3, n_new)
        q = randn(p.rng, (3, sq, HQ, D), p.dtype)
        o1, l1 = attnlib.attention_with_kvcache(q, contiguous, k, v, rope=rope, window=(6, 0),
                                                return_lse=True, backend=attnlib_backend)
        o2, l2 = attnlib.attention_with_paged_kvcache(q, p.cache, sids, k, v, rope=rope,
                                                      window=(6, 0), return_lse=True,
                                                      backend=attnlib_backend)
        np.testing.assert_allclose(as_f64(o2), as_f64(o1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(as_f64(l2), as_f64(l1), rtol=1e-4, atol=1e-5)


def test_fork_shares_and_copies_on_write(attnlib_backend):
    p = Paged(attnlib_backend, 12, 4)
    (a,) = p.new(1)
    p.append([a], [6])  # pages: one full, one partial (2 of 4 slots)
    free = p.cache.num_free_pages
    child = p.fork(a)
    assert p.cache.num_free_pages == free  # fork copies nothing
    assert p.cache.block_table([a]).tolist() == p.cache.block_table([child]).tolist()
    p.check()
    parent_before = p.state()
    p.append([child], [1])  # writes into the shared partial page: copied first
    assert p.cache.num_free_pages == free - 1
    ta, tc = p.cache.block_table([a, child])
    assert ta[0] == tc[0] and ta[1] != tc[1]  # the full page stays shared
    kp, _ = p.pools()
    assert kp[ta[1]].tobytes() == np.frombuffer(parent_before[3], kp.dtype).reshape(
        kp.shape)[ta[1]].tobytes()  # the parent's partial page is unchanged
    p.append([a], [3])  # the parent now owns its partial page alone: written in place
    assert p.cache.block_table([a])[0, 1] == ta[1]
    p.attend([a, child], [2, 1], [2, 1])
    grandchild = p.fork(child)
    p.append([child, grandchild], [2, 2])  # both share the partial page: one copy suffices
    p.attend([grandchild, child, a], [1, 1, 1])


def test_fork_of_full_pages_never_writes_them(attnlib_backend):
    p = Paged(attnlib_backend, 10, 4)
    (a,) = p.new(1)
    p.append([a], [8])  # two full pages
    child = p.fork(a)
    free = p.cache.num_free_pages
    p.append([child], [1])  # a fresh page; nothing copied
    assert p.cache.num_free_pages == free - 1
    p.append([a], [4])
    p.attend([a, child], [1, 1], [1, 1])


def test_truncate_rollback_and_free(attnlib_backend):
    from attnlib.errors import ArgumentError

    p = Paged(attnlib_backend, 14, 3)
    a, b = p.new(2)
    p.append([a, b], [10, 4])
    child = p.fork(a)
    free = p.cache.num_free_pages
    p.truncate(a, 4)  # a keeps 2 pages; the 2 it drops are still held by the child
    assert p.cache.num_free_pages == free
    p.check()
    p.truncate(child, 2)  # now the child drops 3 pages, 2 of them held by nobody else
    assert p.cache.num_free_pages == free + 2
    p.attend([a, child], [1, 1], [1, 1])  # both write into the shared page: copy-on-write
    with pytest.raises(ArgumentError, match="length"):
        p.cache.truncate(b, 5)
    p.truncate(b, 0)
    p.truncate(b, 0)
    p.attend([b], [2], [2])
    p.free(a)
    p.check()
    p.free(child)
    p.free(b)
    assert p.cache.num_free_pages == p.num_pages


def test_rollback_hides_old_tokens(attnlib_backend):
    """Tokens beyond a truncated length (NaN here) are never attended; rewriting them works."""
    p = Paged(attnlib_backend, 10, 4)
    (a,) = p.new(1)
    p.append([a], [5])
    k, v = p.kv(1, 3)
    k[:] = np.nan
    v[:] = np.inf
    p.cache.append([a], k, v)
    p.cache.truncate(a, 5)
    out, _ = p.attend([a], [2])
    assert np.isfinite(as_f64(out)).all()
    p.attend([a], [1], [1])


@pytest.mark.parametrize("how", ["append", "attention"])
def test_overflow_changes_nothing(attnlib_backend, how):
    import attnlib
    from attnlib.errors import CacheOverflowError

    p = Paged(attnlib_backend, 8, 4)
    a, b = p.new(2)
    p.append([a, b], [6, 2])  # 2 + 1 pages held, 5 free
    child = p.fork(a)
    p.check()
    before = p.state()
    # a: a copy of the shared partial page + 1 page; the child then owns the old one alone: 1;
    # b: 3 pages. 6 > 5 free, though 5 would do without counting the copy
    lens = [4, 4, 12]
    k, v, cu = p.new_tokens(lens)
    with pytest.raises(CacheOverflowError):
        if how == "append":
            p.cache.append([a, child, b], k, v, cu_seqlens=cu)
        else:
            q = randn(p.rng, (20, HQ, D), p.dtype)
            attnlib.attention_with_paged_kvcache(q, p.cache, [a, child, b], k, v,
                                                 cu_seqlens_q=cu, backend=attnlib_backend)
    assert p.state() == before
    p.attend([a, child, b], [1, 2, 1], [1, 2, 1])  # and the cache still works


def test_overflow_counts_copy_on_write(attnlib_backend):
    from attnlib.errors import CacheOverflowError

    p = Paged(attnlib_backend, 5, 4)
    (a,) = p.new(1)
    p.append([a], [6])
    child = p.fork(a)
    p.append([a], [2])  # fits a's partial page, but it is shared: copied (one page)
    grandchild = p.fork(child)
    (x,) = p.new(1)
    p.append([x], [8])
    assert p.cache.num_free_pages == 0
    before = p.state()
    with pytest.raises(CacheOverflowError):
        p.append([grandchild], [1])  # one slot left in its page, but the page is shared
    assert p.state() == before
    p.free(x)
    p.append([grandchild], [1])
    assert p.cache.num_free_pages == 1
    p.attend([a, child, grandchild], [1, 1, 1])


def test_errors(attnlib_backend):
    import attnlib
    from attnlib.errors import ArgumentError, DTypeError, ShapeError

    p = Paged(attnlib_backend, 10, 4)
    a, b = p.new(2)
    p.append([a, b], [3, 5])
    gone = p.new(1)[0]
    p.free(gone)
    before = p.state()
    k, v = p.kv(1, 2)
    q = randn(p.rng, (1, 1, HQ, D), p.dtype)
    c = p.cache
    for bad in (gone, 999, -1):
        for fn in (lambda x: c.append([x], k, v), c.fork, lambda x: c.truncate(x, 0), c.free,
                   lambda x: c.lengths([x]), lambda x: c.block_table([a, x]),
                   lambda x: attnlib.attention_with_paged_kvcache(q, c, [x], k, v)):
            with pytest.raises(ArgumentError):
                fn(bad)
    k2, v2 = p.kv(2, 1)
    for fn in (lambda: c.append([a, a], k2, v2), lambda: c.lengths([b, b]),
               lambda: c.block_table([a, a])):
        with pytest.raises(ArgumentError, match="twice"):
            fn()
    with pytest.raises(ArgumentError, match="length"):
        c.truncate(a, 4)
    with pytest.raises(ShapeError):  # more query rows than the sequence holds
        attnlib.attention_with_paged_kvcache(randn(p.rng, (1, 4, HQ, D), p.dtype), c, [a])
    with pytest.raises(ShapeError):
        attnlib.attention_with_paged_kvcache(randn(p.rng, (6, HQ, D), p.dtype), c, [a, b],
                                             cu_seqlens_q=np.array([0, 4, 6], np.int32))
    with pytest.raises(DTypeError):
        c.append([a], k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(DTypeError):
        attnlib.attention_with_paged_kvcache(q.astype(np.float64), c, [a])
    with pytest.raises(ShapeError):  # k batch != number of ids
        c.append([a, b], k, v)
    with pytest.raises(ShapeError):  # wrong kv heads
        c.append([a], randn(p.rng, (1, 2, 3, D), p.dtype), randn(p.rng, (1, 2, 3, D), p.dtype))
    with pytest.raises(ArgumentError):  # cu_seqlens not ending at the packed length
        c.append([a, b], k[0], v[0], cu_seqlens=np.array([0, 1, 3], np.int32))
    with pytest.raises(ArgumentError):
        c.append([a], k, None)
    assert p.state() == before


def test_paged_attention_host_tables(attnlib_backend):
    import attnlib
    from attnlib.errors import ArgumentError

    p = Paged(attnlib_backend, 16, 4, dv=5)
    a, b, c = p.new(3)
    p.append([a, b, c], [9, 4, 0])
    table = p.cache.block_table([a, b, c])
    lens = p.cache.lengths([a, b, c]).astype(np.int32)
    q = randn(p.rng, (4, HQ, D), p.dtype)
    cu = np.array([0, 3, 4, 4], np.int32)
    be = attnlib.get_backend(attnlib_backend)
    dev = be.to_device if be.owns(p.cache.k_pages) else (lambda x: x)  # q where the pool is
    out, lse = attnlib.paged_attention(dev(q), p.cache.k_pages, p.cache.v_pages, table, lens,
                                       cu_seqlens_q=cu, return_lse=True, window=(5, 0),
                                       backend=attnlib_backend)
    out, lse = attnlib.to_numpy(out), attnlib.to_numpy(lse)
    for i, s in enumerate((a, b)):
        p.check_rows(s, q[cu[i]:cu[i + 1]], out[cu[i]:cu[i + 1]], lse[:, cu[i]:cu[i + 1]],
                     window=(5, 0))
    qb = randn(p.rng, (2, 1, HQ, D), p.dtype)
    out = attnlib.to_numpy(attnlib.paged_attention(dev(qb), p.cache.k_pages, p.cache.v_pages,
                                                   table[:2], lens[:2], backend=attnlib_backend))
    for i, s in enumerate((a, b)):
        p.check_rows(s, qb[i], out[i], None)
    if not be.owns(p.cache.k_pages):  # host pools of the vLLM layout, C order
        kc, vc = (np.ascontiguousarray(x) for x in p.pools())
        out = attnlib.paged_attention(qb, kc, vc, table[:2], lens[:2], backend=attnlib_backend)
        for i, s in enumerate((a, b)):
            p.check_rows(s, qb[i], out[i], None)
    wide = np.concatenate([table, np.full((3, 2), -1, np.int32)], axis=1)  # -1 past the end
    attnlib.paged_attention(dev(qb[:1]), p.cache.k_pages, p.cache.v_pages, wide[:1], lens[:1],
                            backend=attnlib_backend)
    for bad_value in (-1, 16, 1 << 30):
        bad = table.copy()
        bad[0, 2] = bad_value  # a page sequence a needs
        with pytest.raises(ArgumentError, match=r"block_table\[0, 2\]"):
            attnlib.paged_attention(dev(qb[:1]), p.cache.k_pages, p.cache.v_pages, bad[:1],
                                    lens[:1], backend=attnlib_backend)
    with pytest.raises(ArgumentError, match="seq_lens"):
        attnlib.paged_attention(dev(qb[:1]), p.cache.k_pages, p.cache.v_pages, table[:1],
                                np.array([13], np.int32), backend=attnlib_backend)


def test_backends_clamp_page_indices(attnlib_backend):
    """A table nobody checked (a device table) may hold anything: the backend reads only inside
    the pool. Through the backend primitive, garbage entries give finite outputs of the right
    shape and leave the pool unchanged."""
    import attnlib
    from attnlib.backends.base import AttnCall, AttnOptions

    p = Paged(attnlib_backend, 6, 4)
    (a,) = p.new(1)
    p.append([a], [10])
    be = attnlib.get_backend(attnlib_backend)
    before = p.state()
    table = np.array([[5, 1 << 30, -7], [-(1 << 31), 2 ** 31 - 1, 3]], np.int32)
    q = randn(p.rng, (2, 2, HQ, D), p.dtype)
    n = np.array([10, 12])
    zeros = np.zeros(2, np.int64)
    call = AttnCall(q=be.to_device(q) if be.owns(p.cache.k_pages) else q, k=p.cache.k_pages,
                    v=p.cache.v_pages, q_batch=np.arange(2), q_row0=zeros, q_len=np.full(2, 2),
                    k_batch=zeros, k_row0=zeros, k_len=n, q_pos0=n - 2, k_pos0=zeros,
                    causal_hi=zeros, options=AttnOptions(0.25, "bottom_right"),
                    block_table=table, page_size=4)
    out, lse = be.attention(call)
    assert np.isfinite(as_f64(out)).all() and np.isfinite(as_f64(lse)).all()
    assert p.state() == before


def test_paged_attention_device_table(attnlib_backend):
    """A device-resident block_table with garbage entries: no crash, finite output, pool
    unchanged (only backends with device arrays take one)."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    p = Paged(attnlib_backend, 6, 4)
    (a,) = p.new(1)
    p.append([a], [10])
    if not be.owns(p.cache.k_pages):
        assert be.to_device(np.zeros(1)).__class__ is np.ndarray  # a host-only backend
        return
    before = p.state()
    table = be.to_device(np.array([[5, 1 << 30, -7], [-(1 << 31), 2 ** 31 - 1, 3]], np.int32))
    q = be.to_device(randn(p.rng, (2, 1, HQ, D), p.dtype))
    out = attnlib.paged_attention(q, p.cache.k_pages, p.cache.v_pages, table,
                                  np.array([10, 12], np.int32), backend=attnlib_backend)
    assert np.isfinite(as_f64(out)).all()
    assert p.state() == before


def test_empty_and_zero_length(attnlib_backend):
    import attnlib

    p = Paged(attnlib_backend, 6, 4)
    a, b = p.new(2)
    q = randn(p.rng, (0, HQ, D), p.dtype)
    out, lse = attnlib.attention_with_paged_kvcache(
        q, p.cache, [a, b], cu_seqlens_q=np.zeros(3, np.int32), return_lse=True,
        backend=attnlib_backend)
    assert out.shape == (0, HQ, D) and lse.shape == (HQ, 0)
    p.attend([a, b], [0, 2], [0, 2])  # a sequence with no rows next to one with rows
    assert p.cache.block_table([a]).shape == (1, 0)


def test_queue_argument(attnlib_backend):
    import attnlib
    from attnlib.errors import ArgumentError

    be = attnlib.get_backend(attnlib_backend)
    queue = getattr(be, "queue", None)
    if queue is None:
        with pytest.raises(ArgumentError):
            attnlib.PagedKVCache(2, 2, 1, 4, queue=object(), backend=attnlib_backend)
        return
    cache = attnlib.PagedKVCache(4, 2, 1, 4, queue=queue)
    assert cache.backend.name == "opencl" and cache.backend.queue is queue
