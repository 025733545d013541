"""contract §4: KVCache and attention_with_kvcache against a plain model of the cache."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, call_or_unsupported, randn, rng_for, unsupported_ok
from attnlib.testing.reference import CacheModel
from attnlib.testing.tolerance import check_attention

HKV, HQ, D = 2, 4, 16


class Pair:
    """A real KVCache and its model, driven together."""

    def __init__(self, backend, max_batch, max_seq, *, dv=D, dtype="float32", ring=False,
                 seed="pair", hq=HQ, hkv=HKV, d=D):
        import attnlib

        self.backend = backend
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
        self.rng = rng_for(seed, max_batch, max_seq, dv, str(dtype), ring, hq, hkv, d)
        self.dv, self.hq, self.hkv, self.d = dv, hq, hkv, d
        self.cache = attnlib.KVCache(max_batch, max_seq, hkv, d, head_dim_v=dv, dtype=self.dtype,
                                     ring=ring, backend=backend)
        self.model = CacheModel(max_batch, max_seq, hkv, d, dv, ring, self.dtype)

    def kv(self, b, s):
        return (randn(self.rng, (b, s, self.hkv, self.d), self.dtype),
                randn(self.rng, (b, s, self.hkv, self.dv), self.dtype))

    def update(self, b, s, start_pos):
        k, v = self.kv(b, s)
        self.cache.update(k, v, start_pos)
        self.model.update(np.arange(b), k, v, np.broadcast_to(start_pos, (b,)))

    def attend(self, sq, *, b=None, new=0, start_pos=None, batch_idx=None, rope=None,
               **kw):
        """attention_with_kvcache with ``new`` appended tokens; checked against the model."""
        import attnlib

        if b is None:
            b = len(self.model.lengths)
        rows = np.arange(b) if batch_idx is None else np.asarray(batch_idx)
        b = len(rows)
        q = randn(self.rng, (b, sq, self.hq, self.d), self.dtype)
        k = v = None
        if new:
            k, v = self.kv(b, new)
        out, lse = attnlib.attention_with_kvcache(
            q, self.cache, k, v, start_pos=start_pos, batch_idx=batch_idx,
            rope=None if rope is None else attnlib.RoPE(**rope), return_lse=True,
            backend=self.backend, **kw)
        if new:
            sp = self.model.lengths[rows] if start_pos is None else np.broadcast_to(
                start_pos, (b,))
            self.model.update(rows, k, v, sp, rope=rope)
        ref, ref_lse = self.model.attend(q, rows, rope=rope, **kw)
        naive = naive_lse = None
        if self.dtype != np.float64:
            naive, naive_lse = self.model.attend(q, rows, rope=rope, dtype=self.dtype, **kw)
        assert out.shape == (b, sq, self.hq, self.dv) and out.dtype == self.dtype
        assert lse.shape == (b, self.hq, sq)
        check_attention(out, lse, ref, naive, ref_lse, naive_lse)
        self.check_lengths()
        return out, lse

    def check_lengths(self):
        lengths = np.asarray(self.cache.lengths)
        assert lengths.shape == self.model.lengths.shape
        assert np.issubdtype(lengths.dtype, np.integer)
        assert np.array_equal(lengths, self.model.lengths), (lengths, self.model.lengths)

    def snapshot(self):
        """What the cache shows: its lengths and its attention over every row (bitwise)."""
        import attnlib

        n = len(self.model.lengths)
        q = randn(rng_for("snap"), (n, 1, self.hq, self.d), self.dtype)
        lengths = np.asarray(self.cache.lengths).copy()
        rows = np.flatnonzero(lengths > 0)
        out = attnlib.attention_with_kvcache(q[rows], self.cache, batch_idx=rows,
                                             backend=self.backend) if rows.size else None
        return lengths.tolist(), (None if out is None else out.tobytes())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_then_decode(attnlib_backend, dtype):
    if unsupported_ok(attnlib_backend, dtype):
        import attnlib
        from attnlib.errors import UnsupportedError

        with pytest.raises(UnsupportedError):
            attnlib.KVCache(2, 8, HKV, D, dtype=dtype, backend=attnlib_backend)
        return
    p = Pair(attnlib_backend, 3, 40, dv=11, dtype=dtype)
    p.update(3, 7, 0)
    p.attend(7)  # prefill queries over the prefilled keys, causal
    for _ in range(4):
        p.attend(1, new=1)  # decode: append one token and attend
    p.attend(3, new=3, causal=False)


def test_per_sequence_start_pos_and_rollback(attnlib_backend):
    p = Pair(attnlib_backend, 3, 30)
    p.update(3, 9, 0)
    p.update(3, 3, np.array([9, 2, 5]))  # append, and two rollbacks that rewrite
    assert list(p.cache.lengths) == [12, 5, 8]
    p.attend(2)
    p.attend(2, new=2, start_pos=np.array([4, 5, 1]))


def test_garbage_beyond_length_is_not_attended(attnlib_backend):
    p = Pair(attnlib_backend, 2, 20)
    p.update(2, 12, 0)
    k, v = p.kv(2, 3)
    k[:] = np.nan
    v[:] = np.inf
    p.cache.update(k, v, 9)  # positions 9..11 now hold NaN/inf...
    p.model.update(np.arange(2), k, v, np.array([9, 9]))
    p.update(2, 1, 8)  # ...and a rollback to 9 tokens leaves them beyond the length
    out, _ = p.attend(1)
    assert np.isfinite(out).all()


def test_gap_is_an_argument_error_and_changes_nothing(attnlib_backend):
    from attnlib.errors import ArgumentError

    p = Pair(attnlib_backend, 2, 20)
    p.update(2, 5, 0)
    before = p.snapshot()
    k, v = p.kv(2, 2)
    with pytest.raises(ArgumentError, match="start_pos"):
        p.cache.update(k, v, 6)
    with pytest.raises(ArgumentError, match="start_pos"):
        p.cache.update(k, v, np.array([5, 7]))
    assert p.snapshot() == before


@pytest.mark.parametrize("how", ["update", "attention"])
def test_overflow_raises_and_changes_nothing(attnlib_backend, how):
    import attnlib
    from attnlib.errors import CacheOverflowError

    p = Pair(attnlib_backend, 2, 16)
    p.update(2, 10, 0)
    before = p.snapshot()
    k, v = p.kv(2, 7)  # rollback to 8 + 7 = 15 fits for row 0, 10 + 7 = 17 overflows row 1
    start = np.array([8, 10])
    with pytest.raises(CacheOverflowError):
        if how == "update":
            p.cache.update(k, v, start)
        else:
            q = randn(p.rng, (2, 1, HQ, D), p.dtype)
            attnlib.attention_with_kvcache(q, p.cache, k, v, start_pos=start,
                                           backend=attnlib_backend)
    assert p.snapshot() == before
    p.check_lengths()
    p.attend(2, new=2)  # and the cache still works


def test_ring_wraps_and_counts_absolute_positions(attnlib_backend):
    p = Pair(attnlib_backend, 2, 8, ring=True)
    for step in range(3):
        p.update(2, 5, 5 * step)
    assert list(p.cache.lengths) == [15, 15]  # lengths exceed max_seq_len
    p.attend(1)
    p.attend(3, window=(4, 0))
    p.attend(1, new=1)
    p.attend(2, new=8)  # one update of exactly max_seq_len tokens


def test_ring_rollback_skips_overwritten_slots(attnlib_backend):
    p = Pair(attnlib_backend, 1, 8, ring=True)
    p.update(1, 8, 0)
    p.update(1, 7, 8)  # positions 0..14; slots hold 8..14 and 7
    p.update(1, 1, 10)  # rollback: length 11, positions 3..6 were overwritten by 11..14
    assert list(p.cache.lengths) == [11]
    kpos, _ = p.model.held(0)
    assert list(kpos) == [7, 8, 9, 10]
    p.attend(1)
    p.attend(3, causal=False)


def test_ring_limits(attnlib_backend):
    from attnlib.errors import ArgumentError, AttnlibError

    p = Pair(attnlib_backend, 1, 8, ring=True)
    p.update(1, 8, 0)
    p.update(1, 7, 8)  # length 15: held positions 7..14
    before = p.snapshot()
    k, v = p.kv(1, 9)
    with pytest.raises(AttnlibError) as info:  # one update writes at most max_seq_len
        p.cache.update(k, v, 15)
    assert isinstance(info.value, ValueError)
    k, v = p.kv(1, 2)
    with pytest.raises(ArgumentError, match="start_pos"):  # position 6 is no longer held
        p.cache.update(k, v, 6)
    assert p.snapshot() == before


def test_update_longer_than_cache_is_an_error(attnlib_backend):
    from attnlib.errors import CacheOverflowError

    p = Pair(attnlib_backend, 1, 8)
    k, v = p.kv(1, 9)
    with pytest.raises(CacheOverflowError):
        p.cache.update(k, v, 0)
    assert list(p.cache.lengths) == [0]


def test_batch_idx_maps_rows(attnlib_backend):
    p = Pair(attnlib_backend, 4, 24)
    p.update(4, 6, 0)
    p.update(4, 2, np.array([6, 6, 3, 6]))
    p.attend(2, batch_idx=np.array([3, 1]), new=2)
    p.attend(1, batch_idx=np.array([2]))
    p.attend(1, batch_idx=np.array([0, 2, 3]), new=1, start_pos=np.array([8, 5, 7]))


def test_options_over_cache(attnlib_backend):
    p = Pair(attnlib_backend, 2, 32, dv=23)
    p.update(2, 17, 0)
    slopes = np.array([[0.1, 0.2, 0.05, 0.3], [0.2, 0.01, 0.1, 0.15]], np.float32)
    p.attend(3, window=(5, 1), softcap=3.0, alibi_slopes=slopes, scale=0.7)
    p.attend(2, new=2, causal=False, alibi_slopes=slopes[0])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rope_on_q_and_new_k(attnlib_backend, interleaved, rotary_dim):
    rope = dict(theta=500.0, interleaved=interleaved, rotary_dim=rotary_dim)
    p = Pair(attnlib_backend, 2, 24)
    p.attend(5, new=5, rope=rope)  # prefill with RoPE at positions 0..4
    p.attend(1, new=1, rope=rope)
    p.attend(2, new=2, start_pos=np.array([3, 6]), rope=rope)


def test_reset(attnlib_backend):
    p = Pair(attnlib_backend, 3, 12)
    p.update(3, 6, 0)
    p.cache.reset(1)
    p.model.reset(1)
    p.check_lengths()
    p.cache.reset()
    p.model.reset()
    p.check_lengths()
    p.update(3, 3, 0)
    p.attend(1, new=1)


def test_wrong_dtype_is_a_dtype_error(attnlib_backend):
    import attnlib
    from attnlib.errors import DTypeError

    p = Pair(attnlib_backend, 1, 8)
    k, v = p.kv(1, 2)
    with pytest.raises(DTypeError, match="k"):
        p.cache.update(k.astype(np.float64), v, 0)
    with pytest.raises(DTypeError, match="v"):
        p.cache.update(k, v.astype(np.float16), 0)
    p.update(1, 2, 0)
    with pytest.raises(DTypeError, match="q"):
        attnlib.attention_with_kvcache(np.ones((1, 1, HQ, D), np.float16), p.cache,
                                       backend=attnlib_backend)
    p.check_lengths()


def test_query_longer_than_held_is_a_shape_error(attnlib_backend):
    import attnlib
    from attnlib.errors import ShapeError

    p = Pair(attnlib_backend, 2, 8)
    p.update(2, 3, 0)
    q = randn(p.rng, (2, 4, HQ, D))
    with pytest.raises(ShapeError):
        attnlib.attention_with_kvcache(q, p.cache, backend=attnlib_backend)


def test_start_pos_without_new_keys_is_an_argument_error(attnlib_backend):
    import attnlib
    from attnlib.errors import ArgumentError

    p = Pair(attnlib_backend, 1, 8)
    p.update(1, 3, 0)
    q = randn(p.rng, (1, 1, HQ, D))
    with pytest.raises(ArgumentError, match="start_pos"):
        attnlib.attention_with_kvcache(q, p.cache, start_pos=1, backend=attnlib_backend)


def test_kvcache_on_unsupported_dtype_says_so(attnlib_backend):
    """float64 caches either work or raise UnsupportedError at construction."""
    import attnlib

    cache = call_or_unsupported(
        attnlib_backend, np.float64,
        lambda: attnlib.KVCache(1, 4, 1, 4, dtype="float64", backend=attnlib_backend))
    if cache is not None:
        assert np.array_equal(np.asarray(cache.lengths), [0])


def test_a_refused_call_appends_nothing(attnlib_backend):
    """attention_with_kvcache validates q, k, v and every option before it writes anything."""
    import attnlib
    from attnlib.errors import AttnlibError

    p = Pair(attnlib_backend, 2, 12)
    p.update(2, 4, 0)
    before = p.snapshot()
    k, v = p.kv(2, 2)
    q = randn(p.rng, (2, 2, HQ, D))
    bad_calls = [
        lambda: attnlib.attention_with_kvcache(q.astype(np.float16), p.cache, k, v,
                                               backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(q[:, :, :3], p.cache, k, v,
                                               backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(q, p.cache, k, v, softcap=-1.0,
                                               backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(q, p.cache, k, v, window=(1,),
                                               backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(q, p.cache, k, v, scale=float("nan"),
                                               backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(q, p.cache, k, v, alibi_slopes=np.ones(
            3, np.float32), backend=attnlib_backend),
        lambda: attnlib.attention_with_kvcache(randn(p.rng, (2, 9, HQ, D)), p.cache, k, v,
                                               backend=attnlib_backend),  # Sq > length
    ]
    for call in bad_calls:
        with pytest.raises(AttnlibError):
            call()
        assert p.snapshot() == before
    p.attend(2, new=2)
