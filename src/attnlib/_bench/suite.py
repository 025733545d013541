"""Run ladders of cases on runners within a time budget; one Result per (runner, case).

First, untimed, :func:`warm_up` calls every runner once on the smallest case of every family, so
that JIT compiles (numba) and kernel builds (OpenCL) happen before any time slot starts: a backend
that compiles for seconds is then timed like one that does not.

The run's wall-clock budget is then handed out in slots, one per (family, runner), each an equal
share of what is left (:class:`Budget`). Per family (one ladder, largest case first) and runner:

1. climb: call the smallest case under the peak-memory meter (its time is the first call of that
   shape, ``first_call_s``: the warm-up ran a length no table uses); predict the next rung's time
   from the FLOP ratio and climb while ``MIN_REPS + 1`` calls of it still fit in the slot. A slow
   backend (PoCL, the numpy reference) so stops on a smaller shape;
2. repeat the top rung reached: the median of as many calls as fit the rest of the slot
   (``MIN_REPS`` to ``MAX_REPS``, or ``--reps``);
3. side by side: every runner is also timed (``MIN_REPS`` calls) on the top rungs that slower
   runners stopped at, so each shape's table has every backend that reached it, PyTorch included;
   a runner that stopped below a shape gets a row there that says so (``skipped``), so every table
   lists every backend.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .measure import median, peak_meter, time_once, time_reps
from .runners import make_inputs
from .shapes import Case

__all__ = ["Result", "Progress", "Budget", "warm_up", "run_family", "MIN_REPS", "MAX_REPS"]

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
    skipped: str | None = None  # why this runner has no time on this case
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
            "skipped": self.skipped,
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


def _probe(runner: Any, case: Case, inputs: _Inputs, res: Result,
           predicted: float | None = None) -> tuple[Callable, Callable, float]:
    """Prepare ``case`` and make its first call under the peak-memory meter; fills ``res`` (the
    first call's time and memory) and returns ``(fn, sync, time of one call)``.

    The family's compile happened in :func:`warm_up`, but a backend may still build kernels per
    shape: a first call slower than ``predicted`` (or, without a prediction, the first call of
    any shape) is followed by one more, whose time is returned instead."""
    fn, sync = runner.prepare(case, inputs.get(case))
    meter = peak_meter(runner)
    with meter:
        t = time_once(fn, sync)
    res.peak_mem_bytes, res.mem_method = meter.bytes, meter.method
    res.first_call_s, res.first_call_shape = t, _short(case)
    if predicted is None or t > 1.5 * predicted:
        t = min(t, time_once(fn, sync))
    return fn, sync, t


def _repeat(fn: Callable, sync: Callable, t: float, budget: float, reps: int | None,
            res: Result) -> None:
    """Median of ``reps`` calls (the metered call counts as one), or as many as fit ``budget``."""
    n = reps if reps else int(max(MIN_REPS, min(MAX_REPS, budget / max(t, 1e-9))))
    ts = [t] + time_reps(fn, sync, n - 1)
    res.median_s, res.min_s, res.reps = median(ts), min(ts), len(ts)


def warm_up(ladders: list[list[Case]], runners: list[Any],
            progress: Callable[[str], None]) -> dict[str, float]:
    """One untimed call of every runner on a small case of every family (:func:`_warm_case`:
    the JIT compiles and kernel builds of that task, dtype and head size); returns the seconds
    each runner spent. A failure is left for the timed run to report as a row of its table."""
    spent = {r.name: 0.0 for r in runners}
    cases = [_warm_case(ladder[-1]) for ladder in ladders]
    progress("compiling and building kernels (warm-up, not timed): one small call per backend "
             "and table ...")
    for runner in runners:
        t0 = time.perf_counter()
        for case in cases:
            try:
                fn, sync = runner.prepare(case, make_inputs(case))
                time_once(fn, sync)
                del fn, sync
            except Exception:  # noqa: BLE001 - reported by run_family on the same case
                _debug()
        spent[runner.name] = time.perf_counter() - t0
        progress(f"  {runner.name:<8} warm in {spent[runner.name]:.1f} s")
    return spent


def _warm_case(case: Case) -> Case:
    """A small case of the same task, dtype and head sizes as ``case`` but a length no table
    uses, so that the first call of every table's shape is still to come when timing starts."""
    from dataclasses import replace

    if case.task == "softmax":
        return replace(case, rows=3 if case.rows != 3 else 5)
    if case.task == "decode":
        return replace(case, L=17 if case.L != 17 else 19)
    return replace(case, S=17 if case.S != 17 else 19)


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
    t_top: dict[str, float] = {}  # runner -> median time on its top rung
    try:
        for runner in runners:
            slot_budget = budget.take()
            slot_end = time.perf_counter() + slot_budget
            idx = len(ladder) - 1
            res = Result(ladder[idx], runner.name, runner.device_label, runner.device_key)
            try:
                fn, sync, t = _probe(runner, ladder[idx], inputs, res)
            except Exception as exc:  # a failing backend is a row in the table, not a crash
                res.error = _err(exc)
                results.append(res)
                progress(f"  {runner.name:<8} {res.case.label()}: FAILED {res.error}")
                _debug()
                continue
            while idx > 0:
                nxt = ladder[idx - 1]
                predicted = t * nxt.flops() / ladder[idx].flops()
                if time.perf_counter() + predicted * (MIN_REPS + 1) > slot_end:
                    break
                nres = Result(nxt, runner.name, runner.device_label, runner.device_key)
                try:
                    fn, sync, t = _probe(runner, nxt, inputs, nres, predicted=predicted)
                except Exception as exc:  # e.g. MemoryError: keep the rung below
                    nres.error = _err(exc)
                    results.append(nres)
                    progress(f"  {runner.name:<8} {nxt.label()}: FAILED {nres.error}")
                    _debug()
                    break
                idx, res = idx - 1, nres
            _repeat(fn, sync, t, slot_end - time.perf_counter(), reps, res)
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
                if mine is None or idx == mine:
                    continue
                case = ladder[idx]
                res = Result(case, runner.name, runner.device_label, runner.device_key)
                predicted = t_top[runner.name] * case.flops() / ladder[mine].flops()
                if idx < mine:  # a larger shape than this runner's slot reached
                    res.skipped = (f"not run: ~{_fmt_s(predicted)} per call predicted, beyond "
                                   "its share of --budget")
                    results.append(res)
                    continue
                try:
                    fn, sync, t = _probe(runner, case, inputs, res, predicted=predicted)
                    _repeat(fn, sync, t, MIN_SLOT_S, reps, res)
                    del fn, sync
                    progress(f"  {runner.name:<8} {case.label()}: median "
                             f"{res.median_s * 1e3:.3f} ms of {res.reps} (side by side)")
                except Exception as exc:
                    res.error = _err(exc)
                    progress(f"  {runner.name:<8} {case.label()}: FAILED {res.error}")
                results.append(res)
    finally:
        inputs.clear()
    return results


def _fmt_s(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _debug() -> None:
    from .._config import env_bench_debug

    if env_bench_debug():
        traceback.print_exc()


def as_dicts(results: list[Result]) -> list[dict]:
    return [r.as_dict() for r in results]

