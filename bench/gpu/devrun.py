"""What the device scripts (decode_check.py, tf32_check.py, mma_bench.py) share: JSON-line
results, each part in a child process with a timeout (a kernel fault poisons its OpenCL
context; one failure never stops the rest), a profiling queue, and the attention FLOP count.
Standard library and numpy only at import time, so a parent process never touches the
device."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np


def emit(rec: dict, path: str | None) -> None:
    """Print one result as a JSON line, and append it to ``path`` when given."""
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def spawn(script: str, argv: list[str], timeout: float, json_path: str | None,
          what: dict) -> None:
    """Run ``python script *argv`` as a child; its failure or timeout becomes an error record."""
    cmd = [sys.executable, script, *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd)
        rc = proc.wait(timeout=timeout)
        if rc:
            emit({**what, "error": f"child exited with status {rc}"}, json_path)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        emit({**what, "error": f"timed out after {timeout:.0f} s"}, json_path)
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        emit({**what, "error": repr(exc)}, json_path)
    print(f"   ({what} took {time.perf_counter() - t0:.1f} s)", flush=True)


def flops(b, h, s, d, causal):
    """Forward attention FLOPs, 4 B H S^2 D, halved for causal."""
    return 4.0 * b * h * s * s * d / (2 if causal else 1)


def cl_env():
    """(pyopencl, context, profiling queue, device) of pyopencl's default device choice."""
    import pyopencl as cl

    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    return cl, ctx, queue, ctx.devices[0]


def peak_tflops(cl, ctx, queue, dev, src: str, kernel: str, options: list[str],
                flops_per_mma: int, chains: int = 8, iters: int = 1024) -> float:
    """The best of 4 runs of a throughput kernel (``kernel(out, iters)``: each warp issues
    ``iters`` x ``chains`` independent mma of ``flops_per_mma``), 8 work-groups of 256 per
    compute unit, timed by profiling events; TFLOP/s."""
    n_wg, threads = dev.max_compute_units * 8, 256
    out = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, n_wg * threads * 4)
    prg = cl.Program(ctx, src).build(options=[*options, f"-DCHAINS={chains}"])
    knl = cl.Kernel(prg, kernel)
    knl.set_args(out, np.int32(iters))
    best = 0.0
    for _ in range(4):
        ev = cl.enqueue_nd_range_kernel(queue, knl, (n_wg * threads,), (threads,))
        ev.wait()
        t = (ev.profile.end - ev.profile.start) * 1e-9
        best = max(best, n_wg * threads / 32 * iters * chains * flops_per_mma / t / 1e12)
    return best


def torch_median_s(torch, fn, reps: int, before=None) -> float:
    """Median seconds of ``fn()`` between two CUDA events (``before()`` runs untimed ahead of
    each rep, e.g. an L2 flush)."""
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    return float(np.median(ts))


def dense_calls(be, dtype, shapes, causals=(False, True)):
    """For each (B, H, S, D) of ``shapes``: random q, k, v of ``dtype`` on ``be``'s device
    (bshd, seed 0), then per causality ``((b, h, s, d), causal, call, flops)`` with ``call`` the
    front door's AttnCall of a plain dense attention; the arrays live until the next shape."""
    import attnlib
    from attnlib import _spec

    for b, h, s, d in shapes:
        rng = np.random.default_rng(0)
        x = [attnlib.to_device(rng.standard_normal((b, s, h, d), dtype=np.float32)
                               .astype(dtype), backend=be) for _ in range(3)]
        for causal in causals:
            call = _spec.dense_call(*x, scale=None, mask=None, layout="bshd", need_lse=False,
                                    alibi_slopes=None, causal=causal, window=None, softcap=None)
            yield (b, h, s, d), causal, call, flops(b, h, s, d, causal)
        del x


def torch_sdpa_anchor(shapes, dtypes, json_path, backends=("flash",), warmup=3, reps=10):
    """PyTorch SDPA on the same (B, H, S, D) shapes (random bhsd tensors), causal and not, per
    backend name of ``backends`` ("flash", "cudnn", "efficient"): CUDA-event median of ``reps``
    after ``warmup`` calls, one record {"part": "torch", backend, dtype, shape, causal, ms,
    tflops} each (an error record when a backend refuses, one {"part": "torch", error} when
    PyTorch or its GPU is missing: the device run goes on)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        emit({"part": "torch", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}, json_path)
        return

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dname in dtypes:
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dname]
        for b, h, s, d in shapes:
            x = [torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3)]
            for causal in (False, True):
                for name in backends:
                    rec = {"part": "torch", "backend": name, "dtype": dname,
                           "shape": [b, h, s, d], "causal": causal}
                    try:
                        with sdpa_kernel(kinds[name]):
                            for _ in range(warmup):
                                sdpa(*x, is_causal=causal)
                            t = torch_median_s(
                                torch, lambda x=x, c=causal: sdpa(*x, is_causal=c), reps)
                        rec.update(ms=round(t * 1e3, 4),
                                   tflops=round(flops(b, h, s, d, causal) / t / 1e12, 1))
                    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    emit(rec, json_path)
            del x
            torch.cuda.empty_cache()
