"""Paged K/V on OpenCL: attention over page pools through the portable kernel (kernels/attn_fwd.cl
built with ``-DPAGE_SIZE``: the K/V row indirection through the block table), and the paged
cache's writes (rope.cl's strided copy, one token per row) and copy-on-write page copies.

The tiling, kernel options and argument list come from :mod:`._attention` (the call's plan) with
``PAGE_SIZE`` added and the table appended to the arguments; the NVIDIA tensor-core kernels do not
take page tables, so every paged call runs the portable kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _attention as A
from . import _pool
from ._arrays import acc_dtype, device_view, is_cl_array, store_kind

if TYPE_CHECKING:
    from ..base import AttnCall, RopeSpec
    from . import OpenCLBackend


@dataclass(frozen=True)
class PagedFwdConfig(A.FwdConfig):
    PAGE_SIZE: int = 0


_plans: dict[tuple, A._Plan] = {}
_PLANS_MAX = 256


def _plan(be: OpenCLBackend, queue: Any, call: AttnCall, views: list, max_rows: int) -> A._Plan:
    key = (A._plan_key(be, queue, call, views, max_rows, 0), call.page_size)
    plan = _plans.get(key)
    if plan is None:
        base = A._make_plan(be, call, views, max_rows, 0)
        cfgs = tuple(PagedFwdConfig(**{f.name: getattr(c, f.name) for f in fields(c)},
                                    PAGE_SIZE=int(call.page_size)) for c in base.cfgs)
        plan = A._Plan(base.tiles, cfgs, base.args)
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    return plan


def _table_args(queue: Any, table: Any, n_pages: int, keep: Any) -> list:
    """(buffer, offset, row stride, column stride, width, n_pages) of the block table: a host
    table is uploaded as int32; a device table is read in place (int32) or converted on the
    device (int64), never checked (the kernel clamps what it reads)."""
    i64, i32 = np.int64, np.int32
    if is_cl_array(table):
        if table.dtype != np.int32:
            table = table.astype(np.int32) if table.flags.c_contiguous else \
                table.get().astype(np.int32)
    else:
        table = np.ascontiguousarray(table, np.int32)
    width = int(table.shape[1])
    if width == 0 or table.shape[0] == 0:  # no sequence holds a key: never read
        table, width = np.zeros((1, 1), np.int32), 1
    if is_cl_array(table):
        view = device_view(queue.context, table)
        buf, off, st = view.buf, view.offset, view.strides
    else:
        buf, off, st = _pool.upload(queue, table, keep), 0, (width, 1)
    return [buf, i64(off), i64(st[0]), i64(st[1]), i32(width), i32(n_pages)]


def attention(be: OpenCLBackend, call: AttnCall) -> tuple[Any, Any]:
    """The portable kernel over page pools (see the module docstring); the same launch, split-KV
    and merge as :func:`._attention.attention`."""
    queue = be.queue_for(call.q, call.k, call.v, call.block_table)
    ctx = queue.context
    dtype = call.dtype
    acc = acc_dtype(dtype)
    bq, sq_arr, hq, d = call.q.shape
    hkv, dv = call.n_kv_heads, call.head_dim_v
    rows = call.q_len.astype(np.int64, copy=False) * (hq // hkv)
    max_rows = int(rows.max()) if call.n_seq else 0
    out = _pool.empty(queue, (bq, sq_arr, hq, dv), dtype)
    host = not is_cl_array(call.q)
    n_out_rows = bq * sq_arr * hq
    if call.need_lse or host:
        lse = _pool.empty(queue, (bq, hq, sq_arr), acc)
        lse_buf = lse.data if lse.size else None
    else:
        lse, lse_buf = None, _pool.scratch(queue, n_out_rows * acc.itemsize)
    if out.size == 0 or call.n_seq == 0:
        return (out.get(), lse.get()) if host else (out, lse)
    views = [device_view(ctx, x) for x in (call.q, call.k, call.v)]
    plan = _plan(be, queue, call, views, max_rows)
    bm, bn, tmh, tnh = plan.tiles
    desc, n_groups = A._descriptor(call, rows, bm)
    if n_groups == 0:
        return (out.get(), lse.get()) if host else (out, lse)
    key_tiles = -(-int(call.k_len.max()) // bn)
    splits = A.choose_splits(be.facts, n_groups * hkv, key_tiles, be.num_splits)
    args = plan.args.copy()
    for slot, view in zip((A._Q, A._K, A._V), views):
        args[slot] = view.buf
    args[A._DESC] = _pool.upload(queue, desc, out)
    args[A._ALIBI] = A.dummy_buffer(ctx)
    if call.alibi is not None:
        args[A._ALIBI] = _pool.upload(queue, np.ascontiguousarray(call.alibi, np.float32), out)
    args[A._MASK] = A.dummy_buffer(ctx)
    if splits > 1:
        part_o = _pool.scratch(queue, splits * n_out_rows * dv * acc.itemsize)
        part_l = _pool.scratch(queue, splits * n_out_rows * acc.itemsize)
        args[A._DST:A._DST + 2] = [part_o, part_l]
    else:
        args[A._DST:A._DST + 2] = [out.data, lse_buf]
    args += _table_args(queue, call.block_table, int(call.k.shape[0]), out)
    nt = tmh * tnh
    be.launch(ctx, queue, "attn_fwd.cl", plan.cfgs[splits > 1], "attn_fwd",
              (n_groups * nt, hkv, splits), (nt, 1, 1), args)
    if splits > 1:
        A.launch_merge(be, queue, part_o, n_out_rows * dv, part_l,
                       (n_out_rows, sq_arr * hq, hq, 1), splits, sq_arr, hq, dv, n_out_rows,
                       out.data, lse_buf, store_kind(acc), store_kind(dtype),
                       int(acc == np.float64))
    if host:
        return out.get(), lse.get()
    return out, lse


def cache_write_slots(be: OpenCLBackend, buf: Any, src: Any, slot_mapping: np.ndarray,
                      positions: np.ndarray, rope: RopeSpec | None) -> None:
    """rope.cl's strided copy (rotating with RoPE) with one token per row: token ``t`` goes to
    page ``slot_mapping[t] // page_size`` from slot ``slot_mapping[t] % page_size`` on."""
    from . import _ops

    t = int(src.shape[0])
    if t == 0:
        return
    if is_cl_array(src) and not src.flags.c_contiguous:
        src = src.get()
    src4 = src.reshape((t, 1) + tuple(src.shape[1:]))
    ps = int(buf.shape[1])
    slots = np.asarray(slot_mapping, np.int64)
    pos = np.asarray(positions, np.int64)[:, None] if rope is not None else None
    _ops._rope_copy(be, be.queue_for(buf), src4, buf, slots // ps, slots % ps, ps, pos, rope)


def copy_pages(be: OpenCLBackend, buf: Any, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """Copy whole pages within the pool (distinct source and destination pages: no overlap),
    through rope.cl's strided copy: a kernel's writes, which Oclgrind's uninitialised-value
    checks follow (they do not follow clEnqueueCopyBuffer)."""
    from . import _ops

    queue = be.queue_for(buf)
    ps = int(buf.shape[1])
    for s, d in zip(np.asarray(src_pages).tolist(), np.asarray(dst_pages).tolist()):
        _ops._rope_copy(be, queue, buf[s:s + 1], buf, np.array([d], np.int64),
                        np.zeros(1, np.int64), ps, None, None)
