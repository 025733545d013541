"""Tensor-core decode kernel (kernels/attn_decode_mma.cl) on the H200, in one command:

    source .gpu/setup.sh && python3 bench/gpu/decode_check.py --json $OUT/decode.jsonl

Parts, each in its own process with a timeout (a kernel fault poisons its OpenCL context), every
result or error one JSON line (stdout and --json), a summary table at the end. Order: check,
then per shape time and torch, verbose, e2e, and the check of head dims not yet dispatched:
  check    the PTX build against the float64 oracle by the SPEC rule (bench/gpu/mma_common.py):
           fp16/bf16, D 64/128 (then 32/96/256, not yet dispatched, in a second process),
           GQA 4/8, q_len 1 and 3 causal, splits with empty ones, ring cache,
           window+softcap+alibi, NaN in hidden v; each case with merge.cl and "fused" (the
           kernel's last work-group per (sequence, kv head) merges the splits, FUSED_MERGE=1);
           and one call through the backend's dispatch (OpenCLBackend.attention must take the
           decode kernel)
  floor    event duration of an empty kernel on the decode grid, one and two back to back
  verbose  ptxas registers / spills / shared memory (-cl-nv-verbose) of every config timed
  time     decode (32 q heads, 8 kv heads, D=128, fp16) B=1/8192, B=8/8192, B=1/131072: kernel
           time by OpenCL profiling events (decode + merge.cl durations, median of REPS), L2 hot
           (back-to-back) and cold (a 256 MB write before each rep), per (BLOCK_N, WARPS,
           STAGES), split count and merge variant (merge.cl / fused), each kernel's own
           duration too (decode_us, merge_us); every variant's result checked against a float32
           reference first (ok, err); TB/s = 2 B n 8 128 2 bytes / time; "gated": REPS calls
           queued behind a user event, released at once, timed first start to last end (per
           call: GPU back to back, launch gaps included); for the default config also the wall
           time per call of back-to-back calls (host included)
  e2e      attnlib.attention_with_kvcache (the public path, dispatch included), pipelined; the
           same with use_mma=False (the portable kernel) beside it
  torch    PyTorch SDPA flash / cudnn / efficient, enable_gqa=True, on the same shapes: events
           (hot and cold) and pipelined
Here, with PoCL (emulated PTX, check part only):  python bench/gpu/decode_check.py --emulate
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

SCRIPT = os.path.abspath(__file__)  # re-run as the children
sys.path.insert(0, os.path.dirname(SCRIPT))
from devrun import emit, spawn, torch_median_s  # noqa: E402 - the script's folder

HERE = os.path.dirname(os.path.abspath(__file__))
HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 8192), (8, 8192), (1, 131072)]
# run 4 dropped (64,4,2) (spills, never best) and (128,8,2) (never best)
CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (64, 2, 4), (32, 2, 4)]
SPLITS = {(1, 8192): [None, 8, 16, 33], (8, 8192): [None, 2, 4],
          (1, 131072): [None, 16, 66]}
# merge variants timed for every (config, splits): merge.cl after the kernel, or "fused": the
# last work-group of each (sequence, kv head) merges (FUSED_MERGE=1, one launch)
VARIANTS = ["", "fused"]
REPS, WARMUP = 30, 3


def nbytes(b: int, n: int) -> int:
    return 2 * b * n * HKV * D * 2


def cl_env():
    import pyopencl as cl

    import attnlib

    be = attnlib.get_backend("opencl")
    queue = cl.CommandQueue(be.context, be.device,
                            properties=cl.command_queue_properties.PROFILING_ENABLE)
    return cl, be, queue


# ------------------------------------------------------------------------------------ children
def child_check(args) -> None:
    sys.path.insert(0, HERE)
    import mma_common as mc

    from attnlib.backends.opencl import _nvidia_decode as nd

    cl, be, queue = cl_env()
    rng = np.random.default_rng(7)
    dims = nd.HEAD_DIMS + nd.EXTRA_HEAD_DIMS  # the extra ones run the kernel directly
    for dname, dt in mc.DTYPES.items():
        for d in args.dims:
            for name, call, splits in check_cases(mc, rng, dt, d):
                for variant in VARIANTS:
                    if variant == "fused" and splits == 1:
                        continue
                    rec = {"part": "check", "dtype": dname, "d": d, "case": name,
                           "splits": splits, "variant": variant}
                    try:
                        if not args.emulate and not nd.applicable(be.device, call, dims):
                            emit({**rec, "ok": False, "error": "not applicable"}, args.json)
                            continue
                        out, lse = nd.run(be, queue, call, splits=splits,
                                          use_ptx=not args.emulate, fused=variant == "fused")
                        ok, err, tol, lerr = mc.check(call, out, lse)
                        emit({**rec, "ok": ok, "err": err, "tol": tol, "lse_err": lerr},
                             args.json)
                    except Exception:  # noqa: BLE001
                        emit({**rec, "ok": False, "error": traceback.format_exc()[-1500:]},
                             args.json)
    if args.emulate or args.dims != [64, 128]:
        return
    # the backend's own dispatch: a GQA decode call must run the decode kernel
    q, k, v = (mc.rand(rng, s, np.float16) for s in ((2, 1, 32, 128), (2, 700, 8, 128),
                                                       (2, 700, 8, 128)))
    call = mc.seq_call(q, k, v, q_batch=[0, 1], q_row0=[0, 0], q_len=[1, 1], k_batch=[0, 1],
                       k_row0=[0, 0], k_len=[700, 333], q_pos0=[699, 332], k_pos0=[0, 0],
                       causal=True)
    before = len(nd._kernels)
    out, lse = be.attention(call)
    ok, err, tol, lerr = mc.check(call, out, lse)
    emit({"part": "check", "case": "dispatch through OpenCLBackend.attention", "ok": ok,
          "took_decode_kernel": len(nd._kernels) > before, "err": err, "tol": tol}, args.json)


def check_cases(mc, rng, dt, d):
    """(name, AttnCall, splits) at odd sizes."""
    def cache_call(b, q_len, klens, hq, hkv, **kw):
        cap = max(klens) + 3
        q, k, v = (mc.rand(rng, s, dt) for s in ((b, q_len, hq, d), (b, cap, hkv, d),
                                                 (b, cap, hkv, d)))
        kl = np.asarray(klens)
        return mc.seq_call(q, k, v, q_batch=range(b), q_row0=[0] * b, q_len=[q_len] * b,
                           k_batch=range(b), k_row0=[0] * b, k_len=kl, q_pos0=kl - q_len,
                           k_pos0=[0] * b, causal=True, **kw)

    yield "gqa4 q_len 1, 1333 keys", cache_call(2, 1, [1333, 517], 8, 2), None
    yield "gqa4 q_len 1, 7 splits (empty ones)", cache_call(1, 1, [301], 8, 2), 7
    yield "gqa8 q_len 1, one split", cache_call(1, 1, [1001], 16, 2), 1
    yield "mha q_len 3 causal", cache_call(2, 3, [250, 77], 3, 3), 3
    call = cache_call(1, 3, [190], 8, 2)
    call.v[0, 189, 1, 5] = np.nan  # seen only by the last row
    call.v[0, 188, 0, 2] = np.inf  # seen by the last two rows
    yield "gqa4 q_len 3, inf/NaN in v hidden from some rows", call, 2
    ring = 160
    q, k, v = (mc.rand(rng, s, dt) for s in ((3, 1, 8, d), (3, ring, 2, d), (3, ring, 2, d)))
    kl = np.array([160, 70, 129])
    yield "ring cache, wrapped rows", mc.seq_call(
        q, k, v, q_batch=range(3), q_row0=[0] * 3, q_len=[1] * 3, k_batch=[2, 0, 1],
        k_row0=[100, 150, 40], k_len=kl, q_pos0=kl + 499, k_pos0=[500] * 3, causal=True,
        ring=ring), 3
    q, k, v = (mc.rand(rng, s, dt) for s in ((1, 2, 8, d), (1, 611, 2, d), (1, 611, 2, d)))
    call = mc.dense_call(q, k, v, causal=True, window=(200, 0), softcap=25.0,
                         alibi=np.linspace(0.01, 0.3, 8).astype(np.float32))
    yield "window+softcap+alibi q_len 2", call, 4


def config_options(be, cfg, split, verbose=False, fused=False):
    from attnlib.backends.opencl import _nvidia_decode as nd

    return list(nd.build_options(D, np.float16, cfg, split=split, fused=fused)) + (
        ["-cl-nv-verbose"] if verbose else [])


def child_verbose(args) -> None:
    from attnlib.backends.opencl import _nvidia_decode as nd
    from attnlib.backends.opencl._runtime import kernel_source

    cl, be, queue = cl_env()
    for cfg in CONFIGS:
        for split in (False, True, "fused"):
            rec = {"part": "verbose", "config": cfg, "split": split,
                   "local_bytes": nd.local_bytes(D, cfg)}
            try:
                prg = cl.Program(be.context, kernel_source("attn_decode_mma.cl")).build(
                    options=config_options(be, cfg, bool(split), True, split == "fused"),
                    devices=[be.device])
                log = prg.get_build_info(be.device, cl.program_build_info.LOG)
                rec["ptxas"] = [ln.strip() for ln in log.splitlines()
                                if "registers" in ln or "spill" in ln or "smem" in ln][:4]
                knl = cl.Kernel(prg, "attn_decode_mma")
                rec["local_mem_reported"] = knl.get_work_group_info(
                    cl.kernel_work_group_info.LOCAL_MEM_SIZE, be.device)
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-2000:]
            emit(rec, args.json)


def _decode_call(cla, queue, b, n):
    from attnlib.backends.base import AttnCall

    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, 1, HQ, D), dtype=np.float32).astype(np.float16)
    k = rng.standard_normal((b, n, HKV, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((b, n, HKV, D), dtype=np.float32).astype(np.float16)
    qd, kd, vd = (cla.to_device(queue, x) for x in (q, k, v))
    ref = _reference(q, k, v)
    del k, v
    i64 = lambda x: np.asarray(x, np.int64)  # noqa: E731
    ar = np.arange(b)
    return ref, AttnCall(
        q=qd, k=kd, v=vd, q_batch=i64(ar), q_row0=i64(ar * 0), q_len=i64(ar * 0 + 1),
        k_batch=i64(ar), k_row0=i64(ar * 0), k_len=i64(ar * 0 + n),
        q_pos0=i64(ar * 0 + n - 1), k_pos0=i64(ar * 0), causal_hi=i64(ar * 0),
        scale=1.0 / np.sqrt(D), need_lse=False)


def _reference(q, k, v):
    """float32 (out, lse) of the timing call (one query row sees every key), per kv head."""
    b, g = q.shape[0], HQ // HKV
    out = np.empty((b, HQ, D), np.float32)
    lse = np.empty((b, HQ), np.float32)
    for i in range(b):
        for h in range(HKV):
            qh = q[i, 0, h * g:(h + 1) * g].astype(np.float32)
            s = qh @ k[i, :, h].astype(np.float32).T / np.float32(np.sqrt(D))
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            tot = p.sum(axis=1, keepdims=True)
            out[i, h * g:(h + 1) * g] = (p @ v[i, :, h].astype(np.float32)) / tot
            lse[i, h * g:(h + 1) * g] = (m + np.log(tot))[:, 0]
    return out, lse


def _verify(ref, out, lse) -> dict:
    """Max errors of one timed variant's result against the float32 reference (fp16 output
    rounding of values ~0.01-0.1 is ~5e-5; a wrong merge is off by ~0.01 or more)."""
    o = out.get().astype(np.float32)[:, 0]
    ls = lse.get()[:, :, 0]
    err, lerr = float(np.abs(o - ref[0]).max()), float(np.abs(ls - ref[1]).max())
    return {"ok": bool(err < 5e-4 and lerr < 1e-3), "err": err, "lse_err": lerr}


def child_floor(args) -> None:
    """Event duration of an empty kernel on the decode grid (the launch floor every kernel
    event holds), and of two back to back (what a second launch adds)."""
    cl, be, queue = cl_env()
    prg = cl.Program(be.context, "__kernel void nop(__global int *x) {}").build()
    knl = cl.Kernel(prg, "nop")
    buf = cl.Buffer(be.context, cl.mem_flags.READ_WRITE, 64)
    knl.set_arg(0, buf)
    for splits in (1, 4, 32, 66):
        grid = (128, HKV, splits)
        for _ in range(WARMUP):
            cl.enqueue_nd_range_kernel(queue, knl, grid, (128, 1, 1))
        queue.finish()
        one, two = [], []
        for _ in range(REPS):
            e1 = cl.enqueue_nd_range_kernel(queue, knl, grid, (128, 1, 1))
            e2 = cl.enqueue_nd_range_kernel(queue, knl, grid, (128, 1, 1))
            e2.wait()
            one.append((e1.profile.end - e1.profile.start) * 1e-3)
            two.append((e2.profile.end - e1.profile.start) * 1e-3)
        emit({"part": "floor", "grid": grid, "empty_kernel_us": float(np.median(one)),
              "two_empty_span_us": float(np.median(two))}, args.json)


def child_time(args) -> None:
    import pyopencl.array as cla

    from attnlib.backends.opencl import _nvidia_decode as nd

    cl, be, queue = cl_env()
    b, n = args.shape
    ref, call = _decode_call(cla, queue, b, n)
    flush = cl.Buffer(be.context, cl.mem_flags.READ_WRITE, 256 << 20)
    zero = np.zeros(1, np.uint32)
    for cfg in CONFIGS:
        for splits in SPLITS[(b, n)]:
            tiles = -(-n // cfg[0])
            used = splits or nd.choose_splits(be.facts.compute_units, b * HKV, tiles, D, cfg)
            for variant in VARIANTS:
                if variant == "fused" and used == 1:
                    continue
                rec = {"part": "time", "batch": b, "cache_len": n, "config": cfg,
                       "splits": used, "auto_splits": splits is None, "variant": variant}
                emit(time_one(cl, be, queue, call, nd, ref, flush, zero, cfg, used, variant,
                              rec, splits is None and cfg == nd.DEFAULT_CONFIGS[D]), args.json)


def time_one(cl, be, queue, call, nd, ref, flush, zero, cfg, used, variant, rec, wall):
    fused = variant == "fused"
    b, n = rec["batch"], rec["cache_len"]
    try:
        out, lse = nd.run(be, queue, call, config=cfg, splits=used, fused=fused)
        rec.update(_verify(ref, out, lse))
        for _ in range(WARMUP):
            nd.run(be, queue, call, config=cfg, splits=used, fused=fused)
        queue.finish()
        for mode in ("hot", "cold"):
            spans, kern, dec, mrg = [], [], [], []
            for _ in range(REPS):
                if mode == "cold":
                    cl.enqueue_fill_buffer(queue, flush, zero, 0, 256 << 20)
                ev: list = []
                nd.run(be, queue, call, config=cfg, splits=used, fused=fused, events=ev)
                ev[-1].wait()
                spans.append((ev[-1].profile.end - ev[0].profile.start) * 1e-9)
                kern.append(sum((e.profile.end - e.profile.start) for e in ev) * 1e-9)
                dec.append((ev[0].profile.end - ev[0].profile.start) * 1e-9)
                mrg.append(sum((e.profile.end - e.profile.start) for e in ev[1:]) * 1e-9)
            # kernels: decode + merge durations; span: first start to last end (also any idle
            # gap while the host enqueues the merge); decode / merge: each kernel's own
            t = float(np.median(kern))
            rec[f"{mode}_kernels_us"] = t * 1e6
            rec[f"{mode}_decode_us"] = float(np.median(dec)) * 1e6
            rec[f"{mode}_merge_us"] = float(np.median(mrg)) * 1e6
            rec[f"{mode}_span_us"] = float(np.median(spans)) * 1e6
            rec[f"{mode}_TBps"] = nbytes(b, n) / t / 1e12
        # back-to-back calls (launch gaps included, host not): what a decode loop sees
        rec["gated_us"] = gated_time(cl, be, queue, call, nd, cfg, used, fused) * 1e6
        if wall:
            queue.finish()
            t0 = time.perf_counter()
            for _ in range(REPS):
                nd.run(be, queue, call, fused=fused)
            queue.finish()
            rec["pipelined_wall_us"] = (time.perf_counter() - t0) / REPS * 1e6
    except Exception:  # noqa: BLE001
        rec["error"] = traceback.format_exc()[-1500:]
    return rec


def gated_time(cl, be, queue, call, nd, cfg, splits, fused) -> float:
    """Seconds per call of REPS calls enqueued behind a user event and then released: the GPU
    runs them back to back (launch gaps included, host time not), as CUDA streams let
    PyTorch's decode steps run."""
    gate = cl.UserEvent(be.context)
    cl.enqueue_barrier(queue, wait_for=[gate])
    ev: list = []
    for _ in range(REPS):
        nd.run(be, queue, call, config=cfg, splits=splits, fused=fused, events=ev)
    gate.set_status(cl.command_execution_status.COMPLETE)
    ev[-1].wait()
    return (ev[-1].profile.end - ev[0].profile.start) * 1e-9 / REPS


