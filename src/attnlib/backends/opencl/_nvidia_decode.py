"""Decode attention on NVIDIA tensor cores (sm_80+), float16 and bfloat16.

``kernels/attn_decode_mma.cl`` runs calls whose sequences have at most :data:`MAX_ROWS` packed
query rows (q_len * group: the query heads of one kv head packed as rows of one 16-row
``mma.sync`` tile). One work-group per (sequence, kv head, key split); each streams its keys
through cp.async buffers and multiplies with ``mma.sync.m16n8k16`` (float32 accumulators), so the
per-key work is ~2 mma + ~2 ldmatrix + a few dozen softmax instructions per warp and 16 keys,
instead of the portable kernel's ~78 warp instructions per key: the cache streams at memory speed.
With several splits the partial states go to merge.cl (``_attention.launch_merge``, as the
portable path's flash-decoding); with one split the kernel writes out and lse itself.

Covered: every :class:`~attnlib.backends.base.AttnCall` with float16/bfloat16, D == Dv in
:data:`HEAD_DIMS`, no mask, at most 16 packed rows per sequence: causal (any alignment, q_len > 1
included), window, softcap, alibi, GQA/MQA/MHA, ring caches, paged K/V pools (any page size:
``-DPAGE_SIZE``, the block table read through the kernel's pipeline), varlen, any positions; the
LSE is always returned. Hidden keys whose k or v hold inf/NaN do not leak (see the kernel).
Quantized K/V (``AttnCall.k_scales``: fp8 e4m3fn / e5m2 or int8 codes with per-(row, kv head)
scales) build the load variant ``-DKV_FORMAT``: the codes are read (half the bytes of fp16) and
staged as scale * code rounded to the compute dtype. Masks and other head dims go to the portable
kernel.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..base import AttnCall
from . import _nvidia_mma, _nvidia_tables, _pool, _runtime, _switches
from ._arrays import dummy_buffer, is_cl_array, store_kind
from ._attention import launch_merge, table_args
from ._family import ArgList, Family, Plan, per_sequence
from ._runtime import launch_lock

__all__ = ["Decode", "reason", "run", "HEAD_DIMS", "EXTRA_HEAD_DIMS", "MAX_ROWS", "DEFAULT_CONFIGS",
           "choose_splits", "build_options", "kernel_options", "local_bytes", "fused_fits",
           "split_key_tiles"]

#: head dims (D == Dv) the dispatch sends to the kernel
HEAD_DIMS = (64, 128)
#: head dims the kernel also builds for and passes the emulated tests with, not dispatched until
#: checked on the device
EXTRA_HEAD_DIMS = (32, 96, 256)
#: packed query rows (q_len * group) of one sequence the kernel takes: one m16 tile
MAX_ROWS = 16
#: (BLOCK_N, WARPS, STAGES) per head dim. D=128: 128-key tiles, 4 warps of 32 keys, 2 buffers
#: (144 KB of local memory, 221 registers), the fastest on the H200 with the fused merge
#: (bench/RESULTS.md). D=64 and the rest: not swept.
DEFAULT_CONFIGS = {64: (64, 4, 4), 128: (128, 4, 2),
                   32: (64, 4, 4), 96: (48, 3, 4), 256: (64, 4, 2)}
#: keys of one shared-prefix chunk in a cascade call (``attnlib._cascade``, the backend's
#: ``parts_limits``): chunks of the prefix are sequences of their own, so that the prefix's rows,
#: at most MAX_ROWS packed per work-group, spread over many work-groups. Not yet measured on a
#: card (``bench/gpu/run.py --only forks`` sweeps it).
PARTS_KEYS = 1024
#: a split keeps at least this many key tiles (fewer: the fixed cost per work-group dominates)
MIN_TILES_PER_SPLIT = 2
#: shared memory of one SM usable by work-groups (H100/H200: 227 KiB)
SM_LOCAL_BYTES = 227 * 1024
_DTYPES = (np.dtype(np.float16), _nvidia_mma.BF16)
_F32 = np.dtype(np.float32)

_lock = threading.Lock()
_counter_bufs: dict[tuple, Any] = {}


class Decode(Family):
    """kernels/attn_decode_mma.cl: decode steps on NVIDIA sm_80+ tensor cores (see the
    module); paged pools and quantized K/V included."""

    name = "nvidia decode"

    def applicable(self, be: Any, call: AttnCall, max_rows: int) -> str | None:
        if not be.use_mma:
            return "the backend's use_mma=False"
        if max_rows > MAX_ROWS:
            return (f"{max_rows} packed query rows per sequence (the decode kernel takes at most "
                    f"{MAX_ROWS})")
        return reason(be.device, call)

    def plan(self, be: Any, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        return DecodePlan(be, queue, call)


def reason(device: Any, call: AttnCall, head_dims: tuple = HEAD_DIMS) -> str | None:
    """None when this kernel can run ``call`` on ``device``, else why not: NVIDIA sm_80+,
    float16/bfloat16, D == Dv in ``head_dims`` (the dispatch: HEAD_DIMS), no mask, arrays read
    in place with 16-byte aligned rows (the packed rows per sequence: :class:`Decode`)."""
    reason = _nvidia_mma.sm80_reason(device)
    if reason is not None:
        return reason
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (float16 or bfloat16 only)"
    if call.mask_view is not None:
        return "a mask"
    if call.head_dim != call.head_dim_v or call.head_dim not in head_dims:
        return (f"head dims D={call.head_dim}, Dv={call.head_dim_v} (D == Dv in "
                f"{tuple(head_dims)})")
    if call.n_seq == 0:
        return "no sequence"
    if call.q.shape[1] >= 2**31 or call.k.shape[1] >= 2**31:
        return "a sequence of 2**31 rows or more"
    if call.k_scales is not None and not all(
            _scales_ok(x) for x in (call.k_scales, call.v_scales)):
        return "k_scales or v_scales with strides the kernel cannot read in place"
    if not all(_nvidia_mma.array_ok(x) for x in (call.q, call.k, call.v)):
        return "rows of q, k or v not 16-byte aligned"
    return None


def _scales_ok(x: Any) -> bool:
    """Device scales are read in place: float32, unit head stride, whole-element strides."""
    if not is_cl_array(x):
        return True
    return (x.dtype == _F32 and (x.strides[2] == 4 or x.shape[2] == 1) and x.offset % 4 == 0
            and all(s % 4 == 0 and s >= 0 for s in x.strides[:2]))


def kv_format(call: AttnCall) -> int:
    """The kernel's KV_FORMAT of ``call`` (kv_format.h's code; 0: k and v in the dtype)."""
    from ._attention import kv_format as fmt

    return fmt(call)


def local_bytes(head_dim: int, config: tuple, page_size: int = 0) -> int:
    """__local bytes of one work-group (the arrays the kernel declares, PTX build)."""
    block_n, warps, stages = config
    lds = head_dim + 8
    pages = stages * ((block_n - 1) // page_size + 2) * 4 if page_size else 0
    return stages * 2 * block_n * lds * 2 + 16 * lds * 2 + 2 * warps * 16 * 4 + 16 + pages


def build_options(head_dim: int, dtype: Any, config: tuple, *, softcap: bool = False,
                  alibi: bool = False, scale_pos: bool = True, split: bool = False,
                  use_ptx: bool = True, fused: bool = False,
                  page_size: int = 0, kv_format: int = 0) -> tuple[str, ...]:
    block_n, warps, stages = config
    fmt = (f"-DKV_FORMAT={int(kv_format)}",) if kv_format else ()
    return (*fmt, f"-DPAGE_SIZE={int(page_size)}",
        f"-DHEAD_DIM={head_dim}", f"-DBLOCK_N={block_n}", f"-DWARPS={warps}",
        f"-DSTAGES={stages}", f"-DIS_BF16={int(np.dtype(dtype) == _nvidia_mma.BF16)}",
        f"-DSOFTCAP={int(softcap)}", f"-DALIBI={int(alibi)}", f"-DSCALE_POS={int(scale_pos)}",
        f"-DSPLIT={int(split)}", f"-DUSE_PTX={int(use_ptx)}", f"-DFUSED_MERGE={int(fused)}",
    )


def kernel_options(call: AttnCall, config: tuple, splits: int, use_ptx: bool,
                   fused: bool | None = None, parts: bool = False) -> tuple[tuple[str, ...], bool]:
    """The build options of ``call``'s kernel with ``splits`` key splits, and whether the splits
    are merged in the kernel (``fused``, default ``_switches.FUSED_MERGE``: the last work-group of
    a (sequence, kv head) merges the splits, no merge.cl launch; where the buffers hold them).
    ``parts``: the float32 partial states of every split kept (SPLIT, never fused), one split
    included."""
    d = call.head_dim
    fused = ((_switches.FUSED_MERGE if fused is None else fused) and splits > 1 and not parts
             and fused_fits(d, config, splits))
    opts = build_options(d, call.dtype, config, softcap=call.options.softcap is not None,
                         alibi=call.options.alibi is not None, scale_pos=call.options.scale > 0,
                         split=splits > 1 or parts, use_ptx=use_ptx, fused=fused,
                         page_size=page_size(call), kv_format=kv_format(call))
    return opts, fused


def page_size(call: AttnCall) -> int:
    """The kernel's PAGE_SIZE for ``call``: its pool's page size, 0 for unpaged k and v."""
    return int(call.page_size or 0) if call.block_table is not None else 0


def fused_fits(head_dim: int, config: tuple, splits: int) -> bool:
    """The fused merge keeps splits x 16 weights in the K/V buffers."""
    block_n, _, stages = config
    return splits * 16 * 4 <= stages * 2 * block_n * (head_dim + 8) * 2


def choose_splits(compute_units: int, pairs: int, key_tiles: int, head_dim: int,
                  config: tuple) -> int:
    """Key splits per (sequence, kv head): the count that minimises waves x tiles per split,
    a wave being one work-group per resident slot (work-groups per SM by local memory, at most
    4); ties go to fewer splits (less merging), each split keeps at least MIN_TILES_PER_SPLIT
    tiles. A partial last wave costs a whole one here: the kernel is memory bound only while
    enough work-groups keep loads in flight. E.g. 132 SMs with 2 slots each: B=1 / 8 kv heads /
    131072 keys 33 splits (264 groups), B=8 / 8192 keys 4 (256 groups, not 5 = 320)."""
    per_cu = max(1, min(4, SM_LOCAL_BYTES // local_bytes(head_dim, config)))
    target = compute_units * per_cu
    if pairs >= target or key_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    best, best_cost = 1, None
    for s in range(1, min(2 * -(-target // pairs), key_tiles // MIN_TILES_PER_SPLIT) + 1):
        cost = -(-pairs * s // target) * -(-key_tiles // s)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def split_key_tiles(call: AttnCall, block_n: int) -> int:
    """The key tiles :func:`choose_splits` plans for: the capacity of ``call``'s keys (rows of k,
    or the block table's pages), not its current lengths, so that the split count and grid of a
    growing cache stay those of its first step (a recorded launch replays correctly; the kernel
    cuts each sequence's own tiles into the fixed number of splits)."""
    if call.block_table is not None:
        rows = int(call.block_table.shape[1]) * int(call.page_size)
    else:
        rows = int(call.k.shape[1])
    return max(1, -(-rows // block_n))


def kernel_key(ctx: Any, device: Any, opts: tuple[str, ...]) -> tuple:
    """The key of the decode kernel's object built with ``opts`` (``_runtime.launch``)."""
    return (ctx.int_ptr, device.int_ptr, "attn_decode_mma", opts)


def counters(ctx: Any, queue: Any, n: int) -> Any:
    """A zeroed uint buffer of >= n counters per queue (the kernels leave it zeroed; launches
    of one in-order queue never overlap)."""
    import pyopencl as cl

    key = ("decode counters", ctx.int_ptr, queue.int_ptr)
    with _lock:
        buf = _counter_bufs.get(key)
        if buf is None or buf.size < 4 * n:
            buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * max(n, 1024))
            cl.enqueue_fill_buffer(queue, buf, np.zeros(1, np.uint32), 0, buf.size)
            _counter_bufs[key] = buf
    return buf


def scale_args(ctx: Any, call: AttnCall) -> list:
    """The kernel's 8 quantized-K/V arguments of ``call`` (k_scl, offset, batch-or-page and
    row-or-slot element strides, then v's): float32 scales with unit head stride."""
    import pyopencl as cl

    res = []
    for x in (call.k_scales, call.v_scales):
        if is_cl_array(x):
            buf, off, st = x.base_data, x.offset // 4, [s // 4 for s in x.strides[:2]]
        else:
            h = np.ascontiguousarray(x, np.float32)
            if h.size == 0:
                h = np.zeros(4, np.float32)
            buf = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=h)
            off, st = 0, [x.shape[1] * x.shape[2], x.shape[2]]
        res += [buf, np.int64(off), np.int64(st[0]), np.int64(st[1])]
    return res


class DecodeKernel:
    """The decode launch of one (splits, work-group columns) of a call description: options,
    kernel key, grid, and the argument list (:class:`~._family.ArgList`) the description fixes,
    the per-call slots left to fill."""

    __slots__ = ("key", "make", "grid", "local", "args", "fused", "splits", "slots", "varying",
                 "parts")

    def __init__(self, queue: Any, device: Any, call: AttnCall, config: tuple, splits: int,
                 n_cols: int, use_ptx: bool, fused: bool | None, tile_buf: Any,
                 seq_buf: Any, parts: bool = False) -> None:
        ctx = queue.context
        bq, sq_arr, hq, _ = call.q.shape
        hkv = call.k.shape[2]
        opts, fused = kernel_options(call, config, splits, use_ptx, fused, parts)
        self.parts = parts
        dummy = dummy_buffer(ctx)
        threads = 32 * config[1]
        i64, i32 = np.int64, np.int32
        a = ArgList()  # attn_decode_mma's parameters, in order
        for name in ("q", "k", "v", "out", "lse", "part_o", "part_l"):
            a.add(name, None)
        a.add("sinks", dummy)
        a.add("tiles", tile_buf)
        a.add("seqs", seq_buf)
        a.add("alibi", dummy)
        a.add("counters", counters(ctx, queue, n_cols * hkv) if fused else dummy)
        a.add("geometry", *_nvidia_tables.geometry(call))
        a.add("shape", i32(sq_arr), i32(hq), i32(hq // hkv), i32(call.ring),
              i64(bq * sq_arr * hq))
        a.add("scalars", *_nvidia_tables.scalars(call))
        a.add("n_sinks", i32(0 if call.options.sinks is None else hq))
        if call.k_scales is not None:  # QUANT_PARAMS
            a.add("scales", *[None] * 8)
        if call.block_table is not None:  # PAGED_PARAMS
            a.add("block_table", *[None] * 6)
        self.args = a.values
        self.slots = {n: a.span(n) if n in ("scales", "block_table") else a.at(n)
                      for n in a.slots}
        self.varying = a.indices("q", "k", "v", "out", "lse", "part_o", "part_l", "sinks",
                                 "scales", "block_table",
                                 *(["alibi"] if call.options.alibi is not None else []))
        self.key = kernel_key(ctx, device, opts)
        self.make = lambda: _nvidia_mma.get_program(ctx, device, opts, "attn_decode_mma.cl")
        self.grid, self.local = (n_cols * threads, hkv, splits), (threads, 1, 1)
        self.fused, self.splits = fused, splits


class DecodePlan(Plan):
    """What a call description fixes on the decode kernel: the config, PTX or emulation, the
    device tables (rewritten in place when the per-sequence values change), the split count per
    work-group count and a :class:`DecodeKernel` per (splits, columns). ``config``, ``splits``,
    ``use_ptx``, ``fused``: see :func:`run` (None: the defaults the dispatch runs). ``parts``:
    :meth:`enqueue` keeps the float32 partial states of every split (one included) and returns
    their buffers (outs, lses) in merge.cl's layout, unmerged, sinks not folded
    (``_dispatch.attention_parts``)."""

    def __init__(self, be: Any, queue: Any, call: AttnCall, config: tuple | None = None,
                 splits: int | None = None, use_ptx: bool | None = None,
                 fused: bool | None = None, parts: bool = False) -> None:
        self.be, self.queue, self.ctx = be, queue, queue.context
        self.spare = dummy_buffer(self.ctx)  # stands in for the buffers a launch does not use
        n = call.n_seq
        fill = not be.facts.simulator
        self.seq_table = _pool.DeviceTable(queue, 8 * _nvidia_tables.SEQ_FIELDS * n, fill)
        self.tile_table = _pool.DeviceTable(queue, 8 * n, fill)
        self.config = tuple(config or DEFAULT_CONFIGS[call.head_dim])
        if use_ptx is None:
            use_ptx = (_nvidia_mma.compute_capability(be.device) is not None
                       and not _switches.EMULATE_PTX)
        self.use_ptx, self.fused, self.splits, self.parts = use_ptx, fused, splits, parts
        self.kernels: dict = {}
        self.split_counts: dict = {}

    def step(self, call: AttnCall, vals: np.ndarray, col: list | None) -> Any:
        block_n = self.config[0]
        if col is not None:  # _nvidia_tables.tables for one sequence, from Python ints
            qb, qr0, ql, kb, kr0, kl, qp0, kp0 = col[:8]
            hi = _nvidia_tables.BIG
            if len(col) == 9:
                hi = min(hi, col[8])
            opts = call.options
            if opts.window_right is not None:
                hi = min(hi, opts.window_right)
            lo = -opts.window_left if opts.window_left is not None else -_nvidia_tables.BIG
            seqs = np.array([[qb, qr0, ql, kb, kr0, kl, qp0 - kp0, lo, hi]], np.int64)
            n_cols = -(-ql // MAX_ROWS)
            tiles = np.zeros((n_cols, 2), np.int32)
        else:
            seqs, tiles = _nvidia_tables.tables(call, MAX_ROWS, block_n)
            n_cols = tiles.shape[0]
        if n_cols == 0:
            return None
        # the key fixes k's shape: one split count per work-group count, whatever the lengths
        splits = self.split_counts.get(n_cols)  # choose_splits loops up to ~70 times
        if splits is None:
            splits = self.splits if self.splits is not None else self.be.num_splits
            if splits is None:
                splits = choose_splits(self.be.facts.compute_units, n_cols * call.k.shape[2],
                                       split_key_tiles(call, block_n), call.head_dim,
                                       self.config)
            splits = self.split_counts[n_cols] = max(1, int(splits))
        kernel = self.kernels.get((splits, n_cols))
        if kernel is None:
            kernel = self.kernels[(splits, n_cols)] = DecodeKernel(
                self.queue, self.be.device, call, self.config, splits, n_cols, self.use_ptx,
                self.fused, self.tile_table.buf, self.seq_table.buf, self.parts)
        return kernel, seqs.tobytes(), tiles.tobytes()

    def enqueue(self, step: Any, call: AttnCall, out: Any, lse: Any, keep: Any) -> list:
        """The launch (then merge.cl's when the splits are not merged by the kernel): the
        tables rewritten when they changed, the call's buffers, sinks (folded in by the
        kernel, its fused merge or merge.cl, once), ALiBi slopes, scales and block table."""
        kn, seqs, tiles = step
        queue, ctx, spare = self.queue, self.ctx, self.spare
        bq, sq_arr, hq, d = call.q.shape
        n_out_rows = bq * sq_arr * hq
        slots = kn.slots
        args = kn.args.copy()
        if isinstance(call.q, np.ndarray):
            args[0:3] = _nvidia_tables.buffers(ctx, call)
        else:
            args[0], args[1], args[2] = call.q.base_data, call.k.base_data, call.v.base_data
        sinks = None
        if call.options.sinks is not None:
            sinks = args[slots["sinks"]] = _pool.upload(queue, call.options.sinks, keep)
        if call.options.alibi is not None:
            args[slots["alibi"]] = _nvidia_tables.slopes(ctx, call)
        if call.k_scales is not None:
            args[slots["scales"]] = scale_args(ctx, call)
        if call.block_table is not None:
            args[slots["block_table"]] = table_args(queue, call.block_table,
                                                    int(call.k.shape[0]), keep)
        splits, fused = kn.splits, kn.fused
        if splits > 1 or kn.parts:
            part_o = _pool.scratch(queue, splits * n_out_rows * d * 4)
            part_l = _pool.scratch(queue, splits * n_out_rows * 4)
            args[3:7] = [out if fused else spare, lse if fused else spare, part_o, part_l]
        else:
            args[3:7] = [out, lse, spare, spare]
        with launch_lock:
            self.seq_table.put(queue, seqs)
            self.tile_table.put(queue, tiles)
            evts = [_runtime.launch(kn.key, kn.make, "attn_decode_mma", queue, kn.grid,
                                    kn.local, args, varying=kn.varying, owner=kn)]
        if kn.parts:  # the partial states' buffers, not events
            return [part_o, part_l]
        if splits > 1 and not fused:
            evts.append(launch_merge(self.be, queue, part_o, n_out_rows * d, part_l,
                                     (n_out_rows, sq_arr * hq, hq, 1), splits, sq_arr, hq, d,
                                     n_out_rows, out, lse, store_kind(_F32),
                                     store_kind(call.dtype), 0, sinks))
        return evts


def run(be: Any, queue: Any, call: AttnCall, *, config: tuple | None = None,
        splits: int | None = None, use_ptx: bool | None = None,
        fused: bool | None = None) -> tuple[Any, Any]:
    """Run ``call`` on this kernel with the caller's choices (tests and benchmarks: the dispatch
    takes the :class:`Decode` family); numpy in -> numpy out, ``pyopencl.array.Array`` in ->
    Array out.

    ``be`` is the OpenCL backend (device, compute units, merge.cl launches); ``config`` =
    (BLOCK_N, WARPS, STAGES) overrides :data:`DEFAULT_CONFIGS`; ``splits`` the key splits
    (default :func:`choose_splits`, or the backend's ``num_splits``); ``use_ptx=False`` builds the
    emulated kernel (any OpenCL device; for checks only); ``fused`` (default
    ``_switches.FUSED_MERGE``) merges the splits in the kernel's last work-group per pair
    instead of merge.cl.
    """
    plan = DecodePlan(be, queue, call, config, splits, use_ptx, fused)
    vals, col = per_sequence(call)
    return plan.run(call, plan.step(call, vals, col))
