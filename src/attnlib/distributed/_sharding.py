"""Sequence sharding: which tokens each rank holds, and shard / gather."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _spec
from .._spec import check_sharding
from ..errors import ShapeError
from ._comm import allgather_array, check_comm, collective_check
from ._device import contiguous, copy_seq, download, pick, to_device


def n_chunks(sharding: str) -> int:
    """Chunks per rank: one for contiguous, two for zigzag."""
    return 1 if sharding == "contiguous" else 2


def chunk_ids(sharding: str, rank: int, size: int) -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds, in its local order (chunks of ``S / (P * n)``)."""
    return (rank,) if sharding == "contiguous" else (rank, 2 * size - 1 - rank)


def local_chunks(sharding: str, rank: int, size: int, s_local: int) -> list[tuple[int, int, int]]:
    """``(row0, length, pos0)`` of each chunk in a shard of ``s_local`` tokens: local rows
    ``row0 : row0 + length`` hold global positions ``pos0 : pos0 + length``."""
    c = s_local // n_chunks(sharding)
    return [(i * c, c, g * c) for i, g in enumerate(chunk_ids(sharding, rank, size))]


def seq_axis(x: Any, name: str, layout: str) -> int:
    """The sequence axis: 1 of a bshd array, 2 of a bhsd one, 2 of an lse ``(B, H, S)``."""
    _spec.check_array(x, name, ndim=(3, 4))
    return 1 if len(x.shape) == 4 and layout == "bshd" else 2


def _slab(x: np.ndarray, axis: int, start: int, length: int) -> np.ndarray:
    """A view of ``x`` holding ``length`` tokens from ``start`` along ``axis``."""
    return x[(slice(None),) * axis + (slice(start, start + length),)]


def _device_shard(x: Any, axis: int, pieces: list[tuple[int, int]]) -> Any:
    """The ``(pos0, length)`` pieces of device array ``x`` along ``axis``, concatenated in a new
    array on ``x``'s queue (rectangular copies on the device)."""
    import pyopencl.array as cla

    be = pick(None, (x,), None)
    queue = be.queue_for(x)
    if len(x.shape) == 4:
        x = contiguous(x, be)
    shape = list(x.shape)
    shape[axis] = sum(n for _, n in pieces)
    out = cla.empty(queue, tuple(shape), x.dtype)
    row = 0
    for pos, n in pieces:
        copy_seq(queue, out, row, x, pos, n, axis)
        row += n
    return out


def shard(x, comm, *, sharding="zigzag", layout="bshd"):
    """This rank's shard of ``x`` along the sequence axis (no data moves; no collective call).

    ``x`` is ``(B, S, H, D)`` (``layout="bshd"``), ``(B, H, S, D)`` (``"bhsd"``) or an lse
    ``(B, H, S)`` (either layout), a numpy or a device array. ``"contiguous"``: rank ``r`` of
    ``P`` holds tokens ``[r*S/P, (r+1)*S/P)`` (a view of a numpy ``x``). ``"zigzag"``: the
    sequence is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and ``2P-1-r`` in that
    order (a copy), which balances causal work. A device ``x`` gives a new C-contiguous device
    array on its queue, copied on the device. For ``P = 2``, ``S = 8``::

        token        0 1 2 3 4 5 6 7
        contiguous   0 0 0 0 1 1 1 1      rank 0: 0 1 2 3   rank 1: 4 5 6 7
        zigzag       0 0 1 1 1 1 0 0      rank 0: 0 1 6 7   rank 1: 2 3 4 5

    Raises ShapeError when ``S`` is not a multiple of ``P`` (contiguous) or ``2P`` (zigzag),
    DTypeError for an ``x`` that is no array, ArgumentError for a bad option or ``comm``.
    """
    rank, size = check_comm(comm)
    sharding = check_sharding(sharding)
    layout = _spec.check_layout(layout)
    device = _spec.check_dist_arrays({"x": x})
    axis = seq_axis(x, "x", layout)
    _spec.check_device_contiguous(x, "x")
    s = x.shape[axis]
    parts = size * n_chunks(sharding)
    if s % parts:
        raise ShapeError(
            f"x has sequence length {s} (axis {axis}), which {sharding} sharding over {size} "
            f"ranks cannot split: it must be a multiple of {parts}"
        )
    c = s // parts
    if device:
        return _device_shard(x, axis, [(g * c, c) for g in chunk_ids(sharding, rank, size)])
    pieces = [_slab(x, axis, g * c, c) for g in chunk_ids(sharding, rank, size)]
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)


def gather(x_l, comm, *, sharding="zigzag", layout="bshd"):
    """The whole sequence on every rank from each rank's shard (the inverse of :func:`shard`).

    ``x_l`` is this rank's shard, ``(B, S/P, H, D)``, ``(B, H, S/P, D)`` or an lse
    ``(B, H, S/P)``; every rank must pass the same shape, dtype and options. Returns a new
    C-contiguous array with ``S`` tokens in global order, of ``x_l``'s kind (a device array
    crosses MPI through a host buffer, and the whole sequence comes back to its queue).
    Collective: a mismatch raises the same error on every rank (ShapeError, DTypeError or
    ArgumentError) before any data moves.
    """

    def local():
        sh = check_sharding(sharding)
        lay = _spec.check_layout(layout)
        device = _spec.check_dist_arrays({"x_l": x_l})
        axis = seq_axis(x_l, "x_l", lay)
        _spec.check_device_contiguous(x_l, "x_l")
        if sh == "zigzag" and x_l.shape[axis] % 2:
            raise ShapeError(
                f"x_l has {x_l.shape[axis]} tokens (axis {axis}); a zigzag shard holds two "
                "equal chunks, so the count must be even"
            )
        desc = [("x_l shape", "ShapeError", tuple(x_l.shape)),
                ("x_l dtype", "DTypeError", str(x_l.dtype)),
                ("array kind", "DTypeError", "device" if device else "numpy"),
                ("sharding", "ArgumentError", sh), ("layout", "ArgumentError", lay)]
        return desc, (sh, axis, device)

    sh, axis, device = collective_check(comm, "gather", local)
    size = comm.Get_size()
    x = x_l
    if device:
        be = pick(None, (x_l,), None)
        queue = be.queue_for(x_l)
        x, event = download(queue, contiguous(x_l, be) if len(x_l.shape) == 4 else x_l)
        event.wait()
    every = allgather_array(comm, x)  # (P, *x_l.shape)
    k = n_chunks(sh)
    c = x_l.shape[axis] // k
    chunks: list[Any] = [None] * (size * k)
    for r in range(size):
        for i, g in enumerate(chunk_ids(sh, r, size)):
            chunks[g] = _slab(every[r], axis, i * c, c)
    whole = np.ascontiguousarray(np.concatenate(chunks, axis=axis))
    return to_device(queue, whole) if device else whole
