"""The numba backend: FlashAttention-style tiled attention on the CPU.

``attention`` runs :func:`._flash.flash_forward`: query blocks x key blocks with the online-softmax
rescale, BLAS gemms on contiguous tiles, no Sq x Sk buffer, key tiles hidden by causal / window
skipped, parallel over (sequence, kv head, query block) and, for decode-sized calls, over key
splits merged afterwards in a fixed order (bitwise reproducible). float16 / bfloat16 q, k and v
are read in their own dtype and widened to float32 tile by tile as the kernel loads them
(``_flash._load_q``, ``_flash._load_stored``; never a widened copy of an input), accumulating in
float32; float64 stays float64. The tile gemms call MKL (sequential; its JIT kernels for full
float32 tiles) when the ``mkl`` wheel is installed, else scipy's OpenBLAS (:mod:`._blas`).

Paged calls (``AttnCall.block_table``) run the same kernel: a key tile whose pages follow each
other in the pool is read in place, any other is gathered one page at a time into the thread's
scratch tile (``_flash._load_paged``); fp16/bf16 pools are widened as their tiles load.
Quantized caches (``AttnCall.k_scales``) are read by the same kernel: each key / value tile is
dequantized into the scratch tile as it is loaded (``_flash._load_stored``: int8 sign-extended,
an fp8 byte converted through the float16 of the same bits, times the row's scale, read once
per row), never as a copy of the cache. KV cache buffers are head-major (:meth:`NumbaBackend.
cache_alloc`, :meth:`NumbaBackend.page_alloc`), so a tile is one contiguous block.

The other primitives (softmax, merge_states, rope, the KV caches) are small numba / numpy code.
Compiled functions are cached on disk (:mod:`._cache`: ``NUMBA_CACHE_DIR`` when set, else
``~/.cache/attnlib/numba``): the first call in a fresh environment compiles for a few tens of
seconds, later processes load the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import _quant
from ..base import AttnCall, Backend, HostPages, RopeSpec
from . import _launch

_available: bool | None = None


class NumbaBackend(HostPages, Backend):
    """CPU backend: FlashAttention tiling in numba, BLAS gemms on the tiles (see module doc)."""

    name = "numba"
    description = "numba CPU kernels (FlashAttention tiling, online softmax, BLAS tiles)"

    @classmethod
    def is_available(cls) -> bool:
        """numba imports, and scipy's BLAS that numba's ``np.dot`` calls is there."""
        global _available
        if _available is None:
            try:
                import numba  # noqa: F401
                import scipy.linalg.cython_blas  # noqa: F401

                _available = True
            except Exception:
                _available = False
        return _available

    @classmethod
    def auto_priority(cls) -> int:
        return 20

    def info(self) -> dict:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel region has run yet
            layer = f"not started (config: {numba.config.THREADING_LAYER})"
        return {
            "numba": numba.__version__,
            "threads": numba.get_num_threads(),
            "threading_layer": layer,
            "block_m": _launch.BLOCK_M,
            "block_n": _launch.BLOCK_N,
            "blas": _launch.blas_name(),
        }

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, call: AttnCall) -> tuple[np.ndarray, np.ndarray]:
        return _launch.attention(call)

    def attention_state(self, call: AttnCall) -> tuple[np.ndarray, np.ndarray]:
        return _launch.attention(call, keep_acc=True)

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
        """A KV cache buffer ``(max_batch, max_seq_len, Hkv, D)`` is head-major, as pages are
        (:meth:`page_alloc`): memory ``(max_batch, Hkv, max_seq_len, D)`` seen through the
        contract's shape, so a key tile of one kv head is one contiguous block that the kernel
        streams (token-major, its rows lie ``Hkv * D`` elements apart, each on its own stretch
        of memory: a decode step ran about twice as long, see bench/RESULTS.md). Other shapes
        (the per-(token, kv head) scales) are C order."""
        if len(shape) != 4:
            return np.zeros(shape, dtype=dtype)
        b, s, h, d = shape
        return np.zeros((b, h, s, d), dtype=dtype).transpose(0, 2, 1, 3)

    def page_alloc(self, shape, dtype) -> np.ndarray:
        """Head-major pages: memory ``(num_pages, Hkv, page_size, D)`` seen as ``(num_pages,
        page_size, Hkv, D)``, so each kv head's rows of a page are one contiguous block (a
        scattered page is one streaming read, not page_size rows a whole token apart)."""
        p, ps, h, d = shape
        return np.zeros((p, h, ps, d), dtype=dtype).transpose(0, 2, 1, 3)

    def cache_write(self, buf, src, rows, start_pos, rope: RopeSpec | None,
                    scales=None) -> None:
        from . import _ops

        cap = buf.shape[1]
        n_new = src.shape[1]
        pos = np.asarray(start_pos, np.int64)[:, None] + np.arange(n_new)[None, :]
        if rope is not None:
            src = _ops.rope(np.asarray(src), pos, rope)
        if scales is not None:
            src, sc = _quant.quantize(src, _quant.format_of(buf.dtype))
            for b in range(src.shape[0]):
                scales[int(rows[b]), pos[b] % cap] = sc[b]
        for b in range(src.shape[0]):
            buf[int(rows[b]), pos[b] % cap] = src[b]
