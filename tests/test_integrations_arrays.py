"""Arrays of other frameworks through every public function (contract section 11): torch CPU
tensors and JAX CPU arrays go in without a copy and come back as the caller's kind, with the same
bits as the same call on numpy arrays (each backend is deterministic, so any difference is the
conversion's); torch bfloat16 through ml_dtypes.bfloat16; device arrays and tensors that need
gradients are refused with UnsupportedError."""

# ruff: noqa: E402  (the optional packages are asked for before the imports that need them)
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

# PyTorch and JAX are optional (the `torch` extra; CI installs both): without them these skip
torch = pytest.importorskip("torch")

import attnlib
from attnlib._spec import _foreign

BACKENDS = ["numpy", "numba"]


def _rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _t(a):
    """A torch tensor of the numpy array ``a`` (bfloat16 for ml_dtypes.bfloat16)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _np(x):
    if isinstance(x, torch.Tensor):
        assert x.device.type == "cpu"
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def _same(got, want, kind=torch.Tensor):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, kind), type(g)
        assert np.array_equal(_np(g), w), np.abs(_np(g).astype(np.float64) - w).max()


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ---- no copy in, the caller's kind out ---------------------------------------------------------
def test_views_share_memory():
    x = torch.randn(2, 7, 3, 5)
    for view in (x, x.transpose(1, 2), x[:, ::2], x.to(torch.bfloat16).transpose(1, 2)):
        a = _foreign.to_host(view, "torch")
        assert _ptr(a) == view.data_ptr()
        assert a.shape == tuple(view.shape)
        assert a.strides == tuple(s * view.element_size() for s in view.stride())
    b = _foreign.to_host(x.to(torch.bfloat16), "torch")
    assert b.dtype == ml_dtypes.bfloat16
    assert np.array_equal(b.astype(np.float32), x.to(torch.bfloat16).float().numpy())
    out = _foreign.from_host(b, "torch")
    assert out.dtype == torch.bfloat16 and out.data_ptr() == _ptr(b)
    assert attnlib.to_numpy(x).ctypes.data == x.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_attention_torch(backend, dtype):
    rng = np.random.default_rng(11)
    q, k, v = _rand(rng, 2, 5, 4, 7, dtype=dtype), _rand(rng, 2, 9, 2, 7, dtype=dtype), \
        _rand(rng, 2, 9, 2, 3, dtype=dtype)
    mask = rng.random((2, 1, 5, 9)) < 0.7
    kw = dict(causal=True, softcap=3.0, return_lse=True, backend=backend)
    _same(attnlib.attention(_t(q), _t(k), _t(v), mask=torch.from_numpy(mask), **kw),
          attnlib.attention(q, k, v, mask=mask, **kw))
    # PyTorch's (B, H, S, D) tensors, given as transposed views of (B, S, H, D) storage
    qt, kt, vt = (_t(a).transpose(1, 2) for a in (q, k, v))
    want = attnlib.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                             v.transpose(0, 2, 1, 3), layout="bhsd", backend=backend)
    _same(attnlib.attention(qt, kt, vt, layout="bhsd", backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_primitives_torch(backend):
    rng = np.random.default_rng(12)
    x = _rand(rng, 3, 4, 2, 6)
    _same(attnlib.softmax(_t(x), axis=1, backend=backend), attnlib.softmax(x, 1, backend=backend))
    _same(attnlib.logsumexp(_t(x), backend=backend), attnlib.logsumexp(x, backend=backend))
    pos = np.array([3, 0, 7, 1], np.int64)
    _same(attnlib.rope(_t(x).transpose(1, 2), torch.from_numpy(pos), layout="bhsd",
                       backend=backend),
          attnlib.rope(x.transpose(0, 2, 1, 3), pos, layout="bhsd", backend=backend))
    q, k, v = _rand(rng, 1, 3, 2, 6), _rand(rng, 1, 5, 2, 6), _rand(rng, 1, 5, 2, 6)
    parts = [attnlib.attention(q, k[:, s], v[:, s], return_lse=True, backend=backend)
             for s in (slice(0, 2), slice(2, 5))]
    _same(attnlib.merge_states([_t(o) for o, _ in parts], tuple(_t(lse) for _, lse in parts),
                               backend=backend),
          attnlib.merge_states([o for o, _ in parts], [lse for _, lse in parts], backend=backend))
    acc_t, acc = (attnlib.OnlineAttention(a, causal=True, total_keys=5, backend=backend)
                  for a in (_t(q), q))
    for s in (slice(0, 1), slice(1, 5)):
        acc_t.update(_t(k[:, s]), _t(v[:, s]))
        acc.update(k[:, s], v[:, s])
    _same(acc_t.result(return_lse=True), acc.result(return_lse=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_and_caches_torch(backend):
    rng = np.random.default_rng(13)
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 3, 9], np.int32)
    q, k, v = _rand(rng, 5, 4, 5), _rand(rng, 9, 2, 5), _rand(rng, 9, 2, 5)
    _same(attnlib.attention_varlen(_t(q), _t(k), _t(v), torch.from_numpy(cu_q),
                                   torch.from_numpy(cu_k), causal=True, backend=backend),
          attnlib.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=backend))

    kd, vd = _rand(rng, 2, 3, 2, 5), _rand(rng, 2, 3, 2, 5)
    caches = [attnlib.KVCache(2, 11, 2, 5, backend=backend) for _ in range(2)]
    caches[0].update(_t(kd), _t(vd), torch.tensor([0, 0]))
    caches[1].update(kd, vd, np.array([0, 0]))
    q1, k1, v1 = _rand(rng, 2, 1, 4, 5), _rand(rng, 2, 1, 2, 5), _rand(rng, 2, 1, 2, 5)
    _same(attnlib.attention_with_kvcache(_t(q1), caches[0], _t(k1), _t(v1), return_lse=True),
          attnlib.attention_with_kvcache(q1, caches[1], k1, v1, return_lse=True))

    pcs = [attnlib.PagedKVCache(8, 3, 2, 5, backend=backend) for _ in range(2)]
    for pc, conv in zip(pcs, (_t, np.asarray)):
        sids = [pc.new_sequence(), pc.new_sequence()]
        pc.append(sids, conv(kd), conv(vd))
    sids_t = torch.tensor([0, 1])
    _same(attnlib.attention_with_paged_kvcache(_t(q1), pcs[0], sids_t, _t(k1), _t(v1)),
          attnlib.attention_with_paged_kvcache(q1, pcs[1], [0, 1], k1, v1))
    kp, vp = (attnlib.to_numpy(p) for p in (pcs[1].k_pages, pcs[1].v_pages))
    table, lens = pcs[1].block_table([0, 1]), pcs[1].lengths([0, 1])
    _same(attnlib.paged_attention(_t(q1), _t(kp), _t(vp), torch.from_numpy(table),
                                  torch.from_numpy(lens)),
          attnlib.paged_attention(q1, kp, vp, table, lens))


def test_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(14)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        q, k, v = _rand(rng, 1, 3, 2, 5, dtype=dtype), _rand(rng, 1, 4, 1, 5, dtype=dtype), \
            _rand(rng, 1, 4, 1, 5, dtype=dtype)
        out = attnlib.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                                backend="numba")
        assert isinstance(out, type(jnp.asarray(q))) and out.dtype == jnp.dtype(dtype)
        want = attnlib.attention(q, k, v, causal=True, backend="numba")
        assert np.array_equal(np.asarray(out), want)
    x = jnp.asarray(_rand(rng, 2, 3))
    assert np.shares_memory(_foreign.to_host(x, "jax"), _foreign.to_host(x, "jax"))


# ---- refused, never copied ---------------------------------------------------------------------
class _OnDevice:
    """A DLPack producer on a CUDA device (what a CUDA tensor offers)."""

    shape, dtype = (1, 2, 1, 4), np.float32

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("a device array must not be read")

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("backend", ["numpy", "numba", "opencl"])
def test_device_arrays_refused(backend):
    q = np.ones((1, 2, 1, 4), np.float32)
    with pytest.raises(attnlib.UnsupportedError, match="to_numpy.*to_device"):
        attnlib.attention(_OnDevice(), q, q, backend=backend)
    with pytest.raises(attnlib.UnsupportedError, match="CUDA"):
        attnlib.to_numpy(_OnDevice())


def test_grad_tensors_refused():
    q = torch.ones(1, 2, 1, 4, requires_grad=True)
    with pytest.raises(attnlib.UnsupportedError, match="no_grad"):
        attnlib.attention(q, q, q, backend="numpy")
    with torch.no_grad():  # a parameter read under no_grad, as in inference
        out = attnlib.attention(q, q, q, backend="numpy")
    assert isinstance(out, torch.Tensor) and not out.requires_grad


def test_distributed_torch():
    """attnlib.distributed on one rank (MPI.COMM_SELF): torch in, torch out, numpy's bits."""
    from mpi4py import MPI

    from attnlib import distributed as dist

    rng = np.random.default_rng(15)
    q, k = _rand(rng, 1, 6, 2, 5), _rand(rng, 1, 6, 1, 5)
    comm = MPI.COMM_SELF
    qt, kt = (dist.shard(_t(x), comm) for x in (q, k))
    qn, kn = (dist.shard(x, comm) for x in (q, k))
    _same(dist.shard(_t(q), comm), dist.shard(q, comm))
    out_t = dist.ring_attention(qt, kt, kt, comm, causal=True, backend="numpy")
    out = dist.ring_attention(qn, kn, kn, comm, causal=True, backend="numpy")
    _same(out_t, out)
    _same(dist.gather(out_t, comm), dist.gather(out, comm))
    o, lse = attnlib.attention(q, k, k, return_lse=True, backend="numpy")
    _same(dist.merge_across(_t(o), _t(lse), comm, backend="numpy"),
          dist.merge_across(o, lse, comm, backend="numpy"))
