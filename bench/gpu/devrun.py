"""What the device scripts (decode_check.py, tf32_check.py, mma_bench.py) share: JSON-line
results, each part in a child process with a timeout (a kernel fault poisons its OpenCL
context; one failure never stops the rest), a profiling queue, and the attention FLOP count.
Standard library only at import time, so a parent process never touches the device."""

from __future__ import annotations

import json
import subprocess
import sys
import time


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
