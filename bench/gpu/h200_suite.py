"""One device run: the opencl backend beside PyTorch SDPA on the same GPU, same data, same process.

Prefill forward TFLOP/s (4·B·H·S²·D, halved for causal) and decode (one query token over a
KV cache; bytes = the K and V cache read once) for the shapes of the OpenCL and tensor-core
issues. Times are medians of ``--reps`` runs after warm-up, each run synchronised with the
device (OpenCL: ``queue.finish()``; torch: CUDA events), so they include attnlib's Python
front door. ``*_pipe*`` figures: the same calls issued back to back with one synchronisation
at the end (attnlib and torch alike), the throughput a caller sees who does not wait on each
result. Prints a markdown table and writes JSON.

    python bench/gpu/h200_suite.py --json $OUT/h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import attnlib

PREFILL = [(4, 16, 2048, 64), (4, 16, 2048, 128), (1, 16, 8192, 128), (1, 32, 16384, 128)]
DECODE = [(1, 8192), (8, 8192), (1, 131072)]  # (batch, cache length); 32 q heads, 8 kv, D 128


def _median_time(fn, sync, warm: int, reps: int) -> float:
    for _ in range(warm):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pipelined_time(fn, sync, reps: int) -> float:
    """Seconds per call of ``reps`` calls issued back to back, then one synchronisation: the
    throughput a caller that does not wait on every result sees (host time hides under device
    time where the kernels are the longer)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def _torch_times(q, k, v, causal: bool, reps: int) -> dict:
    """SDPA per backend on (B, H, S, D) CUDA tensors; missing backends are left out."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    out = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                f(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                ts = []
                for _ in range(reps):
                    start.record()
                    f(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
                    end.record()
                    end.synchronize()
                    ts.append(start.elapsed_time(end) / 1e3)
                out[name] = statistics.median(ts)
                out[name + "_pipe"] = _pipelined_time(
                    lambda: f(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]),
                    torch.cuda.synchronize, reps)
        except Exception as exc:  # noqa: BLE001 - a backend torch cannot run here is reported
            out[name] = f"n/a ({type(exc).__name__})"
    return out


def prefill(dtype: str, reps: int, with_torch: bool, rows: list, portable: bool = False) -> None:
    """``portable=True`` keeps float16/bfloat16 off the tensor-core kernel (``use_mma=False``)."""
    import ml_dtypes
    import torch

    np_dtype = {"float32": np.float32, "float16": np.float16,
                "bfloat16": ml_dtypes.bfloat16}[dtype]
    t_dtype = {"float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16}[dtype]
    be = attnlib.get_backend("opencl", use_mma=False) if portable else "opencl"
    for b, h, s, d in PREFILL:
        if (dtype == "float32" or portable) and h * s > 16 * 8192:
            continue  # the fp32 / portable figures use the first three shapes only
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((b, s, h, d), dtype=np.float32).astype(np_dtype)
                for _ in range(3)]
        dev = [attnlib.to_device(x, backend="opencl") for x in host]
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            out = attnlib.attention(*dev, causal=causal, backend=be)
            sync = out.queue.finish

            def run(c=causal, x=dev):
                return attnlib.attention(*x, causal=c, backend=be)

            t = _median_time(run, sync, warm=2, reps=reps)
            tp = _pipelined_time(run, sync, reps)
            row = {"kind": "prefill", "dtype": dtype, "path": "portable" if portable else "auto",
                   "shape": [b, h, s, d], "causal": causal,
                   "opencl_s": t, "opencl_tflops": flops / t / 1e12,
                   "opencl_pipe_tflops": flops / tp / 1e12}
            if with_torch:
                tq = [torch.from_numpy(x.astype(np.float32)).to("cuda", t_dtype)
                      .transpose(1, 2).contiguous() for x in host]
                for name, tt in _torch_times(*tq, causal, reps).items():
                    row[f"torch_{name}_tflops"] = flops / tt / 1e12 if isinstance(tt, float) else tt
                del tq
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)


def decode(reps: int, with_torch: bool, rows: list) -> None:
    import torch

    hq, hkv, d = 32, 8, 128
    for b, n in DECODE:
        rng = np.random.default_rng(1)
        cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", backend="opencl")
        step = 8192
        kh = rng.standard_normal((b, step, hkv, d), dtype=np.float32).astype(np.float16)
        vh = rng.standard_normal((b, step, hkv, d), dtype=np.float32).astype(np.float16)
        for p in range(0, n, step):
            cache.update(kh, vh, p)
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
        qd = attnlib.to_device(q, backend="opencl")
        out = attnlib.attention_with_kvcache(qd, cache)
        def step_once(x=qd, c=cache):
            return attnlib.attention_with_kvcache(x, c)

        t = _median_time(step_once, out.queue.finish, warm=3, reps=max(reps, 20))
        tp = _pipelined_time(step_once, out.queue.finish, max(reps, 20))
        nbytes = 2 * b * n * hkv * d * 2
        row = {"kind": "decode", "dtype": "float16", "batch": b, "cache_len": n,
               "opencl_us": t * 1e6, "opencl_TBps": nbytes / t / 1e12,
               "opencl_pipe_us": tp * 1e6}
        if with_torch:
            tq = torch.from_numpy(q.astype(np.float32)).to("cuda", torch.float16).transpose(1, 2)
            tk = torch.from_numpy(np.tile(kh, (1, n // step, 1, 1)).astype(np.float32)).to(
                "cuda", torch.float16).transpose(1, 2).contiguous()
            tv = tk.clone()
            for name, tt in _torch_times(tq.contiguous(), tk, tv, False, max(reps, 20)).items():
                row[f"torch_{name}_us"] = tt * 1e6 if isinstance(tt, float) else tt
            del tk, tv
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--only", action="append",
                    choices=["prefill32", "prefill16", "prefill16p", "prefillbf16", "decode"])
    args = ap.parse_args(argv)
    be = attnlib.get_backend("opencl")
    print("opencl backend:", be.info(), flush=True)
    rows: list = []
    parts = args.only or ["prefill32", "prefill16p", "prefill16", "prefillbf16", "decode"]
    if "prefill32" in parts:
        prefill("float32", args.reps, not args.no_torch, rows)
    if "prefill16p" in parts:
        prefill("float16", args.reps, not args.no_torch, rows, portable=True)
    if "prefill16" in parts:
        prefill("float16", args.reps, not args.no_torch, rows)
    if "prefillbf16" in parts:
        prefill("bfloat16", args.reps, not args.no_torch, rows)
    if "decode" in parts:
        decode(args.reps, not args.no_torch, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
