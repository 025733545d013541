"""The attn_fwd.cl variants the GPU tilings select (KV_BOTH, TREE_MAX, STAGE), forced on
whatever OpenCL device the tests run on (PoCL in CI), against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnlib
from attnlib.testing._helpers import check_dense, qkv, rng_for

pytest.importorskip("pyopencl")
from attnlib.backends.opencl import _attention  # noqa: E402


@pytest.fixture
def forced(monkeypatch):
    def force(**fields):
        orig = _attention.FwdConfig
        monkeypatch.setattr(_attention, "FwdConfig", lambda **kw: orig(**{**kw, **fields}))
    return force


@pytest.mark.parametrize("tiles,fields,dtype", [
    ((4, 64, 1, 64), {"KV_BOTH": True, "TREE_MAX": True}, "float16"),
    ((4, 32, 2, 16), {"KV_BOTH": True, "STAGE": 16}, "bfloat16"),
    ((16, 32, 4, 8), {"KV_BOTH": True}, "float32"),
    ((8, 64, 2, 32), {"KV_BOTH": True, "TREE_MAX": True, "STAGE": 32}, "float32"),
])
def test_forced_kernel_variants(forced, tiles, fields, dtype):
    forced(**fields, PREFETCH=False)
    rng = rng_for("variants", tiles, dtype)
    for splits in (None, 3):
        be = attnlib.get_backend("opencl", tiles=tiles, num_splits=splits)
        # GQA 4:1 decode-shaped and prefill-shaped calls; D=32, Dv=48 (vector paths)
        q, k, v = qkv(rng, 2, 1, 150, 8, 2, 32, 48, dtype)
        check_dense(be, q, k, v, causal=True)
        q, k, v = qkv(rng, 1, 37, 70, 4, 2, 32, 32, dtype)
        check_dense(be, q, k, v, causal=True, window=(20, None), softcap=4.0)
        check_dense(be, q, k, v, mask=rng.standard_normal((1, 4, 37, 70)).astype(np.float32))
