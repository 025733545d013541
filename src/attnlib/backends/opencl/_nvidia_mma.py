"""FlashAttention-2 style forward kernel for NVIDIA tensor cores (sm_80+): float16, bfloat16
and float32.

``kernels/attn_fwd_mma.cl`` is OpenCL C with inline PTX (``mma.sync``, ``ldmatrix``,
``cp.async``), built by NVIDIA's OpenCL driver. Its kernel families (``_family``): :class:`MmaSync`
and, on Hopper, :class:`Wgmma` (kernels/attn_fwd_wgmma.cl, built through ``_nvidia_wgmma``), both
launching through :class:`PrefillPlan`.

Covered: every :class:`~attnlib.backends.base.AttnCall` whose dtype is float16, bfloat16 or
float32 with any head dims D, Dv <= :data:`MAX_HEAD_DIM` (D != Dv included; the kernel pads both
to 16 inside: zero-filled columns on load, the padding never stored): dense, varlen, streaming
chunks, KV cache (ring too), any positions, causal, window, softcap, alibi, GQA/MQA, LSE, and
bool or additive masks of any broadcast shape (read per tile from the unbroadcast array,
``-DMASK_KIND``; key tiles a bool mask hides from every row of a block are skipped, by a range
of tiles per row block that the host finds in the mask, ``_nvidia_tables.mask_tile_args``). Rows
that are not 16-byte aligned (e.g. D = 59 in 16 bits) are read element by element instead of by
cp.async (``-DVEC_LOADS=0``). Paged calls (page pools and a block table, any page size) build
the load variant ``-DPAGE_SIZE``: each key row's address comes from the table, whose entries the
kernel stages ahead of the K/V loads; on Hopper they run this kernel, not the warpgroup-MMA one.

float16/bfloat16 run ``mma.sync.m16n8k16`` with float32 accumulators. float32 runs "3xTF32"
(``-DIS_TF32=1``, kernels/attn_fwd_mma_tf32.h): every operand of Q K^T and P V is split as
hi + lo in tf32 (``cvt.rna``), and each product takes three ``mma.sync.m16n8k8`` tf32
(lo*hi + hi*lo + hi*hi) with float32 accumulators, at about a third of the tf32 tensor-core
rate. For float32-class accuracy (the contract's rule against float64) the tensor cores only
sum short runs from zero (S: one 8-wide k-step, O: one key tile) that are added to S and O in
float32 with round-to-nearest: a chain of mma accumulations (which truncate) over all of D or all
keys takes S's error to several times that of the float32 reference at scores of tens. The
backend option ``use_mma=False`` (or ``_switches.F32_ON = False``, float32 only) keeps float32
on the portable float32 FMA kernel.

Hidden keys contribute nothing even when their k or v hold inf/NaN (the contract): keys hidden
from every row of a work-group are never read; in tiles that hide keys from only some rows, the
kernel zeroes non-finite v values for the tensor-core product and adds them back to the rows that
see them.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import ml_dtypes
import numpy as np

from ..base import AttnCall
from . import _pool, _runtime, _switches
from ._arrays import dummy_buffer, is_cl_array
from ._attention import DECODE_ROWS, table_args
from ._family import ArgList, Family, NotBuilt, Plan
from ._nvidia_tables import (
    buffers,
    geometry,
    mask_args,
    mask_tile_args,
    scalars,
    slopes,
    tables_on_device,
)
from ._runtime import KernelBuildError, program

__all__ = ["MmaSync", "Wgmma", "reason", "run", "HEAD_DIMS", "DEFAULT_CONFIGS",
           "DEFAULT_CONFIGS_F32", "default_config", "build_options", "kernel_options"]

#: head dims (D == Dv) of the measured tables below
HEAD_DIMS = (64, 128)
#: the largest D and Dv (any size up to it, padded to 16 in the kernel)
MAX_HEAD_DIM = 256
#: (BLOCK_M, BLOCK_N, WARPS, Q_IN_REGS) per head dim: the fastest of the sweep on the H200
#: (bench/RESULTS.md); 4 warps x 32 rows, 2 work-groups per SM (registers: 246-255 per thread)
DEFAULT_CONFIGS = {64: (128, 64, 4, 1), 128: (128, 64, 4, 0)}
#: the 16-bit head dims between and past those, by the larger padded dim max(D16, Dv16) (D16: D
#: rounded up to 16): (padded dim up to, config, kernel options for (not causal, causal)). Up to
#: 64 and 128 as the tables above; past 128, 64-row blocks (O alone takes Dv / 2 registers per
#: thread) with one K and one V buffer (local memory (64 + 2 * 64) (dim + 8) * 2 bytes: 101 KiB at
#: 256, two work-groups per SM).
PADDED_CONFIGS = (
    (64, (128, 64, 4, 1), (("-DKV_SPLIT_STAGES=1",),
                           ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"))),
    (128, (128, 64, 4, 0), (("-DLDSM_BYTES=1",), ("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1"))),
    (256, (64, 64, 4, 0), (("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1"),
                           ("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1"))),
)
#: float32 (3xTF32), same fields; Q_IN_REGS 0: Q in local memory, split every tile, 1: its tf32
#: hi and lo in registers, 2: hi in registers, lo in local memory. The fastest of the H200 sweeps
#: (bench/RESULTS.md); D=128 runs two m-tiles per warp. Local memory
#: 4 (BLOCK_M (D+8) + 2 BLOCK_N (2D+12)) bytes: 106 and 203 KiB.
DEFAULT_CONFIGS_F32 = {64: (128, 64, 4, 0), 128: (256, 32, 8, 0)}
#: float32 at the other head dims, by the larger padded dim: (padded dim up to, config). Up to
#: 64 and 128 the tables above; past 128, 64-row blocks of 32-key tiles (local memory
#: 4 (64 (D16 + 8) + 64 (D16 + 8 + Dv16 + 4)) bytes: 197 KiB at 256, one work-group per SM).
#: Not measured on a device.
PADDED_CONFIGS_F32 = ((64, (128, 64, 4, 0)), (128, (256, 32, 8, 0)), (256, (64, 32, 4, 0)))
#: Causal calls run the heads-inner grid order and -DWARP_SKIP=1 (a warp skips key tiles none
#: of its rows sees), float32 only at the head dims listed here: faster on the H200 for causal
#: calls, slower for the others (bench/RESULTS.md); outputs bit-identical.
F32_SCHEDULED = (128,)
#: Kernel options of the 16-bit kernel per (head dim, causal), added when ``run`` is not given
#: ``extra_options``: the fastest on the H200 (bench/RESULTS.md; outputs bit-identical to the
#: plain build but for SOFTMAX_PIPE's few ulps). LDSM_BYTES: ldmatrix at per-thread byte
#: addresses plus constants; KV_SPLIT_STAGES: FA2's one-K, one-V-buffer schedule; SOFTMAX_PIPE:
#: the next half tile's S issued with this one's softmax (it refuses WARP_SKIP).
DEFAULT_OPTIONS_16 = {
    (128, False): ("-DLDSM_BYTES=1",),
    (128, True): ("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1"),
    (64, False): ("-DKV_SPLIT_STAGES=1",),
    (64, True): ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
}
#: Hopper (compute capability 9.0): float16/bfloat16 run kernels/attn_fwd_wgmma.cl (warpgroup
#: MMA through the PTX rewrite of _nvidia_wgmma) while ``_switches.WGMMA_ON``; (WGS, BLOCK_N)
#: per head dim (BLOCK_M = 64 WGS query rows, 128 WGS threads), the 128-byte-swizzle layouts,
#: the two warpgroups' products in ping-pong at D >= 128 (bench/RESULTS.md compares it with the
#: mma.sync kernel and PyTorch).
WGMMA_CONFIGS = {64: (2, 64), 128: (2, 128)}
#: paged calls of at most this many packed query rows per sequence take the decode kernels
#: (``_nvidia_decode.MAX_ROWS``: its split-KV walk over the pages), as before this kernel read
#: block tables
PAGED_DECODE_ROWS = 16
BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_DTYPES = (np.dtype(np.float16), BF16, _F32)

_lock = threading.Lock()


_cc_memo: dict[int, tuple[int, int] | None] = {}


def compute_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA device (cl_nv_device_attribute_query), else None; asked of
    the driver once per device (every prefill call checks it)."""
    key = device.int_ptr
    if key not in _cc_memo:
        _cc_memo[key] = _query_cc(device)
    return _cc_memo[key]


