"""The OpenCL backend: portable OpenCL C 1.2 kernels (kernels/*.cl) driven by pyopencl.

It runs on any OpenCL device (NVIDIA, AMD, Intel, PoCL on CPUs) and takes numpy arrays (numpy
out) or ``pyopencl.array.Array`` (Array out, no host copy, enqueued on the Array's queue).

Options (``attnlib.get_backend("opencl", **options)``):

* ``queue``: a ``pyopencl.CommandQueue`` to run on (its context and device are used);
* ``context``: a ``pyopencl.Context`` (a queue on its first device is made);
* ``tiles``: ``(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N)`` forcing the forward tiling;
* ``num_splits``: force the number of key splits (flash-decoding) per query block;
* ``use_mma``: on NVIDIA sm_80+ devices run float16/bfloat16/float32 prefill on tensor cores
  (``_nvidia_mma``, default True), and float16/bfloat16 calls of at most 16 packed query rows
  per kv head (decoding, GQA heads packed) on the tensor-core split-KV decode kernel
  (``_nvidia_decode``); float32 decoding keeps the portable split-KV kernel.
  float32 there runs "3xTF32": each operand split as hi + lo in tf32, three tf32 ``mma.sync``
  per product, float32 accumulation (float32-class accuracy by the contract's rule);
  ``use_mma=False`` keeps float32 (and float16/bfloat16) on the portable FMA kernels.

Raises :class:`~attnlib.errors.UnsupportedError` (through ``unsupported_dtype_reason``) for
float64 on a device without ``cl_khr_fp64`` and :class:`~attnlib.errors.KernelBuildError` when a
kernel fails to compile (the message holds the options and the build log).

How a call runs (one path for the first call and every repeat)::

    OpenCLBackend.attention -> _dispatch.attention
        -> the entry of the call's description (_dispatch.plan_key: shapes, strides, options,
           the backend's options, the _switches) in the one plan cache
        -> per largest packed row count: the first family of _dispatch.FAMILIES whose
           applicable(be, call, max_rows) is None, and its plan (Family.plan)
        -> per per-sequence values: the plan's step (tables, work-group counts, splits)
        -> Plan.run: pooled outputs, Plan.enqueue (the call's buffers bound to named argument
           slots, _family.ArgList) -> _runtime.launch (one kernel-object cache, programs from
           _runtime.program, the one program cache)
    OpenCLBackend.attention_parts (the shared-prompt cascade) -> _dispatch.attention_parts:
        the family's plan in its ``parts`` mode (float32 partial states kept), one merge.cl

:func:`why` shows the families the dispatch tried for a call and why each faster one did not
take it. Every plan cache of the library (these and the front door's) empties with
``attnlib.forget_plans()``.

Modules: ``_family`` (the kernel-family interface: ``Family``, ``Plan``, ``ArgList``),
``_dispatch`` (the ordered family list, the plan cache, :func:`why`), ``_attention`` (the
portable family, attn_fwd.cl and merge.cl), ``_nvidia_mma`` (the tensor-core prefill families,
mma.sync and wgmma), ``_nvidia_wgmma`` (the wgmma program, built through its PTX),
``_nvidia_decode`` (the tensor-core decode family), ``_nvidia_tables`` (what the tensor-core
families take of a call: device tables, buffers, scalars), ``_switches`` (process-wide
switches, part of every plan key), ``_ops`` (softmax, merge_states, rope, the KV-cache writes
and ``cache_append``), ``_runtime`` (devices, kernel sources, the program and kernel-object
caches, launches), ``_pool`` (pooled outputs and scratch, device tables), ``_arrays`` (array
views and dtype kinds).

Adding a kernel family (e.g. a paged KV cache's attention): a ``Family`` subclass with its
``applicable`` (None or the reason it cannot run a call) and ``plan``, a ``Plan`` subclass
(everything the call's description fixes: kernel options, the key of the kernel object, the
named argument list) with ``step`` (what the per-sequence values fix) and ``enqueue`` (the
call's buffers set, ``_runtime.launch``), and its place in ``_dispatch.FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ... import _spec, registry
from ..base import AttnCall, Backend, RopeSpec
from . import _dispatch, _ops, _runtime
from ._arrays import is_cl_array
from ._runtime import (
    KernelConfig,
    choose_context,
    device_type_words,
    has_gpu,
    is_simulator,
)

__all__ = ["OpenCLBackend", "why"]


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    is_cpu: bool
    compute_units: int
    local_mem: int
    fp64: bool
    simulator: bool = False
    local_budget: int = 0  # __local bytes one work-group may use (see _local_budget)
    max_work_group: int = 1 << 30  # CL_DEVICE_MAX_WORK_GROUP_SIZE: work-items of one work-group


def _local_budget(device: Any) -> int:
    """NVIDIA's OpenCL reports 48 KiB of local memory, yet static __local arrays up to about
    200 KiB build and run on Hopper: allow 160 KiB from sm_90 on."""
    reported = int(device.local_mem_size)
    try:
        import pyopencl as cl

        if "cl_nv_device_attribute_query" in device.extensions:
            if device.get_info(cl.device_info.COMPUTE_CAPABILITY_MAJOR_NV) >= 9:
                return max(reported, 160 * 1024)
    except Exception:
        pass
    return reported


def _facts(device: Any) -> DeviceFacts:
    import pyopencl as cl

    return DeviceFacts(
        name=device.name.strip(),
        is_cpu=bool(device.type & cl.device_type.CPU) and not device.type & cl.device_type.GPU,
        compute_units=int(device.max_compute_units),
        local_mem=int(device.local_mem_size),
        fp64="cl_khr_fp64" in device.extensions,
        simulator=is_simulator(device),
        local_budget=_local_budget(device),
        max_work_group=int(device.max_work_group_size),
    )


_OOM_CODES = ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY",
              "INVALID_BUFFER_SIZE")


class device_errors:
    """Device allocation failures become MemoryError (contract §6), never a raw driver error.
    (A class, not a generator context manager: it wraps every call, and a class costs less.)"""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        if exc is None:
            return False
        import pyopencl as cl

        if isinstance(exc, cl.Error) and (isinstance(exc, cl.MemoryError)
                                          or any(c in str(exc) for c in _OOM_CODES)):
            raise MemoryError(f"opencl: {self.what} does not fit the device: {exc}") from exc
        return False


@_spec.keywords_checked
def why(q: Any, k: Any, v: Any, *, scale: float | None = None, causal: bool | str = False,
        window: Any = None, mask: Any = None, softcap: float | None = None,
        alibi_slopes: Any = None, sinks: Any = None, layout: str = "bshd",
        backend: Any = None) -> list[tuple[str, str | None]]:
    """The kernel families the OpenCL backend tries for ``attnlib.attention(q, k, v, ...)``
    with these options, in its order, each with the reason it does not run the call, up to the
    one that does (reason None): a debug aid, as PyTorch's SDPA reports why it skipped a
    backend. The arguments are checked as ``attention`` checks them; nothing runs.
    ``backend``: an OpenCL backend (instance or name; default ``get_backend("opencl")``).

    Returns a list of ``(family name, reason or None)``.
    """
    be = registry.get_backend("opencl" if backend is None else backend)
    call = _spec.dense_call(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                            softcap=softcap, alibi_slopes=alibi_slopes, layout=layout,
                            need_lse=False, sinks=sinks)
    if not isinstance(be, OpenCLBackend):
        return [(be.name, "not the OpenCL backend (it has no kernel families)")]
    return _dispatch.why(be, call)


class OpenCLBackend(Backend):
    name: ClassVar[str] = "opencl"
    description: ClassVar[str] = "OpenCL C 1.2 kernels via pyopencl (any GPU, PoCL on CPUs)"
    _available: ClassVar[bool | None] = None
    _gpu: ClassVar[bool | None] = None

    def __init__(
        self,
        *,
        queue: Any = None,
        context: Any = None,
        tiles: Sequence[int] | None = None,
        num_splits: int | None = None,
        use_mma: bool = True,
    ) -> None:
        import pyopencl as cl

        if queue is None:
            context = context if context is not None else choose_context()
            queue = cl.CommandQueue(context)
        self.queue = queue
        self.context = queue.context
        self.device = queue.device
        self.facts = _facts(self.device)
        self.tiles = tuple(int(t) for t in tiles) if tiles is not None else None
        self.num_splits = num_splits
        self.use_mma = bool(use_mma)

    # ---- availability -------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        if cls._available is None:
            try:
                from ._runtime import list_devices

                cls._available = any(not is_simulator(d) for d in list_devices())
            except Exception:
                cls._available = False
        return cls._available

    @classmethod
    def auto_priority(cls) -> int:
        # first when a GPU is present; after numba and numpy (10) on CPU-only OpenCL (PoCL)
        if cls._gpu is None:
            cls._gpu = has_gpu()
        return 100 if cls._gpu else 5

    def info(self) -> dict:
        """The implementation (platform name and version) and device this backend runs on, its
        type in words ("CPU", "GPU"), OpenCL version, driver and the limits the tiling uses."""
        import pyopencl as cl

        d = self.device
        return {
            "pyopencl": cl.VERSION_TEXT,
            "platform": d.platform.name.strip(),
            "platform_version": d.platform.version.strip(),
            "device": self.facts.name,
            "type": device_type_words(d.type),
            "opencl": d.version.strip(),
            "driver": d.driver_version.strip(),
            "compute_units": self.facts.compute_units,
            "local_mem_bytes": self.facts.local_mem,
            "fp64": self.facts.fp64,
        }

    # ---- arrays -------------------------------------------------------------------------------
    def owns(self, x: Any) -> bool:
        return is_cl_array(x)

    def to_device(self, x: np.ndarray) -> Any:
        import pyopencl.array as cla

        if is_cl_array(x):
            return x
        return cla.to_device(self.queue, np.ascontiguousarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.get() if is_cl_array(x) else np.asarray(x)

    def unsupported_dtype_reason(self, dtype: np.dtype) -> str | None:
        if np.dtype(dtype) == np.float64 and not self.facts.fp64:
            return (
                f"opencl: float64 needs cl_khr_fp64, which device {self.facts.name!r} lacks; "
                "use float32 or the numpy/numba backend"
            )
        return None

    # ---- plumbing -----------------------------------------------------------------------------
    def queue_for(self, *arrays: Any) -> Any:
        """The queue of the first pyopencl Array given (work stays in order with the caller's
        kernels), else the backend's own."""
        for a in arrays:
            if is_cl_array(a) and a.queue is not None:
                return a.queue
        return self.queue

    def launch(self, ctx: Any, queue: Any, filename: str, cfg: KernelConfig | tuple,
               kernel: str, gsize: tuple, lsize: tuple | None, args: Sequence[Any],
               **kw: Any) -> Any:
        """Enqueue ``kernel`` of ``filename`` built with ``cfg`` (or its ``options()``, already
        made); returns its event. ``kw``: ``varying`` / ``owner`` of ``_runtime.launch``."""
        opts = cfg if isinstance(cfg, tuple) else cfg.options()
        return _runtime.launch((ctx.int_ptr, filename, kernel, opts),
                               lambda: _runtime.program(ctx, filename, opts), kernel, queue,
                               gsize, lsize, args, **kw)

    # ---- primitives ---------------------------------------------------------------------------
    def attention(self, call: AttnCall) -> tuple[Any, Any]:
        with device_errors("attention"):
            return _dispatch.attention(self, call)

    def attention_parts(self, call: AttnCall, n_parts: int) -> tuple[Any, Any]:
        with device_errors("attention"):
            return _dispatch.attention_parts(self, call, n_parts)

    def parts_limits(self, call: AttnCall) -> tuple[int | None, int | None]:
        """The tensor-core decode kernel's limits where it takes the call's decode rows: one
        m16 tile of packed rows, and prefix chunks of ``_nvidia_decode.PARTS_KEYS`` keys (many
        work-groups, each as long as a sequence's own keys, not one per row tile over the whole
        prefix); none elsewhere."""
        from . import _nvidia_decode as nd

        rows = int(call.q_len.max()) * (call.n_heads // call.n_kv_heads) if call.n_seq else 0
        if nd.Decode().applicable(self, call, rows) is None:
            return nd.MAX_ROWS, nd.PARTS_KEYS
        return None, None

    def softmax(self, x: Any, axis: int, log: bool) -> Any:
        with device_errors("softmax"):
            return _ops.softmax(self, x, axis, log)

    def merge_states(self, outs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
        with device_errors("merge_states"):
            return _ops.merge_states(self, outs, lses)

    def rope(self, x: Any, positions: np.ndarray, spec: RopeSpec) -> Any:
        with device_errors("rope"):
            return _ops.rope(self, x, positions, spec)

    def cache_alloc(self, shape: tuple[int, int, int, int], dtype: np.dtype) -> Any:
        with device_errors(f"a KV cache of shape {tuple(shape)} {np.dtype(dtype)}"):
            return self._cache_alloc(shape, dtype)

    def _cache_alloc(self, shape: tuple[int, int, int, int], dtype: np.dtype) -> Any:
        import pyopencl.array as cla

        buf = cla.empty(self.queue, tuple(shape), np.dtype(dtype))
        if buf.nbytes:
            # zeroed by a kernel over a word view of the same memory (Oclgrind does not count
            # clEnqueueFillBuffer as initialising memory)
            word = np.uint32 if buf.nbytes % 4 == 0 else np.uint8
            n = buf.nbytes // np.dtype(word).itemsize
            cla.Array(self.queue, (n,), word, data=buf.data).fill(0)
        self.queue.finish()
        return buf

    def cache_write(self, buf: Any, src: Any, rows: np.ndarray, start_pos: np.ndarray,
                    rope: RopeSpec | None, scales: Any = None) -> None:
        with device_errors("the KV-cache append"):
            _ops.cache_write(self, buf, src, rows, start_pos, rope, scales)

    def cache_write_slots(self, buf: Any, src: Any, slot_mapping: np.ndarray,
                          positions: np.ndarray, rope: RopeSpec | None,
                          scales: Any = None) -> None:
        with device_errors("the paged KV-cache append"):
            _ops.cache_write_slots(self, buf, src, slot_mapping, positions, rope, scales)

    def copy_pages(self, buf: Any, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
        with device_errors("the paged KV-cache page copy"):
            _ops.copy_pages(self, buf, src_pages, dst_pages)

    def cache_append(self, k_buf: Any, v_buf: Any, k: Any, v: Any, q: Any, rows: np.ndarray,
                     start: np.ndarray, rope: RopeSpec | None, k_scales: Any = None,
                     v_scales: Any = None) -> Any:
        with device_errors("the KV-cache append"):
            return _ops.fused_append(self, k_buf, v_buf, k, v, q, rows, start, rope,
                                     k_scales is not None)

    def cache_read(self, buf: Any) -> np.ndarray:
        return buf.get()
