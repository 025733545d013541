"""numba backend vs PyTorch SDPA on the CPU (bench/RESULTS.md, "CPU: numba against PyTorch").

    python bench/numba_vs_torch.py                 # prefill + decode + compile times
    python bench/numba_vs_torch.py --big           # also S=16384, 32 heads, D=128 (memory run)
    python bench/numba_vs_torch.py --quick         # prefill only, fewer repeats (tuning)
    python bench/numba_vs_torch.py --single        # also: one thread each, CPU time (load-proof)
    python bench/numba_vs_torch.py --single --prefill-only   # the two prefill tables only
    python bench/numba_vs_torch.py --opencl --reps 3  # the prefill cases on opencl (PoCL) too
    POCL_MAX_PTHREAD_COUNT=1 python bench/numba_vs_torch.py --opencl --single  # one thread each
    python bench/numba_vs_torch.py --prefill-only --isolated  # neither timed in the other's wake
    python bench/numba_vs_torch.py --prefill-only --layout bhsd  # numba reads torch's memory

Same process, same data: numba gets the bshd arrays attnlib takes, torch the same values as
contiguous (B, H, S, D) tensors. Each case alternates the two (numba, torch, numba, ...) so load
from other processes hits both alike; the median of the repeats is reported. Back to back, a call
right after PyTorch's shares the cores with PyTorch's OpenMP threads, which spin for a while
after each call; ``--steady`` times each call after an untimed call of the same library (the
steady state of a program that calls one of them repeatedly), for both alike; ``--isolated``
also pauses 30 ms before that untimed call, so PyTorch's workers have stopped spinning.
Speed ratio = torch time / numba time (> 1: numba faster). FLOPs = 4 * B * H * D * visible pairs.
``--layout bhsd`` gives numba the very (B, H, S, D) arrays torch gets (``layout="bhsd"``, read in
place); the default gives it the same values in attnlib's default (B, S, H, D) order, where the
rows of one head are H * D elements apart (the kernel runs ~7-12% slower on them here).

In the default mode numba is timed right after PyTorch, whose libgomp worker keeps one of this
machine's two cores busy for ~8 ms after every call; calls shorter than that (S=512) then run
beside it. A program that mixes PyTorch CPU ops with attnlib does the same; its remedy is
libgomp's own setting, made before torch is imported: ``OMP_WAIT_POLICY=PASSIVE`` (or a small
``GOMP_SPINCOUNT``). The header line prints these variables, since they change the result.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

PREFILL = [(1, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 4096, 64), (1, 8, 2048, 128)]
DECODE = [(1, 32, 8, L, 128) for L in (4096, 8192, 16384, 32768)]  # B, Hq, Hkv, L, D


def _pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


CLOCK = time.perf_counter  # --single switches to time.process_time (CPU time, one thread)


STEADY = False  # --steady: an untimed call of the same library before each timed one
# --isolated: as --steady, plus a pause before that untimed call, longer than PyTorch's OpenMP
# workers spin after a call (~8 ms here), so neither library shares the cores with the other's
# leftover threads (the untimed call absorbs part of the after-idle cost)
GAP_S = 0.0
LAYOUT = "bshd"  # --layout: the memory order numba's inputs come in


def _time_pair(f_a, f_b, reps: int) -> tuple[float, float]:
    f_a(), f_b()  # warm (compile, caches)
    ta, tb = [], []
    for _ in range(reps):
        if GAP_S:
            time.sleep(GAP_S)
        if STEADY:
            f_a()
        t0 = CLOCK()
        f_a()
        ta.append(CLOCK() - t0)
        if GAP_S:
            time.sleep(GAP_S)
        if STEADY:
            f_b()
        t0 = CLOCK()
        f_b()
        tb.append(CLOCK() - t0)
    return statistics.median(ta), statistics.median(tb)


def prefill(reps: int) -> list[float]:
    import torch
    import torch.nn.functional as F

    import attnlib

    ratios = []
    print("| B,H,S,D | causal | numba ms | numba GFLOP/s | torch ms | torch GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for b, h, s, d in PREFILL:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3))
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
        nb_in = (q, k, v) if LAYOUT == "bshd" else tuple(t.numpy() for t in (tq, tk, tv))
        for causal in (False, True):
            run_nb = functools.partial(attnlib.attention, *nb_in, causal=causal, layout=LAYOUT,
                                       backend="numba")
            run_t = functools.partial(F.scaled_dot_product_attention, tq, tk, tv,
                                      is_causal=causal)

            ref = run_t() if LAYOUT == "bhsd" else run_t().transpose(1, 2)
            err = np.abs(run_nb() - ref.numpy()).max()
            t_nb, t_t = _time_pair(run_nb, run_t, reps)
            fl = 4 * b * h * d * _pairs(s, causal)
            ratios.append(t_t / t_nb)
            print(f"| {b},{h},{s},{d} | {'yes' if causal else 'no'} | {t_nb * 1e3:.1f} | "
                  f"{fl / t_nb / 1e9:.0f} | {t_t * 1e3:.1f} | {fl / t_t / 1e9:.0f} | "
                  f"{t_t / t_nb:.2f} |" + (f" max diff {err:.1e}" if err > 1e-4 else ""))
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\ngeometric-mean speed ratio numba/torch: {gm:.2f} (min {min(ratios):.2f})\n")
    return ratios


def prefill_opencl(reps: int) -> None:
    """The same prefill cases on the opencl backend (PoCL on a CPU-only machine), device-resident
    pyopencl arrays, each call with ``finish()``, beside numba and torch timed in the same round
    (issue: "the same benchmark as the numba backend, reported beside it")."""
    import torch
    import torch.nn.functional as F

    import attnlib

    be = attnlib.get_backend("opencl")
    print(f"opencl device: {be.info()['device']} ({be.info()['platform']})\n")
    print("| B,H,S,D | causal | opencl ms | opencl GFLOP/s | numba ms | torch ms | "
          "opencl/numba | opencl/torch |")
    print("|---|---|---|---|---|---|---|---|")
    for b, h, s, d in PREFILL:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3))
        dq, dk, dv = (attnlib.to_device(x, backend=be) for x in (q, k, v))
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
        for causal in (False, True):
            def run_cl(c=causal, x=(dq, dk, dv)):
                attnlib.attention(*x, causal=c, backend=be)
                be.queue.finish()

            run_nb = functools.partial(attnlib.attention, q, k, v, causal=causal, backend="numba")
            run_t = functools.partial(F.scaled_dot_product_attention, tq, tk, tv,
                                      is_causal=causal)
            t_cl, t_nb = _time_pair(run_cl, run_nb, reps)
            _, t_t = _time_pair(run_cl, run_t, reps)
            fl = 4 * b * h * d * _pairs(s, causal)
            print(f"| {b},{h},{s},{d} | {'yes' if causal else 'no'} | {t_cl * 1e3:.1f} | "
                  f"{fl / t_cl / 1e9:.1f} | {t_nb * 1e3:.1f} | {t_t * 1e3:.1f} | "
                  f"{t_nb / t_cl:.3f} | {t_t / t_cl:.3f} |")


def decode(reps: int) -> None:
    import torch
    import torch.nn.functional as F

    import attnlib

    print("| B,Hq,Hkv,L,D | numba ms | numba GB/s | torch ms | torch GB/s | ratio |")
    print("|---|---|---|---|---|---|")
    for b, hq, hkv, L, d in DECODE:
        rng = np.random.default_rng(1)
        k, v = (rng.standard_normal((b, L, hkv, d), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32)
        cache = attnlib.KVCache(b, L, hkv, d, dtype="float32", backend="numba")
        cache.update(k, v, 0)
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))

        run_nb = functools.partial(attnlib.attention_with_kvcache, q, cache, backend="numba")
        run_t = functools.partial(F.scaled_dot_product_attention, tq, tk, tv, enable_gqa=True)

        t_nb, t_t = _time_pair(run_nb, run_t, reps)
        nbytes = 2 * b * L * hkv * d * 4
        print(f"| {b},{hq},{hkv},{L},{d} | {t_nb * 1e3:.2f} | {nbytes / t_nb / 1e9:.1f} | "
              f"{t_t * 1e3:.2f} | {nbytes / t_t / 1e9:.1f} | {t_t / t_nb:.2f} |")
    print()


_COMPILE_SNIPPET = """
import time, numpy as np
t0 = time.perf_counter()
import attnlib
q = np.random.default_rng(0).standard_normal((1, 64, 2, 32), dtype=np.float32)
attnlib.attention(q, q, q, causal=True, backend="numba")
t1 = time.perf_counter()
attnlib.attention(q.astype(np.float64), q.astype(np.float64), q.astype(np.float64),
                  backend="numba")
