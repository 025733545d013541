"""Floors a decode step cannot go below on this device, measured the way the decode figures are.

* ``read``: a streaming-read kernel (uint4 loads, one sum per work-item, grid-stride) over
  N bytes, timed by profiling events, L2 cold (a 256 MB buffer written before each rep), as
  ``decode_check.py`` times the decode kernel. N = 33.5 MB is the K+V of the 8192-token decode
  (B=1, 8 kv heads, D=128, fp16); 268 MB the 131072-token one. Several grid sizes; the best.
* ``launch``: an empty kernel: enqueue + ``queue.finish()`` per call (the host floor of a
  synchronous call through pyopencl), enqueue only back to back (the pipelined floor), and its
  event time.
* ``torch``: the same two for PyTorch (an empty-ish op + synchronize), for the anchor's share.
* ``ptx``: with ``--ptx DIR``, the PTX and ``-cl-nv-verbose`` log of the default 16-bit
  prefill (D=128, not causal) and decode (D=128) builds, for reading the inner loops.

    python3 bench/gpu/floor.py [--json PATH] [--ptx DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from devrun import cl_env, emit  # noqa: E402

_SRC = r"""
__kernel void read_sum(__global const uint4 *src, ulong n_vec, __global uint *out) {
    uint acc = 0;
    for (ulong i = get_global_id(0); i < n_vec; i += get_global_size(0)) {
        uint4 x = src[i];
        acc += x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  /* keeps the loads; (almost) never stores */
}
__kernel void empty(__global uint *out) { }
__kernel void touch(__global uint *dst, uint n) {
    for (uint i = get_global_id(0); i < n; i += get_global_size(0)) dst[i] = i;
}
"""


def _median(xs):
    return statistics.median(xs)


def read_floor(cl, ctx, queue, dev, json_path):
    prg = cl.Program(ctx, _SRC).build()
    flush_n = 64 << 20  # 256 MB of uint
    flush = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * flush_n)
    out = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
    touch, read = cl.Kernel(prg, "touch"), cl.Kernel(prg, "read_sum")
    cus = dev.max_compute_units
    for nbytes in (33554432, 268435456):
        src = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
        touch.set_args(src, np.uint32(nbytes // 4))
        cl.enqueue_nd_range_kernel(queue, touch, (cus * 1024,), (256,))
        best = None
        for wgs_per_cu, threads in ((2, 256), (4, 256), (8, 256), (16, 256), (8, 512)):
            n_wi = cus * wgs_per_cu * threads
            read.set_args(src, np.uint64(nbytes // 16), out)
            ts = []
            for _ in range(15):
                touch.set_args(flush, np.uint32(flush_n))
                cl.enqueue_nd_range_kernel(queue, touch, (cus * 2048,), (256,))
                ev = cl.enqueue_nd_range_kernel(queue, read, (n_wi,), (threads,))
                ev.wait()
                ts.append((ev.profile.end - ev.profile.start) * 1e-3)
            us = _median(ts)
            rec = {"part": "read", "bytes": nbytes, "wg_per_cu": wgs_per_cu,
                   "threads": threads, "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)}
            emit(rec, json_path)
            if best is None or us < best["us"]:
                best = rec
        emit({**best, "part": "read_best"}, json_path)


def launch_floor(cl, ctx, queue, json_path):
    prg = cl.Program(ctx, _SRC).build()
    knl = cl.Kernel(prg, "empty")
    out = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
    knl.set_args(out)
    for _ in range(200):
        cl.enqueue_nd_range_kernel(queue, knl, (128,), (128,))
    queue.finish()
    sync, pipe, evt = [], [], []
    for _ in range(2000):
        t0 = time.perf_counter()
        cl.enqueue_nd_range_kernel(queue, knl, (128,), (128,))
        queue.finish()
        sync.append(time.perf_counter() - t0)
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(100):
            ev = cl.enqueue_nd_range_kernel(queue, knl, (128,), (128,))
        queue.finish()
        pipe.append((time.perf_counter() - t0) / 100)
        evt.append((ev.profile.end - ev.profile.start) * 1e-9)
    emit({"part": "launch", "sync_us": round(_median(sync) * 1e6, 2),
          "pipelined_us": round(_median(pipe) * 1e6, 2),
          "event_us": round(_median(evt) * 1e6, 2)}, json_path)


def torch_floor(json_path):
    try:
        import torch
    except ImportError:
        return
    x = torch.zeros(32, device="cuda")
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    sync, pipe = [], []
    for _ in range(2000):
        t0 = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        sync.append(time.perf_counter() - t0)
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(100):
            x.add_(1)
        torch.cuda.synchronize()
        pipe.append((time.perf_counter() - t0) / 100)
    emit({"part": "torch_launch", "sync_us": round(_median(sync) * 1e6, 2),
          "pipelined_us": round(_median(pipe) * 1e6, 2)}, json_path)


def dump_ptx(cl, ctx, dev, outdir, json_path):
    from attnlib.backends.opencl import _nvidia_decode, _nvidia_mma
    from attnlib.backends.opencl._runtime import kernel_source

    os.makedirs(outdir, exist_ok=True)
    builds = {
        "prefill_fp16_d128": ("attn_fwd_mma.cl", _nvidia_mma.build_options(
            128, np.float16, _nvidia_mma.DEFAULT_CONFIGS[128])),
        "decode_fp16_d128": ("attn_decode_mma.cl", _nvidia_decode.build_options(
            128, np.float16, _nvidia_decode.DEFAULT_CONFIGS[128], split=True, fused=True)),
    }
    for name, (filename, opts) in builds.items():
        src = kernel_source(filename)
        prg = cl.Program(ctx, src).build(options=[*opts, "-cl-nv-verbose"], devices=[dev])
        log = prg.get_build_info(dev, cl.program_build_info.LOG)
        ptx = prg.get_info(cl.program_info.BINARIES)[0]
        with open(os.path.join(outdir, name + ".ptx"), "wb") as f:
            f.write(ptx)
        with open(os.path.join(outdir, name + ".log"), "w") as f:
            f.write(" ".join(opts) + "\n" + log)
        emit({"part": "ptx", "name": name, "opts": list(opts), "bytes": len(ptx),
              "log_tail": log.strip().splitlines()[-3:] if log.strip() else []}, json_path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ptx")
    args = ap.parse_args()
    cl, ctx, queue, dev = cl_env()
    launch_floor(cl, ctx, queue, args.json)
    torch_floor(args.json)
    read_floor(cl, ctx, queue, dev, args.json)
    if args.ptx:
        dump_ptx(cl, ctx, dev, args.ptx, args.json)


if __name__ == "__main__":
    main()