def _query_cc(device: Any) -> tuple[int, int] | None:
    try:
        import pyopencl as cl

        if "cl_nv_device_attribute_query" not in device.extensions:
            return None
        return (
            int(device.get_info(cl.device_info.COMPUTE_CAPABILITY_MAJOR_NV)),
            int(device.get_info(cl.device_info.COMPUTE_CAPABILITY_MINOR_NV)),
        )
    except Exception:
        return None


def array_ok(x: Any) -> bool:
    """Device arrays whose rows are 16-byte aligned: unit last stride, 16-byte aligned strides
    and start (the decode kernel and the cp.async loads of the prefill kernels)."""
    if not is_cl_array(x):
        return True
    item = x.dtype.itemsize
    if x.strides[3] != item or x.offset % 16:
        return False
    return all(s % 16 == 0 and s >= 0 for s, n in zip(x.strides[:3], x.shape[:3]) if n > 1)


def array_readable(x: Any) -> bool:
    """Device arrays the prefill kernel reads in place: unit last stride, non-negative strides
    (rows of any alignment: see :func:`vec_loads`)."""
    if not is_cl_array(x):
        return True
    item = x.dtype.itemsize
    if x.strides[3] != item or x.offset % item:
        return False
    return all(s % item == 0 and s >= 0 for s, n in zip(x.strides[:3], x.shape[:3]) if n > 1)


