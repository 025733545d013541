"""Device memory for per-call outputs and scratch, from one pyopencl memory pool per queue.

Why: creating and releasing a buffer per call (``clCreateBuffer`` / ``clReleaseMemObject``)
costs far more than a small kernel on some drivers — on NVIDIA, freeing device memory
synchronises, which costs a fixed part of a millisecond per call outside the kernels
(bench/RESULTS.md). A pool keeps released blocks for reuse,
as PyTorch's caching allocator does.

One pool per command queue: a block released while a kernel on that queue may still read it is
handed out again only to work enqueued later on the same in-order queue, so reuse is ordered
after the earlier use. Pools are never shared across queues.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_lock = threading.Lock()
_pools: dict[int, Any] = {}


def pool_for(queue: Any) -> Any:
    """The memory pool of ``queue`` (made on first use)."""
    key = queue.int_ptr
    hit = _pools.get(key)  # made once per queue: the lock only guards the making
    if hit is not None:
        return hit[0]
    import pyopencl.tools as clt

    from ._runtime import is_simulator

    with _lock:
        pool = _pools.get(key)
        if pool is None:
            if is_simulator(queue.device):
                pool = ExactAllocator(queue)
            else:
                pool = clt.MemoryPool(clt.ImmediateAllocator(queue))
            _pools[key] = (pool, queue)  # keep the queue alive as long as its pool
            return pool
        return pool[0]


class ExactAllocator:
    """What a simulator's queue (Oclgrind) gets instead of a pool: a fresh ``pyopencl.Buffer``
    of exactly the size asked for. A pool's size bins leave spare room past the end of a
    buffer, where an over-run would stay invisible to the simulator's bounds check."""

    def __init__(self, queue: Any) -> None:
        self._context = queue.context

    def allocate(self, nbytes: int) -> Any:
        import pyopencl as cl

        return cl.Buffer(self._context, cl.mem_flags.READ_WRITE, max(1, int(nbytes)))

    __call__ = allocate


#: (queue, shape, dtype) -> the attributes of an Array of that shape, less its memory and events
_templates: dict[tuple, dict] = {}
_TEMPLATES_MAX = 256
#: the attributes a pyopencl Array of the fast constructor holds (checked on first use)
_ARRAY_ATTRS = frozenset(("queue", "context", "shape", "dtype", "strides", "events", "nbytes",
                          "size", "allocator", "base_data", "offset", "_flags"))


