"""Which kernel family runs an attention call, and the one entry that runs it.

:func:`kernel_family` is the only place that chooses; :func:`attention` asks the plan cache
(``_plan_cache``: device-array calls, repeated geometries) and otherwise the chosen family's
``run``:

* ``"mma"``: NVIDIA tensor cores, sm_80+ (``_nvidia_mma``: mma.sync; on sm_90 the warpgroup-MMA
  kernel of ``_nvidia_wgmma``), float16/bfloat16, float32 as 3xTF32, more than
  :data:`~._attention.DECODE_ROWS` packed query rows;
* ``"decode"``: NVIDIA tensor cores, float16/bfloat16, at most 16 packed query rows per kv head
  (``_nvidia_decode``), paged calls and quantized KV caches (8-bit codes, its KV_FORMAT load
  variant) included;
* ``"portable"``: kernels/attn_fwd.cl on any device (``_attention``), paged calls and quantized
  KV caches included; a paged call of prefill chunks and decode steps with host arrays runs its
  decode sequences on the decode kernel and the rest here (``_mixed_paged``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _attention, _nvidia_decode, _nvidia_mma, _plan_cache, _pool

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend


def kernel_family(be: OpenCLBackend, call: AttnCall, max_rows: int) -> str:
    """The kernel family of ``call`` on ``be`` (``max_rows``: its largest number of packed query
    rows, q_len * group, of one sequence): "mma", "decode" or "portable". Paged calls (a block
    table) run the decode kernel when it takes them, else the portable kernel: the prefill
    kernel does not read page tables. Quantized K/V (``k_scales``) run the decode kernel's
    KV_FORMAT variant when it takes them, else the portable kernel: the prefill kernel reads K
    and V in the dtype only."""
    if (be.use_mma and call.k_scales is None and max_rows > _attention.DECODE_ROWS
            and call.block_table is None):
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
    if family == "mma":
        return _nvidia_mma.run(queue.context, queue, be.device, call)
    if family == "decode":
        return _nvidia_decode.run(be, queue, call)
    if (call.block_table is not None and call.k_scales is None and be.use_mma
            and max_rows > _nvidia_decode.MAX_ROWS):
        res = _mixed_paged(be, queue, call, rows)
        if res is not None:
            return res
    return _attention.run(be, queue, call, rows, max_rows)


def _mixed_paged(be: OpenCLBackend, queue: Any, call: AttnCall,
                 rows: np.ndarray) -> tuple[Any, Any] | None:
    """A paged call of prefill chunks and decode steps (``cu_seqlens_q``) with host arrays: the
    decode sequences (at most MAX_ROWS packed rows) on the tensor-core decode kernel, the
    others on the portable kernel, each writing its own query rows; None where the decode
    kernel takes none of them (the whole call then runs the portable kernel)."""
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


def attention_parts(be: OpenCLBackend, call: AttnCall, n_parts: int) -> tuple[Any, Any]:
    """``Backend.attention_parts`` on the device: the ``n_parts`` parts are the batches of one
    call whose query is the rows' array seen with a zero batch stride; its kernel (the
    tensor-core decode kernel where :func:`kernel_family` picks it, else the portable one)
    writes float32 partial states (float16 / bfloat16: its split build's, one per key split
    and part; float32 / float64: its plain output), and one merge.cl launch merges each row's
    states into the output dtype, folds the sinks in and writes the LSE in the contract's
    layout. A host query is uploaded once; nothing else goes through the host."""
    import pyopencl.array as cla

    from ._arrays import acc_dtype, is_cl_array, store_kind

    q4 = call.q  # (B, S, Hq, D), rows read flat
    queue = be.queue_for(q4, call.k, call.v)
    host = not is_cl_array(q4)
    if host:
        q4 = be.to_device(q4)
    b, s, hq, d = q4.shape
    n_rows = b * s
    # every part reads the same R rows: a zero batch stride (C-contiguous rows)
    item = q4.dtype.itemsize
    q = cla.Array(queue, (n_parts, n_rows, hq, d), q4.dtype,
                  strides=(0, hq * d * item, d * item, item), data=q4.base_data,
                  offset=q4.offset)
    sink_logits = call.options.sinks  # folded in once, by the merge
    call = replace(call, q=q, options=replace(call.options, sinks=None), need_lse=True)
    dtype, acc = call.dtype, acc_dtype(call.dtype)
    dv = call.head_dim_v
    packed = call.q_len.astype(np.int64, copy=False) * (hq // call.n_kv_heads)
    max_rows = int(packed.max())
    if kernel_family(be, call, max_rows) == "decode":
        part_o, part_l, splits, keep = _nvidia_decode.run(be, queue, call, parts=True)
        # state split * n_parts + part; its LSEs (rows, Hq)
        n_states, l_strides = splits * n_parts, (n_rows * hq, s * hq, hq, 1)
    elif dtype == acc:  # the plain output is the state: the build of the plain call
        po, pl = _attention.run(be, queue, call, packed, max_rows)
        part_o, part_l, keep = po.data, pl.data, po
        n_states, l_strides = n_parts, (hq * n_rows, s, 1, n_rows)  # LSEs (Hq, rows)
    else:
        part_o, part_l, splits, keep = _attention.run(be, queue, call, packed, max_rows,
                                                      parts=True)
        n_states, l_strides = splits * n_parts, (n_rows * hq, s * hq, hq, 1)
    out = _pool.empty(queue, (b, s, hq, dv), dtype)
    lse = _pool.empty(queue, (b, hq, s), acc)
    for e in keep.events:  # the call's uploads: done before its kernels, never waited on here
        out.add_event(e)
    sinks = None if sink_logits is None else _pool.upload(queue, sink_logits, out)
    # rows (b * S + s) * Hq + h of every state (see merge.cl)
    _attention.launch_merge(be, queue, part_o, n_rows * hq * dv, part_l, l_strides, n_states,
                            s, hq, dv, n_rows * hq, out.data, lse.data, store_kind(acc),
                            store_kind(dtype), int(acc == np.float64), sinks)
    if host:
        return out.get(), lse.get()
    return out, lse
