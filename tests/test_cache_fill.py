"""The opencl backend's cache_alloc zeroes every byte of the buffer it returns (base.py: "zeroed"),
for each storage dtype and for byte counts that are and are not a multiple of 4 (the zero fill
then runs over bytes, not 32-bit words), even where the device hands back memory a released
buffer left dirty."""

from __future__ import annotations

import numpy as np
import pytest

import attnlib
from attnlib.testing._helpers import DTYPES

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

from attnlib.backends.opencl import OpenCLBackend  # noqa: E402

pytestmark = pytest.mark.skipif(
    not OpenCLBackend.is_available(), reason="no OpenCL device (pyopencl[pocl] provides one)"
)

# (shape, dtype): odd sizes; the float16 / bfloat16 ones hold an odd number of elements, so
# their byte count is 2 mod 4
CASES = [
    ((2, 41, 3, 7), "float32"),
    ((3, 37, 1, 9), "float16"),
    ((3, 37, 2, 9), "float16"),
    ((3, 37, 1, 9), "bfloat16"),
    ((1, 29, 3, 5), "float64"),
]


@pytest.fixture(scope="module")
def be():
    return attnlib.get_backend("opencl")


def _dirty(be, nbytes: int) -> None:
    """Release a few buffers of ``nbytes`` filled with 0xFF first: a device that recycles
    released memory (PoCL does, through its host allocator) hands one of them back dirty."""
    for _ in range(3):
        junk = cla.empty(be.queue, (nbytes,), np.uint8)
        junk.fill(255)
        be.queue.finish()
        del junk


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{d}-{'x'.join(map(str, s))}"
                                                     for s, d in CASES])
def test_cache_alloc_zeroes_every_byte(be, shape, dtype):
    dtype = np.dtype(DTYPES.get(dtype, dtype))
    why = be.unsupported_dtype_reason(dtype)  # None, or why not (float64 without fp64)
    if why is not None:
        pytest.xfail(why)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    _dirty(be, nbytes)
    buf = be.cache_alloc(shape, dtype)
    assert buf.nbytes == nbytes
    host = np.ascontiguousarray(be.cache_read(buf))
    assert host.shape == shape and host.dtype == dtype
    raw = host.view(np.uint8).ravel()
    assert raw.size == nbytes
    bad = np.flatnonzero(raw)
    assert bad.size == 0, f"{bad.size} of {nbytes} bytes not zeroed, first at byte {bad[:1]}"
