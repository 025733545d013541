"""The attention primitive on OpenCL: one tiled kernel (kernels/attn_fwd.cl) for dense, varlen,
streaming chunks, the (ring) KV cache and paged K/V pools, plus split-KV (flash-decoding) with a
merge pass.

Paged calls (``AttnCall.block_table``) build the kernel with ``-DPAGE_SIZE``: each K/V row is
found through the block table (``KV_ROW`` in the kernel), whose entries the kernel clamps into
the pool, so a device-resident table is used as given and no read leaves the pool.

Quantized calls (``AttnCall.k_scales``) build it with ``-DKV_FORMAT``: k and v are read as 8-bit
codes with their scales and dequantized as each tile is staged (the scalar staging path)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import UnsupportedError
from . import _pool, _runtime, _switches
from ._arrays import (
    DevView,
    acc_dtype,
    device_view,
    dummy_buffer,
    host_strides,
    is_cl_array,
    store_kind,
    upload,
)
from ._family import ArgList, Family, Plan
from ._nvidia_tables import _device_copy, _memoised
from ._runtime import KernelConfig, launch_lock, program

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend

INT_MAX = 2**31 - 1
_UNBOUNDED = 1 << 40  # a window side that is None
#: packed query rows (q_len * group) up to which a call takes the decode tiling
DECODE_ROWS = 8


@dataclass(frozen=True)
class FwdConfig(KernelConfig):
    HEAD_DIM: int
    HEAD_DIM_V: int
    BLOCK_M: int
    BLOCK_N: int
    THREADS_M: int
    THREADS_N: int
    D_VEC: int
    V_VEC: int
    LOAD_VEC: bool
    STORE_KIND: int
    ACC_KIND: int
    MASK_KIND: int
    HAS_ALIBI: bool
    HAS_SOFTCAP: bool
    SPLIT: bool
    TREE_MAX: bool = False
    STAGE: int = 8
    CP_ASYNC: bool = False  # K/V tiles staged by NVIDIA's cp.async instead of registers
    CP_ASYNC_EMULATE: bool = False  # plain copies in cp.async's place (any device; tests)
    CPU_VEC: int = 0  # CPU devices: one work-item per block, register tiles of 8/16-wide vectors
    PAGE_SIZE: int = 0  # paged K/V pools: rows found through the block table


@dataclass(frozen=True)
class QuantFwdConfig(FwdConfig):
    """attn_fwd.cl over 8-bit K/V with scales: the load variant KV_FORMAT (the format's
    ``attnlib._quant.KVFormat.code``; other calls build without it, which the kernel reads as 0)."""

    KV_FORMAT: int = 1


@dataclass(frozen=True)
class MergeConfig(KernelConfig):
    IN_KIND: int
    STORE_KIND: int
    ACC_KIND: int
    WG: int
    G: int  # groups of work-items splitting the states; WG / G columns per work-group


#: merge.cl: work-items per work-group, and columns per work-group (the rest split the states)
MERGE_WG, MERGE_COLS = 128, 32


def launch_merge(be: OpenCLBackend, queue: Any, outs: Any, o_stride: int, lses: Any,
                 l_strides: tuple[int, int, int, int], n_states: int, s: int, h: int, dv: int,
                 n_rows: int, out: Any, lse: Any, in_kind: int, out_kind: int,
                 acc_kind: int, sinks: Any = None) -> Any:
    """Enqueue merge.cl over ``n_states`` partial states (layout in merge.cl's header; ``l_strides``
    = (state, batch, query row, head) strides of the LSEs) into ``out`` / ``lse``; its event.
    Work-groups take MERGE_COLS columns of a row each and split the states over the rest of their
    work-items. ``sinks``: a buffer of float32 ``(h,)`` attention sinks folded in after the merge
    (None: none; a run-time argument, the same build either way)."""
    wg = min(MERGE_WG, pow2_floor(be.facts.max_work_group))
    cw = min(MERGE_COLS, _next_pow2(dv), wg)
    cfg = _merge_cfg(in_kind, out_kind, acc_kind, wg, wg // cw)
    i64, i32 = np.int64, np.int32
    args = [outs, i64(o_stride), lses, *(i64(x) for x in l_strides), i32(n_states), i32(s),
            i32(h), i32(dv), i64(n_rows), out, lse,
            dummy_buffer(queue.context) if sinks is None else sinks, i32(0 if sinks is None else h)]
    return be.launch(queue.context, queue, "merge.cl", cfg, "merge_states",
                     (wg * -(-dv // cw), n_rows), (wg, 1), args)


@functools.lru_cache(maxsize=64)
def _merge_cfg(in_kind: int, out_kind: int, acc_kind: int, wg: int, g: int) -> MergeConfig:
    return MergeConfig(IN_KIND=in_kind, STORE_KIND=out_kind, ACC_KIND=acc_kind, WG=wg, G=g)


def vec_widths(d: int, dv: int, threads_n: int) -> tuple[int, int, int]:
    """(D_VEC, V_VEC, DV_PAD): 4-vector reads along D when D % 4 == 0; 4-wide output chunks
    when that pads Dv by at most a quarter."""
    d_vec = 4 if d % 4 == 0 else 1
    pad4 = -(-dv // (4 * threads_n)) * 4 * threads_n
    v_vec = 4 if pad4 * 4 <= dv * 5 else 1
    dv_pad = pad4 if v_vec == 4 else -(-dv // threads_n) * threads_n
    return d_vec, v_vec, dv_pad


def local_bytes(bm: int, bn: int, tn: int, d: int, dv: int, acc_bytes: int,
                kv_bytes: int) -> int:
    """__local memory of one attn_fwd work-group (mirrors the arrays declared in the kernel);
    K/V tiles hold ``kv_bytes`` per element (2: 16-bit storage staged raw)."""
    d_vec, _, dv_pad = vec_widths(d, dv, tn)
    ld = d + (4 if d_vec == 4 else 1)
    return (acc_bytes * (bm * ld + bm * (bn + 4) + tn * bm + 12)
            + kv_bytes * (bn * max(ld, dv_pad) + 4))


#: the prefill tilings of CPU_VEC (float32 on CPU devices): one work-item per work-group; the
#: taller block from 1024 packed query rows on (staging of K and V shared by more rows)
CPU_VEC_TILES, CPU_VEC_TILES_TALL = (128, 64, 1, 1), (256, 64, 1, 1)


def cpu_vec(facts: Any, tiles: tuple, d: int, dv: int, dtype: np.dtype) -> int:
    """attn_fwd.cl's CPU_VEC: on a CPU device, float32, one work-item per work-group, 8 when it
    divides D, Dv and BLOCK_N; else 0 (off). Never 16: see the kernel's header (PoCL's AVX-512
    ABI mismatch on CPUs its LLVM cannot name)."""
    if not (facts.is_cpu and np.dtype(dtype) == np.float32 and tuple(tiles[2:]) == (1, 1)):
        return 0
    return 8 if d % 8 == 0 and dv % 8 == 0 and tiles[1] % 8 == 0 else 0


#: the fallbacks every device tries last, largest first: (8, 4, 2, 4) keeps D = Dv = 256 within
#: 32 KiB of __local memory in float64 too (25856 bytes; float32 at (8, 8, 2, 4): 17216)
SMALL_TILES = [(16, 16, 4, 4), (8, 8, 2, 4), (8, 4, 2, 4)]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1): a work-group size within a device's limit."""
    return 1 << (int(n).bit_length() - 1)