def vec_loads(call: AttnCall) -> bool:
    """True when every row of q, k and v starts 16-byte aligned (-DVEC_LOADS=1: cp.async of
    16-byte chunks); host arrays are copied to the device contiguous, rows D (Dv) apart."""
    for x in (call.q, call.k, call.v):
        if is_cl_array(x):
            if not array_ok(x):
                return False
        elif (x.shape[3] * x.dtype.itemsize) % 16:
            return False
    return True


def sm80_reason(device: Any) -> str | None:
    """None on an NVIDIA sm_80+ device (the tensor-core kernels' floor), else why not."""
    cc = compute_capability(device)
    if cc is None:
        return "not an NVIDIA device (no cl_nv_device_attribute_query)"
    if cc[0] < 8:
        return f"compute capability {cc[0]}.{cc[1]} (tensor-core kernels need 8.0+)"
    return None

def reason(device: Any, call: AttnCall) -> str | None:
    """None when the prefill kernel can run ``call`` on ``device``, else why not (NVIDIA
    sm_80+; float16, bfloat16 or float32 with D, Dv <= MAX_HEAD_DIM; arrays it reads in
    place)."""
    reason = sm80_reason(device)
    if reason is not None:
        return reason
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (float16, bfloat16 or float32 only)"
    if call.dtype == _F32 and not _switches.F32_ON:
        return "float32 on the tensor cores is switched off (_switches.F32_ON)"
    if not (1 <= call.head_dim <= MAX_HEAD_DIM and 1 <= call.head_dim_v <= MAX_HEAD_DIM):
        return f"head dims D={call.head_dim}, Dv={call.head_dim_v} (at most {MAX_HEAD_DIM})"
    if call.q.shape[1] >= 2**31 or call.k.shape[1] >= 2**31:
        return "a sequence of 2**31 rows or more"
    if not all(array_readable(x) for x in (call.q, call.k, call.v)):
        return "q, k or v has a stride the kernel cannot read in place"
    return None


