"""contract §10: quantized KV caches (``kv_dtype``) on KVCache and PagedKVCache.

Attention over a quantized cache is judged by the accuracy rule against the float64 reference
computed on the dequantized cache (``dequantized()``), and the quantization itself is bounded:
each stored value is within half a step of the format of the value written (the key after RoPE),
on the scale ``absmax / the format's largest value`` of its (token, kv head) row. Bad inputs
raise the contract's errors and leave the cache as it was.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, randn, rng_for
from attnlib.testing.reference import (
    CacheModel,
    naive_attention,
    reference_attention,
    reference_rope,
)
from attnlib.testing.tolerance import check_attention

KV_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
#: (largest value, relative half step of a normal value, half the smallest step) per format,
#: in units of the row's scale where a unit is named
FORMAT_BOUNDS = {
    "float8_e4m3fn": (448.0, 2.0 ** -4, 2.0 ** -10),
    "float8_e5m2": (57344.0, 2.0 ** -3, 2.0 ** -17),
    "int8": (127.0, 0.0, 0.5),
}
HQ, HKV, D, DV = 6, 2, 19, 11  # GQA groups of 3, odd head dims
ROPE = {"theta": 10000.0, "interleaved": False, "rotary_dim": 18}


def check_quantization(kv_dtype, written, deq, dtype):
    """Every dequantized row is within half a step of the format of the row written: ``|deq -
    x| <= rel * |x| + sub * scale`` with ``scale = absmax(x) / FMAX``, plus the rounding of
    the written row to the cache's dtype (RoPE is applied in that dtype before quantizing)."""
    fmax, rel, sub = FORMAT_BOUNDS[kv_dtype]
    x = np.asarray(written, np.float64)
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    eps = 2.0 * float(ml_dtypes.finfo(DTYPES[dtype] if isinstance(dtype, str) else dtype).eps)
    bound = rel * np.abs(x) + sub * absmax / fmax + eps * absmax + 1e-7 * absmax
    err = np.abs(deq - x)
    assert np.isfinite(deq).all(), "a dequantized value is not finite"
    assert (err <= bound).all(), f"quantization error {err.max():.3g} beyond its bound"


