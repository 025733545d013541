"""Arrays of other frameworks at the front door (contract section 11).

Every public entry is wrapped once by :func:`front_door`: CPU arrays that offer ``__dlpack__``
(PyTorch CPU tensors, JAX CPU arrays) become numpy views of the same memory (strides kept, no
copy) before any check runs, and the numpy arrays of the result go back as the caller's kind
(the first foreign array among the arguments decides). A torch ``bfloat16`` tensor, which DLPack
cannot describe to numpy, is read as ``int16`` and reinterpreted as ``ml_dtypes.bfloat16`` (and
back), still without a copy. Arrays on a device attnlib cannot read (CUDA tensors) raise
``UnsupportedError``: nothing is copied silently. Neither torch nor JAX is imported by attnlib
until one of their arrays arrives (torch is then found in ``sys.modules``).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import UnsupportedError
from ._arrays import BFLOAT16, is_array

#: DLPack device types whose memory the host reads: kDLCPU, kDLCUDAHost (pinned), kDLROCMHost
_HOST_DEVICES = (1, 3, 11)
_DEVICE_NAMES = {2: "CUDA", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm",
                 13: "CUDA managed", 14: "oneAPI"}
_SEQ = "sequence"
_UNSEEN = "unseen"
#: type -> "torch", "jax", "dlpack" (another framework), _SEQ, or None (passed through)
_kinds: dict[type, str | None] = {}


def _kind_of_type(t: type) -> str | None:
    if issubclass(t, (list, tuple)):
        return _SEQ
    if issubclass(t, np.ndarray) or not hasattr(t, "__dlpack__"):
        return None
    module = t.__module__.split(".")[0]
    if module == "torch":
        return "torch"
    if module in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _kind(x: Any) -> str | None:
    t = type(x)
    try:
        return _kinds[t]
    except KeyError:
        kind = None if is_array(x) else _kind_of_type(t)
        _kinds[t] = kind
        return kind


def _device_error(x: Any, kind: str, device: Any) -> UnsupportedError:
    code = int(device[0])
    where = _DEVICE_NAMES.get(code, f"DLPack device type {code}")
    return UnsupportedError(
        f"a {kind} array on a {where} device was passed; attnlib reads CPU arrays and its "
        "backend's own device arrays and never copies silently: copy it to the host "
        "(x.cpu(), then attnlib.to_numpy) and, for the OpenCL backend's device, attnlib.to_device"
    )


def to_host(x: Any, kind: str) -> np.ndarray:
    """A numpy view of the foreign CPU array ``x`` (same memory, same strides)."""
    device = x.__dlpack_device__()
    if int(device[0]) not in _HOST_DEVICES:
        raise _device_error(x, kind, device)
    if kind == "torch":
        torch = sys.modules["torch"]
        if x.requires_grad:
            if torch.is_grad_enabled():
                raise UnsupportedError(
                    "a torch tensor that requires grad was passed while gradients are enabled; "
                    "attnlib computes no gradients: call it under torch.no_grad() or pass "
                    "x.detach()"
                )
            x = x.detach()  # a parameter read under no_grad: the same memory
        if x.dtype == torch.bfloat16:
            return np.from_dlpack(x.view(torch.int16)).view(BFLOAT16)
    try:
        return np.from_dlpack(x)
    except (RuntimeError, TypeError, BufferError):
        if kind != "jax":
            raise
        # JAX's bfloat16 is ml_dtypes' own: its array interface gives it without DLPack
        return np.asarray(x)


def _in(x: Any, kinds: list[str]) -> Any:
    kind = _kind(x)
    if kind is None:
        return x
    if kind == _SEQ:
        if not any(_kind(a) is not None for a in x):
            return x
        return [_in(a, kinds) for a in x]
    kinds.append(kind)
    return to_host(x, kind)


def from_host(a: Any, kind: str | None) -> Any:
    """The numpy arrays of a result (in tuples and lists too) as ``kind``'s arrays."""
    if kind is None or kind == "dlpack":
        return a
    if isinstance(a, tuple):
        return tuple(from_host(x, kind) for x in a)
    if isinstance(a, list):
        return [from_host(x, kind) for x in a]
    if not isinstance(a, np.ndarray):
        return a
    if kind == "torch":
        torch = sys.modules["torch"]
        if a.dtype == BFLOAT16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return importlib.import_module("jax.numpy").asarray(a)  # jax is there: its array came in


def front_door(fn: Callable | None = None, *, wrap: bool = True, remember: bool = False,
               method: bool = False) -> Any:
    """Wrap a public function or method: foreign array arguments in, the caller's kind out.

    ``wrap=False``: the result is returned as it is (to_numpy, to_device). ``remember=True``
    (constructors): the instance keeps the kind of its arrays, and its wrapped methods return
    that kind even when called without foreign arrays (``method=True``: OnlineAttention.result).
    """
    if fn is None:
        return functools.partial(front_door, wrap=wrap, remember=remember, method=method)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # the common case, numpy (or device) arrays only, costs one dict look-up per argument
        for a in args:
            if _kinds.get(type(a), _UNSEEN) is not None:
                break
        else:
            for a in kwargs.values():
                if _kinds.get(type(a), _UNSEEN) is not None:
                    break
            else:
                if not method:
                    return fn(*args, **kwargs)
        kinds: list[str] = []
        if any(_kind(a) is not None for a in args):
            args = tuple(_in(a, kinds) for a in args)
        if kwargs and any(_kind(a) is not None for a in kwargs.values()):
            kwargs = {n: _in(a, kinds) for n, a in kwargs.items()}
        out = fn(*args, **kwargs)
        kind = kinds[0] if kinds else None
        if remember:
            if kind is not None:
                args[0]._array_kind = kind
            return out
        if kind is None and method:
            kind = getattr(args[0], "_array_kind", None)
        return from_host(out, kind) if wrap and kind is not None else out

    return call


# ---- attn_implementation="attnlib" (attnlib.integrations.transformers) --------------------------
def check_layer_call(dropout: Any) -> None:
    """What a transformers layer passes that attnlib does not do: dropout (inference only)."""
    if dropout:
        raise UnsupportedError(
            f"attn_implementation='attnlib' runs inference only: dropout={dropout} must be 0 "
            "(call model.eval())"
        )
