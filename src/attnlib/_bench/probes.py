"""Measured ceilings per device: a quick copy probe (bandwidth) and an FMA probe (compute).

* CPU: ``numpy.copyto`` of a 64 MiB float32 array (read + write counted; one thread, and one
  chunk per core in threads) and a float32 matmul through numpy's BLAS (one and all threads;
  PyTorch's too when it runs), ``2 n^3`` FLOPs; the best of each.
* OpenCL: a float4 copy kernel (read + write) and a float4 FMA kernel (8 independent chains per
  work-item, 2 FLOPs per lane per FMA), on the backend's own queue when it exposes one.
* CUDA (PyTorch): a tensor copy and a float32 matmul with TF32 off.

Each probe is calibrated to run ~20-50 ms and the best of a few runs is kept: a ceiling is what
the device reached, never a datasheet number. These are float32 roofs. A probe can come out
below what a benchmark then reaches (a busy machine, a compiler that vectorises the probe
worse than the kernel): the report raises such a roof to the best rate achieved on that device
(:func:`attnlib._bench.report.annotate`), so that a roof always bounds what it roofs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import _config

__all__ = ["Ceiling", "cpu_ceiling", "opencl_ceiling", "cuda_ceiling", "opencl_queue"]


@dataclass
class Ceiling:
    device: str  # human label
    byte_per_s: float  # measured copy bandwidth (read + write)
    flop_per_s: float  # measured float32 FMA rate
    method: str
    raised: str = ""  # what the report raised above the probe, and the probe's own figure

    def as_dict(self) -> dict:
        return asdict(self)


def _best(fn: Callable[[], Any], sync: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _calibrated(make: Callable[[int], tuple[Callable, Callable, float]], start: int,
                grow: int, target_s: float, reps: int = 5, limit: int = 1 << 40) -> float:
    """Grow the size until one run takes ``target_s``, then return work / best time."""
    n = start
    while True:
        fn, sync, work = make(n)
        fn()
        sync()  # warm-up (and page-in)
        t = _best(fn, sync, 1)
        if t >= target_s or n * grow > limit:
            return work / _best(fn, sync, reps)
        n *= grow


def cpu_ceiling(with_torch: bool = False) -> Ceiling:
    n = 16 << 20  # 64 MiB of float32: well past any last-level cache
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    t = _best(lambda: np.copyto(dst, src), lambda: None, 7)
    bw = 2 * src.nbytes / t
    # one thread rarely saturates the memory bus: copy in one chunk per core as well (numpy
    # releases the GIL while it copies) and keep the better of the two
    workers = os.cpu_count() or 1
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, n, workers + 1).astype(np.int64)
        chunks = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        with ThreadPoolExecutor(workers) as pool:
            def par() -> None:
                list(pool.map(lambda c: np.copyto(c[0], c[1]), chunks))

            bw = max(bw, 2 * src.nbytes / _best(par, lambda: None, 7))

    def make(m: int) -> tuple[Callable, Callable, float]:
        a = np.random.default_rng(1).random((m, m), dtype=np.float32)
        b = np.random.default_rng(2).random((m, m), dtype=np.float32)
        return (lambda: a @ b), (lambda: None), 2.0 * m**3

    flops = _calibrated(make, 256, 2, 0.03, reps=3, limit=4096)
    method = "numpy.copyto 64 MiB, 1 and all threads / float32 matmul (numpy BLAS"
    try:
        # on a busy machine a multi-threaded BLAS can stall at its barriers: one thread's rate
        # is a lower bound of the roof
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, user_api="blas"):
            flops = max(flops, _calibrated(make, 256, 2, 0.03, reps=3, limit=4096))
        method += " 1 and all threads"
    except ImportError:
        pass
    if with_torch:
        # PyTorch's own BLAS can beat numpy's: the roof is the best matmul seen on this CPU
        try:
            import torch

            def make_t(m: int) -> tuple[Callable, Callable, float]:
                a, b = torch.rand(m, m), torch.rand(m, m)
                return (lambda: a @ b), (lambda: None), 2.0 * m**3

            flops = max(flops, _calibrated(make_t, 256, 2, 0.03, reps=3, limit=4096))
            method += ", torch"
        except Exception:
            pass
    return Ceiling("CPU", bw, flops, method + ", the best)")


# ---- OpenCL -----------------------------------------------------------------------------------
_CL_SOURCE = """
__kernel void copy4(__global const float4 *src, __global float4 *dst) {
    size_t i = get_global_id(0);
    dst[i] = src[i];
}
__kernel void fma4(__global float4 *out, const float m) {
    /* 8 independent chains hide FMA latency; values stay bounded since |m| < 1. a * m + c
       under -cl-mad-enable, not fma(): PoCL calls a library routine for fma() (6x slower) */
    float4 c = (float4)(0.5f);
    float4 a0 = (float4)(get_global_id(0) * 1e-7f), a1 = a0 + 0.1f, a2 = a0 + 0.2f,
           a3 = a0 + 0.3f, a4 = a0 + 0.4f, a5 = a0 + 0.5f, a6 = a0 + 0.6f, a7 = a0 + 0.7f;
    for (int i = 0; i < ITERS; ++i) {
        a0 = a0 * m + c; a1 = a1 * m + c; a2 = a2 * m + c; a3 = a3 * m + c;
        a4 = a4 * m + c; a5 = a5 * m + c; a6 = a6 * m + c; a7 = a7 * m + c;
    }
    out[get_global_id(0)] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
"""
ITERS = 256  # FMA loop trips per work-item; -D ITERS in the kernel
_FLOP_PER_ITEM = ITERS * 8 * 4 * 2  # chains x lanes x 2 FLOPs per FMA


def _is_simulator(dev: Any) -> bool:
    return "oclgrind" in dev.platform.name.lower()


def opencl_queue(backend: Any = None) -> Any:
    """The backend's own command queue when it exposes one, else a queue on the device the contract
    picks (PYOPENCL_CTX, else the first non-simulator GPU, else first non-simulator device)."""
    import pyopencl as cl

    for attr in ("queue", "_queue", "default_queue"):
        q = getattr(backend, attr, None)
        if isinstance(q, cl.CommandQueue):
            return q
    for attr in ("context", "ctx", "_ctx", "_context"):
        ctx = getattr(backend, attr, None)
        if isinstance(ctx, cl.Context):
            return cl.CommandQueue(ctx)
    if _config.pyopencl_ctx():
        return cl.CommandQueue(cl.create_some_context(interactive=False))
    devices = []
    for p in cl.get_platforms():
        try:
            devices += [d for d in p.get_devices() if not _is_simulator(d)]
        except cl.Error:
            continue
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    dev = (gpus or devices)[0]
    return cl.CommandQueue(cl.Context([dev]))


def opencl_ceiling(backend: Any = None) -> Ceiling:
    import pyopencl as cl

    queue = opencl_queue(backend)
    ctx, dev = queue.context, queue.device
    if _is_simulator(dev):  # Oclgrind interprets every work-item: a probe would take hours
        raise RuntimeError(f"{dev.name.strip()} is a simulator; no ceiling measured")
    prg = cl.Program(ctx, _CL_SOURCE).build(options=[f"-DITERS={ITERS}", "-cl-mad-enable"])
    copy4, fma4 = cl.Kernel(prg, "copy4"), cl.Kernel(prg, "fma4")
    is_gpu = bool(dev.type & cl.device_type.GPU)
    nbytes = min(256 << 20 if is_gpu else 64 << 20, dev.max_mem_alloc_size // 4)
    nbytes -= nbytes % 16
    mf = cl.mem_flags
    src = cl.Buffer(ctx, mf.READ_WRITE, nbytes)
    dst = cl.Buffer(ctx, mf.READ_WRITE, nbytes)
    cl.enqueue_fill_buffer(queue, src, np.float32(1.0), 0, nbytes)
    t = _best(lambda: copy4(queue, (nbytes // 16,), None, src, dst), queue.finish, 7)
    bw = 2 * nbytes / t
    cu = max(1, dev.max_compute_units)
    out_bufs: dict[int, Any] = {}

    def make(items: int) -> tuple[Callable, Callable, float]:
        out = out_bufs.setdefault(items, cl.Buffer(ctx, mf.WRITE_ONLY, items * 16))
        fn = lambda: fma4(queue, (items,), None, out, np.float32(0.999))  # noqa: E731
        return fn, queue.finish, float(items) * _FLOP_PER_ITEM

    flops = _calibrated(make, cu * 64, 4, 0.02, reps=5, limit=1 << 26)
    kind = "GPU" if is_gpu else "CPU"
    from .runners import short_device_name

    return Ceiling(f"{short_device_name(dev.name)} [OpenCL {kind}]", bw, flops,
                   f"OpenCL float4 copy {nbytes >> 20} MiB / float4 FMA kernel")


# ---- CUDA through PyTorch -------------------------------------------------------------------
def cuda_ceiling() -> Ceiling:
    import torch

    dev = torch.device("cuda")
    src = torch.rand(64 << 20, device=dev)  # 256 MiB
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize
    t = _best(lambda: dst.copy_(src), sync, 10)
    bw = 2 * src.numel() * 4 / t
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def make(m: int) -> tuple[Callable, Callable, float]:
            a = torch.rand(m, m, device=dev)
            b = torch.rand(m, m, device=dev)
            return (lambda: a @ b), sync, 2.0 * m**3

        flops = _calibrated(make, 1024, 2, 0.02, reps=5, limit=16384)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    name = torch.cuda.get_device_name(0)
    return Ceiling(f"{name} [CUDA]", bw, flops, "torch copy 256 MiB / float32 matmul (TF32 off)")
