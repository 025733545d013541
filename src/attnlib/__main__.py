"""The ``attnlib`` command: ``info``, ``check``, ``bench``; ``python -m attnlib`` is the same."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def _opencl_devices() -> list[str]:
    try:
        import pyopencl as cl
    except Exception as exc:  # pyopencl missing or its ICD loader broken
        return [f"(pyopencl not usable: {exc})"]
    from attnlib.backends.opencl._runtime import describe_platforms

    try:
        lines = describe_platforms()
    except cl.Error as exc:
        return [f"(no OpenCL platform: {exc})"]
    return lines or ["(no OpenCL devices)"]


def cmd_info(_args) -> int:
    import numpy as np

    import attnlib
    from attnlib import registry

    print(f"attnlib {attnlib.__version__} | Python {platform.python_version()} | "
          f"numpy {np.__version__} | {platform.machine()} {platform.system()}")
    for mod in ("numba", "pyopencl", "ml_dtypes", "torch"):
        try:
            ver = __import__(mod).__version__
        except Exception:
            ver = "not installed"
        print(f"  {mod:10s} {ver}")
    avail = registry.available_backends()
    print("backends (auto order):")
    for name in registry.known_backends():
        state = "available" if name in avail else "not available"
        line = f"  {name:8s} {state}"
        if name in avail:
            try:
                extra = registry.get_backend(name).info()
                line += "  " + ", ".join(f"{k}={v}" for k, v in extra.items())
            except Exception as exc:
                line += f"  (info failed: {exc})"
        print(line)
    chosen = registry.current_choice(None)
    default = registry.resolve_backend().name if avail else "none"
    print(f"default here: {default}" + (f" (chosen by {chosen!r})" if chosen else " (auto)"))
    print("OpenCL devices:")
    for line in _opencl_devices():
        print("  " + line)
    env = {k: os.environ[k] for k in ("ATTNLIB_BACKEND", "PYOPENCL_CTX") if k in os.environ}
    if env:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    return 0


def cmd_check(args) -> int:
    """A quick conformance run (the shipped suite, fast cases) on every available backend."""
    import pytest

    from attnlib import registry

    backends = args.backend or ",".join(registry.available_backends())
    argv = ["--pyargs", "attnlib.testing", "-q", "-p", "no:cacheprovider",
            f"--attnlib-backend={backends}", "-m", "not slow", "-x",
            # attnlib is imported before pytest starts, so its asserts cannot be rewritten
            "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    print(f"attnlib check: conformance suite on {backends}", flush=True)
    return int(pytest.main(argv))


def cmd_bench(argv: list[str]) -> int:
    from attnlib._bench.cli import main as bench_main

    return int(bench_main(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="attnlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, OpenCL platforms and devices, versions, the default")
    chk = sub.add_parser("check", help="quick conformance run on every available backend")
    chk.add_argument("--backend", help="comma-separated backends (default: all available)")
    sub.add_parser("bench", help="backends side by side (see `attnlib bench --help`)")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
