"""The repeat-call (decode) host path of the OpenCL backend: KVCache repeat entries
(kv_cache._FastEntry), the plan cache (backends/opencl/_dispatch), in-place device tables and
kernel arguments set only when they changed (_runtime.KernelSlot).

A cached plan must never serve a call whose geometry, strides, dtypes, options, lengths or
buffers differ: every test warms a key, changes one thing and checks the answer against the
numpy backend (float64 accumulation) on a twin cache given the same writes; each step's answer
must also differ from the previous step's by more than the tolerance, so a stale answer fails.
The tensor-core decode path runs on PoCL through its emulated kernel under a patched compute
capability."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import attnlib
from attnlib.testing._helpers import randn, rng_for

cl = pytest.importorskip("pyopencl")
if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI always has PoCL
    pytest.skip("no OpenCL device", allow_module_level=True)

TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


class Twin:
    """An OpenCL KVCache and a numpy KVCache given the same writes."""

    def __init__(self, be, b, cap, hkv, d, dtype, ring=False):
        self.be, self.dtype = be, dtype
        self.dev = attnlib.KVCache(b, cap, hkv, d, dtype=dtype, ring=ring, backend=be)
        self.ref = attnlib.KVCache(b, cap, hkv, d, dtype=dtype, ring=ring, backend="numpy")
        self.last = None

    def update(self, k, v, start):
        dk, dv = (attnlib.to_device(x, backend=self.be) for x in (k, v))
        self.dev.update(dk, dv, start)
        self.ref.update(k, v, start)

    def step(self, q, k=None, v=None, *, q_dev=None, fresh=True, **kw):
        """One attention_with_kvcache on both; checks the OpenCL answer against numpy's."""
        dq = attnlib.to_device(q, backend=self.be) if q_dev is None else q_dev
        dk = None if k is None else attnlib.to_device(k, backend=self.be)
        dv = None if v is None else attnlib.to_device(v, backend=self.be)
        got = attnlib.attention_with_kvcache(dq, self.dev, dk, dv, **kw)
        self.ref._fast.clear()  # the oracle takes the full path every time (no repeat entry)
        want = attnlib.attention_with_kvcache(q, self.ref, k, v, **kw)
        if kw.get("return_lse"):
            np.testing.assert_allclose(attnlib.to_numpy(got[1]), want[1], atol=1e-4)
            got, want = got[0], want[0]
        got = attnlib.to_numpy(got).astype(np.float64)
        tol = TOL[self.dtype]
        np.testing.assert_allclose(got, want.astype(np.float64), atol=tol, rtol=0)
        assert np.array_equal(self.dev.lengths, self.ref.lengths)
        if fresh and self.last is not None and self.last.shape == got.shape:
            assert np.abs(got - self.last).max() > 4 * tol, "the step did not change the answer"
        self.last = got
        return got


def _qkv_step(rng, b, sq, hq, hkv, d, dtype, n_new=1):
    return (randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, n_new, hkv, d), dtype),
            randn(rng, (b, n_new, hkv, d), dtype))


def _count_queue_work(monkeypatch):
    """A tally of kernel enqueues, table fills and host writes, counted from now on."""
    from attnlib.backends.opencl import _pool, _runtime

    tally = {"enqueue": 0, "fill": 0, "write": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            tally[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(_runtime, "_enqueue", count("enqueue", _runtime._enqueue))
    monkeypatch.setattr(_pool, "_fill", count("fill", _pool._fill_function()))
    monkeypatch.setattr(cl, "enqueue_copy", count("write", cl.enqueue_copy))
    return tally


@pytest.fixture
def be():
    return attnlib.get_backend("opencl")


def _fill(twin, rng, b, n, hkv, d, dtype):
    k, v = randn(rng, (b, n, hkv, d), dtype), randn(rng, (b, n, hkv, d), dtype)
    twin.update(k, v, 0)


def _counting_setup(be, seed):
    """The counting tests' cache (float32, 9 of 40 rows filled; no plan or table of another
    test's geometry left over, which could already hold this test's table bytes and save a
    rewrite) and one decode step's q, k, v on the device."""
    attnlib.forget_plans()
    rng = rng_for(seed)
    b, cap, hq, hkv, d = 1, 40, 4, 2, 16
    t = Twin(be, b, cap, hkv, d, "float32")
    _fill(t, rng, b, 9, hkv, d, "float32")
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, "float32")
    return t, *(attnlib.to_device(x, backend=be) for x in (q, k, v))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_steps_follow_every_change(be, dtype):
    rng = rng_for("host path steps", dtype)
    b, cap, hq, hkv, d = 1, 53, 6, 2, 24
    t = Twin(be, b, cap, hkv, d, dtype)
    _fill(t, rng, b, 17, hkv, d, dtype)
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
    t.step(q)
    t.step(q, fresh=False)  # the repeat entry and the cached plan serve this one
    q0, dq = q, attnlib.to_device(q, backend=be)
    for _ in range(4):  # appends: the lengths change every step
        q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
        t.step(q, k, v)
    t.step(rng.standard_normal(q.shape).astype(dtype))  # new q values, same lengths
    t.step(q0, q_dev=dq)  # the first q's buffer again
    for kw in ({"scale": 0.3}, {"softcap": 2.0}, {"window": (3, 0)}, {"causal": False},
               {"scale": 0.7, "return_lse": True}):
        t.step(q, **kw)
        t.step(q, fresh=False, **kw)
    q3, k3, v3 = _qkv_step(rng, b, 3, hq, hkv, d, dtype, n_new=3)
    t.step(q3, k3, v3)  # three query rows, three new tokens
    t.step(q3, fresh=False)
    t.dev.update(attnlib.to_device(k3, backend=be), attnlib.to_device(v3, backend=be), 5)
    t.ref.update(k3, v3, 5)  # rollback: the length goes down
    t.step(q3)


def test_strides_and_other_caches(be):
    rng = rng_for("host path strides")
    b, cap, hq, hkv, d = 2, 31, 4, 2, 12
    a = Twin(be, b, cap, hkv, d, "float32")
    _fill(a, rng, b, 11, hkv, d, "float32")
    q = randn(rng, (b, 3, hq, d))
    a.step(q)
    # the same q values as a strided device view (bhsd storage transposed to bshd)
    qt = attnlib.to_device(np.ascontiguousarray(q.transpose(0, 2, 1, 3)), backend=be)
    a.step(q, q_dev=qt.transpose((0, 2, 1, 3)), fresh=False)
    # and at an offset (rows 1..3 of a 4-row array)
    wide = randn(rng, (b, 4, hq, d))
    a.step(wide[:, 1:], q_dev=attnlib.to_device(wide, backend=be)[:, 1:])
    a.step(q)
    # a second cache of the same geometry: other k / v buffers, other lengths
    c = Twin(be, b, cap, hkv, d, "float32")
    _fill(c, rng, b, 9, hkv, d, "float32")
    c.last = a.last
    c.step(q)
    a.last = c.last
    a.step(q)
    # different lengths per row (batch_idx: the full path) then the repeat path again
    k, v = randn(rng, (1, 4, hkv, d)), randn(rng, (1, 4, hkv, d))
    a.dev.update(attnlib.to_device(k, backend=be), attnlib.to_device(v, backend=be), 11,
                 batch_idx=[1])
    a.ref.update(k, v, 11, batch_idx=[1])
    a.step(q)


def test_ring_wraps(be):
    rng = rng_for("host path ring")
    b, cap, hq, hkv, d = 1, 13, 4, 1, 8
    t = Twin(be, b, cap, hkv, d, "float32", ring=True)
    _fill(t, rng, b, 10, hkv, d, "float32")
    for _ in range(7):  # wraps: the first held position and the first row move
        q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, "float32")
        t.step(q, k, v)
    assert int(t.dev.held_from[0]) > 0


