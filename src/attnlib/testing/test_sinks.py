"""contract §10, attention sinks: ``sinks=`` on every path against the float64 oracle (dense,
varlen, KV cache, paged cache and pool, cascade, streamed, merged, split-key decode), with the
other options, rows that see no key (out 0, lse = sink), large sinks of both signs; bad sinks
raise the contract's errors and leave caches unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, check_dense, qkv, randn, rng_for
from attnlib.testing.reference import reference_attention
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


def _assert_sink_rows(out, lse, rows, sinks):
    """Query rows ``rows`` (bshd out, lse (B, Hq, Sq)) saw no key: out 0, lse = each head's
    sink exactly."""
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[:, rows] == 0).all()
    want = np.broadcast_to(sinks.astype(lse.dtype)[None, :, None], lse[:, :, rows].shape)
    np.testing.assert_array_equal(lse[:, :, rows], want)


# The shapes below are those of the suite's tests without sinks (sinks are a run-time argument
# of the OpenCL kernels, so these calls reuse their builds).
@pytest.mark.parametrize("kind", SINK_KINDS)
def test_sinks_every_option(attnlib_backend, kind):
    """Causal, window, additive mask (two rows hidden), softcap, ALiBi, scale, GQA
    (test_every_option_together's shapes)."""
    b, h, sq, sk = 2, 4, 23, 41
    rng = rng_for("sinks-together", kind)
    q, k, v = qkv(rng, b, sq, sk, h, 2, 40, 24, scale=1.5)
    mask = np.where(rng.random((b, 1, sq, sk)) < 0.8, rng.standard_normal((b, 1, sq, sk)),
                    -np.inf).astype(np.float32)
    mask[:, :, [0, 5]] = -np.inf
    slopes = (rng.random((b, h)) * 0.3).astype(np.float32)
    sinks = sinks_for(rng, kind, h)
    out, lse = check_dense(attnlib_backend, q, k, v, causal=True, window=(9, 2), mask=mask,
                           softcap=4.0, alibi_slopes=slopes, scale=0.3, sinks=sinks)
    _assert_sink_rows(out, lse, [0, 5], sinks)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sinks_fully_masked_rows(attnlib_backend, kind):
    rng = rng_for("sinks-masked rows", kind)
    q, k, v = qkv(rng, 2, 9, 14, 2, 2, 16)
    keep = rng.random((2, 2, 9, 14)) < 0.7
    keep[:, :, [0, 4, 8]] = False
    mask = keep if kind == "bool" else np.where(keep, 0.25, -np.inf).astype(np.float32)
    sinks = sinks_for(rng, "mixed", 2)
    out, lse = check_dense(attnlib_backend, q, k, v, mask=mask, sinks=sinks)
    _assert_sink_rows(out, lse, [0, 4, 8], sinks)


@pytest.mark.parametrize("kind", ["large", "small"])
def test_sinks_window_leaves_rows_empty(attnlib_backend, kind):
    """Top-left causal with Sq > Sk and a window: rows 0..11 see no key."""
    rng = rng_for("sinks-window", kind)
    q, k, v = qkv(rng, 1, 31, 19, 2, 1, 24)
    sinks = sinks_for(rng, kind, 2)
    out, lse = check_dense(attnlib_backend, q, k, v, causal="top_left", window=(2, 0),
                           sinks=sinks)
    _assert_sink_rows(out, lse, list(range(12)), sinks)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sinks_dtypes_and_layouts(attnlib_backend, dtype):
    rng = rng_for("sinks-dtypes", dtype)
    q, k, v = qkv(rng, 2, 37, 53, 4, 2, 59, 47, dtype)
    layout = "bhsd" if dtype == "float32" else "bshd"
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    check_dense(attnlib_backend, q, k, v, layout=layout, causal=True,
                sinks=sinks_for(rng, "random"))


def test_sinks_no_keys_at_all(attnlib_backend):
    import attnlib

    rng = rng_for("sinks-nokeys")
    q, k, v = qkv(rng, 2, 5, 0, 2, 1, 8, 6)
    sinks = sinks_for(rng, "random", 2)
    out, lse = attnlib.attention(q, k, v, sinks=sinks, return_lse=True, backend=attnlib_backend)
    _assert_sink_rows(out, lse, list(range(5)), sinks)


@pytest.mark.parametrize("causal", [False, "top_left"])
def test_sinks_varlen(attnlib_backend, causal):
    """Sequences with no query, no key (its row: out 0, lse = sink) or neither
    (test_varlen's shapes)."""
    from attnlib.testing.test_varlen import SEQS, run_varlen

    sinks = sinks_for(rng_for("sinks-varlen", causal), "mixed")
    out, lse = run_varlen(attnlib_backend, SEQS[2], 4, 2, 24, 24, causal=causal, sinks=sinks)
    rows = [0, 1, 2]  # the sequence (3, 0)
    assert (out[rows] == 0).all()
    np.testing.assert_array_equal(lse[:, rows], np.repeat(sinks[:, None], 3, 1))


def test_sinks_kvcache_decode(attnlib_backend):
    """Prefill then decode steps (the repeat-call path), new sink values every step and steps
    without sinks in between: no step may take another's sinks (test_prefill_then_decode's
    shapes)."""
    p = Pair(attnlib_backend, 3, 40, dv=11)
    p.update(3, 7, 0)
    p.attend(7, sinks=sinks_for(p.rng, "random"))
    for kind in SINK_KINDS + ("none", "random"):
        p.attend(1, new=1, sinks=None if kind == "none" else sinks_for(p.rng, kind))
    p.attend(3, new=3, causal=False, sinks=sinks_for(p.rng, "mixed"))


def test_sinks_kvcache_options_and_ring(attnlib_backend):
    p = Pair(attnlib_backend, 2, 32, dv=23)
    p.update(2, 17, 0)
    slopes = np.array([[0.1, 0.2, 0.05, 0.3], [0.2, 0.01, 0.1, 0.15]], np.float32)
    p.attend(3, window=(5, 1), softcap=3.0, alibi_slopes=slopes, scale=0.7,
             sinks=sinks_for(p.rng, "random"))
    ring = Pair(attnlib_backend, 2, 8, ring=True)
    for step in range(3):
        ring.update(2, 5, 5 * step)
    ring.attend(3, window=(4, 0), sinks=sinks_for(ring.rng, "mixed"))
    ring.attend(1, new=1, sinks=sinks_for(ring.rng, "large"))


def test_sinks_paged(attnlib_backend):
    """Packed prefill, mixed decode and prefill, batched decode (test_paged's shapes)."""
    p = Paged(attnlib_backend, 24, 4, dv=11)
    a, b, c = p.new(3)
    p.attend([a, b], [7, 5], [7, 5], sinks=sinks_for(p.rng, "random"))
    p.attend([a, b, c], [1, 1, 6], [1, 1, 6], sinks=sinks_for(p.rng, "mixed"))
    p.attend([a, b, c], [1, 1, 1], [1, 1, 1], packed=False, sinks=sinks_for(p.rng, "large"),
             window=(3, 0), softcap=2.5)
    p.attend([b, c], [2, 2], [3, 3], packed=False, causal=False,
             sinks=sinks_for(p.rng, "small"))
    # paged_attention over the same pool, the query where the pool is
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    sids = [a, b, c]
    q = randn(p.rng, (3, 1, HQ, D))
    sinks = sinks_for(p.rng, "random")
    out, lse = attnlib.paged_attention(
        be.to_device(q) if be.owns(p.cache.k_pages) else q, p.cache.k_pages, p.cache.v_pages,
        p.cache.block_table(sids), p.cache.lengths(sids).astype(np.int32), sinks=sinks,
        return_lse=True, backend=attnlib_backend)
    out, lse = attnlib.to_numpy(out), attnlib.to_numpy(lse)
    for i, s in enumerate(sids):
        p.check_rows(s, q[i], out[i], lse[i], sinks=sinks)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sinks_cascade_counts_them_once(attnlib_backend, dtype):
    """Forks of shared prompts (the cascade merges each group's shared prefix with each fork's
    own keys): the sinks join that merge once, also for forks with no key of their own
    (test_forked_groups' shapes; float16 with the query on the device where the backend has
    device arrays)."""
    from attnlib.testing.test_paged_cascade import _both, _forest, _spying

    p = Paged(attnlib_backend, 48, 4, dv=11, dtype=dtype)
    f = _forest(p)
    sids = [f.a, f.c1, f.u, f.c2, f.b, f.d1, f.c3, f.e, f.e1]
    with _spying() as spy:
        groups = _both(p, spy, sids, [1, 1, 3, 2, 1, 1, 1, 1, 1],
                       sinks=sinks_for(p.rng, "mixed"), device=dtype == "float16")
    assert groups == {frozenset([f.a, f.c1, f.c2, f.c3]): 3, frozenset([f.b, f.d1]): 2,
                      frozenset([f.e, f.e1]): 2}, "the cascade must have run"


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_online_streamed(attnlib_backend, causal):
    """Chunks of every size, empty ones included; before any key the state is (0, sinks)
    (test_streaming_equals_one_shot's shapes)."""
    import attnlib

    rng = rng_for("sinks-stream", causal)
    q, k, v = qkv(rng, 2, 13, 50, 4, 2, 32, 24)
    sinks = sinks_for(rng, "random")
    kw = dict(causal=causal, softcap=6.0, scale=0.3)
    acc = attnlib.OnlineAttention(q, sinks=sinks, backend=attnlib_backend,
                                  total_keys=50 if causal else None, **kw)
    out0, lse0 = (attnlib.to_numpy(x) for x in acc.result(return_lse=True))
    _assert_sink_rows(out0, lse0, list(range(13)), sinks)
    chunks = [0, 1, 9, 9, 30, 50]
    for lo, hi in zip(chunks, chunks[1:]):
        acc.update(k[:, lo:hi], v[:, lo:hi])
    out, lse = (attnlib.to_numpy(x) for x in acc.result(return_lse=True))
    ref, ref_lse = reference_attention(q, k, v, sinks=sinks, **kw)
    check_attention(out, lse, ref, None, ref_lse)


def test_sinks_merge_with_the_sink_state(attnlib_backend):
    """The contract: states computed without sinks, merged with the state (0, sink), give attention
    with sinks (test_merge_equals_attention_over_concatenated_keys' shapes)."""
    import attnlib

    rng = rng_for("sinks-merge")
    q, k, v = qkv(rng, 2, 9, 40, 4, 2, 24, 20)
    sinks = sinks_for(rng, "mixed")
    parts = [attnlib.attention(q, k[:, a:b], v[:, a:b], return_lse=True,
                               backend=attnlib_backend) for a, b in ((0, 13), (13, 40))]
    sink_state = (np.zeros_like(parts[0][0]),
                  np.ascontiguousarray(np.broadcast_to(sinks[None, :, None], (2, 4, 9))))
    outs, lses = zip(*(parts + [sink_state]))
    out, lse = attnlib.merge_states(list(outs), list(lses), backend=attnlib_backend)
    ref, ref_lse = reference_attention(q, k, v, sinks=sinks)
    check_attention(out, lse, ref, None, ref_lse)


def test_sinks_split_key_decode(attnlib_backend):
    """One query row over many keys: split-KV decode, whose partial states hold no sink and
    whose merge folds it in once (numba splits 2 tasks over 2100 keys by itself; OpenCL is
    asked for 3 splits)."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    if be.name == "opencl":
        be = attnlib.get_backend("opencl", num_splits=3)
    rng = rng_for("sinks-split")
    q, k, v = qkv(rng, 1, 1, 2100, 8, 2, 64, 48)
    for kind in SINK_KINDS:
        sinks = sinks_for(rng, kind, 8)
        kw = {"causal": True} if kind == "random" else {"window": (1500, 0)}
        out, lse = attnlib.attention(q, k, v, sinks=sinks, return_lse=True, backend=be, **kw)
        ref, ref_lse = reference_attention(q, k, v, sinks=sinks, **kw)
        check_attention(out, lse, ref, None, ref_lse)


def test_sinks_device_arrays_repeat_calls(attnlib_backend):
    """Device arrays (on OpenCL the plan cache of repeat calls): one geometry with sinks,
    other sinks, none, and sinks again; each call against the oracle."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    rng = rng_for("sinks-device")
    q, k, v = qkv(rng, 2, 1, 40, 4, 2, 32)
    qd, kd, vd = (be.to_device(x) for x in (q, k, v))
    for kind in ("random", "none", "mixed", "large", "none", "random"):
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


def test_sinks_bad_raise_and_change_nothing(attnlib_backend):
    """Each bad ``sinks`` on every function: the contract's error, and a KV cache or page pool
    whose append was refused is unchanged (the first call and the repeat-call path)."""
    import attnlib
    from attnlib import errors

    be = attnlib.get_backend(attnlib_backend)
    rng = rng_for("sinks-bad")
    q, k, v = qkv(rng, 1, 2, 5, HQ, HKV, D)
    pair = Pair(attnlib_backend, 1, 40, dv=11, seed="sinks-bad-kv")
    pair.attend(3, new=3, sinks=sinks_for(rng, "random"))
    pair.attend(1, new=1, sinks=sinks_for(rng, "random"))
    p = Paged(attnlib_backend, 24, 4, dv=11, seed="sinks-bad-paged", scatter=False)
    (a,) = p.new(1)
    p.append([a], [3])
    lengths = p.cache.lengths([a]).tolist()
    qp = randn(rng, (1, 1, HQ, D))
    qp = be.to_device(qp) if be.owns(p.cache.k_pages) else qp  # where the pool is
    for bad, (sinks, name) in BAD_SINKS.items():
        err = getattr(errors, name)
        calls = {
            "attention": lambda s: attnlib.attention(q, k, v, sinks=s, backend=be),
            "attention_varlen": lambda s: attnlib.attention_varlen(
                q[0], k[0], v[0], np.array([0, 2], np.int32), np.array([0, 5], np.int32),
                sinks=s, backend=be),
            "OnlineAttention": lambda s: attnlib.OnlineAttention(q, sinks=s, backend=be),
            "paged_attention": lambda s: attnlib.paged_attention(
                qp, p.cache.k_pages, p.cache.v_pages, p.cache.block_table([a]),
                np.array(lengths, np.int32), sinks=s, backend=be),
        }
        for fn, call in calls.items():
            with pytest.raises(err):
                call(sinks)
                pytest.fail(f"{fn} took sinks {bad}")
        before = pair.snapshot()
        kn, vn = pair.kv(1, 1)
        with pytest.raises(err):
            attnlib.attention_with_kvcache(randn(rng, (1, 1, HQ, D)), pair.cache, kn, vn,
                                           sinks=sinks, backend=attnlib_backend)
        assert pair.snapshot() == before, bad
        kn, vn = p.kv(1, 1)
        with pytest.raises(err):
            attnlib.attention_with_paged_kvcache(randn(rng, (1, 1, HQ, D)), p.cache, [a], kn,
                                                 vn, sinks=sinks, backend=attnlib_backend)
        assert p.cache.lengths([a]).tolist() == lengths, bad
        p.check()