def empty(queue: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-contiguous ``pyopencl.array.Array`` whose memory comes from the
    queue's pool.

    pyopencl's checked constructor (``cla.empty``) validated the shape with several numpy calls:
    a large part of a decode call's host time (bench/RESULTS.md); its fast constructor (what
    its ``_new_like_me`` uses) still costs more than a copy of attributes. The first Array of a
    (queue, shape, dtype) is made by that constructor; later ones copy its attributes with a
    fresh allocation and event list, when the Array holds exactly the attributes that
    constructor sets (else every Array is constructed)."""
    key = (queue.int_ptr, shape, dtype)
    tmpl = _templates.get(key)
    if tmpl is not None:
        import pyopencl.array as cla

        arr = cla.Array.__new__(cla.Array)
        arr.__dict__.update(tmpl)
        arr.events = []
        if tmpl["nbytes"]:
            arr.base_data = tmpl["allocator"].allocate(tmpl["nbytes"])
        return arr
    arr = _construct(queue, shape, dtype)
    attrs = getattr(arr, "__dict__", None)
    if attrs is not None and set(attrs) == _ARRAY_ATTRS and arr._flags is None:
        tmpl = dict(attrs, base_data=None, events=None)
        with _lock:
            if len(_templates) >= _TEMPLATES_MAX:
                _templates.clear()
            _templates[key] = tmpl
    return arr


def _construct(queue: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    import pyopencl.array as cla

    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    size = 1
    for n in shape:
        size *= n
    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(1, n)
    try:
        return cla.Array(None, shape, dtype, allocator=pool_for(queue),
                         strides=tuple(strides[::-1]), _fast=True, _size=size,
                         _context=queue.context, _queue=queue)
    except TypeError:  # pragma: no cover - a pyopencl without the fast constructor
        return cla.empty(queue, shape, dtype, allocator=pool_for(queue))


def scratch(queue: Any, nbytes: int) -> Any:
    """A pooled device buffer of at least ``nbytes`` bytes (at least 1)."""
    return pool_for(queue).allocate(max(1, int(nbytes)))


def upload(queue: Any, host: np.ndarray, keeper: Any) -> Any:
    """A pooled device copy of a small host array (descriptors, slopes), enqueued without
    blocking. pyopencl's NannyEvent keeps ``host`` alive until the copy is done, and deleting
    that event blocks until then, so the event is handed to ``keeper`` (the call's output
    ``pyopencl.array.Array``), which holds it until its own events are waited for."""
    import pyopencl as cl

    host = np.ascontiguousarray(host)
    buf = scratch(queue, host.nbytes)
    if host.nbytes:
        keeper.add_event(cl.enqueue_copy(queue, buf, host, is_blocking=False))
    return buf


class DeviceTable:
    """A small device table of one plan (descriptors: per-sequence fields, work lists), rewritten
    in place when its bytes change and left alone when they do not (a decode step that appended
    a token changes one length; one that did not changes nothing).

    The rewrite is enqueued on the plan's in-order queue, so kernels enqueued before it read the
    old bytes and those after it the new ones; the caller holds ``_runtime.launch_lock`` from the
    rewrite to its launch (another thread's rewrite cannot slip in between). Up to 128 bytes the
    rewrite is ``clEnqueueFillBuffer`` with the table as its pattern, which the driver copies at
    the call (no host memory to keep alive, no event to hold); larger tables, and simulators
    (Oclgrind does not count a fill as initialising memory), take a non-blocking write. Its
    event (a pyopencl NannyEvent: it keeps the host bytes alive, and dropping it waits for the
    write) stays with the table for the next PENDING rewrites, not with the call's output: an
    output dropped right away would otherwise wait for the write, i.e. for every kernel enqueued
    before it (``_pool.upload``'s keeper made each such call wait for the previous one)."""

    __slots__ = ("buf", "size", "sig", "fill", "pending", "unordered")
    PENDING = 8

    def __init__(self, queue: Any, nbytes: int, fill: bool) -> None:
        import pyopencl as cl

        ctx = queue.context
        #: an out-of-order queue: a rewrite first waits for the queue's work, then writes
        #: blocking (no kernel enqueued before may read the new bytes)
        self.unordered = bool(
            queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
        fill = fill and not self.unordered
        size = max(4, int(nbytes))
        self.fill = fill and size <= 128 and _fill_ok(ctx)
        if self.fill:
            size = 1 << (size - 1).bit_length()  # a fill's pattern size is a power of two
        self.size = size
        self.buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, size)
        self.sig: bytes | None = None
        self.pending: list = []

    def put(self, queue: Any, host: Any) -> None:
        """Make the table hold ``host`` (an array or its bytes, at most ``size`` bytes) for work
        enqueued after this."""
        import pyopencl as cl

        data = host if type(host) is bytes else host.tobytes()
        if data == self.sig:
            return
        if self.unordered:
            queue.finish()
            cl.enqueue_copy(queue, self.buf, np.frombuffer(data, np.uint8), is_blocking=True)
        elif self.fill:
            pad = bytes(self.size - len(data)) if len(data) < self.size else b""
            _fill(queue, self.buf, data + pad, 0, self.size, None)
        else:
            self.pending.append(cl.enqueue_copy(queue, self.buf, np.frombuffer(data, np.uint8),
                                                is_blocking=False))
            if len(self.pending) > self.PENDING:
                del self.pending[0]  # a write PENDING rewrites ago: done long since
        self.sig = data


def _fill_ok(ctx: Any) -> bool:
    """clEnqueueFillBuffer is OpenCL 1.2: every device of the context must have it."""
    import pyopencl as cl

    try:
        return cl.get_cl_header_version() >= (1, 2) and all(
            tuple(int(x) for x in d.version.split()[1].split(".")[:2]) >= (1, 2)
            for d in ctx.devices)
    except Exception:  # pragma: no cover - an unparsable version string
        return False


def _fill_function() -> Any:
    """pyopencl's C-level fill (its Python wrapper only re-checks the OpenCL version, which
    DeviceTable checked once), else that wrapper."""
    import pyopencl as cl

    low = getattr(getattr(cl, "_cl", None), "_enqueue_fill_buffer", None)
    return low if low is not None else cl.enqueue_fill_buffer


def _fill(queue: Any, buf: Any, pattern: bytes, offset: int, size: int, wait_for: Any) -> Any:
    global _fill
    _fill = _fill_function()
    return _fill(queue, buf, pattern, offset, size, wait_for)
