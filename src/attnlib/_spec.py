"""Every check of user input lives here: the front door turns arguments into normalised calls.

Each check raises a member of the AttnlibError family whose message names the argument, the value
received and what was expected. Nothing here touches a device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .backends.base import AttnCall
from .errors import (
    ArgumentError,
    BackendUnavailableError,
    CacheOverflowError,
    DTypeError,
    ShapeError,
    UnsupportedError,
)

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


# ---- the normalised attention calls -------------------------------------------------------------
def _causal_hi(causal: str | None, off: np.ndarray) -> np.ndarray | None:
    """Upper bound on kpos - qpos: 0 bottom-right; top-left j <= i is kpos - qpos <= -off."""
    if causal is None:
        return None
    return np.zeros_like(off) if causal == "bottom_right" else -off


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


def dense_call(q, k, v, *, scale, causal, window, mask, softcap, alibi_slopes, layout,
               need_lse: bool) -> AttnCall:
    layout = check_layout(layout)
    check_qkv(q, k, v, ndim=4)
    q, k, v = (to_bshd(x, layout) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    check_heads(q.shape, k.shape, v.shape)
    if k.shape[0] != b:
        raise ShapeError(f"k has batch {k.shape[0]} but q has {b}; they must match")
    causal = check_causal(causal)
    left, right = check_window(window)
    mask_view, mask_kind = check_mask(mask, (b, hq, sq, sk))
    idx = np.arange(b, dtype=np.int64)
    zeros = np.zeros(b, dtype=np.int64)
    off = np.full(b, sk - sq, dtype=np.int64)
    return AttnCall(
        q=q, k=k, v=v,
        q_batch=idx, q_row0=zeros, q_len=np.full(b, sq, dtype=np.int64),
        k_batch=idx, k_row0=zeros, k_len=np.full(b, sk, dtype=np.int64),
        q_pos0=off, k_pos0=zeros, causal_hi=_causal_hi(causal, off),
        scale=check_scale(scale, d), window_left=left, window_right=right,
        softcap=check_softcap(softcap), alibi=check_alibi(alibi_slopes, b, hq),
        mask_view=mask_view, mask_kind=mask_kind, dense=True, need_lse=need_lse,
    )


def varlen_call(q, k, v, cu_q, cu_k, *, scale, causal, window, softcap, alibi_slopes,
                need_lse: bool) -> AttnCall:
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
    causal = check_causal(causal)
    left, right = check_window(window)
    zeros = np.zeros(n, dtype=np.int64)
    return AttnCall(
        q=add_batch_dim(q), k=add_batch_dim(k), v=add_batch_dim(v),
        q_batch=zeros, q_row0=cq[:-1].copy(), q_len=q_len,
        k_batch=zeros, k_row0=ck[:-1].copy(), k_len=k_len,
        q_pos0=off, k_pos0=zeros, causal_hi=_causal_hi(causal, off),
        scale=check_scale(scale, q.shape[-1]), window_left=left, window_right=right,
        softcap=check_softcap(softcap), alibi=check_alibi(alibi_slopes, n, q.shape[1]),
        need_lse=need_lse,
    )


def add_batch_dim(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x[None]
    return x.reshape((1,) + tuple(x.shape))


# ---- the paged KV cache (SPEC section 8) ---------------------------------------------------------
def check_int_list(x: Any, name: str) -> np.ndarray:
    """An int, a list/tuple of ints or a 1-D int array as int64 (B,) (ids, lengths)."""
    if is_array(x):
        a = host(x)
        if a.dtype.kind not in "iu" or a.ndim != 1:
            raise ArgumentError(f"{name} must be an int or ints (B,), got {a.dtype} {a.shape}")
        return a.astype(np.int64)
    if isinstance(x, (list, tuple)):
        return np.array([check_int(i, f"{name}[{n}]") for n, i in enumerate(x)], np.int64)
    return np.array([check_int(x, name)], np.int64)


def check_sids(sids: Any, known: Any, name: str = "sids") -> np.ndarray:
    """Sequence ids of a paged cache: each one live (in ``known``), none twice."""
    ids = check_int_list(sids, name)
    for i in ids.tolist():
        if i not in known:
            raise ArgumentError(
                f"{name} holds {i}, which is not a live sequence of this cache (unknown or freed)"
            )
    if np.unique(ids).size != ids.size:
        raise ArgumentError(f"{name}={ids.tolist()} names a sequence twice; ids must be distinct")
    return ids


def check_sid(sid: Any, known: Any, name: str = "sid") -> int:
    """One live sequence id of a paged cache."""
    sid = check_int(sid, name)
    if sid not in known:
        raise ArgumentError(
            f"{name}={sid} is not a live sequence of this cache (unknown or freed)"
        )
    return sid


def check_packed(x: Any, name: str, n_seq: int, cu: Any, cu_name: str, heads: int, dim: int,
                 dtype: np.dtype, heads_name: str = "n_kv_heads",
                 dim_name: str = "head_dim") -> np.ndarray:
    """``x`` either ``(n_seq, S, heads, dim)`` (``cu`` None) or packed ``(total, heads, dim)``
    split by ``cu`` (int (n_seq + 1,)); returns int64 (n_seq,) rows per sequence. dtype exact."""
    check_array(x, name, ndim=4 if cu is None else 3)
    if np.dtype(x.dtype) != dtype:
        raise DTypeError(f"{name} has dtype {x.dtype}; this cache holds {dtype} (nothing is cast)")
    if tuple(x.shape[-2:]) != (heads, dim):
        lead = "(B, S, " if cu is None else "(total, "
        raise ShapeError(
            f"{name} has shape {tuple(x.shape)}; expected {lead}{heads_name}={heads}, "
            f"{dim_name}={dim})"
        )
    if cu is None:
        if x.shape[0] != n_seq:
            raise ShapeError(f"{name} has batch {x.shape[0]} but {n_seq} sequence ids were given")
        return np.full(n_seq, x.shape[1], np.int64)
    c = check_seqlens(cu, cu_name, x.shape[0])
    if c.shape[0] != n_seq + 1:
        raise ArgumentError(
            f"{cu_name} has {c.shape[0] - 1} sequences but {n_seq} sequence ids were given"
        )
    return np.diff(c)


def check_query_rows(q_len: np.ndarray, k_len: np.ndarray, what: str) -> None:
    """More query rows than a sequence holds is a ShapeError (SPEC sections 4 and 8)."""
    short = k_len < q_len
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise ShapeError(
            f"q has {int(q_len[i])} rows for {what} {i} but it holds only {int(k_len[i])} "
            "tokens; query rows must be <= each sequence's length"
        )


def check_page_table(block_table: Any, seq_lens: Any, n_seq: int, num_pages: int,
                     page_size: int) -> tuple[Any, np.ndarray]:
    """``paged_attention``'s caller-owned ``block_table`` (int32/int64 ``(B, max_pages)``) and
    ``seq_lens`` (int ``(B,)``, read to the host). A host table is checked entry by entry: every
    page a sequence needs must be in ``[0, num_pages)``. A device table is taken as given (the
    kernels clamp page indices into the pool). Returns (table, int64 seq_lens)."""
    check_array(block_table, "block_table", ndim=2)
    if np.dtype(block_table.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise DTypeError(f"block_table has dtype {block_table.dtype}; expected int32 (or int64)")
    if block_table.shape[0] != n_seq:
        raise ShapeError(
            f"block_table has shape {tuple(block_table.shape)}; expected ({n_seq}, max_pages)"
        )
    check_array(seq_lens, "seq_lens", ndim=1)
    lens = host(seq_lens)
    if lens.dtype.kind not in "iu":
        raise DTypeError(f"seq_lens has dtype {lens.dtype}; expected int32")
    if lens.shape != (n_seq,):
        raise ShapeError(f"seq_lens has shape {lens.shape}; expected ({n_seq},)")
    lens = lens.astype(np.int64)
    cap = int(block_table.shape[1]) * page_size
    bad = (lens < 0) | (lens > cap)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ArgumentError(
            f"seq_lens[{i}] = {int(lens[i])}; expected 0 <= seq_lens <= max_pages * page_size "
            f"= {cap}"
        )
    if isinstance(block_table, np.ndarray):
        need = -(-lens // page_size)
        used = np.arange(block_table.shape[1])[None, :] < need[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bad.any():
            b, j = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(
                f"block_table[{b}, {j}] = {int(block_table[b, j])}, but sequence {b} holds "
                f"{int(lens[b])} tokens and needs that page; expected a page in "
                f"[0, {num_pages})"
            )
    return block_table, lens


def check_truncate_length(length: int, sid: int, held: int) -> None:
    """``truncate`` only shortens: ``length`` at most the ``held`` tokens of sequence ``sid``."""
    if length > held:
        raise ArgumentError(
            f"length={length} is beyond sequence {sid}'s length {held}; truncate only "
            "shortens"
        )


def check_paged_kv_agree(k: Any, v: Any, n_k: np.ndarray, n_v: np.ndarray) -> None:
    """k and v of one append agree in every dim but the last (rows per sequence included)."""
    if tuple(k.shape[:-2]) != tuple(v.shape[:-2]) or not np.array_equal(n_k, n_v):
        raise ShapeError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they "
                         "must agree in every dim but the last")


def check_paged_kv_arrays(k: Any, v: Any, be: Any) -> None:
    """k and v both numpy arrays or both device arrays of the cache's backend ``be``."""
    if is_device_array(k) != is_device_array(v) or (is_device_array(k) and not be.owns(k)):
        raise ArgumentError(
            f"k and v must both be numpy arrays or both arrays of the cache's backend "
            f"{be.name!r}, got {type(k).__name__} and {type(v).__name__}"
        )