def test_errors_after_warm_calls(be):
    rng = rng_for("host path errors")
    b, cap, hq, hkv, d = 1, 6, 2, 1, 8
    t = Twin(be, b, cap, hkv, d, "float32")
    _fill(t, rng, b, 4, hkv, d, "float32")
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, "float32")
    t.step(q, k, v, scale=1)
    t.step(q, k, v, scale=1)  # length 6 = max_seq_len
    dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))
    with pytest.raises(attnlib.CacheOverflowError):
        attnlib.attention_with_kvcache(dq, t.dev, dk, dv, scale=1)
    assert int(t.dev.lengths[0]) == 6
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention_with_kvcache(dq, t.dev, scale=True)
    attnlib.attention_with_kvcache(dq, t.dev, causal=True)
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention_with_kvcache(dq, t.dev, causal=1)
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention_with_kvcache(dq, t.dev, return_lse=1)
    attnlib.attention_with_kvcache(dq, t.dev, window=(2, 0))
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention_with_kvcache(dq, t.dev, window=(True, 0))
    with pytest.raises(attnlib.DTypeError):
        attnlib.attention_with_kvcache(attnlib.to_device(q.astype(np.float16), backend=be),
                                       t.dev)
    t.dev.reset()
    with pytest.raises(attnlib.ShapeError):  # q has 1 row, the cache holds none
        attnlib.attention_with_kvcache(dq, t.dev)


def test_backend_call_with_values_changed_in_place(be):
    """The cached plan compares the per-sequence values, not the arrays' identities."""
    from attnlib.testing.reference import reference_call, seq_call

    rng = rng_for("host path in place")
    q, k, v = (randn(rng, s) for s in ((2, 1, 4, 16), (2, 40, 2, 16), (2, 40, 2, 16)))
    ar = np.arange(2)
    kl = np.array([30, 12])
    call = seq_call(*(attnlib.to_device(x, backend=be) for x in (q, k, v)), q_batch=ar,
                    q_row0=0 * ar, q_len=ar * 0 + 1, k_batch=ar, k_row0=0 * ar, k_len=kl,
                    q_pos0=kl - 1, k_pos0=0 * ar, causal=True)
    host = seq_call(q, k, v, q_batch=ar, q_row0=0 * ar, q_len=ar * 0 + 1, k_batch=ar,
                    k_row0=0 * ar, k_len=kl, q_pos0=kl - 1, k_pos0=0 * ar, causal=True)
    prev = None
    for n in (30, 30, 22, 39):
        for c in (call, host):
            c.k_len[0] = n
            c.q_pos0[0] = n - 1
        out, lse = be.attention(call)
        ref, ref_lse = reference_call(host)
        got = attnlib.to_numpy(out)
        np.testing.assert_allclose(got, ref, atol=2e-5)
        np.testing.assert_allclose(attnlib.to_numpy(lse), ref_lse, atol=2e-5)
        if prev is not None and prev[0] != n:
            assert np.abs(got - prev[1]).max() > 1e-4
        prev = (n, got)


@pytest.mark.parametrize("rope", [None, attnlib.RoPE(theta=100.0)])
def test_threads_share_plans(be, rope):
    """Caches of one geometry share plans and device tables (and, with RoPE, the fused
    append's plan and position table); threads appending to their own caches at once must each
    get their own answer."""
    rng = rng_for("host path threads", rope is None)
    b, cap, hq, hkv, d = 1, 40, 4, 2, 16
    twins = [Twin(be, b, cap, hkv, d, "float32") for _ in range(4)]
    for i, t in enumerate(twins):
        _fill(t, rng, b, 5 + 3 * i, hkv, d, "float32")
    steps = [[_qkv_step(rng, b, 1, hq, hkv, d, "float32") for _ in range(6)] for _ in twins]
    errors = []

    def work(i):
        try:
            for q, k, v in steps[i]:
                twins[i].step(q, k, v, fresh=False, rope=rope)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(twins))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def _native_tensor_cores() -> bool:
    from attnlib.backends.opencl import _nvidia_mma

    cc = _nvidia_mma.compute_capability(attnlib.get_backend("opencl").device)
    return cc is not None and cc[0] >= 8


@pytest.mark.skipif(not _native_tensor_cores(),
                    reason="needs an NVIDIA sm_80+ device (the emulated tests run everywhere)")
