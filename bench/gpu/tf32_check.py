"""float32 on NVIDIA tensor cores (3xTF32 build of kernels/attn_fwd_mma.cl): correctness of the
PTX build against the float64 oracle, the compiler's register/spill report, kernel time and
TFLOP/s, in one command. On the H200, from the repo root:

    source .gpu/setup.sh && python3 bench/gpu/tf32_check.py --json $OUT/tf32.jsonl
    python3 bench/gpu/tf32_check.py --sweep                  # + the built-in tilings
    python3 bench/gpu/tf32_check.py --config 64:128,64,8,0 128:64,32,4,0:S_CHUNK=2+TF32_SPLIT=1

Each part runs in its own process with a timeout (a kernel fault poisons its OpenCL context):
tf32 mma.sync ceiling, then per config (D:BLOCK_M,BLOCK_N,WARPS,Q_IN_REGS[:NAME=V+NAME=V],
the optional part extra -D macros of the kernel: S_CHUNK, TF32_SPLIT, ...) the build report
(-cl-nv-verbose), every correctness case (odd sizes, masks, NaN/inf, ring cache, scale 1) by
the SPEC rule (max err <= 2 naive-fp32 err + 1e-5), then kernel time by OpenCL profiling events
(median of REPS after WARMUP) for (B,H,S,D) = (4,16,2048,64), (4,16,2048,128), (1,16,8192,128),
causal and not; then PyTorch SDPA float32 (efficient, math) on the same shapes. Every result
and every error is one JSON line (stdout and --json); a summary table ends the run.
FLOPs: 4 B H S^2 D, halved for causal; 3xTF32 issues three tf32 mma per product, so its
ceiling is a third of the tf32 mma.sync rate measured first.
Causal scheduling candidates (D=128 default first, then HEADS_INNER=1: grid order tile * n_heads
+ head, longest-first over all heads, a host option that run() takes; WARP_SKIP=1: a warp skips
key tiles none of its rows sees; S_CHUNK=2; BLOCK_M 128 with two m-tiles per warp; the D=64
default once), in one run of about two minutes:
    source .gpu/setup.sh && python3 bench/gpu/tf32_check.py --config 128:256,32,8,0 \
      128:256,32,8,0:HEADS_INNER=1 128:256,32,8,0:WARP_SKIP=1 \
      128:256,32,8,0:HEADS_INNER=1+WARP_SKIP=1 128:256,32,8,0:HEADS_INNER=1+WARP_SKIP=1+S_CHUNK=2 \
      128:128,32,4,0:KV_STAGES=1+HEADS_INNER=1+WARP_SKIP=1 \
      64:128,64,4,0 64:128,64,4,0:HEADS_INNER=1 64:128,64,4,0:HEADS_INNER=1+WARP_SKIP=1 \
      --no-peak --json $OUT/tf32.jsonl
Here, with PoCL (emulated PTX, tiny shapes):  python bench/gpu/tf32_check.py --emulate
Registers and spills without a GPU, where CUDA's nvcc is installed (the kernel translated to
CUDA C++ and compiled for sm_90; a rough guide only: it matched the H200's OpenCL report for
the fp16 kernel, but NVIDIA's OpenCL took 255 registers for float32 tilings where nvcc took
128-174):
    python bench/gpu/tf32_check.py --nvcc-regs [--sweep] [--config ...] [--fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

SCRIPT = os.path.abspath(__file__)  # re-run as the children
sys.path.insert(0, os.path.dirname(SCRIPT))
from devrun import cl_env, emit, flops, peak_tflops, spawn, torch_median_s  # noqa: E402 - the script's folder

_CU_SHIM = r"""
typedef unsigned int uint; typedef unsigned long ulong; typedef unsigned short ushort;
#define get_local_id(i) ((int)threadIdx.x)
#define get_group_id(i) ((int)((i) == 0 ? blockIdx.x : blockIdx.y))
#define barrier(x) __syncthreads()
#define CLK_LOCAL_MEM_FENCE 0
__device__ inline uint as_uint(float x) { return __float_as_uint(x); }
__device__ inline float as_float(uint x) { return __uint_as_float(x); }
__device__ inline long clamp(long x, long a, long b) { return x < a ? a : (x > b ? b : x); }
#define inline __device__ inline
"""

HERE = os.path.dirname(os.path.abspath(__file__))
PERF = [(4, 16, 2048, 64), (4, 16, 2048, 128), (1, 16, 8192, 128)]
DEFAULTS = {64: (128, 64, 4, 0), 128: (128, 32, 8, 0)}
# --sweep. Run 3 on the H200 (commit 20edf73, bench/gpu/logs/s3-run3-tf32.log) measured at most
# 8 warps per SM (NVIDIA's OpenCL takes 255 registers whatever the tiling) and two m-tiles
# per warp best (D=64 128,64,4,0: 41.7 TFLOP/s; D=128 128,32,4,0 reached 30.0 with 4 warps per
# SM, its 138 KB of local memory leaving room for one work-group). So: two m-tiles per warp and
# 8 warps per SM (BLOCK_M 256 with 8 warps, or 16-key tiles / one K/V buffer for two
# work-groups of 4), then macro A/Bs: TF32_SPLIT=1 (lo unrounded), 2 (hi truncated too),
# S_CHUNK=2 (half the float32 adds of S), 0 (the tensor core's own accumulation of S).
SWEEP = {64: ["128,64,4,0", "256,64,8,0", "256,32,8,0", "128,32,4,0", "128,64,4,0:TF32_SPLIT=1",
              "128,64,4,0:TF32_SPLIT=2", "128,64,4,0:S_CHUNK=2", "128,64,4,0:S_CHUNK=0"],
         128: ["128,32,8,0", "256,32,8,0", "256,16,8,0", "128,16,4,0", "128,32,4,0:KV_STAGES=1",
               "256,32,8,0:TF32_SPLIT=1", "128,32,8,0:TF32_SPLIT=1", "128,32,8,0:TF32_SPLIT=2",
               "128,32,8,0:S_CHUNK=2"]}
WARMUP, REPS = 3, 10
QUICK = ("dense gqa", "causal 70x131", "scale 1.0", "long")  # --quick: these cases only
PEAK_SRC = """
__kernel void tf32_peak(__global float *out, const int iters) {
  const uint lid = get_local_id(0);
  uint a[4] = {0x3f800000u ^ ((lid & 7u) << 13), 0x3f802000u, 0x3f7fe000u, 0x3f804000u};
  uint b0 = 0x3f802000u ^ ((lid & 3u) << 13), b1 = 0x3f7fc000u;
  float acc[CHAINS][4];
#pragma unroll
  for (int c = 0; c < CHAINS; c++) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
  for (int it = 0; it < iters; it++) {
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                   : "=f"(acc[c][0]), "=f"(acc[c][1]), "=f"(acc[c][2]), "=f"(acc[c][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
                     "f"(acc[c][0]), "f"(acc[c][1]), "f"(acc[c][2]), "f"(acc[c][3]));
    }
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; c++) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[get_global_id(0)] = s;
}
"""


# ------------------------------------------------------------------------------------ children
def child_peak(args) -> None:
    cl, ctx, queue, dev = cl_env()
    best = peak_tflops(cl, ctx, queue, dev, PEAK_SRC, "tf32_peak", [], 2048)  # m16n8k8
    emit({"peak_tf32_tflops": best, "device": dev.name}, args.json)


def accuracy_cases(mc, rng, d, emulate):
    """(name, AttnCall): mma_common's cases in float32 plus large-logit and longer ones."""
    f32 = np.dtype(np.float32)
    out = list(mc.cases(rng, f32, d))
    q, k, v = (mc.rand(rng, s, f32) for s in ((1, 61, 2, d), (1, 300, 1, d), (1, 300, 1, d)))
    out.append(("scale 1.0 (scores ~ tens)", mc.dense_call(q, k, v, scale=1.0)))
    q, k, v = (mc.rand(rng, s, f32) for s in ((1, 17, 2, d), (1, 29, 2, d), (1, 29, 2, d)))
    out.append(("huge logits (q, k x 40)", mc.dense_call(q * 40, k * 40, v, causal=True,
                                                          scale=1.0)))
    n = 160 if emulate else 1500
    q, k, v = (mc.rand(rng, s, f32) for s in ((1, n, 2, d), (1, n + 37, 2, d), (1, n + 37, 2, d)))
    out.append((f"long {n}x{n + 37} causal", mc.dense_call(q, k, v, causal=True)))
    out.append((f"long {n}x{n + 37}", mc.dense_call(q, k, v)))
    # many keys: O's float32 sums over thousands of keys (one add per key tile)
    m = 300 if emulate else 8200
    q, k, v = (mc.rand(rng, s, f32) for s in ((1, 40, 2, d), (1, m, 1, d), (1, m, 1, d)))
    out.append((f"long keys 40x{m}", mc.dense_call(q, k, v)))
    return out