print(f"{t1 - t0:.2f} {time.perf_counter() - t1:.2f}")
"""


def compile_times() -> None:
    """First call in a fresh process, with an empty numba cache and then with a warm one."""
    import tempfile

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("cold cache", "warm cache"):
            env = dict(os.environ, NUMBA_CACHE_DIR=tmp)
            out = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET], env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            res[label] = out
    for label, (f32, f64) in res.items():
        print(f"first call, {label}: import + float32 causal {f32} s, then float64 {f64} s")
    print()


_BIG_SNIPPET = """
import resource, time, numpy as np
import attnlib
S, H, D = 16384, 32, 128
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, S, H, D), dtype=np.float32) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
attnlib.attention(q[:, :256], k[:, :256], v[:, :256], backend="numba")  # compile/load, small
t0 = time.perf_counter()
out = attnlib.attention(q, k, v, causal={causal}, backend="numba")
t = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(t, base, peak, q.nbytes * 4, bool(np.isfinite(out).all()))
"""


_BIG_TORCH_SNIPPET = """
import resource, time, numpy as np, torch
S, H, D = 16384, 32, 128
rng = np.random.default_rng(0)
q, k, v = (torch.from_numpy(rng.standard_normal((1, H, S, D), dtype=np.float32))
           for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.nn.functional.scaled_dot_product_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256])