@pytest.mark.parametrize("hq,hkv,d,dtype", [(32, 8, 128, "float16"), (8, 2, 64, "bfloat16")])
def test_native_tensor_core_decode_steps(kernel_launches, hq, hkv, d, dtype):
    """The same steps on the device's own PTX kernels (the H200)."""
    for opts in ({}, {"num_splits": 3}):
        _decode_steps(attnlib.get_backend("opencl", **opts), kernel_launches, hq, hkv, d, dtype)


@pytest.mark.parametrize("hq,hkv,d,dtype", [(8, 2, 64, "float16"), (4, 4, 128, "bfloat16")])
def test_emulated_tensor_core_decode_steps(emulated_nvidia, kernel_launches, hq, hkv, d,
                                           dtype):
    _decode_steps(attnlib.get_backend("opencl", num_splits=3), kernel_launches, hq, hkv, d,
                  dtype)


def _decode_steps(be, launches, hq, hkv, d, dtype):
    rng = rng_for("host path decode", d, dtype)
    b, cap = 1, 70
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    t = Twin(be, b, cap, hkv, d, dtype)
    _fill(t, rng, b, 20, hkv, d, dtype)
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
    t.step(q, k, v)
    assert "attn_decode_mma" in launches, "the tensor-core decode kernel did not run"
    for _ in range(3):
        q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
        t.step(q, k, v)
    t.step(q, softcap=3.0)
    t.step(q, window=(4, 0), return_lse=True)
    rope = attnlib.RoPE()
    for _ in range(3):  # appends with RoPE: the fused append, then this kernel
        q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
        t.step(q, k, v, rope=rope)


def test_repeat_calls_touch_the_queue_once(be, monkeypatch):
    """A repeated decode step: one kernel enqueue and no table rewrite; after an append: the
    fused append's table and the attention's are rewritten (two rewrites in all) and two
    kernels are enqueued (the fused k and v write, the attention)."""
    t, dq, dk, dv = _counting_setup(be, "host path counts")
    attnlib.attention_with_kvcache(dq, t.dev, dk, dv)  # makes the plans
    attnlib.attention_with_kvcache(dq, t.dev)
    tally = _count_queue_work(monkeypatch)
    for _ in range(3):
        attnlib.attention_with_kvcache(dq, t.dev)
    assert tally == {"enqueue": 3, "fill": 0, "write": 0}
    attnlib.attention_with_kvcache(dq, t.dev, dk, dv)
    assert tally == {"enqueue": 5, "fill": 2, "write": 0}


def test_dense_front_door_repeat_calls(be, monkeypatch):
    """attention(q, k, v) with device arrays: after a warm call of one key, every change of
    options, layout, buffers or backend choice still gets the oracle's answer or its error."""
    rng = rng_for("host path dense")
    q, k, v = (randn(rng, s) for s in ((2, 3, 4, 12), (2, 29, 2, 12), (2, 29, 2, 12)))
    dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))

    def check(qq, kk, vv, hq, hk, hv, **kw):
        got = attnlib.attention(qq, kk, vv, **kw)
        want = attnlib.attention(hq, hk, hv, backend="numpy", **kw)
        if kw.get("return_lse"):
            np.testing.assert_allclose(attnlib.to_numpy(got[1]), want[1], atol=2e-5)
            got, want = got[0], want[0]
        np.testing.assert_allclose(attnlib.to_numpy(got), want, atol=2e-5)
        return attnlib.to_numpy(got)

    first = check(dq, dk, dv, q, k, v)
    assert np.array_equal(check(dq, dk, dv, q, k, v), first)
    seen = [first]
    for kw in ({"scale": 0.2}, {"causal": True}, {"window": (5, 1)}, {"softcap": 1.5},
               {"causal": "top_left", "return_lse": True}):
        got = check(dq, dk, dv, q, k, v, **kw)
        got = got if not isinstance(got, tuple) else got[0]
        assert all(np.abs(got - s).max() > 1e-4 for s in seen)
        seen.append(got)
    k2 = randn(rng, k.shape)
    check(dq, attnlib.to_device(k2, backend=be), dv, q, k2, v)
    qb, kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    dqb, dkb, dvb = (attnlib.to_device(x, backend=be) for x in (qb, kb, vb))
    check(dqb, dkb, dvb, qb, kb, vb, layout="bhsd")
    check(dqb, dkb, dvb, qb, kb, vb, layout="bhsd")
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention(dq, dk, dv, scale=True)
    with pytest.raises(attnlib.ArgumentError):
        attnlib.attention(dq, dk, dv, causal=1)
    with pytest.raises(attnlib.ArgumentError):  # the numpy backend cannot read device arrays
        attnlib.attention(dq, dk, dv, backend="numpy")
    with attnlib.use_backend("numpy"), pytest.raises(attnlib.ArgumentError):
        attnlib.attention(dq, dk, dv)
    d64 = [attnlib.to_device(x.astype(np.float64), backend=be) for x in (q, k, v)]
    attnlib.attention(*d64)
    monkeypatch.setattr(be, "facts", be.facts.__class__(**{**vars(be.facts), "fp64": False}))
    with pytest.raises(attnlib.UnsupportedError, match="cl_khr_fp64"):
        attnlib.attention(*d64)