def check_pages_free(taken: int, n_free: int, num_pages: int) -> None:
    """An append needing ``taken`` pages (copies-on-write included) fits the ``n_free`` free."""
    if taken > n_free:
        raise CacheOverflowError(
            f"this append needs {taken} free pages (copies-on-write included) but "
            f"{n_free} of {num_pages} are free; the cache is unchanged"
        )


def paged_queries(q: Any, cu_seqlens_q: Any,
                  n_seq: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """q ``(B, Sq, Hq, D)`` or packed ``(total_q, Hq, D)`` with ``cu_seqlens_q``, for ``n_seq``
    sequences: (q as 4-D, q_batch, q_row0, q_len)."""
    if cu_seqlens_q is None:
        check_array(q, "q", ndim=4)
        if q.shape[0] != n_seq:
            raise ShapeError(f"q has batch {q.shape[0]} but there are {n_seq} sequences")
        return (q, np.arange(n_seq, dtype=np.int64), np.zeros(n_seq, np.int64),
                np.full(n_seq, q.shape[1], np.int64))
    check_array(q, "q", ndim=3)
    c = check_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    if c.shape[0] != n_seq + 1:
        raise ArgumentError(
            f"cu_seqlens_q has {c.shape[0] - 1} sequences but there are {n_seq}"
        )
    return (add_batch_dim(q), np.zeros(n_seq, np.int64), c[:-1].copy(), np.diff(c))


def check_page_pool(k_pages: Any) -> None:
    """A caller-owned pool ``(num_pages, page_size, Hkv, D)`` has a page and a slot."""
    if int(k_pages.shape[1]) < 1 or int(k_pages.shape[0]) < 1:
        raise ShapeError(f"k_pages has shape {tuple(k_pages.shape)}; expected at least one "
                         "page of at least one slot")


# ---- the KV cache (SPEC section 7) ---------------------------------------------------------------
def check_cache_rows(index: Any, name: str, b: int | None, max_batch_size: int) -> np.ndarray:
    """Cache rows as int64: ``None`` is every row (or the first ``b``), else an int, a list /
    tuple of ints or an int array ``(b,)``, each in ``[0, max_batch_size)``."""
    if index is None:
        return np.arange(max_batch_size if b is None else b, dtype=np.int64)
    if is_array(index):
        idx = host(index)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise ArgumentError(
                f"{name} must be an int array (B,), got {idx.dtype} {idx.shape}"
            )
        idx = idx.astype(np.int64)
    elif isinstance(index, (list, tuple)):
        idx = np.array([check_int(i, name) for i in index], dtype=np.int64)
    else:
        idx = np.array([check_int(index, name)], dtype=np.int64)
    if b is not None and idx.shape != (b,):
        raise ShapeError(f"{name} has shape {idx.shape}; expected ({b},)")
    if idx.size and (idx.min() < 0 or idx.max() >= max_batch_size):
        raise ArgumentError(
            f"{name}={idx.tolist()} has entries outside [0, {max_batch_size})"
        )
    return idx


def check_distinct_rows(rows: np.ndarray) -> None:
    """A write names each cache row at most once."""
    if rows.shape[0] > 1 and len(np.unique(rows)) != rows.shape[0]:
        raise ArgumentError(f"batch_idx={rows.tolist()} writes one cache row twice")


def check_cache_kv(k: Any, v: Any, b: int | None, dtype: np.dtype, n_kv_heads: int,
                   head_dim: int, head_dim_v: int, max_batch_size: int) -> int:
    """New keys ``(B, S_new, n_kv_heads, head_dim)`` and values ``(..., head_dim_v)`` of the
    cache's dtype; ``b``: q's batch when there is a q. Returns B."""
    for name, x, d in (("k", k, head_dim), ("v", v, head_dim_v)):
        check_array(x, name, ndim=4)
        if np.dtype(x.dtype) != dtype:
            raise DTypeError(f"{name} has dtype {x.dtype}; this cache holds {dtype}")
        if x.shape[2] != n_kv_heads or x.shape[3] != d:
            raise ShapeError(
                f"{name} has shape {tuple(x.shape)}; expected "
                f"(B, S_new, {n_kv_heads}, {d})"
            )
    if tuple(k.shape[:2]) != tuple(v.shape[:2]):
        raise ShapeError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    if b is not None and k.shape[0] != b:
        raise ShapeError(f"k has batch {k.shape[0]} but q has {b}")
    if k.shape[0] > max_batch_size:
        raise ShapeError(f"k has batch {k.shape[0]} > max_batch_size={max_batch_size}")
    return k.shape[0]


def check_start_pos(start_pos: Any, b: int) -> np.ndarray:
    """``start_pos`` (an int or an int array ``(b,)``, each >= 0) as int64 ``(b,)``."""
    if type(start_pos) is int:  # the common case, without the generic checks' cost
        sp = np.full(b, start_pos, dtype=np.int64)
        if start_pos < 0:
            raise ArgumentError(f"start_pos={sp.tolist()} must be >= 0")
        return sp
    if is_array(start_pos):
        sp = host(start_pos)
        if sp.dtype.kind not in "iu":
            raise ArgumentError(f"start_pos has dtype {sp.dtype}; expected an int or int array")
        if sp.shape != (b,):
            raise ArgumentError(f"start_pos has shape {sp.shape}; expected ({b},)")
        sp = sp.astype(np.int64)
    else:
        sp = np.full(b, check_int(start_pos, "start_pos"), dtype=np.int64)
    if (sp < 0).any():
        raise ArgumentError(f"start_pos={sp.tolist()} must be >= 0")
    return sp


def _first(bad: np.ndarray) -> int:
    """Index of the first offending row, for the error message."""
    return int(np.flatnonzero(bad)[0])


def check_cache_write(rows: np.ndarray, start: np.ndarray, cur: np.ndarray, lo: np.ndarray,
                      n_new: int, cap: int, ring: bool) -> tuple[np.ndarray, np.ndarray]:
    """Writing ``n_new`` tokens at ``start`` into cache ``rows`` that hold positions
    ``[lo, cur)``: no gap; within ``cap`` slots (``ring=False``), or at most ``cap`` tokens and
    no position the ring no longer holds. Returns (new lengths, new first held positions)."""
    gap = start > cur
    if gap.any():
        i = _first(gap)
        raise ArgumentError(
            f"start_pos={int(start[i])} for cache row {int(rows[i])} leaves a gap: that row "
            f"holds {int(cur[i])} tokens, so start_pos must be <= {int(cur[i])}"
        )
    end = start + n_new
    if not ring:
        over = end > cap
        if over.any():
            i = _first(over)
            raise CacheOverflowError(
                f"writing {n_new} tokens at start_pos={int(start[i])} into cache row "
                f"{int(rows[i])} needs {int(end[i])} slots > max_seq_len={cap} (ring=False); "
                "the cache is unchanged"
            )
        return end, lo.copy()
    if n_new > cap:
        raise CacheOverflowError(
            f"k has {n_new} new tokens but a ring cache holds at most max_seq_len={cap} "
            "per update; the cache is unchanged"
        )
    stale = start < lo
    if stale.any():
        i = _first(stale)
        raise ArgumentError(
            f"start_pos={int(start[i])} for cache row {int(rows[i])} rewrites a position no "
            f"longer held (this ring holds positions {int(lo[i])}..{int(cur[i]) - 1})"
        )
    return end, np.maximum(lo, end - cap)


def check_cache_append_one(row: int, cur: int, lo: int, n_new: int, cap: int,
                           ring: bool) -> tuple[int, int]:
    """:func:`check_cache_write` for one cache row appending at its length (the decode step),
    on plain ints; a failing check raises through :func:`check_cache_write`."""
    end = cur + n_new
    if ring:
        if n_new > cap:
            _raise_append(row, cur, lo, n_new, cap, ring)
        return end, max(lo, end - cap)
    if end > cap:
        _raise_append(row, cur, lo, n_new, cap, ring)
    return end, lo


def _raise_append(row: int, cur: int, lo: int, n_new: int, cap: int, ring: bool) -> None:
    one = np.array([cur], np.int64)
    check_cache_write(np.array([row], np.int64), one, one, np.array([lo], np.int64), n_new,
                      cap, ring)


def check_cache_query(q: Any, dtype: np.dtype, head_dim: int, n_kv_heads: int,
                      max_batch_size: int, rows_given: bool) -> tuple[int, int, int, int]:
    """q ``(B, Sq, Hq, head_dim)`` of the cache's dtype, ``Hq`` a multiple of ``n_kv_heads``,
    ``B <= max_batch_size`` unless ``batch_idx`` maps it. Returns q's shape."""
    check_array(q, "q", ndim=4)
    check_cache_query_kind(q, dtype, head_dim, n_kv_heads)
    b, sq, hq, d = q.shape
    if b > max_batch_size and not rows_given:
        raise ShapeError(f"q has batch {b} > max_batch_size={max_batch_size}")
    return b, sq, hq, d


def check_cache_query_kind(q: Any, dtype: np.dtype, head_dim: int, n_kv_heads: int) -> None:
    """A 4-D q of a cache (KVCache or PagedKVCache): the cache's dtype and head_dim, ``Hq`` a
    multiple of ``n_kv_heads``."""
    if np.dtype(q.dtype) != dtype:
        raise DTypeError(f"q has dtype {q.dtype}; this cache holds {dtype}")
    hq, d = q.shape[2], q.shape[3]
    if d != head_dim:
        raise ShapeError(f"q has head dim {d}; this cache holds head_dim={head_dim}")
    if hq < 1 or hq % n_kv_heads:
        raise ShapeError(f"q has {hq} heads; need a multiple of n_kv_heads={n_kv_heads}")


def check_cache_instance(cache: Any, cls: type) -> None:
    """``cache`` is an instance of the cache class ``cls`` (KVCache or PagedKVCache)."""
    if not isinstance(cache, cls):
        raise ArgumentError(f"cache must be an attnlib.{cls.__name__}, got {type(cache).__name__}")


def check_cache_backend(backend: Any, chosen: Any, be: Any) -> None:
    """``backend=`` beside a cache (``chosen``: what it names) must be the cache's ``be``."""
    if backend is not None and chosen is not be:
        raise ArgumentError(
            f"backend={backend!r} differs from the cache's backend {be.name!r}; attention over a "
            "cache runs where the cache lives"
        )


def check_kv_given(k: Any, v: Any, start_pos: Any) -> None:
    """``k`` and ``v`` together or neither; ``start_pos`` only with them."""
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (or both left out)")
    if k is None and start_pos is not None:
        raise ArgumentError("start_pos was given without k and v; there is nothing to write")


def check_held(rows: np.ndarray, new_len: np.ndarray, sq: int) -> None:
    """Each cache row holds at least Sq tokens (after the append)."""
    short = new_len < sq
    if short.any():
        i = _first(short)
        raise ShapeError(
            f"q has Sq={sq} rows but cache row {int(rows[i])} holds only {int(new_len[i])} "
            "tokens; Sq must be <= each sequence's length"
        )


def check_held_one(row: int, length: int, sq: int) -> None:
    """:func:`check_held` for one cache row, on plain ints."""
    if length < sq:
        check_held(np.array([row], np.int64), np.array([length], np.int64), sq)


def check_readable(x: Any, name: str, be: Any) -> None:
    """A device array ``x`` must belong to the backend ``be`` (the cache's)."""
    if is_device_array(x) and not be.owns(x):
        raise ArgumentError(
            f"{name} is a {type(x).__module__}.{type(x).__name__} array, which the cache's "
            f"backend {be.name!r} cannot read"
        )


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
