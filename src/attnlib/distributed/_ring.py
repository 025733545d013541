"""Ring attention over sequence shards, and the exact merge of per-rank partial states."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import _spec
from .._api import merge_states
from .._common import from_bshd
from ..backends.base import AttnCall
from ..errors import ShapeError
from ._comm import TAG_K, TAG_V, Ring, allgather_array, check_comm, collective_check
from ._device import (
    concat_seq,
    contiguous,
    download,
    empty_state,
    marker,
    pick,
    rank_backend,
    recast,
    staging,
    to_device,
    transfer_queue,
    upload,
    wait_on,
    wants_rank_device,
)
from ._options import LocalCall, check_local
from ._sharding import local_chunks


class BlockPlan:
    """One rank's checked ring call: its query chunks, the options of every block, and the
    chunks each source rank's K/V shard brings. Keys and queries carry global positions, so a
    block is one :class:`AttnCall` on views of the local arrays (no copy, exact masking)."""

    def __init__(self, lc: LocalCall) -> None:
        self.lc = lc
        self.q, self.k, self.v = lc.q, lc.k, lc.v  # bshd views
        self.rank, self.size, self.be = lc.rank, lc.size, lc.be
        self.acc = _acc_dtype(lc.q.dtype)

    def chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """``(row0, length, pos0)`` of rank ``rank``'s chunks (queries and keys alike)."""
        return local_chunks(self.lc.sharding, rank, self.size, self.q.shape[1])

    def visible(self, qpos: int, qlen: int, kpos: int, klen: int) -> bool:
        """Whether any key of the block is visible to any of its rows: over the block,
        ``d = kpos - qpos`` takes every integer in ``[lo, hi]``; causal keeps ``d <= 0``, the
        window ``-left <= d <= right``."""
        lo, hi = kpos - (qpos + qlen - 1), kpos + klen - 1 - qpos
        left, right = self.lc.opts.window
        if self.lc.opts.causal:
            hi = min(hi, 0)
        if right is not None:
            hi = min(hi, right)
        if left is not None:
            lo = max(lo, -left)
        return qlen > 0 and klen > 0 and lo <= hi

    def block(self, q_chunk: tuple[int, int, int], k: Any, v: Any,
              k_chunk: tuple[int, int, int], first: bool = False) -> tuple[Any, Any]:
        """``(out, lse)`` of one query chunk over one key chunk, at their global positions
        (``first``: the first block computed for this query chunk)."""
        (qrow, qlen, qpos), (krow, klen, kpos) = q_chunk, k_chunk
        opts = self.lc.opts
        b = self.q.shape[0]
        idx, ones = np.arange(b, dtype=np.int64), np.ones(b, dtype=np.int64)
        call = AttnCall(
            q=self.q[:, qrow:qrow + qlen], k=k, v=v,
            q_batch=idx, q_row0=0 * ones, q_len=qlen * ones,
            k_batch=idx.copy(), k_row0=krow * ones, k_len=klen * ones,
            q_pos0=qpos * ones, k_pos0=kpos * ones,
            causal_hi=0 * ones if opts.causal else None, options=opts.block_options(first),
            need_lse=True,
        )
        return self.be.attention(call)

    def step(self, states: list, k: Any, v: Any, src: int, between=None) -> None:
        """Fold the blocks of source rank ``src``'s K/V shard into ``states`` (one partial
        ``(out, lse)`` per query chunk, float32 or float64), skipping blocks nothing sees.
        Device arrays: every kernel is enqueued and none is waited for."""
        for i, qc in enumerate(self.chunks(self.rank)):
            for kc in self.chunks(src):
                if not self.visible(qc[2], qc[1], kc[2], kc[1]):
                    continue
                out, lse = self.block(qc, k, v, kc, first=states[i] is None)
                out = recast(self.be, out, lse, self.acc) if self.lc.device else \
                    out.astype(self.acc)
                states[i] = (out, lse) if states[i] is None else merge_states(
                    [states[i][0], out], [states[i][1], lse], backend=self.be)
                if between is not None:
                    between()

    def result(self, states: list) -> tuple[Any, Any]:
        """The shard's ``(out (B, S_l, Hq, Dv), lse (B, Hq, S_l))``; empty chunks give 0, -inf."""
        b, _, hq, _ = self.q.shape
        dv, dtype = self.v.shape[3], self.q.dtype
        outs, lses = [], []
        for (_, qlen, _), st in zip(self.chunks(self.rank), states):
            if self.lc.device:
                queue = self.be.queue_for(self.q)
                out, lse = st or empty_state(queue, b, qlen, hq, dv, self.acc)
                outs.append(recast(self.be, out, lse, dtype))
            else:
                out, lse = st or (np.zeros((b, qlen, hq, dv), self.acc),
                                  np.full((b, hq, qlen), -np.inf, self.acc))
                outs.append(out.astype(dtype))
            lses.append(lse)
        if self.lc.device:
            queue = self.be.queue_for(self.q)
            return concat_seq(queue, outs, 1), concat_seq(queue, lses, 2)
        return np.concatenate(outs, axis=1), np.concatenate(lses, axis=2)


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def checked(comm: Any, name: str, local) -> LocalCall:
    """Run :func:`collective_check` over ``local`` (it returns ``(description, LocalCall)``),
    then move a host-array opencl call to this rank's device (:func:`rank_backend`)."""
    lc = collective_check(comm, name, local)
    if wants_rank_device(lc.be, lc.device):
        be = rank_backend(comm)
        dtype = lc.q.dtype
        collective_check(comm, name, lambda: ([], _spec.check_backend_dtype(be, dtype)))
        lc = replace(lc, be=be)
    return lc