def check(mc, call, out, lse) -> dict:
    """The SPEC's rule (tolerance.check_attention) against mma_common's float64 reference: out
    max err <= 2 naive err + 1e-5, the same inf/NaN; lse by the same rule with a slack of
    1e-5 (1 + max |lse|)."""
    ref, ref_lse = mc.reference(call)
    naive, naive_lse = mc.reference(call, round_to=np.float32)
    o = np.asarray(out).astype(np.float64)
    lse = np.asarray(lse).astype(np.float64)
    fin = np.isfinite(ref)
    err = float(np.max(np.abs(o[fin] - ref[fin]))) if fin.any() else 0.0
    tol = 2 * float(np.max(np.abs(naive[fin] - ref[fin]), initial=0.0)) + 1e-5
    same = all(bool(np.array_equal(f(o), f(ref))) for f in (np.isnan, np.isposinf, np.isneginf))
    lf = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(lse[lf] - ref_lse[lf]), initial=0.0))
    lse_tol = (2 * float(np.max(np.abs(naive_lse[lf] - ref_lse[lf]), initial=0.0))
               + 1e-5 * (1 + float(np.max(np.abs(ref_lse[lf]), initial=0.0))))
    lse_same = bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)))
    ok = err <= tol and same and lse_err <= lse_tol and lse_same
    return {"ok": bool(ok), "err": err, "tol": tol, "err_over_tol": err / tol,
            "same_nonfinite": same and lse_same, "lse_err": lse_err, "lse_tol": lse_tol}


