"""What one decode call costs the host, piece by piece, on the machine it runs on.

Each line: the median over 2000 repetitions (after 200 warm-up) of one host-side step of a
decode call (B=1, 8192 tokens, 32 q / 8 kv heads, D=128, fp16):

* ``upload_desc``: ``cl.enqueue_copy`` of a 44-byte descriptor, non-blocking (pooled buffer);
* ``pool_alloc``: one pooled scratch allocation and its release;
* ``empty_array``: one ``pyopencl.array.Array`` from the pool (the call's output);
* ``front_door_only``: ``attention_with_kvcache`` with every kernel launch stubbed out (Python
  front door, validation, descriptor, allocation, upload);
* ``whole_call``: the real call, no ``finish`` (what the host spends enqueueing);
* ``portable_*``: the same with ``use_mma=False`` (the portable kernel instead of the NVIDIA
  tensor-core decode kernel; on other devices the two are the same path).

    python bench/gpu/hostcost.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

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


def _stub_launches():
    """Replace every kernel launch (portable, tensor-core prefill and decode paths) by a no-op;
    returns a function that restores them."""
    from attnlib.backends.opencl import _nvidia_decode, _nvidia_mma

    saved = [(OpenCLBackend, "launch", OpenCLBackend.launch),
             (_nvidia_decode, "launch", _nvidia_decode.launch),
             (_nvidia_mma, "launch", _nvidia_mma.launch)]
    OpenCLBackend.launch = lambda self, *a, **k: None
    _nvidia_decode.launch = _nvidia_mma.launch = lambda *a, **k: None

    def restore():
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return restore


def main() -> None:
    res = {}
    for label, opts in (("", {}), ("portable_", {"use_mma": False})):
        be = attnlib.get_backend("opencl", **opts)
        queue = be.queue
        rng = np.random.default_rng(0)
        cache = attnlib.KVCache(1, 8192, 8, 128, dtype="float16", backend=be)
        kh = rng.standard_normal((1, 8192, 8, 128), dtype=np.float32).astype(np.float16)
        cache.update(kh, kh, 0)
        qd = attnlib.to_device(rng.standard_normal((1, 1, 32, 128), dtype=np.float32)
                               .astype(np.float16), backend=be)
        out = attnlib.attention_with_kvcache(qd, cache)
        queue.finish()
        if not label:
            desc = np.arange(11, dtype=np.int32)
            res["upload_desc"] = median_us(lambda q=queue, h=desc, o=out: _pool.upload(q, h, o))
            queue.finish()
            res["pool_alloc"] = median_us(lambda q=queue: _pool.scratch(q, 4096))
            res["empty_array"] = median_us(lambda q=queue: _pool.empty(q, (1, 1, 32, 128),
                                                                       np.float16))
        restore = _stub_launches()
        try:
            res[label + "front_door_only"] = median_us(
                lambda c=cache, x=qd: attnlib.attention_with_kvcache(x, c))
        finally:
            restore()
        queue.finish()
        res[label + "whole_call"] = median_us(
            lambda c=cache, x=qd: attnlib.attention_with_kvcache(x, c), n=300, warm=30)
        queue.finish()
        del cache
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
