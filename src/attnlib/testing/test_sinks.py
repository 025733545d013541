"""SPEC section 10, attention sinks: ``sinks=`` on every path against the float64 oracle (dense,
varlen, KV cache, paged cache and pool, cascade, streamed, merged, split-key decode), with the
other options, rows that see no key (out 0, lse = sink), large sinks of both signs; bad sinks
raise the contract's errors and leave caches unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, check_dense, qkv, randn, rng_for
from attnlib.testing.reference import reference_attention, reference_varlen
from attnlib.testing.test_kvcache import Pair
from attnlib.testing.test_paged import Paged
from attnlib.testing.tolerance import check_attention

HQ, HKV, D = 4, 2, 16
#: sink values per head: moderate, large positive (the sink dominates), large negative (it
#: vanishes), mixed
SINK_KINDS = ("random", "large", "small", "mixed")


def sinks_for(rng, kind, hq=HQ):
    if kind == "random":
        return randn(rng, (hq,), np.float32, scale=2.0)
    if kind == "large":
        return (30.0 + rng.random(hq)).astype(np.float32)
    if kind == "small":
        return (-30.0 - rng.random(hq)).astype(np.float32)
    return np.resize(np.array([25.0, -25.0, 0.5, -1.5], np.float32), hq)


def _empty_rows_mask(rng, b, sq, sk):
    """A bool mask (B, 1, Sq, Sk) with every row of query 0 and 3 hidden, the rest random."""
    keep = rng.random((b, 1, sq, sk)) < 0.6
    keep[:, :, [0, 3]] = False
    return keep


#: option sets of the dense tests: (name, options(rng, b, sq, sk)); every Sq > Sk case with
#: top-left causal or a window leaves rows that see no key
DENSE = {
    "plain": lambda rng, b, sq, sk: {},
    "causal_window": lambda rng, b, sq, sk: {"causal": True, "window": (3, 0)},
    "top_left_empty": lambda rng, b, sq, sk: {"causal": "top_left", "window": (2, 0)},
    "softcap_alibi": lambda rng, b, sq, sk: {
        "softcap": 1.5, "scale": 0.4, "causal": True,
        "alibi_slopes": np.linspace(0.05, 0.4, HQ).astype(np.float32)},
    "bool_mask": lambda rng, b, sq, sk: {"mask": _empty_rows_mask(rng, b, sq, sk)},
    "additive_mask": lambda rng, b, sq, sk: {"mask": np.where(
        _empty_rows_mask(rng, b, sq, sk), rng.standard_normal((b, 1, sq, sk)),
        -np.inf).astype(np.float32)},
}


@pytest.mark.parametrize("opts", list(DENSE))
@pytest.mark.parametrize("kind", SINK_KINDS)
def test_sinks_dense(attnlib_backend, opts, kind):
    rng = rng_for("sinks-dense", opts, kind)
    b, sq, sk = 2, 13, 9
    q, k, v = qkv(rng, b, sq, sk, HQ, HKV, D)
    sinks = sinks_for(rng, kind)
    res = check_dense(attnlib_backend, q, k, v, sinks=sinks, **DENSE[opts](rng, b, sq, sk))
    if opts in ("top_left_empty", "bool_mask"):  # rows that see nothing: out 0, lse = sink
        out, lse = res
        rows = [0] if opts == "top_left_empty" else [0, 3]
        assert (out[:, rows] == 0).all()
        np.testing.assert_array_equal(lse[:, :, rows],
                                      np.broadcast_to(sinks[None, :, None], lse[:, :, rows].shape))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "float32"])
def test_sinks_dense_dtypes_and_layout(attnlib_backend, dtype):
    rng = rng_for("sinks-dtypes", dtype)
    q, k, v = qkv(rng, 1, 7, 19, HQ, 1, D, 11, dtype)
    sinks = sinks_for(rng, "mixed")
    check_dense(attnlib_backend, q, k, v, sinks=sinks, causal=True)
    qb, kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    check_dense(attnlib_backend, qb, kb, vb, sinks=sinks, layout="bhsd", window=(4, 1))


def test_sinks_no_keys_at_all(attnlib_backend):
    import attnlib

    rng = rng_for("sinks-nokeys")
    q, k, v = qkv(rng, 2, 3, 0, HQ, HKV, D)
    sinks = sinks_for(rng, "random")
    out, lse = attnlib.attention(q, k, v, sinks=sinks, return_lse=True, backend=attnlib_backend)
    assert (out == 0).all()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))


def test_sinks_varlen(attnlib_backend):
    import attnlib

    rng = rng_for("sinks-varlen")
    cu_q = np.array([0, 5, 5, 6, 17], np.int32)
    cu_k = np.array([0, 9, 12, 12, 20], np.int32)  # sequence 2 has a query row and no key
    q = randn(rng, (17, HQ, D))
    k, v = randn(rng, (20, HKV, D)), randn(rng, (20, HKV, 7))
    sinks = sinks_for(rng, "random")
    for kw in ({}, {"causal": True, "window": (2, 0), "softcap": 3.0}):
        out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True,
                                            backend=attnlib_backend, **kw)
        ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, sinks=sinks, **kw)
        check_attention(out[None], lse[None], ref[None], None, ref_lse[None])
        assert (out[5] == 0).all() and np.array_equal(lse[:, 5], sinks)


def test_sinks_kvcache_decode(attnlib_backend):
    """Prefill then decode steps (the repeat-call path), new sink values every step, and a step
    without sinks in between: no step may reuse another's sinks."""
    p = Pair(attnlib_backend, 2, 40, seed="sinks-kv")
    rng = p.rng
    p.attend(6, new=6, sinks=sinks_for(rng, "random"))
    for step, kind in enumerate(SINK_KINDS + ("none", "random")):
        sinks = None if kind == "none" else sinks_for(rng, kind)
        p.attend(1, new=1, sinks=sinks, window=(4, 0) if step % 2 else None)
    p.attend(2, sinks=sinks_for(rng, "random"), softcap=2.0,
             alibi_slopes=np.linspace(0.1, 0.3, HQ).astype(np.float32))