def child_config(args) -> None:
    sys.path.insert(0, HERE)
    import mma_common as mc
    import pyopencl.array as cla

    nv = mc.nv
    cl, ctx, queue, dev = cl_env()
    d = args.d[0]
    tiling, _, macros = args.config[0].partition(":")
    cfg = tuple(int(x) for x in tiling.split(","))
    names = [m for m in macros.split("+") if m]
    # HEADS_INNER=0/1 is a host option too (the grid's shape): passed to run(), which adds the
    # -D; without it, the module's default
    inner = bool(nv.HEADS_INNER)
    for m in names:
        if m.startswith("HEADS_INNER="):
            inner = m != "HEADS_INNER=0"
    extra = tuple(f"-D{m}" for m in names if not m.startswith("HEADS_INNER="))
    base = {"d": d, "config": cfg, "extra": " ".join(extra + (("HEADS_INNER",) if inner else ()))}
    use_ptx = not args.emulate
    flags = extra + (() if args.emulate else ("-cl-nv-verbose",))
    opts = nv.build_options(d, np.float32, cfg, use_ptx=use_ptx, heads_inner=inner) + flags
    t0 = time.perf_counter()
    try:
        prg = nv.get_program(ctx, dev, opts)
    except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
        emit({**base, "build_error": str(exc)[-4000:]}, args.json)
        return
    log = prg.get_build_info(dev, cl.program_build_info.LOG)
    report = [ln.strip() for ln in log.splitlines() if ln.strip()]
    emit({**base, "build_s": round(time.perf_counter() - t0, 2), "ptxas": report}, args.json)
    rng = np.random.default_rng(20261129 + d)
    n_fail = 0
    cases = accuracy_cases(mc, rng, d, args.emulate)
    if args.quick:  # sweep entries: the main paths only
        cases = [c for c in cases if c[0].startswith(QUICK)]
    for name, call in cases:
        try:
            out, lse = nv.run(ctx, queue, dev, call, config=cfg, use_ptx=use_ptx,
                              extra_options=flags, heads_inner=inner)
            with np.errstate(invalid="ignore"):
                res = check(mc, call, out, lse)
            n_fail += not res["ok"]
            emit({**base, "case": name, **res}, args.json)
        except Exception as exc:  # noqa: BLE001
            n_fail += 1
            emit({**base, "case": name, "ok": False, "error": repr(exc)[-2000:]}, args.json)
    if n_fail and not args.time_anyway:
        emit({**base, "perf": "skipped: correctness failed (--time-anyway to time it)"},
             args.json)
        return
    shapes = [s for s in PERF if s[3] == d] if not args.emulate else [(1, 2, 96, d)]
    rng = np.random.default_rng(3)
    for shape in shapes:
        b, h, s, _ = shape
        try:
            q, k, v = (cla.to_device(queue, mc.rand(rng, (b, s, h, d), np.float32))
                       for _ in range(3))
        except Exception as exc:  # noqa: BLE001
            emit({**base, "shape": shape, "error": repr(exc)}, args.json)
            continue
        for causal in (False, True):
            try:
                call = mc.dense_call(q, k, v, causal=causal)
                kw = dict(config=cfg, use_ptx=use_ptx, extra_options=flags, heads_inner=inner)
                for _ in range(WARMUP):
                    nv.run(ctx, queue, dev, call, **kw)
                queue.finish()
                ts = []
                for _ in range(REPS):
                    ev: list = []
                    nv.run(ctx, queue, dev, call, events=ev, **kw)
                    ev[0].wait()
                    ts.append((ev[0].profile.end - ev[0].profile.start) * 1e-9)
                t = float(np.median(ts))
                emit({**base, "shape": shape, "causal": causal, "ms": t * 1e3,
                      "tflops": flops(*shape, causal) / t / 1e12}, args.json)
            except Exception as exc:  # noqa: BLE001
                emit({**base, "shape": shape, "causal": causal, "error": repr(exc)[-2000:]},
                     args.json)
        del q, k, v


