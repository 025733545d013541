"""Device arrays (pyopencl) in context-parallel calls: each rank's device, and the moves of data
between a device and the host buffers that MPI reads and writes.

Every copy here is enqueued without blocking the host; a rank's kernels run on the queue of its
arrays (the compute queue) while copies to and from the host run on a second in-order queue of
the same device (the transfer queue), ordered against the kernels by events, so that a copy and
the current block's kernels can run at the same time. pyopencl's events keep the host buffers of
pending copies alive.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _config, _spec, registry
from .._common import device_contiguous, pick_backend
from ..backends.base import Backend
from ._comm import _mpi, check_comm

_rank_backends: dict[int, Backend] = {}
_queue_backends: dict[int, Backend] = {}
_transfer_queues: dict[int, Any] = {}
#: queue -> (sizes, the staging byte arrays, the buffers that back them)
_staging: dict[int, tuple[tuple, list[np.ndarray], list[Any]]] = {}


def pick(backend: Any, arrays: tuple, dtype: Any) -> Backend:
    """``pick_backend`` for a distributed call, except that device arrays under no choice or
    the name "opencl" run on an opencl backend made on their own queue (one per queue): their
    rank's device, without the shared instance's context on the first GPU of the node."""
    device = [a for a in arrays if _spec.is_device_array(a)]
    choice = registry.current_choice(backend)
    if device and getattr(device[0], "queue", None) is not None and (
            choice is None or (isinstance(choice, str) and choice.strip() == "opencl")):
        queue = device[0].queue
        be = _queue_backends.get(queue.int_ptr)
        if be is None:
            be = _queue_backends[queue.int_ptr] = registry.get_backend("opencl", queue=queue)
        _spec.check_backend_reads(device, be)
        if dtype is not None:
            _spec.check_backend_dtype(be, dtype)
        return be
    return pick_backend(backend, arrays, dtype)


def rank_backend(comm: Any) -> Backend:
    """The OpenCL backend on this rank's device (contract §9); collective on ``comm``.

    ``PYOPENCL_CTX`` set: the device it names (pyopencl's convention, as for the opencl
    backend). Unset: the GPU (simulators excluded) whose index is this rank's rank among the
    ranks of its node (``comm.Split_type(MPI.COMM_TYPE_SHARED)``), modulo the node's GPU count;
    with no GPU, the opencl backend's own choice (a CPU device, shared by the node's ranks).
    Made once per communicator; make device arrays for the distributed calls with it::

        be = dist.rank_backend(comm)
        q_l = attnlib.to_device(dist.shard(q, comm), backend=be)

    Every rank of ``comm`` must call it (the first call per communicator splits it); raises
    BackendUnavailableError when OpenCL has no usable device.
    """
    check_comm(comm)
    key = comm.py2f()
    be = _rank_backends.get(key)
    if be is not None:
        return be
    if _config.pyopencl_ctx():
        be = registry.get_backend("opencl")
    else:
        node = comm.Split_type(_mpi().COMM_TYPE_SHARED)
        local = node.Get_rank()
        node.Free()
        be = registry.get_backend("opencl")  # raises when OpenCL has no device
        gpus = _gpus()
        if gpus:
            import pyopencl as cl

            be = registry.get_backend("opencl", context=cl.Context([gpus[local % len(gpus)]]))
    _rank_backends[key] = be
    return be


def _gpus() -> list[Any]:
    import pyopencl as cl

    from ..backends.opencl._runtime import is_simulator, list_devices

    return [d for d in list_devices() if d.type & cl.device_type.GPU and not is_simulator(d)]


def wants_rank_device(be: Backend, device: bool) -> bool:
    """Whether a call with host arrays (``device`` False) runs on the rank's device: its backend
    resolved to the shared opencl instance (a name or auto), not an instance the caller made."""
    return be.name == "opencl" and not device and registry.shared_instance("opencl") is be


def transfer_queue(queue: Any) -> Any:
    """The second in-order queue of ``queue``'s device (one per compute queue)."""
    tq = _transfer_queues.get(queue.int_ptr)
    if tq is None:
        import pyopencl as cl

        tq = _transfer_queues[queue.int_ptr] = cl.CommandQueue(queue.context, queue.device)
    return tq


