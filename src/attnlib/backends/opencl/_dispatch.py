"""Which kernel family runs an attention call, and the one path every call takes.

:data:`FAMILIES` is the ordered list of kernel families (``_family.Family``), fastest first;
a call runs on the first whose ``applicable`` says None, and :func:`why` lists the reasons the
ones before it gave (``attnlib.backends.opencl.why``, ``attnlib info --why``):

* ``nvidia wgmma``: Hopper warpgroup MMA, float16/bfloat16 prefill (``_nvidia_mma.Wgmma``);
* ``nvidia decode + prefill``: a paged call of prefill chunks and decode steps with host
  arrays, its decode sequences on the decode kernel, the rest on the mma.sync prefill kernel
  where it takes them, else the portable one (:class:`MixedPaged`);
* ``nvidia mma.sync``: tensor-core prefill on sm_80+, float16/bfloat16, float32 as 3xTF32,
  more than :data:`~._attention.DECODE_ROWS` packed query rows, paged calls of more than 16
  (their PAGE_SIZE load variant) included (``_nvidia_mma.MmaSync``);
* ``nvidia decode``: tensor-core decode on sm_80+, float16/bfloat16, at most 16 packed query
  rows per sequence, paged pools and 8-bit K/V included (``_nvidia_decode.Decode``);
* ``portable``: kernels/attn_fwd.cl on any device, every call (``_attention.Portable``).

:func:`attention` is the path of the first call of a call description and of every repeat:
the plan cache :data:`plans` maps the description (:func:`plan_key`: array types, shapes,
strides and offsets, options, the backend's options and the ``_switches`` in force) to an entry
that holds, per largest packed row count, the family's plan; the per-sequence values are
compared as bytes with the last call's: equal, the plan's step (tables, work-group counts,
splits) is reused and nothing is uploaded; different, the step is made again (the plans'
device tables are rewritten in place: ``_pool.DeviceTable``). Buffers, the sinks, ALiBi slopes,
mask values and block tables are bound per call by the plan's ``enqueue``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _plans
from . import _nvidia_decode, _switches
from ._attention import Portable
from ._family import Family, NotBuilt, Plan, per_sequence
from ._nvidia_decode import Decode
from ._nvidia_mma import MmaSync, Wgmma

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend


class MixedPaged(Family):
    """A paged call of prefill chunks and decode steps (host arrays): the decode sequences (at
    most MAX_ROWS packed rows) on the tensor-core decode kernel, the others on the mma.sync
    prefill kernel where it takes them, else the portable kernel, each writing its own query
    rows."""

    name = "nvidia decode + prefill"

    def applicable(self, be: OpenCLBackend, call: AttnCall, max_rows: int) -> str | None:
        if call.block_table is None:
            return "not a paged call"
        if not be.use_mma:
            return "the backend's use_mma=False"
        if call.k_scales is not None:
            return "quantized K/V"
        if max_rows <= _nvidia_decode.MAX_ROWS:
            return "every sequence fits the decode kernel"
        if not isinstance(call.q, np.ndarray) or not isinstance(call.block_table, np.ndarray):
            return "device arrays (the parts' outputs are joined on the host)"
        return _nvidia_decode.reason(be.device, call)

    def plan(self, be: OpenCLBackend, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        return MixedPlan(be, queue, call)


#: the per-sequence fields of an AttnCall (numpy arrays of length n_seq)
_PER_SEQ = ("q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len", "q_pos0", "k_pos0",
            "causal_hi")


class MixedPlan(Plan):
    """:class:`MixedPaged`'s plan: the two parts' plans, by their sequence counts."""

    def __init__(self, be: OpenCLBackend, queue: Any, call: AttnCall) -> None:
        self.be, self.queue = be, queue
        self.group = call.n_heads // call.n_kv_heads
        self.parts: dict = {}

    def step(self, call: AttnCall, vals: np.ndarray, col: list | None) -> Any:
        small = vals[2] * self.group <= _nvidia_decode.MAX_ROWS
        return np.flatnonzero(small), np.flatnonzero(~small)

    def _part(self, family: Family, call: AttnCall) -> tuple[Plan, Any]:
        vals, col = per_sequence(call)
        max_rows = int(vals[2].max()) * self.group
        key = (family.name, call.n_seq, family.plan_rows(max_rows))
        plan = self.parts.get(key)
        if plan is None:
            plan = self.parts[key] = family.plan(self.be, self.queue, call, max_rows)
        return plan, plan.step(call, vals, col)

    def _rest(self, call: AttnCall) -> Family:
        """The family of the prefill sequences: mma.sync where it takes them."""
        max_rows = int(np.max(call.q_len)) * self.group
        return MMA_SYNC if MMA_SYNC.applicable(self.be, call, max_rows) is None else PORTABLE

    def run(self, call: AttnCall, step: Any) -> tuple[Any, Any]:
        dec_idx, rest_idx = step
        if not dec_idx.size:  # no decode sequence this time: all on the prefill side
            plan, st = self._part(self._rest(call), call)
            return plan.run(call, st)
        dec, rest = (replace(call, **{f: getattr(call, f)[idx] for f in _PER_SEQ
                                      if getattr(call, f) is not None},
                             options=call.options.for_sequences(idx),
                             block_table=call.block_table[idx], need_lse=True)
                     for idx in (dec_idx, rest_idx))
        plan, st = self._part(self._rest(rest), rest)
        out, lse = plan.run(rest, st)
        plan, st = self._part(DECODE, dec)
        d_out, d_lse = plan.run(dec, st)
        for s in range(dec.n_seq):
            b, r0, n = int(dec.q_batch[s]), int(dec.q_row0[s]), int(dec.q_len[s])
            out[b, r0:r0 + n] = d_out[b, r0:r0 + n]
            lse[b, :, r0:r0 + n] = d_lse[b, :, r0:r0 + n]
        return out, (lse if call.need_lse else None)


PORTABLE, DECODE, MMA_SYNC = Portable(), Decode(), MmaSync()
#: the kernel families, in the order the dispatch tries them
FAMILIES: tuple[Family, ...] = (Wgmma(), MixedPaged(), MMA_SYNC, DECODE, PORTABLE)


def max_rows_of(call: AttnCall) -> int:
    """The largest number of packed query rows (q_len * group) of one sequence of ``call``."""
    if not call.n_seq:
        return 0
    return int(np.max(call.q_len)) * (call.n_heads // call.n_kv_heads)


def why(be: OpenCLBackend, call: AttnCall) -> list[tuple[str, str | None]]:
    """(family, reason) for each family the dispatch tries for ``call``, up to the one that runs
    it (its reason None)."""
    max_rows = max_rows_of(call)
    out = []
    for family in FAMILIES:
        reason = family.applicable(be, call, max_rows)
        out.append((family.name, reason))
        if reason is None:
            break
    return out


# ---- the plan cache ---------------------------------------------------------------------------
#: the entries by call description (see the module)
plans = _plans.table()
_PLANS_MAX = 256
_ARRAY: list = []


class _Entry:
    """What one call description fixes: the backend, queue, plans by family and packed rows,
    and ``state``: (signature of the per-sequence values, the plan, its step for them)."""

    __slots__ = ("be", "facts", "queue", "group", "routes", "plans", "state")

    def __init__(self, be: OpenCLBackend, queue: Any, call: AttnCall) -> None:
        self.be, self.facts, self.queue = be, be.facts, queue  # facts: its id is in the key
        self.group = call.n_heads // call.n_kv_heads
        self.routes: dict[int, Plan] = {}
        self.plans: dict[tuple, Plan] = {}
        self.state: tuple = (None, None, None)

    def route(self, call: AttnCall, max_rows: int) -> Plan:
        """The plan of the first family that takes the call (the key and ``max_rows`` fix the
        choice)."""
        for family in FAMILIES:
            if family.applicable(self.be, call, max_rows) is not None:
                continue
            pk = (family.name, family.plan_rows(max_rows))
            plan = self.plans.get(pk)
            if plan is None:
                try:
                    plan = family.plan(self.be, self.queue, call, max_rows)
                except NotBuilt:
                    continue
                self.plans[pk] = plan
            self.routes[max_rows] = plan
            return plan
        raise AssertionError("the portable family takes every call")  # pragma: no cover


def plan_key(be: OpenCLBackend, queue: Any, call: AttnCall) -> tuple:
    """Everything of ``call`` that fixes its family and plan but the per-sequence values: the
    backend and its options, the queue, whether q and k are device arrays, their dtypes, shapes,
    strides and offsets, v's (v has k's array kind and dtype: the front doors check that), the
    options, what the call has of mask, block table and scales, and the switches in force."""
    q, k, v = call.q, call.k, call.v
    if not _ARRAY:
        import pyopencl.array as cla

        _ARRAY.append(cla.Array)
    qd, kd = type(q) is _ARRAY[0], type(k) is _ARRAY[0]
    table, ks, mv = call.block_table, call.k_scales, call.mask_view
    return (id(be), id(be.facts), be.tiles, be.num_splits, be.use_mma, queue.int_ptr,
            qd, q.dtype, q.shape, q.strides, q.offset if qd else 0,
            kd, k.dtype, k.shape, k.strides, k.offset if kd else 0,
            v.shape, v.strides, v.offset if kd else 0,
            call.q_len.shape[0], call.ring, call.need_lse, call.options.plan_key,
            None if mv is None else mv.dtype,
            None if table is None else (call.page_size, type(table), table.shape, table.dtype),
            None if ks is None else tuple((type(x), x.dtype, x.shape, x.strides,
                                           getattr(x, "offset", 0))
                                          for x in (ks, call.v_scales)),
            _switches.KEY)


def attention(be: OpenCLBackend, call: AttnCall) -> tuple[Any, Any]:
    """``(out, lse)`` of ``call`` through its entry's plan (made on the first call of its
    description and of its per-sequence values, reused after)."""
    q = call.q
    queue = getattr(q, "queue", None)
    if queue is None:
        queue = be.queue_for(q, call.k, call.v, call.block_table)
    key = plan_key(be, queue, call)
    entry = plans.get(key)
    if entry is None:
        entry = _Entry(be, queue, call)
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = entry
    chi = call.causal_hi
    parts = [call.q_batch.tobytes(), call.q_row0.tobytes(), call.q_len.tobytes(),
             call.k_batch.tobytes(), call.k_row0.tobytes(), call.k_len.tobytes(),
             call.q_pos0.tobytes(), call.k_pos0.tobytes()]
    if chi is not None:
        parts.append(chi.tobytes())
    sig = b"".join(parts)
    state = entry.state
    if sig != state[0]:
        n = call.q_len.shape[0]
        if len(sig) == 8 * n * len(parts):
            vals = np.frombuffer(sig, np.int64).reshape(len(parts), n)
            col = vals[:, 0].tolist() if n == 1 else None
        else:  # per-sequence fields that are not int64
            vals, col = per_sequence(call)
        if col is not None:  # Python ints: cheaper than numpy on 1-element arrays
            max_rows = col[2] * entry.group
        else:
            max_rows = int(vals[2].max()) * entry.group if n else 0
        plan = entry.routes.get(max_rows)
        if plan is None:
            plan = entry.route(call, max_rows)
        state = entry.state = (sig, plan, plan.step(call, vals, col))
    return state[1].run(call, state[2])



def attention_parts(be: OpenCLBackend, call: AttnCall, n_parts: int) -> tuple[Any, Any]:
    """``Backend.attention_parts`` on the device: the ``n_parts`` parts are the batches of one
    call whose query is the rows' array seen with a zero batch stride; its kernel (the
    tensor-core decode kernel where that family takes the call, else the portable one) writes
    float32 partial states (float16 / bfloat16: its split build's, one per key split and part,
    the plans' ``parts`` mode; float32 / float64: its plain output), and one merge.cl launch
    merges each row's states into the output dtype, folds the sinks in and writes the LSE in
    the contract's layout. A host query is uploaded once; nothing else goes through the
    host."""
    import pyopencl.array as cla

    from . import _pool
    from ._arrays import acc_dtype, is_cl_array, store_kind
    from ._attention import launch_merge

    q4 = call.q  # (B, S, Hq, D), rows read flat
    queue = be.queue_for(q4, call.k, call.v)
    host = not is_cl_array(q4)
    if host:
        q4 = be.to_device(q4)
    b, s, hq, d = q4.shape
    n_rows, item = b * s, q4.dtype.itemsize
    # every part reads the same R rows: a zero batch stride (C-contiguous rows)
    q = cla.Array(queue, (n_parts, n_rows, hq, d), q4.dtype,
                  strides=(0, hq * d * item, d * item, item), data=q4.base_data,
                  offset=q4.offset)
    sink_logits = call.options.sinks  # folded in once, by the merge
    call = replace(call, q=q, options=replace(call.options, sinks=None), need_lse=True)
    dtype, acc = call.dtype, acc_dtype(call.dtype)
    dv = call.head_dim_v
    vals, col = per_sequence(call)
    max_rows = int(vals[2].max()) * (hq // call.n_kv_heads)
    out = _pool.empty(queue, (b, s, hq, dv), dtype)
    lse = _pool.empty(queue, (b, hq, s), acc)
    if Decode().applicable(be, call, max_rows) is None:
        plan = _parts_plan(be, queue, call, max_rows, True)
        step = plan.step(call, vals, col)
        part_o, part_l = plan.enqueue(step, call, None, None, out)
        # state split * n_parts + part; its LSEs (rows, Hq)
        n_states, l_strides = step[0].splits * n_parts, (n_rows * hq, s * hq, hq, 1)
    elif dtype == acc:  # the plain output is the state: the build of the plain call
        po, pl = attention(be, call)
        part_o, part_l = po.base_data, pl.base_data
        for e in po.events:  # its uploads: done before its kernels, never waited on here
            out.add_event(e)
        n_states, l_strides = n_parts, (hq * n_rows, s, 1, n_rows)  # LSEs (Hq, rows)
    else:
        plan = _parts_plan(be, queue, call, max_rows, False)
        step = plan.step(call, vals, col)
        part_o, part_l = plan.enqueue(step, call, None, None, out)
        n_states, l_strides = step[2] * n_parts, (n_rows * hq, s * hq, hq, 1)
    sinks = None if sink_logits is None else _pool.upload(queue, sink_logits, out)
    # rows (b * S + s) * Hq + h of every state (see merge.cl)
    evt = launch_merge(be, queue, part_o, n_rows * hq * dv, part_l, l_strides, n_states, s, hq,
                       dv, n_rows * hq, out.base_data, lse.base_data, store_kind(acc),
                       store_kind(dtype), int(acc == np.float64), sinks)
    out.add_event(evt)
    lse.add_event(evt)
    if host:
        return out.get(), lse.get()
    return out, lse


#: the parts-mode plans of attention_parts, by call description (:func:`plan_key`), family and
#: packed row count: a cascade's decode steps reuse theirs (device tables rewritten in place)
parts_plans: dict[tuple, Plan] = _plans.table()


def _parts_plan(be: OpenCLBackend, queue: Any, call: AttnCall, max_rows: int,
                decode: bool) -> Plan:
    from ._attention import PortablePlan

    key = (plan_key(be, queue, call), decode, 0 if decode else max_rows)
    plan = parts_plans.get(key)
    if plan is None:
        plan = (_nvidia_decode.DecodePlan(be, queue, call, parts=True) if decode
                else PortablePlan(be, queue, call, max_rows, parts=True))
        if len(parts_plans) >= _PLANS_MAX:
            parts_plans.clear()
        parts_plans[key] = plan
    return plan
