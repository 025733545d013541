"""The printed table and the JSON document of ``attnlib bench``.

Columns: median time of the repeated calls; the first call of that shape (the JIT compile or
kernel build of each task ran before, untimed; its time is printed below the tables); achieved
FLOP/s and GB/s with the counting rules of :mod:`attnlib._bench.shapes`; ``%roof`` = achieved
FLOP/s over the roofline bound ``min(peak FLOP/s, bandwidth * intensity)`` of the backend's
device, both measured by :mod:`attnlib._bench.probes` and raised to the best rate achieved
on that device where a probe measured less, so never above 100% (``C`` compute-bound, ``M``
memory-bound); ``vs torch`` = PyTorch's time over the backend's on the same case (above 1:
faster than PyTorch); peak memory of one call. A backend that stopped below a shape has a row
there saying so.
"""

from __future__ import annotations

import json
import platform
from typing import Any, TextIO

from .probes import Ceiling
from .suite import Result

__all__ = ["annotate", "print_table", "to_json", "SCHEMA"]

SCHEMA = "attnlib-bench/1"


def raise_roofs(results: list[Result], ceilings: dict[str, Ceiling]) -> None:
    """Raise each device's roofs, in place, to the best rate any result on it achieved (bytes/s
    of every case; FLOP/s of the float32 cases, those the compute roof covers), so that no
    result is above its roof; ``raised`` says which and what the probe measured."""
    for key, ceil in ceilings.items():
        done = [r for r in results if r.device_key == key and r.median_s]
        best_b = max((r.case.nbytes() / r.median_s for r in done), default=0.0)
        best_f = max((r.case.flops() / r.median_s for r in done if r.case.dtype == "float32"),
                     default=0.0)
        notes = []
        if best_b > ceil.byte_per_s > 0:
            notes.append(f"bandwidth probe {ceil.byte_per_s / 1e9:.3g} GB/s")
            ceil.byte_per_s = best_b
        if best_f > ceil.flop_per_s > 0:
            notes.append(f"compute probe {ceil.flop_per_s / 1e9:.3g} GFLOP/s")
            ceil.flop_per_s = best_f
        if notes:
            ceil.raised = " and ".join(notes) + ", raised to the best achieved here"


def annotate(results: list[Result], ceilings: dict[str, Ceiling]) -> None:
    """Raise the roofs that a result exceeds (:func:`raise_roofs`), then fill ``pct_roof``
    (at most 100), ``bound`` and ``vs_torch`` in place."""
    raise_roofs(results, ceilings)
    torch_t = {r.case: r.median_s for r in results if r.backend == "torch" and r.median_s}
    for r in results:
        if not r.median_s:
            continue
        ceil = ceilings.get(r.device_key)
        if ceil is not None and ceil.flop_per_s > 0 and ceil.byte_per_s > 0:
            ai = r.case.flops() / r.case.nbytes()
            mem_roof = ceil.byte_per_s * ai
            r.bound = "memory" if mem_roof < ceil.flop_per_s else "compute"
            roof = min(mem_roof, ceil.flop_per_s)
            # the compute roof is a float32 probe: it says nothing about float16 tensor cores
            if r.bound == "memory" or r.case.dtype == "float32":
                r.pct_roof = min(100.0, 100.0 * (r.case.flops() / r.median_s) / roof)
        if r.backend != "torch" and r.case in torch_t:
            r.vs_torch = torch_t[r.case] / r.median_s


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    if t >= 1.0:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _mib(b: int | float | None) -> str:
    if b is None:
        return "-"
    if b >= 1 << 30:
        return f"{b / (1 << 30):.2f} GiB"
    return f"{b / (1 << 20):.1f} MiB"


_COLS = (("backend", 8), ("device", 24), ("median", 9), ("1st call", 9), ("FLOP/s", 11),
         ("bytes/s", 11), ("%roof", 7), ("vs torch", 8), ("peak mem", 10))


def _row(cells: list[str]) -> str:
    out = []
    for (name, width), cell in zip(_COLS, cells):
        if len(cell) > width:
            cell = cell[: width - 1] + "~"
        out.append(cell.ljust(width) if name in ("backend", "device") else cell.rjust(width))
    return "  ".join(out).rstrip()


