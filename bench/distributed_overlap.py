"""Ring attention's overlap: the ring's wall time against the same blocks computed without MPI.

    mpiexec -n 2 python -m mpi4py bench/distributed_overlap.py          # the CPU goal's case
    mpiexec -n 2 python -m mpi4py bench/distributed_overlap.py --seq 4096 --reps 5

The case of the issue's CPU goal by default: 2 ranks of the numba backend, S = 16384 tokens in
all, causal, float32, zigzag sharding, B = 1, 8 heads (8 kv heads), D = 64; each rank runs numba
on ``cores / ranks`` threads (``--threads``). Each rank draws its own shards (S/P tokens).

Two timings alternate, ``--reps`` times each after one untimed warm-up call, every one started
by a barrier and taken as the slowest rank's time (what a caller of the step waits for):

* ``ring``: ``attnlib.distributed.ring_attention`` itself, K/V shards travelling with
  non-blocking sends and receives while the current blocks compute;
* ``local``: the very blocks and merges each rank computes in the ring (the same plan, the same
  skipped blocks), on the rank's own K/V arrays in place of the received ones: no communication.

The goal is ``ring / local <= 1.10``. Medians are printed, with every repeat; ``ring - local`` is
what communication and waiting cost. The machine's other load changes the figures from run to
run: compare the two numbers of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import attnlib
from attnlib.distributed import ring_attention
from attnlib.distributed._options import check_local
from attnlib.distributed._ring import BlockPlan


def local_blocks(plan) -> np.ndarray:
    """Every block and merge of this rank's ring, on its own K/V: the ring without MPI."""
    states: list = [None] * len(plan.chunks(plan.rank))
    for step in range(plan.size):
        plan.step(states, plan.k, plan.v, (plan.rank - step) % plan.size)
    return plan.result(states)[0]


def timed(comm, fn) -> float:
    """The slowest rank's seconds for ``fn()``, all ranks starting together."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384, help="tokens in all ranks together")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backend", default="numba")
    p.add_argument("--sharding", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--threads", type=int, default=None,
                   help="numba threads per rank (default: cores / ranks, at least 1)")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.backend == "numba":
        import numba

        numba.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // size))
    rng = np.random.default_rng(rank)
    shape = (args.batch, args.seq // size, args.heads, args.dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    kw = dict(causal=args.causal, sharding=args.sharding, backend=args.backend)
    _, lc = check_local(q, k, v, comm, layout="bshd", return_lse=False, heads_split=False,
                        scale=None, window=None, softcap=None, per_head={}, **kw)
    plan = BlockPlan(lc)

    def ring():
        ring_attention(q, k, v, comm, **kw)

    def local():
        local_blocks(plan)

    ring()  # warm-up: JIT compile, plans
    local()
    times: dict[str, list[float]] = {"ring": [], "local": []}
    for _ in range(args.reps):
        times["ring"].append(timed(comm, ring))
        times["local"].append(timed(comm, local))
    if rank == 0:
        med = {name: statistics.median(ts) for name, ts in times.items()}
        threads = attnlib.get_backend(args.backend).info().get("threads", "-")
        print(f"{size} ranks x {threads} threads, backend {args.backend}, S={args.seq}, "
              f"B={args.batch}, H={args.heads}, D={args.dim}, float32, "
              f"{'causal' if args.causal else 'not causal'}, {args.sharding}")
        for name, ts in times.items():
            print(f"  {name:5s}  median {med[name]:.3f} s   ({', '.join(f'{t:.3f}' for t in ts)})")
        print(f"  ring / local = {med['ring'] / med['local']:.3f}   "
              f"(communication and waiting: {med['ring'] - med['local']:+.3f} s)")


if __name__ == "__main__":
    main()
