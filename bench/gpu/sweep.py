"""Device-side timing of the opencl backend's portable kernels, per tiling, beside wall clock.

GPU time comes from two profiled markers around one API call on an in-order queue (so it spans
every kernel and copy of the call, not the Python front door); wall time is the same call plus
``queue.finish()``. The difference is what the host adds per call. Prints one JSON row per
configuration; ``--ptx`` also prints the FMA / MUL / ADD counts of one build's PTX (does the
compiler contract a*b+c into fma?).

    python bench/gpu/sweep.py decode          # split counts and tilings for fp16 decode
    python bench/gpu/sweep.py prefill32 --ptx # tilings for float32 prefill
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import numpy as np

import attnlib


def _queue():
    import pyopencl as cl

    be = attnlib.get_backend("opencl")
    return cl.CommandQueue(be.context, properties=cl.command_queue_properties.PROFILING_ENABLE)


def _timed(queue, fn, reps):
    """(median GPU seconds between markers, median wall seconds) of ``fn()``."""
    import pyopencl as cl

    for _ in range(3):
        fn()
    queue.finish()
    gpu, wall = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        a = cl.enqueue_marker(queue)
        fn()
        b = cl.enqueue_marker(queue)
        queue.finish()
        wall.append(time.perf_counter() - t0)
        gpu.append((b.profile.end - a.profile.end) * 1e-9)
    return statistics.median(gpu), statistics.median(wall)


def decode(args) -> None:
    q_ = _queue()
    hq, hkv, d = 32, 8, 128
    for b, n in ([(1, 512)] if args.quick else [(1, 8192), (8, 8192), (1, 131072)]):
        rng = np.random.default_rng(1)
        step = min(n, 8192)
        kh = rng.standard_normal((b, step, hkv, d), dtype=np.float32).astype(np.float16)
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
        for tiles in [None, (4, 32, 1, 32), (4, 128, 1, 128)]:
            for splits in [None, 16, 32, 128, 256]:
                be = attnlib.get_backend("opencl", queue=q_, tiles=tiles, num_splits=splits)
                cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", backend=be)
                for p in range(0, n, step):
                    cache.update(kh, kh, p)
                qd = attnlib.to_device(q, backend=be)
                g, w = _timed(q_, lambda c=cache, x=qd: attnlib.attention_with_kvcache(x, c),
                              args.reps)
                nbytes = 2 * b * n * hkv * d * 2
                print(json.dumps({"kind": "decode", "batch": b, "cache_len": n, "tiles": tiles,
                                  "splits": splits, "gpu_us": round(g * 1e6, 1),
                                  "wall_us": round(w * 1e6, 1),
                                  "gpu_TBps": round(nbytes / g / 1e12, 3)}), flush=True)
                del cache


def prefill32(args) -> None:
    q_ = _queue()
    bes = []
    for bhsd in ([(1, 2, 130, 64)] if args.quick else [(4, 16, 2048, 64), (4, 16, 2048, 128)]):
        b, h, s, d = bhsd
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3)]
        cands = [None, (64, 64, 16, 16), (128, 64, 16, 16), (64, 64, 16, 8), (128, 64, 16, 8),
                 (64, 128, 8, 16), (32, 64, 8, 16), (128, 32, 32, 8)]
        for tiles in cands:
            be = attnlib.get_backend("opencl", queue=q_, tiles=tiles)
            bes.append(be)
            dev = [attnlib.to_device(x, backend=be) for x in host]
            try:
                g, w = _timed(q_, lambda x=dev, e=be: attnlib.attention(*x, backend=e),
                              args.reps)
            except Exception as exc:  # noqa: BLE001 - a tiling that does not fit is reported
                print(json.dumps({"shape": bhsd, "tiles": tiles, "error": str(exc)[:200]}))
                continue
            flops = 4 * b * h * s * s * d
            print(json.dumps({"kind": "prefill32", "shape": bhsd, "tiles": tiles,
                              "gpu_ms": round(g * 1e3, 3), "wall_ms": round(w * 1e3, 3),
                              "gpu_tflops": round(flops / g / 1e12, 2)}), flush=True)
    if args.ptx:
        import pyopencl as cl

        progs = {k: p for e in bes for k, p in e._programs._programs.items()}
        for key, prg in progs.items():
            ptx = prg.get_info(cl.program_info.BINARIES)[0].decode("latin-1")
            counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))
                      for op in ("fma.rn.f32", "mul.f32", "add.f32", "mul.rn.f32", "add.rn.f32",
                                 "ld.shared.v4.f32", "ld.shared.f32", "bar.sync")}
            print(json.dumps({"ptx": key[1], "opts": [o for o in key[2] if "BLOCK" in o
                              or "THREADS" in o or "HEAD_DIM=" in o], "counts": counts}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("part", choices=["decode", "prefill32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ptx", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test on PoCL)")
    args = ap.parse_args(argv)
    {"decode": decode, "prefill32": prefill32}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
