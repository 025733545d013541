"""The attention primitive on OpenCL: one tiled kernel (kernels/attn_fwd.cl) for dense, varlen,
streaming chunks and the (ring) KV cache, plus split-KV (flash-decoding) with a merge pass."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import UnsupportedError
from . import _pool
from ._arrays import acc_dtype, device_view, dummy_buffer, is_cl_array, store_kind, upload
from ._runtime import KernelConfig

_fast: dict = {}  # the fast plans of _fastpath, dropped with _plans

if TYPE_CHECKING:
    from ..base import AttnCall
    from . import OpenCLBackend

_INT_MAX = 2**31 - 1
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
                 acc_kind: int) -> Any:
    """Enqueue merge.cl over ``n_states`` partial states (layout in merge.cl's header; ``l_strides``
    = (state, batch, query row, head) strides of the LSEs) into ``out`` / ``lse``; its event.
    Work-groups take MERGE_COLS columns of a row each and split the states over the rest of their
    work-items."""
    cw = min(MERGE_COLS, _next_pow2(dv))
    cfg = _merge_cfg(in_kind, out_kind, acc_kind, MERGE_WG // cw)
    i64, i32 = np.int64, np.int32
    args = [outs, i64(o_stride), lses, *(i64(x) for x in l_strides), i32(n_states), i32(s),
            i32(h), i32(dv), i64(n_rows), out, lse]
    return be.launch(queue.context, queue, "merge.cl", cfg, "merge_states",
                     (MERGE_WG * -(-dv // cw), n_rows), (MERGE_WG, 1), args)


@functools.lru_cache(maxsize=64)
def _merge_cfg(in_kind: int, out_kind: int, acc_kind: int, g: int) -> MergeConfig:
    return MergeConfig(IN_KIND=in_kind, STORE_KIND=out_kind, ACC_KIND=acc_kind, WG=MERGE_WG, G=g)


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


#: the fallbacks every device tries last, largest first: (8, 4, 2, 4) keeps D = Dv = 256 within
#: 32 KiB of __local memory in float64 too (25856 bytes; float32 at (8, 8, 2, 4): 17216)
SMALL_TILES = [(16, 16, 4, 4), (8, 8, 2, 4), (8, 4, 2, 4)]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_tiles(
    facts: Any, rows: int, d: int, dv: int, acc_bytes: int, kv_bytes: int, override: tuple | None
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N) for this device and call.

    ``rows`` is the largest number of packed query rows (q_len * group) of one sequence. Few rows
    (decoding) take BLOCK_M = rows rounded up to a power of two with one row per work-item and
    wide key tiles; otherwise the largest prefill tiling whose __local arrays fit the device.
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
    else:
        cands = [(64, 64, 8, 16), (32, 32, 8, 8), (16, 32, 4, 8)]
        if d <= 64 and dv <= 64:  # H200 fp32 D=64: 24.6 TFLOP/s vs 18.5 (bench/RESULTS.md)
            cands.insert(0, (128, 64, 16, 8))
    cands += SMALL_TILES
    for bm, bn, tm, tn in cands:
        if local_bytes(bm, bn, tn, d, dv, acc_bytes, kv_bytes) <= facts.local_budget:
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


#: ATTNLIB_OPENCL_CP_ASYNC=0/1 forces the K/V staging (A/B runs, tests): on devices without
#: cp.async, 1 builds with CP_ASYNC_EMULATE (plain copies, the same tile walk)
CP_ASYNC_FORCE: bool | None = (os.environ["ATTNLIB_OPENCL_CP_ASYNC"] not in ("", "0")
                               if os.environ.get("ATTNLIB_OPENCL_CP_ASYNC") else None)


def cp_async_mode(be: OpenCLBackend, views: list, vec_staging: bool,
                  dtype: np.dtype) -> tuple[bool, bool]:
    """(CP_ASYNC, CP_ASYNC_EMULATE): whether K/V tiles are staged with NVIDIA's cp.async (sm_80+,
    16- or 32-bit storage, vector staging, K/V offsets and strides in whole 4-element chunks so
    every copy is aligned) instead of through registers. On the H200 (bench/RESULTS.md, third
    session) it beat registers by 11-13% on decode from 8192 tokens at B=8 and at 131072."""
    if not vec_staging or dtype == np.float64:
        return False, False
    if CP_ASYNC_FORCE is not None and not _has_cp_async(be):
        return CP_ASYNC_FORCE, CP_ASYNC_FORCE
    if not _has_cp_async(be) or not all(
            vw.offset % 4 == 0 and all(st % 4 == 0 for st in vw.strides[:3])
            for vw in views[1:]):
        return False, False
    return CP_ASYNC_FORCE is not False, False


def _has_cp_async(be: OpenCLBackend) -> bool:
    if be.facts.is_cpu:
        return False
    from ._nvidia_mma import compute_capability

    cc = compute_capability(be.device)
    return cc is not None and cc[0] >= 8


def _descriptor(call: AttnCall, rows: np.ndarray, bm: int) -> tuple[np.ndarray, int]:
    """The kernel's int32 table: 9 fields per sequence, then (sequence, first packed row) per
    work-group column; and the number of those columns. Small tables (every decode step) are
    built from Python ints, which costs ~3 us where numpy's operations on tiny arrays cost ~15."""
    n_seq = call.n_seq
    n_blocks = -(-rows // bm)
    n_groups = int(n_blocks.sum())
    chi = np.full(n_seq, _INT_MAX) if call.causal_hi is None else call.causal_hi
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


@dataclass
class _Plan:
    """What a call's geometry fixes: tiling, kernel configs (no split / split) and the kernel's
    argument list with the per-call slots (q, k, v buffers, descriptor, mask, alibi, outputs)
    left to fill. Decode steps repeat one geometry; the plan is made once for it."""

    tiles: tuple[int, int, int, int]
    cfgs: tuple[Any, Any]
    args: list


class _PlanDict(dict):
    """The plans by geometry; clearing it (tests, benches that change a module setting) drops
    the fast plans made from them too."""

    def clear(self) -> None:
        super().clear()
        _fast.clear()


_plans: dict[tuple, _Plan] = _PlanDict()
_PLANS_MAX = 512
# argument slots the call fills (see _make_plan's argument order)
_Q, _K, _V, _DESC, _ALIBI, _MASK, _DST = 0, 6, 12, 18, 25, 26, 32


def _plan_key(be: OpenCLBackend, queue: Any, call: AttnCall, views: list, max_rows: int,
              mask_kind: int) -> tuple:
    return (id(be), queue.int_ptr, call.dtype, call.q.shape, call.n_kv_heads,
            call.head_dim_v, max_rows, call.n_seq, call.ring, call.scale, call.softcap,
            call.window_left, call.window_right, call.alibi is None, mask_kind,
            *((vw.offset, vw.strides) for vw in views))


def _make_plan(be: OpenCLBackend, call: AttnCall, views: list, max_rows: int,
               mask_kind: int) -> _Plan:
    dtype = call.dtype
    acc = acc_dtype(dtype)
    bq, sq_arr, hq, d = call.q.shape
    hkv, dv = call.n_kv_heads, call.head_dim_v
    kv_bytes = 2 if dtype.itemsize == 2 else acc.itemsize
    bm, bn, tmh, tnh = tiles = choose_tiles(be.facts, max_rows, d, dv, acc.itemsize, kv_bytes,
                                            be.tiles)
    d_vec, v_vec, dv_pad = vec_widths(d, dv, tnh)
    load_vec = (d_vec == 4 and dv % 4 == 0 and dv_pad % 4 == 0
                and all(vw.strides[3] == 1 for vw in views))
    cp_mode, cp_emulate = cp_async_mode(be, views, load_vec, dtype)
    cfgs = tuple(FwdConfig(
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=bm, BLOCK_N=bn, THREADS_M=tmh,
        THREADS_N=tnh, D_VEC=d_vec, V_VEC=v_vec, LOAD_VEC=load_vec,
        STORE_KIND=store_kind(dtype), ACC_KIND=int(acc == np.float64),
        MASK_KIND=mask_kind, HAS_ALIBI=call.alibi is not None,
        HAS_SOFTCAP=call.softcap is not None, SPLIT=split, TREE_MAX=tnh >= 32,
        CP_ASYNC=cp_mode, CP_ASYNC_EMULATE=cp_emulate) for split in (False, True))
    wl = _UNBOUNDED if call.window_left is None else int(call.window_left)
    wr = _UNBOUNDED if call.window_right is None else int(call.window_right)
    i64, i32, f = np.int64, np.int32, acc.type
    n_out_rows = bq * sq_arr * hq
    args: list[Any] = []
    for view in views:  # slots _Q, _K, _V: buffer, offset, then the four strides
        args += [None, i64(view.offset), *(i64(s) for s in view.strides)]
    args += [None, i32(call.n_seq), i32(call.ring), i64(wl), i64(wr), f(call.scale),
             f(call.softcap or 1.0), None, None, *(i64(0) for _ in range(5))]
    args += [None, None, i32(sq_arr), i32(hq), i64(n_out_rows), i32(hq // hkv)]
    assert len(args) == _DST + 6
    return _Plan(tiles, cfgs, args)


def attention(be: OpenCLBackend, call: AttnCall) -> tuple[Any, Any]:
    res = _fastpath.run(be, call)
    if res is not None:
        return res
    queue = be.queue_for(call.q, call.k, call.v)
    ctx = queue.context
    dtype = call.dtype
    acc = acc_dtype(dtype)
    bq, sq_arr, hq, d = call.q.shape
    hkv, dv = call.n_kv_heads, call.head_dim_v
    n_seq = call.n_seq
    rows = call.q_len.astype(np.int64, copy=False) * (hq // hkv)
    max_rows = int(rows.max()) if n_seq else 0
    if be.use_mma and max_rows > DECODE_ROWS:
        from . import _nvidia_mma  # NVIDIA tensor cores (sm_80+): fp16/bf16, float32 as 3xTF32

        if _nvidia_mma.applicable(be.device, call):
            return _nvidia_mma.run(ctx, queue, be.device, call)
    if be.use_mma and max_rows <= 16:
        from . import _nvidia_decode  # NVIDIA tensor cores (sm_80+), fp16/bf16 decode

        if _nvidia_decode.applicable(be.device, call):
            return _nvidia_decode.run(be, queue, call)
    out = _pool.empty(queue, (bq, sq_arr, hq, dv), dtype)
    host = not is_cl_array(call.q)
    # the LSE is written either way; without need_lse it goes to pooled scratch and the call
    # returns None for it (one pyopencl Array less per decode step)
    n_out_rows = bq * sq_arr * hq
    if call.need_lse or host:
        lse = _pool.empty(queue, (bq, hq, sq_arr), acc)
        lse_buf = lse.data if lse.size else None
    else:
        lse, lse_buf = None, _pool.scratch(queue, n_out_rows * acc.itemsize)
    if out.size == 0 or n_seq == 0:
        return (out.get(), lse.get()) if host else (out, lse)

    mask_kind = 0 if call.mask_view is None else (1 if call.mask_kind == "bool" else 2)
    views = [device_view(ctx, x) for x in (call.q, call.k, call.v)]
    key = _plan_key(be, queue, call, views, max_rows, mask_kind)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(be, call, views, max_rows, mask_kind)
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    bm, bn, tmh, tnh = plan.tiles
    desc, n_groups = _descriptor(call, rows, bm)
    if n_groups == 0:
        return (out.get(), lse.get()) if host else (out, lse)
    key_tiles = -(-int(call.k_len.max()) // bn)
    splits = choose_splits(be.facts, n_groups * hkv, key_tiles, be.num_splits)

    args = plan.args.copy()
    for slot, view in zip((_Q, _K, _V), views):
        args[slot] = view.buf
    args[_DESC] = _pool.upload(queue, desc, out)
    args[_ALIBI] = dummy_buffer(ctx)
    if call.alibi is not None:
        args[_ALIBI] = _pool.upload(queue, np.ascontiguousarray(call.alibi, np.float32), out)
    args[_MASK] = dummy_buffer(ctx)
    if mask_kind:
        mv = call.mask_view
        base = mv[tuple(slice(0, 1) if s == 0 else slice(None) for s in mv.strides)]
        base = base.astype(np.uint8 if mask_kind == 1 else acc)
        mdev = upload(ctx, base)
        strides = [0 if n == 1 else s for s, n in zip(mdev.strides, base.shape)]
        args[_MASK:_MASK + 6] = [mdev.buf, *(np.int64(a) for a in (mdev.offset, *strides))]
    if splits > 1:
        part_o = _pool.scratch(queue, splits * n_out_rows * dv * acc.itemsize)
        part_l = _pool.scratch(queue, splits * n_out_rows * acc.itemsize)
        args[_DST:_DST + 2] = [part_o, part_l]
    else:
        args[_DST:_DST + 2] = [out.data, lse_buf]
    nt = tmh * tnh
    be.launch(ctx, queue, "attn_fwd.cl", plan.cfgs[splits > 1], "attn_fwd",
              (n_groups * nt, hkv, splits), (nt, 1, 1), args)

    if splits > 1:
        launch_merge(be, queue, part_o, n_out_rows * dv, part_l, (n_out_rows, sq_arr * hq, hq, 1),
                     splits, sq_arr, hq, dv, n_out_rows, out.data, lse_buf, store_kind(acc),
                     store_kind(dtype), int(acc == np.float64))
    if host:
        return out.get(), lse.get()
    return out, lse


from . import _fastpath  # noqa: E402  (it imports this module's helpers)