def test_emulated_tensor_core_prefill_repeat_calls(emulated_nvidia):
    """attention(q, k, v) on the tensor-core prefill kernel (emulated) through its cached plan:
    repeats, new buffers, options and lengths (a varlen call changes the tables)."""
    from attnlib.backends.opencl import _runtime

    be = attnlib.get_backend("opencl")
    rng = rng_for("host path prefill")
    q, k, v = (randn(rng, s, "float16") for s in ((1, 21, 4, 64), (1, 37, 2, 64), (1, 37, 2, 64)))
    dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))
    before = sum(1 for key in _runtime.kernels if "attn_fwd_mma" in key)
    prev = None
    for kw in ({}, {}, {"causal": True}, {"causal": True}, {"softcap": 2.0}):
        got = attnlib.to_numpy(attnlib.attention(dq, dk, dv, **kw)).astype(np.float64)
        want = attnlib.attention(q, k, v, backend="numpy", **kw).astype(np.float64)
        np.testing.assert_allclose(got, want, atol=TOL["float16"])
        if prev is not None and kw != prev[0]:
            assert np.abs(got - prev[1]).max() > 4 * TOL["float16"]
        prev = (kw, got)
    after = sum(1 for key in _runtime.kernels if "attn_fwd_mma" in key)
    assert after > before, "the tensor-core prefill kernel did not run"
    k2 = randn(rng, k.shape, "float16")
    got = attnlib.attention(dq, attnlib.to_device(k2, backend=be), dv, causal=True)
    want = attnlib.attention(q, k2, v, backend="numpy", causal=True)
    np.testing.assert_allclose(attnlib.to_numpy(got).astype(np.float64), want, atol=2e-3)
    qv, kv = q[0], k[0]
    for cu_q, cu_k in (([0, 9, 21], [0, 15, 37]), ([0, 12, 21], [0, 30, 37])):
        cq, ck = np.array(cu_q, np.int32), np.array(cu_k, np.int32)
        got = attnlib.attention_varlen(dq.reshape(21, 4, 64), dk.reshape(37, 2, 64),
                                       dv.reshape(37, 2, 64), cq, ck, causal=True)
        want = attnlib.attention_varlen(qv, kv, v[0], cq, ck, causal=True, backend="numpy")
        np.testing.assert_allclose(attnlib.to_numpy(got).astype(np.float64), want, atol=2e-3)


def _recorded_launches(monkeypatch, kernel):
    """Replace ``_runtime.launch`` by a recorder of ``kernel``'s launches (options, grid, local
    size, scalar args); other kernels' launches are dropped."""
    from attnlib.backends.opencl import _runtime

    seen = []

    def record(key, make, name, queue, gsize, lsize, args, **kw):
        if name == kernel:
            seen.append((key[-1], tuple(gsize), tuple(lsize),
                         [a if isinstance(a, np.generic) else None for a in args]))

    monkeypatch.setattr(_runtime, "launch", record)
    return seen


@pytest.mark.parametrize("kind,splits", [("decode", None), ("decode", 3), ("prefill", None)])
@pytest.mark.parametrize("causal,softcap", [(True, None), (False, 2.0)])
def test_dispatch_chooses_what_run_chooses(emulated_nvidia, monkeypatch, kind, splits, causal,
                                           softcap):
    """The dispatch's plans of the tensor-core families (first call and repeat) launch with
    the options, grid and scalar arguments ``_nvidia_decode.run`` / ``_nvidia_mma.run`` launch
    with their defaults for the same call (a default changed in run and not in the family
    fails this)."""
    from attnlib.backends.opencl import _nvidia_decode, _nvidia_mma, _switches
    from attnlib.testing.reference import seq_call

    monkeypatch.setattr(_switches, "EMULATE_PTX", False)
    seen = _recorded_launches(monkeypatch,
                              "attn_decode_mma" if kind == "decode" else "attn_fwd_mma")
    be = attnlib.get_backend("opencl", **({} if splits is None else {"num_splits": splits}))
    rng = rng_for("host path same launch", kind, causal)
    sq, hq, hkv, d, n_k = (1, 8, 2, 128, 300) if kind == "decode" else (40, 4, 2, 64, 90)
    q = attnlib.to_device(randn(rng, (2, sq, hq, d), "float16"), backend=be)
    k, v = (attnlib.to_device(randn(rng, (2, n_k, hkv, d), "float16"), backend=be)
            for _ in range(2))
    ar = np.arange(2)
    kl = np.array([n_k, n_k - 37])
    call = seq_call(q, k, v, q_batch=ar, q_row0=0 * ar, q_len=ar * 0 + sq, k_batch=ar,
                    k_row0=0 * ar, k_len=kl, q_pos0=kl - sq, k_pos0=0 * ar, causal=causal,
                    softcap=softcap)
    be.attention(call)  # the dispatch: a plan
    be.attention(call)  # its repeat
    if kind == "decode":
        _nvidia_decode.run(be, be.queue, call)
    else:
        _nvidia_mma.run(be.context, be.queue, be.device, call)
    assert len(seen) == 3
    assert seen[0] == seen[1] == seen[2]


