"""Ring attention over sequence shards, and the exact merge of per-rank partial states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _spec
from .._api import _from_bshd, merge_states, pick_backend
from ..backends.base import AttnCall, Backend
from ..errors import ShapeError
from ._comm import TAG_K, TAG_V, Ring, allgather_array, check_comm, collective_check
from ._sharding import check_host, check_sharding, local_chunks


@dataclass(frozen=True)
class BlockPlan:
    """One rank's checked ring call: its query chunks, the options of every block, and the
    chunks each source rank's K/V shard brings. Keys and queries carry global positions, so a
    block is one :class:`AttnCall` on views of the local arrays (no copy, exact masking)."""

    q: np.ndarray  # (B, S_l, Hq, D), bshd view
    k: np.ndarray  # (B, S_l, Hkv, D)
    v: np.ndarray  # (B, S_l, Hkv, Dv)
    rank: int
    size: int
    sharding: str
    causal: bool
    scale: float
    window: tuple[int | None, int | None]
    softcap: float | None
    alibi: np.ndarray | None  # float32 (B, Hq)
    be: Backend

    def chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """``(row0, length, pos0)`` of rank ``rank``'s chunks (queries and keys alike)."""
        return local_chunks(self.sharding, rank, self.size, self.q.shape[1])

    def visible(self, qpos: int, qlen: int, kpos: int, klen: int) -> bool:
        """Whether any key of the block is visible to any of its rows: over the block,
        ``d = kpos - qpos`` takes every integer in ``[lo, hi]``; causal keeps ``d <= 0``, the
        window ``-left <= d <= right``."""
        lo, hi = kpos - (qpos + qlen - 1), kpos + klen - 1 - qpos
        left, right = self.window
        if self.causal:
            hi = min(hi, 0)
        if right is not None:
            hi = min(hi, right)
        if left is not None:
            lo = max(lo, -left)
        return qlen > 0 and klen > 0 and lo <= hi

    def block(self, q_chunk: tuple[int, int, int], k: np.ndarray, v: np.ndarray,
              k_chunk: tuple[int, int, int]) -> tuple[Any, Any]:
        """``(out, lse)`` of one query chunk over one key chunk, at their global positions."""
        (qrow, qlen, qpos), (krow, klen, kpos) = q_chunk, k_chunk
        b = self.q.shape[0]
        idx, ones = np.arange(b, dtype=np.int64), np.ones(b, dtype=np.int64)
        call = AttnCall(
            q=self.q[:, qrow:qrow + qlen], k=k, v=v,
            q_batch=idx, q_row0=0 * ones, q_len=qlen * ones,
            k_batch=idx.copy(), k_row0=krow * ones, k_len=klen * ones,
            q_pos0=qpos * ones, k_pos0=kpos * ones,
            causal_hi=0 * ones if self.causal else None, scale=self.scale,
            window_left=self.window[0], window_right=self.window[1], softcap=self.softcap,
            alibi=self.alibi, need_lse=True,
        )
        return self.be.attention(call)

    def step(self, states: list, k: np.ndarray, v: np.ndarray, src: int,
             between=None) -> None:
        """Fold the blocks of source rank ``src``'s K/V shard into ``states`` (one partial
        ``(out, lse)`` per query chunk, float32 or float64), skipping blocks nothing sees."""
        acc = _acc_dtype(self.q.dtype)
        for i, qc in enumerate(self.chunks(self.rank)):
            for kc in self.chunks(src):
                if not self.visible(qc[2], qc[1], kc[2], kc[1]):
                    continue
                out, lse = self.block(qc, k, v, kc)
                out = out.astype(acc)
                states[i] = (out, lse) if states[i] is None else merge_states(
                    [states[i][0], out], [states[i][1], lse], backend=self.be)
                if between is not None:
                    between()

    def result(self, states: list) -> tuple[np.ndarray, np.ndarray]:
        """The shard's ``(out (B, S_l, Hq, Dv), lse (B, Hq, S_l))``; empty chunks give 0, -inf."""
        b, _, hq, _ = self.q.shape
        acc = _acc_dtype(self.q.dtype)
        outs, lses = [], []
        for (_, qlen, _), st in zip(self.chunks(self.rank), states):
            if st is None:
                st = (np.zeros((b, qlen, hq, self.v.shape[3]), acc),
                      np.full((b, hq, qlen), -np.inf, acc))
            outs.append(st[0])
            lses.append(st[1])
        out = np.concatenate(outs, axis=1).astype(self.q.dtype)
        return out, np.concatenate(lses, axis=2)


