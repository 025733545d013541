"""softmax / logsumexp, merge_states, rope and the KV-cache append on OpenCL.

A decode step's append (k and v written; with RoPE, q and the new k rotated at their positions
first) runs as one launch of rope.cl's ``rope_append`` through an ``_AppendPlan``
(:func:`fused_append`: the backend's ``cache_append``, which the KV cache's repeat entries call);
the (cos, sin) values come from a device table of consecutive positions (``_CosSin``) made once and
widened when a position falls outside it, so a step uploads nothing but its 12-byte (row, slot,
table row) entry per sequence."""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _plans
from . import _pool
from ._arrays import (
    STORE_KINDS,
    acc_dtype,
    device_view,
    dummy_buffer,
    is_cl_array,
    store_kind,
    upload,
)
from ._attention import launch_merge, pow2_floor
from ._family import ArgList
from ._runtime import KernelConfig, launch_lock

if TYPE_CHECKING:
    from ..base import RopeSpec
    from . import OpenCLBackend


@dataclass(frozen=True)
class SoftmaxConfig(KernelConfig):
    STORE_KIND: int
    ACC_KIND: int
    WG: int
    LOG: bool


@dataclass(frozen=True)
class RopeConfig(KernelConfig):
    STORE_KIND: int
    ACC_KIND: int
    ROTATE: bool
    INTERLEAVED: bool


@dataclass(frozen=True)
class QuantConfig(KernelConfig):
    """kv_quant.cl: STORE_KIND the cache's dtype (the new tokens'), KV_FORMAT the 8-bit format."""

    STORE_KIND: int
    ACC_KIND: int
    ROTATE: bool
    INTERLEAVED: bool
    KV_FORMAT: int


def _finish(host: bool, *arrays: Any) -> Any:
    res = tuple(a.get() for a in arrays) if host else arrays
    return res[0] if len(res) == 1 else res


def softmax(be: OpenCLBackend, x: Any, axis: int, log: bool) -> Any:

    queue = be.queue_for(x)
    host = not is_cl_array(x)
    if not host and not x.flags.c_contiguous:
        x = x.get()  # a strided device view: one host round trip, then the plain path
    if host:
        x = np.ascontiguousarray(x)
    dtype = np.dtype(x.dtype)
    acc = acc_dtype(dtype)
    shape = tuple(x.shape)
    n = shape[axis]
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    out_shape = shape[:axis] + shape[axis + 1 :] if log else shape
    out = _pool.empty(queue, out_shape, acc if log else dtype)
    n_rows = outer * inner
    if out.size == 0:
        return _finish(host, out)
    if n == 0:  # an empty axis: lse = -inf for every row
        out.fill(acc.type(-np.inf))
        return _finish(host, out)
    ctx = queue.context
    view = device_view(ctx, x)
    wg_cap = 64 if be.facts.is_cpu else 256
    wg = 16 if n <= 16 else min(wg_cap, 64 if n <= 512 else 256)
    wg = min(wg, pow2_floor(be.facts.max_work_group))
    cfg = SoftmaxConfig(STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64), WG=wg,
                        LOG=log)
    i64 = np.int64
    args = [view.buf, i64(view.offset), i64(n * inner), i64(inner), i64(1), np.int32(n),
            i64(inner), out.data]
    be.launch(ctx, queue, "softmax.cl", cfg, "softmax_rows", (n_rows * wg,), (wg,), args)
    return _finish(host, out)


def _stack_device(queue: Any, arrays: Sequence[Any], dtype: np.dtype) -> Any:
    """One device buffer holding ``arrays`` back to back (C order), copied on the device when
    they are contiguous pyopencl Arrays, else through the host."""
    import pyopencl as cl

    ctx = queue.context
    if all(is_cl_array(a) and a.flags.c_contiguous for a in arrays):
        nbytes = arrays[0].nbytes
        buf = _pool.scratch(queue, nbytes * len(arrays))
        for i, a in enumerate(arrays):
            if nbytes:
                cl.enqueue_copy(queue, buf, a.base_data, src_offset=a.offset,
                                dst_offset=i * nbytes, byte_count=nbytes)
        return buf
    host = [a.get() if is_cl_array(a) else np.asarray(a) for a in arrays]
    return upload(ctx, np.ascontiguousarray(np.stack([np.asarray(h, dtype) for h in host]))).buf


