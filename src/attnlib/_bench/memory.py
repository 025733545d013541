"""``attnlib bench --memory``: the motivating example, S = 16384, 32 heads, D = 128, float32.

A naive softmax(QK^T)V materialises the score matrix, ``B * H * S * S * 4`` bytes = 32 GiB here;
exact tiled attention needs only its inputs and output. Each backend runs in a fresh subprocess
(``python -m attnlib._bench.memory``) so that one backend's allocator pools cannot hide another's
peak: inputs are made, a small case of the same head size compiles the kernels, the time of the
full call is predicted from a mid-sized one (a backend too slow for ``--memory-timeout`` is
reported, not run), then one full call runs under the peak meter of
:mod:`attnlib._bench.measure`. The subprocess prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from typing import TextIO

from .shapes import Case

__all__ = ["memory_case", "run_memory"]


def memory_case(dtype: str = "float32", causal: bool = True) -> Case:
    return Case(task="prefill", dtype=dtype, B=1, H=32, Hkv=32, S=16384, D=128, causal=causal)


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlib._bench.memory")
    p.add_argument("--backend", required=True)
    p.add_argument("--S", type=int, default=16384)
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--limit", type=float, default=300.0)
    a = p.parse_args(argv)
    from .measure import peak_meter
    from .runners import AttnlibRunner, TorchRunner, make_inputs

    runner = TorchRunner() if a.backend == "torch" else AttnlibRunner(a.backend)
    full = Case(task="prefill", dtype=a.dtype, B=1, H=a.H, Hkv=a.H, S=a.S, D=a.D,
                causal=bool(a.causal))
    out: dict = {"backend": a.backend, "device": runner.device_label}
    # compile on a small case, then time a mid-sized one to predict the full call
    small = replace(full, S=min(256, a.S))
    fn, sync = runner.prepare(small, make_inputs(small))
    sync(fn())
    mid = replace(full, S=min(1024, a.S))
    fn, sync = runner.prepare(mid, make_inputs(mid))
    t0 = time.perf_counter()
    sync(fn())
    t_mid = time.perf_counter() - t0
    predicted = t_mid * full.flops() / mid.flops()
    out["predicted_s"] = predicted
    if predicted > a.limit:
        out["skipped"] = f"predicted {predicted:.0f} s > --memory-timeout {a.limit:.0f} s"
        print(json.dumps(out))
        return 0
    del fn, sync
    inputs = make_inputs(full)
    fn, sync = runner.prepare(full, inputs)
    meter = peak_meter(runner)
    t0 = time.perf_counter()
    with meter:
        sync(fn())
    out["time_s"] = time.perf_counter() - t0
    out["peak_bytes"] = meter.bytes
    out["method"] = meter.method + ", in a fresh process"
    out["input_bytes"] = full.input_bytes()
    print(json.dumps(out))
    return 0


def run_memory(backends: list[str], case: Case, limit: float, progress, out: TextIO) -> list:
    """Run the memory example on each backend in its own subprocess; print and return rows."""
    naive = case.naive_scores_bytes()
    gib = 1 << 30
    print(f"\n--memory: {case.label()}", file=out)
    print(f"  inputs q, k, v: {case.input_bytes() / gib:.2f} GiB; output: "
          f"{case.B * case.S * case.H * case.D * case.itemsize / gib:.2f} GiB", file=out)
    print(f"  naive score matrix B*H*S*S*4 bytes: {naive / gib:.1f} GiB", file=out)
    rows = []
    for name in backends:
        progress(f"--memory: {name} (subprocess, up to {limit:.0f} s)")
        cmd = [sys.executable, "-m", "attnlib._bench.memory", "--backend", name,
               "--S", str(case.S), "--H", str(case.H), "--D", str(case.D),
               "--dtype", case.dtype, "--causal", str(int(case.causal)), "--limit", str(limit)]
        try:
            cp = subprocess.run(cmd, capture_output=True, text=True, timeout=limit * 1.5 + 120)
            line = (cp.stdout.strip().splitlines() or [""])[-1]
            row = json.loads(line) if cp.returncode == 0 and line.startswith("{") else {
                "backend": name, "error": (cp.stderr.strip().splitlines() or ["failed"])[-1]}
        except subprocess.TimeoutExpired:
            row = {"backend": name, "error": "timed out"}
        rows.append(row)
    print(f"  {'backend':<8}  {'time':>9}  {'measured peak (extra)':>22}  vs naive scores  method",
          file=out)
    for r in rows:
        if "peak_bytes" in r and r["peak_bytes"] is not None:
            pk = r["peak_bytes"]
            print(f"  {r['backend']:<8}  {r['time_s']:8.2f}s  {pk / (1 << 20):18.1f} MiB  "
                  f"{naive / max(pk, 1):12.0f}x less  {r['method']}", file=out)
        elif "time_s" in r:
            print(f"  {r['backend']:<8}  {r['time_s']:8.2f}s  {'-':>22}  {r['method']}", file=out)
        else:
            print(f"  {r['backend']:<8}  {r.get('skipped') or r.get('error')}", file=out)
    print("  the measured peak is the memory one call added, its output included; the naive "
          "kernel would need the score matrix on top of that", file=out)
    return rows


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