def _acc_dtype(dtype: np.dtype) -> type:
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def plan_ring(q_l, k_l, v_l, comm, *, causal, scale, window, softcap, alibi_slopes, sharding,
              layout, return_lse, backend) -> tuple[list, tuple[BlockPlan, bool]]:
    """Validate one rank's ring call: what the ranks compare (see :func:`collective_check`),
    and the plan with ``return_lse``."""
    rank, size = check_comm(comm)
    sharding = check_sharding(sharding)
    layout = _spec.check_layout(layout)
    dtype = _spec.check_qkv(q_l, k_l, v_l, ndim=4)
    for name, x in (("q_l", q_l), ("k_l", k_l), ("v_l", v_l)):
        check_host(x, name)
    q, k, v = (_spec.to_bshd(x, layout) for x in (q_l, k_l, v_l))
    _spec.check_heads(q.shape, k.shape, v.shape, names=("q_l", "k_l", "v_l"))
    if k.shape[:2] != q.shape[:2]:
        raise ShapeError(
            f"k_l holds (B, S_l) = {tuple(k.shape[:2])} but q_l holds {tuple(q.shape[:2])}; "
            "ring attention is self-attention: q, k and v are shards of one sequence"
        )
    if sharding == "zigzag" and q.shape[1] % 2:
        raise ShapeError(
            f"q_l has {q.shape[1]} tokens; a zigzag shard holds two equal chunks, so the "
            "count must be even"
        )
    # Sq == Sk over the whole sequence, so bottom-right and top-left causal coincide.
    is_causal = _spec.check_causal(causal) is not None
    scale = _spec.check_scale(scale, q.shape[3])
    left, right = _spec.check_window(window)
    softcap = _spec.check_softcap(softcap)
    alibi = _spec.check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    return_lse = _spec.check_bool(return_lse, "return_lse")
    be = pick_backend(backend, (q, k, v), dtype)
    plan = BlockPlan(q, k, v, rank, size, sharding, is_causal, scale, (left, right), softcap,
                     alibi, be)
    desc = [
        ("q_l shape", "ShapeError", tuple(q_l.shape)),
        ("k_l shape", "ShapeError", tuple(k_l.shape)),
        ("v_l shape", "ShapeError", tuple(v_l.shape)),
        ("dtype", "DTypeError", str(dtype)),
        ("sharding", "ArgumentError", sharding),
        ("layout", "ArgumentError", layout),
        ("causal", "ArgumentError", is_causal),
        ("scale", "ArgumentError", scale),
        ("window", "ArgumentError", (left, right)),
        ("softcap", "ArgumentError", softcap),
        ("alibi_slopes", "ArgumentError", None if alibi is None else alibi.tolist()),
        ("return_lse", "ArgumentError", return_lse),
    ]
    return desc, (plan, return_lse)


@_spec.keywords_checked
def ring_attention(q_l, k_l, v_l, comm, *, causal=False, scale=None, window=None, softcap=None,
                   alibi_slopes=None, sharding="zigzag", layout="bshd", return_lse=False,
                   backend=None):
    """This rank's shard of ``attnlib.attention(q, k, v, ...)`` over the whole sequence.

    Every rank of ``comm`` calls it with its shards of one sequence (see :func:`shard`):
    ``q_l (B, S/P, Hq, D)``, ``k_l (B, S/P, Hkv, D)``, ``v_l (B, S/P, Hkv, Dv)`` numpy arrays
    (``layout="bhsd"``: ``(B, H, S/P, D)``). Returns ``out_l (B, S/P, Hq, Dv)`` in the input
    dtype, and with ``return_lse`` also ``lse_l (B, Hq, S/P)``, both in this rank's token order,
    equal to the matching shard of single-process attention (SPEC's accuracy rule). Options are
    those of ``attention`` (no ``mask``): Sq = Sk, so ``causal=True`` and ``"top_left"`` agree,
    ``window=(left, right)`` shows key ``j`` to query ``i`` iff ``i - left <= j <= i + right``
    and ALiBi uses ``|i - j|``, all at global positions.

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

    Collective checks come first: shapes, dtypes and options are compared across ranks, and a
    mismatch or a local error raises the same AttnlibError (ShapeError, DTypeError, ArgumentError,
    UnsupportedError, ...) with the same message on every rank; the package docstring says what
    no check can catch.
    """
    plan, return_lse = collective_check(comm, "ring_attention", lambda: plan_ring(
        q_l, k_l, v_l, comm, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sharding=sharding, layout=layout, return_lse=return_lse,
        backend=backend))
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
    out, lse = plan.result(states)
    out = _from_bshd(out, layout, plan.be)
    return (out, lse) if return_lse else out


def merge_across(o_l, lse_l, comm, *, layout="bshd", backend=None):
    """Merge per-rank partial attention states exactly; the same result on every rank.

    Each rank holds ``o_l (B, Sq, H, Dv)`` (``layout="bhsd"``: ``(B, H, Sq, Dv)``) and
    ``lse_l (B, H, Sq)`` from ``attention(q, k_r, v_r, return_lse=True)`` over its own disjoint
    keys ``k_r`` (e.g. its shard of a KV cache). Returns ``(out, lse)`` equal to attention over
    all ranks' keys together: ``lse = log sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse)
    o_r``, out in ``o_l``'s dtype, lse float32 (float64 for float64). Ranks with lse = -inf
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
        check_host(o_l, "o_l")
        check_host(lse_l, "lse_l")
        dtype = _spec.check_float_dtype(o_l, "o_l")
        _spec.check_float_dtype(lse_l, "lse_l")
        o = _spec.to_bshd(o_l, lay)
        b, sq, h, _ = o.shape
        if tuple(lse_l.shape) != (b, h, sq):
            raise ShapeError(
                f"lse_l has shape {tuple(lse_l.shape)}; expected (B, H, Sq) = {(b, h, sq)} "
                f"to match o_l {tuple(o_l.shape)} (layout {lay!r})"
            )
        be = pick_backend(backend, (o_l, lse_l), dtype)
        desc = [("o_l shape", "ShapeError", tuple(o_l.shape)),
                ("o_l dtype", "DTypeError", str(dtype)),
                ("lse_l shape", "ShapeError", tuple(lse_l.shape)),
                ("layout", "ArgumentError", lay)]
        return desc, (o, lay, be)

    o, lay, be = collective_check(comm, "merge_across", local)
    outs = allgather_array(comm, o)
    lses = allgather_array(comm, lse_l.astype(_acc_dtype(o.dtype), copy=False))
    out, lse = merge_states(list(outs), list(lses), backend=be)
    return _from_bshd(out, lay, be), lse