def test_decode_grid_fixed_while_the_cache_grows(emulated_nvidia, monkeypatch):
    """The tensor-core decode kernel's split count comes from the cache's capacity, not its
    length: steps from 40 to 2000 cached tokens (1 to 16 key tiles) launch one grid, planned for
    the 16 key tiles of 2048 rows (a recorded launch replays correctly)."""
    from attnlib.backends.opencl import _nvidia_decode, _switches

    monkeypatch.setattr(_switches, "EMULATE_PTX", False)
    seen = _recorded_launches(monkeypatch, "attn_decode_mma")
    planned = []
    real = _nvidia_decode.choose_splits
    monkeypatch.setattr(_nvidia_decode, "choose_splits", lambda cu, pairs, tiles, *a:
                        planned.append(tiles) or real(cu, pairs, tiles, *a))
    be = attnlib.get_backend("opencl")
    rng = rng_for("host path fixed grid")
    cache = attnlib.KVCache(1, 2048, 2, 128, dtype="float16", backend=be)
    q = attnlib.to_device(randn(rng, (1, 1, 8, 128), "float16"), backend=be)
    for n in (40, 300, 1000, 2000):
        kv = attnlib.to_device(randn(rng, (1, n - int(cache.lengths[0]), 2, 128), "float16"),
                               backend=be)
        cache.update(kv, kv, int(cache.lengths[0]))
        attnlib.attention_with_kvcache(q, cache)
    assert len(seen) == 4 and len({s[1] for s in seen}) == 1
    assert planned and set(planned) == {2048 // 128}


def test_switches_are_in_the_plan_keys(be, monkeypatch):
    """A switch changed between two calls of one description takes effect at once (the plan
    keys hold every switch: no stale plan); ``forget_plans`` empties every plan cache."""
    from attnlib.backends.opencl import _runtime, _switches

    built = []
    real = _runtime.launch

    def record(key, make, name, *args, **kw):
        built.append(key[-1])
        return real(key, make, name, *args, **kw)

    monkeypatch.setattr(_runtime, "launch", record)
    rng = rng_for("host path switches")
    q, k = (attnlib.to_device(randn(rng, s), backend=be) for s in ((1, 9, 4, 16),
                                                                    (1, 40, 2, 16)))
    attnlib.attention(q, k, k)
    monkeypatch.setattr(_switches, "CP_ASYNC_FORCE", True)
    attnlib.attention(q, k, k)
    assert len(built) == 2
    assert "-DCP_ASYNC=1" not in built[0] and "-DCP_ASYNC=1" in built[1]
    assert any(len(t) for t in attnlib._plans.tables())
    attnlib.forget_plans()
    assert not any(len(t) for t in attnlib._plans.tables())


def test_why_lists_the_families_tried(be):
    """``why`` names each family the dispatch tried before the one that runs a call, with its
    reason, and checks its arguments as ``attention`` does."""
    from attnlib.backends.opencl import _nvidia_mma, why

    rng = rng_for("host path why")
    q, k = randn(rng, (1, 13, 4, 16), "float16"), randn(rng, (1, 40, 2, 16), "float16")
    tried = why(q, k, k, causal=True, backend=be)
    names = [name for name, _ in tried]
    assert names[-1] == "portable" and tried[-1][1] is None
    assert all(reason for _, reason in tried[:-1])
    if _nvidia_mma.compute_capability(be.device) is None:
        assert names[:4] == ["nvidia wgmma", "nvidia decode + prefill", "nvidia mma.sync",
                             "nvidia decode"]
        assert tried[1][1] == "not a paged call"
        assert "not an NVIDIA device" in tried[2][1]
    off = why(q, k, k, backend=attnlib.get_backend("opencl", use_mma=False))
    assert [name for name, _ in off] == names
    assert off[2][1] == "the backend's use_mma=False"
    with pytest.raises(attnlib.ArgumentError):
        why(q, k, k, is_causal=True)
    with pytest.raises(attnlib.ShapeError):
        why(q, k[..., :8], k)


def test_batched_steps_with_large_tables(be):
    """Five sequences: the descriptor (> 128 bytes) is rewritten by a non-blocking write, not a
    fill; each step still gets the oracle's answer, outputs dropped at once included."""
    rng = rng_for("host path batched")
    b, cap, hq, hkv, d = 5, 45, 4, 2, 16
    t = Twin(be, b, cap, hkv, d, "float32")
    _fill(t, rng, b, 7, hkv, d, "float32")
    for _ in range(6):
        q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, "float32")
        dq = attnlib.to_device(q, backend=be)
        attnlib.attention_with_kvcache(dq, t.dev)  # output dropped before its kernel ran
        t.step(q, k, v)


# ---- appends with RoPE (a decode step of an LLM): the fused rope_append launch -------------------
@pytest.fixture
def fused(monkeypatch):
    """Counts the fused appends that ran (returned q, rotated with RoPE) and those handed
    back."""
    from attnlib.backends.opencl import _ops

    seen = {"ran": 0, "declined": 0}
    real = _ops.fused_append

    def counted(*a):
        res = real(*a)
        seen["ran" if res is not None else "declined"] += 1
        return res

    monkeypatch.setattr(_ops, "fused_append", counted)
    return seen


