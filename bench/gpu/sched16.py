"""The causal scheduling options of the tensor-core prefill kernel on fp16 / bf16 (H200 run 5
measured them on float32 only): HEADS_INNER (grid tile * n_heads + head, so the heaviest causal
tiles of every head start first) and -DWARP_SKIP=1 (a warp skips key tiles none of its rows
sees). Kernel time by OpenCL profiling events (median of REPS after WARMUP) per shape, causal and
not, default vs both options; the options must not change the result: the largest difference
from the default's output is printed (the skipped tiles contribute exactly nothing).

    source .gpu/setup.sh && python3 bench/gpu/sched16.py --json $OUT/sched16.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from devrun import dense_calls  # noqa: E402

SHAPES = [(4, 16, 2048, 64), (4, 16, 2048, 128), (1, 16, 8192, 128), (1, 32, 16384, 128)]
WARMUP, REPS = 3, 10
VARIANTS = {"default": {}, "heads_inner+warp_skip": {"heads_inner": True,
                                                     "extra_options": ("-DWARP_SKIP=1",)}}


def main(argv=None) -> int:
    import ml_dtypes
    import pyopencl as cl

    import attnlib
    from attnlib.backends.opencl import _nvidia_mma as nv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = attnlib.get_backend("opencl")
    ctx, dev = base.context, base.device
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    be = attnlib.get_backend("opencl", queue=queue)
    rows = []
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for (b, h, s, d), causal, call, flops in dense_calls(be, dtype, SHAPES):
            outs = {}
            for name, kw in VARIANTS.items():
                row = {"dtype": np.dtype(dtype).name, "shape": [b, h, s, d],
                       "causal": causal, "variant": name}
                try:
                    ev: list = []
                    for _ in range(WARMUP):
                        nv.run(ctx, queue, dev, call, **kw)
                    queue.finish()
                    for _ in range(REPS):
                        out, _ = nv.run(ctx, queue, dev, call, events=ev, **kw)
                    queue.finish()
                    t = statistics.median((e.profile.end - e.profile.start) * 1e-9
                                          for e in ev[-REPS:])
                    outs[name] = out.get().astype(np.float32)
                    row.update(ms=round(t * 1e3, 4), tflops=round(flops / t / 1e12, 1))
                    if name != "default" and "default" in outs:
                        row["max_diff_vs_default"] = float(
                            np.max(np.abs(outs[name] - outs["default"])))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
