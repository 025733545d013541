"""Run ladders of cases on runners within a time budget; one Result per (runner, case).

The run's wall-clock budget is handed out in slots, one per (family, runner), each an equal share
of what is left (:class:`Budget`). Per family (one ladder, largest case first) and runner:

1. climb: call the smallest case (the first call includes the JIT compile or kernel build and is
   reported as ``first_call_s``), then call it again, timed, under the peak-memory meter; predict
   the next rung's time from the FLOP ratio and climb while ``MIN_REPS + 1`` calls of it still
   fit in the slot. A slow backend (PoCL, the numpy reference) so stops on a smaller shape;
2. repeat the top rung reached: the median of as many calls as fit the rest of the slot
   (``MIN_REPS`` to ``MAX_REPS``, or ``--reps``);
3. side by side: every runner is also timed (``MIN_REPS`` calls) on the top rungs that slower
   runners stopped at, so each shape's table has every backend that reached it, PyTorch included.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .measure import median, peak_meter, time_once, time_reps
from .runners import make_inputs
from .shapes import Case

__all__ = ["Result", "Progress", "Budget", "run_family", "MIN_REPS", "MAX_REPS"]

MIN_REPS = 3
MAX_REPS = 30
MIN_SLOT_S = 0.2


class Budget:
    """The run's wall-clock budget, handed out in slots, one per (family, runner): each slot
    gets an equal share of what is left, so time a slow compile used is taken from later slots
    rather than added to the run."""

    def __init__(self, total_s: float, n_slots: int) -> None:
        self.end = time.perf_counter() + total_s
        self.left = max(1, n_slots)

    def take(self) -> float:
        share = (self.end - time.perf_counter()) / self.left
        self.left = max(1, self.left - 1)
        return max(MIN_SLOT_S, share)


@dataclass
class Result:
    case: Case
    backend: str
    device: str
    device_key: str
    median_s: float | None = None
    min_s: float | None = None
    reps: int = 0
    first_call_s: float | None = None
    first_call_shape: str | None = None
    peak_mem_bytes: int | None = None
    mem_method: str | None = None
    error: str | None = None
    # filled in by the report, once ceilings and PyTorch's times are known
    pct_roof: float | None = None
    bound: str | None = None
    vs_torch: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        c = self.case
        t = self.median_s
        d = {
            "task": c.task,
            "family": c.family(),
            "label": c.label(),
            "shape": c.dims(),
            "dtype": c.dtype,
            "backend": self.backend,
            "device": self.device,
            "device_key": self.device_key,
            "median_s": t,
            "min_s": self.min_s,
            "reps": self.reps,
            "first_call_s": self.first_call_s,
            "first_call_shape": self.first_call_shape,
            "flops": c.flops(),
            "bytes": c.nbytes(),
            "intensity": c.flops() / c.nbytes(),
            "flop_per_s": c.flops() / t if t else None,
            "byte_per_s": c.nbytes() / t if t else None,
            "pct_roof": self.pct_roof,
            "bound": self.bound,
            "vs_torch": self.vs_torch,
            "peak_mem_bytes": self.peak_mem_bytes,
            "mem_method": self.mem_method,
            "error": self.error,
        }
        return d


class Progress:
    """Progress lines on stderr, each prefixed by the seconds since the start."""

    def __init__(self, quiet: bool = False, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.quiet = quiet
        self.stream = stream or sys.stderr

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            self.stream.write(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}\n")
            self.stream.flush()


def _short(case: Case) -> str:
    d = case.dims()
    return " ".join(f"{k}={v}" for k, v in d.items() if k != "causal")


def _err(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip()
    return msg.splitlines()[0][:300] if msg else type(exc).__name__


class _Inputs:
    """Host inputs per case, made once and shared by every runner."""

    def __init__(self) -> None:
        self._cache: dict[Case, dict] = {}

    def get(self, case: Case) -> dict:
        if case not in self._cache:
            self._cache[case] = make_inputs(case)
        return self._cache[case]

    def clear(self) -> None:
        self._cache.clear()


def _probe(runner: Any, case: Case, inputs: _Inputs, res: Result, warm: bool,
           predicted: float | None = None) -> tuple[Callable, Callable, float]:
    """Prepare ``case`` and call it once under the peak-memory meter (after a first, compiling
    call when not ``warm``); fills ``res`` and returns ``(fn, sync, time of one call)``.

    A backend may build kernels per shape: a metered call much slower than ``predicted`` is
    followed by one more, whose time is returned instead."""
    fn, sync = runner.prepare(case, inputs.get(case))
    if not warm:
        res.first_call_s = time_once(fn, sync)
        res.first_call_shape = _short(case)
    meter = peak_meter(runner)
    with meter:
        t = time_once(fn, sync)
    res.peak_mem_bytes, res.mem_method = meter.bytes, meter.method
    if predicted is not None and t > 1.5 * predicted:
        t = time_once(fn, sync)
    return fn, sync, t


def _repeat(fn: Callable, sync: Callable, t: float, budget: float, reps: int | None,
            res: Result) -> None:
    """Median of ``reps`` calls (the metered call counts as one), or as many as fit ``budget``."""
    n = reps if reps else int(max(MIN_REPS, min(MAX_REPS, budget / max(t, 1e-9))))
    ts = [t] + time_reps(fn, sync, n - 1)
    res.median_s, res.min_s, res.reps = median(ts), min(ts), len(ts)


def run_family(
    ladder: list[Case],
    runners: list[Any],
    budget: Budget,
    progress: Callable[[str], None],
    reps: int | None = None,
) -> list[Result]:
    """Measure one family on every runner; see the module docstring."""
    inputs = _Inputs()
    results: list[Result] = []
    top_index: dict[str, int] = {}  # runner -> index in ``ladder`` of its top rung
    first_call: dict[str, tuple[float | None, str | None]] = {}
    t_top: dict[str, float] = {}  # runner -> median time on its top rung
    try:
        for runner in runners:
            slot_budget = budget.take()
            slot_end = time.perf_counter() + slot_budget
            idx = len(ladder) - 1
            res = Result(ladder[idx], runner.name, runner.device_label, runner.device_key)
            try:
                fn, sync, t = _probe(runner, ladder[idx], inputs, res, warm=False)
            except Exception as exc:  # a failing backend is a row in the table, not a crash
                res.error = _err(exc)
                results.append(res)
                progress(f"  {runner.name:<8} {res.case.label()}: FAILED {res.error}")
                _debug()
                continue
            first_call[runner.name] = (res.first_call_s, res.first_call_shape)
            while idx > 0:
                nxt = ladder[idx - 1]
                predicted = t * nxt.flops() / ladder[idx].flops()
                if time.perf_counter() + predicted * (MIN_REPS + 1) > slot_end:
                    break
                nres = Result(nxt, runner.name, runner.device_label, runner.device_key)
                try:
                    fn, sync, t = _probe(runner, nxt, inputs, nres, warm=True,
                                         predicted=predicted)
                except Exception as exc:  # e.g. MemoryError: keep the rung below
                    nres.error = _err(exc)
                    results.append(nres)
                    progress(f"  {runner.name:<8} {nxt.label()}: FAILED {nres.error}")
                    _debug()
                    break
                idx, res = idx - 1, nres
            _repeat(fn, sync, t, slot_end - time.perf_counter(), reps, res)
            res.first_call_s, res.first_call_shape = first_call[runner.name]
            top_index[runner.name] = idx
            t_top[runner.name] = res.median_s
            results.append(res)
            progress(f"  {runner.name:<8} {ladder[idx].label()}: median "
                     f"{res.median_s * 1e3:.3f} ms of {res.reps}")
            del fn, sync
        # side by side: time every runner on each lower top rung it passed while climbing
        tops = sorted(set(top_index.values()))
        for runner in runners:
            mine = top_index.get(runner.name)
            for idx in tops:
                if mine is None or idx <= mine:
                    continue
                case = ladder[idx]
                res = Result(case, runner.name, runner.device_label, runner.device_key)
                try:
                    predicted = t_top[runner.name] * case.flops() / ladder[mine].flops()
                    fn, sync, t = _probe(runner, case, inputs, res, warm=True,
                                         predicted=predicted)
                    _repeat(fn, sync, t, MIN_SLOT_S, reps, res)
                    del fn, sync
                    res.first_call_s, res.first_call_shape = first_call[runner.name]
                    progress(f"  {runner.name:<8} {case.label()}: median "
                             f"{res.median_s * 1e3:.3f} ms of {res.reps} (side by side)")
                except Exception as exc:
                    res.error = _err(exc)
                    progress(f"  {runner.name:<8} {case.label()}: FAILED {res.error}")
                results.append(res)
    finally:
        inputs.clear()
    return results


def _debug() -> None:
    if os.environ.get("ATTNLIB_BENCH_DEBUG"):
        traceback.print_exc()


def as_dicts(results: list[Result]) -> list[dict]:
    return [r.as_dict() for r in results]

