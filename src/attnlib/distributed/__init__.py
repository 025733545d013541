"""Context-parallel attention over MPI: each process holds a shard of the sequence.

MPI through mpi4py moves the data (``pip install "attnlib[mpi]"`` brings mpi4py and MPICH); every
function takes the caller's mpi4py communicator, and mpi4py is only ever imported by the caller,
so ``import attnlib`` never needs it. Each rank's local blocks run on any attnlib backend.

    from mpi4py import MPI
    from attnlib import distributed as dist

    comm = MPI.COMM_WORLD
    q_l, k_l, v_l = (dist.shard(x, comm, sharding="zigzag") for x in (q, k, v))
    out_l = dist.ring_attention(q_l, k_l, v_l, comm, causal=True, sharding="zigzag")
    out = dist.gather(out_l, comm, sharding="zigzag")       # the whole result on every rank
    o, lse = dist.merge_across(o_l, lse_l, comm)            # exact merge of per-rank states

Launch with ``mpiexec -n 4 python -m mpi4py script.py`` (``-m mpi4py`` aborts every rank when one
raises an uncaught exception). Arrays are numpy arrays on the host.
"""

from ._ring import merge_across, ring_attention
from ._sharding import SHARDINGS, gather, shard

__all__ = ["shard", "gather", "ring_attention", "merge_across", "SHARDINGS"]
