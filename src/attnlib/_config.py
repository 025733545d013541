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


def env_bench_debug() -> bool:
    """ATTNLIB_BENCH_DEBUG set and not empty: ``attnlib bench`` prints the traceback of a case
    that failed (the table shows its one-line error either way)."""
    return bool(os.environ.get("ATTNLIB_BENCH_DEBUG", "").strip())
