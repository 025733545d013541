"""Every ATTNLIB_* environment variable, read lazily at call time (one table in the README)."""

from __future__ import annotations

import os

#: name -> (default, meaning); the README's table is generated from the same facts.
VARIABLES: dict[str, tuple[str, str]] = {
    "ATTNLIB_BACKEND": (
        "auto", "backend used when no argument, use_backend or set_backend applies"
    ),
    "ATTNLIB_TEST_BACKENDS": (
        "all available",
        "comma-separated backends the conformance suite runs (pytest plugin)",
    ),
    "ATTNLIB_TEST_EXAMPLES": (
        "25", "Hypothesis examples per random test of the conformance suite; read at import",
    ),
    "ATTNLIB_BENCH_DEBUG": (
        "unset", "set: ``attnlib bench`` prints the traceback of a case that failed",
    ),
    "PYOPENCL_CTX": ("unset", "pyopencl's device choice, honoured by the opencl backend"),
    "ATTNLIB_OPENCL_CP_ASYNC": (
        "unset",
        "how the portable OpenCL kernel stages K/V tiles: 0 through registers, 1 with NVIDIA's "
        "cp.async (the default on sm_80+; elsewhere 1 builds the same tile walk with plain "
        "copies); read at import",
    ),
    "ATTNLIB_NV_WGMMA": (
        "1", "0 keeps Hopper's 16-bit prefill on the mma.sync kernel instead of the warpgroup-MMA "
        "one; read at import",
    ),
    "ATTNLIB_NUMBA_BLAS": (
        "mkl if usable", "the BLAS the numba backend calls: mkl or openblas"
    ),
    "ATTNLIB_NUMBA_MKL_JIT": (
        "1", "0: the numba backend calls MKL's plain sgemm instead of its JIT kernels"
    ),
    "ATTNLIB_NUMBA_NO_TORCH_FIRST": (
        "unset", "set: the numba backend does not import PyTorch before loading MKL"
    ),

    "NUMBA_CACHE_DIR": (
        "$XDG_CACHE_HOME/attnlib/numba (~/.cache/attnlib/numba)",
        "where the numba backend keeps its compiled kernels (numba's own variable, honoured)",
    ),
    "XDG_CACHE_HOME": ("~/.cache", "the user cache directory holding attnlib/numba"),
    "POCL_CACHE_DIR": (
        "$XDG_CACHE_HOME/pocl/kcache (~/.cache/pocl/kcache)",
        "where PoCL caches the kernels it builds (PoCL's own variable; shown by attnlib info)",
    ),
}


def env_backend() -> str | None:
    """The ATTNLIB_BACKEND variable, stripped; None when unset or empty."""
    value = os.environ.get("ATTNLIB_BACKEND", "").strip()
    return value or None


def env_test_backends() -> list[str] | None:
    value = os.environ.get("ATTNLIB_TEST_BACKENDS", "").strip()
    if not value:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def test_backends_value() -> str:
    """ATTNLIB_TEST_BACKENDS as set ("" when unset): the pytest plugin splits it itself."""
    return os.environ.get("ATTNLIB_TEST_BACKENDS", "")


def test_examples() -> int:
    """ATTNLIB_TEST_EXAMPLES: Hypothesis examples per random test (25 when unset or empty)."""
    return int(os.environ.get("ATTNLIB_TEST_EXAMPLES", "") or 25)


def shown_variables(names: tuple[str, ...]) -> dict[str, str]:
    """The variables of ``names`` that are set, with their values (``attnlib info``)."""
    return {k: os.environ[k] for k in names if k in os.environ}


def env_bench_debug() -> bool:
    """ATTNLIB_BENCH_DEBUG set and not empty: ``attnlib bench`` prints the traceback of a case
    that failed (the table shows its one-line error either way)."""
    return bool(os.environ.get("ATTNLIB_BENCH_DEBUG", "").strip())


def opencl_cp_async() -> bool | None:
    """ATTNLIB_OPENCL_CP_ASYNC: True / False when set to 1 / 0, None when unset or empty."""
    value = os.environ.get("ATTNLIB_OPENCL_CP_ASYNC", "")
    return value not in ("", "0") if value else None


def nv_wgmma() -> bool:
    """ATTNLIB_NV_WGMMA: False only when it is "0"."""
    return os.environ.get("ATTNLIB_NV_WGMMA", "1") != "0"


def numba_blas() -> str:
    """ATTNLIB_NUMBA_BLAS, stripped and lower-cased ("" when unset)."""
    return os.environ.get("ATTNLIB_NUMBA_BLAS", "").strip().lower()


def numba_mkl_jit() -> bool:
    """ATTNLIB_NUMBA_MKL_JIT: False only when it is "0"."""
    return os.environ.get("ATTNLIB_NUMBA_MKL_JIT", "1") != "0"


def numba_no_torch_first() -> bool:
    """ATTNLIB_NUMBA_NO_TORCH_FIRST: True when set to anything non-empty."""
    return bool(os.environ.get("ATTNLIB_NUMBA_NO_TORCH_FIRST"))


def pyopencl_ctx() -> str:
    """PYOPENCL_CTX ("" when unset): the opencl backend lets pyopencl choose when it is set."""
    return os.environ.get("PYOPENCL_CTX", "")


def numba_cache_dir() -> str:
    """The numba backend's on-disk cache: NUMBA_CACHE_DIR when set (numba's own variable),
    else ``attnlib/numba`` in the user cache directory (XDG_CACHE_HOME, default ~/.cache), so
    that an install the user cannot write to (a system site-packages) still caches."""
    value = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    if value:
        return value
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnlib", "numba")


def pocl_cache_dir() -> str:
    """Where PoCL caches the kernels it builds (PoCL's own rule, pocl_cache.c): POCL_CACHE_DIR
    when set, else ``pocl/kcache`` in XDG_CACHE_HOME, else in ``$HOME/.cache``."""
    value = os.environ.get("POCL_CACHE_DIR", "")
    if value:
        return value
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(
        os.environ.get("HOME", "/tmp"), ".cache")
    return os.path.join(base, "pocl", "kcache")
