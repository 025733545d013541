"""Arrays, dtypes, scalars and options: the checks every call shares."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

from ..errors import ArgumentError, DTypeError, ShapeError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BFLOAT16)
_DTYPE_NAMES = "float16, float32, float64 or bfloat16"
LAYOUTS = ("bshd", "bhsd")


# ---- arrays -------------------------------------------------------------------------------------
_ARRAY_ATTRS = ("shape", "dtype", "strides", "get")
#: types seen to have every attribute of _ARRAY_ATTRS (pyopencl sets ``shape`` per instance, so the
#: type is remembered after its first array passed; the test ran ~9 times per attention() call)
_array_types: set[type] = {np.ndarray}


def is_array(x: Any) -> bool:
    """numpy arrays, and device arrays that look like them (pyopencl.array.Array)."""
    t = type(x)
    if t in _array_types or isinstance(x, np.ndarray):
        return True
    if all(hasattr(x, a) for a in _ARRAY_ATTRS):
        _array_types.add(t)
        return True
    return False


def is_device_array(x: Any) -> bool:
    return is_array(x) and not isinstance(x, np.ndarray)


def host(x: Any) -> np.ndarray:
    """A numpy view/copy of a small auxiliary array (mask, slopes, cu_seqlens)."""
    return x if isinstance(x, np.ndarray) else np.asarray(x.get())


def check_array(x: Any, name: str, ndim: int | tuple[int, ...] | None = None) -> Any:
    if not is_array(x):
        raise DTypeError(
            f"{name} must be an array (numpy or the backend's), got {type(x).__name__}"
        )
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else ndim
        if len(x.shape) not in ndims:
            want = " or ".join(f"{n}-D" for n in ndims)
            raise ShapeError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    return x


def check_float_dtype(x: Any, name: str) -> np.dtype:
    dt = np.dtype(x.dtype)
    if dt not in FLOAT_DTYPES:
        raise DTypeError(f"{name} has dtype {dt}; expected {_DTYPE_NAMES}")
    return dt


def parse_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    try:
        dt = BFLOAT16 if dtype in ("bfloat16", "bf16") else np.dtype(dtype)
    except (TypeError, ValueError):
        raise DTypeError(f"{name}={dtype!r} is not a dtype; expected {_DTYPE_NAMES}") from None
    if dt not in FLOAT_DTYPES:
        raise DTypeError(f"{name}={dtype!r} is not supported; expected {_DTYPE_NAMES}")
    return dt


def same_dtype(arrays: dict[str, Any]) -> np.dtype:
    dts = {name: check_float_dtype(a, name) for name, a in arrays.items()}
    first_name, first = next(iter(dts.items()))
    for name, dt in dts.items():
        if dt != first:
            raise DTypeError(
                f"{name} has dtype {dt} but {first_name} has {first}; q, k and v must share a dtype"
            )
    return first


def to_bshd(x: Any, layout: str) -> Any:
    return x if layout == "bshd" else x.transpose((0, 2, 1, 3))


# ---- scalars and options ------------------------------------------------------------------------
def check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout={layout!r} is not supported; expected 'bshd' or 'bhsd'")
    return layout


def check_int(value: Any, name: str, minimum: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{name}={value} must be >= {minimum}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_real(value: Any, name: str, positive: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise ArgumentError(f"{name}={value!r} must be {want}")
    return value


def check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_real(scale, "scale")


def check_softcap(softcap: Any) -> float | None:
    return None if softcap is None else check_real(softcap, "softcap", positive=True)


#: keywords of other libraries and what attnlib calls them
_KEYWORD_HINTS = {"is_causal": "causal= (causal='top_left' is PyTorch's is_causal=True; "
                               "causal=True is FlashAttention's bottom-right alignment)",
                  "attn_mask": "mask=", "softmax_scale": "scale=", "sm_scale": "scale="}
_F = TypeVar("_F", bound=Callable[..., Any])


def keywords_checked(fn: _F) -> _F:
    """``fn`` with an unknown keyword raising ArgumentError (naming attnlib's spelling of
    PyTorch's and FlashAttention's keywords, e.g. ``is_causal`` -> ``causal=``) instead of
    Python's bare TypeError. The keywords are only looked at when ``fn`` raised TypeError."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(f"{fn.__qualname__} takes **kwargs; every keyword is known")
    known = tuple(n for n, p in params.items() if p.kind is not p.POSITIONAL_ONLY)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError:
            unknown = [k for k in kwargs if k not in known]
            if not unknown:
                raise
        name = fn.__qualname__.removesuffix(".__init__")
        hints = [f"attnlib spells {k}= as {_KEYWORD_HINTS[k]}" for k in unknown
                 if k in _KEYWORD_HINTS]
        raise ArgumentError(
            f"{name}() got an unexpected keyword {', '.join(map(repr, unknown))}: "
            + ("; ".join(hints) if hints else "expected one of " + ", ".join(
                n for n in known if n != "self"))
        )

    return checked  # type: ignore[return-value]


