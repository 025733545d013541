"""What both NVIDIA tensor-core kernels (``_nvidia_mma``, ``_nvidia_decode``) take of a call
besides their options: the per-sequence table and the work list of (sequence, first row) tiles
(on the device, memoised by the values they are made from), the q, k, v buffers with their
offsets and strides, the ALiBi slopes, the sinks, the mask and the softmax scalars."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ... import _plans
from ..base import AttnCall
from ._arrays import is_cl_array

SEQ_FIELDS = 9
BIG = 1 << 40  # an unbounded side of the visible key range
_LOG2E = 1.4426950408889634

_lock = threading.Lock()
#: device tables and slopes, by the values they are made from; the last _MEMO_MAX
_memo: OrderedDict[tuple, Any] = OrderedDict()
_plans.register(_memo)
_MEMO_MAX = 256


def _memoised(key: tuple, make: Any) -> Any:
    """``make()``, remembered under ``key`` (least recently used dropped past _MEMO_MAX)."""
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            _memo.move_to_end(key)
            return hit
    value = make()
    with _lock:
        _memo[key] = value
        while len(_memo) > _MEMO_MAX:
            _memo.popitem(last=False)
    return value


def _device_copy(ctx: Any, host: np.ndarray) -> Any:
    """A read-only device copy of a small host array (at least one element)."""
    import pyopencl as cl

    host = np.ascontiguousarray(host) if host.size else np.zeros(1, host.dtype)
    return cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)


def tables_on_device(ctx: Any, call: AttnCall, block_m: int,
                      block_n: int) -> tuple[Any, Any, int]:
    """(sequence table, tile table, number of tiles) on the device for ``call``, remembered by
    the values :func:`tables` reads: repeated calls of one shape (the common case) skip its ~20
    small numpy operations and two uploads per call (a large part of the host's cost of a
    prefill call, bench/RESULTS.md). The buffers are never written after they
    are made, so calls and queues of the context share them."""
    fields = (call.q_batch, call.q_row0, call.q_len, call.k_batch, call.k_row0, call.k_len,
              call.q_pos0, call.k_pos0, call.causal_hi)
    key = ("tables", ctx.int_ptr, block_m, block_n, call.options.window_left,
           call.options.window_right,
           *(None if f is None else np.asarray(f, np.int64).tobytes() for f in fields))

    def make() -> tuple[Any, Any, int]:
        seqs, tiles = tables(call, block_m, block_n)
        return _device_copy(ctx, seqs), _device_copy(ctx, tiles), tiles.shape[0]

    return _memoised(key, make)


def tables(call: AttnCall, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence fields for the kernel and the work list of (sequence, first row) tiles,
    heaviest first (causal blocks near the diagonal see more keys and should start early)."""
    n = call.n_seq
    seqs = np.zeros((n, SEQ_FIELDS), np.int64)
    seqs[:, 0], seqs[:, 1], seqs[:, 2] = call.q_batch, call.q_row0, call.q_len
    seqs[:, 3], seqs[:, 4], seqs[:, 5] = call.k_batch, call.k_row0, call.k_len
    seqs[:, 6] = np.asarray(call.q_pos0, np.int64) - np.asarray(call.k_pos0, np.int64)
    seqs[:, 7] = -call.options.window_left if call.options.window_left is not None else -BIG
    hi = np.full(n, BIG, np.int64)
    if call.causal_hi is not None:
        hi = np.minimum(hi, np.asarray(call.causal_hi, np.int64))
    if call.options.window_right is not None:
        hi = np.minimum(hi, call.options.window_right)
    seqs[:, 8] = hi
    q_len = np.asarray(call.q_len, np.int64)
    counts = (q_len + block_m - 1) // block_m
    sid = np.repeat(np.arange(n, dtype=np.int64), counts)
    first = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                    counts)
    m0 = first * block_m
    if sid.size:
        # key tiles each work-group visits (same arithmetic as the kernel), for the order only
        k_len = seqs[sid, 5]
        last = np.minimum(m0 + block_m, q_len[sid]) - 1
        lo = np.clip(m0 + seqs[sid, 6] + seqs[sid, 7], 0, k_len)
        hi_r = np.clip(last + seqs[sid, 6] + seqs[sid, 8], -1, k_len - 1)
        work = np.where(hi_r >= lo, hi_r // block_n - lo // block_n + 1, 0)
        order = np.argsort(-work, kind="stable")
        sid, m0 = sid[order], m0[order]
    tiles = np.stack([sid, m0], axis=1).astype(np.int32)
    return np.ascontiguousarray(seqs), np.ascontiguousarray(tiles)


def buffers(ctx: Any, call: AttnCall) -> list:
    """The q, k, v buffers of a call: device arrays' own, host arrays uploaded contiguous."""
    import pyopencl as cl

    bufs = []
    for x in (call.q, call.k, call.v):
        if is_cl_array(x):
            bufs.append(x.base_data)
            continue
        h = np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")
        if h.size == 0:
            h = np.zeros(16 // x.dtype.itemsize, h.dtype)
        bufs.append(cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                              hostbuf=h))
    return bufs


def geometry(call: AttnCall) -> list:
    """(element offset, element strides of dims 0..2) of q, k and v as int64 arguments: in
    place for device arrays, contiguous for host arrays (as :func:`buffers` uploads them)."""
    out = []
    for x in (call.q, call.k, call.v):
        item = x.dtype.itemsize
        if is_cl_array(x):
            off, strides = x.offset // item, tuple(st // item for st in x.strides[:3])
        else:
            sh = x.shape
            off, strides = 0, (sh[1] * sh[2] * sh[3], sh[2] * sh[3], sh[3])
        out += [np.int64(n) for n in (off, *strides)]
    return out


def scalars(call: AttnCall) -> list:
    """(qk_scale, cap) as float32: the scale (over softcap when there is one) and the softcap
    folded with log2(e) for the exp2-domain softmax."""
    if call.options.softcap is not None:
        qk_scale, cap = call.options.scale / call.options.softcap, call.options.softcap * _LOG2E
    else:
        qk_scale, cap = call.options.scale * _LOG2E, 0.0
    return [np.float32(qk_scale), np.float32(cap)]


def slopes(ctx: Any, call: AttnCall) -> Any:
    """The call's ALiBi slopes times log2(e) on the device (memoised by value)."""
    values = np.asarray(call.options.alibi, np.float32) * np.float32(_LOG2E)
    return _memoised(("slopes", ctx.int_ptr, values.shape, values.tobytes()),
                     lambda: _device_copy(ctx, values))


def mask_args(ctx: Any, call: AttnCall) -> list:
    """The prefill kernels' mask arguments: (buffer, element offset, element strides over
    sequence, head, row, key), the strides 0 where the mask broadcasts. The unbroadcast mask is
    uploaded: bool as uint8, additive float16 / bfloat16 as they are (the kernel reads them as
    float32, exactly), other additive dtypes as float32 (the contract reads them as float32 or
    wider)."""
    i64 = np.int64
    mv = call.mask_view
    base = mv[tuple(slice(0, 1) if st == 0 else slice(None) for st in mv.strides)]
    if call.options.mask_kind == "bool":
        base = np.ascontiguousarray(base).view(np.uint8)  # (no copy of a contiguous mask)
    elif base.dtype.itemsize == 2 and base.dtype.kind in "fV":  # float16, bfloat16
        base = np.ascontiguousarray(base).view(np.uint16)  # the bits: a plain buffer's dtype
    else:
        base = np.ascontiguousarray(base, np.float32)
    strides = [0 if n == 1 else st // base.itemsize for st, n in zip(base.strides, base.shape)]
    return [_device_copy(ctx, base), i64(0), *(i64(st) for st in strides)]


def mask_tile_args(ctx: Any, call: AttnCall, block_m: int, block_n: int) -> list:
    """The prefill kernel's key-tile ranges of a masked call on the device, with their element
    strides over sequence, head and row block (0 where the mask broadcasts). The kernel visits
    no key tile outside its block's range: tiles a bool mask hides from every row of a block are
    skipped (:func:`mask_tile_ranges`, under a millisecond of host time for a 4096 x 4096 mask).
    Additive masks take one unbounded range (every tile; their scan would cost several times
    that, and a -inf-only block is rare in them)."""
    if call.options.mask_kind == "bool":
        table = mask_tile_ranges(call.mask_view, block_m, block_n)
    else:
        table = np.array([[[[0, 1 << 30]]]], np.int32)
    strides = [0 if n == 1 else st // 4 for st, n in zip(table.strides[:3], table.shape[:3])]
    return [_device_copy(ctx, table), *(np.int64(st) for st in strides)]


def mask_tile_ranges(mask_view: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Per (sequence, head, block of ``block_m`` query rows) of an unbroadcast bool mask, the
    first and last key tile (``block_n`` keys) in which some row of the block sees some key, as
    an int32 array (n_seq or 1, Hq or 1, row blocks or 1, 2); last < first where the mask hides
    every key from the block. A side the mask broadcasts over keys is unbounded (2**30). The
    rows of a block are reduced first (contiguous rows, no copy of the mask)."""
    vis = mask_view[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask_view.strides)]
    n0, n1, r, nk = vis.shape
    bm, bn = (block_m if r > 1 else 1), (block_n if nk > 1 else 1)
    rb, kt = -(-r // bm), -(-nk // bn)
    if r % bm:  # the last block's missing rows see nothing
        vis = np.concatenate([vis, np.zeros((n0, n1, rb * bm - r, nk), bool)], axis=2)
    rows = vis.reshape(n0, n1, rb, bm, nk).any(axis=3)
    if nk % bn:
        rows = np.concatenate([rows, np.zeros((n0, n1, rb, kt * bn - nk), bool)], axis=3)
    seen = rows.reshape(n0, n1, rb, kt, bn).any(axis=4)
    some = seen.any(axis=3)
    table = np.empty((n0, n1, rb, 2), np.int32)
    if nk > 1:
        table[..., 0] = np.where(some, seen.argmax(axis=3), 1 << 30)
        table[..., 1] = np.where(some, kt - 1 - seen[..., ::-1].argmax(axis=3), -1)
    else:  # every key alike: all tiles or none
        table[..., 0] = np.where(some, 0, 1 << 30)
        table[..., 1] = np.where(some, 1 << 30, -1)
    return table