def test_sinks_kvcache_ring(attnlib_backend):
    p = Pair(attnlib_backend, 1, 8, ring=True, seed="sinks-ring")
    p.attend(5, new=5, sinks=sinks_for(p.rng, "mixed"))
    for _ in range(6):
        p.attend(1, new=1, sinks=sinks_for(p.rng, "random"))


def test_sinks_paged(attnlib_backend):
    p = Paged(attnlib_backend, 24, 4, seed="sinks-paged")
    a, b, c = p.new(3)
    p.append([a, b, c], [7, 1, 10])
    sinks = sinks_for(p.rng, "random")
    p.attend([a, b, c], [3, 1, 2], [3, 1, 2], sinks=sinks)  # packed, with appends
    p.attend([a, b, c], [1, 1, 1], [1, 1, 1], packed=False, sinks=sinks_for(p.rng, "mixed"),
             window=(3, 0), softcap=2.5)
    p.attend([a, c], [1, 1], sinks=sinks_for(p.rng, "large"),
             alibi_slopes=np.linspace(0.1, 0.3, HQ).astype(np.float32))


def test_sinks_paged_attention_stateless(attnlib_backend):
    import attnlib

    p = Paged(attnlib_backend, 24, 4, seed="sinks-pool")
    a, b = p.new(2)
    p.append([a, b], [9, 6])
    sids = [a, b]
    table = p.cache.block_table(sids)
    lens = p.cache.lengths(sids).astype(np.int32)
    q = randn(p.rng, (2, 2, HQ, D))
    sinks = sinks_for(p.rng, "random")
    be = attnlib.get_backend(attnlib_backend)
    qx = be.to_device(q) if be.owns(p.cache.k_pages) else q  # q where the pool is
    out, lse = attnlib.paged_attention(qx, p.cache.k_pages, p.cache.v_pages, table, lens,
                                       sinks=sinks, window=(2, 0), return_lse=True,
                                       backend=attnlib_backend)
    for i, s in enumerate(sids):
        p.check_rows(s, q[i], attnlib.to_numpy(out)[i], attnlib.to_numpy(lse)[i], sinks=sinks,
                     window=(2, 0))