def mask_kind(call: AttnCall) -> int:
    """The kernel's -DMASK_KIND of ``call``: 0 no mask, 1 bool, additive: 3 float16, 4 bfloat16
    (read in place of float32: exact), 2 float32 (every other float dtype, converted)."""
    if call.mask_view is None:
        return 0
    if call.options.mask_kind == "bool":
        return 1
    return {np.dtype(np.float16): 3, BF16: 4}.get(call.mask_view.dtype, 2)


def page_size(call: AttnCall) -> int:
    """The kernel's -DPAGE_SIZE of ``call``: its pools' page size, 0 for unpaged k and v."""
    return int(call.page_size or 0) if call.block_table is not None else 0


def build_options(head_dim: int, dtype: Any, config: tuple, *, softcap: bool = False,
                  alibi: bool = False, scale_pos: bool = True, use_ptx: bool = True,
                  heads_inner: bool = False, head_dim_v: int | None = None,
                  vec: bool = True, mask: int = 0, page_size: int = 0) -> tuple[str, ...]:
    block_m, block_n, warps, q_in_regs = config
    shape = ((f"-DHEAD_DIM_V={head_dim_v}",) if head_dim_v not in (None, head_dim) else ()) + (
        () if vec else ("-DVEC_LOADS=0",)) + ((f"-DMASK_KIND={mask}",) if mask else ()) + (
        (f"-DPAGE_SIZE={page_size}",) if page_size else ())
    return shape + (
        f"-DHEAD_DIM={head_dim}", f"-DBLOCK_M={block_m}", f"-DBLOCK_N={block_n}",
        f"-DWARPS={warps}", f"-DQ_IN_REGS={int(q_in_regs)}",
        f"-DIS_BF16={int(np.dtype(dtype) == BF16)}",
        f"-DIS_TF32={int(np.dtype(dtype) == _F32)}", f"-DSOFTCAP={int(softcap)}",
        f"-DALIBI={int(alibi)}", f"-DSCALE_POS={int(scale_pos)}", f"-DUSE_PTX={int(use_ptx)}",
    ) + (("-DHEADS_INNER=1",) if heads_inner else ())


