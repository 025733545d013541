"""Context-parallel attention over MPI: each process holds a shard of the sequence.

MPI through mpi4py moves the data (``pip install "attnlib[mpi]"`` brings mpi4py and MPICH); every
function takes the caller's mpi4py communicator, and mpi4py is only ever imported by the caller,
so ``import attnlib`` never needs it. Each rank's local blocks run on any attnlib backend.

    from mpi4py import MPI
    from attnlib import distributed as dist

    comm = MPI.COMM_WORLD
    q_l, k_l, v_l = (dist.shard(x, comm, sharding="zigzag") for x in (q, k, v))
    out_l = dist.ring_attention(q_l, k_l, v_l, comm, causal=True, sharding="zigzag")
    out_l = dist.ulysses_attention(q_l, k_l, v_l, comm, causal=True, sharding="zigzag")
    out = dist.gather(out_l, comm, sharding="zigzag")       # the whole result on every rank
    o, lse = dist.merge_across(o_l, lse_l, comm)            # exact merge of per-rank states
    out = dist.attention_with_sharded_kvcache(q, cache, comm)   # decode over sharded caches

Two strategies compute the same result: ``ring_attention`` passes K/V shards around a ring
while each rank computes (any head count; ``P - 1`` K/V shards cross each link),
``ulysses_attention`` swaps sequence shards for head groups with two all-to-alls (heads must
divide by ``P``; each rank moves ``(P-1)/P`` of its q, k, v and out once).

Arrays are numpy arrays, or device arrays of the opencl backend (``pyopencl.array.Array``):
each function returns the kind it was given. Device data crosses MPI through host buffers, with
the copies enqueued without blocking and overlapped with the kernels (see ``ring_attention``).
Each rank's device is :func:`rank_backend`'s: the one ``PYOPENCL_CTX`` names, else the GPU of
its node-local rank; host arrays with the opencl backend chosen by name run there too.

Errors. Every function but ``shard`` is collective: each rank first
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

from .._spec import SHARDINGS
from ._device import rank_backend
from ._kvcache import attention_with_sharded_kvcache
from ._ring import merge_across, ring_attention
from ._sharding import gather, shard
from ._ulysses import ulysses_attention

__all__ = ["shard", "gather", "ring_attention", "ulysses_attention", "merge_across",
           "attention_with_sharded_kvcache", "rank_backend", "SHARDINGS"]