def choose_tiles(
    facts: Any, rows: int, d: int, dv: int, acc_bytes: int, kv_bytes: int, override: tuple | None
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N) for this device and call.

    ``rows`` is the largest number of packed query rows (q_len * group) of one sequence. Few rows
    (decoding) take BLOCK_M = rows rounded up to a power of two with one row per work-item and
    wide key tiles; otherwise the largest prefill tiling whose __local arrays fit the device.
    Only device queries decide: the device type (CPU or not), the __local budget and the most
    work-items a work-group may hold (THREADS_M * THREADS_N), never a vendor's name.
    """
    if override is not None:
        return tuple(override)  # type: ignore[return-value]
    if facts.simulator:  # Oclgrind interprets every work-item: small tiles, several per call
        cands = [(min(_next_pow2(rows), 8), 8, min(_next_pow2(rows), 4), 4)]
    elif rows <= DECODE_ROWS:
        bm = _next_pow2(rows)
        if facts.is_cpu:
            cands = [(bm, 32, bm, 8)]
        else:  # all packed rows in one work-item row, 64 work-items streaming the keys
            cands = [(bm, 64, 1, 64), (bm, 32, 1, 32), (bm, 16, 1, 16)]
    elif facts.is_cpu:  # PoCL: larger per-work-item tiles measured faster than many items
        cands = [(32, 32, 8, 4)]
        if acc_bytes == 4 and kv_bytes == 4 and d % 8 == 0 and dv % 8 == 0:
            # float32: the CPU_VEC kernel (see cpu_vec)
            cands.insert(0, CPU_VEC_TILES_TALL if rows >= 1024 else CPU_VEC_TILES)
    else:
        cands = [(64, 64, 8, 16), (32, 32, 8, 8), (16, 32, 4, 8)]
        if d <= 64 and dv <= 64:  # faster on the H200 at float32 D=64 (bench/RESULTS.md)
            cands.insert(0, (128, 64, 16, 8))
    cands += SMALL_TILES
    for bm, bn, tm, tn in cands:
        if (local_bytes(bm, bn, tn, d, dv, acc_bytes, kv_bytes) <= facts.local_budget
                and tm * tn <= facts.max_work_group):
            return bm, bn, tm, tn
    smallest = cands[-1]
    need = local_bytes(smallest[0], smallest[1], smallest[3], d, dv, acc_bytes, kv_bytes)
    raise UnsupportedError(
        f"opencl: head dims D={d}, Dv={dv} need {need} bytes of __local memory even with the "
        f"smallest tiling {smallest} (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N); device "
        f"{facts.name!r} allows {facts.local_budget}. Use the numba or numpy backend for these "
        "head dims"
    )


def choose_splits(facts: Any, n_groups: int, key_tiles: int, override: int | None) -> int:
    """Key splits per block (flash-decoding): enough work-groups to fill every compute unit
    several times over, each split keeping at least two key tiles."""
    if override is not None:
        return max(1, int(override))
    # GPUs: ~8 work-groups per compute unit keep enough loads in flight to stream the cache
    target = facts.compute_units * (1 if facts.is_cpu else 8)
    if n_groups >= target or key_tiles < 4:
        return 1
    return max(1, min(-(-target // n_groups), key_tiles // 2))


def cp_async_mode(be: OpenCLBackend, views: list, vec_staging: bool,
                  dtype: np.dtype) -> tuple[bool, bool]:
    """(CP_ASYNC, CP_ASYNC_EMULATE): whether K/V tiles are staged with NVIDIA's cp.async (sm_80+,
    16- or 32-bit storage, vector staging, K/V offsets and strides in whole 4-element chunks so
    every copy is aligned) instead of through registers: faster on the H200 for decode from long
    caches (bench/RESULTS.md)."""
    if not vec_staging or dtype == np.float64:
        return False, False
    force = _switches.CP_ASYNC_FORCE
    if force is not None and not _has_cp_async(be):
        return force, force
    if not _has_cp_async(be) or not all(
            vw.offset % 4 == 0 and all(st % 4 == 0 for st in vw.strides[:3])
            for vw in views[1:]):
        return False, False
    return force is not False, False


def _has_cp_async(be: OpenCLBackend) -> bool:
    if be.facts.is_cpu:
        return False
    from ._nvidia_mma import compute_capability

    cc = compute_capability(be.device)
    return cc is not None and cc[0] >= 8


def descriptor(call: AttnCall, rows: np.ndarray, bm: int) -> tuple[np.ndarray, int]:
    """The kernel's int32 table: 9 fields per sequence, then (sequence, first packed row) per
    work-group column; and the number of those columns. Small tables (every decode step) are
    built from Python ints, cheaper than numpy's operations on tiny arrays."""
    n_seq = call.n_seq
    n_blocks = -(-rows // bm)
    n_groups = int(n_blocks.sum())
    chi = np.full(n_seq, INT_MAX) if call.causal_hi is None else call.causal_hi
    fields = (call.q_batch, call.q_row0, call.q_len, call.k_batch, call.k_row0, call.k_len,
              call.q_pos0, call.k_pos0, chi)
    if 9 * n_seq + 2 * n_groups <= 1024:
        head = [x for row in zip(*(f.tolist() for f in fields)) for x in row]
        table = [x for s, nb in enumerate(n_blocks.tolist()) for g in range(nb)
                 for x in (s, g * bm)]
        return np.array(head + table, np.int32), n_groups
    desc = np.empty(9 * n_seq + 2 * n_groups, np.int32)
    desc[:9 * n_seq].reshape(n_seq, 9)[:] = np.stack(fields, axis=1)
    table = desc[9 * n_seq:].reshape(n_groups, 2)
    table[:, 0] = np.repeat(np.arange(n_seq), n_blocks)
    table[:, 1] = (np.arange(n_groups) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)) * bm
    return desc, n_groups


