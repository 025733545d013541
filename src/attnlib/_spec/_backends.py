"""The backend a call runs on, OnlineAttention's chunks and the registry's arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import (
    ArgumentError,
    BackendUnavailableError,
    DTypeError,
    ShapeError,
    UnsupportedError,
)
from ._arrays import check_array, check_int, is_array, is_device_array, same_dtype, to_bshd
from ._calls import check_heads


# ---- the backend a call runs on ------------------------------------------------------------------
def check_backend_reads(device: list[Any], be: Any) -> None:
    """The chosen backend ``be`` owns the call's device arrays (``device``; none: numpy)."""
    if device and not be.owns(device[0]):
        raise ArgumentError(
            f"inputs are {type(device[0]).__module__}.{type(device[0]).__name__} arrays, which "
            f"backend {be.name!r} cannot read; choose the backend that owns them or pass "
            "attnlib.to_numpy(x)"
        )


def check_backend_dtype(be: Any, dtype: Any) -> None:
    """The backend ``be`` can run ``dtype`` (asked every call: a device's facts may change)."""
    reason = be.unsupported_dtype_reason(np.dtype(dtype))
    if reason:
        raise UnsupportedError(f"backend {be.name!r} cannot run dtype {dtype}: {reason}")


def check_queue(queue: Any, queue_type: type | None) -> None:
    """``queue=`` is a ``pyopencl.CommandQueue`` (``queue_type``; None: pyopencl is absent)."""
    if queue_type is None or not isinstance(queue, queue_type):
        raise ArgumentError(
            f"queue must be a pyopencl.CommandQueue, got {type(queue).__module__}."
            f"{type(queue).__name__}"
        )


def check_queue_backend(backend: Any, be: Any, queue: Any) -> None:
    """``backend=`` beside ``queue=`` (``be``: what it names) is the opencl backend on it."""
    on = getattr(be, "queue", None)
    if be.name != "opencl" or on is None or on.int_ptr != queue.int_ptr:
        where = "on another queue" if be.name == "opencl" else f"is {be.name!r}"
        raise ArgumentError(
            f"queue= and backend= disagree: queue= means the opencl backend on that queue, but "
            f"backend={backend!r} {where}; pass one of them (backend=attnlib.get_backend("
            f"'opencl', queue=queue) is the same as queue=queue)"
        )


def check_host_array(x: Any) -> None:
    """``to_device`` copies numpy arrays only."""
    if not isinstance(x, np.ndarray):
        raise DTypeError(f"x must be a numpy array, got {type(x).__name__}")


def check_any_array(x: Any) -> None:
    """``to_numpy`` takes numpy and device arrays."""
    if not is_array(x):
        raise DTypeError(f"x must be an array, got {type(x).__name__}")


# ---- OnlineAttention -----------------------------------------------------------------------------
def check_total_keys(total_keys: Any, causal: str | None) -> int | None:
    """``total_keys`` (None or an int >= 0), required with ``causal``."""
    if total_keys is not None:
        total_keys = check_int(total_keys, "total_keys", minimum=0)
    if causal is not None and total_keys is None:
        raise ArgumentError(
            "causal=True needs total_keys (the final number of keys) so that the "
            "bottom-right alignment is known; got total_keys=None"
        )
    return total_keys


def check_online_chunk(q: Any, k_chunk: Any, v_chunk: Any, layout: str, dv_before: int | None,
                       seen: int, total: int | None) -> tuple[Any, Any]:
    """One chunk for ``OnlineAttention.update`` (``q`` in bshd; ``dv_before``: the head dim of
    earlier chunks' values, None before the first): k, v in bshd."""
    check_array(k_chunk, "k_chunk", ndim=4)
    check_array(v_chunk, "v_chunk", ndim=4)
    k = to_bshd(k_chunk, layout)
    v = to_bshd(v_chunk, layout)
    same_dtype({"q": q, "k_chunk": k, "v_chunk": v})
    check_heads(q.shape, k.shape, v.shape, names=("q", "k_chunk", "v_chunk"))
    b = q.shape[0]
    if k.shape[0] != b:
        raise ShapeError(f"k_chunk has batch {k.shape[0]} but q has {b}")
    if dv_before is not None and v.shape[3] != dv_before:
        raise ShapeError(
            f"v_chunk has head dim {v.shape[3]} but earlier chunks had {dv_before}"
        )
    n = k.shape[1]
    if total is not None and seen + n > total:
        raise ArgumentError(
            f"this chunk brings the keys to {seen + n}, past total_keys={total}"
        )
    return k, v