def _rope_steps(t, rng, n, rope, hq, hkv, d, dtype, b=1, n_new=1, **kw):
    for _ in range(n):
        t.step(*_qkv_step(rng, b, n_new, hq, hkv, d, dtype, n_new=n_new), rope=rope, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("interleaved,rotary_dim", [(False, None), (True, None), (False, 10)])
def test_rope_append_steps(be, fused, dtype, interleaved, rotary_dim):
    """Decode steps appending with RoPE (GQA), lengths changing every step, then switching to
    plain appends and back, three-token steps, a rollback, other options and q layouts."""
    rng = rng_for("host path rope", dtype, interleaved, rotary_dim)
    b, cap, hq, hkv, d = 1, 60, 6, 2, 24
    rope = attnlib.RoPE(theta=500.0, interleaved=interleaved, rotary_dim=rotary_dim)
    t = Twin(be, b, cap, hkv, d, dtype)
    _fill(t, rng, b, 11, hkv, d, dtype)
    _rope_steps(t, rng, 4, rope, hq, hkv, d, dtype)
    assert fused == {"ran": 3, "declined": 0}  # the first step is the full path's
    _rope_steps(t, rng, 2, None, hq, hkv, d, dtype)  # no RoPE: the plain append
    _rope_steps(t, rng, 2, rope, hq, hkv, d, dtype)
    _rope_steps(t, rng, 2, attnlib.RoPE(theta=900.0, interleaved=interleaved,
                                        rotary_dim=rotary_dim), hq, hkv, d, dtype)
    _rope_steps(t, rng, 3, rope, hq, hkv, d, dtype, n_new=3)  # q rows = new tokens = 3
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype, n_new=2)
    t.step(q, k, v, rope=rope)  # 1 query row, 2 new tokens: not fused (primitives)
    t.step(q, k, v, rope=rope)
    t.step(q, rope=rope, fresh=False)  # no append: the same q at the same position
    t.dev.update(*(attnlib.to_device(x, backend=be) for x in (k, v)), 20)
    t.ref.update(k, v, 20)  # rollback: the positions go down
    _rope_steps(t, rng, 2, rope, hq, hkv, d, dtype)
    for kw in ({"softcap": 2.0}, {"window": (5, 0)}, {"scale": 0.4, "return_lse": True}):
        _rope_steps(t, rng, 2, rope, hq, hkv, d, dtype, **kw)
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
    qt = attnlib.to_device(np.ascontiguousarray(q.transpose(0, 2, 1, 3)), backend=be)
    t.step(q, k, v, q_dev=qt.transpose((0, 2, 1, 3)), rope=rope)  # q as a strided view
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, dtype)
    t.step(q, k, v, q_dev=q, rope=rope)  # a numpy q: not fused (primitives)
    assert fused["ran"] >= 12 and fused["declined"] == 0
    np.testing.assert_allclose(attnlib.to_numpy(t.dev.k).astype(np.float64),
                               attnlib.to_numpy(t.ref.k).astype(np.float64), atol=TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rope_append_ring_batches_and_caches(be, fused, dtype):
    """A ring cache wrapping under RoPE appends; two sequences of different lengths; two
    caches of one geometry (one plan: the caches' buffers are set per call) taking turns."""
    rng = rng_for("host path rope ring", dtype)
    b, cap, hq, hkv, d = 2, 13, 8, 2, 16
    rope = attnlib.RoPE()
    ring = Twin(be, b, cap, hkv, d, dtype, ring=True)
    _fill(ring, rng, b, 6, hkv, d, dtype)
    k, v = randn(rng, (1, 3, hkv, d), dtype), randn(rng, (1, 3, hkv, d), dtype)
    ring.dev.update(*(attnlib.to_device(x, backend=be) for x in (k, v)), 6, batch_idx=[1])
    ring.ref.update(k, v, 6, batch_idx=[1])  # lengths 6 and 9
    other = Twin(be, b, cap, hkv, d, dtype, ring=True)
    _fill(other, rng, b, 2, hkv, d, dtype)
    for _ in range(9):  # wraps: the first held position and the first slot move
        for t in (ring, other):
            t.last = None
            _rope_steps(t, rng, 1, rope, hq, hkv, d, dtype, b=b)
    assert int(ring.dev.held_from.min()) > 0 and fused["ran"] >= 10


def test_rope_position_table_widens_and_falls_back(be, fused, monkeypatch):
    """The (cos, sin) table of consecutive positions: positions past its end make a wider one;
    a call needing more rows than MAX_BYTES allows takes the primitives instead."""
    from attnlib.backends.opencl import _ops

    monkeypatch.setattr(_ops._CosSin, "MIN_ROWS", 2)
    monkeypatch.setattr(_ops, "_cos_sin_tables", {})
    rng = rng_for("host path rope table")
    b, cap, hq, hkv, d = 1, 90, 4, 2, 12
    rope = attnlib.RoPE(theta=300.0)
    t = Twin(be, b, cap, hkv, d, "float32")
    _fill(t, rng, b, 3, hkv, d, "float32")
    _rope_steps(t, rng, 9, rope, hq, hkv, d, "float32")
    (table,) = _ops._cos_sin_tables.values()
    assert table.base <= 4 and table.end >= 12
    t.dev.update(*(attnlib.to_device(randn(rng, (1, 60, hkv, d)), backend=be)
                   for _ in range(2)), 0)  # lengths jump past the table's end
    t.ref.update(*(attnlib.to_numpy(x) for x in (t.dev.k[:, :60], t.dev.v[:, :60])), 0)
    _rope_steps(t, rng, 2, rope, hq, hkv, d, "float32")
    assert table.end >= 62 and fused == {"ran": 10, "declined": 0}
    # a new RoPE (a new table) allowed 4 positions: three new tokens + 2 to spare do not fit
    monkeypatch.setattr(_ops._CosSin, "MAX_BYTES", 4 * 12 * 4)
    _rope_steps(t, rng, 3, attnlib.RoPE(theta=700.0), hq, hkv, d, "float32", n_new=3)
    assert fused == {"ran": 10, "declined": 2}


def test_position_table_ranges(be, monkeypatch):
    """_CosSin.cover: the rows it makes, widening (old range + new positions, as many again to
    spare), a narrow table past MAX_BYTES, a refusal past it; the values are _cos_sin's."""
    from attnlib.backends.base import RopeSpec
    from attnlib.backends.opencl import _ops

    monkeypatch.setattr(_ops._CosSin, "MIN_ROWS", 2)
    monkeypatch.setattr(_ops._CosSin, "MAX_BYTES", 8 * 4 * 40)  # 40 positions of R = 8
    spec = RopeSpec(1000.0, False, 8)
    c = _ops._CosSin(be.context, spec, np.dtype(np.float32))
    ranges = []
    for lo, hi in ((5, 6), (6, 8), (8, 9), (3, 4), (30, 31), (100, 103), (200, 240)):
        ranges.append(c.cover(lo, hi) and (c.base, c.end))
    assert ranges == [(5, 8), (5, 8), (5, 13), (3, 23), (30, 33), (100, 105), False]
    host = np.empty((5, 4, 2), np.float32)
    cl.enqueue_copy(be.queue, host, c.buf)
    assert np.array_equal(host, _ops._cos_sin(np.arange(100, 105), spec, np.dtype(np.float32)))


def test_rope_append_errors_after_warm_calls(be):
    """After warm fused steps, every bad call raises the front door's error and leaves the
    cache (lengths and contents) as it was; a good step still gets the oracle's answer."""
    rng = rng_for("host path rope errors")
    b, cap, hq, hkv, d = 1, 9, 4, 2, 8
    rope = attnlib.RoPE()
    t = Twin(be, b, cap, hkv, d, "float32")
    _fill(t, rng, b, 5, hkv, d, "float32")
    _rope_steps(t, rng, 3, rope, hq, hkv, d, "float32")
    q, k, v = _qkv_step(rng, b, 1, hq, hkv, d, "float32")
    dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))
    before = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
    bad_k = attnlib.to_device(randn(rng, (1, 1, hkv, d), "float16"), backend=be)
    wide_k = attnlib.to_device(randn(rng, (1, 1, hkv + 1, d)), backend=be)
    for err, kw in (
        (attnlib.ArgumentError, {"k": dk, "v": dv, "rope": "rope"}),
        (attnlib.ArgumentError, {"k": dk, "v": dv, "rope": attnlib.RoPE(rotary_dim=10)}),
        (attnlib.DTypeError, {"k": bad_k, "v": dv, "rope": rope}),
        (attnlib.ShapeError, {"k": wide_k, "v": dv, "rope": rope}),
        (attnlib.ArgumentError, {"k": dk, "v": None, "rope": rope}),
        (attnlib.ArgumentError, {"k": dk, "v": dv, "rope": rope, "causal": 1}),
    ):
        with pytest.raises(err):
            attnlib.attention_with_kvcache(dq, t.dev, **kw)
        after = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
        assert all(np.array_equal(x, y) for x, y in zip(before, after))
    t.step(q, k, v, rope=rope)  # length 9 = max_seq_len
    before = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
    with pytest.raises(attnlib.CacheOverflowError):
        attnlib.attention_with_kvcache(dq, t.dev, dk, dv, rope=rope)
    after = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    t.step(randn(rng, q.shape), rope=rope)


