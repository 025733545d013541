"""DeepSpeed-Ulysses: all-to-all from sequence shards to head groups, attention over the whole
sequence per head group, all-to-all back."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _spec
from .._api import attention
from .._common import from_bshd
from ._comm import _bytes, _mpi
from ._device import contiguous, download, to_device
from ._options import LocalCall, check_local
from ._ring import checked
from ._sharding import local_chunks


@_spec.front_door
@_spec.keywords_checked
def ulysses_attention(q_l, k_l, v_l, comm, *, causal=False, scale=None, window=None,
                      softcap=None, alibi_slopes=None, sinks=None, sharding="zigzag",
                      layout="bshd", return_lse=False, backend=None):
    """This rank's shard of ``attnlib.attention(q, k, v, ...)`` over the whole sequence, by
    head-parallel all-to-all (DeepSpeed-Ulysses).

    Same arguments, shardings, options and results as :func:`ring_attention` (numpy or device
    arrays in, the same kind out, ``lse_l (B, Hq, S/P)`` with ``return_lse``), and the same
    collective checks; besides, ``Hq`` and ``Hkv`` must be multiples of the rank count ``P``
    (ShapeError on every rank otherwise). Rank ``g`` owns query heads ``[g Hq/P, (g+1) Hq/P)``
    and kv heads ``[g Hkv/P, (g+1) Hkv/P)`` (the kv heads its query heads read under GQA)::

        q_l, k_l, v_l (B, S/P, H, D)  --all-to-all-->  (B, S, H/P, D), global token order
        attention over the whole sequence for heads of group g (ALiBi slopes, sinks sliced alike)
        out (B, S, Hq/P, Dv), lse  --all-to-all-->  out_l (B, S/P, Hq, Dv), lse_l (B, Hq, S/P)

    Each rank sends and receives ``(P-1)/P`` of its q, k, v and out once, where the ring moves
    ``P-1`` K/V shards; the attention itself is one call per rank on its head group. Device
    arrays cross MPI through host buffers: the copies of q, k and v to the host are enqueued
    together and each one's all-to-all starts as soon as its copy is done, while the others
    still copy.
    """
    lc = checked(comm, "ulysses_attention", lambda: check_local(
        q_l, k_l, v_l, comm, sharding=sharding, layout=layout, return_lse=return_lse,
        backend=backend, heads_split=True, causal=causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks))
    mover = _Mover(lc, comm)
    q, k, v = mover.to_heads([lc.q, lc.k, lc.v])
    g, hq = lc.rank, lc.q.shape[2] // lc.size
    out, lse = attention(q, k, v, return_lse=True, backend=lc.be,
                         **lc.opts.attention_kwargs(slice(g * hq, (g + 1) * hq)))
    out_l, lse_l = mover.to_sequence(out, lse)
    out_l = from_bshd(out_l, lc.layout, lc.be)
    return (out_l, lse_l) if lc.return_lse else out_l


class _Mover:
    """The two all-to-alls of one call, on host buffers; device arrays are copied to and from
    the host around them."""

    def __init__(self, lc: LocalCall, comm: Any) -> None:
        self.lc, self.comm, self.p = lc, comm, lc.size
        s_l = lc.q.shape[1]
        self.chunks = [local_chunks(lc.sharding, r, self.p, s_l) for r in range(self.p)]
        self.queue = lc.be.queue_for(lc.q) if lc.device else None

    def _host(self, xs: list[Any]) -> list[tuple[np.ndarray, Any]]:
        """Host copies of ``xs`` as ``(array, event or None)``, device copies all enqueued."""
        if not self.lc.device:
            return [(np.ascontiguousarray(x), None) for x in xs]
        return [download(self.queue, contiguous(x, self.lc.be)) for x in xs]

    def _alltoall(self, send: np.ndarray) -> tuple[np.ndarray, Any]:
        """Post the all-to-all of ``send (P, ...)``, block ``i`` to rank ``i``."""
        recv = np.empty_like(send)
        return recv, self.comm.Ialltoall(_bytes(send), _bytes(recv))

    def to_heads(self, xs: list[Any]) -> list[Any]:
        """``(B, S/P, H, D)`` sequence shards -> this rank's head group ``(B, S, H/P, D)`` of
        the whole sequence in global token order."""
        posted = []
        for x, event in self._host(xs):
            if event is not None:
                event.wait()
            b, s_l, h, d = x.shape
            send = x.reshape(b, s_l, self.p, h // self.p, d).transpose(2, 0, 1, 3, 4)
            posted.append(self._alltoall(np.ascontiguousarray(send)))
        _mpi().Request.Waitall([r for _, r in posted])
        out = []
        for recv, _ in posted:
            _, b, s_l, hg, d = recv.shape
            whole = np.empty((b, s_l * self.p, hg, d), recv.dtype)
            for r in range(self.p):
                for row0, n, pos0 in self.chunks[r]:
                    whole[:, pos0:pos0 + n] = recv[r][:, row0:row0 + n]
            out.append(to_device(self.queue, whole) if self.lc.device else whole)
        return out

    def to_sequence(self, out: Any, lse: Any) -> tuple[Any, Any]:
        """This head group's ``out (B, S, Hq/P, Dv)`` and ``lse (B, Hq/P, S)`` -> this rank's
        tokens of every head: ``(B, S/P, Hq, Dv)`` and ``(B, Hq, S/P)``."""
        (o, eo), (lse_h, el) = self._host([out, lse])
        if eo is not None:
            eo.wait()
        o_send = np.stack([np.concatenate([o[:, pos0:pos0 + n] for _, n, pos0 in self.chunks[r]],
                                          axis=1) for r in range(self.p)])
        o_recv, o_req = self._alltoall(o_send)
        if el is not None:
            el.wait()
        l_send = np.stack([np.concatenate([lse_h[:, :, pos0:pos0 + n]
                                           for _, n, pos0 in self.chunks[r]], axis=2)
                           for r in range(self.p)])
        l_recv, l_req = self._alltoall(l_send)
        _mpi().Request.Waitall([o_req, l_req])
        p, b, s_l, hg, dv = o_recv.shape
        o_l = np.ascontiguousarray(o_recv.transpose(1, 2, 0, 3, 4).reshape(b, s_l, p * hg, dv))
        lse_l = np.ascontiguousarray(l_recv.transpose(1, 0, 2, 3).reshape(b, p * hg, s_l))
        if self.lc.device:
            return to_device(self.queue, o_l), to_device(self.queue, lse_l)
        return o_l, lse_l
