"""The normalised attention calls (dense, varlen) and the arguments of softmax, merge_states
and rope."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import AttnCall
from ..errors import ArgumentError, DTypeError, ShapeError
from ._arrays import (
    check_array,
    check_float_dtype,
    check_int,
    check_layout,
    check_mask,
    check_seqlens,
    host,
    is_device_array,
    same_dtype,
    to_bshd,
)
from ._options import attn_options, causal_bound


# ---- the normalised attention calls -------------------------------------------------------------
def check_qkv(q: Any, k: Any, v: Any, ndim: int) -> np.dtype:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(x, name, ndim=ndim)
    kinds = {name: is_device_array(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) > 1:
        raise ArgumentError(
            "q, k and v must all be numpy arrays or all device arrays of one backend, got "
            + ", ".join(f"{n}: {'device' if d else 'numpy'}" for n, d in kinds.items())
        )
    return same_dtype({"q": q, "k": k, "v": v})


def check_heads(q_shape, k_shape, v_shape, names=("q", "k", "v")) -> None:
    """Shapes in bshd order (B, S, H, D) (or packed (T, H, D)); checks heads and head dims."""
    qn, kn, vn = names
    hq, d = q_shape[-2], q_shape[-1]
    hkv, dk = k_shape[-2], k_shape[-1]
    if d < 1 or v_shape[-1] < 1:
        raise ShapeError(f"head dims must be >= 1, got D={d}, Dv={v_shape[-1]}")
    if dk != d:
        raise ShapeError(f"{kn} has head dim {dk} but {qn} has {d}; they must match")
    if v_shape[-2] != hkv or v_shape[:-2] != k_shape[:-2]:
        raise ShapeError(
            f"{vn} has shape {tuple(v_shape)} but {kn} has {tuple(k_shape)}; they must agree "
            "in every dim but the last"
        )
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ShapeError(
            f"{qn} has {hq} heads and {kn} has {hkv}; need Hq % Hkv == 0 with both >= 1"
        )


def dense_call(q, k, v, *, mask, layout, need_lse: bool, **options: Any) -> AttnCall:
    """The AttnCall of ``attention``; ``options``: its option keywords
    (:func:`~._options.attn_options`)."""
    layout = check_layout(layout)
    check_qkv(q, k, v, ndim=4)
    q, k, v = (to_bshd(x, layout) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    check_heads(q.shape, k.shape, v.shape)
    if k.shape[0] != b:
        raise ShapeError(f"k has batch {k.shape[0]} but q has {b}; they must match")
    mask_view, mask_kind = check_mask(mask, (b, hq, sq, sk))
    options = attn_options(d, hq, b, mask_kind=mask_kind, **options)
    idx = np.arange(b, dtype=np.int64)
    zeros = np.zeros(b, dtype=np.int64)
    off = np.full(b, sk - sq, dtype=np.int64)
    return AttnCall(
        q=q, k=k, v=v,
        q_batch=idx, q_row0=zeros, q_len=np.full(b, sq, dtype=np.int64),
        k_batch=idx, k_row0=zeros, k_len=np.full(b, sk, dtype=np.int64),
        q_pos0=off, k_pos0=zeros, causal_hi=causal_bound(options.causal, off), options=options,
        mask_view=mask_view, dense=True, need_lse=need_lse,
    )


def varlen_call(q, k, v, cu_q, cu_k, *, need_lse: bool, **options: Any) -> AttnCall:
    """The AttnCall of ``attention_varlen``; ``options``: its option keywords."""
    check_qkv(q, k, v, ndim=3)
    check_heads(q.shape, k.shape, v.shape)
    cq = check_seqlens(cu_q, "cu_seqlens_q", q.shape[0])
    ck = check_seqlens(cu_k, "cu_seqlens_k", k.shape[0])
    if cq.shape != ck.shape:
        raise ArgumentError(
            f"cu_seqlens_q has {cq.shape[0] - 1} sequences but cu_seqlens_k has {ck.shape[0] - 1}"
        )
    n = cq.shape[0] - 1
    q_len, k_len = np.diff(cq), np.diff(ck)
    off = k_len - q_len
    options = attn_options(q.shape[-1], q.shape[1], n, **options)
    zeros = np.zeros(n, dtype=np.int64)
    return AttnCall(
        q=add_batch_dim(q), k=add_batch_dim(k), v=add_batch_dim(v),
        q_batch=zeros, q_row0=cq[:-1].copy(), q_len=q_len,
        k_batch=zeros, k_row0=ck[:-1].copy(), k_len=k_len,
        q_pos0=off, k_pos0=zeros, causal_hi=causal_bound(options.causal, off), options=options,
        need_lse=need_lse,
    )


def add_batch_dim(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x[None]
    return x.reshape((1,) + tuple(x.shape))


# ---- softmax, merge_states, rope -----------------------------------------------------------------
def check_axis(x: Any, axis: Any) -> int:
    """``axis`` of ``x`` (negative counts from the end) as an index in ``[0, x.ndim)``."""
    axis = check_int(axis, "axis")
    nd = len(x.shape)
    if nd == 0:
        raise ShapeError("x must have at least 1 dim, got a 0-d array")
    if not -nd <= axis < nd:
        raise ArgumentError(f"axis={axis} is out of range for x with {nd} dims")
    return axis % nd


def check_states(outs: Any, lses: Any, layout: str) -> tuple[list[Any], np.dtype]:
    """``merge_states``' partial states: equal-length lists of ``out (B, Sq, H, Dv)`` (in
    ``layout``) and ``lse (B, H, Sq)``, one shape each. Returns the outs in bshd and their
    dtype."""
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise ArgumentError("outs and lses must be lists (or tuples) of arrays")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ArgumentError(
            f"outs and lses must be non-empty and of equal length, got {len(outs)} and {len(lses)}"
        )
    for i, (o, lse) in enumerate(zip(outs, lses)):
        check_array(o, f"outs[{i}]", ndim=4)
        check_array(lse, f"lses[{i}]", ndim=3)
        check_float_dtype(lse, f"lses[{i}]")
    dt = same_dtype({f"outs[{i}]": o for i, o in enumerate(outs)})
    outs = [to_bshd(o, layout) for o in outs]
    b, sq, h, _ = outs[0].shape
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != tuple(outs[0].shape):
            raise ShapeError(
                f"outs[{i}] has shape {tuple(o.shape)}; expected {tuple(outs[0].shape)}"
            )
        if tuple(lse.shape) != (b, h, sq):
            raise ShapeError(f"lses[{i}] has shape {tuple(lse.shape)}; expected {(b, h, sq)}")
    return outs, dt


def check_rotary_dim(rotary_dim: Any) -> int | None:
    """``RoPE(rotary_dim=)``: None (all of D) or an even int >= 2."""
    if rotary_dim is None:
        return None
    rotary_dim = check_int(rotary_dim, "rotary_dim", minimum=2)
    if rotary_dim % 2:
        raise ArgumentError(f"rotary_dim={rotary_dim} must be even")
    return rotary_dim


def check_rotary_fits(rotary_dim: int | None, head_dim: int) -> int:
    """The dims that rotate (``rotary_dim``, None: the head dim): even and <= the head dim."""
    r = head_dim if rotary_dim is None else rotary_dim
    if r > head_dim or r % 2:
        raise ArgumentError(
            f"rotary_dim={r} must be even and <= the head dim {head_dim}"
            + (" (the default rotary_dim is D)" if rotary_dim is None else "")
        )
    return r


def check_rope_type(rope_arg: Any, rope_type: type) -> None:
    """``rope=`` is None or an ``attnlib.RoPE`` (``rope_type``)."""
    if rope_arg is not None and not isinstance(rope_arg, rope_type):
        raise ArgumentError(f"rope must be None or an attnlib.RoPE, got {type(rope_arg).__name__}")


def check_positions(positions: Any, b: int, s: int) -> np.ndarray:
    """Rotary positions, int ``(s,)`` or ``(b, s)``, as int64 ``(b, s)``."""
    check_array(positions, "positions", ndim=(1, 2))
    p = host(positions)
    if p.dtype.kind not in "iu":
        raise DTypeError(f"positions has dtype {p.dtype}; expected an integer dtype")
    if p.shape not in ((s,), (b, s)):
        raise ShapeError(f"positions has shape {p.shape}; expected ({s},) or ({b}, {s})")
    return np.ascontiguousarray(np.broadcast_to(p.astype(np.int64), (b, s)))
