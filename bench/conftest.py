"""pytest-benchmark suites: every available backend beside PyTorch, one group per shape.

    pytest bench/ --benchmark-only                         # every backend, every shape
    pytest bench/ --benchmark-only --bench-backends numba,torch
    pytest bench/ --benchmark-only --benchmark-autosave    # keep this run (.benchmarks/)
    pytest-benchmark compare 0001 0002 --group-by=group    # before / after

A test asks for the ``bench_runner`` fixture and gets one parametrized instance per backend
(attnlib's through the public API, and ``torch`` for PyTorch SDPA when it is installed).
``run_case`` times one case: a first call (JIT compile / kernel build, kept in extra_info as
``first_call_s``), then ``benchmark.pedantic`` for as many rounds as fit about 5 s (3 to 50).
A call predicted to take longer than ``--bench-max-call`` seconds (from the rate the same backend
reached on a smaller case of the task) is skipped with that reason: the numpy reference and
PoCL would take minutes on the largest shapes. The printed tables group by shape, so each puts
the backends side by side; extra_info carries FLOPs, bytes, GFLOP/s and GB/s.

    python -m pytest bench -q --benchmark-disable           # smoke run (CI): every case once

With ``--benchmark-disable`` nothing is timed: each case runs once on every backend, shrunk to
small sizes (``smoke_case``), so that the suites cannot rot without costing minutes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest

from attnlib._bench.runners import AttnlibRunner, TorchRunner, make_inputs
from attnlib._bench.shapes import Case

_RUNNERS: dict[str, Any] = {}
_RATES: dict[tuple[str, str], float] = {}  # (backend, family) -> FLOP/s reached so far
TARGET_S = 5.0  # measured time per benchmark, about
MIN_ROUNDS, MAX_ROUNDS = 3, 50


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("attnlib-bench")
    g.addoption("--bench-backends", default=os.environ.get("ATTNLIB_BENCH_BACKENDS"),
                help="comma-separated backends to benchmark, 'torch' for PyTorch SDPA "
                     "(default: every available backend, and torch when installed)")
    g.addoption("--bench-max-call", type=float, default=10.0,
                help="skip a case whose single call is predicted longer than this (s)")


def _backend_names(config: pytest.Config) -> list[str]:
    import importlib.util

    import attnlib

    opt = config.getoption("--bench-backends")
    if opt:
        return [n.strip() for n in opt.split(",") if n.strip()]
    names = attnlib.available_backends()
    if importlib.util.find_spec("torch") is not None:
        names.append("torch")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "bench_runner" in metafunc.fixturenames:
        metafunc.parametrize("bench_runner", _backend_names(metafunc.config), indirect=True)


@pytest.fixture
def bench_runner(request: pytest.FixtureRequest) -> Any:
    name = request.param
    if name not in _RUNNERS:
        _RUNNERS[name] = TorchRunner() if name == "torch" else AttnlibRunner(name)
    return _RUNNERS[name]


@pytest.fixture
def run_case(benchmark: Any, request: pytest.FixtureRequest):
    """``run_case(runner, case)``: benchmark one case on one runner (see the module docstring)."""
    max_call = request.config.getoption("--bench-max-call")

    def run(runner: Any, case: Case) -> None:
        if benchmark.disabled:
            case = smoke_case(case)
            fn, sync = runner.prepare(case, make_inputs(case))
            benchmark.extra_info.update({"backend": runner.name, "shape": case.dims()})
            benchmark.pedantic(lambda: sync(fn()))  # disabled: one call, nothing timed
            return
        key = (runner.name, case.family())
        rate = _RATES.get(key)
        if rate and case.flops() / rate > max_call:
            pytest.skip(f"{runner.name}: one call predicted {case.flops() / rate:.0f} s "
                        f"> --bench-max-call {max_call:g} s (from {rate / 1e9:.3g} GFLOP/s on a "
                        f"smaller {case.task}); raise --bench-max-call to measure it")
        fn, sync = runner.prepare(case, make_inputs(case))
        t0 = time.perf_counter()
        sync(fn())
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync(fn())
        t = time.perf_counter() - t0
        rounds = int(max(MIN_ROUNDS, min(MAX_ROUNDS, TARGET_S / max(t, 1e-9))))
        benchmark.group = case.label()
        benchmark.extra_info.update({
            "backend": runner.name, "device": runner.device_label, "shape": case.dims(),
            "dtype": case.dtype, "flops": case.flops(), "bytes": case.nbytes(),
            "first_call_s": first,
        })
        benchmark.pedantic(lambda: sync(fn()), rounds=rounds, iterations=1, warmup_rounds=0)
        med = benchmark.stats.stats.median
        _RATES[key] = max(_RATES.get(key, 0.0), case.flops() / med)
        benchmark.extra_info["GFLOP/s"] = round(case.flops() / med / 1e9, 3)
        benchmark.extra_info["GB/s"] = round(case.nbytes() / med / 1e9, 3)

    return run


#: the largest sizes of a smoke run (``--benchmark-disable``): every code path, seconds in all
SMOKE_LIMITS = {"S": 128, "L": 512, "rows": 64, "cols": 512}


def smoke_case(case: Case) -> Case:
    """``case`` with its sequence, cache and softmax sizes capped at :data:`SMOKE_LIMITS`."""
    return dataclasses.replace(case, **{f: min(getattr(case, f), cap)
                                        for f, cap in SMOKE_LIMITS.items()})
