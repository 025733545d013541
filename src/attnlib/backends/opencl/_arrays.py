"""Host and device arrays as the kernels see them: a buffer, an element offset, element strides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

#: storage kind macro (STORE_KIND / IN_KIND) of each dtype the contract allows
STORE_KINDS = {
    np.dtype(np.float32): 0,
    np.dtype(np.float16): 1,
    np.dtype(ml_dtypes.bfloat16): 2,
    np.dtype(np.float64): 3,
}


def store_kind(dtype: Any) -> int:
    return STORE_KINDS[np.dtype(dtype)]


def acc_dtype(dtype: Any) -> np.dtype:
    """float64 math for float64 storage, float32 for everything else."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


_ARRAY_TYPE: list = []  # pyopencl.array.Array once imported (the check runs several times a call)


def is_cl_array(x: Any) -> bool:
    if not _ARRAY_TYPE:
        try:
            import pyopencl.array as cla
        except ImportError:  # pragma: no cover - the backend is unavailable then
            return False
        _ARRAY_TYPE.append(cla.Array)
    return isinstance(x, _ARRAY_TYPE[0])


@dataclass
class DevView:
    """``x[i0, i1, ...]`` lives at ``buf[offset + sum(i * s for s in strides)]`` (elements)."""

    buf: Any
    offset: int
    strides: tuple[int, ...]
    keep: Any = None  # what must stay alive while the kernel may run


def _host_span(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """A 1-D array holding x's elements plus x's element strides into it, copying only when x's
    memory is not one dense block with non-negative strides (a transposed view is not copied)."""
    item = x.itemsize
    if x.flags.c_contiguous:
        return x.reshape(-1), np.empty(x.shape, np.uint8).strides
    if all(s > 0 and s % item == 0 for s, n in zip(x.strides, x.shape) if n > 1):
        flat = np.ravel(x, order="K")
        if np.shares_memory(flat, x):
            return flat, tuple(s // item if n > 1 else 0 for s, n in zip(x.strides, x.shape))
    x = np.ascontiguousarray(x)
    return x.reshape(-1), np.empty(x.shape, np.uint8).strides


def host_strides(x: np.ndarray) -> tuple[int, ...]:
    """The element strides :func:`upload` gives ``x`` (without uploading it)."""
    return _host_span(x)[1]


def upload(ctx: Any, x: np.ndarray) -> DevView:
    """Copy a numpy array to a new read-only device buffer (its exact element span)."""
    import pyopencl as cl

    x = np.asarray(x)
    if x.size == 0:
        return DevView(dummy_buffer(ctx), 0, (0,) * x.ndim)
    flat, strides = _host_span(x)
    if flat.dtype == ml_dtypes.bfloat16:
        flat = flat.view(np.uint16)
    mf = cl.mem_flags
    buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(flat))
    return DevView(buf, 0, strides, buf)


def device_view(ctx: Any, x: Any) -> DevView:
    """A view of a pyopencl Array in place (no copy), or of a numpy array uploaded."""
    if is_cl_array(x):
        if x.size == 0 or x.base_data is None:
            return DevView(dummy_buffer(ctx), 0, (0,) * x.ndim)
        item = x.dtype.itemsize
        return DevView(x.base_data, x.offset // item, tuple(s // item for s in x.strides), x)
    return upload(ctx, x)


_dummies: dict[int, Any] = {}


def dummy_buffer(ctx: Any) -> Any:
    """A small zeroed buffer standing in for an absent optional argument (never read)."""
    import pyopencl as cl

    buf = _dummies.get(ctx.int_ptr)
    if buf is None:
        mf = cl.mem_flags
        buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.zeros(16, np.float64))
        _dummies[ctx.int_ptr] = buf
    return buf
