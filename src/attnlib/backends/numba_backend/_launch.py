"""How the numba backend launches its attention kernel: the call flattened to the kernel's
arrays, the tasks planned (memoised per call shape), the tiles run on a thread pool with BLAS
limited to one thread, and the partial states of split keys merged."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ... import _plans as _attnlib_plans
from ..base import AttnCall

BLOCK_M = 256  # packed query rows per task
BLOCK_N = 256  # keys per tile
# causal / window calls of at most SHORT_ROWS packed rows per sequence use smaller tiles
SHORT_ROWS = 1024
BLOCK_M_SHORT = 128
BLOCK_N_SHORT = 128
# decode-sized calls (few tasks) split each task's keys so that every thread has work
MIN_KEYS_PER_SPLIT = 4 * BLOCK_N

# the BLAS thread limit below is process-wide, and the helper pool is shared: one launch at a time
_launch_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a fresh pool when needed (the
    work itself would still be done, by the calling thread alone)."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


_works: dict[tuple[int, str], np.ndarray] = {}


def _work(slot: int, size: int, dtype: np.dtype) -> np.ndarray:
    """Thread slot ``slot``'s kernel scratch (``size`` elements of ``dtype``, 64-byte aligned),
    kept across calls (up to ~2 MiB per thread for 256 x 256 tiles at D = 128 in float64).
    Only used under ``_launch_lock``, so one launch at a time owns it."""
    key = (slot, np.dtype(dtype).str)
    w = _works.get(key)
    if w is None or w.size < size:
        raw = np.empty(size + 64, dtype)
        off = (-raw.ctypes.data % 64) // raw.itemsize
        w = _works[key] = raw[off:off + size]
    return w


def _run_tasks(kernel, args: tuple, n_tasks: int, n_threads: int, work_size: int,
               dtype: np.dtype) -> None:
    """Run ``kernel(*args, counter, done, *rest, work)`` on this thread and ``n_threads - 1``
    helper threads (the kernel releases the GIL), each with its own scratch ``work``; they claim
    tasks through ``counter``. Returns when ``done`` says every task is finished: a helper that
    has not started yet (on a loaded machine the OS may not schedule it for a few ms) finds no
    task left and is not waited for, unlike a fork-join parallel region, whose join waits for
    every thread."""
    global _pool, _pool_size
    counter = np.zeros(1, np.int64)
    done = np.zeros(1, np.int64)
    pre, post = args
    futures = []
    if n_threads > 1 and n_tasks > 1:
        if _pool is None or _pool_size != n_threads - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n_threads - 1, thread_name_prefix="attnlib-numba")
            _pool_size = n_threads - 1
        futures = [_pool.submit(kernel, *pre, counter, done, *post, _work(i, work_size, dtype))
                   for i in range(1, min(n_threads, n_tasks))]
    kernel(*pre, counter, done, *post, _work(0, work_size, dtype))
    while done[0] < n_tasks:  # a helper is finishing its last task
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        time.sleep(2e-5)


def _blas_single_thread():
    """A context manager pinning every BLAS library to one thread (nested BLAS threads inside
    the prange workers would oversubscribe the cores), or a no-op without threadpoolctl."""
    import contextlib

    try:
        import scipy.linalg.cython_blas  # noqa: F401  (numba's np.dot calls this BLAS)
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return contextlib.nullcontext()
    global _controller
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="blas")


_controller = None


def _readonly_c(x: Any, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous, read-only array of ``dtype`` (a copy only when needed), so the kernels
    are compiled for one array type per dtype."""
    x = np.asarray(x)
    if x.dtype != dtype or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=dtype)
    x = x.view()
    x.flags.writeable = False
    return x


