"""Shared pieces of the NVIDIA tensor-core kernel's harness: AttnCall builders for the cases the
kernel covers, a float64 reference of the AttnCall semantics, and the SPEC's accuracy rule."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np


def _import_kernel_module():
    """attnlib.backends.opencl._nvidia_mma; when the package's __init__ files fail to import
    (the tree is shared and others edit it), load it beneath stub packages instead."""
    try:
        return importlib.import_module("attnlib.backends.opencl._nvidia_mma")
    except Exception as exc:  # noqa: BLE001
        print(f"(attnlib import failed: {exc!r}; loading the kernel module alone)")
        for name in [n for n in sys.modules if n == "attnlib" or n.startswith("attnlib.")]:
            del sys.modules[name]
        src = Path(__file__).resolve().parents[2] / "src" / "attnlib"
        for name, path in (("attnlib", src), ("attnlib.backends", src / "backends"),
                           ("attnlib.backends.opencl", src / "backends" / "opencl")):
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            sys.modules[name] = mod
        return importlib.import_module("attnlib.backends.opencl._nvidia_mma")


nv = _import_kernel_module()

from attnlib import _spec  # noqa: E402 - after the kernel module's import above
from attnlib.testing.reference import reference_call, seq_call  # noqa: E402

AttnCall = nv.AttnCall

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def dense_call(q, k, v, *, causal=False, window=None, softcap=None, alibi=None, scale=None):
    """AttnCall of attention(q, k, v) in bshd, bottom-right causal alignment (the front door's
    own builder)."""
    return _spec.dense_call(q, k, v, scale=scale, causal=causal, window=window, mask=None,
                            softcap=softcap, alibi_slopes=alibi, layout="bshd", need_lse=True)


def reference(call: AttnCall, round_to=None):
    """out (Bq, Sq, Hq, Dv), lse (Bq, Hq, Sq) of ``call`` from the conformance oracle
    (attnlib.testing.reference.reference_call): float64, or with ``round_to`` the naive run with
    every intermediate rounded to that dtype (the SPEC's naive same-dtype computation)."""
    return reference_call(call, np.float64 if round_to is None else round_to)


def check(call: AttnCall, out, lse, *, rows_mask=None):
    """(ok, err, tol, lse_err) by the SPEC's rule: err <= 2 * naive_err + 1e-5."""
    ref, ref_lse = reference(call)
    naive, _ = reference(call, round_to=call.dtype)
    o = np.asarray(out).astype(np.float64)
    err = float(np.nanmax(np.abs(o - ref))) if o.size else 0.0
    same_nan = all(bool(np.array_equal(f(o), f(ref))) for f in (np.isnan, np.isposinf,
                                                                   np.isneginf))
    tol = 2 * float(np.nanmax(np.abs(naive - ref))) + 1e-5
    fin = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[fin] - ref_lse[fin]))) if fin.any() else 0.0
    lse_inf_ok = bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)))
    ok = err <= tol and same_nan and lse_inf_ok and lse_err <= 1e-2
    return ok, err, tol, lse_err


def cases(rng, dtype, head_dim):
    """(name, AttnCall) covering every path the kernel has, at odd sizes."""
    d = head_dim
    out = []
    q, k, v = (rand(rng, s, dtype) for s in ((2, 77, 4, d), (2, 77, 2, d), (2, 77, 2, d)))
    out.append(("dense gqa 77x77", dense_call(q, k, v)))
    # large scores: the running max keeps growing past the lazy-rescale threshold
    q, k, v = (rand(rng, s, dtype) for s in ((1, 45, 2, d), (1, 300, 2, d), (1, 300, 2, d)))
    k *= np.linspace(0.2, 3, 300, dtype=np.float32)[None, :, None, None].astype(dtype)
    out.append(("growing max, scale 1.0", dense_call(q, k, v, scale=1.0)))
    q, k, v = (rand(rng, s, dtype) for s in ((1, 70, 6, d), (1, 131, 2, d), (1, 131, 2, d)))
    out.append(("causal 70x131 gqa3", dense_call(q, k, v, causal=True)))
    q, k, v = (rand(rng, s, dtype) for s in ((1, 150, 2, d), (1, 150, 1, d), (1, 150, 1, d)))
    slopes = np.array([0.25, 0.0625], np.float32)
    out.append(("window+softcap+alibi 150", dense_call(q, k, v, window=(20, 5), softcap=3.0,
                                                       alibi=slopes)))
    q, k, v = (rand(rng, s, dtype) for s in ((1, 90, 2, d), (1, 33, 2, d), (1, 33, 2, d)))
    out.append(("causal Sq>Sk empty rows", dense_call(q, k, v, causal=True)))
    # varlen: three sequences packed in one batch row
    ql, kl = [5, 64, 33], [5, 90, 33]
    cq, ck = np.cumsum([0] + ql), np.cumsum([0] + kl)
    q, k, v = (rand(rng, s, dtype) for s in ((1, cq[-1], 4, d), (1, ck[-1], 4, d),
                                             (1, ck[-1], 4, d)))
    out.append(("varlen causal", seq_call(
        q, k, v, q_batch=[0] * 3, q_row0=cq[:-1], q_len=ql, k_batch=[0] * 3, k_row0=ck[:-1],
        k_len=kl, q_pos0=np.subtract(kl, ql), k_pos0=[0] * 3, causal=True)))
    # ring KV cache: slots 80.. then wrap, 90 keys held, NaN in the slots not held
    ring = 96
    q = rand(rng, (2, 3, 4, d), dtype)
    k, v = rand(rng, (2, ring, 2, d), dtype), rand(rng, (2, ring, 2, d), dtype)
    k[:, 74:80] = np.nan
    v[:, 74:80] = np.nan
    out.append(("ring cache decode", seq_call(
        q, k, v, q_batch=[0, 1], q_row0=[0, 0], q_len=[3, 3], k_batch=[1, 0], k_row0=[80, 80],
        k_len=[90, 90], q_pos0=[87 + 100, 87 + 100], k_pos0=[100, 100], causal=True, ring=ring)))
    # ring cache read before the wrap (the unchecked tile loader), negative scale (no folding)
    out.append(("ring no wrap, scale<0", seq_call(
        q, k, v, q_batch=[0, 1], q_row0=[0, 0], q_len=[3, 3], k_batch=[1, 0], k_row0=[2, 0],
        k_len=[70, 74], q_pos0=[67, 71], k_pos0=[0, 0], causal=True, ring=ring, scale=-0.2)))
    # inf/NaN in v (and NaN in k) at keys hidden from some rows of a block and seen by others:
    # only the rows that see them turn inf/NaN (SPEC: hidden keys contribute nothing)
    q, k, v = (rand(rng, s, dtype) for s in ((1, 100, 2, d), (1, 100, 1, d), (1, 100, 1, d)))
    k[:, 99] = np.nan
    v[:, 99] = np.nan
    out.append(("causal NaN in last key", dense_call(q, k, v, causal=True)))
    q, k, v = (rand(rng, s, dtype) for s in ((1, 80, 2, d), (1, 80, 1, d), (1, 80, 1, d)))
    v[:, 40, :, :3] = np.inf
    v[:, 41, :, 5] = -np.inf
    v[:, 50, :, 7] = np.nan
    out.append(("window inf/NaN in v", dense_call(q, k, v, window=(2, 1))))
    return out
