"""contract §6: every error kind at the front door, each naming its argument.

A spy backend that fails the test if it is ever reached proves that validation happens before
any backend runs.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlib
from attnlib.backends.numpy_backend import NumpyBackend
from attnlib.errors import (
    ArgumentError,
    AttnlibError,
    BackendUnavailableError,
    CacheOverflowError,
    DTypeError,
    ShapeError,
    UnsupportedError,
)


class _Tripwire(NumpyBackend):
    """Any primitive call means a bad input got past the front door."""

    name = "tripwire"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def attention(self, call):
        raise AssertionError("reached the backend with a bad input")

    softmax = merge_states = rope = attention

    def cache_write(self, *a):
        raise AssertionError("reached cache_write with a bad input")


BE = "tripwire"


@pytest.fixture(autouse=True, scope="module")
def _tripwire_registered():
    """Registered while this module's tests run, not when it is imported: registered at import,
    it was also 'available' to the conformance plugin's default backend list whenever that list
    was first made after this module's collection (pytest tests/test_errors.py
    tests/test_layouts_device.py ran layout tests on it)."""
    from attnlib import registry

    attnlib.register_backend(BE, _Tripwire)
    yield
    with registry._lock:
        for table in (registry._registered, registry._classes, registry._instances):
            table.pop(BE, None)


def _qkv(b=1, sq=5, sk=7, hq=4, hkv=2, d=8, dv=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, sq, hq, d)).astype(dtype),
            rng.standard_normal((b, sk, hkv, d)).astype(dtype),
            rng.standard_normal((b, sk, hkv, dv)).astype(dtype))


def _raises(kind, argname, fn):
    """fn() raises ``kind`` whose message names ``argname``."""
    with pytest.raises(kind) as info:
        fn()
    assert isinstance(info.value, AttnlibError)
    assert argname in str(info.value), f"{argname!r} not named in: {info.value}"
    return info.value


Q, K, V = _qkv()

ATTENTION_CASES = [
    # (id, error kind, argument named, call)
    ("q list", DTypeError, "q", lambda: attnlib.attention(Q.tolist(), K, V, backend=BE)),
    ("q int", DTypeError, "q", lambda: attnlib.attention(Q.astype(np.int32), K, V, backend=BE)),
    ("k bool", DTypeError, "k", lambda: attnlib.attention(Q, K > 0, V, backend=BE)),
    ("v complex", DTypeError, "v", lambda: attnlib.attention(Q, K, V.astype(complex),
                                                             backend=BE)),
    ("q object", DTypeError, "q", lambda: attnlib.attention(Q.astype(object), K, V, backend=BE)),
    ("mixed dtypes", DTypeError, "k", lambda: attnlib.attention(Q, K.astype(np.float64), V,
                                                                backend=BE)),
    ("q 3-d", ShapeError, "q", lambda: attnlib.attention(Q[0], K, V, backend=BE)),
    ("heads", ShapeError, "Hq", lambda: attnlib.attention(*_qkv(hq=5, hkv=2), backend=BE)),
    ("head dim", ShapeError, "k", lambda: attnlib.attention(Q, K[..., :7], V, backend=BE)),
    ("k/v lengths", ShapeError, "v", lambda: attnlib.attention(Q, K, V[:, :6], backend=BE)),
    ("batch", ShapeError, "k", lambda: attnlib.attention(Q, np.concatenate([K, K]),
                                                         np.concatenate([V, V]), backend=BE)),
    ("scale nan", ArgumentError, "scale", lambda: attnlib.attention(Q, K, V, scale=float("nan"),
                                                                    backend=BE)),
    ("scale inf", ArgumentError, "scale", lambda: attnlib.attention(Q, K, V, scale=np.inf,
                                                                    backend=BE)),
    ("scale str", ArgumentError, "scale", lambda: attnlib.attention(Q, K, V, scale="1",
                                                                    backend=BE)),
    ("softcap 0", ArgumentError, "softcap", lambda: attnlib.attention(Q, K, V, softcap=0.0,
                                                                      backend=BE)),
    ("softcap neg", ArgumentError, "softcap", lambda: attnlib.attention(Q, K, V, softcap=-1.0,
                                                                        backend=BE)),
    ("causal", ArgumentError, "causal", lambda: attnlib.attention(Q, K, V, causal="bottom",
                                                                  backend=BE)),
    ("window len", ArgumentError, "window", lambda: attnlib.attention(Q, K, V, window=(1,),
                                                                      backend=BE)),
    ("window type", ArgumentError, "window", lambda: attnlib.attention(Q, K, V, window=(1.5, 2),
                                                                       backend=BE)),
    ("mask shape", ShapeError, "mask", lambda: attnlib.attention(
        Q, K, V, mask=np.ones((5, 6), bool), backend=BE)),
    ("mask dtype", DTypeError, "mask", lambda: attnlib.attention(
        Q, K, V, mask=np.ones((5, 7), np.int32), backend=BE)),
    ("alibi shape", ShapeError, "alibi_slopes", lambda: attnlib.attention(
        Q, K, V, alibi_slopes=np.ones(3, np.float32), backend=BE)),
    ("layout", ArgumentError, "layout", lambda: attnlib.attention(Q, K, V, layout="bsdh",
                                                                  backend=BE)),
    ("backend", ArgumentError, "numpy", lambda: attnlib.attention(Q, K, V, backend="nope")),
]


@pytest.mark.parametrize("kind,argname,fn", [c[1:] for c in ATTENTION_CASES],
                         ids=[c[0] for c in ATTENTION_CASES])
def test_attention_errors(kind, argname, fn):
    _raises(kind, argname, fn)


def test_error_family():
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, TypeError)
    assert issubclass(UnsupportedError, NotImplementedError)
    assert issubclass(BackendUnavailableError, RuntimeError)
    assert issubclass(CacheOverflowError, ValueError)
    assert attnlib.ShapeError is ShapeError and attnlib.AttnlibError is AttnlibError


def _varlen(cu_q, cu_k, total_q=6, total_k=9):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((total_q, 2, 8)).astype(np.float32)
    k = rng.standard_normal((total_k, 2, 8)).astype(np.float32)
    return lambda: attnlib.attention_varlen(q, k, k, np.asarray(cu_q, np.int32),
                                            np.asarray(cu_k, np.int32), backend=BE)


@pytest.mark.parametrize("cu_q,cu_k,argname", [
    ([1, 6], [0, 9], "cu_seqlens_q"),  # does not start at 0
    ([0, 4, 3, 6], [0, 3, 6, 9], "cu_seqlens_q"),  # decreasing
    ([0, 6], [0, 3, 9], "cu_seqlens"),  # different batch sizes
    ([0, 6], [0, 8], "cu_seqlens_k"),  # does not end at total_k
    ([0, 7], [0, 9], "cu_seqlens_q"),  # past total_q
])
def test_varlen_cu_seqlens_errors(cu_q, cu_k, argname):
    with pytest.raises((ArgumentError, ShapeError)) as info:
        _varlen(cu_q, cu_k)()
    assert argname in str(info.value)


def test_varlen_cu_seqlens_float_dtype():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 2, 8)).astype(np.float32)
    with pytest.raises((ArgumentError, DTypeError)) as info:
        attnlib.attention_varlen(q, q, q, np.array([0.0, 6.0]), np.array([0, 6], np.int32),
                                 backend=BE)
    assert "cu_seqlens_q" in str(info.value)


def test_softmax_errors():
    x = np.ones((3, 4), np.float32)
    _raises(ArgumentError, "axis", lambda: attnlib.softmax(x, axis=2, backend=BE))
    _raises(ArgumentError, "axis", lambda: attnlib.logsumexp(x, axis=-3, backend=BE))
    _raises(DTypeError, "x", lambda: attnlib.softmax(x.astype(np.int64), backend=BE))
    _raises(DTypeError, "x", lambda: attnlib.logsumexp([1.0, 2.0], backend=BE))


def test_merge_errors():
    o = np.ones((1, 3, 2, 4), np.float32)
    s = np.zeros((1, 2, 3), np.float32)
    _raises(ShapeError, "lses", lambda: attnlib.merge_states([o, o], [s, s[:, :, :2]],
                                                             backend=BE))
    _raises(ShapeError, "outs", lambda: attnlib.merge_states([o, o[:, :2]], [s, s], backend=BE))
    _raises(ArgumentError, "outs", lambda: attnlib.merge_states([], [], backend=BE))
    _raises(ArgumentError, "lses", lambda: attnlib.merge_states([o, o], [s], backend=BE))
    _raises(DTypeError, "outs", lambda: attnlib.merge_states([o, o.astype(np.float64)], [s, s],
                                                             backend=BE))


def test_online_attention_errors():
    q, k, v = _qkv()
    _raises(ArgumentError, "total_keys", lambda: attnlib.OnlineAttention(q, causal=True,
                                                                         backend=BE))
    acc = attnlib.OnlineAttention(q, backend="numpy")
    _raises(ShapeError, "k", lambda: acc.update(k[..., :5], v))
    _raises(DTypeError, "k", lambda: acc.update(k.astype(np.float64), v.astype(np.float64)))
    acc = attnlib.OnlineAttention(q, causal=True, total_keys=7, backend="numpy")
    acc.update(k[:, :4], v[:, :4])
    with pytest.raises(AttnlibError) as info:  # more keys than announced
        acc.update(k[:, :4], v[:, :4])
    assert "total_keys" in str(info.value)


def test_kvcache_construction_errors():
    _raises(ArgumentError, "max_seq_len", lambda: attnlib.KVCache(1, 0, 2, 8, backend=BE))
    _raises(ArgumentError, "max_batch_size", lambda: attnlib.KVCache(-1, 8, 2, 8, backend=BE))
    _raises(ArgumentError, "head_dim", lambda: attnlib.KVCache(1, 8, 2, 0, backend=BE))
    _raises(DTypeError, "dtype", lambda: attnlib.KVCache(1, 8, 2, 8, dtype="int32", backend=BE))


def test_kvcache_update_errors():
    cache = attnlib.KVCache(2, 8, 2, 8, backend="numpy")
    _, k, v = _qkv(b=2, sk=3)
    _raises(ArgumentError, "start_pos", lambda: cache.update(k, v, -1))
    _raises(ArgumentError, "start_pos", lambda: cache.update(k, v, np.array([0, 0, 0])))
    _raises(ArgumentError, "start_pos", lambda: cache.update(k, v, 1.5))
    _raises(ShapeError, "k", lambda: cache.update(k[..., :7], v, 0))
    _raises(ShapeError, "v", lambda: cache.update(k, v[:, :2], 0))
    k3, v3 = np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]])
    _raises(ShapeError, "max_batch_size", lambda: cache.update(k3, v3, 0))
    err = _raises(CacheOverflowError, "max_seq_len", lambda: cache.update(
        np.concatenate([k, k, k], 1), np.concatenate([v, v, v], 1), 0))
    assert isinstance(err, ValueError)
    assert np.asarray(cache.lengths).tolist() == [0, 0]


def test_kvcache_attention_errors():
    cache = attnlib.KVCache(2, 8, 2, 8, backend="numpy")
    _, k, v = _qkv(b=2, sk=3)
    cache.update(k, v, 0)
    q = _qkv(b=2, sq=1)[0]
    _raises(ArgumentError, "batch_idx", lambda: attnlib.attention_with_kvcache(
        q, cache, batch_idx=np.array([0, 2]), backend="numpy"))
    _raises(ShapeError, "batch_idx", lambda: attnlib.attention_with_kvcache(
        q, cache, batch_idx=np.array([0]), backend="numpy"))
    _raises(ArgumentError, "rope", lambda: attnlib.attention_with_kvcache(
        q, cache, rope=10000.0, backend="numpy"))
    _raises(ArgumentError, "k", lambda: attnlib.attention_with_kvcache(
        q, cache, k=k[:, :1], backend="numpy"))  # k without v
    _raises(ShapeError, "q", lambda: attnlib.attention_with_kvcache(
        q[..., :7], cache, backend="numpy"))


def test_rope_errors():
    x = np.ones((1, 4, 2, 8), np.float32)
    pos = np.arange(4)
    _raises(ArgumentError, "rotary_dim", lambda: attnlib.rope(x, pos, rotary_dim=5, backend=BE))
    _raises(ArgumentError, "rotary_dim", lambda: attnlib.rope(x, pos, rotary_dim=10, backend=BE))
    _raises(ShapeError, "positions", lambda: attnlib.rope(x, np.arange(5), backend=BE))
    _raises(DTypeError, "positions", lambda: attnlib.rope(x, pos.astype(float), backend=BE))
    _raises(ArgumentError, "theta", lambda: attnlib.rope(x, pos, theta=-1.0, backend=BE))
    _raises(ArgumentError, "rotary_dim", lambda: attnlib.RoPE(rotary_dim=3))


def test_unknown_backend_lists_valid_names():
    for call in (lambda: attnlib.get_backend("nope"), lambda: attnlib.set_backend("nope"),
                 lambda: attnlib.use_backend("nope").__enter__()):
        err = _raises(ArgumentError, "nope", call)
        for name in ("numpy", "numba", "opencl"):
            assert name in str(err)


def test_bad_calls_leave_everything_working():
    for case in ATTENTION_CASES:
        with pytest.raises(AttnlibError):
            case[3]()
    out = attnlib.attention(Q, K, V, backend="numpy")
    assert np.isfinite(out).all()


def test_queue_and_backend_that_disagree():
    """``queue=`` means the opencl backend on that queue: a backend that is another one, or
    OpenCL on another queue, beside it is an ArgumentError naming both; so is a queue that is
    not a ``pyopencl.CommandQueue``. Nothing is allocated on the way."""
    kw = dict(max_batch_size=1, max_seq_len=8, n_kv_heads=1, head_dim=4)
    with pytest.raises(ArgumentError, match="queue must be a pyopencl.CommandQueue"):
        attnlib.KVCache(queue="gpu0", **kw)
    with pytest.raises(ArgumentError, match="queue must be a pyopencl.CommandQueue"):
        attnlib.to_device(np.ones(3, np.float32), queue=object())
    cl = pytest.importorskip("pyopencl")
    if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI has PoCL
        pytest.skip("no OpenCL device")
    own = attnlib.get_backend("opencl")
    queue = cl.CommandQueue(own.context)
    for backend in ("numpy", "tripwire", own, "opencl"):
        with pytest.raises(ArgumentError, match="queue= and backend= disagree") as info:
            attnlib.KVCache(queue=queue, backend=backend, **kw)
        assert "backend=" in str(info.value)
        with pytest.raises(ArgumentError, match="queue= and backend= disagree"):
            attnlib.to_device(np.ones(3, np.float32), queue=queue, backend=backend)
    with pytest.raises(ArgumentError, match="not a known backend"):
        attnlib.KVCache(queue=queue, backend="bogus", **kw)


def test_unknown_keyword_names_attnlib_spelling():
    """PyTorch's ``is_causal=`` (and any unknown keyword) at every function that takes
    ``causal=`` is an ArgumentError naming ``causal=`` (or the valid keywords), raised before
    any backend runs; a misspelled keyword is never silently dropped."""
    import attnlib.distributed as dist

    q3 = Q[0]
    cu = np.array([0, Q.shape[1]], np.int32)
    cache = attnlib.KVCache(max_batch_size=1, max_seq_len=8, n_kv_heads=1, head_dim=4,
                            backend="tripwire")
    pages = attnlib.PagedKVCache(num_pages=2, page_size=4, n_kv_heads=1, head_dim=4,
                                 backend="tripwire")
    calls = {
        "attention": lambda **kw: attnlib.attention(Q, K, V, backend="tripwire", **kw),
        "attention_varlen": lambda **kw: attnlib.attention_varlen(
            q3, K[0], V[0], cu, cu, backend="tripwire", **kw),
        "OnlineAttention": lambda **kw: attnlib.OnlineAttention(Q, backend="tripwire", **kw),
        "attention_with_kvcache": lambda **kw: attnlib.attention_with_kvcache(Q, cache, **kw),
        "attention_with_paged_kvcache": lambda **kw: attnlib.attention_with_paged_kvcache(
            q3, pages, [0], **kw),
        "paged_attention": lambda **kw: attnlib.paged_attention(q3, None, None, None, None,
                                                                **kw),
        "ring_attention": lambda **kw: dist.ring_attention(Q, K, V, None, **kw),
    }
    for name, call in calls.items():
        with pytest.raises(ArgumentError, match=rf"^{name}\(\) .*'is_causal'.* causal="):
            call(is_causal=True)
        with pytest.raises(ArgumentError, match=r"'causl'.*expected one of .*causal"):
            call(causl=True)


@pytest.mark.parametrize("start_pos,echo", [(-1, "start_pos=-1 "), (np.int32(-2), "start_pos=-2 "),
                                            (np.array([3, -1]), r"start_pos=\[3, -1\] ")])
def test_start_pos_echoed_as_given(start_pos, echo):
    cache = attnlib.KVCache(max_batch_size=2, max_seq_len=8, n_kv_heads=1, head_dim=4,
                            backend="numpy")
    k = np.ones((2, 1, 1, 4), np.float32)
    with pytest.raises(ArgumentError, match=echo):
        cache.update(k, k, start_pos=start_pos)
