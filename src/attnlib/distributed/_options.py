"""One rank's checked context-parallel call: arrays, options, backend (ring and Ulysses alike).

Per-head options (ALiBi slopes) are checked once into arrays whose last axis is the query head,
kept by name in ``Options.per_head``; :data:`PER_HEAD` says how each is checked, which
:class:`AttnCall` field it fills, and whether it acts on every key (ALiBi: every block of the
ring gets it) or once per query row (a term of the softmax's denominator, such as an attention
sink: only the first block the ring computes for a query chunk gets it). Ulysses slices every
per-head option to its head group along the last axis. A new per-head option is one entry here
and one keyword of ``ring_attention`` and ``ulysses_attention``, passed on in ``per_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _spec
from ..backends.base import Backend
from ._comm import Description, check_comm
from ._device import pick, wants_rank_device

#: keyword -> (check(value, B, Hq) -> array with Hq last or None, AttnCall field, once per row)
PER_HEAD: dict[str, tuple[Callable[[Any, int, int], np.ndarray | None], str, bool]] = {
    "alibi_slopes": (_spec.check_alibi, "alibi", False),
}


@dataclass(frozen=True)
class Options:
    """The options of ``attention`` a context-parallel call takes (Sq = Sk, so ``causal=True``
    and ``"top_left"`` agree), checked."""

    causal: bool
    scale: float
    window: tuple[int | None, int | None]
    softcap: float | None
    per_head: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (..., Hq)

    def describe(self) -> Description:
        """What the ranks compare of the options."""
        return [("causal", "ArgumentError", self.causal), ("scale", "ArgumentError", self.scale),
                ("window", "ArgumentError", self.window),
                ("softcap", "ArgumentError", self.softcap)] + [
            (name, "ArgumentError", self.per_head[name].tolist() if name in self.per_head
             else None) for name in PER_HEAD]

    def call_fields(self, first: bool) -> dict[str, Any]:
        """The AttnCall fields of the per-head options for one ring block (whole: a block has
        every head); the once-per-row options only for the ``first`` block of a query chunk."""
        return {PER_HEAD[n][1]: a for n, a in self.per_head.items() if first or not PER_HEAD[n][2]}

    def attention_kwargs(self, heads: slice) -> dict[str, Any]:
        """Keywords of ``attnlib.attention`` for the query heads ``heads`` over the whole
        sequence (Ulysses' head group): per-head options sliced along their last axis."""
        return dict(causal=self.causal, scale=self.scale, window=self.window,
                    softcap=self.softcap,
                    **{n: np.ascontiguousarray(a[..., heads]) for n, a in self.per_head.items()})


def check_options(b: int, hq: int, d: int, *, causal: Any, scale: Any, window: Any,
                  softcap: Any, per_head: dict[str, Any]) -> Options:
    checked = {}
    for name, value in per_head.items():
        a = PER_HEAD[name][0](value, b, hq)
        if a is not None:
            checked[name] = a
    return Options(_spec.check_causal(causal) is not None, _spec.check_scale(scale, d),
                   _spec.check_window(window), _spec.check_softcap(softcap), checked)


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
