"""Decoding over a long context whose KV cache is split across MPI ranks.

    pip install -e ".[mpi]"
    mpiexec -n 4 python -m mpi4py examples/distributed_decode.py

(``-m mpi4py`` makes an uncaught exception on one rank end every rank instead of leaving the
others waiting.)

Each rank holds a contiguous shard of the prompt's keys and values in its own ``attnlib.KVCache``
(rank ``r`` of ``P``: prompt tokens ``[r*L/P, (r+1)*L/P)``); the last rank also receives the
tokens decoded afterwards, since it holds the tail of the sequence. Each decode step is one call of
``attnlib.distributed.attention_with_sharded_kvcache``: every rank attends the new query over its
shard, and the partial states are merged (``merge_across``) into exactly the attention over the
whole cache, on every rank. Rank 0 checks each step against one process attending over the whole
context and prints the largest difference.

There is no model here: the prompt's keys and values and each step's q, k, v are random, drawn
from one seed so that every rank sees the same sequence.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import attnlib
from attnlib import distributed as dist

B, HQ, HKV, D = 1, 8, 2, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8400,
                        help="prompt tokens (a multiple of the rank count; 8400 suits 1-8 ranks)")
    parser.add_argument("--steps", type=int, default=16, help="tokens to decode")
    parser.add_argument("--backend", default=None, help="attnlib backend of every rank")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)  # the same stream on every rank
    k_all = rng.standard_normal((B, args.context, HKV, D)).astype(np.float32)
    v_all = rng.standard_normal((B, args.context, HKV, D)).astype(np.float32)

    # -- this rank's shard of the prompt goes into its own cache
    k_mine = dist.shard(k_all, comm, sharding="contiguous")
    v_mine = dist.shard(v_all, comm, sharding="contiguous")
    last = rank == size - 1
    room = k_mine.shape[1] + (args.steps if last else 0)
    cache = attnlib.KVCache(B, room, HKV, D, dtype="float32", backend=args.backend)
    cache.update(k_mine, v_mine, start_pos=0)

    worst = 0.0
    for _ in range(args.steps):
        q = rng.standard_normal((B, 1, HQ, D)).astype(np.float32)
        k_new = rng.standard_normal((B, 1, HKV, D)).astype(np.float32)
        v_new = rng.standard_normal((B, 1, HKV, D)).astype(np.float32)
        # -- the last rank appends the new token; every rank attends over its shard, then merge
        new = {"k": k_new, "v": v_new} if last else {}
        out = dist.attention_with_sharded_kvcache(q, cache, comm, **new)
        k_all = np.concatenate([k_all, k_new], axis=1)
        v_all = np.concatenate([v_all, v_new], axis=1)
        if rank == 0:
            whole = attnlib.attention(q, k_all, v_all, backend=args.backend)
            worst = max(worst, float(np.abs(out - whole).max()))
    if rank == 0:
        print(f"{size} ranks, {args.context} + {args.steps} tokens, {HQ} heads ({HKV} kv), D={D}: "
              f"max |error| against one process = {worst:.3g}")
        assert worst <= 1e-5, f"sharded decoding differs from one process by {worst}"


if __name__ == "__main__":
    main()