class Portable(Family):
    """kernels/attn_fwd.cl on any OpenCL device: every call (paged pools, quantized K/V, masks,
    ALiBi included); the last family the dispatch tries."""

    name = "portable"

    def plan_rows(self, max_rows: int) -> int:
        return max_rows  # the tiling follows the packed rows (decode tiles up to DECODE_ROWS)

    def applicable(self, be: OpenCLBackend, call: AttnCall, max_rows: int) -> str | None:
        return None

    def plan(self, be: OpenCLBackend, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        return PortablePlan(be, queue, call, max_rows)


def geometry(x: Any) -> DevView:
    """The element offset and strides the kernel reads ``x`` with (no buffer): in place for a
    device array, as :func:`~._arrays.upload` lays out a host array."""
    if x.size == 0 or (is_cl_array(x) and x.base_data is None):
        return DevView(None, 0, (0,) * x.ndim)
    if is_cl_array(x):
        item = x.dtype.itemsize
        return DevView(None, x.offset // item, tuple(s // item for s in x.strides))
    return DevView(None, 0, host_strides(x))


class PortablePlan(Plan):
    """What a call description and its largest packed row count fix on attn_fwd.cl: tiling,
    build options (no split / split), the argument list (:class:`~._family.ArgList`) with the
    per-call slots left to fill, and the descriptor's device table. ``parts``: :meth:`enqueue`
    takes the split build even for one split, keeps its partial states and returns their
    buffers (outs, lses) in merge.cl's layout, unmerged, sinks not folded
    (``_dispatch.attention_parts``)."""

    def __init__(self, be: OpenCLBackend, queue: Any, call: AttnCall, max_rows: int,
                 parts: bool = False) -> None:
        self.parts = parts
        self.ctx = ctx = queue.context
        self.be, self.queue = be, queue
        dtype = call.dtype
        acc = acc_dtype(dtype)
        self.lse_dtype = acc
        bq, sq_arr, hq, d = call.q.shape
        hkv, dv = call.n_kv_heads, call.head_dim_v
        views = [geometry(x) for x in (call.q, call.k, call.v)]
        fmt = kv_format(call)  # 8-bit K/V: staged dequantized, as acc_t, by scalar loads
        kv_bytes = 2 if dtype.itemsize == 2 and not fmt else acc.itemsize
        bm, bn, tmh, tnh = tiles = choose_tiles(be.facts, max_rows, d, dv, acc.itemsize,
                                                kv_bytes, be.tiles)
        d_vec, v_vec, dv_pad = vec_widths(d, dv, tnh)
        load_vec = (d_vec == 4 and dv % 4 == 0 and dv_pad % 4 == 0 and not fmt
                    and all(vw.strides[3] == 1 for vw in views))
        cp_mode, cp_emulate = cp_async_mode(be, views, load_vec, dtype)
        self.mask_kind = (0 if call.mask_view is None
                          else 1 if call.options.mask_kind == "bool" else 2)
        config = QuantFwdConfig if fmt else FwdConfig
        extra = {"KV_FORMAT": fmt} if fmt else {}
        self.cfgs = tuple(config(
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=bm, BLOCK_N=bn, THREADS_M=tmh,
            THREADS_N=tnh, D_VEC=d_vec, V_VEC=v_vec, LOAD_VEC=load_vec,
            STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64),
            MASK_KIND=self.mask_kind, HAS_ALIBI=call.options.alibi is not None,
            HAS_SOFTCAP=call.options.softcap is not None, SPLIT=split, TREE_MAX=tnh >= 32,
            CP_ASYNC=cp_mode, CP_ASYNC_EMULATE=cp_emulate,
            CPU_VEC=0 if fmt else cpu_vec(be.facts, tiles, d, dv, dtype),
            PAGE_SIZE=int(call.page_size or 0) if call.block_table is not None else 0, **extra)
            for split in (False, True))
        self.tiles = tiles
        opts = [c.options() for c in self.cfgs]
        self.keys = [(ctx.int_ptr, "attn_fwd.cl", "attn_fwd", o) for o in opts]
        self.makes = [functools.partial(program, ctx, "attn_fwd.cl", o) for o in opts]
        wl = _UNBOUNDED if call.options.window_left is None else int(call.options.window_left)
        wr = _UNBOUNDED if call.options.window_right is None else int(call.options.window_right)
        i64, i32, f = np.int64, np.int32, acc.type
        self.n_out_rows = n_out_rows = bq * sq_arr * hq
        dummy = dummy_buffer(ctx)
        a = ArgList()  # attn_fwd's parameters, in order
        for name, view in zip("qkv", views):
            a.add(name, None)
            a.add(name + "_geometry", i64(view.offset), *(i64(s) for s in view.strides))
        a.add("desc", None)
        a.add("options", i32(call.n_seq), i32(call.ring), i64(wl), i64(wr), f(call.options.scale),
              f(call.options.softcap or 1.0))
        a.add("alibi", dummy)
        a.add("mask", dummy, *(i64(0) for _ in range(5)))
        a.add("out", None)
        a.add("lse", None)
        a.add("shape", i32(sq_arr), i32(hq), i64(n_out_rows), i32(hq // hkv))
        a.add("sinks", dummy)
        a.add("n_sinks", i32(0 if call.options.sinks is None else hq))
        if call.block_table is not None:  # PAGED_ARGS
            a.add("block_table", *[None] * 6)
        if fmt:  # KV_ARGS: the scales of k and v (buffer, offset, 3 strides each)
            a.add("k_scales", *[None] * 5)
            a.add("v_scales", *[None] * 5)
        self.args = a.values
        self.i_q, self.i_k, self.i_v = a.at("q"), a.at("k"), a.at("v")
        self.i_out, self.i_lse, self.i_sinks = a.at("out"), a.at("lse"), a.at("sinks")
        self.i_alibi, self.s_mask = a.at("alibi"), a.span("mask")
        self.s_table = a.span("block_table") if a.has("block_table") else None
        self.s_scales = (a.span("k_scales"), a.span("v_scales")) if fmt else None
        #: the slots a launch sets (a launch of the same plan compares only these; the
        #: stand-ins of absent options stay as the plan's first launch set them)
        self.varying = a.indices("q", "k", "v", "out", "lse", "sinks", "block_table",
                                 "k_scales", "v_scales",
                                 *(["alibi"] if call.options.alibi is not None else []),
                                 *(["mask"] if self.mask_kind else []))
        self.owners = (object(), object())  # the KernelSlot owner of each split mode
        self.group = hq // hkv
        self.grid_y = hkv
        self.nt = tmh * tnh
        n = call.n_seq
        self.table = _pool.DeviceTable(queue, 4 * (9 * n + 2 * n * -(-max_rows // bm)),
                                       not be.facts.simulator)
        self.args[a.at("desc")] = self.table.buf
        self.merge_kinds = (store_kind(acc), store_kind(dtype), int(acc == np.float64))
        self.geom = (sq_arr, hq, dv, acc.itemsize)

    def step(self, call: AttnCall, vals: np.ndarray, col: list | None) -> Any:
        bm, bn = self.tiles[0], self.tiles[1]
        if col is not None:  # one sequence: the descriptor from Python ints
            rows = col[2] * self.group
            head = col if len(col) == 9 else col + [INT_MAX]
            nb = -(-rows // bm)
            desc = np.array(head + [x for g in range(nb) for x in (0, g * bm)], np.int32)
            n_groups, max_k = nb, col[5]
        else:
            desc, n_groups = descriptor(call, vals[2] * self.group, bm)
            max_k = int(vals[5].max())
        if n_groups == 0:
            return None
        splits = choose_splits(self.be.facts, n_groups * self.grid_y, -(-max_k // bn),
                               self.be.num_splits)
        return desc.tobytes(), n_groups, splits

    def enqueue(self, step: Any, call: AttnCall, out: Any, lse: Any, keep: Any) -> list:
        desc, n_groups, splits = step
        queue, ctx = self.queue, self.ctx
        args = self.args.copy()
        q, k, v = call.q, call.k, call.v
        if (isinstance(q, np.ndarray) or isinstance(k, np.ndarray) or q.base_data is None
                or k.base_data is None or v.base_data is None):  # host or empty arrays
            args[self.i_q], args[self.i_k], args[self.i_v] = (device_view(ctx, x).buf
                                                              for x in (q, k, v))
        else:
            args[self.i_q], args[self.i_k], args[self.i_v] = q.base_data, k.base_data, v.base_data
        if call.options.alibi is not None:
            args[self.i_alibi] = _pool.upload(queue, np.ascontiguousarray(call.options.alibi,
                                                                          np.float32), keep)
        if self.mask_kind:
            mv = call.mask_view
            base = mv[tuple(slice(0, 1) if s == 0 else slice(None) for s in mv.strides)]
            base = base.astype(np.uint8 if self.mask_kind == 1 else self.lse_dtype)
            mdev = upload(ctx, base)
            strides = [0 if n == 1 else s for s, n in zip(mdev.strides, base.shape)]
            args[self.s_mask] = [mdev.buf, *(np.int64(a) for a in (mdev.offset, *strides))]
        if self.s_table is not None:
            args[self.s_table] = table_args(queue, call.block_table, int(call.k.shape[0]), keep)
        if self.s_scales is not None:
            for span, scl in zip(self.s_scales, (call.k_scales, call.v_scales)):
                sv = device_view(ctx, scl)
                args[span] = [sv.buf, *(np.int64(a) for a in (sv.offset, *sv.strides))]
        if call.options.sinks is not None:
            args[self.i_sinks] = _pool.upload(queue, call.options.sinks, keep)
        split = splits > 1 or self.parts
        sq_arr, hq, dv, item = self.geom
        n_out_rows = self.n_out_rows
        if split:
            part_o = _pool.scratch(queue, splits * n_out_rows * dv * item)
            part_l = _pool.scratch(queue, splits * n_out_rows * item)
            args[self.i_out], args[self.i_lse] = part_o, part_l
        else:
            args[self.i_out], args[self.i_lse] = out, lse
        nt = self.nt
        with launch_lock:
            self.table.put(queue, desc)
            evt = _runtime.launch(self.keys[split], self.makes[split], "attn_fwd", queue,
                                  (n_groups * nt, self.grid_y, splits), (nt, 1, 1), args,
                                  varying=self.varying, owner=self.owners[split])
        if self.parts:  # the partial states' buffers, not events
            return [part_o, part_l]
        if not split:
            return [evt]
        in_kind, out_kind, acc_kind = self.merge_kinds
        return [evt, launch_merge(self.be, queue, part_o, n_out_rows * dv, part_l,
                                  (n_out_rows, sq_arr * hq, hq, 1), splits, sq_arr, hq, dv,
                                  n_out_rows, out, lse, in_kind, out_kind, acc_kind,
                                  args[self.i_sinks] if call.options.sinks is not None else None)]


def kv_format(call: AttnCall) -> int:
    """attn_fwd.cl's KV_FORMAT of ``call``: its 8-bit format's code, 0 when not quantized."""
    if call.k_scales is None:
        return 0
    from ... import _quant

    return _quant.format_of(call.k.dtype).code


#: host block tables up to this size are kept on the device by value (the tables memo of
#: _nvidia_tables: never written, shared by calls); larger ones are uploaded per call
TABLE_MEMO_BYTES = 64 * 1024


def table_args(queue: Any, table: Any, n_pages: int, keep: Any) -> list:
    """(buffer, offset, row stride, column stride, width, n_pages) of a paged call's block
    table: a host table is uploaded as int32 (small ones once per value: a cache's table
    changes only when a sequence takes or drops a page); a device table is read in place
    (int32) or converted on the device (int64), never checked (the kernel clamps what it
    reads)."""
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
    elif table.nbytes <= TABLE_MEMO_BYTES:  # a decode step's table changes once a page
        ctx = queue.context
        key = ("block table", ctx.int_ptr, table.shape, table.tobytes())
        buf, off, st = _memoised(key, lambda: _device_copy(ctx, table)), 0, (width, 1)
    else:
        buf, off, st = _pool.upload(queue, table, keep), 0, (width, 1)
    return [buf, i64(off), i64(st[0]), i64(st[1]), i32(width), i32(n_pages)]
