"""Runners: one per backend (attnlib's, through the public API, and PyTorch's SDPA).

``runner.prepare(case, inputs)`` returns ``(fn, sync)``: ``fn()`` makes one call and returns its
result, ``sync(result)`` waits until the device has finished it. Inputs are made once per case on
the host (bshd layout) and moved to the runner's device before timing, so what is timed is the
call itself (device-resident inputs on OpenCL and CUDA; numpy in, numpy out on CPU backends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .shapes import Case

__all__ = ["make_inputs", "AttnlibRunner", "TorchRunner", "torch_runner", "np_dtype"]


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_BLOCK = (1 << 22) + 9  # random values drawn at most; an odd length so the tiling never aligns


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Uniform in [-1, 1): random data, never zeros. Large inputs (a GPU decode cache is GiBs)
    repeat one random block of ``_BLOCK`` values, ten times faster than drawing them all."""
    n = int(np.prod(shape))
    x = rng.random(min(n, _BLOCK), dtype=np.float32)
    x *= 2.0
    x -= 1.0
    if n > _BLOCK:
        x = np.resize(x, n)
    return x.reshape(shape).astype(np_dtype(dtype), copy=False)


def make_inputs(case: Case, seed: int = 0) -> dict[str, Any]:
    """Host (numpy) inputs of ``case`` in attnlib's default bshd layout."""
    rng = np.random.default_rng(seed)
    d = case.dtype
    if case.task == "prefill":
        return {
            "q": _rand(rng, (case.B, case.S, case.H, case.D), d),
            "k": _rand(rng, (case.B, case.S, case.Hkv, case.D), d),
            "v": _rand(rng, (case.B, case.S, case.Hkv, case.D), d),
        }
    if case.task in ("decode", "paged_decode"):
        return {
            "q": _rand(rng, (case.B, 1, case.H, case.D), d),
            "k": _rand(rng, (case.B, case.L, case.Hkv, case.D), d),
            "v": _rand(rng, (case.B, case.L, case.Hkv, case.D), d),
        }
    if case.task == "softmax":
        x = _rand(rng, (case.rows, case.cols), "float32")
        x *= 8.0  # a realistic spread of logits, so exp() is exercised
        return {"x": x.astype(np_dtype(d), copy=False)}
    outs = [_rand(rng, (case.B, case.S, case.H, case.D), d) for _ in range(case.n)]
    lses = [(_rand(rng, (case.B, case.H, case.S), "float32") * 4.0) for _ in range(case.n)]
    return {"outs": outs, "lses": lses}


class AttnlibRunner:
    """An attnlib backend, called only through the public API with ``backend=name``."""

    def __init__(self, name: str) -> None:
        import attnlib

        self.name = name
        self.backend = attnlib.get_backend(name)
        self.device_key, self.device_label = _attnlib_device(name, self.backend)
        self.host_memory = self.device_key == "cpu" or self.device_label.endswith("CPU]")

    def prepare(self, case: Case, inputs: dict[str, Any]) -> tuple[Callable[[], Any], Callable]:
        import attnlib

        name = self.name
        dev = self._to_device
        if case.task == "prefill":
            q, k, v = dev(inputs["q"]), dev(inputs["k"]), dev(inputs["v"])
            causal = case.causal

            def fn() -> Any:
                return attnlib.attention(q, k, v, causal=causal, backend=name)

        elif case.task == "decode":
            cache = attnlib.KVCache(case.B, case.L, case.Hkv, case.D, dtype=case.dtype,
                                    backend=name, kv_dtype=case.kv_dtype or None)
            cache.update(inputs["k"], inputs["v"], 0)
            q = dev(inputs["q"])

            def fn() -> Any:
                return attnlib.attention_with_kvcache(q, cache, backend=name)

        elif case.task == "paged_decode":
            cache, sids = _paged_cache(case, inputs, name)
            q = dev(inputs["q"])

            def fn() -> Any:
                return attnlib.attention_with_paged_kvcache(q, cache, sids, backend=name)

        elif case.task == "softmax":
            x = dev(inputs["x"])

            def fn() -> Any:
                return attnlib.softmax(x, axis=-1, backend=name)

        else:
            outs = [dev(o) for o in inputs["outs"]]
            lses = [dev(s) for s in inputs["lses"]]

            def fn() -> Any:
                return attnlib.merge_states(outs, lses, backend=name)

        return fn, _sync_any

    def _to_device(self, x: np.ndarray) -> Any:
        # device-resident inputs where the backend has its own arrays (OpenCL), so transfers
        # are not timed; numpy backends get the numpy array itself
        try:
            y = self.backend.to_device(x)
            return y if self.backend.owns(y) else x
        except Exception:
            return x