@_spec.front_door
@_spec.keywords_checked
def ring_attention(q_l, k_l, v_l, comm, *, causal=False, scale=None, window=None, softcap=None,
                   alibi_slopes=None, sinks=None, sharding="zigzag", layout="bshd",
                   return_lse=False, backend=None):
    """This rank's shard of ``attnlib.attention(q, k, v, ...)`` over the whole sequence.

    Every rank of ``comm`` calls it with its shards of one sequence (see :func:`shard`):
    ``q_l (B, S/P, Hq, D)``, ``k_l (B, S/P, Hkv, D)``, ``v_l (B, S/P, Hkv, Dv)`` (``layout=
    "bhsd"``: ``(B, H, S/P, D)``), numpy arrays or device arrays (``pyopencl.array.Array``, e.g.
    on :func:`rank_backend`'s device). Returns ``out_l (B, S/P, Hq, Dv)`` in the input dtype,
    and with ``return_lse`` also ``lse_l (B, Hq, S/P)``, both in this rank's token order and of
    the input's array kind, equal to the matching shard of single-process attention (the contract's
    accuracy rule). Options are those of ``attention`` (no ``mask``): Sq = Sk, so
    ``causal=True`` and ``"top_left"`` agree, ``window=(left, right)`` shows key ``j`` to query
    ``i`` iff ``i - left <= j <= i + right`` and ALiBi uses ``|i - j|``, all at global
    positions; ``sinks`` join the first block computed for each query chunk only (once). With
    host arrays and the opencl backend chosen by name (or auto), each rank runs on
    :func:`rank_backend`'s device.

    The ring (ring-flash-attention's forward): in step ``t`` a rank holds the K/V shard of rank
    ``rank - t``; it posts the non-blocking send of that shard to ``rank + 1`` and the receive of
    the next one from ``rank - 1``, computes its query chunks against the shard's key chunks while
    the messages travel, and folds each block's ``(out, lse)`` into its running state with
    ``attnlib.merge_states``. A block that causal or the window hides entirely is not computed.
    With zigzag sharding and causal, every rank computes the same work: in the first step its
    two diagonal blocks and one full block, in every later step two full blocks. For ``P = 2``
    (chunks of S/4; ``#`` a full block, ``\\`` a diagonal one, ``.`` skipped)::

                         keys 0 1 2 3
        rank 0  chunk 0       \\ . . .
                chunk 3       # # # \\
        rank 1  chunk 1       # \\ . .
                chunk 2       # # \\ .

    Device arrays: the K/V shards cross MPI through host buffers in page-locked memory (kept
    for the next call of the same shapes). The local shard is copied to the host once; each
    received shard is forwarded from the host buffer it arrived in, and copied to the device on
    a second queue while the current step's kernels run; the next step's kernels wait for that
    copy by an event, never by the host.

    Collective checks come first: shapes, dtypes and options are compared across ranks, and a
    mismatch or a local error raises the same AttnlibError (ShapeError, DTypeError, ArgumentError,
    UnsupportedError, ...) with the same message on every rank; the package docstring says what
    no check can catch.
    """
    lc = checked(comm, "ring_attention", lambda: check_local(
        q_l, k_l, v_l, comm, sharding=sharding, layout=layout, return_lse=return_lse,
        backend=backend, heads_split=False, causal=causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks))
    plan = BlockPlan(lc)
    out, lse = (_ring_device if lc.device else _ring_host)(plan, comm)
    out = from_bshd(out, lc.layout, plan.be)
    return (out, lse) if lc.return_lse else out


