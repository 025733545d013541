"""Correctness of kernels/attn_fwd_mma.cl against the float64 reference, at odd sizes.

On the H200 (inline PTX):  python bench/gpu/mma_check.py
Here, with PoCL (every warp-level PTX instruction emulated through local memory):
    PYOPENCL_CTX=portable python bench/gpu/mma_check.py --emulate --d 64
Kernel -D options (the candidates of notes/kernel4.md) through --extra, without the -D, e.g.
    --extra LDSM_BYTES=1 KV_SPLIT_STAGES=1
Exit status 1 when a case fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mma_common as mc  # noqa: E402

nv = mc.nv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--dtype", nargs="*", default=["float16", "bfloat16"])
    ap.add_argument("--config", default=None, help="BLOCK_M,BLOCK_N,WARPS,Q_IN_REGS")
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    ap.add_argument("--extra", nargs="*", default=[],
                    help="NAME=VALUE macros for the kernel build (passed as -DNAME=VALUE)")
    args = ap.parse_args()
    import pyopencl as cl

    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    dev = ctx.devices[0]
    cfg = tuple(int(x) for x in args.config.split(",")) if args.config else None
    extra = tuple(x if x.startswith("-D") else "-D" + x for x in args.extra)
    print(f"device: {dev.name}; config {cfg or 'default'}; emulate={args.emulate}; "
          f"extra {' '.join(extra) or '-'}")
    rng = np.random.default_rng(1234)
    failed = 0
    for dname in args.dtype:
        for d in args.d:
            for name, call in mc.cases(rng, mc.DTYPES[dname], d):
                if args.only and args.only not in name:
                    continue
                if not args.emulate and not nv.applicable(dev, call):
                    print(f"  {dname} D={d} {name}: not applicable")
                    failed += 1
                    continue
                t0 = time.perf_counter()
                out, lse = nv.run(ctx, queue, dev, call, config=cfg,
                                  use_ptx=not args.emulate, extra_options=extra or None)
                dt = time.perf_counter() - t0
                ok, err, tol, lerr = mc.check(call, out, lse)
                failed += not ok
                print(f"  {'ok  ' if ok else 'FAIL'} {dname:8s} D={d:3d} {name:26s} "
                      f"err {err:.2e} tol {tol:.2e} lse_err {lerr:.1e} ({dt:.1f} s)", flush=True)
    print("FAILED" if failed else "all passed", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