def staging(queue: Any, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Host byte arrays of ``sizes`` in page-locked memory of ``queue``'s context (mapped
    ``ALLOC_HOST_PTR`` buffers, which drivers pin: copies to and from the device run at the
    bus's rate; from the device they run faster than into fresh numpy arrays on PoCL, see
    bench/RESULTS.md), kept for the next call of the same sizes on this queue (one set per
    queue). MPI reads and writes them as any host memory. The caller waits for every copy that
    used them before it returns."""
    import pyopencl as cl

    held = _staging.get(queue.int_ptr)
    if held is not None and held[0] == sizes:
        return held[1]
    arrays, buffers = [], []
    for n in sizes:
        buf = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR,
                        max(1, n))
        mapped, _ = cl.enqueue_map_buffer(queue, buf, cl.map_flags.READ | cl.map_flags.WRITE,
                                          0, (max(1, n),), np.uint8)
        arrays.append(mapped[:n])
        buffers.append(buf)
    _staging[queue.int_ptr] = (sizes, arrays, buffers)
    return arrays


def contiguous(x: Any, be: Backend) -> Any:
    """``x`` as a C-contiguous device array (a strided 4-D view is copied on the device)."""
    return x if x.flags.c_contiguous else device_contiguous(x, be)


def marker(queue: Any) -> Any:
    """An event that completes when everything enqueued on ``queue`` so far has."""
    import pyopencl as cl

    return cl.enqueue_marker(queue)


def wait_on(queue: Any, events: list[Any]) -> None:
    """Later commands of ``queue`` start after ``events``."""
    import pyopencl as cl

    if events:
        cl.enqueue_barrier(queue, wait_for=events)


def download(queue: Any, x: Any, wait_for: list[Any] | None = None,
             host: np.ndarray | None = None) -> tuple[np.ndarray, Any]:
    """A host array (``host``, else a new one) with contiguous ``x``'s values, and the event of
    the copy."""
    import pyopencl as cl

    host = np.empty(x.shape, x.dtype) if host is None else host
    if not x.size:
        return host, marker(queue)
    event = cl.enqueue_copy(queue, host.reshape(-1).view(np.uint8), x.base_data,
                            src_offset=x.offset, is_blocking=False, wait_for=wait_for)
    return host, event


def upload(queue: Any, dst: Any, host: np.ndarray, wait_for: list[Any] | None = None) -> Any:
    """Copy contiguous ``host`` into contiguous device ``dst``; the event of the copy."""
    import pyopencl as cl

    if not dst.size:
        return marker(queue)
    return cl.enqueue_copy(queue, dst.base_data, np.ascontiguousarray(host).reshape(-1).view(
        np.uint8), dst_offset=dst.offset, is_blocking=False, wait_for=wait_for)


def to_device(queue: Any, host: np.ndarray) -> Any:
    """A new device array on ``queue`` holding ``host`` (enqueued without blocking)."""
    import pyopencl.array as cla

    out = cla.empty(queue, host.shape, host.dtype)
    upload(queue, out, host)
    return out


def copy_seq(queue: Any, dst: Any, dst_pos: int, src: Any, src_pos: int, length: int,
             axis: int) -> None:
    """``dst[..., dst_pos:dst_pos+length, ...] = src[..., src_pos:src_pos+length, ...]`` along
    ``axis`` of two C-contiguous device arrays alike but on that axis (one rectangular copy)."""
    import pyopencl as cl

    outer = int(np.prod(src.shape[:axis], dtype=np.int64))
    inner = int(np.prod(src.shape[axis + 1:], dtype=np.int64)) * src.dtype.itemsize
    if not (outer and inner and length):
        return
    cl.enqueue_copy(queue, dst.base_data, src.base_data,
                    src_origin=(src.offset + src_pos * inner, 0, 0),
                    dst_origin=(dst.offset + dst_pos * inner, 0, 0),
                    region=(length * inner, outer, 1),
                    src_pitches=(src.shape[axis] * inner, 0),
                    dst_pitches=(dst.shape[axis] * inner, 0))


def concat_seq(queue: Any, parts: list[Any], axis: int) -> Any:
    """The device arrays ``parts`` (C-contiguous) concatenated along ``axis``."""
    import pyopencl.array as cla

    if len(parts) == 1:
        return parts[0]
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    out = cla.empty(queue, tuple(shape), parts[0].dtype)
    pos = 0
    for p in parts:
        copy_seq(queue, out, pos, p, 0, p.shape[axis], axis)
        pos += p.shape[axis]
    return out


def empty_state(queue: Any, b: int, s: int, h: int, dv: int, acc: Any) -> tuple[Any, Any]:
    """The state of rows that see no key: out 0, lse -inf."""
    import pyopencl.array as cla

    out = cla.zeros(queue, (b, s, h, dv), acc)
    lse = cla.empty(queue, (b, h, s), acc)
    lse.fill(np.dtype(acc).type(-np.inf))
    return out, lse


def recast(be: Backend, out: Any, lse: Any, dtype: Any) -> Any:
    """``out`` of the state ``(out, lse)`` stored as ``dtype`` (on the device)."""
    from ..backends.opencl._ops import recast as cl_recast

    return cl_recast(be, out, lse, dtype)