def _paged_cache(case: Case, inputs: dict[str, Any], name: str) -> tuple[Any, list]:
    """A PagedKVCache holding the decode inputs, each sequence's pages taken from a shuffled
    free list (not adjacent, not in order), as a serving engine's pool looks after a while."""
    import attnlib

    from .shapes import PAGED_PAGE_SIZE as ps

    per = -(-case.L // ps)
    cache = attnlib.PagedKVCache(case.B * per, ps, case.Hkv, case.D, dtype=case.dtype,
                                 backend=name, kv_dtype=case.kv_dtype or None)
    fill = [cache.new_sequence() for _ in range(case.B * per)]
    one = np.zeros((len(fill), 1, case.Hkv, case.D), np_dtype(case.dtype))
    cache.append(fill, one, one)
    for i in np.random.default_rng(0).permutation(len(fill)):
        cache.free(fill[i])
    sids = [cache.new_sequence() for _ in range(case.B)]
    cache.append(sids, inputs["k"], inputs["v"])
    return cache, sids


def _sync_any(result: Any) -> None:
    """Wait for a result's device work: pyopencl arrays carry their queue."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    for r in items:
        q = getattr(r, "queue", None)
        if q is not None and hasattr(q, "finish"):
            q.finish()


def _attnlib_device(name: str, backend: Any) -> tuple[str, str]:
    """(device key for the ceilings, human label). CPU backends share the key "cpu"."""
    if name == "opencl":
        try:
            from .probes import opencl_queue

            dev = opencl_queue(backend).device
            import pyopencl as cl

            kind = "GPU" if dev.type & cl.device_type.GPU else "CPU"
            if "oclgrind" in dev.platform.name.lower():  # reports every type bit, GPU included
                kind = "simulator"
            return f"opencl:{dev.name.strip()}", f"{short_device_name(dev.name)} [OpenCL {kind}]"
        except Exception:
            return "opencl:?", "OpenCL device"
    return "cpu", "CPU"


def short_device_name(name: str) -> str:
    """'pthread-Intel(R) Xeon(R) Processor' -> 'Intel Xeon' (PoCL's names are long)."""
    for junk in ("(R)", "(TM)", "(tm)", "pthread-", "cpu-", " Processor", " CPU"):
        name = name.replace(junk, "")
    return " ".join(name.split())


class TorchRunner:
    """PyTorch's ``scaled_dot_product_attention`` (and softmax, logsumexp) on CUDA if present."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = bool(torch.cuda.is_available())
        if self.cuda:
            self.dev = torch.device("cuda")
            self.device_key = f"cuda:{torch.cuda.get_device_name(0)}"
            self.device_label = f"{short_device_name(torch.cuda.get_device_name(0))} [CUDA]"
        else:
            self.dev = torch.device("cpu")
            self.device_key, self.device_label = "cpu", "CPU"
        self.host_memory = not self.cuda

    def tensor(self, x: np.ndarray, bhsd: bool = False) -> Any:
        torch = self.torch
        if x.dtype.name == "bfloat16":
            t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(x))
        if bhsd:
            t = t.transpose(1, 2)
        return t.contiguous().to(self.dev)

    def prepare(self, case: Case, inputs: dict[str, Any]) -> tuple[Callable[[], Any], Callable]:
        torch = self.torch
        F = torch.nn.functional
        if case.task in ("prefill", "decode", "paged_decode"):  # paged: contiguous SDPA
            q, k, v = (self.tensor(inputs[n], bhsd=True) for n in ("q", "k", "v"))
            # decode: one query at the end sees every key; torch's is_causal is top-left aligned,
            # so the causal flag only goes with Sq == Sk
            causal = case.causal and case.task == "prefill"
            gqa = {"enable_gqa": True} if case.H != case.Hkv else {}

            def fn() -> Any:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        elif case.task == "softmax":
            x = self.tensor(inputs["x"])

            def fn() -> Any:
                return torch.softmax(x, dim=-1)

        else:
            outs = torch.stack([self.tensor(o) for o in inputs["outs"]])  # (n, B, S, H, D)
            lses = torch.stack([self.tensor(s) for s in inputs["lses"]])  # (n, B, H, S)

            def fn() -> Any:
                lse = torch.logsumexp(lses, dim=0)
                w = torch.exp(lses - lse).transpose(2, 3).unsqueeze(-1).to(outs.dtype)
                return (w * outs).sum(dim=0), lse

        return fn, self._sync

    def _sync(self, result: Any) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def torch_runner() -> TorchRunner | None:
    """A TorchRunner when PyTorch is installed, else None (never raises)."""
    try:
        return TorchRunner()
    except Exception:
        return None