def print_table(results: list[Result], ceilings: dict[str, Ceiling], out: TextIO,
                load: dict | None = None, warm_s: dict[str, float] | None = None) -> None:
    """One section per case (every backend that ran it, PyTorch included), largest case first."""
    order: list[Any] = []
    for r in results:
        if r.case not in order:
            order.append(r.case)
    order.sort(key=lambda c: (_family_rank(results, c), -c.flops()))
    header = _row([n for n, _ in _COLS])
    for case in order:
        rows = [r for r in results if r.case == case]
        rows.sort(key=lambda r: (r.backend == "torch", r.median_s is None, r.median_s or 0,
                                 r.backend))
        print("", file=out)
        print(f"{case.label()}   [{case.flops() / 1e9:.3g} GFLOP, "
              f"{case.nbytes() / (1 << 20):.3g} MiB moved, "
              f"{case.flops() / case.nbytes():.3g} FLOP/byte]", file=out)
        print(header, file=out)
        print("-" * len(header), file=out)
        for r in rows:
            if r.error or r.skipped:
                print(_row([r.backend, r.device]) + "  " + (r.error or r.skipped), file=out)
                continue
            roof = "-" if r.pct_roof is None else f"{r.pct_roof:.0f}% {r.bound[0].upper()}"
            if r.pct_roof is None and r.bound:
                roof = f"- {r.bound[0].upper()}"
            cells = [
                r.backend, r.device, _time(r.median_s), _time(r.first_call_s),
                _si(r.case.flops() / r.median_s, "F"), _si(r.case.nbytes() / r.median_s, "B"),
                roof, _ratio(r.vs_torch),
                _mib(r.peak_mem_bytes),
            ]
            print(_row(cells), file=out)
        print(_winner(rows), file=out)
    print("", file=out)
    if ceilings:
        print("ceilings (measured here; float32):", file=out)
    for c in ceilings.values():
        print(f"  {c.device:<40} {_si(c.byte_per_s, 'B/s'):>12} "
              f"{_si(c.flop_per_s, 'FLOP/s'):>14}   ({c.method})", file=out)
        if c.raised:
            print(f"  {'':<40} {c.raised}", file=out)
    methods = sorted({r.mem_method for r in results if r.mem_method})
    if warm_s:
        print("compile / kernel build before timing (one small untimed call per table): "
              + ", ".join(f"{name} {t:.1f} s" for name, t in warm_s.items()), file=out)
    notes = [
        "median of the repeated calls; '1st call': the first call of that shape, after the "
        "compile above; F = FLOP, B = bytes",
        "%roof: achieved FLOP/s over min(peak FLOP/s, bandwidth x FLOP/byte) of the device; "
        "C compute-bound, M memory-bound (compute roofs are float32: '-' for other dtypes); "
        "a roof a result exceeded is raised to the best achieved on that device",
        "=> fastest: the backend with the lowest median of the table, the others' median as a "
        "multiple of its",
        "vs torch: PyTorch's time / this backend's time (above 1 = faster than PyTorch)",
    ]
    if methods:
        notes.append("peak mem: extra memory of one call, measured by " + "; ".join(methods))
    busy = load or {}
    if busy.get("busy"):
        notes.append(f"this machine was busy (load average {busy['loadavg_1m']:.1f} on "
                     f"{busy['cpu_count']} CPUs): timings are noisy")
    for n in notes:
        print("  " + n, file=out)


def _winner(rows: list[Result]) -> str:
    """One line: the fastest backend of a table and the others' time as a multiple of its."""
    timed = sorted((r for r in rows if r.median_s), key=lambda r: r.median_s)
    if not timed:
        return "=> no backend ran this shape"
    best = timed[0]
    if len(timed) == 1:
        return f"=> only {best.backend} ran this shape"
    others = ", ".join(f"{r.backend} {r.median_s / best.median_s:.2f}x its time"
                       for r in timed[1:])
    return f"=> fastest: {best.backend} ({others})"


def machine_load() -> dict:
    """The 1-minute load average against the CPU count (timings on a busy machine are noisy);
    taken before the run starts, since the run itself loads the machine."""
    import os

    n = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return {"cpu_count": n}
    return {"cpu_count": n, "loadavg_1m": load, "busy": load > 0.75 * n}


def _family_rank(results: list[Result], case: Any) -> int:
    fams: list[str] = []
    for r in results:
        if r.case.family() not in fams:
            fams.append(r.case.family())
    return fams.index(case.family())


def to_json(results: list[Result], ceilings: dict[str, Ceiling], config: dict,
            load: dict | None = None) -> dict:
    import numpy as np

    import attnlib

    versions = {"attnlib": attnlib.__version__, "numpy": np.__version__,
                "python": platform.python_version()}
    from importlib import metadata

    for dist in ("numba", "pyopencl", "torch", "matplotlib"):
        try:  # the installed version, without importing the package (torch takes seconds)
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "schema": SCHEMA,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "machine": platform.machine(), **(load or machine_load())},
        "versions": versions,
        "config": config,
        "ceilings": {k: c.as_dict() for k, c in ceilings.items()},
        "results": [r.as_dict() for r in results],
    }


def write_json(doc: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, allow_nan=False)
        f.write("\n")
