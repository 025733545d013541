"""L2 -> shared-memory streaming rate of K/V tiles by load instruction (bench/gpu/l2probe.cl):
cp.async 16-byte chunks in two lane orders against cp.async.bulk row copies (the TMA engine
without a tensor map), at several stage counts, with and without a per-tile spin that stands
for the math.  The traffic is that of the attention kernels at (1, NH, SEQ, 128) fp16 with
BLOCK_M = 128: every one of NH * SEQ / 128 work-groups reads its head's whole K and V.

    source .gpu/setup.sh && python3 bench/gpu/l2probe.py --json $OUT/l2probe.jsonl

Records: {"part": "l2probe", name, method, stages, block_n, threads, pad_kb, delay, ms,
"tb_s" (K and V bytes moved into shared memory per second), "us_per_64kb_per_sm" (per
128-row K+V tile per SM, 132 SMs), "ptxas"}; ``--delays`` are spin clocks per 128 rows.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from devrun import cl_env, emit  # noqa: E402

#: name -> (METHOD, STAGES, BLOCK_N, THREADS, PAD_KB): PAD_KB pads shared memory so that the
#: work-groups per SM match a kernel: wgmma (2 x 64 KB K/V + 32 KB Q) 1 per SM; mma.sync
#: (BLOCK_N 64, 2 stages, Q 34 KB) 2 per SM
CASES = {
    "cpasync_8line_s2_n128": (1, 2, 128, 256, 32),
    "cpasync_rows_s2_n128": (2, 2, 128, 256, 32),
    "cpasync_rows_s3_n128": (2, 3, 128, 256, 0),
    "cpasync_8line_s2_n64_2cta": (1, 2, 64, 128, 34),
    "cpasync_rows_s4_n64": (2, 4, 64, 256, 32),
    "bulk_s2_n128": (3, 2, 128, 256, 32),
    "bulk_s3_n128": (3, 3, 128, 256, 0),
    "bulk_s4_n64": (3, 4, 64, 256, 32),
    "bulk_s2_n64_2cta": (3, 2, 64, 128, 34),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--nh", type=int, default=16)
    ap.add_argument("--delays", type=int, nargs="*", default=[0, 3000])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cl, ctx, queue, dev = cl_env()
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "l2probe.cl")).read()
    seq, nh = args.seq, args.nh
    rng = np.random.default_rng(0)
    host = rng.integers(0, 65535, size=(seq, nh, 128), dtype=np.uint16)
    mf = cl.mem_flags
    kbuf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
    vbuf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host[::-1].copy())
    qblocks = seq // 128
    for name in args.cases:
        method, stages, block_n, threads, pad_kb = CASES[name]
        groups = nh * qblocks
        out = cl.Buffer(ctx, mf.WRITE_ONLY, 4 * groups * threads)
        for delay in args.delays:
            rec = {"part": "l2probe", "name": name, "method": method, "stages": stages,
                   "block_n": block_n, "threads": threads, "pad_kb": pad_kb, "delay": delay}
            try:
                opts = [f"-DMETHOD={method}", f"-DSTAGES={stages}", f"-DWAITN={stages - 2}",
                        f"-DBLOCK_N={block_n}", f"-DTHREADS={threads}", f"-DPAD_KB={pad_kb}",
                        f"-DDELAY={delay * block_n // 128}", "-cl-nv-verbose"]
                prg = cl.Program(ctx, src).build(options=opts)
                log = prg.get_build_info(dev, cl.program_build_info.LOG)
                rec["ptxas"] = " ".join(ln.strip() for ln in log.splitlines()
                                        if "registers" in ln or "smem" in ln or "spill" in ln)
                knl = prg.probe
                knl.set_args(kbuf, vbuf, out, np.int32(seq), np.int32(nh), np.int32(qblocks))
                gsize = (groups * threads,)
                for _ in range(2):
                    cl.enqueue_nd_range_kernel(queue, knl, gsize, (threads,))
                queue.finish()
                times = []
                for _ in range(args.reps):
                    ev = cl.enqueue_nd_range_kernel(queue, knl, gsize, (threads,))
                    ev.wait()
                    times.append((ev.profile.end - ev.profile.start) * 1e-9)
                t = float(np.median(times))
                tiles = groups * (seq // block_n)
                moved = tiles * 2 * block_n * 256
                rec.update(ms=round(t * 1e3, 4), tb_s=round(moved / t / 1e12, 3),
                           us_per_64kb_per_sm=round(t / (moved / 65536 / 132) * 1e6, 3))
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                rec["error"] = repr(exc)[:2000]
            emit(rec, args.json)


if __name__ == "__main__":
    main()
