"""The cache of attention plans for device-array calls: what a call's kernel launch needs that
does not depend on its per-sequence values, found by one key, so that repeat calls (decode
steps, a model's layers) skip the planning.

A decode step repeats one geometry thousands of times: the same array shapes, strides and
options, per-sequence values that change by one length per step (or not at all). A plan, found
by a key of everything the kernel choice and its launch read except the per-sequence values,
holds the tiling, kernel options, argument list and device tables:

* the key: backend (and its facts and options), queue, dtype, the shapes, strides and offsets of
  q, k and v, the number of sequences, ring, scale, softcap, window, whether the call is causal
  and wants the LSE, and whether it has sinks (their values are uploaded per call). Buffers
  are not in it: they are set per call (only when they changed since
  the kernel object's last launch, see ``_runtime.KernelSlot``);
* the per-sequence values (the nine int64 fields) are compared as bytes with the last call's:
  equal, everything derived from them (which kernel, splits, grid, the device tables) is reused
  and nothing is uploaded; different, it is derived again and the plan's device tables are
  rewritten in place (``_pool.DeviceTable``: one fill of at most 128 bytes for one sequence).

Calls with device arrays only, no mask, no ALiBi and no quantized K/V take it, on each of the
three kernel families the dispatch (``_dispatch.kernel_family``) picks: portable (here), NVIDIA
tensor-core decode and prefill (``_nvidia_plans``); paged calls (a block table: its type, shape
and dtype in the key, its arguments set per call) on the decode kernel only. Every other call
takes its family's ``run`` (this returns None for them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _attention as A
from . import _nvidia_plans, _pool
from ._arrays import acc_dtype, dummy_buffer
from ._runtime import launch_lock

_FIELDS = ("q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len", "q_pos0", "k_pos0")
_I64, _I32 = np.int64, np.int32
_NOT = False  # a key whose calls never take a cached plan
_FAST_MAX = 256


def _array_type() -> Any:
    import pyopencl.array as cla

    return cla.Array


_ARRAY: list = []


class _Plan:
    """What one key fixes; ``state`` is (signature of the per-sequence values, what they give)."""

    __slots__ = ("be", "facts", "queue", "ctx", "kind", "state", "subs", "group", "n")

    def __init__(self, be: Any, queue: Any, n: int, group: int) -> None:
        self.be, self.facts, self.queue, self.ctx = be, be.facts, queue, queue.context
        self.kind = None
        self.state: tuple = (None, None)
        self.subs: dict = {}
        self.group, self.n = group, n


#: the plans by key
plans: dict[tuple, Any] = {}


def run(be: Any, call: Any, family: Any) -> tuple[Any, Any] | None:
    """``(out, lse)`` of ``call`` through its plan, or None (take the family's ``run``);
    ``family(be, call, max_rows)`` is the dispatch's choice of the kernel family."""
    if not _ARRAY:
        _ARRAY.append(_array_type())
    arr = _ARRAY[0]
    q, k, v = call.q, call.k, call.v
    if (type(q) is not arr or type(k) is not arr or type(v) is not arr
            or call.mask_view is not None or call.options.alibi is not None or q.queue is None
            or call.k_scales is not None):
        return None
    chi = call.causal_hi
    n = call.q_len.shape[0]
    queue = q.queue
    table = call.block_table
    paged = None if table is None else (call.page_size, type(table), table.shape, table.dtype)
    key = (id(be), id(be.facts), be.tiles, be.num_splits, be.use_mma, queue.int_ptr, q.dtype,
           q.shape, q.strides, q.offset, k.shape, k.strides, k.offset, v.shape, v.strides,
           v.offset, n, call.ring, call.options.plan_key, chi is None, call.need_lse, paged)
    fp = plans.get(key)
    if fp is None:
        fp = _new_plan(be, call, queue)
        if len(plans) >= _FAST_MAX:
            plans.clear()
        plans[key] = fp
    if fp is _NOT:
        return None
    parts = [call.q_batch.tobytes(), call.q_row0.tobytes(), call.q_len.tobytes(),
             call.k_batch.tobytes(), call.k_row0.tobytes(), call.k_len.tobytes(),
             call.q_pos0.tobytes(), call.k_pos0.tobytes()]
    if chi is not None:
        parts.append(chi.tobytes())
    sig = b"".join(parts)
    state = fp.state
    if sig != state[0]:
        if len(sig) != 8 * n * len(parts):  # per-sequence fields that are not int64
            return None
        state = (sig, _derive(fp, call, np.frombuffer(sig, np.int64).reshape(len(parts), n),
                              family))
        fp.state = state
    derived = state[1]
    if derived is None:
        return None
    return derived.run(fp, call)


def _new_plan(be: Any, call: Any, queue: Any) -> Any:
    """A plan for this key, or _NOT: empty calls, out-of-order queues, zero sizes."""
    import pyopencl as cl

    q, k, v = call.q, call.k, call.v
    if q.size == 0 or k.size == 0 or v.size == 0 or call.q_len.shape[0] == 0:
        return _NOT
    if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
        return _NOT  # the in-place table rewrites rely on queue order
    if any(x.base_data is None for x in (q, k, v)):
        return _NOT
    return _Plan(be, queue, int(call.q_len.shape[0]), call.n_heads // call.n_kv_heads)


def _derive(fp: _Plan, call: Any, vals: np.ndarray, family: Any) -> Any:
    """What the per-sequence values ``vals`` (rows: the fields of _FIELDS, then causal_hi when
    the call is causal) give: a _Portable or _Decode step, or None (the family's run)."""
    if fp.n == 1:  # Python ints: numpy's operations on 1-element arrays cost ~1 us each
        col = vals[:, 0].tolist()
        rows, max_rows = None, col[2] * fp.group
    else:
        col, rows = None, vals[2] * fp.group
        max_rows = int(rows.max())
    if max_rows == 0:
        return None
    route = fp.subs.get(("route", max_rows))
    if route is None:  # the key and max_rows fix the dispatch's choice
        route = fp.subs[("route", max_rows)] = family(fp.be, call, max_rows)
    if route == "decode":
        return _nvidia_plans.decode_step(fp, call, vals, col)
    if call.block_table is not None:  # paged calls: only the decode kernel's plans take them
        return None
    if route == "portable":
        return _portable_step(fp, call, vals, col, rows, max_rows)
    return _nvidia_plans.mma_step(fp, call, vals)


# ---- the portable kernel (attn_fwd.cl) ----------------------------------------------------------
class _PortableSub:
    """Per (plan, packed rows): the portable kernel's plan, its argument list with everything
    but q, k, v and the outputs filled in, and the descriptor table."""

    __slots__ = ("plan", "args", "table", "owners")

    def __init__(self, fp: _Plan, call: Any, max_rows: int) -> None:
        from ._arrays import device_view

        ctx = fp.ctx
        views = [device_view(ctx, x) for x in (call.q, call.k, call.v)]
        key = A.plan_key(fp.be, fp.queue, call, views, max_rows, 0)
        plan = A.plans.get(key)
        if plan is None:
            plan = A.make_plan(fp.be, call, views, max_rows, 0)
            if len(A.plans) >= A.PLANS_MAX:
                A.plans.clear()  # the repeat-call plans stay: they hold their own
            A.plans[key] = plan
        self.plan = plan
        bm = plan.tiles[0]
        args = plan.args.copy()
        n = fp.n
        cap = 9 * n + 2 * n * -(-max_rows // bm)
        self.table = _pool.DeviceTable(ctx, 4 * cap, not fp.facts.simulator)
        args[A.ARG_DESC] = self.table.buf
        args[A.ARG_ALIBI] = args[A.ARG_MASK] = args[A.ARG_SINKS] = dummy_buffer(ctx)
        self.args = args
        self.owners = (object(), object())  # the KernelSlot owner of each split mode


class _Portable:
    __slots__ = ("sub", "desc", "n_groups", "splits")

    def __init__(self, sub: _PortableSub, desc: np.ndarray, n_groups: int, splits: int) -> None:
        self.sub, self.desc, self.n_groups, self.splits = sub, desc, n_groups, splits

    def run(self, fp: _Plan, call: Any) -> tuple[Any, Any]:
        sub, queue = self.sub, fp.queue
        q = call.q
        bq, sq_arr, hq, _ = q.shape
        acc = acc_dtype(q.dtype)
        out = _pool.empty(queue, (bq, sq_arr, hq, call.v.shape[3]), q.dtype)
        if call.need_lse:
            lse = _pool.empty(queue, (bq, hq, sq_arr), acc)
            lse_buf = lse.base_data
        else:
            lse, lse_buf = None, _pool.scratch(queue, bq * sq_arr * hq * acc.itemsize)
        args = sub.args.copy()
        args[A.ARG_Q], args[A.ARG_K] = q.base_data, call.k.base_data
        args[A.ARG_V] = call.v.base_data
        if call.options.sinks is not None:
            args[A.ARG_SINKS] = _pool.upload(queue, call.options.sinks, out)
        with launch_lock:
            sub.table.put(queue, self.desc)
            sub.plan.enqueue(fp.be, queue, args, out.base_data, lse_buf, self.n_groups,
                             self.splits, owner=sub.owners)
        return out, lse


def _portable_step(fp: _Plan, call: Any, vals: np.ndarray, col: list | None, rows: Any,
                   max_rows: int) -> Any:
    sub = fp.subs.get(("portable", max_rows))
    if sub is None:
        sub = fp.subs[("portable", max_rows)] = _PortableSub(fp, call, max_rows)
    bm, bn = sub.plan.tiles[0], sub.plan.tiles[1]
    n = fp.n
    if n == 1:
        head = col if len(col) == 9 else col + [A.INT_MAX]
        nb = -(-max_rows // bm)
        table = [x for g in range(nb) for x in (0, g * bm)]
        desc, n_groups = np.array(head + table, np.int32), nb
        max_k = col[5]
    else:
        desc, n_groups = A.descriptor(call, rows, bm)
        max_k = int(vals[5].max())
    if n_groups == 0:
        return None
    key_tiles = -(-max_k // bn)
    hkv = call.k.shape[2]
    splits = A.choose_splits(fp.facts, n_groups * hkv, key_tiles, fp.be.num_splits)
    return _Portable(sub, desc, n_groups, splits)
