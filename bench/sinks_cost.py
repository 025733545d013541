"""What attention sinks cost (``sinks=``, contract §10): the same call with and without them,
alternating call by call in one process (load from other processes hits both alike), the median
of the repeats; bench/RESULTS.md, "Attention sinks".

    OMP_WAIT_POLICY=PASSIVE python bench/sinks_cost.py  # numba on the CPU
    NUMBA_NUM_THREADS=1 python bench/sinks_cost.py --single  # CPU time, one thread each
    python bench/sinks_cost.py --backend opencl --gpu   # a GPU: float16, larger shapes

Cases: prefill (``attention``, causal and not) and decode (``attention_with_kvcache``, one query
token per sequence over a cache of L tokens, the repeat-call path). Ratio = time with sinks / time
without (<= 1.03 is the target). Device backends get device-resident q, k, v and are synchronised
per call (their queue finished). "max diff": the call with sinks against the call without them
merged on the host with the state (0, sink), the contract's equivalent form. The anchor, in the same
rotation: PyTorch's
``scaled_dot_product_attention`` on the same values without sinks (it has none), on the GPU with
``--gpu`` when torch sees CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time

import numpy as np

#: (B, H, Hkv, S, D, causal) prefill; (B, Hq, Hkv, L, D) decode
CPU = {"prefill": [(1, 8, 8, 2048, 64, False), (1, 8, 8, 2048, 64, True),
                   (1, 8, 8, 4096, 64, True)],
       "decode": [(1, 32, 8, 8192, 128), (8, 32, 8, 8192, 128)]}
GPU = {"prefill": [(4, 32, 8, 4096, 128, False), (4, 32, 8, 4096, 128, True),
                   (1, 32, 8, 16384, 128, True)],
       "decode": [(8, 32, 8, 8192, 128), (32, 32, 8, 8192, 128)]}


CLOCK = time.perf_counter  # --single: time.process_time (CPU time: steady on a loaded machine)


def _timed(fns, reps: int, sync) -> list[float]:
    """Median seconds of each of ``fns``, called in turn ``reps`` times after a warm call; the
    first two (without and with sinks) swap places every other round, so that each follows the
    anchor's call (whose OpenMP threads may still spin) equally often."""
    for f in fns:
        sync(f())
    times: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        order = [1, 0] + list(range(2, len(fns))) if i % 2 else list(range(len(fns)))
        for j in order:
            t0 = CLOCK()
            sync(fns[j]())
            times[j].append(CLOCK() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--gpu", action="store_true", help="GPU shapes, float16")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--single", action="store_true",
                    help="CPU time of one thread each (run with NUMBA_NUM_THREADS=1)")
    args = ap.parse_args()
    try:  # before the numba backend loads MKL (see bench/numba_vs_torch.py)
        import torch
    except ImportError:
        torch = None
    if args.single:
        global CLOCK
        CLOCK = time.process_time
        if torch is not None:
            torch.set_num_threads(1)
    import attnlib
    from attnlib._bench.runners import _sync_any

    be = attnlib.get_backend(args.backend)
    shapes = GPU if args.gpu else CPU
    dtype = np.float16 if args.gpu else np.float32
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    print(f"{datetime.date.today()} backend {args.backend} ({be.info().get('device', '')}), "
          f"{np.dtype(dtype).name}, median of {args.reps} alternating calls"
          + (", CPU time of one thread" if args.single else ""))
    torch_fn = _torch_maker(args.gpu)
    print("| case | without sinks ms | with sinks ms | ratio | PyTorch SDPA ms | max diff |")
    print("|---|---|---|---|---|---|")
    for b, h, hkv, s, d, causal in shapes["prefill"]:
        host = [rand(b, s, n, d) for n in (h, hkv, hkv)]
        q, k, v = (be.to_device(x) for x in host)
        sinks = rng.standard_normal(h).astype(np.float32)
        fns = [functools.partial(attnlib.attention, q, k, v, causal=causal, sinks=sk,
                                 backend=be) for sk in (None, sinks)]
        ts = _timed(fns + torch_fn(*host, causal), args.reps, _sync_any)
        name = f"prefill B={b} Hq={h} Hkv={hkv} S={s} D={d}{' causal' if causal else ''}"
        _row(name, ts, _check(attnlib, fns[0], fns[1], sinks))
    for b, h, hkv, length, d in shapes["decode"]:
        cache = attnlib.KVCache(b, length, hkv, d, dtype=dtype, backend=be)
        kh, vh, qh = rand(b, length, hkv, d), rand(b, length, hkv, d), rand(b, 1, h, d)
        cache.update(kh, vh, 0)
        q = be.to_device(qh)
        sinks = rng.standard_normal(h).astype(np.float32)
        fns = [functools.partial(attnlib.attention_with_kvcache, q, cache, sinks=sk)
               for sk in (None, sinks)]
        ts = _timed(fns + torch_fn(qh, kh, vh, False), args.reps, _sync_any)
        _row(f"decode B={b} Hq={h} Hkv={hkv} L={length} D={d}", ts,
             _check(attnlib, fns[0], fns[1], sinks))


def _check(attnlib, plain, with_sinks, sinks: np.ndarray) -> float:
    """Max |out with sinks - the contract's form|: the call without sinks, its state merged on
    the host with (0, sink) (``out * exp(lse - log(exp(lse) + exp(sink)))``), in float64."""
    out, lse = (attnlib.to_numpy(x).astype(np.float64)
                for x in plain.func(*plain.args, **plain.keywords, return_lse=True))
    got = attnlib.to_numpy(with_sinks()).astype(np.float64)
    sk = sinks.astype(np.float64)[None, :, None]
    w = np.exp(lse - np.logaddexp(lse, sk))  # (B, Hq, Sq)
    return float(np.abs(got - out * w.transpose(0, 2, 1)[..., None]).max())


def _row(name: str, ts: list[float], err: float) -> None:
    anchor = f"{ts[2] * 1e3:.3f}" if len(ts) > 2 else "-"
    print(f"| {name} | {ts[0] * 1e3:.3f} | {ts[1] * 1e3:.3f} | {ts[1] / ts[0]:.3f} | {anchor} "
          f"| {err:.1e} |")


def _torch_maker(gpu: bool):
    """``make(q, k, v, causal)``: [PyTorch SDPA on those values (bshd numpy in, GQA by
    ``enable_gqa``), synchronised on CUDA], or [] without torch (or without CUDA for --gpu)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return lambda *a: []
    if gpu and not torch.cuda.is_available():
        return lambda *a: []
    dev = "cuda" if gpu else "cpu"

    def make(q, k, v, causal):
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).to(dev)
                      for x in (q, k, v))

        def fn():
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
            if gpu:
                torch.cuda.synchronize()
            return out

        return [fn]

    return make


if __name__ == "__main__":
    main()
