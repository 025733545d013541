"""The NVIDIA tensor-core kernel (kernels/attn_fwd_mma.cl) on any OpenCL device, with every
warp-level PTX instruction (mma.sync, ldmatrix, cp.async) emulated in plain OpenCL C
(``USE_PTX=0``): the fragment layouts, tile walk, masking and online softmax it runs on the H200
are checked here against the float64 oracle by the SPEC's accuracy rule, on PoCL in CI."""

from __future__ import annotations

import numpy as np
import pytest

import attnlib
from attnlib import _spec
from attnlib.testing._helpers import qkv, rng_for
from attnlib.testing.reference import naive_attention, reference_attention
from attnlib.testing.tolerance import assert_rule

pytest.importorskip("pyopencl")
if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI always has PoCL
    pytest.skip("no OpenCL device", allow_module_level=True)

CASES = [
    # name, dtype, (b, sq, sk, hq, hkv, d), options
    ("gqa causal Sq<Sk", "float16", (1, 70, 131, 6, 2, 64), {"causal": True}),
    ("window softcap alibi", "bfloat16", (2, 45, 77, 2, 1, 128),
     {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("causal Sq>Sk empty rows", "float16", (1, 90, 37, 2, 2, 64), {"causal": True}),
]


@pytest.mark.parametrize("name,dtype,shape,opts", CASES, ids=[c[0] for c in CASES])
def test_mma_kernel_emulated(name, dtype, shape, opts):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = qkv(rng_for("mma", name), b, sq, sk, hq, hkv, d, dtype=dtype)
    if name.startswith("gqa"):
        v[0, sk - 1, 0, 3] = np.nan  # hidden from the first rows by causal: must not leak
    kw = dict(opts)
    slopes = np.linspace(0.05, 0.4, hq).astype(np.float32) if kw.pop("alibi", False) else None
    call = _spec.dense_call(q, k, v, scale=None, mask=None, layout="bshd", need_lse=True,
                            alibi_slopes=slopes, causal=kw.get("causal", False),
                            window=kw.get("window"), softcap=kw.get("softcap"))
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=False)
    ref, ref_lse = reference_attention(q, k, v, alibi_slopes=slopes, **kw)
    naive, _ = naive_attention(q, k, v, alibi_slopes=slopes, **kw)
    assert_rule(out, ref, naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-2)