def _ring_host(plan: BlockPlan, comm: Any) -> tuple[Any, Any]:
    ring = Ring(comm)
    k, v = np.ascontiguousarray(plan.k), np.ascontiguousarray(plan.v)
    # two receive buffers: the one being filled, and the one being computed and sent
    spare = [(np.empty_like(k), np.empty_like(v)) for _ in range(min(plan.size - 1, 2))]
    states: list = [None] * len(plan.chunks(plan.rank))
    for step in range(plan.size):
        last = step == plan.size - 1
        if not last:
            k_next, v_next = spare[step % 2]
            ring.send_recv(k, k_next, TAG_K)
            ring.send_recv(v, v_next, TAG_V)
        plan.step(states, k, v, (plan.rank - step) % plan.size, between=ring.progress)
        if not last:
            ring.wait()
            k, v = k_next, v_next
    return plan.result(states)


def _ring_device(plan: BlockPlan, comm: Any) -> tuple[Any, Any]:
    """The ring on device arrays. Step ``t`` computes on device K/V slot ``t`` (the rank's own
    arrays for ``t = 0``, then two spare pairs in turn) and sends host buffer ``t % 2``, which
    holds the same shard; the next shard arrives in host buffer ``(t + 1) % 2`` and is copied to
    its device slot on the transfer queue once the step that last read that slot is done."""
    import pyopencl.array as cla

    be, size = plan.be, plan.size
    cq = be.queue_for(plan.q)
    k0, v0 = contiguous(plan.k, be), contiguous(plan.v, be)
    states: list = [None] * len(plan.chunks(plan.rank))
    if size == 1:
        plan.step(states, k0, v0, plan.rank)
        return plan.result(states)
    tq = transfer_queue(cq)
    ring = Ring(comm)
    ready = [marker(cq)]
    raw = staging(tq, (k0.nbytes, v0.nbytes) * 2)  # host K/V buffers 0 and 1
    hk, hv, hk1, hv1 = (b.view(x.dtype).reshape(x.shape) for b, x in zip(raw, (k0, v0) * 2))
    (_, ek), (_, ev) = download(tq, k0, ready, hk), download(tq, v0, ready, hv)
    tq.flush()
    host = [(hk, hv), (hk1, hv1)]
    dev = [(cla.empty_like(k0), cla.empty_like(v0)) for _ in range(2)]
    ends: dict[int, Any] = {}  # step -> marker after its kernels
    uploads: dict[int, list] = {}  # step -> the copies of its shard to the device
    for t in range(size):
        k, v = (k0, v0) if t == 0 else dev[t % 2]
        plan.step(states, k, v, (plan.rank - t) % size)
        ends[t] = marker(cq)
        cq.flush()  # submitted now: the other queue's commands wait on these events
        if t == size - 1:
            break
        if t == 0:
            ek.wait()
            ev.wait()
        cur, nxt = host[t % 2], host[(t + 1) % 2]
        for e in uploads.pop(t - 1, []):  # the last copy that read ``nxt``
            e.wait()
        ring.send_recv(cur[0], nxt[0], TAG_K)
        ring.send_recv(cur[1], nxt[1], TAG_V)
        ring.wait()
        after = [ends[t - 1]] if t >= 2 else []  # the step that last read this device slot
        k_next, v_next = dev[(t + 1) % 2]
        uploads[t + 1] = [upload(tq, k_next, nxt[0], after), upload(tq, v_next, nxt[1], after)]
        tq.flush()
        wait_on(cq, uploads[t + 1])
    for events in uploads.values():  # the staging buffers are free for the next call
        for e in events:
            e.wait()
    return plan.result(states)