def test_sinks_cascade_counts_sinks_once(attnlib_backend):
    """Forks of one prompt (the cascade merges the shared prefix with each fork's own keys):
    the sinks join that merge once; a fork with no key of its own past the prefix included."""
    from attnlib.testing.test_paged_cascade import _both, _spying

    p = Paged(attnlib_backend, 48, 4, seed="sinks-cascade")
    a, u = p.new(2)
    p.append([a, u], [12, 5])
    c1, c2 = p.fork(a), p.fork(a)
    p.append([c1], [3])
    with _spying() as spy:
        groups = _both(p, spy, [a, c1, u, c2], [1, 2, 1, 1], sinks=sinks_for(p.rng, "mixed"))
    assert groups == {frozenset([a, c1, c2]): 3}, "the cascade must have run"


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_online_streamed(attnlib_backend, causal):
    import attnlib

    rng = rng_for("sinks-online", causal)
    q, k, v = qkv(rng, 2, 5, 23, HQ, HKV, D)
    sinks = sinks_for(rng, "random")
    acc = attnlib.OnlineAttention(q, sinks=sinks, causal=causal, backend=attnlib_backend,
                                  total_keys=23 if causal else None)
    out0, lse0 = acc.result(return_lse=True)  # before any key: (0, sink)
    assert (attnlib.to_numpy(out0) == 0).all()
    np.testing.assert_array_equal(attnlib.to_numpy(lse0),
                                  np.broadcast_to(sinks[None, :, None], (2, HQ, 5)))
    for lo, hi in ((0, 0), (0, 7), (7, 8), (8, 8), (8, 23)):
        acc.update(k[:, lo:hi], v[:, lo:hi])
    out, lse = (attnlib.to_numpy(x) for x in acc.result(return_lse=True))
    ref, ref_lse = reference_attention(q, k, v, sinks=sinks, causal=causal)
    check_attention(out, lse, ref, None, ref_lse)


def test_sinks_merge_with_the_sink_state(attnlib_backend):
    """SPEC: states computed without sinks, merged with the state (0, sink), give attention
    with sinks."""
    import attnlib

    rng = rng_for("sinks-merge")
    q, k, v = qkv(rng, 2, 3, 17, HQ, HKV, D)
    sinks = sinks_for(rng, "mixed")
    parts = [attnlib.attention(q, k[:, a:b], v[:, a:b], return_lse=True, causal=c,
                               backend=attnlib_backend)
             for a, b, c in ((0, 6, False), (6, 17, False))]
    sink_state = (np.zeros_like(parts[0][0]),
                  np.ascontiguousarray(np.broadcast_to(sinks[None, :, None], (2, HQ, 3))))
    outs, lses = zip(*(parts + [sink_state]))
    out, lse = attnlib.merge_states(list(outs), list(lses), backend=attnlib_backend)
    ref, ref_lse = reference_attention(q, k, v, sinks=sinks)
    check_attention(out, lse, ref, None, ref_lse)


