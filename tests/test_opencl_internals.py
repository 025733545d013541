"""What the shared conformance suite cannot see of the opencl backend: build errors, device arrays
in and out without host copies, a caller's queue, threads, forced tilings and key splits."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import attnlib
from attnlib.testing._helpers import check_dense, qkv, rng_for

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

from attnlib.backends.opencl import OpenCLBackend, _attention, _runtime  # noqa: E402

pytestmark = pytest.mark.skipif(
    not OpenCLBackend.is_available(), reason="no OpenCL device (pyopencl[pocl] provides one)"
)


@pytest.fixture(scope="module")
def be():
    return attnlib.get_backend("opencl")


def test_device_choice_skips_simulators(monkeypatch):
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    ctx = _runtime.choose_context()
    assert not _runtime.is_simulator(ctx.devices[0])
    assert OpenCLBackend.is_available() is True
    if not _runtime.has_gpu():
        assert OpenCLBackend.auto_priority() < attnlib.get_backend("numpy").auto_priority()


def test_kernel_build_error_names_options_and_log(be):
    opts = ("-DHEAD_DIM=8",)  # the other macros missing: the file's #error guard fires
    with pytest.raises(attnlib.KernelBuildError) as info:
        _runtime.build_program(be.context, "attn_fwd.cl", _runtime.kernel_source("attn_fwd.cl"),
                               opts)
    msg = str(info.value)
    assert "-DHEAD_DIM=8" in msg and "attn_fwd.cl" in msg
    assert "HEAD_DIM_V must be defined" in msg, "the build log is part of the message"
    bad = "__kernel void f(__global float *x) { x[0] = undefined_name; }"
    with pytest.raises(attnlib.KernelBuildError, match="undefined_name"):
        _runtime.build_program(be.context, "inline.cl", bad, ())


def test_config_options_are_sorted_defines():
    cfg = _attention.MergeConfig(IN_KIND=1, STORE_KIND=0, ACC_KIND=0, WG=64, G=2)
    assert cfg.options() == ("-DACC_KIND=0", "-DG=2", "-DIN_KIND=1", "-DSTORE_KIND=0", "-DWG=64")


def test_arrays_in_arrays_out_without_host_copies(be, monkeypatch):
    rng = rng_for("cl arrays")
    q, k, v = qkv(rng, 2, 19, 45, 4, 2, 24, 12)
    ref_out, ref_lse = attnlib.attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    dq, dk, dv = (attnlib.to_device(a, backend=be) for a in (q, k, v))

    def no_get(*a, **kw):
        raise AssertionError("a device -> host copy happened")

    uploads = []
    real_upload = _attention.upload
    monkeypatch.setattr(cla.Array, "get", no_get)
    monkeypatch.setattr(_attention, "upload", lambda ctx, x: uploads.append(x.size)
                        or real_upload(ctx, x))
    out, lse = attnlib.attention(dq, dk, dv, causal=True, return_lse=True, backend=be)
    monkeypatch.undo()
    assert isinstance(out, cla.Array) and isinstance(lse, cla.Array)
    assert out.queue is dq.queue
    assert all(n < q.size for n in uploads), "q, k or v went through the host"
    np.testing.assert_allclose(attnlib.to_numpy(out), ref_out, atol=2e-5)
    np.testing.assert_allclose(attnlib.to_numpy(lse), ref_lse, atol=2e-5)


def test_callers_queue_is_used(be):
    queue = cl.CommandQueue(be.context)
    mine = attnlib.get_backend("opencl", queue=queue)
    assert mine.queue is queue
    rng = rng_for("caller queue")
    x = rng.standard_normal((3, 7, 33)).astype(np.float32)
    dx = cla.to_device(queue, x)
    y = attnlib.softmax(dx, axis=1, backend=mine)
    assert isinstance(y, cla.Array) and y.queue is queue
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y.get(), e / e.sum(axis=1, keepdims=True), atol=1e-6)


def test_strided_device_arrays(be):
    rng = rng_for("strided arrays")
    q, k, v = qkv(rng, 1, 11, 23, 2, 2, 16)
    # (B, H, S, D) device arrays seen through transposed (B, S, H, D) views: strided, no copy
    dq, dk, dv = (attnlib.to_device(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), backend=be)
                  .transpose((0, 2, 1, 3)) for a in (q, k, v))
    assert not dq.flags.c_contiguous
    out = attnlib.attention(dq, dk, dv, causal=True, backend=be)
    ref = attnlib.attention(q, k, v, causal=True, backend="numpy")
    np.testing.assert_allclose(attnlib.to_numpy(out), ref, atol=2e-5)


@pytest.mark.parametrize("tiles,dtype", [((8, 8, 2, 4), "float32"), ((4, 16, 4, 4), "float16"),
                                         ((16, 8, 8, 2), "bfloat16"), ((8, 8, 2, 4), "float64"),
                                         ((64, 64, 8, 16), "float32"), ((32, 32, 8, 8), "float16"),
                                         ((4, 64, 1, 64), "bfloat16"),
                                         ((4, 128, 1, 128), "float16")])
def test_forced_tilings(tiles, dtype):
    """Every tiling (the GPU ones too), with the scalar (odd D) and the vector paths (D % 4 == 0,
    unit strides: vload4) of the kernel."""
    mine = attnlib.get_backend("opencl", tiles=tiles)
    rng = rng_for("tiles", tiles, dtype)
    q, k, v = qkv(rng, 2, 21, 37, 6, 2, 13, 11, dtype)
    check_dense(mine, q, k, v, causal=True, window=(9, None), softcap=3.0)
    check_dense(mine, q, k, v, mask=rng.standard_normal((1, 6, 21, 37)).astype(np.float32))
    q, k, v = qkv(rng, 1, 70, 75, 4, 2, 32, 48, dtype)
    check_dense(mine, q, k, v, causal=True)
    check_dense(mine, q, k[:, ::-1], v[:, ::-1], causal=True)  # negative strides


@pytest.mark.parametrize("splits,dtype", [(2, "float32"), (3, "float16"), (7, "float64"),
                                          (40, "float32")])
def test_split_kv_matches_reference(splits, dtype):
    mine = attnlib.get_backend("opencl", num_splits=splits)
    rng = rng_for("splits", splits, dtype)
    q, k, v = qkv(rng, 2, 1, 203, 8, 2, 64, 48, dtype)  # decode: one query row, GQA 4
    check_dense(mine, q, k, v, causal=True)
    q, k, v = qkv(rng, 1, 29, 150, 3, 3, 24, 24, dtype)
    check_dense(mine, q, k, v, causal=True, window=(40, 0))
    out1 = mine.to_numpy(attnlib.attention(q, k, v, backend=mine))
    out2 = mine.to_numpy(attnlib.attention(q, k, v, backend=mine))
    assert np.array_equal(out1, out2), "split-KV must stay deterministic"


@pytest.mark.parametrize("ring", [False, True])
def test_kvcache_decode_with_splits_and_device_arrays(ring):
    mine = attnlib.get_backend("opencl", num_splits=3)
    rng = rng_for("cache", ring)
    hkv, d, cap = 2, 32, 40
    caches = {name: attnlib.KVCache(2, cap, hkv, d, ring=ring, backend=name)
              for name in ("numpy", "opencl")}
    caches["opencl"] = attnlib.KVCache(2, cap, hkv, d, ring=ring, backend=mine)
    rope = attnlib.RoPE(theta=500.0)
    steps = [13, 1, 1, 20] + ([15, 1] if ring else [])
    for s_new in steps:
        q, k, v = qkv(rng, 2, s_new, s_new, 4, hkv, d)
        ref = attnlib.attention_with_kvcache(q, caches["numpy"], k, v, rope=rope,
                                             return_lse=True)
        dq, dk, dv = (attnlib.to_device(a, backend=mine) for a in (q, k, v))
        got = attnlib.attention_with_kvcache(dq, caches["opencl"], dk, dv, rope=rope,
                                             return_lse=True)
        assert isinstance(got[0], cla.Array)
        out, lse = (attnlib.to_numpy(g) for g in got)
        np.testing.assert_allclose(out, ref[0], atol=5e-5)
        np.testing.assert_allclose(lse, ref[1], atol=5e-5)
    assert np.array_equal(caches["numpy"].lengths, caches["opencl"].lengths)


@pytest.mark.parametrize("device_arrays", [False, True])
def test_threads_share_one_backend(device_arrays):
    """Eight threads on one backend (split-KV on, pooled outputs with device arrays) give the
    serial results bitwise."""
    mine = attnlib.get_backend("opencl", num_splits=3)
    rng = rng_for("threads")
    cases = [qkv(rng, 1, 1 + i % 3 * 5, 30 + 7 * i, 4, 2, 8 + 8 * (i % 3)) for i in range(6)]
    if device_arrays:
        cases = [tuple(mine.to_device(a) for a in c) for c in cases]

    def run(c):
        return mine.to_numpy(attnlib.attention(*c, causal=True, backend=mine))

    serial = [run(c) for c in cases]
    results: dict[int, list] = {}

    def worker(t: int) -> None:
        results[t] = [run(c) for _ in range(3) for c in cases]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in range(8):
        for got, want in zip(results[t], serial * 3):
            assert np.array_equal(got, want), "threaded calls must match serial ones bitwise"


def test_float64_refused_without_fp64(monkeypatch):
    mine = attnlib.get_backend("opencl", tiles=(8, 8, 2, 4))
    monkeypatch.setattr(mine, "facts", mine.facts.__class__(**{**vars(mine.facts),
                                                               "fp64": False}))
    assert "cl_khr_fp64" in mine.unsupported_dtype_reason(np.dtype(np.float64))
    assert mine.unsupported_dtype_reason(np.dtype(np.float32)) is None
    q = np.ones((1, 2, 1, 4))
    with pytest.raises(attnlib.UnsupportedError, match="cl_khr_fp64"):
        attnlib.attention(q, q, q, backend=mine)


def test_device_memory_errors_are_memoryerror(be):
    with pytest.raises(MemoryError, match="KV cache"):
        be.cache_alloc((1, 1 << 20, 1024, 1024), np.dtype(np.float32))  # 4 TiB


def test_head_dims_beyond_local_memory_are_unsupported(monkeypatch):
    mine = OpenCLBackend()
    monkeypatch.setattr(mine, "facts", mine.facts.__class__(**{**vars(mine.facts),
                                                               "local_budget": 2048}))
    q = np.ones((1, 20, 1, 64), np.float32)
    with pytest.raises(attnlib.UnsupportedError, match="__local memory"):
        attnlib.attention(q, q, q, backend=mine)


def test_bhsd_layout_with_device_arrays(be):
    q = rng_for("bhsd device").standard_normal((1, 2, 5, 8)).astype(np.float32)
    dq = attnlib.to_device(q, backend=be)
    out = attnlib.attention(dq, dq, dq, layout="bhsd", backend=be)
    ref = attnlib.attention(q, q, q, layout="bhsd", backend="numpy")
    np.testing.assert_allclose(attnlib.to_numpy(out), ref, atol=2e-5)


class _RecordingKernel:
    """Stands in for a cl.Kernel in a KernelSlot: records the (index, cl_mem handle) of each
    buffer a launch sets, holding no buffer alive."""

    def __init__(self):
        self.mems: list = []
        self.packs: list = []

    def _set_arg_multi(self, items):
        for i in range(0, len(items), 2):
            b = items[i + 1]
            self.mems.append((items[i], 0 if b is None else b.int_ptr))

    def _set_arg_buf_pack_multi(self, items):
        self.packs.append(items)


def test_kernel_slot_sets_a_new_buffer_with_a_reused_handle(be):
    """A released buffer's cl_mem value is handed to the next buffer made (Oclgrind does so every
    time): the slot must set the new buffer, not skip it as 'unchanged' (CI caught a kernel
    reading a fresh input through the stale argument). Pooled blocks it set stay retained, so
    a block handed out again is the same memory and is not set twice."""
    from attnlib.backends.opencl import _pool

    ctx = be.context
    knl = _RecordingKernel()
    slot = _runtime.KernelSlot(knl, [None, np.int32(0)])
    mf = cl.mem_flags
    for i in range(6):
        buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.full(5 + i, i, np.int8))
        before = len(knl.mems)
        slot.set([buf, np.int32(7)], range(2))
        assert knl.mems[before:] == [(0, buf.int_ptr)]
        del buf
    assert len(knl.packs) == 1  # the unchanged scalar was set once
    pool = _pool.pool_for(cl.CommandQueue(ctx))  # a fresh pool: its one block comes back
    block = pool.allocate(256)
    ptr = block.int_ptr
    slot.set([block, np.int32(7)], range(2))
    assert knl.mems[-1] == (0, ptr) and slot.held[0].int_ptr == ptr
    del block
    again = pool.allocate(256)
    n = len(knl.mems)
    slot.set([again, np.int32(7)], range(2))
    assert again.int_ptr == ptr  # the pool handed the same block out again
    assert len(knl.mems) == n  # and the slot knew it was the same memory
    slot.set([None, np.int32(7)], range(2))
    assert knl.mems[-1] == (0, 0) and slot.held[0] is None
