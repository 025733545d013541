"""Which BLAS ``?gemm`` the numba kernel calls: MKL's (the PyPI ``mkl`` wheel, sequential) when
it loads, else scipy's OpenBLAS.

The kernel calls the Fortran ``sgemm`` / ``dgemm`` by address (an int64 argument, never a
constant compiled into the cached code, so the on-disk cache survives a different load address
in the next process). MKL must not start threads of its own (the backend runs its own caller
and helper threads), so it is loaded through ``libmkl_rt`` with the *sequential* threading
layer, which is thread-safe. ``ATTNLIB_NUMBA_BLAS=openblas`` (or ``mkl``) forces the choice.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

import numpy as np

from ... import _config

MKL_THREADING_SEQUENTIAL = 1

_lock = threading.Lock()
_mkl: ctypes.CDLL | None = None
_mkl_tried = False
_mkl_error = ""


def _find_mkl_rt() -> str | None:
    """The path of ``libmkl_rt.so*`` installed by the ``mkl`` distribution, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution("mkl")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name.startswith("libmkl_rt.so"):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    return None


def _torch_first() -> None:
    """Import PyTorch, when it is installed and not imported yet, before MKL loads.

    ``libmkl_rt``'s first call dlopens MKL's layer libraries into the process's global symbol
    scope, and a PyTorch imported afterwards binds its own MKL calls to them: it then sizes its
    OpenMP pool from the sequential layer's ``mkl_get_max_threads()`` = 1 and runs
    single-threaded (``torch.get_num_threads()`` reports 1, and its SDPA runs about half as fast
    on two cores). Importing it first costs ~1-2 s once and keeps PyTorch's own bindings."""
    import importlib.util
    import sys

    if "torch" in sys.modules or _config.numba_no_torch_first():
        return
    try:
        if importlib.util.find_spec("torch") is not None:
            import torch  # noqa: F401
    except Exception:  # pragma: no cover - a broken torch install must not stop the backend
        pass


def load_mkl() -> ctypes.CDLL | None:
    """``libmkl_rt`` on the sequential threading layer, or None (not x86_64, not installed,
    does not load, or an earlier user in this process already chose a threaded layer)."""
    global _mkl, _mkl_tried, _mkl_error
    with _lock:
        if _mkl_tried:
            return _mkl
        _mkl_tried = True
        if platform.machine().lower() not in ("x86_64", "amd64"):
            _mkl_error = f"not x86_64 ({platform.machine()})"
            return None
        path = _find_mkl_rt()
        if path is None:
            _mkl_error = "the mkl package is not installed"
            return None
        _torch_first()
        try:
            lib = ctypes.CDLL(path)
            lib.MKL_Set_Threading_Layer.restype = ctypes.c_int
            lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
            layer = lib.MKL_Set_Threading_Layer(MKL_THREADING_SEQUENTIAL)
        except (OSError, AttributeError) as e:
            _mkl_error = f"{path}: {e}"
            return None
        if layer != MKL_THREADING_SEQUENTIAL:  # MKL was already in use, threaded
            _mkl_error = f"MKL threading layer is {layer}, not sequential"
            return None
        _mkl = lib
        return lib


def _openblas_address(name: str) -> int:
    from numba.extending import get_cython_function_address

    return get_cython_function_address("scipy.linalg.cython_blas", name)


_addresses: dict[str, tuple[int, str]] = {}


def gemm(cdt: np.dtype) -> tuple[int, str]:
    """(address of the Fortran ``sgemm`` / ``dgemm`` for compute dtype ``cdt``, library name)."""
    name = "sgemm" if cdt == np.float32 else "dgemm"
    hit = _addresses.get(name)
    if hit is not None:
        return hit
    choice = _config.numba_blas()
    res = None
    if choice != "openblas":
        lib = load_mkl()
        if lib is not None:
            res = (ctypes.cast(getattr(lib, name + "_"), ctypes.c_void_p).value, "mkl")
        elif choice == "mkl":
            raise RuntimeError(f"ATTNLIB_NUMBA_BLAS=mkl, but MKL is unusable: {_mkl_error}")
    if res is None:
        res = (_openblas_address(name), "openblas")
    _addresses[name] = res
    return res


MKL_COL_MAJOR, MKL_NOTRANS, MKL_TRANS = 102, 111, 112
MKL_JIT_SUCCESS = 0
_jitters: dict[tuple, tuple[int, int]] = {}
MAX_JITTERS = 256  # tile shapes kept (never freed: a few KiB of code each)


def jit_sgemm(trans_a: bool, trans_b: bool, m: int, n: int, k: int, lda: int, ldb: int,
              beta: float, ldc: int) -> tuple[int, int]:
    """MKL's JIT ``sgemm`` specialised to one column-major shape (``alpha = 1``):
    ``(kernel address, jitter address)``, called as ``kernel(jitter, a, b, c)``; ``(0, 0)``
    when the kernel does not call MKL or MKL generates no code for that shape (then plain
    ``sgemm`` is as fast). Jitters are cached by shape and read-only, so threads share them."""
    key = (trans_a, trans_b, m, n, k, lda, ldb, beta, ldc)
    hit = _jitters.get(key)
    if hit is not None:
        return hit
    res = (0, 0)
    if gemm(np.dtype(np.float32))[1] == "mkl" and len(_jitters) < MAX_JITTERS and \
            _config.numba_mkl_jit():
        lib = _mkl
        create = getattr(lib, "mkl_cblas_jit_create_sgemm", None)  # MKL >= 2019
        if create is None:
            _jitters[key] = res
            return res
        create.restype = ctypes.c_int
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_int] * 6 + \
            [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        get_ptr = lib.mkl_jit_get_sgemm_ptr
        get_ptr.restype = ctypes.c_void_p
        get_ptr.argtypes = [ctypes.c_void_p]
        jitter = ctypes.c_void_p()
        status = create(ctypes.byref(jitter), MKL_COL_MAJOR,
                        MKL_TRANS if trans_a else MKL_NOTRANS,
                        MKL_TRANS if trans_b else MKL_NOTRANS, m, n, k, 1.0, lda, ldb, beta, ldc)
        if status == MKL_JIT_SUCCESS and jitter.value:
            res = (get_ptr(jitter) or 0, jitter.value)
            if not res[0]:
                res = (0, 0)
        elif jitter.value:
            lib.mkl_jit_destroy.argtypes = [ctypes.c_void_p]
            lib.mkl_jit_destroy(jitter)
    _jitters[key] = res
    return res


def describe() -> str:
    """The library the float32 kernel calls (for ``info()``)."""
    _, lib = gemm(np.dtype(np.float32))
    return lib if lib != "openblas" or not _mkl_error else f"openblas ({_mkl_error})"
