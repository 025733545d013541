"""One rank's checked context-parallel call: arrays, options, backend (ring and Ulysses alike).

The options are one :class:`AttnOptions` (``attnlib._spec.attn_options``) over the local batch.
Two kinds of option need more than handing it on: :data:`ONCE_PER_ROW` options act once per
query row (a term of the softmax's denominator, such as an attention sink), so only the first
block the ring computes for a query chunk gets them; :data:`PER_HEAD` options have the query
head as their last axis, and Ulysses slices them to its head group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .. import _spec
from ..backends.base import AttnOptions, Backend
from ._comm import Description, check_comm
from ._device import pick, wants_rank_device

#: options that act once per query row: only the first block of a query chunk gets them
ONCE_PER_ROW = ("sinks",)
#: options whose last axis is the query head
PER_HEAD = ("alibi", "sinks")
#: the keyword of ``attention`` an option comes from, where the names differ
_KEYWORD = {"alibi": "alibi_slopes"}


@dataclass(frozen=True)
class Options:
    """The options of ``attention`` a context-parallel call takes (Sq = Sk, so ``causal=True``
    and ``"top_left"`` agree), checked: ``every`` for a query chunk's first block, ``rest``
    (without the once-per-row options) for its others."""

    every: AttnOptions
    rest: AttnOptions

    @property
    def causal(self) -> bool:
        return self.every.causal is not None

    @property
    def window(self) -> tuple[int | None, int | None]:
        return self.every.window_left, self.every.window_right

    def describe(self) -> Description:
        """What the ranks compare of the options."""
        desc = [("causal", "ArgumentError", self.causal)]
        for f in fields(AttnOptions):
            if f.name in ("causal", "window_right", "mask_kind"):
                continue
            value = getattr(self.every, f.name)
            if f.name == "window_left":
                desc.append(("window", "ArgumentError", self.window))
            else:
                desc.append((_KEYWORD.get(f.name, f.name), "ArgumentError",
                             value.tolist() if isinstance(value, np.ndarray) else value))
        return desc

    def block_options(self, first: bool) -> AttnOptions:
        """The options of one ring block (whole: a block has every head); the once-per-row
        options only for the ``first`` block of a query chunk."""
        return self.every if first else self.rest

    def attention_kwargs(self, heads: slice) -> dict[str, Any]:
        """Keywords of ``attnlib.attention`` for the query heads ``heads`` over the whole
        sequence (Ulysses' head group): per-head options sliced along their last axis."""
        kw: dict[str, Any] = dict(causal=self.causal, window=self.window)
        for f in fields(AttnOptions):
            if f.name in ("causal", "window_left", "window_right", "mask_kind"):
                continue
            value = getattr(self.every, f.name)
            if f.name in PER_HEAD and value is not None:
                value = np.ascontiguousarray(value[..., heads])
            kw[_KEYWORD.get(f.name, f.name)] = value
        return kw


def options_of(every: AttnOptions) -> Options:
    return Options(every, replace(every, **{n: None for n in ONCE_PER_ROW}))


def check_options(b: int, hq: int, d: int, **options: Any) -> Options:
    return options_of(_spec.attn_options(d, hq, b, **options))


@dataclass(frozen=True)
class LocalCall:
    """One rank's checked ring or Ulysses call; ``q, k, v`` are bshd views of its shards."""

    q: Any
    k: Any
    v: Any
    rank: int
    size: int
    sharding: str
    layout: str
    opts: Options
    return_lse: bool
    be: Backend
    device: bool  # device arrays (pyopencl) rather than numpy


def check_local(q_l, k_l, v_l, comm, *, sharding, layout, return_lse, backend, heads_split,
                **options) -> tuple[Description, LocalCall]:
    """Validate one rank's call (``heads_split``: Ulysses' head groups): what the ranks compare
    (see :func:`~._comm.collective_check`), and the checked call."""
    rank, size = check_comm(comm)
    sharding = _spec.check_sharding(sharding)
    layout = _spec.check_layout(layout)
    dtype = _spec.check_qkv(q_l, k_l, v_l, ndim=4)
    device = _spec.check_dist_arrays({"q_l": q_l, "k_l": k_l, "v_l": v_l})
    q, k, v = (_spec.to_bshd(x, layout) for x in (q_l, k_l, v_l))
    _spec.check_heads(q.shape, k.shape, v.shape, names=("q_l", "k_l", "v_l"))
    _spec.check_self_attention(q.shape, k.shape, sharding)
    if heads_split:
        _spec.check_head_groups(q.shape[2], k.shape[2], size)
    opts = check_options(q.shape[0], q.shape[2], q.shape[3], **options)
    return_lse = _spec.check_bool(return_lse, "return_lse")
    be = pick(backend, (q, k, v), dtype)
    desc = [
        ("q_l shape", "ShapeError", tuple(q_l.shape)),
        ("k_l shape", "ShapeError", tuple(k_l.shape)),
        ("v_l shape", "ShapeError", tuple(v_l.shape)),
        ("dtype", "DTypeError", str(dtype)),
        ("array kind", "DTypeError", "device" if device else "numpy"),
        ("sharding", "ArgumentError", sharding),
        ("layout", "ArgumentError", layout),
        *opts.describe(),
        ("return_lse", "ArgumentError", return_lse),
        ("backend", "ArgumentError", (be.name, wants_rank_device(be, device))),
    ]
    return desc, LocalCall(q, k, v, rank, size, sharding, layout, opts, return_lse, be, device)
