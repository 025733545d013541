"""What the front doors share: the backend of a call, results back in the caller's layout, the
LSE of rows that see no key, and RoPE's settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _spec, registry
from .backends.base import AttnCall, Backend, RopeSpec

__all__ = [
    "RoPE",
    "check_rope",
    "device_contiguous",
    "empty_lse",
    "from_bshd",
    "pick_backend",
]


def pick_backend(backend: Any, arrays: Sequence[Any], dtype: np.dtype | None, *,
                 queue: Any = None) -> Backend:
    """The backend for a call. Device arrays under ``"auto"`` choose the backend that owns them;
    an explicit choice is never changed, and a mismatch is an error, not a silent copy.
    ``queue`` (a ``pyopencl.CommandQueue``, for the calls that take ``queue=``: KVCache,
    PagedKVCache, to_device) is short for ``backend=get_backend("opencl", queue=queue)``;
    beside it ``backend`` may only be the OpenCL backend on that same queue."""
    if queue is not None:
        backend = _queue_backend(backend, queue)
    choice = registry.current_choice(backend)
    device = [a for a in arrays if _spec.is_device_array(a)]
    if choice is None and device:
        choice = "opencl"
    be = registry.get_backend("auto" if choice is None else choice)
    _spec.check_backend_reads(device, be)
    if dtype is not None:
        _spec.check_backend_dtype(be, dtype)
    return be


def _queue_backend(backend: Any, queue: Any) -> Backend:
    """The OpenCL backend on ``queue``; ArgumentError for a ``queue`` that is not a
    ``pyopencl.CommandQueue`` or a ``backend`` that is not the OpenCL backend on it."""
    try:
        import pyopencl as cl
    except ImportError:
        cl = None
    _spec.check_queue(queue, None if cl is None else cl.CommandQueue)
    if backend is None:
        return registry.get_backend("opencl", queue=queue)
    be = registry.get_backend(backend)
    _spec.check_queue_backend(backend, be, queue)
    return be


def device_contiguous(x: Any, be: Backend) -> Any:
    """A C-contiguous copy of a strided 4-D device view, made on the device through the
    backend's strided ``cache_write`` copy (``buf[b, s] = src[b, s]``), never via the host."""
    b = x.shape[0]
    buf = be.cache_alloc(tuple(x.shape), np.dtype(x.dtype))
    if x.size:
        be.cache_write(buf, x, np.arange(b, dtype=np.int64), np.zeros(b, dtype=np.int64), None)
    return buf


def from_bshd(x: Any, layout: str, be: Backend) -> Any:
    """bshd -> the caller's layout, as a contiguous array (what PyTorch users expect)."""
    if layout == "bshd":
        return x
    xt = x.transpose((0, 2, 1, 3))
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(xt)
    return device_contiguous(xt, be)


def empty_lse(call: AttnCall, b: int, sq: int) -> np.ndarray:
    """The LSE ``(b, Hq, sq)`` of rows that see no key: -inf, or each head's sink."""
    acc = np.float64 if call.dtype == np.float64 else np.float32
    hq = call.q.shape[2]
    if call.options.sinks is None:
        return np.full((b, hq, sq), -np.inf, acc)
    return np.ascontiguousarray(np.broadcast_to(call.options.sinks.astype(acc)[None, :, None],
                                                (b, hq, sq)))


class RoPE:
    """Rotary position embedding settings for ``attention_with_kvcache`` and ``rope``.

    ``interleaved=False`` rotates halves (GPT-NeoX, Llama); ``True`` rotates adjacent pairs
    (GPT-J). Only the first ``rotary_dim`` dims rotate (default: all; must be even).
    """

    def __init__(self, theta: float = 10000.0, interleaved: bool = False,
                 rotary_dim: int | None = None) -> None:
        self.theta = _spec.check_real(theta, "theta", positive=True)
        self.interleaved = _spec.check_bool(interleaved, "interleaved")
        self.rotary_dim = _spec.check_rotary_dim(rotary_dim)

    def __repr__(self) -> str:
        return (f"RoPE(theta={self.theta}, interleaved={self.interleaved}, "
                f"rotary_dim={self.rotary_dim})")

    def spec(self, head_dim: int) -> RopeSpec:
        return RopeSpec(self.theta, self.interleaved,
                        _spec.check_rotary_fits(self.rotary_dim, head_dim))


def check_rope(rope_arg: Any, head_dim: int) -> RopeSpec | None:
    """The RopeSpec of ``rope=`` (None or an attnlib.RoPE) for ``head_dim``."""
    _spec.check_rope_type(rope_arg, RoPE)
    return None if rope_arg is None else rope_arg.spec(head_dim)