def _flat(x: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x as a 4-D numpy array of ``dtype``, a read-only flat view of its memory, int64 (4,):
    its element strides along (batch, row, head) and the row width) for the kernel. No copy
    when x is C-contiguous (bshd) or a (B, S, H, D) view of C-contiguous (B, H, S, D) memory,
    which ``layout="bhsd"`` hands over; the kernel reads the second faster (rows of one
    head adjacent: a tile spans a few pages, not one per row); anything else is copied
    C-contiguous. Strides come from the shape (numpy leaves them arbitrary along length-1
    axes)."""
    x = np.asarray(x)
    head_major = x.dtype == dtype and not x.flags.c_contiguous and \
        x.transpose(0, 2, 1, 3).flags.c_contiguous
    if not head_major:
        x = _readonly_c(x, dtype)
    b, s, h, d = x.shape
    if head_major:
        flat = x.transpose(0, 2, 1, 3).reshape(-1)
        st = np.array([h * s * d, d, s * d, d], np.int64)
    else:
        flat = x.reshape(-1)
        st = np.array([s * h * d, h * d, d, d], np.int64)
    flat = flat.view()
    flat.flags.writeable = False  # one compiled signature, whatever the caller's flags
    return x, flat, st


def _bytes(x: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x seen as ``dtype``, 4-D; its memory as a read-only flat uint8 array; int64 (4,) element
    strides, as :func:`_flat`) for an input the kernel reads in its storage dtype: no copy
    unless x's layout is neither bshd nor bhsd (then a C-contiguous copy in the same dtype)."""
    x4, flat, st = _flat(np.asarray(x).view(dtype), dtype)
    raw = flat.view(np.uint8)
    raw.flags.writeable = False
    return x4, raw, st


def _stored(call: AttnCall, cdt: np.dtype) -> tuple:
    """k and v as the kernel reads them when their dtype is not the compute dtype: (k 4-D,
    empty k, k strides, the same for v, and the kernel's stored-format arguments ``(kc, vc,
    ksc, vsc, sst, kv_format)``). The bytes are read in place, tile by tile (never a widened
    or dequantized copy): an 8-bit cache's codes with its float32 scales (flat, strides
    ``sst``), or float16 / bfloat16 elements (strides in 16-bit elements, no scales)."""
    from ... import _quant
    from ._flash import BF16, F16

    fmt = _quant.format_of(call.k.dtype)
    empty = _empty_ro(cdt)
    if fmt is None:
        code = F16 if call.k.dtype == np.float16 else BF16
        k, kc, kst = _bytes(call.k, np.dtype(np.uint16))
        v, vc, vst = _bytes(call.v, np.dtype(np.uint16))
        no = _empty_ro(np.dtype(np.float32))
        return k, empty, kst, v, empty, vst, (kc, vc, no, no, np.zeros(3, np.int64), code)
    k, kc, kst = _bytes(call.k, np.dtype(np.uint8))
    v, vc, vst = _bytes(call.v, np.dtype(np.uint8))
    ksc = _readonly_c(call.k_scales, np.dtype(np.float32))
    vsc = _readonly_c(call.v_scales, np.dtype(np.float32))
    _, s, h = ksc.shape
    sst = np.array([s * h, h, 1], np.int64)
    return (k, empty, kst, v, empty, vst,
            (kc, vc, ksc.reshape(-1), vsc.reshape(-1), sst, fmt.code))


def _not_stored() -> tuple:
    """The kernel's stored-format arguments for k and v in the compute dtype: empty arrays of
    the same (read-only) types, so every float32 call shares one compiled signature."""
    u8, f32 = _empty_ro(np.dtype(np.uint8)), _empty_ro(np.dtype(np.float32))
    return (u8, u8, f32, f32, np.zeros(3, np.int64), 0)


def _query(call: AttnCall, cdt: np.dtype) -> tuple:
    """(q 4-D, q as the compute dtype (flat, read-only), its strides, and the kernel's ``(qc,
    q_format)``): a float16 / bfloat16 q is read as its bytes (``qc``), widened as each query
    block loads; any other q is handed over in the compute dtype (``qc`` empty)."""
    from ._flash import BF16, F16

    dtype = np.dtype(call.q.dtype)
    if dtype == cdt:
        q, qf, qst = _flat(call.q, cdt)
        return q, qf, qst, (_empty_ro(np.dtype(np.uint8)), 0)
    q, qc, qst = _bytes(call.q, np.dtype(np.uint16))
    return q, _empty_ro(cdt), qst, (qc, F16 if dtype == np.float16 else BF16)


def _paging(call: AttnCall, k: np.ndarray) -> tuple:
    """The kernel's (table, page_size, n_pages) arguments: an empty table when not paged."""
    if call.block_table is None:
        return (_empty_table, 0, 0)
    table = np.ascontiguousarray(np.asarray(call.block_table), dtype=np.int64)
    if table.shape[1] == 0:
        table = np.zeros((table.shape[0], 1), np.int64)
    return (table, int(call.page_size), int(k.shape[0]))


_empty_table = np.zeros((0, 0), np.int64)
_empties: dict[tuple, np.ndarray] = {}