def _padded(head_dim: int, head_dim_v: int, table: tuple = PADDED_CONFIGS) -> tuple:
    """The row of ``table`` (PADDED_CONFIGS, PADDED_CONFIGS_F32) of a call with head dims D,
    Dv."""
    dim = max(-(-head_dim // 16), -(-head_dim_v // 16)) * 16
    return next(row for row in table if dim <= row[0])


def default_config(dtype: Any, head_dim: int, head_dim_v: int | None = None) -> tuple:
    """The (BLOCK_M, BLOCK_N, WARPS, Q_IN_REGS) a call of ``dtype`` and head dims runs with."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if np.dtype(dtype) == _F32:
        if dv == head_dim and head_dim in DEFAULT_CONFIGS_F32:
            return DEFAULT_CONFIGS_F32[head_dim]
        return _padded(head_dim, dv, PADDED_CONFIGS_F32)[1]
    if dv == head_dim and head_dim in DEFAULT_CONFIGS:
        return DEFAULT_CONFIGS[head_dim]
    return _padded(head_dim, dv)[1]


def default_options_16(head_dim: int, head_dim_v: int, causal: bool) -> tuple[str, ...]:
    """The kernel options of a 16-bit call (DEFAULT_OPTIONS_16, else PADDED_CONFIGS)."""
    if head_dim == head_dim_v and (head_dim, causal) in DEFAULT_OPTIONS_16:
        return DEFAULT_OPTIONS_16[(head_dim, causal)]
    return _padded(head_dim, head_dim_v)[2][int(causal)]


def get_program(ctx: Any, device: Any, options: tuple[str, ...],
                filename: str = "attn_fwd_mma.cl") -> Any:
    """The program of one of the tensor-core kernels (this one, or attn_decode_mma.cl for
    _nvidia_decode) for ``device``, with NVIDIA's default OpenCL C version (no -cl-std)."""
    return program(ctx, filename, options, device=device, std=None)


def kernel_options(call: AttnCall, config: tuple, use_ptx: bool,
                   extra_options: tuple[str, ...] | None = None,
                   heads_inner: bool | None = None) -> tuple[tuple[str, ...], bool]:
    """The build options of ``call``'s kernel and its grid order (see :func:`run` for the
    arguments): the one place that picks DEFAULT_OPTIONS_16 and the causal scheduling."""
    d, dtype = call.head_dim, call.dtype
    causal = call.causal_hi is not None
    scheduled = causal and (dtype != _F32 or d in F32_SCHEDULED)
    if extra_options is None:
        extra_options = () if dtype == _F32 else default_options_16(d, call.head_dim_v, causal)
    if heads_inner is None:
        heads_inner = _switches.HEADS_INNER or scheduled
    if scheduled and not any("WARP_SKIP" in o for o in extra_options):
        extra_options = ("-DWARP_SKIP=1", *extra_options)
    opts = build_options(d, dtype, config, softcap=call.options.softcap is not None,
                         alibi=call.options.alibi is not None, scale_pos=call.options.scale > 0,
                         use_ptx=use_ptx, heads_inner=heads_inner, head_dim_v=call.head_dim_v,
                         vec=vec_loads(call), mask=mask_kind(call),
                         page_size=page_size(call)) + tuple(extra_options)
    return opts, heads_inner


#: devices (``int_ptr``) on which a warpgroup-MMA build failed: they keep the mma.sync kernel
_wgmma_failed: set[int] = set()


def wgmma_reason(device: Any, call: AttnCall) -> str | None:
    """None when ``call`` runs the warpgroup-MMA kernel (Hopper, 16-bit, D == Dv of
    :data:`WGMMA_CONFIGS`, aligned rows, no mask, not paged, and no failed build of it on this
    device), else why not; the other head dims, masked and paged calls run the mma.sync kernel
    on Hopper too."""
    if not _switches.WGMMA_ON:
        return "switched off (ATTNLIB_NV_WGMMA=0)"
    if _switches.EMULATE_PTX:
        return "the emulated build is asked for (_switches.EMULATE_PTX)"
    cc = compute_capability(device)
    if cc != (9, 0):
        return "not compute capability 9.0 (Hopper)"
    if call.dtype == _F32:
        return "float32 (the warpgroup-MMA kernel is 16-bit)"
    if call.head_dim not in WGMMA_CONFIGS or call.head_dim_v != call.head_dim:
        return (f"head dims D={call.head_dim}, Dv={call.head_dim_v} (built for D == Dv in "
                f"{tuple(WGMMA_CONFIGS)})")
    if call.mask_view is not None:
        return "a mask"
    if call.block_table is not None:
        return "a paged call (the warpgroup-MMA kernel reads no block table)"
    if not vec_loads(call):
        return "rows of q, k or v not 16-byte aligned"
    if device.int_ptr in _wgmma_failed:
        return "its build failed on this device (warned once)"
    return None


def use_wgmma(device: Any, call: AttnCall) -> bool:
    """True when ``call`` runs the warpgroup-MMA kernel (:func:`wgmma_reason`)."""
    return wgmma_reason(device, call) is None


def built_wgmma(device: Any, launch: Launch) -> bool:
    """Build the warpgroup-MMA program of ``launch`` right away: its program is PTX rewritten
    for sm_90a, which a driver's compiler might not take (another version's PTX, or no
    sm_90a). Then the device keeps the mma.sync kernel from here on, with one warning, instead
    of every call failing: False."""
    try:
        launch.make()
    except KernelBuildError as exc:
        with _lock:
            first = device.int_ptr not in _wgmma_failed
            _wgmma_failed.add(device.int_ptr)
        if first:
            warnings.warn(f"attnlib: the warpgroup-MMA kernel did not build on "
                          f"{device.name.strip()}; the mma.sync kernel runs instead ({exc})",
                          RuntimeWarning, stacklevel=4)
        return False
    return True


class Launch:
    """What a launch of a call's prefill kernel needs besides q, k, v, outputs and tables: the
    kernel name, build options, program maker, work-group size, block sizes and grid order."""

    __slots__ = ("name", "opts", "make", "threads", "block_m", "block_n", "heads_inner")

    def __init__(self, name: str, opts: tuple, make: Any, threads: int, block_m: int,
                 block_n: int, heads_inner: bool) -> None:
        self.name, self.opts, self.make, self.threads = name, opts, make, threads
        self.block_m, self.block_n, self.heads_inner = block_m, block_n, heads_inner

    def key(self, ctx: Any, device: Any) -> tuple:
        """The key of the kernel object (``_runtime.launch``)."""
        return (ctx.int_ptr, device.int_ptr, self.name, self.opts)

    def grid(self, n_tiles: int, hq: int) -> tuple[int, int]:
        t = self.threads
        return (n_tiles * hq * t, 1) if self.heads_inner else (n_tiles * t, hq)


class MmaSync(Family):
    """kernels/attn_fwd_mma.cl: mma.sync prefill on NVIDIA sm_80+ (see the module)."""

    name = "nvidia mma.sync"

    def applicable(self, be: Any, call: AttnCall, max_rows: int) -> str | None:
        if not be.use_mma:
            return "the backend's use_mma=False"
        if call.k_scales is not None:
            return "quantized K/V (the prefill kernels read K and V in the call's dtype)"
        if call.block_table is not None and max_rows <= PAGED_DECODE_ROWS:
            return (f"a paged call of {max_rows} packed query rows per sequence (at most "
                    f"{PAGED_DECODE_ROWS} go to the decode kernels)")
        if max_rows <= DECODE_ROWS:
            return (f"{max_rows} packed query rows per sequence (at most {DECODE_ROWS} go to "
                    "the decode kernels)")
        return reason(be.device, call)

    def plan(self, be: Any, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        return PrefillPlan(queue, be.device, call, plan_launch(queue.context, be.device, call,
                                                               kernel="mma"))


class Wgmma(MmaSync):
    """kernels/attn_fwd_wgmma.cl: warpgroup-MMA prefill on Hopper (``_nvidia_wgmma``)."""

    name = "nvidia wgmma"

    def applicable(self, be: Any, call: AttnCall, max_rows: int) -> str | None:
        return MmaSync.applicable(self, be, call, max_rows) or wgmma_reason(be.device, call)

    def plan(self, be: Any, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        launch = plan_launch(queue.context, be.device, call, kernel="wgmma")
        if not built_wgmma(be.device, launch):
            raise NotBuilt(wgmma_reason(be.device, call))
        return PrefillPlan(queue, be.device, call, launch)


class PrefillPlan(Plan):
    """A prefill launch of one call description: the kernel (:class:`Launch`), the key of its
    kernel object, and its argument list (:class:`~._family.ArgList`) with the per-call slots
    (buffers, tables, sinks, ALiBi slopes, mask) left to fill."""

    def __init__(self, queue: Any, device: Any, call: AttnCall, kernel: Launch) -> None:
        self.ctx = ctx = queue.context
        self.queue = queue
        _, sq_arr, hq, _ = call.q.shape
        i32, i64 = np.int32, np.int64
        self.kernel, self.key = kernel, kernel.key(ctx, device)
        dummy = dummy_buffer(ctx)
        a = ArgList()  # PREFILL_PARAMS of nv_warp.h, in order
        for name in ("q", "k", "v", "out", "lse", "tiles", "seqs"):
            a.add(name, None)
        a.add("sinks", dummy)
        a.add("alibi", dummy)
        a.add("geometry", *geometry(call))
        a.add("shape", i32(sq_arr), i32(hq), i32(hq // call.k.shape[2]), i32(call.ring))
        a.add("scalars", *scalars(call))
        a.add("n_sinks", i32(0 if call.options.sinks is None else hq))
        a.add("mask", dummy, *(i64(0) for _ in range(5)))
        masked, paged = call.mask_view is not None, call.block_table is not None
        if masked:  # MASK_TILE_PARAMS of attn_fwd_mma.cl
            a.add("mask_tiles", dummy, *(i64(0) for _ in range(3)))
        if paged:  # PAGED_PARAMS of nv_warp.h
            a.add("table", dummy, *(i64(0) for _ in range(3)), i32(1), i32(1))
        self.args = a.values
        self.i_sinks, self.i_alibi, self.s_mask = a.at("sinks"), a.at("alibi"), a.span("mask")
        self.s_tiles = a.span("mask_tiles") if masked else None
        self.s_table = a.span("table") if paged else None
        self.varying = a.indices("q", "k", "v", "out", "lse", "tiles", "seqs", "sinks",
                                 *(["alibi"] if call.options.alibi is not None else []),
                                 *(["mask", "mask_tiles"] if masked else []),
                                 *(["table"] if paged else []))
        self.hq = hq

    def step(self, call: AttnCall, vals: Any, col: Any) -> Any:
        kn = self.kernel
        seq_buf, tile_buf, n_tiles = tables_on_device(self.ctx, call, kn.block_m,
                                                      kn.block_n)
        return None if n_tiles == 0 else (seq_buf, tile_buf, n_tiles)

    def enqueue(self, step: Any, call: AttnCall, out: Any, lse: Any, keep: Any) -> list:
        seq_buf, tile_buf, n_tiles = step
        queue, ctx = self.queue, self.ctx
        args = self.args.copy()
        if isinstance(call.q, np.ndarray):
            args[0:3] = buffers(ctx, call)
        else:
            args[0], args[1], args[2] = call.q.base_data, call.k.base_data, call.v.base_data
        args[3], args[4], args[5], args[6] = out, lse, tile_buf, seq_buf
        if call.options.sinks is not None:
            args[self.i_sinks] = _pool.upload(queue, call.options.sinks, keep)
        if call.options.alibi is not None:
            args[self.i_alibi] = slopes(ctx, call)
        kn = self.kernel
        if call.mask_view is not None:
            args[self.s_mask] = mask_args(ctx, call)
            args[self.s_tiles] = mask_tile_args(ctx, call, kn.block_m, kn.block_n)
        if call.block_table is not None:
            args[self.s_table] = table_args(queue, call.block_table, int(call.k.shape[0]), keep)
        return [_runtime.launch(self.key, kn.make, kn.name, queue, kn.grid(n_tiles, self.hq),
                                (kn.threads, 1), args, varying=self.varying, owner=self)]


def wgmma_options(call: AttnCall, wgs: int, block_n: int,
                  heads_inner: bool) -> tuple[str, ...]:
    return (f"-DHEAD_DIM={call.head_dim}", f"-DWGS={wgs}", f"-DBLOCK_N={block_n}",
            f"-DIS_BF16={int(call.dtype == BF16)}",
            f"-DSOFTCAP={int(call.options.softcap is not None)}",
            f"-DALIBI={int(call.options.alibi is not None)}",
            f"-DSCALE_POS={int(call.options.scale > 0)}",
            f"-DHEADS_INNER={int(heads_inner)}")


def plan_launch(ctx: Any, device: Any, call: AttnCall, *, config: tuple | None = None,
                use_ptx: bool | None = None, extra_options: tuple[str, ...] | None = None,
                heads_inner: bool | None = None, kernel: str | None = None,
                wgmma_config: tuple | None = None) -> Launch:
    """The kernel ``call`` runs with (see :func:`run` for the arguments): the warpgroup-MMA
    kernel when :func:`use_wgmma` says so and no mma.sync ``config`` / ``extra_options`` were
    given (or ``kernel="wgmma"``), else attn_fwd_mma.cl."""
    if kernel is None:
        kernel = ("wgmma" if config is None and extra_options is None and use_wgmma(device, call)
                  else "mma")
    if kernel == "wgmma":
        from . import _nvidia_wgmma

        wgs, block_n = wgmma_config or WGMMA_CONFIGS[call.head_dim]
        causal = call.causal_hi is not None
        hi = causal if heads_inner is None else heads_inner
        emulated = () if use_ptx is None or use_ptx else ("-DUSE_PTX=0",)
        extra = () if extra_options is None else tuple(extra_options)
        opts = wgmma_options(call, wgs, block_n, hi) + emulated + extra
        return Launch("attn_fwd_wgmma", opts,
                      lambda: _nvidia_wgmma.get_program(ctx, device, opts, block_n,
                                                        call.head_dim),
                      128 * wgs, 64 * wgs, block_n, hi)
    d = call.head_dim
    config = tuple(config or default_config(call.dtype, d, call.head_dim_v))
    if use_ptx is None:
        use_ptx = compute_capability(device) is not None and not _switches.EMULATE_PTX
    opts, hi = kernel_options(call, config, use_ptx, extra_options, heads_inner)
    return Launch("attn_fwd_mma", opts, lambda: get_program(ctx, device, opts), 32 * config[2],
                  config[0], config[1], hi)


def run(ctx: Any, queue: Any, device: Any, call: AttnCall, *, config: tuple | None = None,
        use_ptx: bool | None = None, extra_options: tuple[str, ...] | None = None,
        heads_inner: bool | None = None, kernel: str | None = None,
        wgmma_config: tuple | None = None) -> tuple[Any, Any]:
    """Run ``call`` on a prefill kernel of this module's choice or the caller's (tests and
    benchmarks: the dispatch takes the families); numpy in -> numpy out,
    ``pyopencl.array.Array`` in -> Array out.

    ``config`` = (BLOCK_M, BLOCK_N, WARPS, Q_IN_REGS) overrides :data:`DEFAULT_CONFIGS`
    (:data:`PADDED_CONFIGS` for other head dims, :data:`DEFAULT_CONFIGS_F32` for float32);
    ``use_ptx=False`` builds the emulated kernel (any OpenCL device; for layout checks only);
    ``heads_inner`` (default ``_switches.HEADS_INNER``) picks the grid order;
    ``extra_options`` (-D options of the kernel) replace :data:`DEFAULT_OPTIONS_16` when given
    (``()``: the plain build; benchmarks compare variants that way);
    ``kernel`` ("mma" or "wgmma") and ``wgmma_config`` = (WGS, BLOCK_N) override the choice of
    :func:`plan_launch` (whose warpgroup-MMA choice falls back to mma.sync, as the dispatch
    does, when its build fails).
    """
    kw = dict(config=config, use_ptx=use_ptx, extra_options=extra_options,
              heads_inner=heads_inner, wgmma_config=wgmma_config)
    launch = plan_launch(ctx, device, call, kernel=kernel, **kw)
    if kernel is None and launch.name == "attn_fwd_wgmma" and not built_wgmma(device, launch):
        launch = plan_launch(ctx, device, call, **kw)
    plan = PrefillPlan(queue, device, call, launch)
    return plan.run(call, plan.step(call, None, None))