def merge_states(be: OpenCLBackend, outs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:

    queue = be.queue_for(*outs, *lses)
    host = not is_cl_array(outs[0])
    dtype = np.dtype(outs[0].dtype)
    acc = acc_dtype(dtype)
    b, s, h, dv = outs[0].shape
    out = _pool.empty(queue, (b, s, h, dv), dtype)
    lse = _pool.empty(queue, (b, h, s), acc)
    n_rows = b * s * h
    if out.size == 0:
        if lse.size:
            lse.fill(acc.type(-np.inf))
        return _finish(host, out, lse)
    o_buf = _stack_device(queue, outs, dtype)
    l_buf = _stack_device(queue, [np.asarray(x, acc) if not is_cl_array(x) else x for x in lses],
                          acc)
    # LSEs are (B, H, S) per state: strides (state, batch, row, head) = (n_rows, H S, 1, S)
    launch_merge(be, queue, o_buf, n_rows * dv, l_buf, (n_rows, h * s, 1, s), len(outs), s, h,
                 dv, n_rows, out.data, lse.data, store_kind(dtype), store_kind(dtype),
                 int(acc == np.float64))
    return _finish(host, out, lse)


def recast(be: OpenCLBackend, out: Any, lse: Any, dtype: Any) -> Any:
    """The attention state ``(out, lse)`` (contiguous device arrays) with ``out`` stored as
    ``dtype``: merge.cl over the one state, whose weight ``exp(lse - lse)`` is exactly 1, so the
    values are only rounded (a row with lse = -inf is empty and gives 0). One kernel for every
    pair of storage kinds, bfloat16 included (context-parallel states accumulate in float32)."""
    queue = be.queue_for(out, lse)
    dtype = np.dtype(dtype)
    acc = np.dtype(lse.dtype)
    b, s, h, dv = out.shape
    res = _pool.empty(queue, (b, s, h, dv), dtype)
    n_rows = b * s * h
    if res.size:
        merged_lse = _pool.empty(queue, (b, h, s), acc)
        launch_merge(be, queue, out.data, n_rows * dv, lse.data, (n_rows, h * s, 1, s),
                     1, s, h, dv, n_rows, res.data, merged_lse.data, store_kind(out.dtype),
                     store_kind(dtype), int(acc == np.float64))
    return res


def _cos_sin(positions: np.ndarray, spec: RopeSpec, acc: np.dtype) -> np.ndarray:
    """(cos, sin) of pos * theta**(-2t/r) per (position, pair), computed in float64."""
    half = spec.rotary_dim // 2
    inv_freq = float(spec.theta) ** (-2.0 * np.arange(half, dtype=np.float64) / spec.rotary_dim)
    ang = positions.reshape(-1, 1).astype(np.float64) * inv_freq[None, :]
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(acc)


class _Uploads:
    """Keeps the events of _rope_copy's table uploads for the next KEEP uploads. A pyopencl
    NannyEvent keeps the host bytes alive until the copy is done, and dropping it waits for the
    copy, i.e. for every kernel enqueued before it. Handed to the destination Array (a KV
    cache), they made pyopencl's ``Array.add_event``, which waits on the oldest events once it
    holds 12, wait for earlier steps' kernels: every append with RoPE on the per-call path
    waited for the previous step's kernels. An upload KEEP uploads
    old is long done when its event is dropped (as _pool.DeviceTable.pending)."""

    __slots__ = ("events",)
    KEEP = 16

    def __init__(self) -> None:
        self.events: deque = deque(maxlen=self.KEEP)

    def add_event(self, event: Any) -> None:
        self.events.append(event)  # the event KEEP uploads ago is dropped here


_uploads = _Uploads()


def _rope_copy(be: OpenCLBackend, queue: Any, src: Any, dst: Any, dst_rows: np.ndarray,
               dst_start: np.ndarray, cap: int, positions: np.ndarray | None,
               spec: RopeSpec | None) -> None:
    bsz, s, h, d = src.shape
    if bsz * s * h * d == 0:
        return
    ctx = queue.context
    dtype = np.dtype(dst.dtype)
    acc = acc_dtype(dtype)
    rotate = spec is not None and spec.rotary_dim > 0
    cs = (_pool.upload(queue, _cos_sin(positions, spec, acc), _uploads) if rotate
          else dummy_buffer(ctx))
    cfg = RopeConfig(STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64),
                     ROTATE=rotate, INTERLEAVED=bool(spec and spec.interleaved))
    view = device_view(ctx, src)
    table = np.stack([dst_rows, dst_start], axis=1).astype(np.int32)
    item = dtype.itemsize
    i64, i32 = np.int64, np.int32
    y_strides = [st // item for st in dst.strides[:3]]
    args = [view.buf, i64(view.offset), *(i64(st) for st in view.strides), cs,
            _pool.upload(queue, table, _uploads), i32(s), i32(h), i32(d),
            i32(spec.rotary_dim if rotate else 0), i32(cap), dst.data,
            *(i64(st) for st in y_strides)]
    be.launch(ctx, queue, "rope.cl", cfg, "rope_copy", (d, h, bsz * s), None, args)


def rope(be: OpenCLBackend, x: Any, positions: np.ndarray, spec: RopeSpec) -> Any:

    queue = be.queue_for(x)
    host = not is_cl_array(x)
    bsz, s, h, d = x.shape
    out = _pool.empty(queue, (bsz, s, h, d), x.dtype)
    pos = np.broadcast_to(np.asarray(positions, np.int64), (bsz, s))
    _rope_copy(be, queue, x, out, np.arange(bsz), np.zeros(bsz, np.int64), max(s, 1), pos, spec)
    return _finish(host, out)


class _WritePlan:
    """A KV-cache append of one geometry without RoPE (rope.cl as a strided copy): the kernel
    options, every argument but the source and destination buffers, and the (row, first slot)
    table on the device, rewritten in place when it changes (_pool.DeviceTable; the k and the v
    write of one step share it)."""

    __slots__ = ("be", "opts", "args", "table", "gsize", "i_src", "i_dst", "varying")

    def __init__(self, be: OpenCLBackend, queue: Any, buf: Any, src: Any) -> None:
        self.be = be  # keeps id(be), part of the plan's key, from being reused while it lives
        dtype = np.dtype(buf.dtype)
        acc = acc_dtype(dtype)
        cfg = RopeConfig(STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64),
                         ROTATE=False, INTERLEAVED=False)
        bsz, s, h, d = src.shape
        item = dtype.itemsize
        i64, i32 = np.int64, np.int32
        self.table = _pool.DeviceTable(queue, 8 * bsz, not be.facts.simulator)
        self.opts = cfg.options()
        a = ArgList()  # rope_copy's parameters, in order
        a.add("x", None)
        a.add("x_geometry", i64(src.offset // item), *(i64(st // item) for st in src.strides))
        a.add("cs", dummy_buffer(queue.context))
        a.add("dst", self.table.buf)
        a.add("sizes", i32(s), i32(h), i32(d), i32(0), i32(buf.shape[1]))
        a.add("y", None)
        a.add("y_strides", *(i64(st // item) for st in buf.strides[:3]))
        self.args = a.values
        self.i_src, self.i_dst = a.at("x"), a.at("y")
        self.varying = a.indices("x", "y")
        self.gsize = (d, h, bsz * s)


_write_plans = _plans.table()
_PLANS_MAX = 256


def _memo_plan(table: dict, key: tuple, queue: Any, make: Any) -> Any:
    """The plan of ``key`` in ``table`` (made by ``make()`` on first use; the table is emptied
    past _PLANS_MAX), or None for an out-of-order queue: a plan's device tables are rewritten
    in place, which relies on the queue's order."""
    plan = table.get(key)
    if plan is None:
        import pyopencl as cl

        if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
            return None
        if len(table) >= _PLANS_MAX:
            table.clear()
        plan = table[key] = make()
    return plan
_ROW_SLOT = struct.Struct("=ii")  # one (cache row, first slot) entry of the table


def _cache_write_fast(be: OpenCLBackend, buf: Any, src: Any, rows: np.ndarray,
                      start_pos: np.ndarray) -> bool:
    """The append through a _WritePlan; False when the call is not one it takes."""

    if (not is_cl_array(src) or src.base_data is None or buf.base_data is None or src.size == 0
            or buf.offset):
        return False
    queue = be.queue_for(buf)
    key = (id(be), queue.int_ptr, buf.shape, buf.strides, buf.dtype, src.shape, src.strides,
           src.offset, src.dtype)
    plan = _memo_plan(_write_plans, key, queue, lambda: _WritePlan(be, queue, buf, src))
    if plan is None:
        return False
    cap = buf.shape[1]
    if rows.shape[0] == 1:
        table = _ROW_SLOT.pack(int(rows[0]), int(start_pos[0]) % cap)
    else:
        table = np.stack([rows, np.asarray(start_pos, np.int64) % cap], axis=1).astype(np.int32)
    args = plan.args.copy()
    args[plan.i_src], args[plan.i_dst] = src.base_data, buf.base_data
    with launch_lock:
        plan.table.put(queue, table)
        be.launch(queue.context, queue, "rope.cl", plan.opts, "rope_copy", plan.gsize, None,
                  args, varying=plan.varying, owner=plan)
    return True


def cache_write(be: OpenCLBackend, buf: Any, src: Any, rows: np.ndarray, start_pos: np.ndarray,
                rope_spec: RopeSpec | None, scales: Any = None) -> None:
    if rope_spec is None and scales is None and _cache_write_fast(be, buf, src, rows, start_pos):
        return
    queue = be.queue_for(buf)
    cap = buf.shape[1]
    bsz, s = src.shape[:2]
    start = np.asarray(start_pos, np.int64)
    pos = start[:, None] + np.arange(s, dtype=np.int64)[None, :] if rope_spec else None
    if scales is not None:
        _quant_write(be, queue, src, buf, scales, np.asarray(rows, np.int64), start % cap, cap,
                     pos, rope_spec)
        return
    _rope_copy(be, queue, src, buf, np.asarray(rows, np.int64), start % cap, cap, pos, rope_spec)


def _quant_write(be: OpenCLBackend, queue: Any, src: Any, dst: Any, scales: Any,
                 dst_rows: np.ndarray, dst_start: np.ndarray, cap: int,
                 positions: np.ndarray | None, spec: RopeSpec | None) -> None:
    """kv_quant.cl's write of ``src (B, S, H, D)`` (the cache's dtype) into the 8-bit ``dst``
    and its scales, addressed as :func:`_rope_copy` addresses its destination."""
    from ... import _quant

    bsz, s, h, d = src.shape
    if bsz * s * h == 0:
        return
    ctx = queue.context
    sdt = np.dtype(src.dtype)
    acc = acc_dtype(sdt)
    rotate = spec is not None and spec.rotary_dim > 0
    cs = (_pool.upload(queue, _cos_sin(positions, spec, acc), _uploads) if rotate
          else dummy_buffer(ctx))
    cfg = QuantConfig(STORE_KIND=store_kind(sdt), ACC_KIND=int(acc == np.float64),
                      ROTATE=rotate, INTERLEAVED=bool(spec and spec.interleaved),
                      KV_FORMAT=_quant.format_of(dst.dtype).code)
    view = device_view(ctx, src)
    table = np.stack([dst_rows, dst_start], axis=1).astype(np.int32)
    i64, i32 = np.int64, np.int32
    args = [view.buf, i64(view.offset), *(i64(st) for st in view.strides), cs,
            _pool.upload(queue, table, _uploads), i32(s), i32(h), i32(d),
            i32(spec.rotary_dim if rotate else 0), i32(cap), dst.data,
            *(i64(st // dst.dtype.itemsize) for st in dst.strides[:3]), scales.data,
            *(i64(st // 4) for st in scales.strides[:3])]
    be.launch(ctx, queue, "kv_quant.cl", cfg, "kv_quant_write", (h, bsz * s), None, args)


# ---- the decode step's append with RoPE --------------------------------------------------------
class _CosSin:
    """(cos, sin) of consecutive positions ``[base, end)`` on the device, computed by
    :func:`_cos_sin` (the values the per-call path uploads, bit for bit) and made with
    ``COPY_HOST_PTR`` (no queue work, no host memory to keep alive). A position outside the
    range makes a new table covering the old range and the new positions with as many rows again
    to spare (a decode loop widens it log-many times), up to MAX_BYTES; past that, a table of
    only what the call needs (with MIN_ROWS to spare). Callers hold ``launch_lock``."""

    __slots__ = ("ctx", "spec", "acc", "buf", "base", "end")
    MIN_ROWS = 1024
    MAX_BYTES = 64 << 20

    def __init__(self, ctx: Any, spec: RopeSpec, acc: np.dtype) -> None:
        self.ctx, self.spec, self.acc = ctx, spec, acc
        self.buf: Any = None
        self.base = self.end = 0

    def cover(self, lo: int, hi: int) -> bool:
        """Make the table hold positions ``[lo, hi)``; False if that would pass MAX_BYTES."""
        if self.buf is not None and self.base <= lo and hi <= self.end:
            return True
        import pyopencl as cl

        max_rows = self.MAX_BYTES // (self.spec.rotary_dim * self.acc.itemsize)
        if hi - lo + self.MIN_ROWS > max_rows:
            return False
        base, end = lo, hi + self.MIN_ROWS
        if self.buf is not None:
            wide_lo, wide_hi = min(lo, self.base), max(hi, self.end)
            spare = max(self.MIN_ROWS, wide_hi - wide_lo)
            if wide_hi - wide_lo + spare <= max_rows:
                base, end = wide_lo, wide_hi + spare
        host = _cos_sin(np.arange(base, end, dtype=np.int64), self.spec, self.acc)
        mf = cl.mem_flags
        self.buf = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
        self.base, self.end = base, end
        return True


_cos_sin_tables: dict[tuple, _CosSin] = {}


class _AppendPlan:
    """rope_append for one geometry (the caches' k and v, the new k and v and, with RoPE, q:
    shapes, strides, offsets) and RoPE (or none): options, grid, every argument but the buffers
    of the call (q, the new k and v, q's rotated copy, the caches: caches of one geometry share
    the plan), the (row, slot, table row) table on the device (rewritten in place when it
    changes) and the (cos, sin) table it uses. Without RoPE q is left out (HQ = 0)."""

    __slots__ = ("be", "opts", "args", "table", "gsize", "cs", "cs_seen", "cap", "slot",
                 "varying")

    def __init__(self, be: OpenCLBackend, queue: Any, kbuf: Any, vbuf: Any, q: Any, k: Any,
                 v: Any, spec: RopeSpec | None) -> None:
        self.be = be  # keeps id(be), part of the plan's key, from being reused while it lives
        ctx = queue.context
        dtype = np.dtype(kbuf.dtype)
        acc = acc_dtype(dtype)
        cfg = RopeConfig(STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64),
                         ROTATE=spec is not None, INTERLEAVED=bool(spec and spec.interleaved))
        self.cs = None
        if spec is not None:
            cs_key = (ctx.int_ptr, spec, acc)
            self.cs = _cos_sin_tables.get(cs_key)
            if self.cs is None:
                self.cs = _cos_sin_tables[cs_key] = _CosSin(ctx, spec, acc)
        self.cs_seen = None
        bsz, s, hkv, d = k.shape
        dv = v.shape[3]
        hq = q.shape[2] if spec is not None else 0
        item = dtype.itemsize
        i64, i32 = np.int64, np.int32

        def view(x: Any) -> list:  # the element offset and strides following x's buffer
            return [i64(x.offset // item), *(i64(st // item) for st in x.strides)]

        dummy = dummy_buffer(ctx)
        self.table = _pool.DeviceTable(queue, 12 * bsz, not be.facts.simulator)
        self.opts = cfg.options()
        self.cap = kbuf.shape[1]
        a = ArgList()  # rope_append's parameters, in order
        a.add("q", None)
        a.add("q_geometry", *(view(q) if hq else [i64(0)] * 5))
        a.add("k", None)
        a.add("k_geometry", *view(k))
        a.add("v", None)
        a.add("v_geometry", *view(v))
        a.add("cs", dummy)
        a.add("dst", self.table.buf)
        a.add("sizes", i32(s), i32(hq), i32(hkv), i32(d), i32(dv),
              i32(spec.rotary_dim if spec is not None else 0), i32(self.cap))
        a.add("q_out", None)
        a.add("k_cache", None)
        a.add("k_cache_strides", *(i64(st // item) for st in kbuf.strides[:3]))
        a.add("v_cache", None)
        a.add("v_cache_strides", *(i64(st // item) for st in vbuf.strides[:3]))
        self.args = a.values
        self.slot = {n: a.at(n) for n in ("q", "k", "v", "cs", "q_out", "k_cache", "v_cache")}
        #: the slots a launch sets (caches of one geometry share the plan): without RoPE, the
        #: caches and the new k and v (q, its copy and cs: the fixed stand-in); with RoPE q and
        #: its copy too, and cs when its table was widened since the plan's last launch
        plain = a.indices("k", "v", "k_cache", "v_cache")
        rope = a.indices("q", "k", "v", "q_out", "k_cache", "v_cache")
        self.varying = (plain, rope, rope + a.indices("cs"))
        self.gsize = (max(d, dv), hq + 2 * hkv, bsz * s)


_append_plans = _plans.table()
_ROW_SLOT_POS = struct.Struct("=iii")  # one (cache row, first slot, first cs row) entry


def fused_append(be: OpenCLBackend, kbuf: Any, vbuf: Any, k: Any, v: Any, q: Any,
                 rows: np.ndarray, start: np.ndarray, spec: RopeSpec | None,
                 scales: bool = False) -> Any:
    """A KV-cache append in one launch: the new ``k``, ``v`` (B, S, ...) go to cache rows
    ``rows`` (B,) from positions ``start`` (B,) on; with RoPE (``spec``) k and ``q`` (B, S, HQ,
    D: q row s at position start + s) are rotated and q's rotated copy is returned, without it
    q is not read and returned as it is. None when the call is not one this takes (anything but
    device arrays of the caches' queue, a position table past its limit): then nothing was
    enqueued and the caller makes the primitive calls (so for a quantized cache, ``scales``:
    its writes go through kv_quant.cl)."""
    rotate = spec is not None
    if scales or not (is_cl_array(k) and is_cl_array(v)) or kbuf.offset or vbuf.offset:
        return None
    queue = kbuf.queue
    qp = queue.int_ptr
    if (k.queue is None or v.queue is None or k.queue.int_ptr != qp or v.queue.int_ptr != qp
            or vbuf.queue.int_ptr != qp or k.base_data is None or v.base_data is None):
        return None
    if rotate and (not is_cl_array(q) or q.queue is None or q.queue.int_ptr != qp
                   or q.base_data is None):
        return None
    key = (id(be), qp, kbuf.shape, kbuf.strides, kbuf.dtype, vbuf.shape, vbuf.strides,
           k.shape, k.strides, k.offset, v.shape, v.strides, v.offset)
    if rotate:
        key += (spec, q.shape, q.strides, q.offset)
    plan = _memo_plan(_append_plans, key, queue,
                      lambda: _AppendPlan(be, queue, kbuf, vbuf, q, k, v, spec))
    if plan is None:
        return None
    bsz, s = k.shape[:2]
    cap = plan.cap
    args = plan.args.copy()
    slot = plan.slot
    args[slot["k"]], args[slot["v"]] = k.base_data, v.base_data
    args[slot["k_cache"]], args[slot["v_cache"]] = kbuf.base_data, vbuf.base_data
    out = q
    if rotate:
        out = _pool.empty(queue, q.shape, q.dtype)
        args[slot["q"]], args[slot["q_out"]] = q.base_data, out.data
    else:  # q, its copy, cs: the dummy buffer (never read or written with HQ = 0)
        args[slot["q"]] = args[slot["q_out"]] = args[slot["cs"]]
    first = int(start[0]) if bsz == 1 else None
    with launch_lock:
        base, cs, varying = 0, plan.cs, plan.varying[0]
        if cs is not None:
            lo = first if bsz == 1 else int(start.min())
            if not cs.cover(lo, (first if bsz == 1 else int(start.max())) + s):
                return None
            base, varying = cs.base, plan.varying[1]
            if cs.buf is not plan.cs_seen:
                plan.cs_seen = cs.buf
                varying = plan.varying[2]
            args[slot["cs"]] = cs.buf
        if bsz == 1:
            table = _ROW_SLOT_POS.pack(int(rows[0]), first % cap, first - base if rotate else 0)
        else:
            start = np.asarray(start, np.int64)
            table = np.stack([rows, start % cap, start - base if rotate else 0 * start],
                             axis=1).astype(np.int32)
        plan.table.put(queue, table)
        be.launch(queue.context, queue, "rope.cl", plan.opts, "rope_append", plan.gsize, None,
                  args, varying=varying, owner=plan)
    return out


def cache_write_slots(be: OpenCLBackend, buf: Any, src: Any, slot_mapping: np.ndarray,
                      positions: np.ndarray, rope: RopeSpec | None, scales: Any = None) -> None:
    """rope.cl's strided copy (rotating with RoPE) with one token per row: token ``t`` goes to
    page ``slot_mapping[t] // page_size`` from slot ``slot_mapping[t] % page_size`` on."""
    t = int(src.shape[0])
    if t == 0:
        return
    if is_cl_array(src) and not src.flags.c_contiguous:
        src = src.get()
    src4 = src.reshape((t, 1) + tuple(src.shape[1:]))
    ps = int(buf.shape[1])
    slots = np.asarray(slot_mapping, np.int64)
    pos = np.asarray(positions, np.int64)[:, None] if rope is not None else None
    if scales is not None:
        _quant_write(be, be.queue_for(buf), src4, buf, scales, slots // ps, slots % ps, ps, pos,
                     rope)
        return
    _rope_copy(be, be.queue_for(buf), src4, buf, slots // ps, slots % ps, ps, pos, rope)


#: kv_quant.cl's options for kv_copy_pages (a byte copy: the kinds do not matter)
_COPY_CFG = QuantConfig(STORE_KIND=0, ACC_KIND=0, ROTATE=False, INTERLEAVED=False, KV_FORMAT=1)


def copy_pages(be: OpenCLBackend, buf: Any, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """Copy whole pages within the pool (distinct source and destination pages: no overlap),
    through rope.cl's strided copy: a kernel's writes, which Oclgrind's uninitialised-value
    checks follow (they do not follow clEnqueueCopyBuffer). The pools of a quantized cache (8-bit
    codes, float32 scales ``(num_pages, page_size, Hkv)``) are copied as bytes by kv_quant.cl."""
    queue = be.queue_for(buf)
    if buf.ndim == 3 or np.dtype(buf.dtype) not in STORE_KINDS:
        page_bytes = int(np.prod(buf.shape[1:])) * buf.dtype.itemsize
        pairs = np.stack([src_pages, dst_pages], axis=1).astype(np.int32)
        args = [buf.base_data, _pool.upload(queue, pairs, _uploads), np.int64(page_bytes)]
        be.launch(queue.context, queue, "kv_quant.cl", _COPY_CFG, "kv_copy_pages",
                  (page_bytes, len(pairs)), None, args)
        return
    ps = int(buf.shape[1])
    for s, d in zip(np.asarray(src_pages).tolist(), np.asarray(dst_pages).tolist()):
        _rope_copy(be, queue, buf[s:s + 1], buf, np.array([d], np.int64),
                   np.zeros(1, np.int64), ps, None, None)
