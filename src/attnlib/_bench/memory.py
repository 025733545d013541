"""``attnlib bench --memory``: the motivating example, S = 16384, 32 heads, D = 128, float32.

A naive softmax(QK^T)V materialises the score matrix, ``B * H * S * S * 4`` bytes = 32 GiB here;
exact tiled attention needs only its inputs and output. Then the memory of a decode KV cache
(:func:`kv_cache_memory`) in the dtype and in each 8-bit ``kv_dtype``. Each backend runs in a
fresh subprocess (``python -m attnlib._bench.memory``) so that one backend's allocator pools
cannot hide another's peak: inputs are made, a small case of the same head size compiles the
kernels, the time of the full call is predicted from a mid-sized one (a backend too slow for
``--memory-timeout`` is reported, not run), then one full call runs under the peak meter of
:mod:`attnlib._bench.measure`. The subprocess prints its progress on stderr (passed on, with a
line every ``HEARTBEAT_S`` while the full call runs) and one JSON line on stdout.

Without ``--backends`` the backends that are slow here by design are left out (the numpy
reference, and opencl when its device is a CPU: minutes each); naming them runs them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import TextIO

from .shapes import Case

__all__ = ["memory_case", "run_memory", "kv_cache_memory", "default_memory_backends",
           "HEARTBEAT_S"]

HEARTBEAT_S = 10.0


def default_memory_backends(names: list[str]) -> tuple[list[str], list[str]]:
    """(backends to run, backends left out as slow here) for ``--memory`` without
    ``--backends``: the numpy reference and opencl on a CPU device take minutes."""
    import attnlib

    slow = []
    for n in names:
        if n == "numpy":
            slow.append(n)
        elif n == "opencl":
            try:
                import pyopencl as cl

                if not attnlib.get_backend("opencl").device.type & cl.device_type.GPU:
                    slow.append(n)
            except Exception:  # noqa: BLE001 - a backend that cannot say is run
                pass
    return [n for n in names if n not in slow], slow


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    t0 = time.perf_counter()
    fn, sync = runner.prepare(small, make_inputs(small))
    sync(fn())
    _say(f"compiled and warm in {time.perf_counter() - t0:.1f} s")
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
    _say(f"full call predicted to take {predicted:.0f} s; running it ...")
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


#: the decode cache of ``--memory``'s KV-cache lines (contract §10's benchmark shape)
KV_CACHE_SHAPE = dict(B=8, L=8192, Hkv=8, D=128)


def kv_cache_memory(dtype: str, out: TextIO) -> list[dict]:
    """The bytes a ``KVCache`` of :data:`KV_CACHE_SHAPE` allocates (K, V and, when quantized,
    their float32 scales; numpy backend, measured from its arrays) in ``dtype`` and in each
    8-bit kv_dtype; printed with the ratio to ``dtype``, returned as rows."""
    import attnlib
    from attnlib import _quant

    b, length, hkv, d = (KV_CACHE_SHAPE[n] for n in ("B", "L", "Hkv", "D"))
    rows = []
    for kv in (None, *_quant.FORMATS):
        cache = attnlib.KVCache(b, length, hkv, d, dtype=dtype, kv_dtype=kv, backend="numpy")
        parts = [cache.k, cache.v] + ([cache.k_scales, cache.v_scales] if kv else [])
        rows.append({"kv_dtype": kv or dtype, "bytes": int(sum(x.nbytes for x in parts))})
        del cache, parts
    base = rows[0]["bytes"]
    print(f"\nKV cache B={b} L={length} Hkv={hkv} D={d}, dtype={dtype} (K, V and their "
          "scales as allocated):", file=out)
    for r in rows:
        print(f"  {r['kv_dtype']:<14} {r['bytes'] / (1 << 20):9.1f} MiB  "
              f"{r['bytes'] / base:5.3f}x", file=out)
    return rows


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
        progress(f"--memory: {name} in a fresh process (skipped if predicted over {limit:.0f} s)")
        cmd = [sys.executable, "-m", "attnlib._bench.memory", "--backend", name,
               "--S", str(case.S), "--H", str(case.H), "--D", str(case.D),
               "--dtype", case.dtype, "--causal", str(int(case.causal)), "--limit", str(limit)]
        rows.append(_run_child(name, cmd, limit * 1.5 + 120, progress))
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


def _run_child(name: str, cmd: list[str], timeout: float, progress) -> dict:
    """Run one child, passing its stderr lines on as progress, with a line every
    ``HEARTBEAT_S`` seconds while it is quiet; its last stdout line is the JSON row."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_tail: list[str] = []

    def forward() -> None:
        for line in proc.stderr:
            line = line.rstrip()
            if line:
                err_tail[:] = (err_tail + [line])[-5:]
                progress(f"  {name}: {line}")

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    try:
        while True:
            try:
                out = proc.stdout.read() if proc.wait(timeout=HEARTBEAT_S) is not None else ""
                break
            except subprocess.TimeoutExpired:
                elapsed = time.perf_counter() - t0
                if elapsed > timeout:
                    proc.kill()
                    proc.wait()
                    return {"backend": name, "error": f"timed out after {elapsed:.0f} s"}
                progress(f"  {name}: still running ({elapsed:.0f} s)")
    finally:
        reader.join(timeout=5)
    line = (out.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and line.startswith("{"):
        row = json.loads(line)
        if "time_s" in row:
            progress(f"  {name}: done in {row['time_s']:.1f} s")
        return row
    return {"backend": name, "error": (err_tail or ["failed"])[-1]}


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
