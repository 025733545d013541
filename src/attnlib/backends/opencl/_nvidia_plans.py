"""Repeat calls (see _plan_cache) on the NVIDIA tensor-core kernels: what a plan fixes for the
decode kernel (``_nvidia_decode``) and the prefill kernel (``_nvidia_mma``), with exactly the
tables, splits, options, grid and arguments their ``run`` makes with its defaults."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import AttnCall
from . import _nvidia_decode as nd
from . import _nvidia_mma as mma
from . import _nvidia_tables as nt
from . import _pool
from ._attention import table_args
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
        self.seq_table = _pool.DeviceTable(ctx, 8 * nt.SEQ_FIELDS * fp.n, fill)
        self.tile_table = _pool.DeviceTable(ctx, 8 * fp.n, fill)
        self.alibi_buf, _, self.geometry, self.scalars = nt.kernel_inputs(ctx, call)
        self.use_ptx = (mma.compute_capability(fp.be.device) is not None
                        and not nd.EMULATE_PTX)
        self.config = tuple(nd.DEFAULT_CONFIGS[call.head_dim])
        self.subs: dict = {}


class _DecodeStep:
    __slots__ = ("common", "sub", "seqs", "tiles")

    def __init__(self, common: _DecodeCommon, sub: nd.DecodePlan, seqs: np.ndarray,
                 tiles: np.ndarray) -> None:
        self.common, self.sub, self.seqs, self.tiles = common, sub, seqs, tiles

    def run(self, fp: Any, call: AttnCall) -> tuple[Any, Any] | None:
        if not getattr(nd.run, "_attnlib_original", False):
            return None  # run is wrapped (a bench): the dispatch calls it
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
        table = None
        if call.block_table is not None:
            table = table_args(queue, call.block_table, int(call.k.shape[0]), out)
        with launch_lock:
            common.seq_table.put(queue, self.seqs)
            common.tile_table.put(queue, self.tiles)
            sinks = None if call.options.sinks is None else nt.sinks_input(queue, call, out)[0]
            evts = sub.enqueue(fp.be, queue, call, q.base_data, call.k.base_data,
                               call.v.base_data, out.base_data, lse_buf, owner=sub, table=table,
                               sinks=sinks)
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
        hi = nt.BIG
        if len(col) == 9:
            hi = min(hi, col[8])
        if call.options.window_right is not None:
            hi = min(hi, call.options.window_right)
        lo = -call.options.window_left if call.options.window_left is not None else -nt.BIG
        seqs = np.array([[qb, qr0, ql, kb, kr0, kl, qp0 - kp0, lo, hi]], np.int64)
        n_cols = -(-ql // nd.MAX_ROWS)
        tiles = np.zeros((n_cols, 2), np.int32)
    else:
        seqs, tiles = nt.tables(call, nd.MAX_ROWS, block_n)
        n_cols = tiles.shape[0]
    if n_cols == 0:
        return None
    # the plan's key fixes k's shape: one split count per work-group count, whatever the lengths
    splits = common.subs.get(n_cols)  # choose_splits loops up to ~70 times
    if splits is None:
        splits = fp.be.num_splits
        if splits is None:
            splits = nd.choose_splits(fp.facts.compute_units, n_cols * call.k.shape[2],
                                      nd.split_key_tiles(call, block_n), call.head_dim,
                                      common.config)
        splits = common.subs[n_cols] = max(1, int(splits))
    sub = common.subs.get((splits, n_cols, "sub"))
    if sub is None:
        sub = common.subs[(splits, n_cols, "sub")] = nd.DecodePlan(
            fp.queue, fp.be.device, call, common.config, splits, n_cols, common.use_ptx, None,
            common.tile_table.buf, common.seq_table.buf, common.alibi_buf, common.geometry,
            common.scalars)
    return _DecodeStep(common, sub, seqs, tiles)


# ---- the prefill kernel ------------------------------------------------------------------------
class _MmaCommon:
    """Per plan: the prefill kernel's plan with the defaults of :func:`run` (config, PTX, grid
    order), every argument but the call slots filled."""

    __slots__ = ("block_m", "block_n", "plan")

    def __init__(self, fp: Any, call: AttnCall) -> None:
        ctx, device = fp.ctx, fp.be.device
        use_ptx = mma.compute_capability(device) is not None and not mma.EMULATE_PTX
        kernel = mma.usable_plan(ctx, device, call, use_ptx=use_ptx)
        self.block_m, self.block_n = kernel.block_m, kernel.block_n
        alibi_buf, _, geometry, scalars = nt.kernel_inputs(ctx, call)
        self.plan = mma.PrefillPlan(ctx, device, kernel, call, alibi_buf, geometry, scalars)


class _MmaStep:
    __slots__ = ("common", "seq_buf", "tile_buf", "n_tiles")

    def __init__(self, common: _MmaCommon, seq_buf: Any, tile_buf: Any, n_tiles: int) -> None:
        self.common, self.seq_buf, self.tile_buf, self.n_tiles = common, seq_buf, tile_buf, n_tiles

    def run(self, fp: Any, call: AttnCall) -> tuple[Any, Any] | None:
        if not getattr(mma.run, "_attnlib_original", False):
            return None  # run is wrapped (a bench): the dispatch calls it
        common, queue = self.common, fp.queue
        q = call.q
        bq, sq_arr, hq, _ = q.shape
        out = _pool.empty(queue, (bq, sq_arr, hq, call.v.shape[3]), q.dtype)
        if call.need_lse:
            lse = _pool.empty(queue, (bq, hq, sq_arr), _F32)
            lse_buf = lse.base_data
        else:
            lse, lse_buf = None, _pool.scratch(queue, bq * sq_arr * hq * 4)
        sinks = None if call.options.sinks is None else nt.sinks_input(queue, call, out)[0]
        evt = common.plan.enqueue(queue, q.base_data, call.k.base_data, call.v.base_data,
                                  out.base_data, lse_buf, self.tile_buf, self.seq_buf,
                                  self.n_tiles, hq, owner=common, sinks=sinks)
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
    seq_buf, tile_buf, n_tiles = nt.tables_on_device(fp.ctx, call, common.block_m,
                                                       common.block_n)
    if n_tiles == 0:
        return None
    return _MmaStep(common, seq_buf, tile_buf, n_tiles)