def child_e2e(args) -> None:
    import attnlib

    b, n = args.shape
    rng = np.random.default_rng(1)
    cache = attnlib.KVCache(b, n, HKV, D, dtype="float16", backend="opencl")
    step = min(n, 8192)
    kh = rng.standard_normal((b, step, HKV, D), dtype=np.float32).astype(np.float16)
    for p in range(0, n, step):
        cache.update(kh, kh, p)
    q = rng.standard_normal((b, 1, HQ, D), dtype=np.float32).astype(np.float16)
    qd = attnlib.to_device(q, backend="opencl")
    be = attnlib.get_backend("opencl")
    rec = {"part": "e2e", "batch": b, "cache_len": n}
    for name, use_mma in (("", True), ("portable_", False)):  # portable: use_mma=False
        be.use_mma = use_mma
        out = attnlib.attention_with_kvcache(qd, cache)
        out.queue.finish()
        t0 = time.perf_counter()
        for _ in range(REPS):
            attnlib.attention_with_kvcache(qd, cache)
        out.queue.finish()
        t = (time.perf_counter() - t0) / REPS
        rec[f"{name}pipelined_us"] = t * 1e6
        rec[f"{name}pipelined_TBps"] = nbytes(b, n) / t / 1e12
    be.use_mma = True
    emit(rec, args.json)