def check_chunk_readable(k: Any, be: Any) -> None:
    """A device chunk belongs to the accumulator's backend ``be``."""
    if not be.owns(k) and is_device_array(k):
        raise ArgumentError("k_chunk is a device array of another backend")


# ---- backend names and classes (the registry's arguments) ----------------------------------------
def backend_origin(name: Any, from_env: bool) -> str:
    """Where a backend name came from, for messages: ``backend=`` or ATTNLIB_BACKEND."""
    if from_env:
        return f"the environment variable ATTNLIB_BACKEND={str(name)!r}"
    return f"backend={name!r}"


def _unknown_backend(name: Any, known: list[str], from_env: bool) -> ArgumentError:
    valid = ", ".join(["auto"] + known)
    hint = " (or unset it)" if from_env else ""
    return ArgumentError(
        f"{backend_origin(name, from_env)} is not a known backend; expected one of: "
        f"{valid}{hint}"
    )


def check_backend_str(name: Any, known: Callable[[], list[str]]) -> None:
    """A backend name is a str (``known``: the registry's names, for the message)."""
    if not isinstance(name, str):
        raise _unknown_backend(name, known(), False)


def check_backend_known(name: str, known: Callable[[], list[str]], from_env: bool = False,
                        allow_auto: bool = False) -> None:
    """``name`` (stripped) is one of ``known()`` (or "auto" with ``allow_auto``)."""
    if not (allow_auto and name == "auto") and name not in known():
        raise _unknown_backend(name, known(), from_env)


def check_backend_choice_type(name: Any) -> None:
    """``set_backend`` / ``use_backend`` take a name or a Backend instance (checked before)."""
    if not isinstance(name, str):
        raise ArgumentError(
            f"backend must be a backend name (str) or a Backend instance, got {type(name).__name__}"
        )


def check_backend_not_none(name: Any) -> None:
    """``use_backend(None)`` has nothing to use."""
    if name is None:
        raise ArgumentError("use_backend: backend must be a name or a Backend instance, not None")


def check_backend_register_name(name: Any) -> None:
    """``register_backend``'s name: a non-empty string other than "auto"."""
    if not isinstance(name, str) or not name.strip() or name == "auto":
        raise ArgumentError(f"register_backend: name must be a non-empty string, not {name!r}")


def check_backend_class(name: str, cls: Any, required: tuple[str, ...]) -> None:
    """A backend class: a class with every method of the Backend protocol in ``required``."""
    if not isinstance(cls, type):
        raise ArgumentError(f"register_backend: cls for {name!r} must be a class, got {cls!r}")
    missing = [m for m in required if not callable(getattr(cls, m, None))]
    if missing:
        raise ArgumentError(
            f"register_backend: class {cls.__name__} for backend {name!r} lacks the methods "
            f"{missing}; expected the attnlib.backends.base.Backend protocol"
        )


def check_backend_importable(cls: Any, origin: str, name: str) -> None:
    """The class of a known backend ``name`` could be imported (``cls`` None: it could not)."""
    if cls is None:
        raise BackendUnavailableError(
            f"{origin}: backend {str(name)!r} cannot be imported here (is its package "
            f"installed? e.g. pip install 'attnlib[{name}]')"
        )


def check_backend_available(ok: bool, origin: str, name: str,
                            available: Callable[[], list[str]]) -> None:
    """The backend ``name`` can run on this machine (``ok``: its ``is_available()``)."""
    if not ok:
        raise BackendUnavailableError(
            f"{origin}: backend {str(name)!r} is not available on this machine; available "
            f"here: {', '.join(available())}"
        )
