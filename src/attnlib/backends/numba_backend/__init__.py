"""The numba backend: FlashAttention-style tiled attention on the CPU.

``attention`` runs :func:`._flash.flash_forward`: query blocks x key blocks with the online-softmax
rescale, BLAS gemms on contiguous tiles, no Sq x Sk buffer, key tiles hidden by causal / window
skipped, parallel over (sequence, kv head, query block) and, for decode-sized calls, over key
splits merged afterwards in a fixed order (bitwise reproducible). float16 / bfloat16 inputs are
widened to float32 before the kernel and accumulate in float32; float64 stays float64.

The other primitives (softmax, merge_states, rope, the KV cache) are small numba / numpy code.
Compiled functions are cached on disk (``cache=True``): the first call in a fresh environment
compiles for a few tens of seconds, later processes load the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import AttnCall, Backend, RopeSpec

BLOCK_M = 128  # packed query rows per task
BLOCK_N = 128  # keys per tile
# decode-sized calls (few tasks) split each task's keys so that every thread has work
MIN_KEYS_PER_SPLIT = 4 * BLOCK_N

_available: bool | None = None
# numba's default (workqueue) threading layer must not be entered by two threads at once, and
# the BLAS thread limit below is process-wide: one kernel launch at a time.
_launch_lock = threading.Lock()


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


def _compact_mask(call: AttnCall, cdt: np.dtype) -> np.ndarray:
    """The mask as an additive ``cdt`` view broadcast to ``(n_seq, Hq, Sq_arr, Sk)``: converted
    at its stored size only (zero-stride axes stay broadcast), never materialised."""
    mv = call.mask_view
    if mv is None:
        m = np.zeros((1, 1, 1, 1), cdt)
        return np.broadcast_to(m, (0, 0, 0, 0))
    idx = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                for st, n in zip(mv.strides, mv.shape))
    small = mv[idx]
    if call.mask_kind == "bool":
        small = np.where(small, 0.0, -np.inf).astype(cdt)
    else:
        small = np.ascontiguousarray(small, dtype=cdt)
    return np.broadcast_to(small, mv.shape)


def plan_tasks(call: AttnCall, n_threads: int, block_m: int = BLOCK_M,
               block_n: int = BLOCK_N) -> tuple[np.ndarray, int]:
    """Tasks ``(seq, kv head, first packed row, rows, first key, key end, slot)`` and the number
    of partial-state slots. Decode-sized calls split keys so every thread has work."""
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


class NumbaBackend(Backend):
    """CPU backend: FlashAttention tiling in numba, BLAS gemms on the tiles (see module doc)."""

    name = "numba"
    description = "numba CPU kernels (FlashAttention tiling, online softmax, BLAS tiles)"

    @classmethod
    def is_available(cls) -> bool:
        global _available
        if _available is None:
            try:
                import numba  # noqa: F401

                _available = True
            except Exception:
                _available = False
        return _available

    @classmethod
    def auto_priority(cls) -> int:
        return 20

    def info(self) -> dict:
        import numba

        return {
            "numba": numba.__version__,
            "threads": numba.get_num_threads(),
            "threading_layer": numba.config.THREADING_LAYER,
            "block_m": BLOCK_M,
            "block_n": BLOCK_N,
        }

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, call: AttnCall) -> tuple[np.ndarray, np.ndarray]:
        import numba

        from . import _flash, _ops

        dtype = call.dtype
        cdt = _ops.compute_dtype(dtype)
        q = _readonly_c(call.q, cdt)
        k = _readonly_c(call.k, cdt)
        v = _readonly_c(call.v, cdt)
        bq, sq_arr, hq, _ = q.shape
        d_v = v.shape[3]
        big = _flash.BIG
        seq = np.stack([call.q_batch, call.q_row0, call.q_len, call.k_batch, call.k_row0,
                        call.k_len, call.q_pos0, call.k_pos0,
                        call.causal_hi if call.causal_hi is not None
                        else np.full(call.n_seq, big)], axis=1).astype(np.int64)
        seq = np.ascontiguousarray(seq.reshape(-1, 9))
        wl = big if call.window_left is None or call.window_left < 0 else int(call.window_left)
        wr = big if call.window_right is None or call.window_right < 0 else int(call.window_right)
        softcap = float(call.softcap) if call.softcap is not None else 0.0
        if call.alibi is not None:
            alibi = np.ascontiguousarray(call.alibi, dtype=cdt).reshape(call.n_seq, hq)
        else:
            alibi = np.zeros((0, 0), cdt)
        mask = _compact_mask(call, cdt)
        out = np.zeros((bq, sq_arr, hq, d_v), cdt)
        lse = np.full((bq, hq, sq_arr), -np.inf, cdt)
        n_threads = numba.get_num_threads()
        tasks, n_slots = plan_tasks(call, n_threads)
        part_o = np.zeros((n_slots, BLOCK_M, d_v), cdt)
        part_ml = np.zeros((n_slots, BLOCK_M, 2), cdt)
        if tasks.shape[0]:
            with _launch_lock, _blas_single_thread():
                _flash.flash_forward(q, k, v, seq, tasks, hq // k.shape[2], float(call.scale),
                                     wl, wr, softcap, alibi, mask, int(call.ring), BLOCK_M,
                                     BLOCK_N, n_threads, out, lse, part_o, part_ml)
                if n_slots:
                    _flash.merge_partials(seq, tasks, hq // k.shape[2], part_o, part_ml,
                                          out, lse)
        if dtype != cdt:
            out = out.astype(dtype)
        lse_dtype = np.float64 if dtype == np.float64 else np.float32
        return out, lse.astype(lse_dtype, copy=False)

    # ---- online-softmax primitives -------------------------------------------------------------
    def softmax(self, x: Any, axis: int, log: bool) -> np.ndarray:
        from . import _ops

        return _ops.softmax(np.asarray(x), axis, log)

    def merge_states(self, outs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
        from . import _ops

        return _ops.merge_states([np.asarray(o) for o in outs], [np.asarray(x) for x in lses])

    def rope(self, x: Any, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
        from . import _ops

        return _ops.rope(np.asarray(x), positions, spec)

    # ---- KV cache -----------------------------------------------------------------------------
    def cache_alloc(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def cache_write(self, buf, src, rows, start_pos, rope: RopeSpec | None) -> None:
        from . import _ops

        cap = buf.shape[1]
        n_new = src.shape[1]
        pos = np.asarray(start_pos, np.int64)[:, None] + np.arange(n_new)[None, :]
        if rope is not None:
            src = _ops.rope(np.asarray(src), pos, rope)
        for b in range(src.shape[0]):
            buf[int(rows[b]), pos[b] % cap] = src[b]