def check_causal(causal: Any, allow_top_left: bool = True) -> str | None:
    """None (not causal), 'bottom_right' or 'top_left'."""
    if causal is None or causal is False or (isinstance(causal, np.bool_) and not causal):
        return None
    if causal is True or isinstance(causal, np.bool_):
        return "bottom_right"
    if causal == "bottom_right" or (allow_top_left and causal == "top_left"):
        return causal
    want = "True, False, 'bottom_right' or 'top_left'" if allow_top_left else "True or False"
    raise ArgumentError(f"causal={causal!r} is not supported; expected {want}")


def check_window(window: Any) -> tuple[int | None, int | None]:
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for side, name in zip(window, ("window[0] (left)", "window[1] (right)")):
        if side is None:
            sides.append(None)
            continue
        side = check_int(side, name)
        sides.append(None if side < 0 else side)
    return sides[0], sides[1]


def check_alibi(slopes: Any, n_seq: int, n_heads: int) -> np.ndarray | None:
    if slopes is None:
        return None
    check_array(slopes, "alibi_slopes", ndim=(1, 2))
    a = host(slopes)
    if a.dtype.kind != "f" and np.dtype(a.dtype) != BFLOAT16:
        raise DTypeError(f"alibi_slopes has dtype {a.dtype}; expected a float dtype (float32)")
    if a.shape not in ((n_heads,), (n_seq, n_heads)):
        raise ShapeError(
            f"alibi_slopes has shape {a.shape}; expected ({n_heads},) or ({n_seq}, {n_heads})"
        )
    return np.ascontiguousarray(np.broadcast_to(a.astype(np.float32), (n_seq, n_heads)))


def check_mask(mask: Any, shape: tuple[int, int, int, int]) -> tuple[np.ndarray | None, str | None]:
    """Broadcast a bool or additive mask to ``shape = (B, Hq, Sq, Sk)`` without copying."""
    if mask is None:
        return None, None
    check_array(mask, "mask")
    m = host(mask)
    if m.dtype == np.bool_:
        kind = "bool"
    elif m.dtype.kind == "f" or m.dtype == BFLOAT16:
        kind = "additive"
    else:
        raise DTypeError(f"mask has dtype {m.dtype}; expected bool or a float dtype (additive)")
    if m.ndim > 4:
        raise ShapeError(
            f"mask has shape {m.shape}; expected at most 4 dims broadcastable to {shape}"
        )
    full = (1,) * (4 - m.ndim) + tuple(m.shape)
    if any(a not in (1, b) for a, b in zip(full, shape)):
        raise ShapeError(
            f"mask has shape {m.shape}, which does not broadcast to (B, Hq, Sq, Sk) = {shape}"
        )
    return np.broadcast_to(m.reshape(full), shape), kind


def check_seqlens(cu: Any, name: str, total: int) -> np.ndarray:
    if not is_array(cu):
        raise ArgumentError(
            f"{name} must be an int32 array of shape (B + 1,), got {type(cu).__name__}"
        )
    c = host(cu)
    if c.dtype.kind not in "iu":
        raise ArgumentError(f"{name} has dtype {c.dtype}; expected int32")
    if c.ndim != 1 or c.shape[0] < 1:
        raise ArgumentError(f"{name} has shape {c.shape}; expected (B + 1,) with B >= 0")
    c = c.astype(np.int64)
    if c[0] != 0:
        raise ArgumentError(f"{name}[0] = {c[0]}; expected 0")
    if np.any(np.diff(c) < 0):
        raise ArgumentError(f"{name} = {c.tolist()} must be non-decreasing")
    if c[-1] != total:
        raise ArgumentError(f"{name}[-1] = {c[-1]}; expected the packed length {total}")
    return c
