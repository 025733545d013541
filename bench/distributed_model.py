"""The rates a context-parallel step depends on, measured, and the time they predict on P GPUs.

    mpiexec -n 2 python -m mpi4py bench/distributed_model.py                   # CPU (numba)
    mpiexec -n 2 python -m mpi4py bench/distributed_model.py --backend opencl \\
        --dtype float16 --heads 32 --kv-heads 32 --dim 128 --block 16384       # a GPU

Measured on this machine (medians of ``--reps``, ranks started together by a barrier):

* ``compute``: rank 0's attention over one block while the other ranks wait, ``--block``
  queries against ``--block`` keys, not causal: ``4 B H D block^2`` FLOP over the time (the
  ring's full block). On the opencl backend the arrays live on the rank's device
  (``dist.rank_backend``).
* ``d2h`` / ``h2d``: rank 0 alone copying one K/V shard (``--shard`` tokens) between the device
  and a numpy buffer, as the ring does (pageable memory); absent on host backends.
  ``d2h_pinned`` / ``h2d_pinned``: the same through page-locked host memory (a mapped
  ``ALLOC_HOST_PTR`` buffer), as the ring's staging buffers copy.
* ``p2p``: the ring's exchange of that shard's bytes, every rank sending to the next and
  receiving from the previous at once (MPI Isend / Irecv, per rank).
* ``alltoall``: an all-to-all of that many bytes per rank.

Then the model of ``docs/distributed.md`` turns the rates into the time of ring and Ulysses
attention on ``P`` ranks at ``S`` = 128k ... 1M tokens (causal, zigzag) against one device
running the whole sequence at the ``compute`` rate. The message rates of ranks that share one
host are those of that host's MPI (shared memory); across hosts, put the network's in their
place.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import attnlib
from attnlib import distributed as dist
from attnlib.distributed._device import download, upload


def median_time(comm, fn, reps: int, sync=lambda: None) -> float:
    """The median over ``reps`` of the slowest rank's seconds for ``fn(); sync()``."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def solo_time(comm, fn, reps: int, sync=lambda: None) -> float:
    """:func:`median_time` of rank 0 alone (the others wait): a device's or a copy engine's
    own rate, not shared with the other ranks of this launch."""
    t = median_time(MPI.COMM_SELF, fn, reps, sync) if comm.Get_rank() == 0 else None
    return comm.bcast(t)


