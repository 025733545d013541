"""The roofline picture: arithmetic intensity (FLOP/byte) against achieved FLOP/s, log-log.

Each device measured by the probes draws its two roofs: the bandwidth roof ``bandwidth * I``
(a diagonal) up to the ridge point and the compute roof ``peak FLOP/s`` (a horizontal line) after
it. Each backend is one marker shape, each task one colour, on its device's roof colour family.
"""

from __future__ import annotations

from .probes import Ceiling
from .suite import Result

__all__ = ["plot_roofline", "MissingPlotDependency"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class MissingPlotDependency(RuntimeError):
    pass


def plot_roofline(results: list[Result], ceilings: dict[str, Ceiling], path: str,
                  title: str = "attnlib bench: roofline") -> None:
    """Write the roofline of ``results`` to ``path`` (any format matplotlib knows, by suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingPlotDependency(
            "--plot needs matplotlib, which is not installed here: "
            "pip install 'attnlib[plot]' (or pip install matplotlib)"
        ) from exc

    ok = [r for r in results if r.median_s]
    fig, ax = plt.subplots(figsize=(9, 6))
    ais = [r.case.flops() / r.case.nbytes() for r in ok] or [1.0]
    ridges = [c.flop_per_s / c.byte_per_s for c in ceilings.values()]
    lo, hi = min(ais + ridges) / 4, max(ais + ridges) * 4
    roof_colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (c, ridge) in enumerate(zip(ceilings.values(), ridges)):
        xs = [lo, ridge, hi]
        ys = [c.byte_per_s * lo, c.flop_per_s, c.flop_per_s]
        color = roof_colors[i % len(roof_colors)]
        ax.plot(xs, ys, "-", color=color, lw=2, alpha=0.6,
                label=f"roof {c.device}: {c.byte_per_s / 1e9:.3g} GB/s, "
                      f"{c.flop_per_s / 1e9:.3g} GFLOP/s")
    backends = sorted({r.backend for r in ok})
    tasks = sorted({r.case.task for r in ok})
    task_colors = {t: roof_colors[(len(ceilings) + j) % len(roof_colors)]
                   for j, t in enumerate(tasks)}
    for r in ok:
        m = _MARKERS[backends.index(r.backend) % len(_MARKERS)]
        ax.scatter(r.case.flops() / r.case.nbytes(), r.case.flops() / r.median_s, marker=m,
                   s=60, color=task_colors[r.case.task], edgecolors="black", linewidths=0.5,
                   zorder=3)
    # legend entries: one per backend (marker) and one per task (colour)
    for b in backends:
        ax.scatter([], [], marker=_MARKERS[backends.index(b) % len(_MARKERS)], color="white",
                   edgecolors="black", label=f"backend {b}")
    for t in tasks:
        ax.scatter([], [], marker="o", color=task_colors[t], label=f"task {t}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")  # above the bandwidth roof nothing can sit
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
