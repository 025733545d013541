"""The streaming primitives on the CPU: softmax, logsumexp, merge_states against PyTorch and
against a plain copy, same process, same data.

    python bench/cpu_primitives.py                  # numba, every shape, 15 repeats
    python bench/cpu_primitives.py --reps 31 --backend numpy
    python bench/cpu_primitives.py --ops softmax,logsumexp --quick
    python bench/cpu_primitives.py --single         # one thread each, CPU time (load-proof)

Each case times, round after round, the attnlib call, the PyTorch call and an ``np.copyto`` that
reads and writes as many bytes in all as the primitive moves (interleaved, so load from other
processes hits all three alike) and prints medians. Bytes moved are the compulsory DRAM traffic:
softmax reads x and writes p (its last pass rescales a row of p in cache while the row fits L2),
logsumexp reads x, merge_states reads the n partial outputs and lses and writes one output and lse.
``copy GB/s`` is read + write bytes of the copy over its time: the machine's streaming bandwidth in
the same run; ``of copy`` is the primitive's GB/s as a fraction of it. The copy writes into an
existing array; a primitive returns a new one, and the first touch of fresh pages (the kernel
zeroes them) costs about one more write pass: ``alloc copy ms`` is the same copy into a new array
(``x.copy()``), the floor for a primitive with a large output. ``--single`` runs every side on one
thread and reads the process's CPU time instead of the wall clock: on a shared, loaded machine the
ratios stay meaningful. ``vs torch`` = torch ms / attnlib ms (> 1: attnlib faster). Inputs are the
pytest-benchmark suite's (attnlib._bench.runners.make_inputs)."""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import subprocess
import time

import numpy as np

SOFTMAX_SHAPES = [(4096, 1024), (4096, 4096), (256, 65536)]
MERGE_SHAPES = [(2, 512), (2, 2048), (8, 1024)]  # (n, S) with B=1, H=32, D=128


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cases(ops: list[str], quick: bool):
    """(op, label, attnlib fn, torch fn, bytes moved, bytes of the copy's source)."""
    import torch

    import attnlib
    from attnlib._bench.runners import make_inputs
    from attnlib._bench.shapes import Case

    sm_shapes = SOFTMAX_SHAPES[1:2] if quick else SOFTMAX_SHAPES
    for op in ("softmax", "logsumexp"):
        if op not in ops:
            continue
        for rows, cols in sm_shapes:
            x = make_inputs(Case(task="softmax", dtype="float32", rows=rows, cols=cols))["x"]
            xt = torch.from_numpy(x)
            n = x.nbytes
            if op == "softmax":
                yield (op, f"{rows}x{cols}", lambda x=x: attnlib.softmax(x, backend=BACKEND),
                       lambda xt=xt: torch.softmax(xt, dim=-1), 2 * n, n)
            else:
                yield (op, f"{rows}x{cols}", lambda x=x: attnlib.logsumexp(x, backend=BACKEND),
                       lambda xt=xt: torch.logsumexp(xt, dim=-1), n, n // 2)
    if "merge" not in ops:
        return
    for n_states, s in MERGE_SHAPES[1:2] if quick else MERGE_SHAPES:
        case = Case(task="merge", dtype="float32", n=n_states, B=1, S=s, H=32, D=128)
        inp = make_inputs(case)
        outs, lses = inp["outs"], inp["lses"]
        to = torch.stack([torch.from_numpy(o) for o in outs])  # (n, B, S, H, D), as the suite
        tl = torch.stack([torch.from_numpy(x) for x in lses])

        def t_merge(to=to, tl=tl):
            lse = torch.logsumexp(tl, dim=0)
            w = torch.exp(tl - lse).transpose(2, 3).unsqueeze(-1)
            return (w * to).sum(dim=0), lse

        moved = (n_states + 1) * (outs[0].nbytes + lses[0].nbytes)
        yield ("merge_states", f"n={n_states} S={s} H=32 D=128",
               lambda outs=outs, lses=lses: attnlib.merge_states(outs, lses, backend=BACKEND),
               t_merge, moved, moved // 2)


BACKEND = "numba"


def main() -> None:
    global BACKEND
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds per case")
    ap.add_argument("--ops", default="softmax,logsumexp,merge")
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    ap.add_argument("--single", action="store_true",
                    help="one thread each, process CPU time instead of wall time")
    args = ap.parse_args()
    BACKEND = args.backend

    import torch

    clock = time.perf_counter
    if args.single:
        import numba

        numba.set_num_threads(1)
        torch.set_num_threads(1)
        clock = time.process_time

    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {_cpu_model()}, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, backend "
          f"{BACKEND}, median of {args.reps} interleaved rounds (attnlib, torch, copy), "
          f"{'CPU time, 1 thread each' if args.single else 'wall time'}")
    hdr = (f"{'op':<13} {'shape':<24} {'attnlib ms':>10} {'torch ms':>9} {'vs torch':>8} "
           f"{'GB/s':>6} {'copy ms':>8} {'copy GB/s':>9} {'of copy':>7} {'alloc copy ms':>13}")
    print(hdr)
    print("-" * len(hdr))
    for op, label, fa, ft, moved, copy_src in _cases(args.ops.split(","), args.quick):
        src = np.ones(copy_src // 4, np.float32)
        copy_into = functools.partial(np.copyto, np.empty_like(src), src)
        fa()  # compile / warm up
        ft()
        ta, tt, tc, tn = [], [], [], []
        for _ in range(args.reps):
            for fn, acc in ((fa, ta), (ft, tt), (copy_into, tc),
                            (src.copy, tn)):
                t0 = clock()
                fn()
                acc.append(clock() - t0)
        a, t, c, cn = (statistics.median(v) for v in (ta, tt, tc, tn))
        gbs, cgbs = moved / a / 1e9, 2 * copy_src / c / 1e9
        print(f"{op:<13} {label:<24} {a * 1e3:>10.2f} {t * 1e3:>9.2f} {t / a:>7.2f}x "
              f"{gbs:>6.1f} {c * 1e3:>8.2f} {cgbs:>9.1f} {gbs / cgbs:>7.0%} {cn * 1e3:>13.2f}")


if __name__ == "__main__":
    main()
