"""Repeat calls (see _plan_cache) on the NVIDIA tensor-core kernels: what a plan fixes for the
decode kernel (``_nvidia_decode``) and the prefill kernel (``_nvidia_mma``), with exactly the
tables, splits, options, grid and arguments their ``run`` makes with its defaults."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import AttnCall
from . import _attention as A
from . import _nvidia_decode as nd
from . import _nvidia_mma as mma
from . import _pool
from ._arrays import store_kind
from ._runtime import launch_lock

_F32 = np.dtype(np.float32)


# ---- the decode kernel -------------------------------------------------------------------------
class _DecodeCommon:
    """Per plan: the device tables (rewritten in place when the values change), the
    geometry and scalar arguments, the ALiBi stand-in buffer, the kernel flavour."""

    __slots__ = ("seq_table", "tile_table", "alibi_buf", "geometry", "scalars", "use_ptx",
                 "subs", "config")

    def __init__(self, fp: Any, call: AttnCall) -> None:
        ctx = fp.ctx
        fill = not fp.facts.simulator
        self.seq_table = _pool.DeviceTable(ctx, 8 * mma.SEQ_FIELDS * fp.n, fill)
        self.tile_table = _pool.DeviceTable(ctx, 8 * fp.n, fill)
        self.alibi_buf, _, self.geometry, self.scalars = mma.kernel_inputs(ctx, call)
        self.use_ptx = (mma.compute_capability(fp.be.device) is not None
                        and not nd.EMULATE_PTX)
        self.config = tuple(nd.DEFAULT_CONFIGS[call.head_dim])
        self.subs: dict = {}


class _DecodeSub:
    """Per (plan, splits, work-group columns): options, grid, arguments but q, k, v and the
    destinations (the KernelSlot owner: a launch of this sub sets only those)."""

    __slots__ = ("key", "make", "grid", "local", "args", "fused", "splits")

    def __init__(self, fp: Any, common: _DecodeCommon, call: AttnCall, splits: int,
                 n_cols: int) -> None:
        ctx, queue, device = fp.ctx, fp.queue, fp.be.device
        config = common.config
        bq, sq_arr, hq, _ = call.q.shape
        hkv = call.k.shape[2]
        opts, fused = nd.kernel_options(call, config, splits, common.use_ptx)
        counters = nd.counters(ctx, queue, n_cols * hkv) if fused else common.alibi_buf
        threads = 32 * config[1]
        i64, i32 = np.int64, np.int32
        self.args = [None] * 7 + [
            common.tile_table.buf, common.seq_table.buf, common.alibi_buf, counters,
            *common.geometry, i32(sq_arr), i32(hq), i32(hq // hkv), i32(call.ring),
            i64(bq * sq_arr * hq), *common.scalars]
        self.key = nd.kernel_key(ctx, device, opts)
        self.make = lambda: mma.get_program(ctx, device, opts, "attn_decode_mma.cl")
        self.grid, self.local = (n_cols * threads, hkv, splits), (threads, 1, 1)
        self.fused, self.splits = fused, splits


_DECODE_VARYING = (0, 1, 2, 3, 4, 5, 6)


class _DecodeStep:
    __slots__ = ("common", "sub", "seqs", "tiles")

    def __init__(self, common: _DecodeCommon, sub: _DecodeSub, seqs: np.ndarray,
                 tiles: np.ndarray) -> None:
        self.common, self.sub, self.seqs, self.tiles = common, sub, seqs, tiles

    def run(self, fp: Any, call: AttnCall) -> tuple[Any, Any] | None:
        if not getattr(nd.run, "_attnlib_original", False):
            return None  # run is wrapped (a bench): the full path calls it
        common, sub, queue = self.common, self.sub, fp.queue
        q = call.q
        bq, sq_arr, hq, d = q.shape
        n_out_rows = bq * sq_arr * hq
        out = _pool.empty(queue, (bq, sq_arr, hq, d), q.dtype)
        if call.need_lse:
            lse = _pool.empty(queue, (bq, hq, sq_arr), _F32)
            lse_buf = lse.base_data
        else:
            lse, lse_buf = None, _pool.scratch(queue, n_out_rows * 4)
        splits, fused, spare = sub.splits, sub.fused, common.alibi_buf
        args = sub.args.copy()
        args[0], args[1], args[2] = q.base_data, call.k.base_data, call.v.base_data
        if splits > 1:
            part_o = _pool.scratch(queue, splits * n_out_rows * d * 4)
            part_l = _pool.scratch(queue, splits * n_out_rows * 4)
            args[3:7] = [out.base_data if fused else spare, lse_buf if fused else spare,
                         part_o, part_l]
        else:
            args[3:7] = [out.base_data, lse_buf, spare, spare]
        with launch_lock:
            common.seq_table.put(queue, self.seqs)
            common.tile_table.put(queue, self.tiles)
            evts = [nd.launch(sub.key, sub.make, "attn_decode_mma", queue,
                              sub.grid, sub.local, args, varying=_DECODE_VARYING, owner=sub)]
        if splits > 1 and not fused:
            evts.append(A.launch_merge(fp.be, queue, part_o, n_out_rows * d, part_l,
                                     (n_out_rows, sq_arr * hq, hq, 1), splits, sq_arr, hq, d,
                                     n_out_rows, out.base_data, lse_buf, store_kind(_F32),
                                     store_kind(q.dtype), 0))
        for e in evts:
            if e is not None:
                out.add_event(e)
                if lse is not None:
                    lse.add_event(e)
        return out, lse


def decode_step(fp: Any, call: AttnCall, vals: np.ndarray,
                col: list | None) -> _DecodeStep | None:
    """The step of a plan (``_plan_cache``) for per-sequence values ``vals`` (rows: q_batch,
    q_row0, q_len, k_batch, k_row0, k_len, q_pos0, k_pos0[, causal_hi]); the same tables,
    splits and kernel as :func:`run` with its defaults."""
    common = fp.subs.get("decode")
    if common is None:
        common = fp.subs["decode"] = _DecodeCommon(fp, call)
    block_n = common.config[0]
    if fp.n == 1:  # mma.tables for one sequence, from Python ints
        qb, qr0, ql, kb, kr0, kl, qp0, kp0 = col[:8]
        hi = mma.BIG
        if len(col) == 9:
            hi = min(hi, col[8])
        if call.window_right is not None:
            hi = min(hi, call.window_right)
        lo = -call.window_left if call.window_left is not None else -mma.BIG
        seqs = np.array([[qb, qr0, ql, kb, kr0, kl, qp0 - kp0, lo, hi]], np.int64)
        n_cols = -(-ql // nd.MAX_ROWS)
        tiles = np.zeros((n_cols, 2), np.int32)
        max_k = kl
    else:
        seqs, tiles = mma.tables(call, nd.MAX_ROWS, block_n)
        n_cols, max_k = tiles.shape[0], int(vals[5].max())
    if n_cols == 0:
        return None
    key_tiles = -(-max_k // block_n)
    splits = common.subs.get((n_cols, key_tiles))  # choose_splits loops up to ~70 times
    if splits is None:
        splits = fp.be.num_splits
        if splits is None:
            splits = nd.choose_splits(fp.facts.compute_units, n_cols * call.k.shape[2],
                                      key_tiles, call.head_dim, common.config)
        splits = common.subs[(n_cols, key_tiles)] = max(1, int(splits))
    sub = common.subs.get((splits, n_cols, "sub"))
    if sub is None:
        sub = common.subs[(splits, n_cols, "sub")] = _DecodeSub(fp, common, call, splits, n_cols)
    return _DecodeStep(common, sub, seqs, tiles)


# ---- the prefill kernel ------------------------------------------------------------------------
class _MmaCommon:
    """Per plan: kernel options, block sizes, grid order, and every argument but q, k, v,
    the outputs and the two tables (the defaults of :func:`run`: config, PTX, grid order)."""

    __slots__ = ("block_m", "block_n", "threads", "heads_inner", "key", "make", "args", "name")

    def __init__(self, fp: Any, call: AttnCall) -> None:
        ctx, device = fp.ctx, fp.be.device
        use_ptx = mma.compute_capability(device) is not None and not mma.EMULATE_PTX
        plan = mma.usable_plan(ctx, device, call, use_ptx=use_ptx)
        self.block_m, self.block_n, self.threads = plan.block_m, plan.block_n, plan.threads
        self.heads_inner, self.name = plan.heads_inner, plan.name
        alibi_buf, _, geometry, scalars = mma.kernel_inputs(ctx, call)
        _, sq_arr, hq, _ = call.q.shape
        i32 = np.int32
        self.args = [None] * 7 + [alibi_buf, *geometry, i32(sq_arr), i32(hq),
                                  i32(hq // call.k.shape[2]), i32(call.ring), *scalars]
        self.key = plan.key(ctx, device)
        self.make = plan.make


_MMA_VARYING = (0, 1, 2, 3, 4, 5, 6)


class _MmaStep:
    __slots__ = ("common", "seq_buf", "tile_buf", "grid")

    def __init__(self, common: _MmaCommon, seq_buf: Any, tile_buf: Any, grid: tuple) -> None:
        self.common, self.seq_buf, self.tile_buf, self.grid = common, seq_buf, tile_buf, grid

    def run(self, fp: Any, call: AttnCall) -> tuple[Any, Any] | None:
        if not getattr(mma.run, "_attnlib_original", False):
            return None  # run is wrapped (bench/gpu/probe.py): the full path calls it
        common, queue = self.common, fp.queue
        q = call.q
        bq, sq_arr, hq, _ = q.shape
        out = _pool.empty(queue, (bq, sq_arr, hq, call.v.shape[3]), q.dtype)
        if call.need_lse:
            lse = _pool.empty(queue, (bq, hq, sq_arr), _F32)
            lse_buf = lse.base_data
        else:
            lse, lse_buf = None, _pool.scratch(queue, bq * sq_arr * hq * 4)
        args = common.args.copy()
        args[0:7] = [q.base_data, call.k.base_data, call.v.base_data, out.base_data, lse_buf,
                     self.tile_buf, self.seq_buf]
        evt = mma.launch(common.key, common.make, common.name, queue,
                         self.grid, (common.threads, 1), args, varying=_MMA_VARYING,
                         owner=common)
        if evt is not None:
            out.add_event(evt)
            if lse is not None:
                lse.add_event(evt)
        return out, lse


def mma_step(fp: Any, call: AttnCall, vals: np.ndarray) -> _MmaStep | None:
    """The step of a plan (``_plan_cache``) for its current per-sequence values: the tables
    of :func:`run` (memoised by value, as there) and the grid they give."""
    common = fp.subs.get("mma")
    if common is None:
        common = fp.subs["mma"] = _MmaCommon(fp, call)
    seq_buf, tile_buf, n_tiles = mma.tables_on_device(fp.ctx, call, common.block_m,
                                                       common.block_n)
    if n_tiles == 0:
        return None
    hq, threads = call.q.shape[2], common.threads
    grid = (n_tiles * hq * threads, 1) if common.heads_inner else (n_tiles * threads, hq)
    return _MmaStep(common, seq_buf, tile_buf, grid)