class QuantPair:
    """A quantized KVCache and a float64 model of it. After every write the model's slots are
    checked against the values written (the quantization bound) and then set to the cache's
    dequantized values, so the model attends over exactly what the cache holds."""

    def __init__(self, backend, kv_dtype, max_batch, max_seq, *, dtype="float32", ring=False):
        import attnlib

        self.backend, self.kv_dtype, self.dtype = backend, kv_dtype, DTYPES[dtype]
        self.rng = rng_for("quant", backend, kv_dtype, max_batch, max_seq, dtype, ring)
        self.cache = attnlib.KVCache(max_batch, max_seq, HKV, D, head_dim_v=DV,
                                     dtype=self.dtype, ring=ring, kv_dtype=kv_dtype,
                                     backend=backend)
        self.model = CacheModel(max_batch, max_seq, HKV, D, DV, ring, self.dtype)

    def kv(self, b, s):
        return (randn(self.rng, (b, s, HKV, D), self.dtype, 2.0),
                randn(self.rng, (b, s, HKV, DV), self.dtype))

    def _sync(self, rows):
        """Check the slots just written against the model, then take the cache's values."""
        kd, vd = self.cache.dequantized()
        for row in rows:
            _, slots = self.model.held(row)
            check_quantization(self.kv_dtype, self.model.k[row, slots], kd[row, slots],
                               self.dtype)
            check_quantization(self.kv_dtype, self.model.v[row, slots], vd[row, slots],
                               self.dtype)
        self.model.k[:], self.model.v[:] = kd, vd

    def update(self, b, s, start_pos):
        k, v = self.kv(b, s)
        self.cache.update(k, v, start_pos)
        self.model.update(np.arange(b), k, v, np.broadcast_to(start_pos, (b,)))
        self._sync(range(b))

    def attend(self, sq, *, new=0, rope=None, **kw):
        import attnlib

        b = len(self.model.lengths)
        q = randn(self.rng, (b, sq, HQ, D), self.dtype)
        k = v = None
        if new:
            k, v = self.kv(b, new)
        out, lse = attnlib.attention_with_kvcache(
            q, self.cache, k, v, rope=None if rope is None else attnlib.RoPE(**rope),
            return_lse=True, backend=self.backend, **kw)
        rows = np.arange(b)
        if new:
            self.model.update(rows, k, v, self.model.lengths.copy(), rope=rope)
            self._sync(rows)
        assert np.array_equal(self.cache.lengths, self.model.lengths)
        ref, ref_lse = self.model.attend(q, rows, rope=rope, **kw)
        naive, naive_lse = None, None
        if self.dtype != np.float64:
            naive, naive_lse = self.model.attend(q, rows, rope=rope, dtype=self.dtype, **kw)
        assert out.dtype == self.dtype and out.shape == (b, sq, HQ, DV)
        check_attention(out, lse, ref, naive, ref_lse, naive_lse)
        return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_cache_prefill_and_decode(attnlib_backend, kv_dtype):
    """Prefill, decode steps with and without the fused RoPE append, a rollback."""
    pair = QuantPair(attnlib_backend, kv_dtype, 2, 40)
    pair.update(2, 13, 0)
    pair.attend(5)
    pair.attend(1, new=1)
    pair.attend(1, new=1, rope=ROPE)
    pair.attend(3, new=3, rope=ROPE, window=(7, 0), softcap=20.0)
    pair.update(2, 4, 9)  # rollback: rewrites positions 9..12, the cache now holds 13
    pair.attend(2, new=2)
    kd, _ = pair.cache.dequantized(1)
    assert kd.shape == (1, 40, HKV, D)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_quantized_cache_dtypes(attnlib_backend, dtype):
    """q, out and the compute stay in the cache's dtype; K and V in fp8."""
    from attnlib.errors import UnsupportedError

    try:
        pair = QuantPair(attnlib_backend, "float8_e4m3fn", 2, 24, dtype=dtype)
    except UnsupportedError:
        import attnlib

        assert attnlib.get_backend(attnlib_backend).unsupported_dtype_reason(
            DTYPES[dtype]) is not None
        return
    pair.update(2, 9, 0)
    pair.attend(1, new=1, rope=ROPE)
    pair.attend(4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_ring(attnlib_backend, kv_dtype):
    """A ring keeps each token's scale in its slot: wrapped writes, decode, rollback."""
    pair = QuantPair(attnlib_backend, kv_dtype, 2, 8, ring=True)
    pair.update(2, 6, 0)
    pair.update(2, 5, 6)  # wraps: positions 3..10 held
    pair.attend(2)
    pair.attend(1, new=1, rope=ROPE)
    pair.update(2, 2, 10)
    pair.attend(3, new=2)


def test_quantized_zero_rows(attnlib_backend):
    """A row of zeros gets a scale that dequantizes to zeros: never NaN."""
    import attnlib

    rng = rng_for("zero rows", attnlib_backend)
    for kv_dtype in KV_DTYPES:
        cache = attnlib.KVCache(1, 8, HKV, D, kv_dtype=kv_dtype, backend=attnlib_backend)
        k = randn(rng, (1, 3, HKV, D))
        v = randn(rng, (1, 3, HKV, D))
        k[0, 1, 0] = 0.0
        v[0, 2, 1] = 0.0
        cache.update(k, v, 0)
        kd, vd = cache.dequantized()
        assert np.array_equal(kd[0, 1, 0], np.zeros(D)) and np.array_equal(vd[0, 2, 1],
                                                                           np.zeros(D))
        q = randn(rng, (1, 1, HQ, D))
        out = attnlib.attention_with_kvcache(q, cache)
        ref, _ = reference_attention(q, kd[:, :3], vd[:, :3], causal=True)
        naive, _ = naive_attention(q, kd[:, :3].astype(np.float32),
                                   vd[:, :3].astype(np.float32), causal=True)
        check_attention(out, None, ref, naive)


# ---- the paged cache ---------------------------------------------------------------------------
def _paged_reference(cache, sids, q, rope=None):
    """(ref, naive) of attention_with_paged_kvcache over the dequantized tokens of ``sids``
    (q (B, Sq, Hq, D) rotated at its positions when ``rope`` is given)."""
    kd, vd = cache.dequantized(sids)
    lens = cache.lengths(sids)
    refs, naives = [], []
    start = 0
    for b, n in enumerate(lens.tolist()):
        k, v = kd[None, start:start + n], vd[None, start:start + n]
        start += n
        qb = q[b:b + 1]
        if rope is not None:
            pos = n - qb.shape[1] + np.arange(qb.shape[1])
            qb = reference_rope(qb, pos[None], **rope).astype(q.dtype)
        refs.append(reference_attention(qb, k, v, causal=True)[0])
        naives.append(naive_attention(qb, k.astype(q.dtype), v.astype(q.dtype), causal=True)[0])
    return np.concatenate(refs), np.concatenate(naives)


def _written(cache, sids, k_by_sid):
    """Check each sequence's dequantized tokens against the tokens written to it."""
    kd, _ = cache.dequantized(sids)
    check_quantization(cache.kv_format.name, np.concatenate([k_by_sid[s] for s in sids]), kd,
                       cache.dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_paged(attnlib_backend, kv_dtype):
    """Appends over scattered pages, fork, copy-on-write, truncate; attention_with_paged_kvcache
    and paged_attention over the pools and their scales."""
    import attnlib

    rng = rng_for("quant paged", attnlib_backend, kv_dtype)
    ps = 4
    cache = attnlib.PagedKVCache(16, ps, HKV, D, kv_dtype=kv_dtype, backend=attnlib_backend)
    assert cache.k_scales.shape == (16, ps, HKV) and cache.k_pages.dtype == cache.kv_dtype
    # scatter the free pages: each to a one-token sequence, freed in random order
    tmp = [cache.new_sequence() for _ in range(16)]
    cache.append(tmp, randn(rng, (16, 1, HKV, D)), randn(rng, (16, 1, HKV, D)))
    for i in rng.permutation(16):
        cache.free(tmp[i])
    a, b = cache.new_sequence(), cache.new_sequence()
    toks = {a: randn(rng, (7, HKV, D), scale=3.0), b: randn(rng, (10, HKV, D))}
    vals = {s: randn(rng, (t.shape[0], HKV, D)) for s, t in toks.items()}
    cu = np.array([0, 7, 17], np.int32)
    cache.append([a, b], np.concatenate([toks[a], toks[b]]),
                 np.concatenate([vals[a], vals[b]]), cu_seqlens=cu)
    _written(cache, [a, b], toks)
    c = cache.fork(a)  # shares a's partial last page
    before = cache.dequantized([a])
    q = randn(rng, (3, 2, HQ, D))
    k_new, v_new = randn(rng, (3, 2, HKV, D)), randn(rng, (3, 2, HKV, D))
    out = attnlib.attention_with_paged_kvcache(q, cache, [a, b, c], k_new, v_new,
                                               rope=attnlib.RoPE(**ROPE))
    ref, naive = _paged_reference(cache, [a, b, c], q, rope=ROPE)
    check_attention(out, None, ref, naive)
    ka, _ = cache.dequantized([a])
    kc, _ = cache.dequantized([c])
    assert np.array_equal(ka[:7], before[0]) and np.array_equal(kc[:7], before[0])
    # the new tokens were rotated, then quantized
    for row, s in enumerate((a, b, c)):
        n = int(cache.lengths([s])[0])
        rot = reference_rope(k_new[row][None], np.arange(n - 2, n)[None], **ROPE)[0]
        check_quantization(kv_dtype, rot, cache.dequantized([s])[0][n - 2:], np.float32)
    # truncate into a page, append again: the rewritten slots carry the new tokens' scales
    cache.truncate(b, 5)
    k2 = randn(rng, (1, 4, HKV, D), scale=0.01)
    cache.append([b], k2, randn(rng, (1, 4, HKV, D)))
    check_quantization(kv_dtype, k2[0], cache.dequantized([b])[0][5:], np.float32)
    # the stateless form over the pools and scale pools gives the same as the cache's call
    sids = [a, b, c]
    q1 = randn(rng, (3, 1, HQ, D))
    table, lens = cache.block_table(sids), cache.lengths(sids).astype(np.int32)
    be = attnlib.get_backend(attnlib_backend)
    dev = be.to_device if be.owns(cache.k_pages) else (lambda x: x)  # q where the pool is
    out1 = attnlib.paged_attention(dev(q1), cache.k_pages, cache.v_pages, table, lens,
                                   k_scales=cache.k_scales, v_scales=cache.v_scales,
                                   backend=attnlib_backend)
    ref1, naive1 = _paged_reference(cache, sids, q1)
    check_attention(out1, None, ref1, naive1)
    out2 = attnlib.attention_with_paged_kvcache(q1, cache, sids)
    check_attention(out2, None, ref1, naive1)
    if not be.owns(cache.k_pages):  # host pools of the vLLM layout, C order
        pools = (np.ascontiguousarray(x) for x in (cache.k_pages, cache.v_pages,
                                                    cache.k_scales, cache.v_scales))
        kp, vp, ks, vs = pools
        out3 = attnlib.paged_attention(q1, kp, vp, table, lens, k_scales=ks, v_scales=vs,
                                       backend=attnlib_backend)
        check_attention(out3, None, ref1, naive1)


# ---- bad input -----------------------------------------------------------------------------------
def _snapshot(cache, sids=None):
    kd, vd = cache.dequantized() if sids is None else cache.dequantized(sids)
    lens = cache.lengths if sids is None else cache.lengths(sids)
    return np.array(lens), kd, vd


def _same(a, b):
    return all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def test_quantized_bad_inputs(attnlib_backend):
    """Unsupported kv_dtypes, wrong k / v dtypes, scale pools of the wrong shape or dtype,
    pools without their scales: the contract's errors, and every cache unchanged."""
    import attnlib
    from attnlib.errors import ArgumentError, CacheOverflowError, DTypeError, ShapeError

    be = attnlib_backend
    for bad in ("float8_e4m3fnuz", "uint8", "int16", "float16", 3, "fp8"):
        with pytest.raises(DTypeError):
            attnlib.KVCache(1, 4, HKV, D, kv_dtype=bad, backend=be)
        with pytest.raises(DTypeError):
            attnlib.PagedKVCache(2, 4, HKV, D, kv_dtype=bad, backend=be)
    assert attnlib.KVCache(1, 4, HKV, D, kv_dtype="float32", backend=be).k_scales is None
    rng = rng_for("quant bad", be)
    cache = attnlib.KVCache(2, 6, HKV, D, kv_dtype="int8", backend=be)
    cache.update(randn(rng, (2, 4, HKV, D)), randn(rng, (2, 4, HKV, D)), 0)
    snap = _snapshot(cache)
    q = randn(rng, (2, 1, HQ, D))
    k8 = randn(rng, (2, 1, HKV, D)).astype(np.int8)
    with pytest.raises(DTypeError):  # new tokens come in the cache's dtype, never pre-quantized
        cache.update(k8, k8, 4)
    with pytest.raises(DTypeError):
        attnlib.attention_with_kvcache(q, cache, k8, k8)
    with pytest.raises(CacheOverflowError):
        attnlib.attention_with_kvcache(q, cache, *(randn(rng, (2, 3, HKV, D)),) * 2)
    assert _same(_snapshot(cache), snap)

    pc = attnlib.PagedKVCache(4, 2, HKV, D, kv_dtype="float8_e5m2", backend=be)
    s = pc.new_sequence()
    pc.append([s], randn(rng, (1, 3, HKV, D)), randn(rng, (1, 3, HKV, D)))
    snap = _snapshot(pc, [s])
    with pytest.raises(CacheOverflowError):
        pc.append([s], randn(rng, (1, 6, HKV, D)), randn(rng, (1, 6, HKV, D)))
    assert _same(_snapshot(pc, [s]), snap)
    dev = attnlib.get_backend(be).to_device if attnlib.get_backend(be).owns(pc.k_pages) else \
        (lambda x: x)
    q1 = dev(randn(rng, (1, 1, HQ, D)))
    table, lens = pc.block_table([s]), pc.lengths([s]).astype(np.int32)
    kp, vp, ks, vs = pc.k_pages, pc.v_pages, pc.k_scales, pc.v_scales
    with pytest.raises(DTypeError):  # quantized pools need their scales
        attnlib.paged_attention(q1, kp, vp, table, lens, backend=be)
    with pytest.raises(ArgumentError):
        attnlib.paged_attention(q1, kp, vp, table, lens, k_scales=ks, backend=be)
    if isinstance(kp, np.ndarray):  # host scale pools of the wrong shape / dtype
        with pytest.raises(ShapeError):
            attnlib.paged_attention(q1, kp, vp, table, lens, k_scales=ks[:, :1], v_scales=vs,
                                    backend=be)
        with pytest.raises(DTypeError):
            attnlib.paged_attention(q1, kp, vp, table, lens, k_scales=ks.astype(np.float16),
                                    v_scales=vs, backend=be)
        fk = randn(rng, (4, 2, HKV, D))
        with pytest.raises(DTypeError):  # scales beside float pools
            attnlib.paged_attention(q1, fk, fk, table, lens, k_scales=ks, v_scales=vs,
                                    backend=be)
    assert _same(_snapshot(pc, [s]), snap)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_code(attnlib_backend, kv_dtype):
    """Every finite value of the format written at scale 1 (the row's absmax is the format's
    largest value) is stored as its own code, the midpoints between neighbours round to even as
    ml_dtypes / np.rint do, and attention over one key returns that key's values exactly: the
    encoding and the kernel's decoding of every code."""
    import attnlib
    from attnlib import _quant

    fmt = _quant.FORMATS[kv_dtype]
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    vals = np.unique(codes.astype(np.float64))
    vals = vals[np.isfinite(vals) & (np.abs(vals) <= fmt.fmax)]  # int8's -128 is never written
    mids = np.append((vals[1:] + vals[:-1]) / 2, fmt.fmax)
    d = vals.size
    be = attnlib.get_backend(attnlib_backend)
    for row, want in ((vals, vals.astype(fmt.dtype)), (mids, _round_codes(mids, fmt))):
        cache = attnlib.KVCache(1, 1, 1, d, kv_dtype=kv_dtype, backend=attnlib_backend)
        x = row.astype(np.float32)[None, None, None, :]
        q = np.ones((1, 1, 1, d), np.float32)
        out = attnlib.attention_with_kvcache(q, cache, x, x)
        stored = be.cache_read(cache.k).view(np.uint8).reshape(-1)
        assert np.array_equal(stored, want.view(np.uint8)), "a value stored as another code"
        assert np.array_equal(be.cache_read(cache.k_scales).reshape(-1), [1.0])
        assert np.array_equal(np.asarray(out).reshape(-1),
                              want.astype(np.float32)), "a code read as another value"


def _round_codes(x, fmt):
    """``x`` (float64, representable in float32) to the format, ties to even."""
    if fmt.dtype == np.int8:
        return np.rint(x).astype(np.int8)
    return x.astype(np.float32).astype(fmt.dtype)
