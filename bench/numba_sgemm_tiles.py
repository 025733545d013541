"""Time per sgemm call at the numba kernel's tile shapes: OpenBLAS vs MKL vs MKL's JIT gemm.

    python bench/numba_sgemm_tiles.py

The two products of one tile exactly as ``_flash.flash_forward`` issues them (column-major,
K / V read in place with leading dimension ``Hkv * D``, H = 8 kv heads):
``S^T = gemm('T', 'N', rows, keys, D, Q, K)`` and ``O^T += gemm('N', 'T', D, rows, keys, V, P)``,
called from numba through the same function pointers as the kernel (``_gemm``; the JIT kernel as
``fn(jitter, a, b, c)``), one thread, walking the key tiles of one head of an S = 2048 (512)
sequence. CPU time, best of 5 runs of 200 calls. Needs the ``mkl`` wheel.
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import njit

from attnlib.backends.numba_backend import _blas, _blas_single_thread
from attnlib.backends.numba_backend._flash import _call_jit, _gemm


@njit
def _loop(fn, jfn, jitter, ta, tb, m, n, k, a_arr, lda, astep, b_arr, ldb, bstep, beta, c_arr,
          ldc, ntile, reps):
    bi = np.zeros(8, np.int32)
    bf = np.zeros(2, np.float32)
    a0 = np.int64(a_arr.ctypes.data)
    b0 = np.int64(b_arr.ctypes.data)
    c0 = np.int64(c_arr.ctypes.data)
    for it in range(reps):
        a = a0 + (it % ntile) * astep
        b = b0 + (it % ntile) * bstep
        if jfn != 0:
            _call_jit(jfn, jitter, a, b, c0)
        else:
            _gemm(fn, ta, tb, m, n, k, 1.0, a, lda, b, ldb, beta, c0, ldc, bi, bf)
    return c_arr[0]


def _time(*args, reps: int = 200) -> float:
    _loop(*args, 5)
    best = 1e9
    for _ in range(5):
        t0 = time.process_time()
        _loop(*args, reps)
        best = min(best, (time.process_time() - t0) / reps)
    return best * 1e6


def main() -> None:
    os.environ.setdefault("ATTNLIB_NUMBA_BLAS", "mkl")
    openblas = _blas._openblas_address("sgemm")
    mkl, lib = _blas.gemm(np.dtype(np.float32))
    assert lib == "mkl", "needs the mkl wheel"
    print(f"load average {os.getloadavg()[0]:.2f}; microseconds per call (GFLOP/s)")
    print("| rows x keys, D | product | OpenBLAS | MKL sgemm | MKL JIT |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    with _blas_single_thread():
        for nr, n, d, s in [(256, 256, 64, 2048), (128, 128, 64, 512), (256, 256, 128, 2048)]:
            ld = 8 * d
            kv = rng.standard_normal(s * ld, dtype=np.float32)
            step = n * ld * 4
            qt = rng.standard_normal(nr * d, dtype=np.float32)
            p = rng.random(nr * n, dtype=np.float32)
            st = np.zeros(nr * n, np.float32)
            ot = np.zeros(nr * d, np.float32)
            flops = 2 * nr * n * d
            for label, ta, tb, m, nn, k, a, lda, astep, b, ldb, bstep, beta, c, ldc in [
                ("Q K^T", True, False, nr, n, d, qt, d, 0, kv, ld, step, 0.0, st, nr),
                ("P V", False, True, d, nr, n, kv, ld, step, p, nr, 0, 1.0, ot, d),
            ]:
                shape = (ta, tb, m, nn, k, a, lda, astep, b, ldb, bstep, beta, c, ldc, s // n)
                t_ob = _time(openblas, 0, 0, *shape)
                t_mkl = _time(mkl, 0, 0, *shape)
                jfn, jitter = _blas.jit_sgemm(ta, tb, m, nn, k, lda, ldb, beta, ldc)
                t_jit = _time(0, jfn, jitter, *shape) if jfn else float("nan")
                cells = [f"{t:.1f} ({flops / t / 1e3:.0f})" if t == t else "no JIT code"
                         for t in (t_ob, t_mkl, t_jit)]
                print(f"| {nr} x {n}, {d} | {label} | " + " | ".join(cells) + " |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
