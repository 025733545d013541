"""The OpenCL conformance cases on small shapes, for a run under Oclgrind (run_oclgrind.py).

Every kernel and every code path runs at least once: partial and fully masked tiles, GQA, Dv != D,
an odd D, each storage dtype, bool / additive masks, ALiBi, softcap, windows, varlen, split-KV
with its merge, the ring KV cache with fused RoPE, the decode step's fused append (rope_append),
softmax / logsumexp, merge_states and rope. Each result is also checked against the float64
reference, so a wrong answer fails here too. Run directly it uses whatever device the opencl
backend picks (PoCL here). Under run_oclgrind.py every buffer is kept alive until the end
(keep_buffers_alive: Oclgrind's stale shadow memory, stale_shadow.py).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import attnlib
from attnlib.testing._helpers import check_dense, qkv, rng_for
from attnlib.testing.reference import (
    reference_logsumexp,
    reference_rope,
    reference_softmax,
    reference_varlen,
)

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def close(got, want, atol):
    got = np.asarray(attnlib.to_numpy(got), np.float64)
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@case
def dense_float32_gqa_causal_window(be):
    rng = rng_for("og dense")
    q, k, v = qkv(rng, 1, 9, 21, 4, 2, 13, 7)
    check_dense(be, q, k, v, causal=True)
    # top-left alignment with Sq > visible keys: whole rows and whole tiles masked out
    check_dense(be, q, k[:, :5], v[:, :5], causal="top_left", window=(1, 0))


@case
def device_tilings(be):
    # the tilings chosen for real devices (CPU prefill, GPU prefill, decode), not the simulator's
    rng = rng_for("og tilings")
    for tiles in ((16, 32, 4, 8), (32, 32, 8, 16), (4, 64, 4, 32)):
        decode = tiles[0] == 4
        # D = 12, Dv = 32: the 4-vector paths (vload4, V_VEC=4 where the tiling allows it)
        q, k, v = qkv(rng, 1, 3 if decode else 20, 70, 4, 2 if decode else 4, 12, 32)
        check_dense(attnlib.get_backend("opencl", tiles=tiles), q, k, v, causal=True)


@case
def masks_alibi_softcap(be):
    rng = rng_for("og masks")
    q, k, v = qkv(rng, 2, 5, 11, 2, 1, 8)
    k[:, 3] = np.nan  # hidden behind the masks below: must not leak
    bool_mask = rng.random((2, 1, 5, 11)) > 0.4
    bool_mask[..., 3] = False
    slopes = rng.random(2).astype(np.float32)
    check_dense(be, q, k, v, mask=bool_mask, alibi_slopes=slopes, softcap=2.5)
    add = rng.standard_normal((5, 11)).astype(np.float32)
    add[:, 3] = -np.inf
    add[1] = -np.inf  # a fully masked row
    check_dense(be, q, k, v, mask=add)


@case
def each_storage_dtype(be):
    for dtype in ("float16", "bfloat16", "float64"):
        rng = rng_for("og dtype", dtype)
        q, k, v = qkv(rng, 1, 6, 10, 2, 2, 9, 5, dtype)
        check_dense(be, q, k, v, causal=True)


@case
def split_kv_decode(be):
    split = attnlib.get_backend("opencl", num_splits=3)
    rng = rng_for("og split")
    q, k, v = qkv(rng, 2, 1, 37, 4, 1, 8)
    check_dense(split, q, k, v, causal=True)
    check_dense(split, q, k[:, :3], v[:, :3], causal=True)  # empty splits merged


@case
def cp_async_tile_walks(be):
    # the cp.async staging (NVIDIA only) built with plain copies in cp.async's place
    from attnlib.backends.opencl import _switches

    rng = rng_for("og cp.async")
    _switches.CP_ASYNC_FORCE = True  # a switch of every plan key: no plan to forget
    try:
        split = attnlib.get_backend("opencl", num_splits=3, tiles=(4, 16, 4, 4))
        q, k, v = qkv(rng, 2, 1, 37, 4, 1, 8)
        check_dense(split, q, k, v, causal=True)
        q, k, v = qkv(rng, 1, 7, 23, 2, 2, 12, 8, "float16")
        check_dense(be, q, k, v, causal=True)
    finally:
        _switches.CP_ASYNC_FORCE = None


@case
def varlen(be):
    rng = rng_for("og varlen")
    cu_q = np.array([0, 3, 3, 10], np.int32)
    cu_k = np.array([0, 5, 9, 20], np.int32)
    q, k, v = (x[0] for x in qkv(rng, 1, 10, 20, 2, 1, 8))
    out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                        backend=be)
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    close(out, ref, 1e-5)
    close(lse, ref_lse, 1e-5)


@case
def ring_cache_with_rope(be):
    rng = rng_for("og cache")
    caches = [attnlib.KVCache(2, 8, 1, 8, ring=True, backend=name) for name in ("numpy", be)]
    rope = attnlib.RoPE(theta=100.0, rotary_dim=6)
    for s_new in (5, 4, 1):
        q, k, v = qkv(rng, 2, s_new, s_new, 2, 1, 8)
        want = attnlib.attention_with_kvcache(q, caches[0], k, v, rope=rope, return_lse=True)
        got = attnlib.attention_with_kvcache(q, caches[1], k, v, rope=rope, return_lse=True)
        close(got[0], want[0], 1e-5)
        close(got[1], want[1], 1e-5)


@case
def decode_append_on_device(be):
    # repeat decode steps with device arrays take the fused append (rope_append in rope.cl):
    # with RoPE (interleaved, partial rotary_dim) on a float16 ring cache of two sequences that
    # wraps, and without RoPE on a float32 cache
    from attnlib.backends.opencl import _ops

    rng = rng_for("og append")
    real, fused = _ops.fused_append, []

    def counted(*args):
        res = real(*args)
        fused.append(res is not None)
        return res

    _ops.fused_append = counted
    try:
        for dtype, ring, rope, steps, tol in (
                ("float16", True, attnlib.RoPE(theta=100.0, interleaved=True, rotary_dim=6),
                 7, 3e-3),
                ("float32", False, None, 3, 1e-5)):
            caches = [attnlib.KVCache(2, 7, 1, 8, dtype=dtype, ring=ring, backend=name)
                      for name in ("numpy", be)]
            _, k, v = qkv(rng, 2, 0, 2, 4, 1, 8, dtype=dtype)
            caches[0].update(k, v, 0)
            caches[1].update(*(attnlib.to_device(x, backend=be) for x in (k, v)), 0)
            for _ in range(steps):
                q, k, v = qkv(rng, 2, 1, 1, 4, 1, 8, dtype=dtype)
                want = attnlib.attention_with_kvcache(q, caches[0], k, v, rope=rope)
                got = attnlib.attention_with_kvcache(
                    *(attnlib.to_device(x, backend=be) for x in (q,)), caches[1],
                    *(attnlib.to_device(x, backend=be) for x in (k, v)), rope=rope)
                close(got, want, tol)
    finally:
        _ops.fused_append = real
    # every step after each cache's first went through rope_append
    assert sum(fused) == 7 - 1 + 3 - 1, fused


@case
def paged_cache_and_unchecked_table(be):
    # a paged cache (packed prefill + decode, RoPE fused into the append, a fork whose next
    # append copies a shared partial page), then paged_attention over a device block table
    # holding garbage: every page index the kernel reads is clamped into the pool
    rng = rng_for("og paged")
    caches = [attnlib.PagedKVCache(6, 4, 1, 8, backend=name) for name in ("numpy", be)]
    rope = attnlib.RoPE(theta=100.0)
    sids = [[c.new_sequence() for _ in range(2)] for c in caches]
    for lens in ((6, 3), (1, 1)):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v = (x[0] for x in qkv(rng, 1, int(cu[-1]), int(cu[-1]), 2, 1, 8))
        want, got = (attnlib.attention_with_paged_kvcache(q, c, s, k, v, cu_seqlens_q=cu,
                                                          rope=rope)
                     for c, s in zip(caches, sids))
        close(got, want, 1e-5)
    _, k, v = qkv(rng, 1, 0, 1, 2, 1, 8)
    for c, s in zip(caches, sids):
        child = c.fork(s[0])
        c.append([child], k, v)
        s.append(child)
    q = qkv(rng, 3, 1, 0, 2, 1, 8)[0]
    want, got = (attnlib.attention_with_paged_kvcache(q, c, s) for c, s in zip(caches, sids))
    close(got, want, 1e-5)
    table = attnlib.to_device(np.array([[5, 1 << 30], [-7, -(1 << 31)]], np.int32), backend=be)
    q = attnlib.to_device(qkv(rng, 2, 1, 0, 2, 1, 8)[0], backend=be)
    out = attnlib.paged_attention(q, caches[1].k_pages, caches[1].v_pages, table,
                                  np.array([8, 5], np.int32), backend=be)
    assert np.isfinite(attnlib.to_numpy(out)).all()


@case
def softmax_and_logsumexp(be):
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        rng = rng_for("og softmax", dtype)
        x = rng.standard_normal((3, 21, 2)).astype(dtype)
        x[1, :, 0] = -np.inf  # an all -inf row
        tol = 1e-6 if dtype in ("float32", "float64") else 1e-2
        close(attnlib.softmax(x, axis=1, backend=be), reference_softmax(x, axis=1), tol)
        close(attnlib.logsumexp(x, axis=1, backend=be), reference_logsumexp(x, axis=1), tol)


@case
def merge_states(be):
    rng = rng_for("og merge")
    q, k, v = qkv(rng, 1, 4, 12, 2, 2, 8)
    parts = [attnlib.attention(q, k[:, a:b], v[:, a:b], return_lse=True, backend=be)
             for a, b in ((0, 5), (5, 5), (5, 12))]
    out, lse = attnlib.merge_states([p[0] for p in parts], [p[1] for p in parts], backend=be)
    want, want_lse = attnlib.attention(q, k, v, return_lse=True, backend="numpy")
    close(out, want, 1e-5)
    close(lse, want_lse, 1e-5)


@case
def rope_both_layouts(be):
    rng = rng_for("og rope")
    x = rng.standard_normal((2, 5, 2, 10)).astype(np.float32)
    pos = np.arange(10).reshape(2, 5) * 3
    for interleaved in (False, True):
        got = attnlib.rope(x, pos, theta=50.0, interleaved=interleaved, rotary_dim=8, backend=be)
        close(got, reference_rope(x, pos, theta=50.0, interleaved=interleaved, rotary_dim=8),
              1e-5)


_KEPT: list = []


def keep_buffers_alive() -> None:
    """Make every ``pyopencl.Buffer`` made from here on live until the process ends.

    Why: Oclgrind gives a released buffer's number to the next buffer made, but its
    uninitialised-value plugin keeps the old buffer's shadow state under that number (it has no
    handler for a release, and makes a shadow only for a number that has none). A buffer that
    takes the number of a smaller one keeps the smaller shadow: its bytes past that size read as
    uninitialised whatever wrote them, and every kernel reading them is reported (a float16 ring
    cache of 224 bytes given the number of a released 128-byte input: ~1000 reports in
    attn_fwd). stale_shadow.py shows it with pyopencl alone. Numbers that are never released are
    never reused. (A kernel reading a buffer through a stale argument then reads the old buffer's
    data, which the comparison with the reference catches.)"""
    import pyopencl as cl

    try:
        class KeptBuffer(cl.Buffer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                _KEPT.append(self)
    except TypeError as exc:  # a pyopencl whose Buffer cannot be subclassed
        print(f"keep_buffers_alive: not done ({exc}); stale shadow reports may follow")
        return
    cl.Buffer = KeptBuffer


def main() -> int:
    if os.environ.get("ATTNLIB_OCLGRIND_KEEP_BUFFERS") == "1":  # set by run_oclgrind.py
        keep_buffers_alive()
    be = attnlib.get_backend("opencl")
    print(f"device: {be.info()['device']}", flush=True)
    failed = 0
    wanted = set(sys.argv[1:])
    for fn in CASES:
        if wanted and fn.__name__ not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            fn(be)
            status = "ok"
        except Exception as exc:  # report every case, then fail at the end
            failed += 1
            status = f"FAILED: {type(exc).__name__}: {exc}"
        print(f"{fn.__name__:36s} {time.perf_counter() - t0:6.1f} s  {status}", flush=True)
    if os.environ.get("ATTNLIB_OCLGRIND_KEEP_BUFFERS") == "1":
        print(f"buffers kept alive: {len(_KEPT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
