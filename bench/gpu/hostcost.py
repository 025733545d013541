"""What one call costs the host, piece by piece, on the machine it runs on.

Each figure: the median over ``--n`` repetitions (after a tenth as many warm-up calls) of one
host-side step, in microseconds (with ``--repeat R``: the least of R such medians, for a CPU
shared with other work). Cases (32 q / 8 kv heads, D=128, fp16, device arrays):

* ``decode``: ``attention_with_kvcache(q, cache)``, B=1, 8192 cached tokens;
* ``append``: ``attention_with_kvcache(q, cache, k1, v1)``: two cache_write launches, then the
  attention (the cache is reset to 8192 tokens every 512 calls, outside the timing);
* ``append_rope``: the same with ``rope=attnlib.RoPE()`` (an LLM decode step: rotary on q and
  the new k at their positions);
* ``rewrite_rope``: ``append_rope`` at ``start_pos=8192`` every call (a rollback by one token, as
  speculative decoding does); ``decode_batch_idx``: ``decode`` with ``batch_idx=np.array([0])``;
* ``prefill``: ``attention(q, k, v, causal=True)`` at (1, 512, 32 / 8, 128) (the tensor-core
  prefill kernel on NVIDIA sm_80+, the portable one elsewhere);
* ``dense_decode``: ``attention(q, k, v)`` with q (1, 1, 32, 128), k, v (1, 8192, 8, 128).

For each: ``<case>_stub`` (every kernel launch replaced by a no-op: the Python front door,
validation, planning, allocation, table uploads), and, unless ``--stub-only`` or
``--emulate-nvidia``, ``<case>_call`` (the real call, no finish: what the host spends
enqueueing) and ``<case>_pipelined`` (``--n`` calls back to back, then one finish, per call).
Prefixes: none for the default backend (NVIDIA tensor-core paths where the device has them),
``portable_`` for ``use_mma=False``. Also the primitives: ``pool_alloc``, ``empty_array``,
``upload_desc``, and (real calls only) what the ``decode`` case's launch costs below attnlib:
``decode_enqueue_only`` (the driver's enqueue of its kernel object, arguments already set, the
event pyopencl makes included) and ``set_arg_buffer`` (one buffer argument set again).
``paged_decode`` is ``paged_attention`` over a page pool (page 16, a device block table) with
the ``decode`` case's tokens, ``paged_cache_decode`` ``attention_with_paged_kvcache`` of one
sequence of a ``PagedKVCache`` (page 16).

``--emulate-nvidia`` (any OpenCL device, e.g. PoCL): the dispatch sees an sm_90 device
(``_nvidia_mma.compute_capability`` patched to (9, 0), the warpgroup-MMA family off) and every
launch is stubbed, so the NVIDIA-only Python paths (``_nvidia_decode``, ``_nvidia_mma``) run
without building PTX.

``--count``: instead of times, what 16 real calls of each case (after two warm ones) do per call
on the queue:
``enqueues`` (kernel launches), ``fills`` / ``writes`` (device-table rewrites: fills of at most
128 bytes, host-to-device copies), ``args_set`` (kernel arguments set: changed scalars and
pooled buffers, and the non-pooled buffers, which are set on every launch). With
``--emulate-nvidia`` the tensor-core kernels are built emulated (``_switches.EMULATE_PTX``) and
the prefill case is left out (its emulated kernel is slow to build and run on a CPU).

    python bench/gpu/hostcost.py                       # on the GPU host
    python bench/gpu/hostcost.py --emulate-nvidia      # the NVIDIA paths' host cost, anywhere
    python bench/gpu/hostcost.py --stub-only --portable-only
    python bench/gpu/hostcost.py --count [--emulate-nvidia]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import attnlib
from attnlib.backends.opencl import _pool

HQ, HKV, D, CTX = 32, 8, 128, 8192


def median_us(fn, n=2000, warm=200):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 2)


def pipelined_us(fn, queue, n):
    fn()
    queue.finish()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    queue.finish()
    return round((time.perf_counter() - t0) / n * 1e6, 2)


def _stub_launches():
    """Replace every kernel launch (every family and primitive launches through
    ``_runtime.launch``) by a no-op; returns a function that restores it."""
    from attnlib.backends.opencl import _runtime

    real = _runtime.launch
    _runtime.launch = lambda *a, **k: None

    def restore():
        _runtime.launch = real
    return restore


def _emulate_nvidia():
    from attnlib.backends.opencl import _nvidia_mma, _switches

    _nvidia_mma.compute_capability = lambda device: (9, 0)
    # the warpgroup-MMA program needs NVIDIA's compiler (the dispatch would warn and fall back):
    # the emulated prefill case plans the mma.sync kernel
    _switches.WGMMA_ON = False


def _dev(rng, shape, be):
    return attnlib.to_device(rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
                             backend=be)


def cases(be, rng):
    """(name, fn, reset) per case; reset() (or None) runs outside the timing every 512 calls."""
    cache = attnlib.KVCache(1, CTX + 1024, HKV, D, dtype="float16", backend=be)
    kh = rng.standard_normal((1, CTX, HKV, D), dtype=np.float32).astype(np.float16)
    dk = attnlib.to_device(kh, backend=be)
    cache.update(dk, dk, 0)
    q1 = _dev(rng, (1, 1, HQ, D), be)
    k1, v1 = _dev(rng, (1, 1, HKV, D), be), _dev(rng, (1, 1, HKV, D), be)

    def reset():
        cache.reset()
        cache.update(dk, dk, 0)

    rope, bidx = attnlib.RoPE(), np.array([0])
    qp, kp = _dev(rng, (1, 512, HQ, D), be), _dev(rng, (1, 512, HKV, D), be)
    kd = _dev(rng, (1, CTX, HKV, D), be)
    page = 16
    pool = _dev(rng, (CTX // page, page, HKV, D), be)
    table = attnlib.to_device(np.arange(CTX // page, dtype=np.int32)[None], backend=be)
    lens = np.array([CTX], np.int32)
    paged = attnlib.PagedKVCache(CTX // page + 64, page, HKV, D, dtype="float16", backend=be)
    sid = paged.new_sequence()
    paged.append([sid], dk, dk)
    sids = [sid]
    return [
        ("decode", lambda: attnlib.attention_with_kvcache(q1, cache), None),
        ("append", lambda: attnlib.attention_with_kvcache(q1, cache, k1, v1), reset),
        ("append_rope", lambda: attnlib.attention_with_kvcache(q1, cache, k1, v1, rope=rope),
         reset),
        ("rewrite_rope", lambda: attnlib.attention_with_kvcache(q1, cache, k1, v1, rope=rope,
                                                                start_pos=CTX), reset),
        ("decode_batch_idx", lambda: attnlib.attention_with_kvcache(q1, cache, batch_idx=bidx),
         None),
        ("prefill", lambda: attnlib.attention(qp, kp, kp, causal=True, backend=be), None),
        ("dense_decode", lambda: attnlib.attention(q1, kd, kd, backend=be), None),
        ("paged_decode", lambda: attnlib.paged_attention(q1, pool, pool, table, lens), None),
        ("paged_cache_decode", lambda: attnlib.attention_with_paged_kvcache(q1, paged, sids),
         None),
    ]


REPEAT = 1  # --repeat: the figure is the least of this many medians (a shared, busy CPU)


def timed(fn, reset, n, warm):
    """median_us with ``reset`` every 512 calls outside the timing; the least of REPEAT."""
    return min(_timed(fn, reset, n, warm) for _ in range(REPEAT))


def _timed(fn, reset, n, warm):
    if reset is None:
        return median_us(fn, n, warm)
    ts = []
    done = 0
    while done < n + warm:
        reset()
        m = min(512, n + warm - done)
        for _ in range(m):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        done += m
    return round(statistics.median(ts[warm:]) * 1e6, 2)


def launch_parts(fn, queue, n: int) -> dict:
    """The last launch ``fn`` makes, below attnlib: the driver's enqueue of that kernel object
    (its arguments as the call left them) and one buffer argument set again, in µs."""
    from attnlib.backends.opencl import _runtime

    seen = []
    real = _runtime._enqueue

    def record(q, knl, gsize, lsize, offset, wait_for):
        seen.append((knl, gsize, lsize))
        return real(q, knl, gsize, lsize, offset, wait_for)

    _runtime._enqueue = record
    try:
        fn()
    finally:
        _runtime._enqueue = real
    queue.finish()
    knl, gsize, lsize = seen[-1]
    res = {"decode_enqueue_only": median_us(lambda: real(queue, knl, gsize, lsize, None, None),
                                            n, n // 10)}
    queue.finish()
    buf = _pool.scratch(queue, 4096)
    slot = next(s for s in _runtime.kernels.values() if s.knl is knl)
    i = slot.kinds.index(None)
    res["set_arg_buffer"] = median_us(lambda: knl.set_arg(i, buf), n, n // 10)
    slot.last[i] = _runtime._UNSET  # the next launch sets it again
    return res


def count(fn, reset, queue, n=16):
    """Per call: kernel enqueues, table fills, host-to-device writes, kernel arguments set."""
    import pyopencl as cl

    from attnlib.backends.opencl import _runtime

    tally = {"enqueues": 0, "fills": 0, "writes": 0, "args_set": 0}
    saved = (_runtime._enqueue, _pool._fill, cl.enqueue_copy, _runtime.KernelSlot.set)

    def enqueue(*a):
        tally["enqueues"] += 1
        return saved[0](*a)

    def fill(*a):
        tally["fills"] += 1
        return _pool._fill_function()(*a)

    def copy(queue, dest, src, **kw):
        tally["writes"] += isinstance(src, np.ndarray) and not isinstance(dest, np.ndarray)
        return saved[2](queue, dest, src, **kw)

    def set_args(self, args, slots):
        before = list(self.last)
        saved[3](self, args, slots)
        if self.plain:
            tally["args_set"] += len(args)
            return
        # changed scalars and pooled buffers, and every non-pooled buffer (set each launch)
        tally["args_set"] += sum(a is not b for a, b in zip(before, self.last)) + sum(
            self.kinds[i] is None and args[i] is not None
            and type(args[i]) is not _runtime._POOLED for i in slots)

    if reset is not None:
        reset()
    fn()  # the first call makes the front door's repeat entry,
    fn()  # the second the plans behind it (the fused append's)
    queue.finish()
    _runtime._enqueue, _pool._fill, cl.enqueue_copy, _runtime.KernelSlot.set = (
        enqueue, fill, copy, set_args)
    try:
        for _ in range(n):
            fn()
    finally:
        _runtime._enqueue, _pool._fill, cl.enqueue_copy, _runtime.KernelSlot.set = saved
    queue.finish()
    return {k: round(v / n, 2) for k, v in tally.items()}


def main(argv=None) -> dict:
    """Prints one JSON line per backend variant and returns every figure in one dict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulate-nvidia", action="store_true")
    ap.add_argument("--stub-only", action="store_true")
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--portable-only", action="store_true")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--real-n", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=1,
                    help="report the least of this many medians (default 1)")
    ap.add_argument("--cases", default="decode,append,append_rope,rewrite_rope,decode_batch_idx,"
                                       "prefill,dense_decode,paged_decode,paged_cache_decode")
    args = ap.parse_args(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    if args.emulate_nvidia:
        _emulate_nvidia()
        if args.count:
            from attnlib.backends.opencl import _switches

            _switches.EMULATE_PTX = True
    stub_only = args.stub_only or args.emulate_nvidia
    want = args.cases.split(",")
    res, every = {}, {}
    variants = [("portable_", {"use_mma": False})]
    if not args.portable_only:
        variants.insert(0, ("", {}))
    for label, opts in variants:
        be = attnlib.get_backend("opencl", **opts)
        queue = be.queue
        rng = np.random.default_rng(0)
        if args.count:
            for name, fn, reset in cases(be, rng):
                if name in want and not (args.emulate_nvidia and name == "prefill"):
                    res[f"{label}{name}"] = count(fn, reset, queue)
            print(json.dumps({"emulate_nvidia": args.emulate_nvidia, "count": res}), flush=True)
            every.update(res)
            res = {}
            continue
        if not label:
            out = _pool.empty(queue, (1, 1, HQ, D), np.float16)
            desc = np.arange(11, dtype=np.int32)
            res["upload_desc"] = median_us(lambda q=queue, h=desc, o=out: _pool.upload(q, h, o))
            queue.finish()
            res["pool_alloc"] = median_us(lambda q=queue: _pool.scratch(q, 4096))
            res["empty_array"] = median_us(lambda q=queue: _pool.empty(q, (1, 1, HQ, D),
                                                                       np.float16))
        for name, fn, reset in cases(be, rng):
            if name not in want:
                continue
            if stub_only:  # warm the plans with stubs too: no kernel is ever built
                restore = _stub_launches()
            else:
                fn()
                queue.finish()
                restore = _stub_launches()
            try:
                res[f"{label}{name}_stub"] = timed(fn, reset, args.n, args.n // 10)
            finally:
                restore()
            if stub_only:
                continue
            queue.finish()
            n = args.real_n
            res[f"{label}{name}_call"] = timed(fn, reset, n, n // 10)
            queue.finish()
            if reset is not None:
                reset()
            res[f"{label}{name}_pipelined"] = pipelined_us(fn, queue, min(n, 512))
            if name == "decode" and not label:
                res.update(launch_parts(fn, queue, n))
        print(json.dumps({"emulate_nvidia": args.emulate_nvidia, **res}), flush=True)
        every.update(res)
        res = {}
    return every


if __name__ == "__main__":
    main()
