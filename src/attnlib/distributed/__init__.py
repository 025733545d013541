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

Arrays are host arrays: numpy, or torch and JAX CPU arrays, which come back as their own kind
(contract section 11; ``attnlib.to_numpy`` brings device arrays to the host).

Errors. ``gather``, ``ring_attention`` and ``merge_across`` are collective: each rank first
validates its own call, then the ranks exchange their verdicts and a description of their shapes,
dtypes and options (one small ``allgather``) before any data moves. A local error on any rank, or
a mismatch between ranks, raises the same AttnlibError with the same message on every rank.
``shard`` moves no data and checks locally. What no check can catch: a rank that does not make the
call at all, or passes a different communicator, leaves the others waiting inside MPI (a rank
whose ``comm`` is not a communicator raises at once, but cannot tell the others); and an error
after the checks (out of memory, a device failure) is raised on its own rank only. Launch with
``mpiexec -n 4 python -m mpi4py script.py``: ``-m mpi4py`` aborts every rank when one ends with an
uncaught exception, instead of leaving the others waiting.
"""

from ._ring import merge_across, ring_attention
from ._sharding import SHARDINGS, gather, shard

__all__ = ["shard", "gather", "ring_attention", "merge_across", "SHARDINGS"]
