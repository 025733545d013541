"""The opencl backend within small device limits. 32 KiB of __local memory (many GPUs, Mesa's
rusticl): every head dim up to 256 runs, in every dtype, on prefill, decode and split-KV shapes;
below what the smallest tiling needs, the refusal names both numbers. A small work-group limit: the
tiling stays within it. The device's own limits are replaced by smaller ones through the backend's
DeviceFacts, so this runs on any OpenCL device (PoCL in CI)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import attnlib
from attnlib.testing._helpers import check_dense, qkv, rng_for

pytest.importorskip("pyopencl")

from attnlib.backends.opencl import OpenCLBackend, _attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    not OpenCLBackend.is_available(), reason="no OpenCL device (pyopencl[pocl] provides one)"
)

KIB32 = 32 * 1024


def budget_backend(limit: int, **options) -> OpenCLBackend:
    """A fresh backend on the default device that may use at most ``limit`` bytes of __local
    memory per work-group (a fresh instance: no plan of another budget is reused)."""
    be = OpenCLBackend(**options)
    be.facts = dataclasses.replace(be.facts, local_budget=min(be.facts.local_budget, limit))
    return be


@pytest.fixture(scope="module")
def be32():
    return budget_backend(KIB32)


def dtypes(be):
    """float32 and float16 everywhere; float64 only where the device has it (elsewhere the
    conformance suite checks the UnsupportedError)."""
    return ["float32", "float16"] + (["float64"] if be.facts.fp64 else [])


@pytest.mark.parametrize("d,dv", [(256, 256), (255, 256), (256, 129), (200, 256)])
@pytest.mark.parametrize("rows", [1, 4, 19])  # decode tilings (<= 8 packed rows) and prefill
def test_every_dtype_fits_32kib(be32, d, dv, rows):
    for dtype in dtypes(be32):
        acc = 8 if dtype == "float64" else 4
        kv = 2 if dtype == "float16" else acc
        tiles = _attention.choose_tiles(be32.facts, 2 * rows, d, dv, acc, kv, None)
        assert _attention.local_bytes(tiles[0], tiles[1], tiles[3], d, dv, acc, kv) <= KIB32
        rng = rng_for("32k", d, dv, rows, dtype)
        q, k, v = qkv(rng, 1, rows, 37, 4, 2, d, dv, dtype=dtype)
        check_dense(be32, q, k, v, causal=True, alibi_slopes=np.array(
            [0.05, 0.1, 0.2, 0.3], np.float32))


def test_split_kv_decode_fits_32kib():
    be = budget_backend(KIB32, num_splits=3)
    rng = rng_for("32k split")
    for dtype in dtypes(be):
        q, k, v = qkv(rng, 2, 1, 301, 4, 1, 256, dtype=dtype)
        check_dense(be, q, k, v, causal=True, softcap=5.0)


def test_too_little_local_memory_names_both_numbers():
    limit = 4096
    be = budget_backend(limit)
    smallest = _attention.SMALL_TILES[-1]
    need = _attention.local_bytes(smallest[0], smallest[1], smallest[3], 256, 256, 4, 4)
    assert need > limit
    rng = rng_for("32k refusal")
    q, k, v = qkv(rng, 1, 9, 21, 2, 1, 256)
    with pytest.raises(attnlib.UnsupportedError) as info:
        attnlib.attention(q, k, v, backend=be)
    msg = str(info.value)
    assert f"need {need} bytes" in msg and f"allows {limit}" in msg and str(smallest) in msg


@pytest.mark.parametrize("limit", [16, 64])
def test_tiles_within_the_work_group_limit(limit):
    """A GPU that allows fewer work-items per work-group (CL_DEVICE_MAX_WORK_GROUP_SIZE) than the
    default tilings use gets a tiling within its limit, for decode and prefill shapes."""
    facts = dataclasses.replace(OpenCLBackend().facts, is_cpu=False, max_work_group=limit)
    for rows in (1, 8, 300):
        for d in (64, 128, 256):
            for acc, kv in ((4, 2), (4, 4), (8, 8)):
                bm, bn, tm, tn = _attention.choose_tiles(facts, rows, d, d, acc, kv, None)
                assert tm * tn <= limit
                assert _attention.local_bytes(bm, bn, tn, d, d, acc, kv) <= facts.local_budget


def test_softmax_and_merge_within_a_small_work_group_limit():
    """softmax.cl and merge.cl take work-groups within the device's limit (here 16 work-items,
    below their usual 64-256) and still match the reference."""
    be = OpenCLBackend()
    be.facts = dataclasses.replace(be.facts, max_work_group=16)
    launched = []
    real_launch = be.launch

    def launch(ctx, queue, filename, cfg, kernel, gsize, lsize, args, **kw):
        launched.append((filename, lsize[0]))
        return real_launch(ctx, queue, filename, cfg, kernel, gsize, lsize, args, **kw)

    be.launch = launch
    rng = rng_for("small work-groups")
    x = rng.standard_normal((3, 601)).astype(np.float32) * 4
    np.testing.assert_allclose(attnlib.softmax(x, backend=be),
                               attnlib.softmax(x.astype(np.float64), backend="numpy"),
                               atol=1e-6)
    outs = [rng.standard_normal((1, 5, 2, 40)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((1, 2, 5)).astype(np.float32) for _ in range(3)]
    out, lse = attnlib.merge_states(outs, lses, backend=be)
    ref, ref_lse = attnlib.merge_states([o.astype(np.float64) for o in outs],
                                        [v.astype(np.float64) for v in lses], backend="numpy")
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    assert {f for f, _ in launched} == {"softmax.cl", "merge.cl"}
    assert all(size <= 16 for _, size in launched)
