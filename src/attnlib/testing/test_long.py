"""Decode-shaped calls over long key ranges: few query rows, thousands of keys. These are the
shapes for which tiled backends split the keys across workers (flash-decoding) and merge."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import check_dense, qkv, rng_for
from attnlib.testing.test_kvcache import Pair
from attnlib.testing.test_varlen import run_varlen

SK = 3001  # more than a few key tiles of any block size, and odd


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("b,hkv", [(1, 1), (2, 2)])
def test_long_decode(attnlib_backend, dtype, sq, b, hkv):
    rng = rng_for("long decode", dtype, sq, b, hkv)
    q, k, v = qkv(rng, b, sq, SK, 4, hkv, 64, dtype=dtype)
    check_dense(attnlib_backend, q, k, v, causal=True)


@pytest.mark.parametrize("opts", ["window", "mask", "softcap-alibi"])
def test_long_decode_options(attnlib_backend, opts):
    rng = rng_for("long decode opts", opts)
    q, k, v = qkv(rng, 1, 2, SK, 4, 1, 48)
    kw = {"causal": True}
    if opts == "window":
        kw["window"] = (1200, 0)
    elif opts == "mask":
        kw["mask"] = np.where(rng.random((1, 1, 2, SK)) < 0.5, 0.3, -np.inf).astype(np.float32)
    else:
        kw["softcap"] = 3.0
        kw["alibi_slopes"] = np.array([0.001, 0.002, 0.004, 0.008], np.float32)
    check_dense(attnlib_backend, q, k, v, **kw)


def test_long_varlen(attnlib_backend):
    run_varlen(attnlib_backend, [(1, 2500), (2, 1300), (1, 0), (3, 7)], 4, 1, 32, 32,
               causal=True)


def test_long_cache_decode(attnlib_backend):
    p = Pair(attnlib_backend, 1, 3100, hq=4, hkv=1, d=64, dv=64, seed="long cache")
    for start in range(0, 3000, 1000):
        p.update(1, 1000, start)
    for _ in range(2):
        p.attend(1, new=1)
    p.attend(3, new=3, window=(900, 0))


def test_long_ring_decode_across_the_wrap(attnlib_backend):
    """A ring of 1500 slots holding positions 1701..3200: the held keys straddle the wrap."""
    p = Pair(attnlib_backend, 1, 1500, ring=True, hq=4, hkv=1, d=64, dv=64, seed="long ring")
    for start in range(0, 3200, 800):
        p.update(1, 800, start)
    assert list(p.cache.lengths) == [3200]
    p.attend(1, new=1)
    p.attend(2, new=2)
    p.update(1, 1, 3000)  # a rollback on the wrapped ring
    p.attend(1)


@pytest.mark.slow
def test_no_sq_by_sk_host_memory(attnlib_backend):
    """contract §1, memory: no Sq x Sk allocation. Sq = Sk = 10007 would need 400 MB of float32
    scores (800 MB in float64); the host allocations numpy reports (tracemalloc) must stay under
    the numpy reference's 256 MiB chunk budget plus the inputs and outputs."""
    import tracemalloc

    import attnlib

    n = 10007
    rng = rng_for("memory")
    q, k, v = qkv(rng, 1, n, n, 1, 1, 8)
    attnlib.attention(q[:, :3], k[:, :3], v[:, :3], backend=attnlib_backend)  # warm-up/compile
    tracemalloc.start()
    try:
        out, lse = attnlib.attention(q, k, v, return_lse=True, backend=attnlib_backend)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 300 * 2**20, f"peak host allocation {peak / 2**20:.0f} MiB for Sq = Sk = {n}"
    rows = [0, 5003, n - 1]  # rows are independent without a mask: check three by the oracle
    from attnlib.testing.reference import naive_attention, reference_attention
    from attnlib.testing.tolerance import check_attention

    ref, ref_lse = reference_attention(q[:, rows], k, v)
    naive, naive_lse = naive_attention(q[:, rows], k, v)
    check_attention(out[:, rows], lse[:, :, rows], ref, naive, ref_lse, naive_lse)
