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

#: option values whose checks depend only on (type, value): a repeat-call key holds both, so True
#: and 1 (equal and of one hash) never share an entry
_SIMPLE = frozenset((bool, int, float, type(None), str, np.bool_, np.float64, np.float32))


def option_key(options: dict[str, Any], per_call: tuple[str, ...] = ()) -> tuple | None:
    """What the checks of the options ``options`` (keyword -> value, in the front door's order)
    read, for a repeat-call cache: each value by type and value, a tuple or list by its type and
    its items'; for the names in ``per_call`` only whether they are given (their values are
    checked on every call). None when a value is of another kind (an array): such calls take the
    full path every time."""
    values = tuple(options.values())
    types = tuple(map(type, values))
    if _SIMPLE.issuperset(types):  # the common case: scalars and None only
        return types + values
    key = []
    for name, value in options.items():
        tv = type(value)
        if name in per_call:
            key.append(value is None)
        elif tv in _SIMPLE:
            key += (tv, value)
        elif tv in (tuple, list) and _SIMPLE.issuperset(map(type, value)):
            key.append((tv, tuple(map(type, value)), tuple(value)))
        else:
            return None
    return (tuple(key),)  # one item: never equal to a key of the common case


#: checked options by everything their checks read (see attn_options)
_checked: dict[tuple, AttnOptions] = {}
_CHECKED_MAX = 256


def attn_options(head_dim: int, n_heads: int, n_seq: int, *, mask_kind: str | None = None,
                 top_left: bool = True, **options: Any) -> AttnOptions:
    """The checked options of a call of ``n_seq`` sequences with ``n_heads`` query heads of
    ``head_dim``: every front door builds its call's options here, from its option keywords
    ``options`` (those of :func:`_check`). ``mask_kind`` comes from the checked mask
    (:func:`~._arrays.check_mask`); ``top_left=False`` refuses ``causal="top_left"`` (KV caches
    align bottom-right). Raises the argument's AttnlibError. Options of scalars only are checked
    once per distinct value (:func:`option_key`) and the same AttnOptions returned again."""
    key = option_key(options)
    if key is not None:
        key = (head_dim, n_heads, n_seq, mask_kind, top_left, tuple(options), key)
        hit = _checked.get(key)
        if hit is not None:
            return hit
    checked = _check(head_dim, n_heads, n_seq, mask_kind, top_left, **options)
    if key is not None:
        if len(_checked) >= _CHECKED_MAX:
            _checked.clear()
        _checked[key] = checked
    return checked


def _check(head_dim: int, n_heads: int, n_seq: int, mask_kind: str | None, top_left: bool, *,
           scale: Any = None, causal: Any = False, window: Any = None, softcap: Any = None,
           alibi_slopes: Any = None, sinks: Any = None) -> AttnOptions:
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
