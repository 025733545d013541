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
    "PYOPENCL_CTX": ("unset", "pyopencl's device choice, honoured by the opencl backend"),
    "NUMBA_CACHE_DIR": (
        "$XDG_CACHE_HOME/attnlib/numba (~/.cache/attnlib/numba)",
        "where the numba backend keeps its compiled kernels (numba's own variable, honoured)",
    ),
    "XDG_CACHE_HOME": ("~/.cache", "the user cache directory holding attnlib/numba"),
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