def child_torch(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n = args.shape
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.float16)
    v = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.float16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name, sb in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        rec = {"part": "torch", "torch": name, "batch": b, "cache_len": n}
        try:
            with sdpa_kernel([sb]):
                def fn():
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                for _ in range(WARMUP):
                    fn()
                torch.cuda.synchronize()
                for mode in ("hot", "cold"):
                    t = torch_median_s(torch, fn, REPS, flush.zero_ if mode == "cold" else None)
                    rec[f"{mode}_us"], rec[f"{mode}_TBps"] = t * 1e6, nbytes(b, n) / t / 1e12
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(REPS):
                    fn()
                torch.cuda.synchronize()
                rec["pipelined_wall_us"] = (time.perf_counter() - t0) / REPS * 1e6
        except Exception as exc:  # noqa: BLE001
            rec["error"] = repr(exc)[-500:]
        emit(rec, args.json)


# -------------------------------------------------------------------------------------- parent
def summary(recs: list[dict]) -> None:
    print("\n== summary")
    checks = [r for r in recs if r.get("part") == "check"]
    bad = [r for r in checks if not r.get("ok")]
    wrong = [r for r in recs if r.get("part") == "time" and r.get("ok") is False]
    for r in wrong:
        print(f"  WRONG timed result {r['batch']},{r['cache_len']} {r['config']} "
              f"{r['splits']} {r.get('variant')}: err {r.get('err')} lse {r.get('lse_err')}")
    print(f"check: {len(checks) - len(bad)}/{len(checks)} correct"
          + "".join(f"\n  FAIL {r.get('dtype')} D={r.get('d')} {r.get('case')}: "
                    f"{r.get('err', r.get('error', ''))}" for r in bad))
    for r in recs:
        if r.get("part") == "verbose":
            print(f"verbose {r['config']} split={r['split']}: {r.get('ptxas', r.get('error'))}")
    torch = {(r["batch"], r["cache_len"], r["torch"]): r for r in recs
             if r.get("part") == "torch" and "hot_us" in r}
    for r in recs:
        if r.get("part") == "floor":
            print(f"floor grid {r['grid']}: empty kernel {r['empty_kernel_us']:.1f} us, two "
                  f"back to back {r['two_empty_span_us']:.1f} us (first start to last end)")
    print("| B, n | BLOCK_N,WARPS,STAGES | splits | merge | ok | cold us (decode + merge) "
          "| cold TB/s | hot us (decode + merge) | gated us | torch flash cold / hot / pipelined |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in recs:
        if r.get("part") != "time" or "cold_kernels_us" not in r:
            continue
        fl = torch.get((r["batch"], r["cache_len"], "flash"), {})
        tf = (f"{fl['cold_us']:.1f} / {fl['hot_us']:.1f} / {fl['pipelined_wall_us']:.1f}"
              if fl else "-")
        gated = f"{r['gated_us']:.1f}" if "gated_us" in r else "-"
        cold = f"{r['cold_kernels_us']:.1f} ({r['cold_decode_us']:.1f} + {r['cold_merge_us']:.1f})"
        hot = f"{r['hot_kernels_us']:.1f} ({r['hot_decode_us']:.1f} + {r['hot_merge_us']:.1f})"
        ok = "ok" if r.get("ok") else f"WRONG {r.get('err', -1):.2g}"
        print(f"| {r['batch']}, {r['cache_len']} | {','.join(map(str, r['config']))} | "
              f"{r['splits']}{'*' if r['auto_splits'] else ''} | "
              f"{r.get('variant') or 'merge.cl'} | {ok} | {cold} | "
              f"{r['cold_TBps']:.2f} | {hot} | {gated} | {tf} |")
    for r in recs:
        if r.get("part") == "e2e":
            print(f"e2e attention_with_kvcache B={r['batch']} n={r['cache_len']}: "
                  f"{r['pipelined_us']:.1f} us per call pipelined (portable kernel: "
                  f"{r['portable_pipelined_us']:.1f} us)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="JSON lines file (default $OUT or /tmp)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per child")
    ap.add_argument("--emulate", action="store_true", help="USE_PTX=0, check part only")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--child", choices=["check", "verbose", "time", "e2e", "torch", "floor"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--shape", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            {"check": child_check, "verbose": child_verbose, "time": child_time,
             "e2e": child_e2e, "torch": child_torch, "floor": child_floor}[args.child](args)
        except Exception:  # noqa: BLE001
            emit({"child": args.child, "shape": args.shape,
                  "error": traceback.format_exc()[-3000:]}, args.json)
            return 1
        return 0
    if args.json is None:
        args.json = os.path.join(os.environ.get("OUT") or "/tmp", "decode.jsonl")
    if os.path.exists(args.json):
        os.remove(args.json)
    own = ["--json", args.json] + (["--emulate"] if args.emulate else [])
    start = time.perf_counter()
    spawn(SCRIPT, ["--child", "check", *own], 240 if args.emulate else args.timeout, args.json,
          {"child": "check"})
    if not args.emulate:  # timings first: they matter most if the run is cut short
        spawn(SCRIPT, ["--child", "floor", *own], 60, args.json, {"child": "floor"})
        for b, n in SHAPES:
            shape = ["--shape", str(b), str(n)]
            spawn(SCRIPT, ["--child", "time", *shape, *own], args.timeout, args.json,
                  {"child": "time", "shape": (b, n)})
            if not args.no_torch:
                spawn(SCRIPT, ["--child", "torch", *shape, *own], 90, args.json,
                      {"child": "torch", "shape": (b, n)})
        spawn(SCRIPT, ["--child", "verbose", *own], args.timeout, args.json, {"child": "verbose"})
        for b, n in SHAPES:
            spawn(SCRIPT, ["--child", "e2e", "--shape", str(b), str(n), *own], 90, args.json,
                  {"child": "e2e", "shape": (b, n)})
    # head dims built but not dispatched yet (EXTRA_HEAD_DIMS): own process, a fault there
    # must not poison the rest
    spawn(SCRIPT, ["--child", "check", "--dims", "32", "96", "256", *own],
          240 if args.emulate else args.timeout, args.json, {"child": "check extra dims"})
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    recs = [json.loads(ln) for ln in open(args.json) if ln.strip()]
    summary(recs)
    return 1 if any(r.get("ok") is False or "error" in r for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