@_spec.front_door
def merge_across(o_l, lse_l, comm, *, layout="bshd", backend=None):
    """Merge per-rank partial attention states exactly; the same result on every rank.

    Each rank holds ``o_l (B, Sq, H, Dv)`` (``layout="bhsd"``: ``(B, H, Sq, Dv)``) and
    ``lse_l (B, H, Sq)`` from ``attention(q, k_r, v_r, return_lse=True)`` over its own disjoint
    keys ``k_r`` (e.g. its shard of a KV cache). Returns ``(out, lse)`` equal to attention over
    all ranks' keys together: ``lse = log sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse)
    o_r``, out in ``o_l``'s dtype, lse float32 (float64 for float64), of the inputs' array kind
    (numpy, or device arrays: these cross MPI through host buffers). Ranks with lse = -inf
    contribute nothing; rows empty on every rank give 0 and -inf, never NaN.

    Collective (an allgather of every state, then ``attnlib.merge_states`` in rank order, so
    every rank computes the same bits): shapes and dtypes are compared first, and a mismatch
    raises the same ShapeError / DTypeError / ArgumentError on every rank.
    """

    def local():
        check_comm(comm)
        lay = _spec.check_layout(layout)
        _spec.check_array(o_l, "o_l", ndim=4)
        _spec.check_array(lse_l, "lse_l", ndim=3)
        device = _spec.check_dist_arrays({"o_l": o_l, "lse_l": lse_l})
        _spec.check_device_contiguous(lse_l, "lse_l")
        dtype = _spec.check_float_dtype(o_l, "o_l")
        _spec.check_float_dtype(lse_l, "lse_l")
        o = _spec.to_bshd(o_l, lay)
        b, sq, h, _ = o.shape
        if tuple(lse_l.shape) != (b, h, sq):
            raise ShapeError(
                f"lse_l has shape {tuple(lse_l.shape)}; expected (B, H, Sq) = {(b, h, sq)} "
                f"to match o_l {tuple(o_l.shape)} (layout {lay!r})"
            )
        be = pick(backend, (o_l, lse_l), dtype)
        desc = [("o_l shape", "ShapeError", tuple(o_l.shape)),
                ("o_l dtype", "DTypeError", str(dtype)),
                ("lse_l shape", "ShapeError", tuple(lse_l.shape)),
                ("array kind", "DTypeError", "device" if device else "numpy"),
                ("layout", "ArgumentError", lay), ("backend", "ArgumentError", be.name)]
        return desc, (o, lay, be, device)

    o, lay, be, device = collective_check(comm, "merge_across", local)
    acc = _acc_dtype(o.dtype)
    if device:
        queue = be.queue_for(o)
        (o_host, eo), (l_host, el) = download(queue, contiguous(o, be)), download(queue, lse_l)
        eo.wait()
        el.wait()
        outs = allgather_array(comm, o_host)
        lses = allgather_array(comm, l_host.astype(acc, copy=False))
        outs, lses = [to_device(queue, x) for x in outs], [to_device(queue, x) for x in lses]
    else:
        outs = list(allgather_array(comm, o))
        lses = list(allgather_array(comm, lse_l.astype(acc, copy=False)))
    out, lse = merge_states(outs, lses, backend=be)
    return from_bshd(out, lay, be), lse
