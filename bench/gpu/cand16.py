"""The candidate -D options of the 16-bit tensor-core prefill kernel (notes/kernel4.md) against
the default build, in one device run: kernel time by OpenCL profiling events (median of REPS
after WARMUP) for fp16 and bf16, shapes (B, H, S, D) below, causal and not; the largest
difference of each candidate's output from the default's (LDSM_BYTES and KV_SPLIT_STAGES reorder
no arithmetic: 0 is expected; SOFTMAX_PIPE steps the online softmax per half tile: a few output
ulps); the ptxas report (-cl-nv-verbose: registers, spills, local memory) of every build;
with --ptx DIR, each build's PTX and log in one archive DIR/cand16_ptx.tar.gz (the device run
returns at most 8 files), rewritten after every build. Optionally PyTorch's flash backend on
the same shapes (the anchor of issue #5), after the OpenCL part.

    source .gpu/setup.sh && python3 bench/gpu/cand16.py --json $OUT/cand16.jsonl --ptx $OUT/ptx

Records: {"part": "time", dtype, shape, causal, variant, ms, tflops, max_diff_vs_default}
{"part": "build", name, opts, ptxas}, {"part": "torch", dtype, shape, causal, ms, tflops}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tarfile
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from devrun import dense_calls, emit, torch_sdpa_anchor  # noqa: E402

SHAPES = [(4, 16, 2048, 128), (1, 16, 8192, 128), (1, 32, 16384, 128), (4, 16, 2048, 64)]
WARMUP, REPS = 3, 10
#: name -> extra -D options (every build also gets -cl-nv-verbose, which only adds the report)
#: (causal calls get -DWARP_SKIP=1 unless a variant sets WARP_SKIP itself)
VARIANTS = {
    "auto": None,  # the library's choice (_nvidia_mma.DEFAULT_OPTIONS_16); no ptxas report
    "default": (),
    "ldsm_bytes": ("-DLDSM_BYTES=1",),
    "kv_split": ("-DKV_SPLIT_STAGES=1",),
    "softmax_pipe": ("-DSOFTMAX_PIPE=1", "-DWARP_SKIP=0"),
    "softmax_pipe_ldsm_bytes": ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
    "softmax_pipe2_ldsm_bytes": ("-DSOFTMAX_PIPE=2", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
    "ldsm_bytes_kv_split": ("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1"),
    # not causal with the causal build's shape of code (the tile body under WARP_SKIP's test;
    # no tile is skipped): run 5's causal LDSM_BYTES + KV_SPLIT_STAGES build did not spill
    "ldsm_bytes_skip": ("-DLDSM_BYTES=1", "-DWARP_SKIP=1"),
    "ldsm_bytes_kv_split_skip": ("-DLDSM_BYTES=1", "-DKV_SPLIT_STAGES=1", "-DWARP_SKIP=1"),
    # the causal baseline of the softmax_pipe rows without WARP_SKIP
    "default_no_warp_skip": ("-DWARP_SKIP=0",),
    # SOFTMAX_PIPE with WARP_SKIP (half tiles a warp cannot see skipped) on causal calls
    "softmax_pipe_ldsm_bytes_skip": ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1"),
    # BLOCK_N=32 (the rest of the default config kept): half tiles of 16 keys for the pipe,
    # 2 x 16 S registers instead of 2 x 32 (NVIDIA's D=128 pipe builds spilled 52-56 B)
    "ldsm_bytes_n32": ("-DLDSM_BYTES=1",),
    "softmax_pipe_ldsm_bytes_n32": ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
    "softmax_pipe2_ldsm_bytes_n32": ("-DSOFTMAX_PIPE=2", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
}
# KV_ROWWISE: the fast K/V loader copies chunks of one row per thread ([R+imm] cp.async)
VARIANTS.update({
    "ldsm_bytes_rowwise": ("-DLDSM_BYTES=1", "-DKV_ROWWISE=1"),
    "kv_split_rowwise": ("-DKV_SPLIT_STAGES=1", "-DKV_ROWWISE=1"),
    "softmax_pipe_ldsm_bytes_rowwise": ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DKV_ROWWISE=1",
                                        "-DWARP_SKIP=0"),
})
#: variants with another BLOCK_N than the default config's
VARIANT_BLOCK_N = {"ldsm_bytes_n32": 32, "softmax_pipe_ldsm_bytes_n32": 32,
                   "softmax_pipe2_ldsm_bytes_n32": 32}
#: run when --variants is not given
DEFAULT_VARIANTS = ["default", "auto", "ldsm_bytes", "ldsm_bytes_rowwise", "kv_split",
                    "kv_split_rowwise", "softmax_pipe_ldsm_bytes",
                    "softmax_pipe_ldsm_bytes_rowwise", "softmax_pipe_ldsm_bytes_n32",
                    "softmax_pipe_ldsm_bytes_skip", "ldsm_bytes_kv_split"]
VERBOSE = "-cl-nv-verbose"
_STAGE = os.path.join(tempfile.gettempdir(), f"cand16_ptx_{os.getpid()}")


def report_builds(cl, nv, dev, seen: set, name: str, ptx_dir: str | None,
                  json_path: str | None) -> None:
    """The ptxas report (and PTX, log) of every program built since the last call."""
    for key, prg in list(nv._programs.items()):
        if key in seen or key[2] != "attn_fwd_mma.cl":
            continue
        seen.add(key)
        opts = list(key[3])
        log = prg.get_build_info(dev, cl.program_build_info.LOG) or ""
        ptxas = [ln.strip() for ln in log.splitlines()
                 if "registers" in ln or "spill" in ln or "stack" in ln]
        rec = {"part": "build", "name": name, "opts": [o for o in opts if o != VERBOSE],
               "ptxas": ptxas}
        if ptx_dir:
            ptx = prg.get_info(cl.program_info.BINARIES)[0]
            os.makedirs(_STAGE, exist_ok=True)
            with open(os.path.join(_STAGE, name + ".ptx"), "wb") as f:
                f.write(ptx)
            with open(os.path.join(_STAGE, name + ".log"), "w") as f:
                f.write(" ".join(opts) + "\n" + log)
            rec["ptx_bytes"] = len(ptx)
            os.makedirs(ptx_dir, exist_ok=True)
            with tarfile.open(os.path.join(ptx_dir, "cand16_ptx.tar.gz"), "w:gz") as tar:
                tar.add(_STAGE, arcname="cand16_ptx")
        emit(rec, json_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--ptx", default=None, help="directory for each build's PTX and log")
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--dtype", nargs="*", default=["float16", "bfloat16"])
    ap.add_argument("--d", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--no-causal", action="store_true", help="non-causal calls only")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch anchor")
    ap.add_argument("--shapes", nargs="*", default=None, help="B,H,S,D each (default SHAPES)")
    ap.add_argument("--no-verbose", action="store_true",
                    help="build without -cl-nv-verbose (not NVIDIA: a smoke test on PoCL)")
    args = ap.parse_args(argv)
    import ml_dtypes
    import pyopencl as cl

    import attnlib
    from attnlib.backends.opencl import _nvidia_mma as nv

    t_start = time.perf_counter()
    base = attnlib.get_backend("opencl")
    ctx, dev = base.context, base.device
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    be = attnlib.get_backend("opencl", queue=queue)
    dtypes = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    shapes = ([tuple(int(v) for v in sh.split(",")) for sh in args.shapes] if args.shapes
              else [s for s in SHAPES if s[3] in args.d])
    verbose = () if args.no_verbose else (VERBOSE,)
    seen: set = set()
    for dname in args.dtype:
        dtype = dtypes[dname]
        causals = (False,) if args.no_causal else (False, True)
        for (b, h, s, d), causal, call, fl in dense_calls(be, dtype, shapes, causals):
            ref = None
            for name in args.variants:
                extra = None if VARIANTS[name] is None else (*VARIANTS[name], *verbose)
                cfg = nv.default_config(dtype, d)
                if name in VARIANT_BLOCK_N:
                    cfg = (cfg[0], VARIANT_BLOCK_N[name], *cfg[2:])
                row = {"part": "time", "dtype": dname, "shape": [b, h, s, d],
                       "causal": causal, "variant": name}
                try:
                    ev: list = []
                    t0 = time.perf_counter()
                    nv.run(ctx, queue, dev, call, config=cfg, extra_options=extra)
                    queue.finish()
                    row["first_call_s"] = round(time.perf_counter() - t0, 2)  # + build
                    for _ in range(WARMUP - 1):
                        nv.run(ctx, queue, dev, call, config=cfg, extra_options=extra)
                    queue.finish()
                    report_builds(cl, nv, dev, seen,
                                  f"{dname}_d{d}_{'causal' if causal else 'dense'}_{name}",
                                  args.ptx, args.json)
                    for _ in range(REPS):
                        out, _ = nv.run(ctx, queue, dev, call, config=cfg, events=ev,
                                        extra_options=extra)
                    queue.finish()
                    t = statistics.median((e.profile.end - e.profile.start) * 1e-9
                                          for e in ev[-REPS:])
                    row.update(ms=round(t * 1e3, 4), tflops=round(fl / t / 1e12, 1))
                    o = out.get().astype(np.float32)
                    if ref is None and name == "default":
                        ref = o
                    elif ref is not None:
                        row["max_diff_vs_default"] = float(np.max(np.abs(o - ref)))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                emit(row, args.json)
    emit({"part": "opencl_done", "s": round(time.perf_counter() - t_start, 1)}, args.json)
    if not args.no_torch:
        torch_sdpa_anchor(shapes, args.dtype, args.json, ("flash",), WARMUP, REPS)
    emit({"part": "done", "s": round(time.perf_counter() - t_start, 1)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