def pinned_host(queue, nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory as a numpy array: a mapped ``ALLOC_HOST_PTR``
    buffer (NVIDIA's OpenCL pins such buffers; copies from the mapped pointer are DMA)."""
    import pyopencl as cl

    buf = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR,
                    nbytes)
    host, _ = cl.enqueue_map_buffer(queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                    (nbytes,), np.uint8)
    return host


def model(r: dict, s: int, p: int, h: int, hkv: int, d: int, item: int) -> dict:
    """Seconds of one device on the whole sequence, the ring and Ulysses on ``p`` ranks, for a
    causal zigzag self-attention of ``s`` tokens (B = 1), from the rates ``r`` (FLOP/s, B/s).

    Ring: ``p`` steps; a step computes two full blocks of ``c = s / 2p`` tokens (the zigzag
    causal balance) while the next K/V shard (``2 (s/p) Hkv D`` elements) crosses MPI and is
    copied to the device; the local shard goes to the host once, before the first send. A step
    lasts as long as the longer of the two. Ulysses: q, k, v go to the host, through one
    all-to-all (``(p-1)/p`` of them leave the rank) and back to the device; one attention over
    the whole sequence on ``h / p`` heads; the output takes the same way back; nothing overlaps
    the attention, which needs all of its input."""
    flops = 2.0 * h * d * s * s  # causal: half of 4 H D S^2
    one = flops / r["compute"]
    c = s / (2 * p)
    step = 8.0 * h * d * c * c / r["compute"]
    kv = 2.0 * (s / p) * hkv * d * item
    pcie = (lambda n: n / r["d2h"] + n / r["h2d"]) if "d2h" in r else (lambda n: 0.0)
    # the ring stages through pinned buffers, Ulysses through fresh numpy arrays
    msg = kv / r["p2p"] + (kv / r["h2d_pinned"] if "h2d_pinned" in r else 0.0)
    first = kv / r["d2h_pinned"] if "d2h_pinned" in r else 0.0
    ring = first + (p - 1) * max(step, msg) + step
    qkvo = (s / p) * (2 * h + 2 * hkv) * d * item  # q, out, k, v of one rank
    ulysses = pcie(qkvo) + qkvo * (p - 1) / p / r["alltoall"] + flops / p / r["compute"]
    return {"one": one, "ring": ring, "ulysses": ulysses, "hidden": msg <= step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=2048, help="tokens of the timed block")
    ap.add_argument("--shard", type=int, default=65536, help="tokens of the moved K/V shard")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", default="2,4,8", help="P of the model's table")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(rank)
    h, hkv, d, n = args.heads, args.kv_heads, args.dim, args.block
    q, k, v = (rng.standard_normal((1, n, hh, d)).astype(dtype) for hh in (h, hkv, hkv))
    be = dist.rank_backend(comm) if args.backend == "opencl" else attnlib.get_backend(
        args.backend)
    device = args.backend == "opencl"
    if device:
        import pyopencl as cl
    sync = (lambda: be.queue.finish()) if device else (lambda: None)
    if device:
        q, k, v = (attnlib.to_device(x, backend=be) for x in (q, k, v))
    rates = {}
    t = solo_time(comm, lambda: attnlib.attention(q, k, v, backend=be), args.reps, sync)
    rates["compute"] = 4.0 * h * d * n * n / t
    kv_host = rng.standard_normal((1, args.shard, hkv, d)).astype(dtype)
    nbytes = kv_host.nbytes
    if device:
        kv_dev = attnlib.to_device(kv_host, backend=be)
        rates["d2h"] = nbytes / solo_time(
            comm, lambda: download(be.queue, kv_dev)[1].wait(), args.reps)
        rates["h2d"] = nbytes / solo_time(
            comm, lambda: upload(be.queue, kv_dev, kv_host).wait(), args.reps)
        pinned = pinned_host(be.queue, nbytes)
        rates["d2h_pinned"] = nbytes / solo_time(comm, lambda: cl.enqueue_copy(
            be.queue, pinned, kv_dev.base_data, src_offset=kv_dev.offset), args.reps)
        rates["h2d_pinned"] = nbytes / solo_time(comm, lambda: cl.enqueue_copy(
            be.queue, kv_dev.base_data, pinned, dst_offset=kv_dev.offset), args.reps)
    send = kv_host.reshape(-1).view(np.uint8)
    recv = np.empty_like(send)

    def p2p():
        reqs = [comm.Isend(send, dest=(rank + 1) % size), comm.Irecv(recv, source=(rank - 1)
                                                                     % size)]
        MPI.Request.Waitall(reqs)

    rates["p2p"] = nbytes / median_time(comm, p2p, args.reps)
    a2a_send = np.resize(send, (nbytes // size) * size)
    a2a_recv = np.empty_like(a2a_send)
    rates["alltoall"] = a2a_send.nbytes / median_time(
        comm, lambda: comm.Alltoall(a2a_send, a2a_recv), args.reps)
    if rank:
        return
    dev = be.info().get("device", args.backend)
    print(f"{size} ranks, backend {args.backend} ({dev}), {dtype}, H={h}, Hkv={hkv}, D={d}; "
          f"block {n} tokens, K/V shard {args.shard} tokens ({2 * nbytes / 2**20:.1f} MiB)")
    print("  rates: " + ", ".join(
        f"{name} {val / 1e12:.3g} TFLOP/s" if name == "compute" else f"{name} {val / 1e9:.3g} GB/s"
        for name, val in rates.items()))
    print("  model (causal, zigzag, B=1): S, P, one device s, ring s (speed-up), "
          "Ulysses s (speed-up), ring messages hidden")
    for s in (131072, 262144, 524288, 1048576):
        for p in (int(x) for x in args.ranks.split(",")):
            m = model(rates, s, p, h, hkv, d, dtype.itemsize)
            uly = f"{m['ulysses']:.3f} ({m['one'] / m['ulysses']:.2f}x)" if h % p == 0 \
                and hkv % p == 0 else "heads do not divide"
            print(f"  {s:8d} {p:2d} {m['one']:9.3f} {m['ring']:9.3f} "
                  f"({m['one'] / m['ring']:.2f}x)  {uly}  {m['hidden']}")


if __name__ == "__main__":
    main()
