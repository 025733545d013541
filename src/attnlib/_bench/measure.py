"""Timing and peak-memory measurement of one call.

Peak memory, by where the backend's buffers live:

* host (CPU backends, PoCL, PyTorch on CPU), Linux: the process's resident-set high-water mark
  (``VmHWM``), reset before the call by writing 5 to ``/proc/self/clear_refs``; the peak is
  ``VmHWM`` after the call minus ``VmRSS`` before it, after ``malloc_trim(0)``. This sees every
  allocator. ``tracemalloc`` sees numpy's and numba's arrays (checked: an 80 MB array from an
  ``@njit`` function shows) but not PyTorch's tensors nor PoCL's buffers (checked: 0 MB for an
  80 MB tensor, a few kB for a 40 MB softmax on PoCL). Memory the allocator kept from earlier
  calls and reuses does not show in the RSS delta, so it can under-count.
* elsewhere: ``tracemalloc`` (numpy's and numba's arrays only), said so in the output.
* CUDA (PyTorch): ``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated.
* an OpenCL GPU: not measured (OpenCL has no portable query), shown as "-".
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["time_once", "time_reps", "HostPeak", "host_peak_method", "median"]


def time_once(fn: Callable[[], Any], sync: Callable[[Any], None]) -> float:
    t0 = time.perf_counter()
    sync(fn())
    return time.perf_counter() - t0


def time_reps(fn: Callable[[], Any], sync: Callable[[Any], None], reps: int) -> list[float]:
    return [time_once(fn, sync) for _ in range(reps)]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(field + r":\s+(\d+)\s*kB", f.read())
    if m is None:
        raise OSError(f"{field} not in /proc/self/status")
    return int(m.group(1))


def _linux_hwm_works() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM")
        return True
    except OSError:
        return False


_HWM: bool | None = None


def host_peak_method() -> str:
    global _HWM
    if _HWM is None:
        _HWM = _linux_hwm_works()
    if _HWM:
        return "host RSS high-water delta (Linux VmHWM)"
    return "tracemalloc (numpy and numba arrays only)"


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HostPeak:
    """``with HostPeak() as p: call()`` then ``p.bytes`` is the peak extra host memory."""

    def __enter__(self) -> HostPeak:
        self.bytes: int | None = None
        self.method = host_peak_method()
        if _HWM:
            _malloc_trim()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _status_kib("VmRSS")
        else:
            import tracemalloc

            self._tm = not tracemalloc.is_tracing()
            if self._tm:
                tracemalloc.start()
            tracemalloc.reset_peak()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        if _HWM:
            self.bytes = max(0, _status_kib("VmHWM") - self._base) * 1024
        else:
            import tracemalloc

            self.bytes = max(0, tracemalloc.get_traced_memory()[1] - self._base)
            if self._tm:
                tracemalloc.stop()


class CudaPeak:
    """The same for PyTorch on CUDA."""

    method = "torch.cuda.max_memory_allocated delta"

    def __enter__(self) -> CudaPeak:
        import torch

        self.bytes: int | None = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.cuda.synchronize()
        self.bytes = max(0, torch.cuda.max_memory_allocated() - self._base)


class NoPeak:
    method = "not measured (device memory)"

    def __enter__(self) -> NoPeak:
        self.bytes = None
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def peak_meter(runner: Any) -> Any:
    """The right meter for where ``runner`` keeps its buffers."""
    if getattr(runner, "host_memory", False):
        return HostPeak()
    if getattr(runner, "name", "") == "torch" and getattr(runner, "cuda", False):
        return CudaPeak()
    return NoPeak()