def _empty_ro(dtype: np.dtype) -> np.ndarray:
    """A read-only empty 1-D array of ``dtype`` (an unused input of the kernel), made once."""
    key = ("ro", np.dtype(dtype).str)
    e = _empties.get(key)
    if e is None:
        e = np.zeros(0, dtype)
        e.flags.writeable = False
        _empties[key] = e
    return e


def _empty(cdt: np.dtype, ndim: int, broadcast: bool = False) -> np.ndarray:
    """An empty ``cdt`` array of ``ndim`` dims (no alibi / mask / partial states), made once;
    ``broadcast``: a read-only broadcast view, as a mask is, so that the kernel sees the same
    argument types either way (one compiled signature)."""
    key = (np.dtype(cdt).str, ndim, broadcast)
    e = _empties.get(key)
    if e is None:
        e = np.zeros((0,) * ndim, cdt) if not broadcast else \
            np.broadcast_to(np.zeros((1,) * ndim, cdt), (0,) * ndim)
        _empties[key] = e
    return e


def _compact_mask(call: AttnCall, cdt: np.dtype) -> np.ndarray:
    """The mask as an additive ``cdt`` view broadcast to ``(n_seq, Hq, Sq_arr, Sk)``: converted
    at its stored size only (zero-stride axes stay broadcast), never materialised."""
    mv = call.mask_view
    if mv is None:
        return _empty(cdt, 4, broadcast=True)
    idx = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                for st, n in zip(mv.strides, mv.shape))
    small = mv[idx]
    if call.options.mask_kind == "bool":
        small = np.where(small, 0.0, -np.inf).astype(cdt)
    else:
        small = np.ascontiguousarray(small, dtype=cdt)
    return np.broadcast_to(small, mv.shape)


