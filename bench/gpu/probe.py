"""Where a call's time goes on the device: kernel events vs host enqueue vs wall clock.

For one decode call (B=1, 8192 tokens, 32 q heads / 8 kv heads, D=128, fp16) and one fp16
prefill call (4,16,2048,64): the sum of the kernels' own profiled durations, the host time to
enqueue one call (N calls back to back, then one finish), the wall time of call + finish, a
cProfile of the host side, and the compiler's register/spill report (-cl-nv-verbose) of the
decode kernel.

    python bench/gpu/probe.py
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import numpy as np
import pyopencl as cl

import attnlib
from attnlib.backends.opencl import OpenCLBackend, _nvidia_mma
from attnlib.backends.opencl._runtime import kernel_source

EVENTS: list = []
_launch = OpenCLBackend.launch
_mma_run = _nvidia_mma.run


def _launch_rec(self, *a, **kw):
    evt = _launch(self, *a, **kw)
    EVENTS.append(evt)
    return evt


def _mma_rec(*a, **kw):
    kw.setdefault("events", EVENTS)
    return _mma_run(*a, **kw)


OpenCLBackend.launch = _launch_rec
_nvidia_mma.run = _mma_rec


def measure(name, fn, queue, n=50):
    for _ in range(5):
        fn()
    queue.finish()
    EVENTS.clear()
    walls = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        queue.finish()
        walls.append(time.perf_counter() - t0)
    per_call = len(EVENTS) // n
    kern = [sum((e.profile.end - e.profile.start) * 1e-9 for e in EVENTS[i:i + per_call])
            for i in range(0, len(EVENTS), per_call)]
    each = [statistics.median((EVENTS[i + j].profile.end - EVENTS[i + j].profile.start) * 1e-9
                              for i in range(0, len(EVENTS), per_call)) for j in range(per_call)]
    span = [(EVENTS[i + per_call - 1].profile.end - EVENTS[i].profile.start) * 1e-9
            for i in range(0, len(EVENTS), per_call)]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    queue.finish()
    t2 = time.perf_counter()
    print(json.dumps({"case": name, "kernels_per_call": per_call,
                      "kernel_us_each": [round(x * 1e6, 1) for x in each],
                      "kernel_sum_us": round(statistics.median(kern) * 1e6, 1),
                      "first_start_to_last_end_us": round(statistics.median(span) * 1e6, 1),
                      "wall_us": round(statistics.median(walls) * 1e6, 1),
                      "host_enqueue_us": round((t1 - t0) / n * 1e6, 1),
                      "pipelined_us": round((t2 - t0) / n * 1e6, 1)}), flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    queue.finish()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    print("\n".join(s.getvalue().splitlines()[:30]), flush=True)


def _kernel_us(fn, queue, reps=10):
    """Median device time of each kernel of one ``fn()`` call, from its events (us)."""
    for _ in range(3):
        fn()
    queue.finish()
    EVENTS.clear()
    for _ in range(reps):
        fn()
    queue.finish()
    per = len(EVENTS) // reps
    return [statistics.median((EVENTS[i + j].profile.end - EVENTS[i + j].profile.start) * 1e-3
                              for i in range(0, len(EVENTS), per)) for j in range(per)]


def _with(overrides, fn):
    """Run ``fn()`` with FwdConfig fields forced (TREE_MAX, STAGE, ...)."""
    from attnlib.backends.opencl import _attention

    orig = _attention.FwdConfig
    _attention.FwdConfig = lambda **kw: orig(**{**kw, **overrides})
    _attention._plans.clear()  # plans made without the override must not be reused
    try:
        return fn()
    finally:
        _attention.FwdConfig = orig
        _attention._plans.clear()


DECODE_VARIANTS = [  # (tiles, FwdConfig overrides); earlier runs swept more (bench/gpu/logs)
    (None, {"CP_ASYNC": False}), (None, {}),
    ((4, 64, 1, 32), {}), ((4, 128, 1, 64), {}), ((4, 128, 2, 64), {}), ((4, 64, 2, 16), {}),
]
SPLITS = [None if s == "None" else int(s)
          for s in __import__("os").environ.get("PROBE_SPLITS", "None,32,64,132,264").split(",")]


def verbose_report(ctx, filename: str, options_seen) -> None:
    """Rebuild each option set seen with -cl-nv-verbose; print registers, spills and smem."""
    for opts in sorted(set(options_seen)):
        prg = cl.Program(ctx, kernel_source(filename)).build(
            options=list(opts) + ["-cl-std=CL1.2", "-cl-nv-verbose"])
        log = prg.get_build_info(ctx.devices[0], cl.program_build_info.LOG)
        keep = ("BLOCK", "THREADS", "CP_ASYNC=", "STORE_KIND")
        print(json.dumps({"verbose": [o for o in opts if any(k in o for k in keep)],
                          "ptxas": [ln.strip() for ln in log.splitlines()
                                    if "registers" in ln or "spill" in ln][:3]}), flush=True)


def decode_sweep(queue) -> None:
    """Kernel times (events) per tiling, split count and kernel option for the decode cases."""
    from attnlib.backends.opencl import _runtime

    seen = []
    build = _runtime.build_program

    def rec(ctx, filename, source, options):
        if filename == "attn_fwd.cl":
            seen.append(tuple(options))
        return build(ctx, filename, source, options)

    _runtime.build_program = rec
    hq, hkv, d = 32, 8, 128
    rng = np.random.default_rng(1)
    for b, n in [(1, 8192), (8, 8192), (1, 131072)]:
        step = min(n, 8192)
        kh = rng.standard_normal((b, step, hkv, d), dtype=np.float32).astype(np.float16)
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
        for tiles, ov in DECODE_VARIANTS:
            for splits in SPLITS:
                be = attnlib.get_backend("opencl", queue=queue, tiles=tiles, num_splits=splits)
                cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", backend=be)
                for p in range(0, n, step):
                    cache.update(kh, kh, p)
                qd = attnlib.to_device(q, backend=be)
                try:
                    ks = _with(ov, lambda c=cache, x=qd: _kernel_us(
                        lambda: attnlib.attention_with_kvcache(x, c), queue))
                    row = {"b": b, "n": n, "tiles": tiles, "splits": splits, "ov": ov,
                           "kernel_us": [round(x, 1) for x in ks], "sum_us": round(sum(ks), 1),
                           "TBps": round(2 * b * n * hkv * d * 2 / sum(ks) / 1e6, 2)}
                except Exception as exc:  # noqa: BLE001 - a tiling that does not fit
                    row = {"tiles": tiles, "ov": ov, "error": str(exc)[:120]}
                print(json.dumps(row), flush=True)
                del cache
    _runtime.build_program = build
    verbose_report(queue.context, "attn_fwd.cl", seen)


def prefill32_sweep(queue) -> None:
    """float32 prefill kernel time per tiling, K/V staged through registers or cp.async (run 1 of
    the third session swept TREE_MAX here)."""
    for bhsd in [(4, 16, 2048, 64), (4, 16, 2048, 128)]:
        b, h, s, d = bhsd
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3)]
        for tiles in [None, (128, 64, 16, 8), (64, 64, 8, 16), (128, 64, 16, 16),
                      (64, 128, 8, 32), (128, 128, 16, 32)]:
            for cp in (False, True):
                be = attnlib.get_backend("opencl", queue=queue, tiles=tiles)
                dev = [attnlib.to_device(x, backend=be) for x in host]
                try:
                    ks = _with({"CP_ASYNC": cp}, lambda x=dev, e=be: _kernel_us(
                        lambda: attnlib.attention(*x, backend=e), queue, reps=5))
                    row = {"shape": bhsd, "tiles": tiles, "cp_async": cp,
                           "ms": round(sum(ks) / 1e3, 3),
                           "tflops": round(4 * b * h * s * s * d / sum(ks) / 1e6, 2)}
                except Exception as exc:  # noqa: BLE001
                    row = {"shape": bhsd, "tiles": tiles, "error": str(exc)[:120]}
                print(json.dumps(row), flush=True)


ABLATIONS = {  # attn_fwd.cl with one phase removed (wrong results; for where-the-time-goes only)
    "full": [],
    "no_stage_k": ["STAGE_KV(DST, k, k_off, k_sb, k_ss, k_sh, k_sd, HEAD_DIM, HEAD_DIM, KS_LD)"],
    "no_stage_v": ["STAGE_KV(DST, v, v_off, v_sb, v_ss, v_sh, v_sd, DV_PAD, HEAD_DIM_V, VS_LD)"],
    "no_s": ["for (int d4 = 0; d4 < HEAD_DIM / 4; ++d4) {"],
    "no_tree": ["for (int w = THREADS_N / 2; w > 0; w /= 2) {"],
    "no_pv": ["PV_TILE(0)", "PV_TILE(1)"],
}


def ablate(queue) -> None:
    """Decode kernel time with one phase of attn_fwd.cl cut out at a time (default tiling)."""
    from attnlib.backends.opencl import _runtime

    src0 = _runtime.kernel_source("attn_fwd.cl")
    rng = np.random.default_rng(1)
    for b, n in [(1, 131072), (8, 8192)]:
        kh = rng.standard_normal((b, 8192, 8, 128), dtype=np.float32).astype(np.float16)
        q = rng.standard_normal((b, 1, 32, 128), dtype=np.float32).astype(np.float16)
        for name, cuts in ABLATIONS.items():
            src = src0
            for c in cuts:
                assert c in src, c
                if c.startswith("for ("):
                    src = src.replace(c, c.replace("; ++d4) {", " && 0; ++d4) {")
                                      .replace("w > 0; w /= 2) {", "w > THREADS_N; w /= 2) {"))
                else:
                    src = src.replace(c, "/* cut */")
            be = attnlib.get_backend("opencl", queue=queue)
            be._programs._sources["attn_fwd.cl"] = src
            cache = attnlib.KVCache(b, n, 8, 128, dtype="float16", backend=be)
            for p in range(0, n, 8192):
                cache.update(kh, kh, p)
            qd = attnlib.to_device(q, backend=be)
            ks = _kernel_us(lambda c=cache, x=qd: attnlib.attention_with_kvcache(x, c), queue)
            print(json.dumps({"b": b, "n": n, "variant": name,
                              "kernel_us": [round(x, 1) for x in ks]}), flush=True)
            del cache


def main() -> None:
    ctx = attnlib.get_backend("opencl").context
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    be = attnlib.get_backend("opencl", queue=queue)
    if "sweep" in sys.argv[1:]:
        decode_sweep(queue)
        return
    if "ablate" in sys.argv[1:]:
        ablate(queue)
        return
    if "prefill32" in sys.argv[1:]:
        prefill32_sweep(queue)
        return
    rng = np.random.default_rng(0)
    b, n, hq, hkv, d = 1, int(__import__("os").environ.get("PROBE_N", 8192)), 32, 8, 128
    cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", backend=be)
    kh = rng.standard_normal((b, n, hkv, d), dtype=np.float32).astype(np.float16)
    cache.update(kh, kh, 0)
    qd = attnlib.to_device(rng.standard_normal((b, 1, hq, d), dtype=np.float32)
                           .astype(np.float16), backend=be)
    measure("decode B=1 L=8192", lambda: attnlib.attention_with_kvcache(qd, cache), queue)
    for key, _prg in list(be._programs._programs.items()):
        if key[1] != "attn_fwd.cl":
            continue
        opts = list(key[2]) + ["-cl-std=CL1.2", "-cl-nv-verbose"]
        prg = cl.Program(ctx, kernel_source("attn_fwd.cl")).build(options=opts)
        log = prg.get_build_info(ctx.devices[0], cl.program_build_info.LOG)
        print("verbose", [o for o in key[2] if "BLOCK" in o or "THREADS" in o or "PREF" in o],
              [ln for ln in log.splitlines() if "registers" in ln or "spill" in ln
               or "lmem" in ln or "smem" in ln][:6], flush=True)

    x = [attnlib.to_device(rng.standard_normal((4, 2048, 16, 64), dtype=np.float32)
                           .astype(np.float16), backend=be) for _ in range(3)]
    measure("prefill fp16 4,16,2048,64", lambda: attnlib.attention(*x, backend=be), queue, n=20)


if __name__ == "__main__":
    main()