t0 = time.perf_counter()
out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal={causal})
t = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(t, base, peak)
"""


def big_torch(causal: bool) -> None:
    out = subprocess.run([sys.executable, "-c", _BIG_TORCH_SNIPPET.format(causal=causal)],
                         capture_output=True, text=True, check=True).stdout.split()
    t, base, peak = float(out[0]), int(out[1]) * 1024, int(out[2]) * 1024
    fl = 4 * 32 * 128 * _pairs(16384, causal)
    print(f"torch SDPA, same shape: {t:.1f} s ({fl / t / 1e9:.0f} GFLOP/s); process peak RSS "
          f"{peak / 2**30:.2f} GiB ({base / 2**30:.2f} GiB before the call)")


def big(causal: bool) -> None:
    out = subprocess.run([sys.executable, "-c", _BIG_SNIPPET.format(causal=causal)],
                         capture_output=True, text=True, check=True).stdout.split()
    t, base, peak = float(out[0]), int(out[1]) * 1024, int(out[2]) * 1024
    qkvo = int(out[3])
    fl = 4 * 32 * 128 * _pairs(16384, causal)
    print(f"S=16384, H=32, D=128 float32, causal={causal}: {t:.1f} s ({fl / t / 1e9:.0f} GFLOP/s); "
          f"q+k+v+out = {qkvo / 2**30:.2f} GiB; process peak RSS {peak / 2**30:.2f} GiB "
          f"(before the call, inputs made: {base / 2**30:.2f} GiB; the call added "
          f"{(peak - base) / 2**30:.2f} GiB); naive scores would be "
          f"{16384 * 16384 * 32 * 4 / 1e9:.0f} GB; finite: {out[4]}")


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time runs")
    ap.add_argument("--prefill-only", action="store_true", help="skip decode and compile times")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--opencl", action="store_true",
                    help="only the prefill cases on the opencl backend (PoCL on a CPU) beside "
                         "numba and torch")
    ap.add_argument("--steady", action="store_true",
                    help="time each call after an untimed call of the same library, so that "
                         "neither is timed while the other's worker threads still spin "
                         "(PyTorch's OpenMP pool does after each call) or while warming up")
    ap.add_argument("--isolated", action="store_true",
                    help="as --steady, with a 30 ms pause before each untimed call, so that "
                         "PyTorch's spinning OpenMP workers have stopped before numba's calls")
    ap.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd",
                    help="numba's input order: bshd (default; the same values, attnlib's order) "
                         "or bhsd (the same arrays torch gets, read in place)")
    args = ap.parse_args()
    global STEADY, GAP_S, LAYOUT
    LAYOUT = args.layout
    STEADY = args.steady or args.isolated
    GAP_S = 0.03 if args.isolated else 0.0
    import numba
    import torch

    cpu = platform.processor() or "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except Exception:
        pass
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu}, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at start; "
          f"numba {numba.__version__} ({numba.get_num_threads()} threads); torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); "
          + ", ".join(f"{k}={os.environ.get(k, 'unset')}"
                      for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"))
          + f"; numba layout {LAYOUT}\n")
    reps = 3 if args.quick else args.reps
    if args.opencl:
        if args.single:  # PoCL's own threads: POCL_MAX_PTHREAD_COUNT=1 in the environment
            CLOCK = time.process_time
            numba.set_num_threads(1)
            torch.set_num_threads(1)
            print("one thread each, CPU time (time.process_time)\n")
        prefill_opencl(reps)
        return
    prefill(reps)
    if not (args.quick or args.prefill_only):
        decode(reps * 3)
        if not args.no_compile:
            compile_times()
    if args.single:
        # other processes on a shared machine delay one of two threads; one thread each,
        # timed in CPU time, compares the kernels themselves
        CLOCK = time.process_time
        numba.set_num_threads(1)
        torch.set_num_threads(1)
        print("one thread each, CPU time (time.process_time):\n")
        prefill(reps)
        numba.set_num_threads(os.cpu_count() or 1)
        torch.set_num_threads(os.cpu_count() or 1)
    if args.big:
        big(False)
        big_torch(False)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"load average {os.getloadavg()[0]:.2f} at the end; max RSS of this process "
          f"{rss:.2f} GiB")


if __name__ == "__main__":
    main()
