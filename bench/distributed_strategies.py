"""Ring against Ulysses: context-parallel attention on P ranks against one process.

    mpiexec -n 1 python -m mpi4py bench/distributed_strategies.py     # the one-process anchor
    mpiexec -n 2 python -m mpi4py bench/distributed_strategies.py
    mpiexec -n 4 python -m mpi4py bench/distributed_strategies.py

Every launch times, on the same whole problem (``--seq`` tokens in all, B = ``--batch``,
``--heads`` query and kv heads, D = ``--dim``, float32, zigzag sharding, causal unless
``--no-causal``), ``dist.ring_attention`` and ``dist.ulysses_attention`` over its ranks, each
rank's shards drawn locally; a one-rank launch also times ``attnlib.attention`` on the whole
sequence in one call, the anchor. Each rank runs its backend on ``cores / ranks`` threads
(``--threads``), so every launch uses the same cores in all. Each figure is the median of
``--reps`` calls after one untimed warm-up, each call started by a barrier and taken as the
slowest rank's time. Output: one line per strategy with the median, every repeat, and the
speed-up against the anchor when ``--anchor SECONDS`` (the one-rank attention median) is given.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
from distributed_overlap import timed  # bench/ is on the path of `python bench/...`
from mpi4py import MPI

import attnlib
from attnlib import distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens in all ranks together")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backend", default="numba")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--threads", type=int, default=None,
                   help="numba threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--anchor", type=float, default=None,
                   help="the one-rank attention median in seconds, for the speed-up column")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.backend == "numba":
        import numba

        numba.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // size))
    rng = np.random.default_rng(rank)
    shape = (args.batch, args.seq // size, args.heads, args.dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    kw = dict(causal=args.causal, sharding="zigzag", backend=args.backend)
    calls = {"ring": lambda: dist.ring_attention(q, k, v, comm, **kw),
             "ulysses": lambda: dist.ulysses_attention(q, k, v, comm, **kw)}
    if size == 1:
        calls["attention"] = lambda: attnlib.attention(q, k, v, causal=args.causal,
                                                       backend=args.backend)
    for fn in calls.values():  # warm-up: JIT compile, plans
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.reps):
        for name, fn in calls.items():
            times[name].append(timed(comm, fn))
    if rank == 0:
        threads = attnlib.get_backend(args.backend).info().get("threads", "-")
        print(f"{size} ranks x {threads} threads, backend {args.backend}, S={args.seq}, "
              f"B={args.batch}, H={args.heads}, D={args.dim}, float32, "
              f"{'causal' if args.causal else 'not causal'}, zigzag")
        for name, ts in times.items():
            med = statistics.median(ts)
            speed = f"   x{args.anchor / med:.2f} of one process" if args.anchor else ""
            print(f"  {name:9s} median {med:.3f} s   ({', '.join(f'{t:.3f}' for t in ts)})"
                  f"{speed}")


if __name__ == "__main__":
    main()
