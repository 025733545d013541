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


def _caches() -> list[str]:
    """Where compiled kernels are kept on disk, as the libraries that keep them decide."""
    from attnlib import _config

    lines = [f"numba kernels: {_config.numba_cache_dir()}"]
    try:
        import platformdirs
        import pyopencl as cl
        from pyopencl.characterize import has_src_build_cache
        from pyopencl.invoker import invoker_cache
    except Exception as exc:  # noqa: BLE001 - pyopencl missing or unusable
        return lines + [f"OpenCL: (pyopencl not usable: {exc})"]
    # pyopencl's own binary cache serves only devices whose driver has none (has_src_build_cache)
    own = os.path.join(platformdirs.user_cache_dir("pyopencl", "pyopencl"),
                       "pyopencl-compiler-cache-v2-py" + ".".join(map(str, sys.version_info)))
    try:
        devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    except cl.Error:
        devices = []
    for dev in devices:
        if dev.platform.name == "Portable Computing Language":
            where = f"PoCL's cache {_config.pocl_cache_dir()}"
        elif has_src_build_cache(dev):
            where = "the driver's own cache"
        else:
            where = f"pyopencl's cache {own}"
        lines.append(f"OpenCL kernels for {dev.name.strip()}: {where}")
    lines.append(f"pyopencl's kernel argument code: {invoker_cache.container_dir}")
    return lines


def _render(value, indent: str) -> list[str]:
    """A backend's info() value: scalars inline, dicts and lists one entry per line."""
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list, tuple)) and v:
                out.append(f"{indent}{k}:")
                out.extend(_render(v, indent + "  "))
            else:
                out.append(f"{indent}{k}: {v}")
        return out
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            if isinstance(v, dict):
                sub = _render(v, indent + "  ")
                out.append(indent + "- " + sub[0].lstrip() if sub else indent + "-")
                out.extend(sub[1:])
            else:
                out.append(f"{indent}- {v}")
        return out
    return [f"{indent}{value}"]


def cmd_info(_args) -> int:
    """What runs here. Never fails: each part that cannot be found out says why instead."""
    import numpy as np

    import attnlib
    from attnlib import registry
    from attnlib._config import env_backend, shown_variables

    print(f"attnlib {attnlib.__version__} | Python {platform.python_version()} | "
          f"numpy {np.__version__} | {platform.machine()} {platform.system()}")
    for mod in ("numba", "pyopencl", "ml_dtypes", "torch"):
        try:
            ver = __import__(mod).__version__
        except Exception:
            ver = "not installed"
        print(f"  {mod:10s} {ver}")
    try:
        avail = registry.available_backends()
        known = registry.known_backends()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(f"backends: could not be listed ({type(exc).__name__}: {exc})")
        avail, known = [], []
    print("backends, in the order auto tries them:")
    for name in avail + [n for n in known if n not in avail]:
        if name not in avail:
            print(f"  {name:8s} not available")
            continue
        print(f"  {name:8s} available")
        try:
            print("\n".join(_render(registry.get_backend(name).info(), " " * 12)))
        except Exception as exc:  # noqa: BLE001
            print(f"            (info failed: {type(exc).__name__}: {exc})")
    env = env_backend()
    try:
        chosen = registry.current_choice(None)
        default = registry.resolve_backend().name
        how = f"ATTNLIB_BACKEND={env}" if env is not None and chosen is not None else "auto"
        print(f"default here: {default} (chosen by {how})")
    except Exception as exc:  # noqa: BLE001 - a bad ATTNLIB_BACKEND is reported as such
        print(f"default here: none: {exc}")
        if env is not None:
            print("  every call without backend= raises this error until ATTNLIB_BACKEND is "
                  "fixed or unset")
    print("OpenCL devices:")
    for line in _opencl_devices():
        print("  " + line)
    print("caches (compiled once, loaded by later processes):")
    for line in _caches():
        print("  " + line)
    shown = shown_variables(("ATTNLIB_BACKEND", "PYOPENCL_CTX"))
    if shown:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    if getattr(_args, "why", False):
        _print_why()
    return 0


#: the typical calls ``attnlib info --why`` explains: (label, dtype, B, Sq, Sk, Hq, Hkv, D, causal)
_WHY_CALLS = (
    ("prefill float16 S=2048 D=128 causal", "float16", 1, 2048, 2048, 32, 8, 128, True),
    ("prefill float32 S=2048 D=128 causal", "float32", 1, 2048, 2048, 32, 8, 128, True),
    ("decode float16 1 row, 8192 keys", "float16", 1, 1, 8192, 32, 8, 128, True),
    ("prefill float16 D=80", "float16", 1, 512, 512, 16, 16, 80, False),
)


def _print_why() -> None:
    """Which kernel family of the OpenCL backend runs each typical call, and why each family
    tried before it did not (attnlib.backends.opencl.why); nothing runs."""
    import numpy as np

    print("OpenCL kernel families for typical calls (first that takes the call runs it):")
    try:
        from attnlib.backends.opencl import why
        from attnlib.registry import get_backend

        be = get_backend("opencl")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(f"  (the opencl backend is not usable here: {type(exc).__name__}: {exc})")
        return
    for label, dtype, b, sq, sk, hq, hkv, d, causal in _WHY_CALLS:
        q = np.zeros((b, sq, hq, d), dtype)
        k = np.zeros((b, sk, hkv, d), dtype)
        print(f"  {label}:")
        for name, reason in why(q, k, k, causal=causal, backend=be):
            print(f"    {name:26s} {'runs it' if reason is None else 'skipped: ' + reason}")


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
    info = sub.add_parser("info", help="backends, OpenCL platforms and devices, versions, the "
                          "default")
    info.add_argument("--why", action="store_true",
                      help="also which OpenCL kernel family runs typical calls, and why each "
                           "faster one was skipped")
    chk = sub.add_parser("check", help="quick conformance run on every available backend")
    chk.add_argument("--backend", help="comma-separated backends (default: all available)")
    sub.add_parser("bench", help="backends side by side (see `attnlib bench --help`)")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
