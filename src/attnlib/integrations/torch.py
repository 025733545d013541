"""``attnlib::attention`` as a ``torch.library`` custom op, so that ``torch.compile`` graphs call
attnlib on the CPU as one opaque node (no graph break), with a fake implementation that gives the
output's shape and dtype without computing it.

>>> import torch
>>> from attnlib.integrations.torch import attention
>>> q = torch.randn(1, 2, 3, 8); out = attention(q, q, q, causal=True)  # (B, H, S, D)
>>> out.shape
torch.Size([1, 2, 3, 8])

The tensors are CPU tensors in PyTorch's ``(B, H, S, D)`` order (``layout="bshd"`` for
``(B, S, H, D)``); they reach attnlib as strided numpy views of the same memory. attnlib computes
no gradients: the op has no autograd formula, so call it under ``torch.no_grad()`` (inference).
"""

from __future__ import annotations

import torch

from .. import _api

__all__ = ["attention"]


@torch.library.custom_op("attnlib::attention", mutates_args=(), device_types="cpu")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, scale: float | None, causal: str,
                  window_left: int, window_right: int, softcap: float | None,
                  sinks: torch.Tensor | None, layout: str, backend: str | None) -> torch.Tensor:
    window = None if window_left < 0 and window_right < 0 else (window_left, window_right)
    out = _api.attention(q, k, v, mask=mask, scale=scale, causal=causal or False, window=window,
                         softcap=softcap, sinks=sinks, layout=layout, backend=backend)
    return out


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, scale, causal, window_left, window_right, softcap, sinks,
                    layout, backend):
    return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              mask: torch.Tensor | None = None, scale: float | None = None,
              causal: bool | str = False, window: tuple[int | None, int | None] | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              layout: str = "bhsd",
              backend: str | None = None) -> torch.Tensor:
    """``attnlib.attention`` (contract section 2) as the custom op ``torch.ops.attnlib.attention``:
    ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` -> ``(B, Hq, Sq, Dv)``
    (``layout="bshd"``: ``(B, S, H, D)`` in and out). ``causal=True`` (``"bottom_right"``) or
    ``"top_left"`` as in ``attnlib.attention``;
    ``window=(left, right)`` with None for unbounded; ``mask`` bool (True = attend) or additive,
    broadcastable to ``(B, Hq, Sq, Sk)``; ``sinks`` float32 ``(Hq,)`` (gpt-oss)."""
    left, right = (None, None) if window is None else window
    if causal is True or causal is False:
        causal = "bottom_right" if causal else ""
    return _attention_op(q, k, v, mask, scale, causal,
                         -1 if left is None else int(left), -1 if right is None else int(right),
                         softcap, sinks, layout, backend)
