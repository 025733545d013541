"""What one decode call costs the host, piece by piece, on the machine it runs on.

Each line: the median over 2000 repetitions (after 200 warm-up) of one host-side step of a
decode call (B=1, 8192 tokens, 32 q / 8 kv heads, D=128, fp16):

* ``upload_desc``: ``cl.enqueue_copy`` of a 44-byte descriptor, non-blocking (pooled buffer);
* ``pool_alloc``: one pooled scratch allocation and its release;
* ``empty_array``: one ``pyopencl.array.Array`` from the pool (the call's output);
* ``launch``: ``set_args`` + ``enqueue_nd_range_kernel`` of the decode kernel (already built);
* ``front_door_only``: ``attention_with_kvcache`` with every kernel launch stubbed out (Python
  front door, validation, descriptor, allocation, upload);
* ``whole_call``: the real call, no ``finish`` (what the host spends enqueueing).

    python bench/gpu/hostcost.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pyopencl as cl

import attnlib
from attnlib.backends.opencl import OpenCLBackend, _pool


def median_us(fn, n=2000, warm=200):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 2)


def main() -> None:
    be = attnlib.get_backend("opencl")
    queue = be.queue
    rng = np.random.default_rng(0)
    cache = attnlib.KVCache(1, 8192, 8, 128, dtype="float16", backend=be)
    kh = rng.standard_normal((1, 8192, 8, 128), dtype=np.float32).astype(np.float16)
    cache.update(kh, kh, 0)
    qd = attnlib.to_device(rng.standard_normal((1, 1, 32, 128), dtype=np.float32)
                           .astype(np.float16), backend=be)
    out = attnlib.attention_with_kvcache(qd, cache)
    queue.finish()
    desc = np.arange(11, dtype=np.int32)
    res = {}
    res["upload_desc"] = median_us(lambda: _pool.upload(queue, desc, out))
    queue.finish()
    res["pool_alloc"] = median_us(lambda: _pool.scratch(queue, 4096))
    res["empty_array"] = median_us(lambda: _pool.empty(queue, (1, 1, 32, 128), np.float16))
    knl_key = next(k for k in be._kernels if k[1] == "attn_fwd.cl")
    captured = {}
    orig = OpenCLBackend.launch

    def grab(self, ctx, q, filename, cfg, kernel, gsize, lsize, args):
        captured.setdefault(filename, (gsize, lsize, list(args)))
        return orig(self, ctx, q, filename, cfg, kernel, gsize, lsize, args)

    OpenCLBackend.launch = grab
    attnlib.attention_with_kvcache(qd, cache)
    OpenCLBackend.launch = orig
    queue.finish()
    knl = be._kernels[knl_key]
    gsize, lsize, args = captured["attn_fwd.cl"]

    def launch():
        knl.set_args(*args)
        cl.enqueue_nd_range_kernel(queue, knl, gsize, lsize)

    res["launch"] = median_us(launch, n=500, warm=50)
    queue.finish()
    OpenCLBackend.launch = lambda self, *a, **k: None
    res["front_door_only"] = median_us(lambda: attnlib.attention_with_kvcache(qd, cache))
    OpenCLBackend.launch = orig
    queue.finish()
    res["whole_call"] = median_us(lambda: attnlib.attention_with_kvcache(qd, cache), n=300,
                                  warm=30)
    queue.finish()
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
