"""The cp.async K/V staging of kernels/attn_fwd.cl (taken on NVIDIA sm_80+ only). On devices
without cp.async (PoCL in CI) it depends on emulation: plain copies in cp.async's place
(``CP_ASYNC_EMULATE``), the tile walk, barriers and zero padding the H200 runs; on an NVIDIA
sm_80+ card the real cp.async build runs. Each case is compared with the float64 oracle by the
contract's accuracy rule, with the tensor-core kernels off (``use_mma=False``) so that the portable
kernel runs every case on the card too."""

from __future__ import annotations

import pytest

import attnlib
from attnlib.testing._helpers import check_dense, qkv, rng_for

pytest.importorskip("pyopencl")
if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI always has PoCL
    pytest.skip("no OpenCL device", allow_module_level=True)

CASES = [
    # name, dtype, (b, sq, sk, hq, hkv, d, dv), backend options, attention options
    ("decode split gqa", "float16", (2, 1, 301, 8, 2, 64, 64), {"num_splits": 5}, {}),
    ("decode one split", "bfloat16", (1, 2, 77, 4, 1, 12, 12), {"num_splits": 1},
     {"causal": True}),
    ("prefill causal", "float32", (1, 37, 53, 2, 2, 20, 8), {}, {"causal": True}),
    ("window softcap", "float16", (2, 9, 70, 4, 2, 16, 16), {"num_splits": 3},
     {"window": (11, 2), "softcap": 5.0}),
]


@pytest.fixture
def forced_cp_async(monkeypatch):
    from attnlib.backends.opencl import _switches

    monkeypatch.setattr(_switches, "CP_ASYNC_FORCE", True)
    attnlib.forget_plans()  # only this test's plans below


@pytest.mark.parametrize("name,dtype,shape,be_opts,opts", CASES, ids=[c[0] for c in CASES])
def test_cp_async_staging(forced_cp_async, name, dtype, shape, be_opts, opts):
    from attnlib.backends.opencl import _attention, _dispatch

    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = qkv(rng_for("cp.async", name), b, sq, sk, hq, hkv, d, dv, dtype)
    be = attnlib.get_backend("opencl", use_mma=False, **be_opts)
    check_dense(be, q, k, v, **opts)
    modes = {(cfg.CP_ASYNC, cfg.CP_ASYNC_EMULATE) for entry in _dispatch.plans.values()
             for plan in entry.plans.values() for cfg in plan.cfgs}
    emulated = not _attention._has_cp_async(be)  # the real cp.async on NVIDIA sm_80+
    assert modes == {(True, emulated)}, f"kernel built with (CP_ASYNC, CP_ASYNC_EMULATE) {modes}"