def test_sinks_split_key_decode(attnlib_backend):
    """Long keys and one query row: the split-KV decode partial states hold no sink and their
    merge folds it in once (numba splits by itself; OpenCL is asked for 3 splits)."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    if be.name == "opencl":
        be = attnlib.get_backend("opencl", num_splits=3)
    rng = rng_for("sinks-split")
    q, k, v = qkv(rng, 1, 1, 700, HQ, HKV, D)
    for kind in SINK_KINDS:
        sinks = sinks_for(rng, kind)
        for kw in ({}, {"window": (650, 0), "causal": True}):
            out, lse = attnlib.attention(q, k, v, sinks=sinks, return_lse=True, backend=be, **kw)
            ref, ref_lse = reference_attention(q, k, v, sinks=sinks, **kw)
            check_attention(out, lse, ref, None, ref_lse)


def test_sinks_device_arrays_repeat_calls(attnlib_backend):
    """Device-array calls (the plan cache on OpenCL): the same geometry with sinks, different
    sinks and none; each call against the oracle."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    rng = rng_for("sinks-device")
    q, k, v = qkv(rng, 1, 1, 40, HQ, HKV, D)
    qd, kd, vd = (be.to_device(x) for x in (q, k, v))
    for kind in ("random", "none", "mixed", "random"):
        sinks = None if kind == "none" else sinks_for(rng, kind)
        out, lse = attnlib.attention(qd, kd, vd, sinks=sinks, return_lse=True, causal=True,
                                     backend=be)
        ref, ref_lse = reference_attention(q, k, v, sinks=sinks, causal=True)
        check_attention(attnlib.to_numpy(out), attnlib.to_numpy(lse), ref, None, ref_lse)


BAD_SINKS = {
    "2-D": (np.zeros((1, HQ), np.float32), "ShapeError"),
    "too few": (np.zeros(HQ - 1, np.float32), "ShapeError"),
    "float64": (np.zeros(HQ), "DTypeError"),
    "int32": (np.zeros(HQ, np.int32), "DTypeError"),
    "list": ([0.0] * HQ, "DTypeError"),
    "nan": (np.array([0, np.nan, 0, 0], np.float32), "ArgumentError"),
    "inf": (np.array([0, 0, -np.inf, 0], np.float32), "ArgumentError"),
}


@pytest.mark.parametrize("bad", list(BAD_SINKS))
def test_sinks_bad_raise_and_change_nothing(attnlib_backend, bad):
    import attnlib
    from attnlib import errors

    sinks, err = BAD_SINKS[bad]
    err = getattr(errors, err)
    rng = rng_for("sinks-bad", bad)
    q, k, v = qkv(rng, 1, 2, 5, HQ, HKV, D)
    with pytest.raises(err):
        attnlib.attention(q, k, v, sinks=sinks, backend=attnlib_backend)
    with pytest.raises(err):
        attnlib.attention_varlen(q[0], k[0], v[0], np.array([0, 2], np.int32),
                                 np.array([0, 5], np.int32), sinks=sinks,
                                 backend=attnlib_backend)
    with pytest.raises(err):
        attnlib.OnlineAttention(q, sinks=sinks, backend=attnlib_backend)
    # KV caches: the append of a refused call is not made (first and repeat-call paths)
    pair = Pair(attnlib_backend, 1, 16, seed="sinks-bad-kv")
    pair.attend(3, new=3, sinks=sinks_for(rng, "random"))
    pair.attend(1, new=1, sinks=sinks_for(rng, "random"))
    before = pair.snapshot()
    kn, vn = pair.kv(1, 1)
    with pytest.raises(err):
        attnlib.attention_with_kvcache(randn(rng, (1, 1, HQ, D)), pair.cache, kn, vn,
                                       sinks=sinks, backend=attnlib_backend)
    assert pair.snapshot() == before
    p = Paged(attnlib_backend, 8, 4, seed="sinks-bad-paged", scatter=False)
    (a,) = p.new(1)
    p.append([a], [3])
    lengths = p.cache.lengths([a]).tolist()
    kn, vn = p.kv(1, 1)
    with pytest.raises(err):
        attnlib.attention_with_paged_kvcache(randn(rng, (1, 1, HQ, D)), p.cache, [a], kn, vn,
                                             sinks=sinks, backend=attnlib_backend)
    assert p.cache.lengths([a]).tolist() == lengths
    p.check()
    be = attnlib.get_backend(attnlib_backend)
    q = randn(rng, (1, 1, HQ, D))
    with pytest.raises(err):
        attnlib.paged_attention(be.to_device(q) if be.owns(p.cache.k_pages) else q,
                                p.cache.k_pages, p.cache.v_pages,
                                p.cache.block_table([a]), np.array(lengths, np.int32),
                                sinks=sinks, backend=attnlib_backend)
