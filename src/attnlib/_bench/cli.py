"""``attnlib bench``: every available backend side by side with PyTorch, with a roofline.

With no options it picks sizes for the machine (a CPU or a GPU profile), measures each device's
ceilings, then runs prefill (causal and not), decode over a KV cache, softmax and merge_states on
every available backend and on PyTorch (when installed), within a time budget of about a minute,
and prints one table per shape. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .shapes import SHAPE_HELP, TASKS, default_ladders, parse_shape

__all__ = ["main", "build_parser"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnlib bench",
        description="Every available attnlib backend side by side with PyTorch SDPA (when "
                    "installed): a table per shape, the JSON of it, and a roofline picture.",
        epilog="Shapes are picked for this machine and shrunk for slow backends to fit --budget; "
               "--shape fixes them. A benchmark is measured, never asserted.",
    )
    p.add_argument("--backends", type=_csv, default=None, metavar="LIST",
                   help="comma-separated backends, 'torch' for PyTorch SDPA "
                        "(default: every available backend, and torch when installed)")
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    p.add_argument("--tasks", type=_csv, default=list(TASKS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(TASKS)} (default: all)")
    p.add_argument("--dtypes", type=_csv, default=["float32"], metavar="LIST",
                   help=f"comma-separated subset of {','.join(_DTYPES)} (default: float32)")
    p.add_argument("--causal", choices=("yes", "no", "both"), default="both",
                   help="prefill masking (default: both)")
    p.add_argument("--shape", action="append", default=[], metavar="TASK=DIMS",
                   help=SHAPE_HELP + "; exact shapes, no shrinking")
    p.add_argument("--size", choices=("auto", "cpu", "gpu", "tiny"), default="auto",
                   help="size profile (default: gpu when an OpenCL GPU or CUDA is present)")
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="target wall time of the whole run (default: 60); slow backends get "
                        "smaller shapes and fewer repetitions to fit it")
    p.add_argument("--reps", type=int, default=None, help="repetitions per case (default: "
                   "as many as fit the budget, 3 to 30)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the roofline (needs matplotlib)")
    p.add_argument("--memory", action="store_true",
                   help="run the motivating example instead: S=16384, 32 heads, D=128, float32, "
                        "one subprocess per backend, peak memory beside the naive score matrix "
                        "(--backends, --causal and the first of --dtypes apply; about a minute "
                        "on a 2-core CPU, several minutes on a busy one)")
    p.add_argument("--memory-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --memory: skip a backend predicted slower than this (default: "
                        "120); without --backends the numpy reference and opencl on a CPU are "
                        "left out")
    p.add_argument("--no-probes", action="store_true", help="skip the ceiling probes")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def _pick_backends(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    import attnlib

    torch_ok = _torch_installed()
    if args.backends is None:
        names = attnlib.available_backends()
        return names + (["torch"] if torch_ok and not args.no_torch else [])
    names = []
    for n in args.backends:
        if n == "torch":
            if not torch_ok:
                parser.error("--backends torch: PyTorch is not installed here")
        else:
            try:  # only the named backends are loaded, not every one
                attnlib.get_backend(n)
            except Exception as exc:
                avail = attnlib.available_backends() + (["torch"] if torch_ok else [])
                parser.error(f"--backends {n!r}: {type(exc).__name__}: {exc}. Available here: "
                             f"{', '.join(avail)}")
        if n not in names:
            names.append(n)
    if args.no_torch and "torch" in names:
        names.remove("torch")
    return names


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _make_runners(names: list[str], progress: Any) -> list[Any]:
    from .runners import AttnlibRunner, TorchRunner

    runners = []
    for n in names:
        try:
            runners.append(TorchRunner() if n == "torch" else AttnlibRunner(n))
        except Exception as exc:
            progress(f"{n}: cannot start ({type(exc).__name__}: {exc}); left out")
    # PyTorch last, so each table reads "ours, then the reference point"
    runners.sort(key=lambda r: r.name == "torch")
    return runners


def _ceilings(runners: list[Any], progress: Any) -> dict:
    from . import probes

    out: dict = {}
    for r in runners:
        key = r.device_key
        if key in out:
            continue
        progress(f"probing ceilings of {r.device_label} ...")
        try:
            if key == "cpu":
                out[key] = probes.cpu_ceiling(with_torch=any(x.name == "torch" for x in runners))
            elif key.startswith("opencl:"):
                out[key] = probes.opencl_ceiling(getattr(r, "backend", None))
            elif key.startswith("cuda:"):
                out[key] = probes.cuda_ceiling()
        except Exception as exc:
            progress(f"  probe failed: {type(exc).__name__}: {exc}")
            continue
        c = out[key]
        progress(f"  {c.byte_per_s / 1e9:.3g} GB/s, {c.flop_per_s / 1e9:.3g} GFLOP/s")
    cpu = out.get("cpu")
    for c in out.values():
        # an OpenCL CPU device is the same silicon as "cpu": the better probe of each is its roof
        if cpu is not None and c is not cpu and c.device.endswith("[OpenCL CPU]"):
            if cpu.byte_per_s > c.byte_per_s or cpu.flop_per_s > c.flop_per_s:
                c.method += "; or the CPU probe's, where higher (the same CPU)"
            c.byte_per_s = max(c.byte_per_s, cpu.byte_per_s)
            c.flop_per_s = max(c.flop_per_s, cpu.flop_per_s)
    return out


def _profile(args: argparse.Namespace, runners: list[Any]) -> str:
    if args.size != "auto":
        return args.size
    gpu = any(r.device_key.startswith("cuda:") or "GPU]" in r.device_label for r in runners)
    return "gpu" if gpu else "cpu"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``attnlib bench``; returns the process exit status."""
    t_start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from .suite import Progress

    progress = Progress(quiet=args.quiet)
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        parser.error(f"--tasks: unknown {bad}; expected a subset of {','.join(TASKS)}")
    bad = [d for d in args.dtypes if d not in _DTYPES]
    if bad:
        parser.error(f"--dtypes: unknown {bad}; expected a subset of {','.join(_DTYPES)}")
    if args.budget <= 0 or (args.reps is not None and args.reps < 1):
        parser.error("--budget and --reps must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("attnlib bench: --plot needs matplotlib, which is not installed here: "
                  "pip install 'attnlib[plot]'", file=sys.stderr)
            return 2
    from .report import machine_load

    load = machine_load()
    names = _pick_backends(args, parser)
    if args.memory:
        return _memory(args, names, progress)
    try:
        shapes = [parse_shape(s, d) for s in args.shape for d in args.dtypes]
    except ValueError as exc:
        parser.error(str(exc))
    progress(f"attnlib bench: {', '.join(names)}")
    runners = _make_runners(names, progress)
    if not runners:
        print("attnlib bench: no backend can run here", file=sys.stderr)
        return 1
    profile = _profile(args, runners)
    causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    if shapes:
        ladders = [[c] for c in shapes]
    else:
        ladders = default_ladders(profile, args.tasks, args.dtypes, causal)
    from .report import annotate, print_table, to_json, write_json
    from .suite import Budget, run_family, warm_up

    ceilings = {} if args.no_probes else _ceilings(runners, progress)
    progress(f"size profile {profile!r}; {len(ladders)} families x {len(runners)} backends")
    warm_s = warm_up(ladders, runners, progress)
    # the budget counts from the start (imports, probes and compiles are part of the minute);
    # the timed slots share what is left, so no slot pays for a compile
    budget = Budget(args.budget - (time.perf_counter() - t_start), len(ladders) * len(runners))
    progress("timing (compiled; each backend gets an equal share of the time left) ...")
    results = []
    for lad in ladders:
        progress(f"{lad[0].family()}:")
        results += run_family(lad, runners, budget, progress, reps=args.reps)
    annotate(results, ceilings)
    print_table(results, ceilings, sys.stdout, load, warm_s)
    status = 0
    if not any(r.median_s for r in results):
        print("attnlib bench: every case failed (see the rows above; ATTNLIB_BENCH_DEBUG=1 "
              "prints each traceback)", file=sys.stderr)
        status = 1
    config = {"backends": [r.name for r in runners], "devices": {r.name: r.device_label
              for r in runners}, "profile": profile, "budget_s": args.budget,
              "reps": args.reps, "argv": list(sys.argv[1:] if argv is None else argv),
              "warm_up_s": warm_s}
    if args.json:
        write_json(to_json(results, ceilings, config, load), args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        from .plot import plot_roofline

        plot_roofline(results, ceilings, args.plot)
        progress(f"wrote {args.plot}")
    progress("done")
    return status


def _memory(args: argparse.Namespace, names: list[str], progress: Any) -> int:
    from .memory import default_memory_backends, memory_case, run_memory

    if args.backends is None:
        names, slow = default_memory_backends(names)
        if slow:
            progress(f"--memory: leaving out {', '.join(slow)} (minutes each here); "
                     f"--backends {','.join(names + slow)} runs them too")
    case = memory_case(args.dtypes[0], causal=args.causal != "no")
    rows = run_memory(names, case, args.memory_timeout, progress, sys.stdout)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"schema": "attnlib-bench-memory/1", "case": case.dims(),
                       "naive_scores_bytes": case.naive_scores_bytes(), "results": rows}, f,
                      indent=2)
            f.write("\n")
    if not any(r.get("time_s") is not None for r in rows):
        print("attnlib bench --memory: no backend ran the example", file=sys.stderr)
        return 1
    return 0
