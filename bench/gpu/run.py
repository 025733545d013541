"""The GPU benchmark: the opencl backend beside PyTorch SDPA on the same GPU, same data, one run.

    python bench/gpu/run.py                       # every table, markdown on stdout
    python bench/gpu/run.py --json out.json       # also every row as JSON
    python bench/gpu/run.py --only prefill16 --only decode --reps 20
    python bench/gpu/run.py --no-torch            # attnlib only (no PyTorch with CUDA here)

Needs an OpenCL GPU (the ``opencl`` backend's default device) and, for the anchors, PyTorch with
CUDA on the same GPU. It prints the tables of ``bench/RESULTS.md``:

* **prefill** (``prefill32``, ``prefill16``, ``prefillbf16``; ``prefill16p`` = float16 on the
  portable kernel, ``use_mma=False``): TFLOP/s (4·B·H·S²·D, halved for causal) per
  (dtype, B, H, S, D, causal) through ``attnlib.attention`` on device arrays, beside PyTorch
  SDPA's flash, efficient and cuDNN backends. "per call": median of ``--reps`` calls, each
  followed by a synchronisation (OpenCL: ``queue.finish()``; torch: CUDA events), so attnlib's
  Python front door is inside the figure. "pipelined": ``--reps`` calls back to back and one
  synchronisation, the throughput of a caller that does not wait on each result.
* **shapes** (``shapes``): float16, B=1, 16 heads, S=4096, per call, on head dims off 64/128
  (D != Dv for MLA's 192/128, unaligned D=59) and with bool / additive (B, 1, S, S) masks
  (host arrays, so the figure holds their upload), TFLOP/s (2·B·H·S²·(D+Dv), halved for causal)
  beside the same PyTorch backends; each output is checked against PyTorch's float32 math
  backend on the same inputs first (max abs error in the table).
* **decode** (``decode``): one float16 query token, 32 query / 8 kv heads, D=128, over a KV cache
  of B sequences × L tokens through ``attention_with_kvcache``: µs per call and pipelined, and
  the cache read rate (K and V read once), beside the same PyTorch backends.
* **paged** (``paged``): the same decode step over a page pool (``paged_attention``, a device
  block table), page sizes 1, 8, 16 and 32 with every sequence's pages scattered (a shuffled free
  list), beside the contiguous cache (``KVCache``) and PyTorch SDPA on the contiguous tensors of
  the same run, at B=8 L=8192, B=32 L=4096, B=1 L=131072; each paged result is checked against
  the contiguous cache's (max |diff|) and sequence 0 against the float64 reference.
* **paged prefill** (``pagedprefill``): a causal float16 prefill of S tokens over their own
  pages (``paged_attention``, device arrays, a device block table, scattered pages of 1, 16 and
  128 tokens), B=1, 16 heads, S=4096, D=64 and 128, TFLOP/s per call beside the same call on
  contiguous k and v (``attention``) and PyTorch SDPA's flash, efficient and cuDNN backends on
  the same tensors; each paged output is checked against the contiguous one (max |diff|).
  ``--quick`` (S/16) runs it on a CPU OpenCL device.
* **forks** (``forks``): 32 forks of an 8192-token prompt with 256 tokens of their own each
  (a ``PagedKVCache``, page 16, float16, device queries), one decode step for all 32 through the
  shared-prompt cascade (checked to take the 32 forks; one row per prefix chunk size of
  ``FORKS_KEYS``, the default marked; "host": the call alone, returning before its kernels
  finish), beside the same step with the cascade off and over 32 unshared contiguous caches of
  8448 tokens (the per-sequence decode, the speed-up's base);
  "equivalent TB/s" counts every sequence's tokens as if read separately. ``--quick`` (4 forks of
  512 + 16 tokens) runs it on a CPU OpenCL device.
* **portable** (``portable``): the portable kernel (``use_mma=False``) against the device's
  limits, measured in the same run: float32 and float16 prefill (B=4 H=16 S=2048, D 64/128,
  causal or not) in TFLOP/s beside PyTorch SDPA; float16 decode (B=8 L=8192, B=1 L=131072,
  32 q / 8 kv heads, D=128) in TB/s; softmax, logsumexp and merge_states in GB/s; each stream
  as a fraction of the device's copy rate (``enqueue_copy`` buffer to buffer, read + write
  bytes). ``--quick`` shrinks every shape (S/8, L/16, ...) so the table also runs on a CPU
  OpenCL device (PoCL) as a check of the script.
* **quant** (``quant``): the decode step of ``decode`` over a float16 ``KVCache`` and over the
  same cache stored as int8, fp8 e4m3fn and fp8 e5m2 (``kv_dtype``; half the bytes), B=8
  L=8192 and B=1 L=131072: µs per call and pipelined, the ratio to the float16 cache
  (pipelined) and the cache read rate, and the max |error| of sequence 0 against the float64
  reference on ``cache.dequantized()``. ``--quick`` (L/16) runs it on a CPU OpenCL device.
* **host** (``host``): what a repeated call costs the host (``bench/gpu/hostcost.py``: the call
  with its kernel launches stubbed, the real enqueue, back to back), and what a repeated call
  does on the queue (kernel enqueues, table fills, host-to-device copies).
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
PAGED = [(8, 8192), (32, 4096), (1, 131072)]
PAGE_SIZES = (1, 8, 16, 32)
#: (B, H, S, D) of the paged prefill table; its page sizes
PAGED_PREFILL = [(1, 16, 4096, 64), (1, 16, 4096, 128)]
PREFILL_PAGES = (1, 16, 128)
FORKS = (32, 8192, 256)  # forks, prompt tokens, own tokens each
FORKS_QUICK = (4, 512, 16)
#: the cascade's prefix chunk sizes (keys) the forks table sweeps (_nvidia_decode.PARTS_KEYS)
FORKS_KEYS = (512, 1024, 2048, 8192)
QUANT = [(8, 8192), (1, 131072)]  # (batch, cache length) of the quantized-cache decode
QUANT_FORMATS = (None, "int8", "float8_e4m3fn", "float8_e5m2")  # None: the float16 cache
#: (D, Dv, causal, mask): the head-dim and mask table, B=1, H=16, S=4096, float16
SHAPES = [(64, 64, True, None), (128, 128, True, None), (80, 80, True, None),
          (96, 96, True, None), (192, 128, True, None), (256, 256, True, None),
          (59, 59, True, None), (32, 32, True, None), (48, 48, True, None),
          (111, 111, True, None), (160, 160, True, None), (224, 224, True, None),
          (128, 128, False, "bool"), (128, 128, False, "additive")]


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


def _torch_times(q, k, v, causal: bool, reps: int, mask=None) -> dict:
    """SDPA per backend on (B, H, S, D) CUDA tensors (``mask``: SDPA's attn_mask); missing
    backends are left out."""
    import functools

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    if mask is not None:
        f = functools.partial(f, attn_mask=mask)
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

    np_dtype = {"float32": np.float32, "float16": np.float16,
                "bfloat16": ml_dtypes.bfloat16}[dtype]
    if with_torch:
        import torch

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


def shapes(reps: int, with_torch: bool, rows: list, cases: list = SHAPES) -> None:
    """The ``shapes`` table (see the module docstring); ``cases`` rows of :data:`SHAPES`."""
    import torch

    b, h, s = 1, 16, 4096
    for d, dv, causal, mask_kind in cases:
        rng = np.random.default_rng(2)
        host = [rng.standard_normal((b, s, h, n), dtype=np.float32).astype(np.float16)
                for n in (d, d, dv)]
        mask = None
        if mask_kind is not None:
            keep = rng.random((b, 1, s, s)) < 0.8
            mask = keep if mask_kind == "bool" else np.where(
                keep, rng.standard_normal((b, 1, s, s), dtype=np.float32), -np.inf
            ).astype(np.float16)
        dev = [attnlib.to_device(x, backend="opencl") for x in host]
        flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)

        def run(x=dev, c=causal, m=mask):
            return attnlib.attention(*x, causal=c, mask=m, backend="opencl")

        out = run()
        sync = out.queue.finish
        row = {"kind": "shapes", "dtype": "float16", "shape": [b, h, s, d, dv],
               "causal": causal, "mask": mask_kind}
        if with_torch:
            tq = [torch.from_numpy(x.astype(np.float32)).to("cuda").transpose(1, 2)
                  for x in host]
            tm = None if mask is None else torch.from_numpy(
                mask if mask_kind == "bool" else mask.astype(np.float32)).to("cuda")
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.MATH]):
                want = torch.nn.functional.scaled_dot_product_attention(
                    *tq, attn_mask=tm, is_causal=causal).transpose(1, 2)
            got = torch.from_numpy(out.get().astype(np.float32)).to("cuda")
            row["max_abs_err"] = float((got - want).abs().max())
            del want, got
        row["opencl_s"] = _median_time(run, sync, warm=1, reps=reps)
        row["opencl_tflops"] = flops / row["opencl_s"] / 1e12
        if with_torch:
            tq = [x.to(torch.float16).contiguous() for x in tq]
            if tm is not None:
                tm = tm.to(torch.float16) if mask_kind == "additive" else tm
            for name, tt in _torch_times(*tq, causal, reps, mask=tm).items():
                if not name.endswith("_pipe"):
                    row[f"torch_{name}_tflops"] = (flops / tt / 1e12 if isinstance(tt, float)
                                                   else tt)
            del tq, tm
            torch.cuda.empty_cache()
        rows.append(row)
        print(shapes_table([row]).splitlines()[-1], flush=True)


def decode(reps: int, with_torch: bool, rows: list) -> None:
    if with_torch:
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
               "opencl_pipe_us": tp * 1e6, "opencl_pipe_TBps": nbytes / tp / 1e12}
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


def quant(reps: int, rows: list, quick: bool = False) -> None:
    hq, hkv, d = 32, 8, 128
    for b, n in QUANT:
        n = n // 16 if quick else n
        rng = np.random.default_rng(1)
        k, v = _contiguous_kv(rng, b, n, hkv, d)
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
        for fmt in QUANT_FORMATS:
            cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", kv_dtype=fmt,
                                    backend="opencl")
            step = min(n, 8192)
            for p in range(0, n, step):
                cache.update(k[:, p:p + step], v[:, p:p + step], p)
            qd = attnlib.to_device(q, backend="opencl")
            out = attnlib.attention_with_kvcache(qd, cache)

            def step_once(x=qd, c=cache):
                return attnlib.attention_with_kvcache(x, c)

            t = _median_time(step_once, out.queue.finish, warm=3, reps=max(reps, 20))
            tp = _pipelined_time(step_once, out.queue.finish, max(reps, 20))
            k0, v0 = cache.dequantized([0])
            ref = attnlib.attention(q[:1].astype(np.float64), k0, v0,
                                    backend="numpy")
            err = float(np.max(np.abs(out.get()[:1].astype(np.float64) - ref)))
            nbytes = 2 * b * n * hkv * d * (1 if fmt else 2) + (2 * b * n * hkv * 4 if fmt else 0)
            rows.append({"kind": "quant", "kv_dtype": fmt or "float16", "batch": b,
                         "cache_len": n, "opencl_us": t * 1e6, "opencl_pipe_us": tp * 1e6,
                         "opencl_pipe_TBps": nbytes / tp / 1e12, "max_err": err})
            del cache, out


def quant_table(rows: list) -> str:
    lines = ["| B | L | cache | µs per call | µs pipelined | × float16 (pipelined) | TB/s "
             "(pipelined) | max err vs float64 |", "|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if r["kind"] != "quant":
            continue
        key = (r["batch"], r["cache_len"])
        if r["kv_dtype"] == "float16":
            base[key] = r["opencl_pipe_us"]
        ratio = r["opencl_pipe_us"] / base[key] if key in base else float("nan")
        lines.append(f"| {r['batch']} | {r['cache_len']} | {r['kv_dtype']} | "
                     f"{_fmt(r['opencl_us'])} | {_fmt(r['opencl_pipe_us'])} | {ratio:.2f} | "
                     f"{r['opencl_pipe_TBps']:.2f} | {r['max_err']:.1e} |")
    return "\n".join(lines)


def _contiguous_kv(rng, b: int, n: int, hkv: int, d: int) -> tuple:
    """Host float16 k, v (b, n, hkv, d), tiled from one block of at most 8192 random tokens."""
    blk = min(n, 8192)
    out = []
    for _ in range(2):
        x = rng.standard_normal((b, blk, hkv, d), dtype=np.float32).astype(np.float16)
        out.append(np.ascontiguousarray(np.tile(x, (1, n // blk, 1, 1))))
    return out[0], out[1]


def _torch_decode(row: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray, reps: int) -> None:
    import torch

    tq = torch.from_numpy(q).to("cuda").transpose(1, 2).contiguous()
    tk = torch.from_numpy(k).to("cuda").transpose(1, 2).contiguous()
    tv = torch.from_numpy(v).to("cuda").transpose(1, 2).contiguous()
    for name, tt in _torch_times(tq, tk, tv, False, reps).items():
        row[f"torch_{name}_us"] = tt * 1e6 if isinstance(tt, float) else tt
    del tq, tk, tv
    torch.cuda.empty_cache()


def paged(reps: int, with_torch: bool, rows: list) -> None:
    """Paged decode (page sizes PAGE_SIZES, scattered pages) beside the contiguous cache and
    PyTorch on the same tokens."""
    from attnlib.testing.reference import reference_attention

    hq, hkv, d = 32, 8, 128
    reps = max(reps, 20)
    for b, n in PAGED:
        rng = np.random.default_rng(2)
        k, v = _contiguous_kv(rng, b, n, hkv, d)
        q = rng.standard_normal((b, 1, hq, d), dtype=np.float32).astype(np.float16)
        qd = attnlib.to_device(q, backend="opencl")
        nbytes = 2 * b * n * hkv * d * 2
        ref, _ = reference_attention(q[:1].astype(np.float64), k[:1].astype(np.float64),
                                     v[:1].astype(np.float64))
        cache = attnlib.KVCache(b, n, hkv, d, dtype="float16", backend="opencl")
        cache.update(attnlib.to_device(k, backend="opencl"),
                     attnlib.to_device(v, backend="opencl"), 0)
        base = attnlib.attention_with_kvcache(qd, cache)
        sync = base.queue.finish
        base = base.get()

        def contiguous(x=qd, c=cache):
            return attnlib.attention_with_kvcache(x, c)

        t = _median_time(contiguous, sync, warm=3, reps=reps)
        tp = _pipelined_time(contiguous, sync, reps)
        row = {"kind": "paged", "batch": b, "cache_len": n, "page": 0, "opencl_us": t * 1e6,
               "opencl_pipe_us": tp * 1e6, "opencl_TBps": nbytes / t / 1e12,
               "opencl_pipe_TBps": nbytes / tp / 1e12,
               "err_ref": float(np.abs(base[:1].astype(np.float64) - ref).max())}
        if with_torch:
            _torch_decode(row, q, k, v, reps)
        rows.append(row)
        del cache
        seq_lens = np.full(b, n, np.int32)
        for page in PAGE_SIZES:
            per = n // page
            perm = rng.permutation(b * per)  # scattered: logical page j of all -> pool page
            kp = np.empty((b * per, page, hkv, d), np.float16)
            vp = np.empty_like(kp)
            kp[perm] = k.reshape(b * per, page, hkv, d)
            vp[perm] = v.reshape(b * per, page, hkv, d)
            kpd, vpd = (attnlib.to_device(x, backend="opencl") for x in (kp, vp))
            table = attnlib.to_device(perm.reshape(b, per).astype(np.int32), backend="opencl")
            del kp, vp

            def step(x=qd, kk=kpd, vv=vpd, tb=table, sl=seq_lens):
                return attnlib.paged_attention(x, kk, vv, tb, sl)

            got = step().get()
            t = _median_time(step, sync, warm=3, reps=reps)
            tp = _pipelined_time(step, sync, reps)
            rows.append({"kind": "paged", "batch": b, "cache_len": n, "page": page,
                         "opencl_us": t * 1e6, "opencl_pipe_us": tp * 1e6,
                         "opencl_TBps": nbytes / t / 1e12, "opencl_pipe_TBps": nbytes / tp / 1e12,
                         "diff_contiguous": float(np.abs(got.astype(np.float32)
                                                         - base.astype(np.float32)).max()),
                         "err_ref": float(np.abs(got[:1].astype(np.float64) - ref).max())})
            del kpd, vpd, table


def paged_prefill(reps: int, with_torch: bool, rows: list, quick: bool = False) -> None:
    """The ``pagedprefill`` table (see the module docstring)."""
    for b, h, s, d in PAGED_PREFILL:
        s = s // 16 if quick else s
        rng = np.random.default_rng(4)
        host = [rng.standard_normal((b, s, h, d), dtype=np.float32).astype(np.float16)
                for _ in range(3)]
        dev = [attnlib.to_device(x, backend="opencl") for x in host]
        flops = 4 * b * h * s * s * d / 2

        def contiguous(x=dev):
            return attnlib.attention(*x, causal=True, backend="opencl")

        base = contiguous()
        sync = base.queue.finish
        base = base.get().astype(np.float32)
        t = _median_time(contiguous, sync, warm=2, reps=reps)
        row = {"kind": "pagedprefill", "shape": [b, h, s, d], "page": 0,
               "opencl_tflops": flops / t / 1e12}
        if with_torch:
            import torch

            tq = [torch.from_numpy(x).to("cuda").transpose(1, 2).contiguous() for x in host]
            for name, tt in _torch_times(*tq, True, reps).items():
                if not name.endswith("_pipe"):
                    row[f"torch_{name}_tflops"] = (flops / tt / 1e12 if isinstance(tt, float)
                                                   else tt)
            del tq
            torch.cuda.empty_cache()
        rows.append(row)
        seq_lens = np.full(b, s, np.int32)
        for page in PREFILL_PAGES:
            per = -(-s // page)
            perm = rng.permutation(b * per)  # scattered: logical page j of all -> pool page
            pools = []
            for x in host[1:]:
                pad = np.zeros((b, per * page, h, d), np.float16)
                pad[:, :s] = x
                pool = np.empty((b * per, page, h, d), np.float16)
                pool[perm] = pad.reshape(b * per, page, h, d)
                pools.append(attnlib.to_device(pool, backend="opencl"))
            table = attnlib.to_device(perm.reshape(b, per).astype(np.int32), backend="opencl")

            def step(x=dev[0], kk=pools[0], vv=pools[1], tb=table, sl=seq_lens):
                return attnlib.paged_attention(x, kk, vv, tb, sl)

            got = step().get().astype(np.float32)
            t = _median_time(step, sync, warm=2, reps=reps)
            rows.append({"kind": "pagedprefill", "shape": [b, h, s, d], "page": page,
                         "opencl_tflops": flops / t / 1e12,
                         "diff_contiguous": float(np.abs(got - base).max())})
            del pools, table


def paged_prefill_table(rows: list) -> str:
    """Markdown: TFLOP/s per call of each page size and of the contiguous call, the ratio to it,
    PyTorch's backends on the contiguous tensors and the ratio to the fastest of flash /
    efficient and to cuDNN."""
    out = ["| B,H,S,D | page | attnlib | / contiguous | flash | efficient | cuDNN "
           "| / best flash, eff. | / cuDNN | max diff vs contiguous |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base: dict = {}
    for r in rows:
        if r["kind"] != "pagedprefill":
            continue
        key = tuple(r["shape"])
        if r["page"] == 0:
            base[key] = r
        b0 = base.get(key, {})
        a = r["opencl_tflops"]
        cells = [b0.get(f"torch_{n}_tflops") for n in ("flash", "efficient", "cudnn")]
        fe = [c for c in cells[:2] if isinstance(c, float)]
        best = f"{a / max(fe):.2f}" if fe else "-"
        cud = f"{a / cells[2]:.2f}" if isinstance(cells[2], float) else "-"
        vs = f"{a / b0['opencl_tflops']:.2f}" if b0 else "-"
        diff = r.get("diff_contiguous")
        out.append(f"| {','.join(map(str, key))} | {r['page'] or 'contiguous'} | {_fmt(a)} | "
                   f"{vs} | " + " | ".join(_fmt(c) if isinstance(c, float) else "n/a"
                                           for c in cells)
                   + f" | {best} | {cud} | {'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(out)


def forks(reps: int, rows: list, quick: bool = False) -> None:
    """32 forks of one prompt, one decode step for all of them (the cascade: the prompt's pages
    read once per chunk for every fork's rows, float32 partial states merged on the device), for
    each prefix chunk size of FORKS_KEYS, beside the same step with the cascade off (each
    sequence over its own pages) and over 32 unshared contiguous caches (the per-sequence
    decode). ``quick`` shrinks the shape (4 forks of 512 + 16 tokens, a smoke run on a CPU
    device). Each result is checked: the cascade's against the plain call's (max |diff|) and
    sequence 0 against the float64 reference."""
    from attnlib import _cascade
    from attnlib.backends.opencl import _nvidia_decode, _nvidia_mma
    from attnlib.testing.reference import reference_attention

    hq, hkv, d, page = 32, 8, 128, 16
    n_fork, prompt, own = FORKS_QUICK if quick else FORKS
    reps = max(reps, 20)
    rng = np.random.default_rng(3)
    dev = lambda x: attnlib.to_device(x, backend="opencl")  # noqa: E731
    rand = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(  # noqa: E731
        np.float16)
    n_pages = (prompt + n_fork * (own + page)) // page + 8
    cache = attnlib.PagedKVCache(n_pages, page, hkv, d, dtype="float16", backend="opencl")
    root = cache.new_sequence()
    kp, vp = rand(1, prompt, hkv, d), rand(1, prompt, hkv, d)
    cache.append([root], dev(kp), dev(vp))
    sids = [root] + [cache.fork(root) for _ in range(n_fork - 1)]
    ko, vo = rand(n_fork, own, hkv, d), rand(n_fork, own, hkv, d)
    cache.append(sids, dev(ko), dev(vo))
    q = rand(n_fork, 1, hq, d)
    qd = dev(q)

    def step(x=qd, c=cache, s=sids):
        return attnlib.attention_with_paged_kvcache(x, c, s)

    taken, real = [], _cascade.groups_of
    _cascade.groups_of = lambda call, n: taken.append(real(call, n)) or taken[-1]
    try:
        got = step().get()
    finally:
        _cascade.groups_of = real
    if not taken or [len(m) for m, _ in taken[-1]] != [n_fork]:
        raise RuntimeError(f"the cascade did not take the {n_fork} forks: {taken}")
    sync = cache.k_pages.queue.finish
    threshold = _cascade.MIN_PREFIX_TOKENS
    _cascade.MIN_PREFIX_TOKENS = None
    try:
        plain = step().get()
        t0, tp0 = _median_time(step, sync, 3, reps), _pipelined_time(step, sync, reps)
    finally:
        _cascade.MIN_PREFIX_TOKENS = threshold
    k0 = np.concatenate([kp[0], ko[0]])[None].astype(np.float64)
    v0 = np.concatenate([vp[0], vo[0]])[None].astype(np.float64)
    ref, _ = reference_attention(q[:1].astype(np.float64), k0, v0)
    n = prompt + own
    flat = attnlib.KVCache(n_fork, n, hkv, d, dtype="float16", backend="opencl")
    kf = dev(rand(n_fork, n, hkv, d))
    flat.update(kf, kf, 0)

    def per_seq(x=qd, c=flat):
        return attnlib.attention_with_kvcache(x, c)

    t1, tp1 = _median_time(per_seq, sync, 3, reps), _pipelined_time(per_seq, sync, reps)
    nbytes = 2 * n_fork * n * hkv * d * 2
    default_keys = _nvidia_decode.PARTS_KEYS
    nvidia = _nvidia_mma.compute_capability(cache.backend.device) is not None
    try:  # the chunk size is the tensor-core decode kernel's (elsewhere: the whole prefix)
        for keys in FORKS_KEYS if nvidia else (None,):
            _nvidia_decode.PARTS_KEYS = keys or default_keys
            got = step().get()
            t, tp = _median_time(step, sync, 3, reps), _pipelined_time(step, sync, reps)
            host = _median_time(step, lambda: None, 3, reps)  # the call alone, no wait
            sync()
            rows.append({"kind": "forks", "forks": n_fork, "prompt": prompt, "own": own,
                         "chunk_keys": keys, "default": keys == default_keys,
                         "opencl_us": t * 1e6, "opencl_pipe_us": tp * 1e6,
                         "host_us": host * 1e6,
                         "equiv_TBps": nbytes / tp / 1e12, "plain_us": t0 * 1e6,
                         "plain_pipe_us": tp0 * 1e6, "per_seq_us": t1 * 1e6,
                         "per_seq_pipe_us": tp1 * 1e6, "speedup": tp1 / tp,
                         "diff_plain": float(np.abs(got.astype(np.float32)
                                                    - plain.astype(np.float32)).max()),
                         "err_ref": float(np.abs(got[:1].astype(np.float64) - ref).max())})
    finally:
        _nvidia_decode.PARTS_KEYS = default_keys


def paged_table(rows: list) -> str:
    out = ["| B, tokens | page | attnlib µs | attnlib TB/s | / contiguous | flash µs | cuDNN µs "
           "| / cuDNN | max diff vs contiguous | max err vs float64 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if r["kind"] != "paged":
            continue
        key = (r["batch"], r["cache_len"])
        if r["page"] == 0:
            base[key] = r
        b0 = base.get(key, {})
        cells = []
        for name in ("flash", "cudnn"):
            per, pipe = b0.get(f"torch_{name}_us"), b0.get(f"torch_{name}_pipe_us")
            cells.append(f"{_fmt(per)} / {_fmt(pipe)}" if isinstance(per, float) else _fmt(per))
        cud = b0.get("torch_cudnn_pipe_us")
        vs_cudnn = f"{cud / r['opencl_pipe_us']:.2f}" if isinstance(cud, float) else "-"
        vs_cont = f"{b0['opencl_pipe_us'] / r['opencl_pipe_us']:.2f}" if b0 else "-"
        out.append(f"| {key[0]}, {key[1]} | {r['page'] or 'contiguous'} | "
                   f"{_fmt(r['opencl_us'])} / {_fmt(r['opencl_pipe_us'])} | "
                   f"{_fmt(r['opencl_TBps'], 2)} / {_fmt(r['opencl_pipe_TBps'], 2)} | {vs_cont} | "
                   + " | ".join(cells) + f" | {vs_cudnn} | "
                   f"{_fmt(r.get('diff_contiguous'), 4)} | {_fmt(r.get('err_ref'), 4)} |")
    return "\n".join(out)


def forks_table(rows: list) -> str:
    out = ["| forks × (prompt + own) | prefix chunk keys | cascade µs | cascade host µs "
           "| equivalent TB/s | cascade off µs | unshared caches µs "
           "| speed-up vs unshared (pipelined) | max diff vs cascade off | max err vs float64 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "forks":
            mark = " (default)" if r["default"] else ""
            keys = "whole prefix" if r["chunk_keys"] is None else f"{r['chunk_keys']}{mark}"
            out.append(f"| {r['forks']} × ({r['prompt']} + {r['own']}) | {keys} "
                       f"| {_fmt(r['opencl_us'])} / {_fmt(r['opencl_pipe_us'])} "
                       f"| {_fmt(r['host_us'])} | {_fmt(r['equiv_TBps'], 2)} "
                       f"| {_fmt(r['plain_us'])} / {_fmt(r['plain_pipe_us'])} "
                       f"| {_fmt(r['per_seq_us'])} / {_fmt(r['per_seq_pipe_us'])} "
                       f"| {_fmt(r['speedup'], 2)} | {_fmt(r['diff_plain'], 4)} "
                       f"| {_fmt(r['err_ref'], 4)} |")
    return "\n".join(out)


PORTABLE_PREFILL = [(4, 16, 2048, 64), (4, 16, 2048, 128)]
PORTABLE_DECODE = [(8, 8192), (1, 131072)]  # (batch, cache length); 32 q heads, 8 kv, D 128
PORTABLE_SOFTMAX = (4096, 8192)  # rows, cols (float32)
PORTABLE_MERGE = (2, 1, 8192, 32, 128)  # states, B, S, H, D (float32)


def portable_rows(reps: int, with_torch: bool, rows: list, quick: bool = False) -> None:
    """The ``portable`` rows: the portable kernel (``use_mma=False``) and the streaming
    primitives against the device's copy rate and PyTorch, all measured in this run.
    ``quick`` divides the sizes (a smoke run on a CPU device)."""
    import pyopencl as cl

    be = attnlib.get_backend("opencl", use_mma=False)
    queue = be.queue
    div = 8 if quick else 1
    if with_torch:
        import torch

    # the copy rate: one buffer into another, read + write bytes
    nbytes = (1 << 30) // div // div
    src, dst = cl.Buffer(be.context, 0, nbytes), cl.Buffer(be.context, 0, nbytes)
    cl.enqueue_fill_buffer(queue, src, np.float32(1.0), 0, nbytes)

    def copy(dst=dst, src=src):
        cl.enqueue_copy(queue, dst, src)

    t = _median_time(copy, queue.finish, warm=2, reps=max(reps, 10))
    copy_gbs = 2 * nbytes / t / 1e9
    row = {"kind": "portable", "case": "copy", "opencl_GBps": copy_gbs}
    if with_torch:
        a = torch.empty(nbytes // 4, device="cuda")
        b = torch.empty_like(a)
        row["torch_GBps"] = 2 * nbytes / _median_time(
            lambda: b.copy_(a), torch.cuda.synchronize, 2, max(reps, 10)) / 1e9
        del a, b
    rows.append(row)
    del src, dst, copy
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16"):
        for bsz, h, s, d in PORTABLE_PREFILL:
            s //= div
            host = [rng.standard_normal((bsz, s, h, d), dtype=np.float32).astype(dtype)
                    for _ in range(3)]
            dev = [attnlib.to_device(x, backend=be) for x in host]
            for causal in (False, True):
                flops = 4 * bsz * h * s * s * d / (2 if causal else 1)

                def run(c=causal, x=dev):
                    return attnlib.attention(*x, causal=c, backend=be)

                t = _median_time(run, queue.finish, warm=2, reps=reps)
                row = {"kind": "portable", "case": "prefill", "dtype": dtype,
                       "shape": [bsz, h, s, d], "causal": causal,
                       "opencl_tflops": flops / t / 1e12}
                if with_torch:
                    tq = [torch.from_numpy(x.astype(np.float32)).to("cuda", getattr(torch, dtype))
                          .transpose(1, 2).contiguous() for x in host]
                    tt = [v for k, v in _torch_times(*tq, causal, reps).items()
                          if isinstance(v, float) and not k.endswith("_pipe")]
                    row["torch_tflops"] = flops / min(tt) / 1e12 if tt else None
                    del tq
                rows.append(row)
    hq, hkv, d = 32, 8, 128
    for bsz, n in PORTABLE_DECODE:
        n //= div * div
        cache = attnlib.KVCache(bsz, n, hkv, d, dtype="float16", backend=be)
        step = min(n, 8192)
        kh = rng.standard_normal((bsz, step, hkv, d), dtype=np.float32).astype(np.float16)
        for p in range(0, n, step):
            cache.update(kh, kh, p)
        q = attnlib.to_device(rng.standard_normal((bsz, 1, hq, d), dtype=np.float32)
                              .astype(np.float16), backend=be)

        def step_once(x=q, c=cache):
            return attnlib.attention_with_kvcache(x, c)

        t = _median_time(step_once, queue.finish, warm=3, reps=max(reps, 20))
        moved = 4 * bsz * n * hkv * d  # K and V, float16, read once
        row = {"kind": "portable", "case": "decode", "dtype": "float16",
               "shape": [bsz, n, hq, hkv, d], "opencl_GBps": moved / t / 1e9}
        del cache
        if with_torch:
            tq = torch.from_numpy(q.get()).to("cuda").transpose(1, 2).contiguous()
            tk = torch.from_numpy(np.tile(kh, (1, n // step, 1, 1))).to("cuda").transpose(
                1, 2).contiguous()
            tt = [v for k, v in _torch_times(tq, tk, tk, False, max(reps, 20)).items()
                  if isinstance(v, float) and not k.endswith("_pipe")]
            row["torch_GBps"] = moved / min(tt) / 1e9 if tt else None
            del tq, tk
        rows.append(row)
    r, c = PORTABLE_SOFTMAX
    r //= div
    x = rng.standard_normal((r, c), dtype=np.float32)
    xd = attnlib.to_device(x, backend=be)
    n_st, bsz, s, h, d = PORTABLE_MERGE
    s //= div
    outs = [attnlib.to_device(rng.standard_normal((bsz, s, h, d), dtype=np.float32), backend=be)
            for _ in range(n_st)]
    lses = [attnlib.to_device(rng.standard_normal((bsz, h, s), dtype=np.float32), backend=be)
            for _ in range(n_st)]
    merge_bytes = (n_st + 1) * 4 * bsz * s * h * (d + 1)
    cases = [("softmax", lambda: attnlib.softmax(xd, backend=be), 2 * x.nbytes),
             ("logsumexp", lambda: attnlib.logsumexp(xd, backend=be), x.nbytes),
             ("merge_states", lambda: attnlib.merge_states(outs, lses, backend=be), merge_bytes)]
    for name, fn, moved in cases:
        t = _median_time(fn, queue.finish, warm=2, reps=max(reps, 10))
        row = {"kind": "portable", "case": name, "dtype": "float32",
               "shape": [r, c] if name != "merge_states" else [n_st, bsz, s, h, d],
               "opencl_GBps": moved / t / 1e9}
        if with_torch and name != "merge_states":
            xt = torch.from_numpy(x).cuda()
            f = torch.softmax if name == "softmax" else torch.logsumexp
            row["torch_GBps"] = moved / _median_time(
                lambda f=f, xt=xt: f(xt, dim=-1), torch.cuda.synchronize, 2, max(reps, 10)) / 1e9
        elif with_torch:
            to = torch.stack([torch.from_numpy(o.get()).cuda() for o in outs])
            tl = torch.stack([torch.from_numpy(v.get()).cuda() for v in lses])

            def t_merge(to=to, tl=tl):
                lse = torch.logsumexp(tl, dim=0)
                return (torch.exp(tl - lse).transpose(2, 3).unsqueeze(-1) * to).sum(0), lse

            row["torch_GBps"] = moved / _median_time(
                t_merge, torch.cuda.synchronize, 2, max(reps, 10)) / 1e9
        rows.append(row)
    for row in rows:
        if row.get("kind") == "portable" and "opencl_GBps" in row:
            row["of_copy"] = row["opencl_GBps"] / copy_gbs


def portable_table(rows: list) -> str:
    """Markdown: one line per portable case, attnlib's rate, PyTorch's, and the fraction of the
    copy rate of the same run (streaming cases) or attnlib / PyTorch (prefill)."""
    out = ["| case | dtype | shape | causal | attnlib | PyTorch | attnlib / PyTorch | of copy |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") != "portable":
            continue
        unit = "TFLOP/s" if r["case"] == "prefill" else "GB/s"
        mine = r.get("opencl_tflops", r.get("opencl_GBps"))
        theirs = r.get("torch_tflops", r.get("torch_GBps"))
        ratio = f"{mine / theirs:.2f}" if isinstance(theirs, float) else "-"
        causal = ("yes" if r["causal"] else "no") if "causal" in r else "-"
        shape = ",".join(map(str, r.get("shape", []))) or "-"
        frac = f"{r['of_copy']:.0%}" if "of_copy" in r else "-"
        out.append(f"| {r['case']} | {r.get('dtype', '-')} | {shape} | {causal} | "
                   f"{_fmt(mine, 2)} {unit} | {_fmt(theirs, 2)} | {ratio} | {frac} |")
    return "\n".join(out)


def _fmt(x, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x) if x is not None else "-"


def prefill_table(rows: list) -> str:
    """Markdown: TFLOP/s per call / pipelined, attnlib and each PyTorch backend, and the ratio
    to the best PyTorch backend of the same run."""
    out = ["| dtype | path | B,H,S,D | causal | attnlib | flash | efficient | cuDNN "
           "| attnlib / best PyTorch |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "prefill":
            continue
        cells, best = [], None
        for name in ("flash", "efficient", "cudnn"):
            per, pipe = r.get(f"torch_{name}_tflops"), r.get(f"torch_{name}_pipe_tflops")
            cells.append(f"{_fmt(per)} / {_fmt(pipe)}" if isinstance(per, float) else _fmt(per))
            if isinstance(per, float) and (best is None or per > best[0]):
                best = (per, pipe)
        ratio = "-" if best is None else (f"{r['opencl_tflops'] / best[0]:.2f} / "
                                          f"{r['opencl_pipe_tflops'] / best[1]:.2f}")
        out.append(f"| {r['dtype']} | {r['path']} | {','.join(map(str, r['shape']))} | "
                   f"{'yes' if r['causal'] else 'no'} | {_fmt(r['opencl_tflops'])} / "
                   f"{_fmt(r['opencl_pipe_tflops'])} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out)


def shapes_table(rows: list) -> str:
    """Markdown: TFLOP/s per call, attnlib and each PyTorch backend, the ratio to the fastest of
    flash / efficient and to cuDNN, and attnlib's max abs error against PyTorch's math backend."""
    out = ["| D, Dv | causal | mask | attnlib | flash | efficient | cuDNN "
           "| / best flash, eff. | / cuDNN | max abs err |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "shapes":
            continue
        a = r["opencl_tflops"]
        cells = [r.get(f"torch_{n}_tflops") for n in ("flash", "efficient", "cudnn")]
        fe = [c for c in cells[:2] if isinstance(c, float)]
        best = f"{a / max(fe):.2f}" if fe else "-"
        cud = f"{a / cells[2]:.2f}" if isinstance(cells[2], float) else "-"
        err = r.get("max_abs_err")
        out.append(f"| {r['shape'][3]}, {r['shape'][4]} | {'yes' if r['causal'] else 'no'} | "
                   f"{r['mask'] or '-'} | {_fmt(a)} | "
                   + " | ".join(_fmt(c) if isinstance(c, float) else "n/a" for c in cells)
                   + f" | {best} | {cud} | {'-' if err is None else f'{err:.1e}'} |")
    return "\n".join(out)


def decode_table(rows: list) -> str:
    out = ["| B, tokens | attnlib µs | attnlib TB/s | flash µs | efficient µs | cuDNN µs "
           "| attnlib / best PyTorch |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "decode":
            continue
        cells, best = [], None
        for name in ("flash", "efficient", "cudnn"):
            per, pipe = r.get(f"torch_{name}_us"), r.get(f"torch_{name}_pipe_us")
            cells.append(f"{_fmt(per)} / {_fmt(pipe)}" if isinstance(per, float) else _fmt(per))
            if isinstance(per, float) and (best is None or per < best[0]):
                best = (per, pipe)
        ratio = "-" if best is None else (f"{best[0] / r['opencl_us']:.2f} / "
                                          f"{best[1] / r['opencl_pipe_us']:.2f}")
        out.append(f"| {r['batch']}, {r['cache_len']} | {_fmt(r['opencl_us'])} / "
                   f"{_fmt(r['opencl_pipe_us'])} | {_fmt(r['opencl_TBps'], 2)} / "
                   f"{_fmt(r['opencl_pipe_TBps'], 2)} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out)


def host_table(times: dict, counts: dict) -> str:
    """Markdown: per case, µs stub / call / pipelined, and what a repeated call does on the
    queue (kernel enqueues, table fills, host-to-device copies)."""
    cases = sorted({k.rsplit("_", 1)[0] for k in times if k.endswith("_stub")},
                   key=lambda c: (c.startswith("portable_"), c))
    out = ["| case | stub µs | call µs | pipelined µs | enqueues | fills | copies |",
           "|---|---|---|---|---|---|---|"]
    for c in cases:
        cnt = counts.get(c) or {}
        out.append(f"| {c} | {_fmt(times.get(c + '_stub'))} | {_fmt(times.get(c + '_call'))} | "
                   f"{_fmt(times.get(c + '_pipelined'))} | {_fmt(cnt.get('enqueues'))} | "
                   f"{_fmt(cnt.get('fills'))} | {_fmt(cnt.get('writes'))} |")
    return "\n".join(out)


def torch_cuda_missing() -> str | None:
    """Why PyTorch cannot be the anchor here (not installed, or built without CUDA, or no CUDA
    device), or None when it can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        why = "has no CUDA device here" if torch.version.cuda else "is built without CUDA"
        return f"PyTorch {torch.__version__} {why}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write every row here")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--only", action="append",
                    choices=["prefill32", "prefill16", "prefill16p", "prefillbf16", "shapes",
                             "decode", "paged", "pagedprefill", "forks", "host", "portable",
                             "quant"])
    ap.add_argument("--quick", action="store_true",
                    help="portable, quant, forks, pagedprefill: every shape divided (a smoke "
                         "run on a CPU device)")
    args = ap.parse_args(argv)
    be = attnlib.get_backend("opencl")
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "opencl backend:", be.info(),
          flush=True)
    missing = None if args.no_torch else torch_cuda_missing()
    if missing:
        print(f"{missing}: attnlib's rows only, no PyTorch anchors (as --no-torch)", flush=True)
    args.no_torch = args.no_torch or missing is not None
    rows: list = []
    parts = args.only or ["prefill32", "prefill16p", "prefill16", "prefillbf16", "shapes",
                          "decode", "paged", "pagedprefill", "forks", "quant", "host"]
    for part, dtype, portable in (("prefill32", "float32", False),
                                  ("prefill16p", "float16", True),
                                  ("prefill16", "float16", False),
                                  ("prefillbf16", "bfloat16", False)):
        if part in parts:
            print(f"prefill {dtype}{' (portable kernel)' if portable else ''} ...", flush=True)
            prefill(dtype, args.reps, not args.no_torch, rows, portable=portable)
    if "shapes" in parts:
        print("head dims and masks, float16 ...", flush=True)
        shapes(args.reps, not args.no_torch, rows)
    if "decode" in parts:
        print("decode ...", flush=True)
        decode(args.reps, not args.no_torch, rows)
    if "paged" in parts:
        print("paged decode ...", flush=True)
        paged(args.reps, not args.no_torch, rows)
    if "pagedprefill" in parts:
        print("paged prefill ...", flush=True)
        paged_prefill(args.reps, not args.no_torch, rows, quick=args.quick)
    if "forks" in parts:
        print("forks ...", flush=True)
        forks(args.reps, rows, quick=args.quick)
    if "quant" in parts:
        print("quantized caches ...", flush=True)
        quant(args.reps, rows, quick=args.quick)
        print("\n## Decode over 8-bit KV caches, float16 compute, 32 q / 8 kv heads, D=128 "
              "(attention_with_kvcache, device queries)\n")
        print(quant_table(rows))
    if any(r["kind"] == "prefill" for r in rows):
        print("\n## Prefill, TFLOP/s (per call / pipelined)\n")
        print(prefill_table(rows))
    if any(r["kind"] == "shapes" for r in rows):
        print("\n## Head dims and masks, float16, B=1, H=16, S=4096, TFLOP/s per call\n")
        print(shapes_table(rows))
    if any(r["kind"] == "decode" for r in rows):
        print("\n## Decode, float16, 32 q / 8 kv heads, D=128 (per call / pipelined)\n")
        print(decode_table(rows))
    if any(r["kind"] == "paged" for r in rows):
        print("\n## Paged decode, float16, 32 q / 8 kv heads, D=128, scattered pages "
              "(per call / pipelined; ratios pipelined)\n")
        print(paged_table(rows))
    if any(r["kind"] == "pagedprefill" for r in rows):
        print("\n## Paged prefill, float16, causal, scattered pages, TFLOP/s per call\n")
        print(paged_prefill_table(rows))
    if any(r["kind"] == "forks" for r in rows):
        print("\n## Shared prompt: forks of one prompt, one decode step, float16, 32 q / 8 kv "
              "heads, D=128, page 16, device queries (per call / pipelined)\n")
        print(forks_table(rows))
    if "portable" in parts:
        print("portable kernel ...", flush=True)
        portable_rows(args.reps, not args.no_torch, rows, quick=args.quick)
        print("\n## The portable kernel (use_mma=False) and the copy rate of the same run\n")
        print(portable_table(rows))
    if "host" in parts:
        import hostcost  # this script's folder

        print("host cost ...", flush=True)
        times = hostcost.main(["--repeat", "3"])
        counts = hostcost.main(["--count"])
        rows += [{"kind": "host", **times}, {"kind": "host_count", **counts}]
        print("\n## Host cost of a repeated call (stub: kernel launches stubbed; per call)\n")
        print(host_table(times, counts))
        prims = ("upload_desc", "pool_alloc", "empty_array", "decode_enqueue_only",
                 "set_arg_buffer")
        print("\nprimitives (µs): " + ", ".join(f"{k} {times[k]}" for k in prims if k in times))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