def test_rope_append_touches_the_queue_twice(be, monkeypatch):
    """A repeated append with RoPE: two enqueues (the fused append, the attention), the two
    tables rewritten by fills (their lengths changed), nothing written from the host."""
    from attnlib.backends.opencl import _pool

    t, dq, dk, dv = _counting_setup(be, "host path rope counts")
    rope = attnlib.RoPE()
    for _ in range(2):  # the full path, then the repeat entry makes its plan
        attnlib.attention_with_kvcache(dq, t.dev, dk, dv, rope=rope)
    tally = _count_queue_work(monkeypatch)
    for _ in range(3):
        attnlib.attention_with_kvcache(dq, t.dev, dk, dv, rope=rope)
    fills = 6 if _pool.DeviceTable(be.queue, 8, not be.facts.simulator).fill else 0
    assert tally == {"enqueue": 6, "fill": fills, "write": 6 - fills}


# ---- start_pos and batch_idx on the repeat path --------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batch_idx_and_start_pos_steps(be, fused, dtype, monkeypatch):
    """Batch rows mapped to cache rows (array, list, one int), rewrites at an explicit start_pos
    (speculative decoding's rollback), with and without RoPE, a ring: each step against the
    oracle after warm calls of the same key."""
    from attnlib import kv_cache

    served = []
    real = kv_cache._FastEntry._mapped
    monkeypatch.setattr(kv_cache._FastEntry, "_mapped",
                        lambda *a: served.append(1) or real(*a))
    rng = rng_for("host path mapped", dtype)
    hq, hkv, d = 6, 3, 16
    rope = attnlib.RoPE(theta=200.0)
    for ring, cap in ((False, 40), (True, 11)):
        t = Twin(be, 3, cap, hkv, d, dtype, ring=ring)
        _fill(t, rng, 3, 5, hkv, d, dtype)
        for idx in (np.array([2, 0]), np.array([2, 0]), np.array([0, 1]), [1, 2], [2, 1]):
            for r in (None, rope, rope):
                _rope_steps(t, rng, 1, r, hq, hkv, d, dtype, b=2, batch_idx=idx)
        for idx in (np.array([1, 1]), np.array([0, 2])):  # no append: a row may repeat
            t.step(randn(rng, (2, 1, hq, d), dtype), batch_idx=idx)
        for idx in (1, 0, np.int64(2)):  # one row, an int
            _rope_steps(t, rng, 2, rope, hq, hkv, d, dtype, batch_idx=idx)
        for _ in range(3):  # rewrite the last position again and again (rollback by one)
            n = int(t.dev.lengths[0])
            _rope_steps(t, rng, 1, rope, hq, hkv, d, dtype, start_pos=n - 1)
            _rope_steps(t, rng, 1, None, hq, hkv, d, dtype, b=2, batch_idx=[0, 2],
                        start_pos=np.array([n - 1, int(t.dev.lengths[2])]))
        n = t.dev.lengths
        _rope_steps(t, rng, 1, rope, hq, hkv, d, dtype, b=3, start_pos=n - 2)
        _rope_steps(t, rng, 1, rope, hq, hkv, d, dtype, b=3, start_pos=t.dev.lengths)
        if ring:
            assert int(t.dev.held_from.max()) > 0
    assert fused["ran"] >= 30 and fused["declined"] == 0 and len(served) >= 40


def test_mapped_errors_after_warm_calls(be):
    """After warm calls with batch_idx / start_pos, every bad value raises the front door's
    error and leaves the cache as it was."""
    rng = rng_for("host path mapped errors")
    cap, hq, hkv, d = 9, 4, 2, 8
    rope = attnlib.RoPE()
    for ring in (False, True):
        t = Twin(be, 3, cap, hkv, d, "float32", ring=ring)
        _fill(t, rng, 3, 4, hkv, d, "float32")
        q, k, v = _qkv_step(rng, 2, 1, hq, hkv, d, "float32")
        q1, k1, v1 = _qkv_step(rng, 1, 1, hq, hkv, d, "float32")
        for _ in range(2):  # warm each key
            t.step(q, k, v, batch_idx=np.array([0, 2]), rope=rope, fresh=False)
            t.step(q, batch_idx=[1, 2], fresh=False)
            t.step(q1, k1, v1, start_pos=int(t.dev.lengths[0]) - 1, rope=rope, fresh=False)
            t.step(q1, k1, v1, start_pos=np.array([3]), batch_idx=1, fresh=False)
        while int(t.dev.lengths[0]) < cap + 2 * ring:  # full (or wrapped: 0, 1 not held)
            t.step(q1, k1, v1, rope=rope, fresh=False)
        dq, dk, dv, dq1, dk1, dv1 = (attnlib.to_device(x, backend=be)
                                     for x in (q, k, v, q1, k1, v1))
        length = int(t.dev.lengths[0])
        bad = [
            (attnlib.ArgumentError, (dq, dk, dv), {"batch_idx": np.array([2, 2]), "rope": rope}),
            (attnlib.ArgumentError, (dq, dk, dv), {"batch_idx": np.array([0, 3]), "rope": rope}),
            (attnlib.ArgumentError, (dq, dk, dv), {"batch_idx": np.array([-1, 0]),
                                                    "rope": rope}),
            (attnlib.ShapeError, (dq, dk, dv), {"batch_idx": np.array([0, 1, 2]), "rope": rope}),
            (attnlib.ArgumentError, (dq, dk, dv), {"batch_idx": np.array([0.0, 1.0]),
                                                    "rope": rope}),
            (attnlib.ArgumentError, (dq,), {"batch_idx": [1, 3]}),
            (attnlib.ArgumentError, (dq,), {"batch_idx": [1, True]}),
            (attnlib.ArgumentError, (dq1,), {"start_pos": 2}),
            (attnlib.ArgumentError, (dq1, dk1, dv1), {"start_pos": length + 1, "rope": rope}),
            (attnlib.ArgumentError, (dq1, dk1, dv1), {"start_pos": -1, "rope": rope}),
            (attnlib.ArgumentError, (dq1, dk1, dv1), {"start_pos": True, "rope": rope}),
            (attnlib.ArgumentError, (dq1, dk1, dv1), {"start_pos": np.array([2, 3]),
                                                      "batch_idx": 1}),
        ]
        if ring:  # a position the ring no longer holds
            bad.append((attnlib.ArgumentError, (dq1, dk1, dv1), {"start_pos": 0, "rope": rope}))
        else:  # past max_seq_len
            bad.append((attnlib.CacheOverflowError, (dq1, dk1, dv1),
                        {"start_pos": cap, "rope": rope}))
        for err, args, kw in bad:
            before = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
            with pytest.raises(err):
                attnlib.attention_with_kvcache(args[0], t.dev, *args[1:], **kw)
            after = (t.dev.lengths, attnlib.to_numpy(t.dev.k), attnlib.to_numpy(t.dev.v))
            assert all(np.array_equal(x, y) for x, y in zip(before, after)), (err, kw)
        t.step(randn(rng, q.shape), batch_idx=np.array([2, 1]))


