"""Which kernel family runs an attention call, and the one entry that runs it.

:func:`kernel_family` is the only place that chooses; :func:`attention` asks the plan cache
(``_plan_cache``: device-array calls, repeated geometries) and otherwise the chosen family's
``run``:

* ``"mma"``: NVIDIA tensor cores, sm_80+ (``_nvidia_mma``: mma.sync; on sm_90 the warpgroup-MMA
  kernel of ``_nvidia_wgmma``), float16/bfloat16, float32 as 3xTF32, more than
  :data:`~._attention.DECODE_ROWS` packed query rows, paged calls included (their PAGE_SIZE load
  variant, mma.sync);
* ``"decode"``: NVIDIA tensor cores, float16/bfloat16, at most 16 packed query rows per kv head
  (``_nvidia_decode``), paged calls and quantized KV caches (8-bit codes, its KV_FORMAT load
  variant) included;
* ``"portable"``: kernels/attn_fwd.cl on any device (``_attention``), paged calls and quantized
  KV caches included.

A paged call of prefill chunks and decode steps with host arrays runs its decode sequences on the
decode kernel and the rest on the family that takes them ("mma" or "portable"; ``_mixed_paged``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _attention, _nvidia_decode, _nvidia_mma, _plan_cache

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend


def kernel_family(be: OpenCLBackend, call: AttnCall, max_rows: int) -> str:
    """The kernel family of ``call`` on ``be`` (``max_rows``: its largest number of packed query
    rows, q_len * group, of one sequence): "mma", "decode" or "portable". Quantized K/V
    (``k_scales``) run the decode kernel's KV_FORMAT variant when it takes them, else the
    portable kernel: the prefill kernel reads K and V in the dtype only."""
    if be.use_mma and call.k_scales is None and max_rows > _attention.DECODE_ROWS:
        if _nvidia_mma.applicable(be.device, call):
            return "mma"
    if be.use_mma and max_rows <= _nvidia_decode.MAX_ROWS:
        if _nvidia_decode.applicable(be.device, call):
            return "decode"
    return "portable"


def attention(be: OpenCLBackend, call: AttnCall) -> tuple[Any, Any]:
    res = _plan_cache.run(be, call, kernel_family)
    if res is not None:
        return res
    queue = be.queue_for(call.q, call.k, call.v, call.block_table)
    hq, hkv = call.q.shape[2], call.n_kv_heads
    rows = call.q_len.astype(np.int64, copy=False) * (hq // hkv)
    max_rows = int(rows.max()) if call.n_seq else 0
    family = kernel_family(be, call, max_rows)
    if family == "decode":
        return _nvidia_decode.run(be, queue, call)
    if (call.block_table is not None and call.k_scales is None and be.use_mma
            and max_rows > _nvidia_decode.MAX_ROWS):
        res = _mixed_paged(be, queue, call, rows, family)
        if res is not None:
            return res
    if family == "mma":
        return _nvidia_mma.run(queue.context, queue, be.device, call)
    return _attention.run(be, queue, call, rows, max_rows)


def _mixed_paged(be: OpenCLBackend, queue: Any, call: AttnCall, rows: np.ndarray,
                 family: str) -> tuple[Any, Any] | None:
    """A paged call of prefill chunks and decode steps (``cu_seqlens_q``) with host arrays: the
    decode sequences (at most MAX_ROWS packed rows) on the tensor-core decode kernel, the
    others on ``family``'s kernel (the prefill kernel or the portable one), each writing its own
    query rows; None where the decode kernel takes none of them (the whole call then runs
    ``family``)."""
    if not isinstance(call.q, np.ndarray) or not isinstance(call.block_table, np.ndarray):
        return None
    small = rows <= _nvidia_decode.MAX_ROWS
    if not small.any():
        return None
    parts = []
    for keep in (small, ~small):
        idx = np.flatnonzero(keep)
        parts.append(replace(call, **{f: getattr(call, f)[idx] for f in _PER_SEQ
                                      if getattr(call, f) is not None},
                             options=call.options.for_sequences(idx),
                             block_table=call.block_table[idx], need_lse=True))
    dec, rest = parts
    if not _nvidia_decode.applicable(be.device, dec):
        return None
    if family == "mma":
        out, lse = _nvidia_mma.run(queue.context, queue, be.device, rest)
    else:
        out, lse = _attention.run(be, queue, rest, rows[~small], int(rows[~small].max()))
    d_out, d_lse = _nvidia_decode.run(be, queue, dec)
    for s in range(dec.n_seq):
        b, r0, n = int(dec.q_batch[s]), int(dec.q_row0[s]), int(dec.q_len[s])
        out[b, r0:r0 + n] = d_out[b, r0:r0 + n]
        lse[b, :, r0:r0 + n] = d_lse[b, :, r0:r0 + n]
    return out, (lse if call.need_lse else None)


#: the per-sequence fields of an AttnCall (numpy arrays of length n_seq)
_PER_SEQ = ("q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len", "q_pos0", "k_pos0",
            "causal_hi")


def forget_plans() -> None:
    """Drop every attention plan (tests and benches that change a module setting the plans were
    made under)."""
    _attention.plans.clear()
    _plan_cache.plans.clear()
