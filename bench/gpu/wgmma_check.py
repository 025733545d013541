"""The warpgroup-MMA prefill kernel (kernels/attn_fwd_wgmma.cl, _nvidia_wgmma) on the H200, in
one device run: (1) the build: marker counts, ptxas report, the PTX's .version/.target, both PTX
texts in DIR/wgmma_ptx.tar.gz; (2) correctness against the float64 numpy reference and the
mma.sync kernel on odd shapes with every option (and, if the first case fails, which of the
LBO/SBO exchanges QK_SWAP / V_SWAP would pass); (3) kernel time (OpenCL events, median of REPS
after WARMUP) of wgmma configs (WGS, BLOCK_N) beside the mma.sync kernel's default, and
PyTorch's flash and cuDNN backends on the same shapes.

    source .gpu/setup.sh && python3 bench/gpu/wgmma_check.py --json $OUT/wg.jsonl --ptx $OUT

Records: {"part": "build"|"check"|"swap"|"time"|"torch", ...}.
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
CONFIGS = [(2, 128), (2, 64), (1, 128), (3, 64)]
WARMUP, REPS = 3, 10
TOL = {"float16": 3e-3, "bfloat16": 2.5e-2}
#: correctness cases: (B, Sq, Sk, Hq, Hkv, D, kwargs)
CASES = [
    (2, 333, 333, 4, 2, 128, {"causal": True}),
    (1, 200, 200, 2, 2, 128, {}),
    (2, 77, 333, 4, 1, 64, {"causal": True}),
    (1, 130, 260, 3, 3, 64, {"window": (32, 5)}),
    (1, 150, 150, 2, 1, 128, {"softcap": 20.0, "alibi": True}),
    (1, 257, 257, 2, 2, 64, {"hidden_nan": True, "causal": True}),
]


def _case_inputs(rng, b, sq, sk, hq, hkv, d, dtype):
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    return q, k, v


def check(be, args_json, dtypes, swaps: bool) -> bool:
    import attnlib
    from attnlib.backends.opencl import _nvidia_mma as nv

    all_ok = True
    for dname, dtype in dtypes.items():
        for i, (b, sq, sk, hq, hkv, d, kw) in enumerate(CASES):
            rng = np.random.default_rng(100 + i)
            q, k, v = _case_inputs(rng, b, sq, sk, hq, hkv, d, dtype)
            kw = dict(kw)
            if kw.pop("hidden_nan", False):
                v[:, -3] = np.nan  # keys hidden from the early rows of the causal diagonal
            if kw.pop("alibi", False):
                kw["alibi_slopes"] = rng.random(hq).astype(np.float32)
            want = attnlib.attention(q, k, v, backend="numpy", **kw).astype(np.float64)
            rec = {"part": "check", "dtype": dname, "case": [b, sq, sk, hq, hkv, d],
                   "kw": {k_: str(v_) for k_, v_ in kw.items()}}
            was = nv.WGMMA_ON
            try:
                nv.WGMMA_ON = False
                mma = attnlib.to_numpy(attnlib.attention(q, k, v, backend=be, **kw))
                nv.WGMMA_ON = True
                got = attnlib.to_numpy(attnlib.attention(q, k, v, backend=be, **kw))
                err = float(np.nanmax(np.abs(got.astype(np.float64) - want)))
                nan_ok = bool(np.array_equal(np.isnan(got), np.isnan(want)))
                rec.update(max_err=err, vs_mma=float(np.nanmax(np.abs(
                    got.astype(np.float64) - mma.astype(np.float64)))),
                    mma_err=float(np.nanmax(np.abs(mma.astype(np.float64) - want))),
                    nan_pattern_ok=nan_ok, ok=bool(err <= TOL[dname] and nan_ok))
            except Exception as exc:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:600]}")
            finally:
                nv.WGMMA_ON = was
            emit(rec, args_json)
            all_ok &= rec["ok"]
            if not rec["ok"] and swaps and i == 0:
                try_swaps(be, q, k, v, kw, want, dname, args_json)
    return all_ok


def try_swaps(be, q, k, v, kw, want, dname, args_json) -> None:
    """Which exchange of LBO and SBO (K-major Q/K, N-major V) gives the right answer."""
    import attnlib
    from attnlib import _spec
    from attnlib.backends.opencl import _nvidia_mma as nv

    dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))
    call = _spec.dense_call(dq, dk, dv, scale=None, mask=None, layout="bshd", need_lse=False,
                            alibi_slopes=None, causal=kw.get("causal", False), window=None,
                            softcap=None)
    for qk in (0, 1):
        for vs in (0, 1):
            rec = {"part": "swap", "QK_SWAP": qk, "V_SWAP": vs}
            try:
                out, _ = nv.run(be.context, be.queue, be.device, call, kernel="wgmma",
                                extra_options=(f"-DQK_SWAP={qk}", f"-DV_SWAP={vs}"))
                got = out.get().astype(np.float64)
                rec["max_err"] = float(np.nanmax(np.abs(got - want)))
            except Exception as exc:  # noqa: BLE001
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            emit(rec, args_json)


def build_report(be, ptx_dir, json_path) -> None:
    import attnlib
    from attnlib import _spec
    from attnlib.backends.opencl import _nvidia_mma as nv
    from attnlib.backends.opencl import _nvidia_wgmma as wg

    for d, causal in ((128, False), (128, True), (64, False)):
        x = [attnlib.to_device(np.ones((1, 64, 2, d), np.float16), backend=be) for _ in range(3)]
        call = _spec.dense_call(*x, scale=None, mask=None, layout="bshd", need_lse=False,
                                alibi_slopes=None, causal=causal, window=None, softcap=None)
        plan = nv.plan_launch(be.context, be.device, call, kernel="wgmma",
                              extra_options=("-cl-nv-verbose",))
        rec = {"part": "build", "d": d, "causal": causal, "opts": list(plan.opts)}
        try:
            _, info = wg.build(be.context, be.device, plan.opts, plan.block_n, d)
            ptx, new = info["ptx"], info["ptx_sm90a"]
            rec["header"] = [ln.strip() for ln in ptx.splitlines()
                             if ln.strip().startswith((".version", ".target"))]
            rec["markers"] = info["markers"]
            rec["ptxas"] = [ln.strip() for ln in info["log"].splitlines()
                            if "registers" in ln or "spill" in ln or "arning" in ln
                            or "stack" in ln][:12]
            if ptx_dir:
                stage = tempfile.mkdtemp()
                name = f"d{d}_{'causal' if causal else 'dense'}"
                with open(os.path.join(stage, name + ".ptx"), "w") as f:
                    f.write(ptx)
                with open(os.path.join(stage, name + ".sm90a.ptx"), "w") as f:
                    f.write(new)
                os.makedirs(ptx_dir, exist_ok=True)
                with tarfile.open(os.path.join(ptx_dir, f"wgmma_ptx_{name}.tar.gz"), "w:gz") as t:
                    t.add(stage, arcname="wgmma_ptx")
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        emit(rec, json_path)


def timing(be, queue, shapes, dtypes, configs, json_path, variants=None) -> None:
    from attnlib.backends.opencl import _nvidia_mma as nv

    ctx, dev = be.context, be.device
    for dname, dtype in dtypes.items():
        for (b, h, s, d), causal, call, fl in dense_calls(be, dtype, shapes):
            ref = None
            runs = [(None, "", None)] + [(cfg, vname, vopts) for cfg in configs
                                         for vname, vopts in (variants or {"": None}).items()]
            for cfg, vname, vopts in runs:
                kind = "mma" if cfg is None else "wgmma"
                row = {"part": "time", "dtype": dname, "shape": [b, h, s, d],
                       "causal": causal, "kernel": kind, "config": cfg, "variant": vname}
                try:
                    ev: list = []
                    for _ in range(WARMUP):
                        nv.run(ctx, queue, dev, call, kernel=kind, wgmma_config=cfg,
                               extra_options=vopts)
                    for _ in range(REPS):
                        out, _ = nv.run(ctx, queue, dev, call, kernel=kind,
                                        wgmma_config=cfg, events=ev, extra_options=vopts)
                    queue.finish()
                    t = statistics.median((e.profile.end - e.profile.start) * 1e-9
                                          for e in ev)
                    row.update(ms=round(t * 1e3, 4), tflops=round(fl / t / 1e12, 1))
                    o = out.get().astype(np.float32)
                    if ref is None:
                        ref = o
                    else:
                        row["max_diff_vs_mma"] = float(np.max(np.abs(o - ref)))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                emit(row, json_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--ptx", default=None)
    ap.add_argument("--dtype", nargs="*", default=["float16", "bfloat16"])
    ap.add_argument("--configs", nargs="*", default=None, help="WGS,BLOCK_N each")
    ap.add_argument("--shapes", nargs="*", default=None, help="B,H,S,D each")
    ap.add_argument("--skip", nargs="*", default=[], choices=["build", "check", "time", "torch"])
    ap.add_argument("--check-options", nargs="*", default=None,
                    help="-D options of the wgmma builds the correctness part runs (commas "
                         "also separate them: --check-options=-DA=1,-DB=1)")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="NAME=-DOPT=V,-DOPT=V each: wgmma kernel options timed per config "
                         "(e.g. serial=-DWG_OVERLAP=0 overlap=-DWG_OVERLAP=1)")
    args = ap.parse_args(argv)
    import ml_dtypes
    import pyopencl as cl

    import attnlib

    t0 = time.perf_counter()
    base = attnlib.get_backend("opencl")
    queue = cl.CommandQueue(base.context,
                            properties=cl.command_queue_properties.PROFILING_ENABLE)
    be = attnlib.get_backend("opencl", queue=queue)
    dtypes = {n: {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[n] for n in args.dtype}
    shapes = ([tuple(int(v) for v in sh.split(",")) for sh in args.shapes] if args.shapes
              else SHAPES)
    configs = ([tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs
               else CONFIGS)
    if "build" not in args.skip:
        build_report(be, args.ptx, args.json)
    ok = True
    if "check" not in args.skip:
        from attnlib.backends.opencl import _nvidia_mma as nv

        if args.check_options is not None:
            nv.WGMMA_OPTIONS = tuple(o for v in args.check_options for o in v.split(","))
        ok = check(be, args.json, dtypes, swaps=True)
        emit({"part": "check_done", "all_ok": ok, "s": round(time.perf_counter() - t0, 1)},
             args.json)
    variants = None
    if args.variants:
        variants = {}
        for item in args.variants:
            name, _, opts = item.partition("=")
            variants[name] = tuple(o for o in opts.split(",") if o)
    if "time" not in args.skip:
        timing(be, queue, shapes, dtypes, configs, args.json, variants)
    if "torch" not in args.skip:
        torch_sdpa_anchor(shapes, dtypes, args.json, ("flash", "cudnn"), WARMUP, REPS)
    emit({"part": "done", "s": round(time.perf_counter() - t0, 1)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
