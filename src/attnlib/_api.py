"""The front door: validate (``_spec``) -> pick the backend (``registry``) -> call it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from . import _plans, _spec, registry
from ._common import RoPE, device_contiguous, empty_lse, from_bshd, pick_backend
from .backends.base import AttnCall, Backend

__all__ = [
    "attention",
    "attention_varlen",
    "softmax",
    "logsumexp",
    "merge_states",
    "rope",
    "RoPE",
    "to_device",
    "to_numpy",
]


@_spec.front_door
@_spec.keywords_checked
def attention(q: Any, k: Any, v: Any, *, scale: float | None = None,
              causal: bool | str = False, window: tuple[int | None, int | None] | None = None,
              mask: Any = None, softcap: float | None = None, alibi_slopes: Any = None,
              sinks: Any = None, layout: str = "bshd", return_lse: bool = False,
              backend: str | Backend | None = None) -> Any:
    """Exact softmax attention, computed tile by tile with an online softmax (no Sq x Sk matrix).

    Shapes (``layout="bshd"``, the default): ``q (B, Sq, Hq, D)``, ``k (B, Sk, Hkv, D)``,
    ``v (B, Sk, Hkv, Dv)`` -> ``out (B, Sq, Hq, Dv)``; ``layout="bhsd"`` takes and returns
    ``(B, H, S, D)`` (PyTorch's order). ``Hq % Hkv == 0``: query head ``h`` reads kv head
    ``h // (Hq // Hkv)`` (GQA, MQA). ``lse`` is ``(B, Hq, Sq)``, natural log, float32 (float64
    for float64 inputs).

    For row ``i``, key ``j`` and ``off = Sk - Sq``: ``s = scale * q_i . k_j`` (scale defaults to
    ``1/sqrt(D)``); ``softcap * tanh(s / softcap)``; ``- alibi_slopes[h] * |i + off - j|``;
    ``+ mask`` (additive) or bool mask (True = attend); then softmax over visible keys.
    ``causal=True`` (= ``"bottom_right"``, FlashAttention's) shows key ``j`` iff
    ``j <= i + off``; ``"top_left"`` (PyTorch's ``is_causal``) iff ``j <= i``. For Sq=2, Sk=5::

        bottom_right      top_left
        1 1 1 1 0         1 0 0 0 0
        1 1 1 1 1         1 1 0 0 0

    ``window=(left, right)`` shows ``i + off - left <= j <= i + off + right`` (None or negative:
    unbounded). Causal, window and mask intersect. A row that sees no key gives 0 and lse -inf.
    ``softcap`` must be > 0 (None disables it; FlashAttention's ``softcap=0.0`` is spelled None).
    ``sinks`` (float32 ``(Hq,)``, gpt-oss's attention sinks): one logit per query head added to
    each row's softmax denominator as a key of value zero (no scale, softcap, ALiBi or mask
    touches it); a row that sees no key then gives 0 and lse = ``sinks[h]``.

    Raises ShapeError, DTypeError, ArgumentError for bad input; UnsupportedError when the chosen
    backend cannot run the call (it never falls back silently).

    >>> import numpy as np, attnlib
    >>> q = np.ones((1, 2, 1, 4), np.float32); k = v = np.ones((1, 3, 1, 4), np.float32)
    >>> attnlib.attention(q, k, v, causal=True, backend="numpy").shape
    (1, 2, 1, 4)
    """
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks)
    key = None
    if mask is None:
        key = _dense_key(q, k, v, options, layout, return_lse, backend)
        hit = _dense_entries.get(key) if key is not None else None
        if hit is not None:
            # the backend is resolved every call (use_backend / set_backend may have changed)
            if _resolves_to(backend, hit):
                be = hit.be
                _spec.check_backend_dtype(be, hit.dtype)  # pick_backend's, asked every call
            else:
                be = pick_backend(backend, (q, k, v), hit.dtype)
            if be is hit.be:
                out, lse = _run(be, hit.call(q, k, v, layout))
                out = from_bshd(out, layout, be)
                return (out, lse) if return_lse else out
    return_lse = _spec.check_bool(return_lse, "return_lse")
    call = _spec.dense_call(q, k, v, mask=mask, layout=layout, need_lse=return_lse, **options)
    be = pick_backend(backend, (q, k, v), call.dtype)
    out, lse = _run(be, call)
    if key is not None:  # every check passed: repeat calls of this key may skip them
        if len(_dense_entries) >= _DENSE_MAX:
            _dense_entries.clear()
        _dense_entries[key] = _DenseEntry(be, call)
    out = from_bshd(out, layout, be)
    return (out, lse) if return_lse else out


# ---- repeat calls of attention(): the checks of a key are done once ------------------------------
_DENSE_MAX = 128
_dense_entries = _plans.table()


def _dense_key(q, k, v, options, layout, return_lse, backend):
    """Everything the checks of :func:`attention` read (no mask): the types, shapes, dtypes and
    strides of q, k, v, the options (:func:`~._spec.option_key`), layout, return_lse and the
    backend; None when some of them are of other types (the full path then runs every time)."""
    opts = _spec.option_key(options)
    if opts is None or type(layout) is not str or type(return_lse) not in (bool, np.bool_):
        return None
    if backend is not None and not isinstance(backend, (str, Backend)):
        return None
    try:
        return (type(q), q.shape, q.dtype, q.strides, type(k), k.shape, k.dtype, k.strides,
                type(v), v.shape, v.dtype, v.strides, opts, layout, type(return_lse), return_lse,
                type(backend), backend)
    except (AttributeError, TypeError):
        return None


def _resolves_to(backend: Any, hit: Any) -> bool:
    """True when :func:`pick_backend` would pick ``hit.be`` for this call, known without the
    registry's lock: the choice in force is that instance, or the name whose shared instance it
    is (for device arrays and no choice: "opencl"). False: ask pick_backend."""
    choice = registry.current_choice(backend)
    if choice is hit.be:
        return True
    if choice is None:
        name = "opencl" if hit.device else None
    elif isinstance(choice, str):
        name = choice.strip()
    else:
        return False
    return name not in (None, "auto") and registry.shared_instance(name) is hit.be


class _DenseEntry:
    """A checked dense call of one key: its backend and AttnCall fields but q, k, v (the
    per-sequence arrays are copied for each call, so no backend shares them)."""

    __slots__ = ("be", "dtype", "fields", "arrays", "device")

    def __init__(self, be: Backend, call: AttnCall) -> None:
        self.be, self.dtype = be, call.dtype
        # the owns() check of pick_backend passed for these array types and this backend
        self.device = _spec.is_device_array(call.q)
        names = ("q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len", "q_pos0",
                 "k_pos0", "causal_hi")
        self.arrays = {n: getattr(call, n) for n in names if getattr(call, n) is not None}
        self.fields = {f.name: getattr(call, f.name) for f in fields(AttnCall)
                       if f.name not in self.arrays and f.name not in ("q", "k", "v")}

    def call(self, q, k, v, layout: str) -> AttnCall:
        if layout != "bshd":
            q, k, v = (_spec.to_bshd(x, layout) for x in (q, k, v))
        values = dict(self.fields, q=q, k=k, v=v)
        for n, a in self.arrays.items():
            values[n] = a.copy()
        return AttnCall(**values)


def _run(be: Backend, call: AttnCall):
    if any(n == 0 for n in call.q.shape[:2]) and isinstance(call.q, np.ndarray):
        # Nothing to compute: keep backends free of zero-size launches.
        b, sq, hq = call.q.shape[:3]
        return (np.zeros((b, sq, hq, call.head_dim_v), call.dtype), empty_lse(call, b, sq))
    return be.attention(call)


@_spec.front_door
@_spec.keywords_checked
def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                     scale: float | None = None, causal: bool | str = False,
                     window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None, alibi_slopes: Any = None, sinks: Any = None,
                     return_lse: bool = False, backend: str | Backend | None = None) -> Any:
    """Attention over a ragged batch packed without padding.

    ``q (total_q, Hq, D)``, ``k (total_k, Hkv, D)``, ``v (total_k, Hkv, Dv)``; sequence ``b``
    is rows ``cu[b]:cu[b+1]`` of each (``cu_seqlens_*``: int32 ``(B + 1,)``, starting at 0,
    non-decreasing, ending at the packed length). Each sequence attends only to itself, with
    causal alignment and window per sequence. ``alibi_slopes``: ``(Hq,)`` or ``(B, Hq)``;
    ``sinks``: float32 ``(Hq,)``, as in :func:`attention`.
    Returns ``out (total_q, Hq, Dv)`` and, with ``return_lse``, ``lse (Hq, total_q)``.
    """
    return_lse = _spec.check_bool(return_lse, "return_lse")
    call = _spec.varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, need_lse=return_lse,
                             scale=scale, causal=causal, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes, sinks=sinks)
    be = pick_backend(backend, (q, k, v), call.dtype)
    out, lse = _run(be, call)
    return (out[0], lse[0]) if return_lse else out[0]


@_spec.front_door
def softmax(x: Any, axis: int = -1, *, backend: str | Backend | None = None) -> Any:
    """Softmax along ``axis`` in one streaming pass (online max and sum); x's dtype out.

    An all -inf row gives zeros (not NaN); NaN propagates.

    >>> import numpy as np, attnlib
    >>> attnlib.softmax(np.array([0.0, np.log(3.0)]), backend="numpy").round(6).tolist()
    [0.25, 0.75]
    """
    _spec.check_array(x, "x")
    dt = _spec.check_float_dtype(x, "x")
    axis = _spec.check_axis(x, axis)
    return pick_backend(backend, (x,), dt).softmax(x, axis, False)


@_spec.front_door
def logsumexp(x: Any, axis: int = -1, *, backend: str | Backend | None = None) -> Any:
    """``log(sum(exp(x)))`` along ``axis``: float32 (float64 for float64 x); -inf for an all
    -inf row."""
    _spec.check_array(x, "x")
    dt = _spec.check_float_dtype(x, "x")
    axis = _spec.check_axis(x, axis)
    return pick_backend(backend, (x,), dt).softmax(x, axis, True)


@_spec.front_door
def merge_states(outs: Sequence[Any], lses: Sequence[Any], *, layout: str = "bshd",
                 backend: str | Backend | None = None) -> tuple[Any, Any]:
    """Merge partial attention states over disjoint key sets (FlashInfer's ``merge_state``).

    Given ``(o_i, lse_i)`` from ``attention(q, k_i, v_i, return_lse=True)``, returns exactly
    ``attention(q, concat k_i, concat v_i, return_lse=True)``: ``lse = log sum exp(lse_i)``,
    ``out = sum exp(lse_i - lse) o_i``. Empty states (lse -inf) contribute nothing; merging
    only empty states gives (0, -inf).
    """
    layout = _spec.check_layout(layout)
    outs, dt = _spec.check_states(outs, lses, layout)
    be = pick_backend(backend, list(outs) + list(lses), dt)
    if layout == "bhsd":
        outs = [o if isinstance(o, np.ndarray) else device_contiguous(o, be) for o in outs]
    out, lse = be.merge_states(outs, lses)
    return from_bshd(out, layout, be), lse


@_spec.front_door
def rope(x: Any, positions: Any, *, theta: float = 10000.0, interleaved: bool = False,
         rotary_dim: int | None = None, layout: str = "bshd",
         backend: str | Backend | None = None) -> Any:
    """Rotate ``x (B, S, H, D)`` (or ``(B, H, S, D)`` with ``layout="bhsd"``) at ``positions``
    (int ``(S,)`` or ``(B, S)``); returns a new array of x's dtype."""
    layout = _spec.check_layout(layout)
    _spec.check_array(x, "x", ndim=4)
    dt = _spec.check_float_dtype(x, "x")
    xb = _spec.to_bshd(x, layout)
    spec = RoPE(theta, interleaved, rotary_dim).spec(xb.shape[3])
    pos = _spec.check_positions(positions, xb.shape[0], xb.shape[1])
    be = pick_backend(backend, (x,), dt)
    return from_bshd(be.rope(xb, pos, spec), layout, be)


@_spec.front_door(wrap=False)
def to_device(x: Any, *, backend: str | Backend | None = None, queue: Any = None) -> Any:
    """Copy a numpy array to the backend's device (numpy backends return it unchanged).
    ``queue=`` (a ``pyopencl.CommandQueue``) copies to that queue's device, in its order."""
    be = pick_backend(backend, (), None, queue=queue)
    _spec.check_host_array(x)
    return be.to_device(x)


@_spec.front_door(wrap=False)
def to_numpy(x: Any) -> np.ndarray:
    """A numpy array from a numpy or device array (a device array is copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    _spec.check_any_array(x)
    return np.asarray(x.get())

