"""Device memory for per-call outputs and scratch, from one pyopencl memory pool per queue.

Why: creating and releasing a buffer per call (``clCreateBuffer`` / ``clReleaseMemObject``)
costs far more than a small kernel on some drivers — on NVIDIA, freeing device memory
synchronises, and the H200 run (bench/RESULTS.md) showed about 0.5 ms of fixed cost per decode
call and 1–1.7 ms per prefill call outside the kernels. A pool keeps released blocks for reuse,
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
    import pyopencl.tools as clt

    key = queue.int_ptr
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = clt.MemoryPool(clt.ImmediateAllocator(queue))
            _pools[key] = (pool, queue)  # keep the queue alive as long as its pool
            return pool
        return pool[0]


def empty(queue: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-contiguous ``pyopencl.array.Array`` whose memory comes from the
    queue's pool.

    pyopencl's checked constructor (``cla.empty``) validated the shape with several numpy calls:
    ~15 us of the ~120 us a decode call spends on the H200's host (bench/RESULTS.md). The shape
    here is always a tuple of non-negative ints made by attnlib, so the Array is built through
    pyopencl's own fast constructor (what its ``_new_like_me`` uses), falling back to the checked
    one if that signature ever changes."""
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
