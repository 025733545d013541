"""MPI plumbing: communicator checks, the collective check, and the ring's non-blocking exchange.

mpi4py is never imported here at module level: a communicator can only exist once the caller has
imported ``mpi4py.MPI`` itself, so this module reads that module from ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import errors
from ..errors import ArgumentError, AttnlibError

#: the message tags of the ring's key and value shards
TAG_K, TAG_V = 0x6174, 0x6175


def _mpi() -> Any | None:
    return sys.modules.get("mpi4py.MPI")


def check_comm(comm: Any) -> tuple[int, int]:
    """``(rank, size)`` of an mpi4py intracommunicator; ArgumentError for anything else."""
    mpi = _mpi()
    if mpi is None or not isinstance(comm, mpi.Intracomm) or not comm:
        hint = "" if mpi is not None else " (mpi4py is not imported: pip install 'attnlib[mpi]')"
        raise ArgumentError(
            f"comm must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got "
            f"{type(comm).__name__} {comm!r}{hint}"
        )
    return comm.Get_rank(), comm.Get_size()


#: what a rank describes of its call: (label, AttnlibError class name for a mismatch, value)
Description = list[tuple[str, str, Any]]


def collective_check(comm: Any, name: str, local: Callable[[], tuple[Description, Any]]) -> Any:
    """Run ``local()`` (this rank's validation) on every rank, then agree on the verdict.

    ``local`` returns ``(description, value)`` or raises. The ranks exchange their verdicts and
    descriptions (one ``allgather`` of small picklable tuples) before any data moves. If a rank
    failed, every rank raises that rank's error class with its message (the lowest failing rank
    wins); if the descriptions differ, every rank raises the class named for the first differing
    entry. Each rank computes the message from the same gathered facts, so it is the same on all.
    Returns ``value`` when every rank passed and all descriptions agree.
    """
    rank, size = check_comm(comm)
    cause: BaseException | None = None
    try:
        description, value = local()
        verdict = None
    except AttnlibError as exc:
        verdict, cause = (type(exc).__name__, str(exc)), exc
    except Exception as exc:  # an unforeseen failure must not leave the other ranks waiting
        verdict, cause = ("ArgumentError", f"{type(exc).__name__}: {exc}"), exc
    if verdict is not None:
        description, value = None, None
    gathered = comm.allgather((verdict, description))
    failed = [(r, v) for r, (v, _) in enumerate(gathered) if v is not None]
    if failed:
        r, (cls_name, message) = failed[0]
        more = f" ({len(failed)} of {size} ranks failed; the first is reported)" \
            if len(failed) > 1 else ""
        raise _error(cls_name)(f"{name} on rank {r} of {size}{more}: {message}") from cause
    first = gathered[0][1]
    for r, (_, desc) in enumerate(gathered[1:], start=1):
        for (label, cls_name, want), (_, _, got) in zip(first, desc):
            if got != want:
                raise _error(cls_name)(
                    f"{name}: {label} differs across ranks: rank 0 has {want}, rank {r} has "
                    f"{got}; every rank must call it alike"
                )
    return value


def _error(cls_name: str) -> type[AttnlibError]:
    cls = getattr(errors, cls_name, None)
    return cls if isinstance(cls, type) and issubclass(cls, AttnlibError) else AttnlibError


def _bytes(x: np.ndarray) -> np.ndarray:
    """A C-contiguous array as a flat byte view: MPI moves any dtype (bfloat16 included)."""
    return x.reshape(-1).view(np.uint8)


class Ring:
    """The ring's exchange (ring-flash-attention's ``RingComm``): each rank sends to ``rank + 1``
    and receives from ``rank - 1`` with non-blocking messages; ``wait`` completes them all."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        rank, size = comm.Get_rank(), comm.Get_size()
        self.send_to, self.recv_from = (rank + 1) % size, (rank - 1) % size
        self._requests: list[Any] = []

    def send_recv(self, send: np.ndarray, recv: np.ndarray, tag: int) -> None:
        """Post ``send`` to the next rank and ``recv`` from the previous one (both contiguous,
        neither touched again until :meth:`wait`)."""
        self._requests.append(self.comm.Isend(_bytes(send), dest=self.send_to, tag=tag))
        self._requests.append(self.comm.Irecv(_bytes(recv), source=self.recv_from, tag=tag))

    def progress(self) -> None:
        """Let MPI move data between two blocks of compute (it progresses only inside calls)."""
        if self._requests:
            _mpi().Request.Testall(self._requests)

    def wait(self) -> None:
        if self._requests:
            _mpi().Request.Waitall(self._requests)
            self._requests = []


def allgather_array(comm: Any, x: np.ndarray) -> np.ndarray:
    """``(P, *x.shape)``: every rank's ``x`` (same shape and dtype on all ranks, checked before)."""
    x = np.ascontiguousarray(x)
    out = np.empty((comm.Get_size(),) + x.shape, dtype=x.dtype)
    comm.Allgather(_bytes(x), _bytes(out))
    return out
