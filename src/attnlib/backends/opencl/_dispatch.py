"""Which kernel family runs an attention call, and the one entry that runs it.

:func:`kernel_family` is the only place that chooses; :func:`attention` asks the plan cache
(``_plan_cache``: device-array calls, repeated geometries) and otherwise the chosen family's
``run``:

* ``"mma"``: NVIDIA tensor cores, sm_80+ (``_nvidia_mma``: mma.sync; on sm_90 the warpgroup-MMA
  kernel of ``_nvidia_wgmma``), float16/bfloat16, float32 as 3xTF32, more than
  :data:`~._attention.DECODE_ROWS` packed query rows;
* ``"decode"``: NVIDIA tensor cores, float16/bfloat16, at most 16 packed query rows per kv head
  (``_nvidia_decode``);
* ``"portable"``: kernels/attn_fwd.cl on any device (``_attention``), paged calls and quantized
  KV caches included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _attention, _nvidia_decode, _nvidia_mma, _plan_cache

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend


def kernel_family(be: OpenCLBackend, call: AttnCall, max_rows: int) -> str:
    """The kernel family of ``call`` on ``be`` (``max_rows``: its largest number of packed query
    rows, q_len * group, of one sequence): "mma", "decode" or "portable". Paged calls (a
    block table) and quantized K/V (``k_scales``) run the portable kernel: the tensor-core
    kernels read neither page tables nor 8-bit caches."""
    if call.block_table is not None or call.k_scales is not None:
        return "portable"
    if be.use_mma and max_rows > _attention.DECODE_ROWS:
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
    return _attention.run(be, queue, call, rows, max_rows)


def forget_plans() -> None:
    """Drop every attention plan (tests and benches that change a module setting the plans were
    made under)."""
    _attention.plans.clear()
    _plan_cache.plans.clear()