def child_torch(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for shape in PERF:
        b, h, s, d = shape
        q, k, v = (torch.randn(b, h, s, d, device="cuda") for _ in range(3))
        for causal in (False, True):
            for name, be in backends.items():
                if name == "math" and s > 4096:
                    continue
                try:
                    with sdpa_kernel(be):
                        def fn(q=q, k=k, v=v, causal=causal):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        for _ in range(WARMUP):
                            fn()
                        torch.cuda.synchronize()
                        t = torch_median_s(torch, fn, REPS)
                    emit({"torch": name, "shape": shape, "causal": causal, "ms": t * 1e3,
                          "tflops": flops(*shape, causal) / t / 1e12,
                          "tf32_allowed": torch.backends.cuda.matmul.allow_tf32}, args.json)
                except Exception as exc:  # noqa: BLE001
                    emit({"torch": name, "shape": shape, "causal": causal,
                          "error": repr(exc)[-500:]}, args.json)
        del q, k, v
        torch.cuda.empty_cache()


def nvcc_regs(configs, fp16: bool) -> None:
    """ptxas registers/spills of each config from the kernel translated to CUDA C++ (address
    spaces dropped, static __local arrays shrunk: nvcc caps static shared memory at 48 KiB and
    their size does not change register allocation)."""
    import re
    import tempfile

    sys.path.insert(0, HERE)
    import mma_common as mc

    text = mc.nv.kernel_source("attn_fwd_mma.cl")
    text = text.replace("__kernel __attribute__((reqd_work_group_size(THREADS, 1, 1)))",
                        "KERNEL_HEAD")
    text = re.sub(r"__local\s+(\w+)\s+(\w+)\s*\[[^\]]*\]", r"__shared__ \1 \2[64]", text)
    text = text.replace("__local int v_flag", "__shared__ int v_flag")
    text = text.replace("__local", "").replace("__global", "")
    text = re.sub(r"\((float2|uint4|float4)\)\(", r"make_\1(", text)
    text = text.replace("KERNEL_HEAD", 'extern "C" __global__ __launch_bounds__(THREADS)')
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cu")
        with open(path, "w") as f:
            f.write(_CU_SHIM + text)
        for d, item in configs:
            tiling, _, macros = item.partition(":")
            cfg = tuple(int(x) for x in tiling.split(","))
            dtype = np.float16 if fp16 else np.float32
            opts = list(mc.nv.build_options(d, dtype, cfg)) + [f"-D{m}" for m in
                                                               macros.split("+") if m]
            cmd = ["nvcc", "-arch=sm_90", "-cubin", "-o", os.devnull, "-Xptxas", "-v", *opts,
                   path]
            res = subprocess.run(cmd, capture_output=True, text=True)
            info = [ln.split(":", 1)[-1].strip() for ln in res.stderr.splitlines()
                    if "Used" in ln or "spill" in ln]
            print(f"D={d} {item} {'fp16' if fp16 else 'fp32'}: "
                  f"{'; '.join(info) if res.returncode == 0 else res.stderr[-800:]}", flush=True)


# -------------------------------------------------------------------------------------- parent
def summary(recs: list[dict], peak: float | None) -> None:
    print("\n== summary")
    if peak:
        print(f"tf32 mma.sync ceiling {peak:.0f} TFLOP/s -> 3xTF32 ceiling {peak / 3:.0f} "
              "TFLOP/s of attention FLOPs")
    acc: dict = {}
    for r in recs:
        if "case" in r:
            key = (r["d"], tuple(r["config"]), r.get("extra", ""))
            ok, worst = acc.get(key, (0, 0.0))
            acc[key] = (ok + (not r.get("ok")), max(worst, r.get("err_over_tol", 0.0)))
    for (d, cfg, extra), (bad, worst) in sorted(acc.items()):
        print(f"D={d} {cfg} {extra}: {'all correct' if not bad else f'{bad} FAILED'}, "
              f"worst err/tol {worst:.2f}")
    torch = {(tuple(r["shape"]), r["causal"], r["torch"]): r["tflops"]
             for r in recs if "torch" in r and "tflops" in r}
    # "vs first": this row's time over the first config's time on the same shape and causality
    print("| B,H,S,D | causal | config | ms | TFLOP/s | of 3xTF32 ceiling | vs first "
          "| torch efficient |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    first: dict = {}
    for r in recs:
        if "tflops" not in r or "config" not in r:
            continue
        shape, causal = tuple(r["shape"]), r["causal"]
        frac = f"{3 * r['tflops'] / peak:.0%}" if peak else "-"
        eff = torch.get((shape, causal, "efficient"))
        speed = first.setdefault((shape, causal), r["ms"]) / r["ms"]
        print(f"| {','.join(map(str, shape))} | {'yes' if causal else 'no'} | "
              f"{','.join(map(str, r['config']))} {r.get('extra', '')} | {r['ms']:.3f} | "
              f"{r['tflops']:.1f} | {frac} | {speed:.3f}x | "
              f"{f'{eff:.1f}' if eff else '-'} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", nargs="*", default=None,
                    help="D:BLOCK_M,BLOCK_N,WARPS,Q_IN_REGS ... (default: the module's table)")
    ap.add_argument("--sweep", action="store_true", help="also the built-in tilings")
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--json", default=None, help="JSON lines file (default $OUT or /tmp)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per child")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--emulate", action="store_true", help="USE_PTX=0 on any device (PoCL)")
    ap.add_argument("--time-anyway", action="store_true")
    ap.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds: no new config is started past this (the device's command "
                         "limit is 600 s)")
    ap.add_argument("--nvcc-regs", action="store_true", help="registers by nvcc, no GPU needed")
    ap.add_argument("--fp16", action="store_true", help="--nvcc-regs: the 16-bit build")
    ap.add_argument("--child", choices=["peak", "config", "torch"], help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.child:
        try:
            {"peak": child_peak, "config": child_config, "torch": child_torch}[args.child](args)
        except Exception:  # noqa: BLE001
            emit({"child": args.child, "error": traceback.format_exc()[-3000:]}, args.json)
            return 1
        return 0
    if args.json is None:
        args.json = os.path.join(os.environ.get("OUT") or "/tmp", "tf32_check.jsonl")
    own = ["--json", args.json]
    common = own + (["--emulate"] if args.emulate else []) + (
        ["--time-anyway"] if args.time_anyway else [])
    configs: list[tuple[int, str]] = []
    if args.config:
        for item in args.config:
            d, _, c = item.partition(":")
            configs.append((int(d), c))
    else:
        from_module = DEFAULTS
        try:
            sys.path.insert(0, HERE)
            import mma_common as mc

            from_module = dict(mc.nv.DEFAULT_CONFIGS_F32)
        except Exception as exc:  # noqa: BLE001
            print(f"(default configs from this script: {exc!r})")
        configs = [(d, ",".join(map(str, from_module[d]))) for d in args.d]
    if args.sweep:
        configs += [(d, c) for d in args.d for c in SWEEP[d] if (d, c) not in configs]
    if args.nvcc_regs:
        nvcc_regs(configs, args.fp16)
        return 0
    if os.path.exists(args.json):
        os.remove(args.json)
    start = time.perf_counter()
    if not (args.no_peak or args.emulate):
        spawn(SCRIPT, ["--child", "peak", *own], 60, args.json, {"child": "peak"})
    n_first = len(configs) if args.config else len(args.d)  # the rest: --sweep entries
    reserve = 0 if (args.no_torch or args.emulate) else 60
    for i, (d, cfg) in enumerate(configs):
        left = args.budget - reserve - (time.perf_counter() - start)
        if left < 30:
            emit({"d": d, "config": cfg, "error": "skipped: --budget spent"}, args.json)
            continue
        print(f"\n== D={d} config BLOCK_M,BLOCK_N,WARPS,Q_IN_REGS[:macros] = {cfg}", flush=True)
        spawn(SCRIPT, ["--child", "config", "--d", str(d), "--config", cfg, *common,
               *(["--quick"] if i >= n_first else [])], min(args.timeout, left), args.json,
              {"d": d, "config": cfg})
    if not (args.no_torch or args.emulate):
        print("\n== PyTorch SDPA float32", flush=True)
        left = args.budget + 50 - (time.perf_counter() - start)
        spawn(SCRIPT, ["--child", "torch", *own], max(30.0, min(240.0, left)), args.json,
              {"child": "torch"})
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if os.path.exists(args.json):
        recs = [json.loads(ln) for ln in open(args.json) if ln.strip()]
        peak = next((r["peak_tf32_tflops"] for r in recs if "peak_tf32_tflops" in r), None)
        summary(recs, peak)
        failed = any(r.get("ok") is False or "build_error" in r or "error" in r for r in recs)
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