def test_per_call_rope_uploads_stay_off_the_arrays(be):
    """The per-call RoPE path (1 query row over 2 new tokens; attnlib.rope) keeps its table
    uploads' events to itself: on the cache Arrays, pyopencl's add_event made each step wait for
    the previous step's kernels; on a returned Array, dropping it waited for them."""
    rng = rng_for("host path rope uploads")
    hq, hkv, d = 4, 2, 16
    rope = attnlib.RoPE()
    t = Twin(be, 1, 60, hkv, d, "float32")
    _fill(t, rng, 1, 7, hkv, d, "float32")
    for _ in range(8):
        q, k, v = _qkv_step(rng, 1, 1, hq, hkv, d, "float32", n_new=2)
        t.step(q, k, v, rope=rope)
    x = attnlib.to_device(randn(rng, (1, 3, hq, d)), backend=be)
    rot = attnlib.rope(x, np.arange(3), backend=be)
    assert t.dev.k.events == [] and t.dev.v.events == [] and rot.events == []


@pytest.mark.parametrize("d,dv,dtype", [(16, 24, "float32"), (24, 8, "float16"),
                                        (16, 10, "float64")])
def test_fused_append_value_dims_and_float64(be, fused, d, dv, dtype):
    """Fused appends (RoPE and plain) with head_dim_v != head_dim (the grid spans max(D, Dv))
    and in float64 (float64 (cos, sin)), against the numpy cache."""
    rng = rng_for("host path dv", d, dv, dtype)
    b, cap, hq, hkv = 2, 30, 4, 2
    dev = attnlib.KVCache(b, cap, hkv, d, head_dim_v=dv, dtype=dtype, backend=be)
    ref = attnlib.KVCache(b, cap, hkv, d, head_dim_v=dv, dtype=dtype, backend="numpy")
    tol = {"float64": 1e-10}.get(dtype, TOL.get(dtype))
    for rope in (attnlib.RoPE(rotary_dim=8), None, attnlib.RoPE(rotary_dim=8)):
        for _ in range(3):
            q = randn(rng, (b, 1, hq, d), dtype)
            k, v = randn(rng, (b, 1, hkv, d), dtype), randn(rng, (b, 1, hkv, dv), dtype)
            got = attnlib.attention_with_kvcache(
                *(attnlib.to_device(x, backend=be) for x in (q,)), dev,
                *(attnlib.to_device(x, backend=be) for x in (k, v)), rope=rope)
            ref._fast.clear()
            want = attnlib.attention_with_kvcache(q, ref, k, v, rope=rope)
            np.testing.assert_allclose(attnlib.to_numpy(got).astype(np.float64),
                                       want.astype(np.float64), atol=tol, rtol=0)
    np.testing.assert_allclose(attnlib.to_numpy(dev.v).astype(np.float64),
                               attnlib.to_numpy(ref.v).astype(np.float64), atol=tol, rtol=0)
    assert fused["ran"] == 7  # the first call of each key is the full path


@pytest.mark.parametrize("sq", [1, 20])
def test_quantized_cache_dispatch(emulated_nvidia, sq):
    """On an NVIDIA sm_80+ device (emulated here) an 8-bit cache's decode call (sq=1) runs the
    tensor-core decode kernel's dequantizing load (KV_FORMAT), its prefill call (sq=20) the
    portable kernel's: the prefill kernel reads K and V in the dtype only. The same float16 call
    without kv_dtype takes the tensor-core kernels. Checked against the float64 reference on the
    dequantized cache."""
    from attnlib.backends.base import AttnCall, AttnOptions
    from attnlib.backends.opencl import _dispatch
    from attnlib.testing.reference import naive_attention, reference_attention
    from attnlib.testing.tolerance import check_attention

    be = attnlib.get_backend("opencl")
    rng = rng_for("quantized dispatch", sq)
    hq, hkv, d, n = 8, 2, 64, 30
    k, v = (rng.standard_normal((1, n, hkv, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((1, sq, hq, d)).astype(np.float16)
    z = np.zeros(1, np.int64)
    for kv_dtype, family in (("float8_e4m3fn", "nvidia decode" if sq == 1 else "portable"),
                             (None, "nvidia decode" if sq == 1 else "nvidia mma.sync")):
        cache = attnlib.KVCache(1, 32, hkv, d, dtype="float16", kv_dtype=kv_dtype, backend=be)
        cache.update(k, v, 0)
        # the call attention_with_kvcache makes over this cache, with q on the device
        call = AttnCall(q=attnlib.to_device(q, backend=be), k=cache.k, v=cache.v, q_batch=z,
                        q_row0=z, q_len=z + sq, k_batch=z, k_row0=z, k_len=z + n,
                        q_pos0=z + n - sq, k_pos0=z, causal_hi=z,
                        options=AttnOptions(d ** -0.5, "bottom_right"),
                        k_scales=cache.k_scales, v_scales=cache.v_scales)
        assert _dispatch.why(be, call)[-1][0] == family
        if kv_dtype is not None:
            out = attnlib.attention_with_kvcache(q, cache)
            kd, vd = (x[:, :n] for x in cache.dequantized())
            ref, _ = reference_attention(q, kd, vd, causal=True)
            naive, _ = naive_attention(q, kd.astype(np.float16), vd.astype(np.float16),
                                       causal=True)
            check_attention(out, None, ref, naive)
