"""The options of an attention call, checked once into one :class:`AttnOptions`."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import AttnOptions
from ._arrays import (
    check_alibi,
    check_causal,
    check_scale,
    check_sinks,
    check_softcap,
    check_window,
)


def attn_options(head_dim: int, n_heads: int, n_seq: int, *, scale: Any = None,
                 causal: Any = False, window: Any = None, softcap: Any = None,
                 alibi_slopes: Any = None, sinks: Any = None, mask_kind: str | None = None,
                 top_left: bool = True) -> AttnOptions:
    """The checked options of a call of ``n_seq`` sequences with ``n_heads`` query heads of
    ``head_dim``: every front door builds its call's options here. ``mask_kind`` comes from the
    checked mask (:func:`~._arrays.check_mask`); ``top_left=False`` refuses
    ``causal="top_left"`` (KV caches align bottom-right). Raises the argument's AttnlibError."""
    causal = check_causal(causal, allow_top_left=top_left)
    left, right = check_window(window)
    return AttnOptions(
        scale=check_scale(scale, head_dim), causal=causal, window_left=left,
        window_right=right, softcap=check_softcap(softcap),
        alibi=check_alibi(alibi_slopes, n_seq, n_heads), mask_kind=mask_kind,
        sinks=check_sinks(sinks, n_heads),
    )


def causal_bound(causal: str | None, off: np.ndarray) -> np.ndarray | None:
    """``AttnCall.causal_hi`` of sequences whose query row ``i`` sits at position ``off + i``
    and key ``j`` at ``j``: the upper bound on ``kpos - qpos``, 0 bottom-right; top-left
    ``j <= i`` is ``kpos - qpos <= -off``. None when not causal."""
    if causal is None:
        return None
    return np.zeros_like(off) if causal == "bottom_right" else -off
