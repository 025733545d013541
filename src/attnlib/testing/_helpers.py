"""Shared pieces of the conformance tests: dtypes, random data, one checked attention call."""

from __future__ import annotations

import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from attnlib.testing.reference import naive_attention, reference_attention
from attnlib.testing.tolerance import check_attention

#: every dtype of the contract, by name
DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}


def rng_for(*key) -> np.random.Generator:
    """A generator seeded from the test's own parameters (reproducible, different per case)."""
    seed = zlib.crc32(repr(key).encode())
    return np.random.default_rng([seed, 20261129])


def randn(rng, shape, dtype="float32", scale=1.0) -> np.ndarray:
    """Random normal data in ``dtype``; never zeros (a zero would hide indexing bugs)."""
    x = rng.standard_normal(shape) * scale
    x = np.where(x == 0, 0.5, x)
    return x.astype(DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)


def qkv(rng, b, sq, sk, hq, hkv, d, dv=None, dtype="float32", scale=1.0):
    dv = d if dv is None else dv
    return (
        randn(rng, (b, sq, hq, d), dtype, scale),
        randn(rng, (b, sk, hkv, d), dtype, scale),
        randn(rng, (b, sk, hkv, dv), dtype),
    )


def kernel_call(q, k, v, opts):
    """What the kernel-level tests hand a backend's kernel: the AttnCall of a dense attention
    of bshd ``q, k, v`` with the log-sum-exp wanted and ``opts`` (causal, window, softcap, scale,
    mask, and ``alibi=True`` for slopes 0.05 .. 0.4 over the query heads). Returns (call, slopes,
    kw), kw being ``opts`` without ``alibi``, for the reference's call."""
    from attnlib import _spec

    kw = dict(opts)
    hq = q.shape[2]
    slopes = np.linspace(0.05, 0.4, hq).astype(np.float32) if kw.pop("alibi", False) else None
    call = _spec.dense_call(q, k, v, scale=kw.get("scale"), mask=kw.get("mask"), layout="bshd",
                            need_lse=True, alibi_slopes=slopes, causal=kw.get("causal", False),
                            window=kw.get("window"), softcap=kw.get("softcap"))
    return call, slopes, kw


def unsupported_ok(backend, dtype) -> bool:
    """The contract lets a backend refuse only float64 (OpenCL devices without cl_khr_fp64), and
    only when its own ``unsupported_dtype_reason`` says so."""
    import attnlib

    dtype = np.dtype(dtype)
    if dtype != np.float64:
        return False
    return attnlib.get_backend(backend).unsupported_dtype_reason(dtype) is not None


def call_or_unsupported(backend, dtype, fn):
    """Run ``fn()``; if the backend refuses the dtype it must do so with UnsupportedError (and
    only where the contract allows it): then return None and the caller checks nothing more."""
    from attnlib.errors import UnsupportedError

    if unsupported_ok(backend, dtype):
        with pytest.raises(UnsupportedError):
            fn()
        return None
    return fn()


def check_dense(backend, q, k, v, *, layout="bshd", **kw):
    """attention() on ``backend`` against the oracle, by the accuracy rule; returns (out, lse)."""
    import attnlib

    dtype = np.asarray(q).dtype
    res = call_or_unsupported(
        backend,
        dtype,
        lambda: attnlib.attention(q, k, v, return_lse=True, backend=backend, layout=layout, **kw),
    )
    if res is None:
        return None
    out, lse = res
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray), "numpy in, numpy out"
    ref, ref_lse = reference_attention(q, k, v, layout=layout, **kw)
    assert out.shape == ref.shape, f"out shape {out.shape}, expected {ref.shape}"
    assert out.dtype == dtype, f"out dtype {out.dtype}, expected {dtype}"
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    assert lse.dtype == lse_dtype, f"lse dtype {lse.dtype}, expected {lse_dtype}"
    assert lse.shape == ref_lse.shape, f"lse shape {lse.shape}, expected {ref_lse.shape}"
    if dtype == np.float64:
        naive, naive_lse = None, None
    else:
        naive, naive_lse = naive_attention(q, k, v, layout=layout, **kw)
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)
    return out, lse


def paged_twin(rng, call: Any, page_size: int, spare: int = 3,
               table_dtype=np.int32) -> Any:
    """The paged twin of a kernel test's ``call`` (an AttnCall; batch s = sequence s, rows from
    k_row0): its keys and values moved into a page pool, the pages of every sequence drawn from
    a shuffled free list (scattered, in no order), ``spare`` pages nobody uses filled with NaN,
    table columns past a sequence's last page pointing at garbage (page -7, 10**6: clamped,
    never read)."""
    import dataclasses

    k, v = call.k, call.v
    hkv = k.shape[2]
    need = [-(-(int(r) + int(n)) // page_size) for r, n in zip(call.k_row0, call.k_len)]
    width = max(need) + 2
    n_pages = sum(need) + spare
    free = rng.permutation(n_pages)
    kp = np.full((n_pages, page_size, hkv, k.shape[3]), np.nan, k.dtype)
    vp = np.full((n_pages, page_size, hkv, v.shape[3]), np.nan, v.dtype)
    table = np.empty((call.n_seq, width), np.int64)
    table[:, 1::2], table[:, ::2] = -7, 10**6
    used = 0
    for s in range(call.n_seq):
        b = int(call.k_batch[s])
        pages = free[used:used + need[s]]
        used += need[s]
        table[s, :need[s]] = pages
        rows = np.arange(need[s] * page_size)
        src = np.minimum(rows, k.shape[1] - 1)
        kp[pages.repeat(page_size), np.tile(np.arange(page_size), need[s])] = k[b, src]
        vp[pages.repeat(page_size), np.tile(np.arange(page_size), need[s])] = v[b, src]
    return dataclasses.replace(call, k=kp, v=vp, k_batch=np.zeros(call.n_seq, np.int64),
                               block_table=table.astype(table_dtype), page_size=page_size)