def _key_range(call: AttnCall, tasks: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Per task, the keys ``[lo, hi)`` that some row can see (as the kernel's tile skipping)."""
    s = tasks[:, 0]
    qpos_lo = call.q_pos0[s] + tasks[:, 2] // g
    qpos_hi = call.q_pos0[s] + (tasks[:, 2] + tasks[:, 3] - 1) // g
    lo, hi = tasks[:, 4].copy(), tasks[:, 5].copy()
    if call.options.window_left is not None and call.options.window_left >= 0:
        lo = np.maximum(lo, qpos_lo - call.options.window_left - call.k_pos0[s])
    bound = []
    if call.causal_hi is not None:
        bound.append(call.causal_hi[s])
    if call.options.window_right is not None and call.options.window_right >= 0:
        bound.append(np.full(len(s), call.options.window_right))
    if bound:
        hi = np.minimum(hi, qpos_hi + np.minimum.reduce(bound) - call.k_pos0[s] + 1)
    return lo, np.maximum(hi, lo)


def plan_tasks(call: AttnCall, n_threads: int, block_m: int | None = None,
               block_n: int | None = None) -> tuple[np.ndarray, int]:
    """Tasks ``(seq, kv head, first packed row, rows, first key, key end, slot)`` in natural order
    and the number of partial-state slots. Decode-sized calls split keys so every thread has
    work (flash-decoding); slots of one task are consecutive."""
    block_m = BLOCK_M if block_m is None else block_m
    block_n = BLOCK_N if block_n is None else block_n
    hq, hkv = call.n_heads, call.n_kv_heads
    g = hq // hkv
    q_len = call.q_len.astype(np.int64)
    k_len = call.k_len.astype(np.int64)
    rows = []
    for s in range(call.n_seq):
        packed = int(q_len[s]) * g
        for kvh in range(hkv):
            for r0 in range(0, packed, block_m):
                rows.append((s, kvh, r0, min(block_m, packed - r0), 0, int(k_len[s]), -1))
    tasks = np.array(rows, dtype=np.int64).reshape(-1, 7)
    n_tasks = tasks.shape[0]
    max_k = int(k_len.max()) if call.n_seq else 0
    if n_tasks == 0 or n_tasks >= 2 * n_threads or max_k < 2 * MIN_KEYS_PER_SPLIT:
        return tasks, 0
    # -- flash-decoding: split the key range of each task, merge the partial states later
    n_split = min(-(-4 * n_threads // n_tasks), max_k // MIN_KEYS_PER_SPLIT)
    split_rows = []
    slot = 0
    for t in tasks:
        k_end = int(t[5])
        chunk = -(-max(k_end, 1) // n_split)
        chunk = -(-chunk // block_n) * block_n
        for j0 in range(0, n_split * chunk, chunk):
            split_rows.append((*t[:4], min(j0, k_end), min(j0 + chunk, k_end), slot))
            slot += 1
    return np.array(split_rows, dtype=np.int64), slot


def schedule(call: AttnCall, tasks: np.ndarray, block_n: int) -> np.ndarray:
    """Tasks costliest first (rows x visible key tiles, longest-processing-time order), for the
    kernel's dynamic schedule; ties keep their natural (cache-friendly) order."""
    g = call.n_heads // call.n_kv_heads
    lo, hi = _key_range(call, tasks, g)
    tiles = -(-(hi - lo) // block_n)
    costs = tasks[:, 3].astype(np.float64) * (tiles + 1)  # + a fixed per-task cost
    return np.ascontiguousarray(tasks[np.argsort(-costs, kind="stable")])


def _blocks(call: AttnCall) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a call: 256 x 256 tiles keep BLAS efficient (its packing of the
    operands is amortised over more work); short causal / window calls take 128 x 128 tiles so
    the tiles cut by the diagonal waste less (S = 512: 10 tiles for 8 of work, not 3 for 2)."""
    masked = call.causal_hi is not None or call.options.window_left is not None or \
        call.options.window_right is not None
    rows = int(call.q_len.max(initial=0)) * (call.n_heads // call.n_kv_heads)
    if masked and rows <= SHORT_ROWS:
        return BLOCK_M_SHORT, BLOCK_N_SHORT
    return BLOCK_M, BLOCK_N


def _gemm_address(cdt: np.dtype) -> int:
    """The address of the BLAS ``sgemm`` / ``dgemm`` the kernel calls directly, with leading
    dimensions, so K / V tiles are read in place: MKL's (sequential) when the ``mkl`` package
    loads, else scipy's OpenBLAS (the library numba's ``np.dot`` uses); see :mod:`._blas`."""
    from . import _blas

    return _blas.gemm(cdt)[0]


def _jit_kernels(cdt: np.dtype, block_m: int, block_n: int, d_qk: int, d_v: int,
                 k_ld: int, v_ld: int) -> np.ndarray:
    """int64 (4,): MKL JIT kernels for a full tile read in place (see ``flash_forward``):
    ``S^T = gemm('T', 'N', block_m, block_n, d_qk, Q (ld d_qk), K (ld k_ld), 0, ld block_m)``
    and ``O^T += gemm('N', 'T', d_v, block_m, block_n, V (ld v_ld), P (ld block_m), 1,
    ld d_v)`` (``k_ld`` / ``v_ld``: the row strides of K and V, see ``_flat``); zeros (plain
    gemm) without MKL, for float64, or where MKL has no JIT code."""
    from . import _blas

    jit = np.zeros(4, np.int64)
    if cdt == np.float32:
        jit[0:2] = _blas.jit_sgemm(True, False, block_m, block_n, d_qk, d_qk, k_ld, 0.0,
                                   block_m)
        jit[2:4] = _blas.jit_sgemm(False, True, d_v, block_m, block_n, v_ld, block_m,
                                   1.0, d_v)
    return jit


_plans = _attnlib_plans.table()
MAX_PLANS = 64  # calls of a model repeat a few shapes


def _plan(call: AttnCall, seq: np.ndarray, n_threads: int, wl: int, wr: int, cdt: np.dtype,
          d_qk: int, d_v: int, k_ld: int, v_ld: int) -> tuple:
    """Everything a launch needs that depends only on the call's shape, memoised (``seq``
    holds the per-sequence lengths and positions): (block_m, block_n, tasks costliest first,
    tasks in natural order, partial-state slots, MKL JIT kernels (int64 (4,), zeros: plain
    gemm), the gemm's address, the per-thread scratch size, whether BLAS needs a thread
    limit). A repeated call shape skips that numpy work. The kernel never writes these
    arrays."""
    from . import _blas, _flash

    masked = call.causal_hi is not None or call.options.window_left is not None or \
        call.options.window_right is not None
    key = (seq.tobytes(), call.n_heads, call.n_kv_heads, wl, wr, n_threads, masked,
           np.dtype(cdt).str, d_qk, d_v, k_ld, v_ld)
    hit = _plans.get(key)
    if hit is not None:
        return hit
    block_m, block_n = _blocks(call)
    tasks, n_slots = plan_tasks(call, n_threads, block_m, block_n)
    dealt = schedule(call, tasks, block_n) if tasks.shape[0] else tasks
    full = tasks.shape[0] > 0 and int(tasks[:, 3].max()) == block_m and \
        int((tasks[:, 5] - tasks[:, 4]).max()) >= block_n
    jit = _jit_kernels(cdt, block_m, block_n, d_qk, d_v, k_ld, v_ld) if full else \
        np.zeros(4, np.int64)
    size = int(_flash.work_layout(block_m, block_n, d_qk, d_v)[-1])
    res = (block_m, block_n, dealt, tasks, n_slots, jit, _gemm_address(cdt), size,
           _blas.gemm(cdt)[1] != "mkl")
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = res
    return res


def blas_name() -> str:
    """The BLAS the tile gemms call (see :mod:`._blas`)."""
    from . import _blas

    return _blas.describe()


def attention(call: AttnCall, keep_acc: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The attention primitive: ``(out, lse)`` of ``call`` (see the package docstring);
    ``keep_acc``: ``out`` in the compute dtype (float32 for float16 / bfloat16), a partial
    state for a merge (``Backend.attention_state``)."""
    import numba

    from . import _flash, _ops

    dtype = call.dtype
    cdt = _ops.compute_dtype(dtype)
    q, qf, qst, q_stored = _query(call, cdt)
    if call.quantized or np.dtype(call.k.dtype) != cdt:
        k, kf, kst, v, vf, vst, kv_stored = _stored(call, cdt)
    else:
        k, kf, kst = _flat(call.k, cdt)
        v, vf, vst = _flat(call.v, cdt)
        kv_stored = _not_stored()
    bq, sq_arr, hq, _ = q.shape
    d_v = v.shape[3]
    big = _flash.BIG
    seq = np.empty((call.n_seq, 9), np.int64)
    for c, col in enumerate((call.q_batch, call.q_row0, call.q_len, call.k_batch,
                             call.k_row0, call.k_len, call.q_pos0, call.k_pos0)):
        seq[:, c] = col
    seq[:, 8] = big if call.causal_hi is None else call.causal_hi
    opts = call.options
    wl = big if opts.window_left is None or opts.window_left < 0 else int(opts.window_left)
    wr = big if opts.window_right is None or opts.window_right < 0 else int(opts.window_right)
    softcap = float(opts.softcap) if opts.softcap is not None else 0.0
    if opts.alibi is not None:
        alibi = np.ascontiguousarray(opts.alibi, dtype=cdt).reshape(call.n_seq, hq)
    else:
        alibi = _empty(cdt, 2)
    mask = _compact_mask(call, cdt)
    sinks = _empty(cdt, 1) if call.options.sinks is None else call.options.sinks.astype(cdt)
    # a dense call writes every output row (each row is one task's), so no zero fill
    covered = call.dense and bool((call.q_len == sq_arr).all())
    out = (np.empty if covered else np.zeros)((bq, sq_arr, hq, d_v), cdt)
    # rows no task reaches see no key
    lse = (np.empty((bq, hq, sq_arr), cdt) if covered
           else _flash.empty_lse(bq, hq, sq_arr, sinks, cdt))
    n_threads = numba.get_num_threads()
    g = hq // k.shape[2]
    block_m, block_n, dealt, tasks, n_slots, jit, gemm_fn, size, limit = \
        _plan(call, seq, n_threads, wl, wr, cdt, q.shape[3], d_v, int(kst[1]), int(vst[1]))
    if n_slots:
        part_o = np.zeros((n_slots, block_m, d_v), cdt)
        part_ml = np.zeros((n_slots, block_m, 2), cdt)
    else:
        part_o = part_ml = _empty(cdt, 3)
    if tasks.shape[0]:
        with _launch_lock, (_blas_single_thread() if limit else contextlib.nullcontext()):
            pre = (qf, kf, vf, qst, kst, vst, seq, dealt, g, float(call.options.scale), wl, wr,
                   softcap, alibi, mask, int(call.ring), sinks, block_m, block_n)
            post = (out, lse, part_o, part_ml, gemm_fn, jit) + _paging(call, k) + \
                kv_stored + q_stored
            _run_tasks(_flash.flash_forward, (pre, post), dealt.shape[0], n_threads, size,
                       cdt)
            if n_slots:
                _flash.merge_partials(seq, tasks, g, part_o, part_ml, out, lse, sinks)
    if dtype != cdt and not keep_acc:
        out = out.astype(dtype)
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    return out, lse.astype(lse_dtype, copy=False)
