"""``attn_implementation="attnlib"`` for Hugging Face transformers models.

>>> import attnlib.integrations.transformers as attnlib_hf
>>> attnlib_hf.register()          # once; then from_pretrained(..., attn_implementation="attnlib")

``register()`` adds attnlib to transformers' ``AttentionInterface`` and its masks to
``AttentionMaskInterface`` (the boolean masks transformers builds for SDPA: True = attend, None
where causality alone says it). Each layer's call maps onto ``attnlib.attention``: the
``(B, H, S, D)`` tensors transformers passes are read as ``(B, S, H, D)`` strided views (no copy),
GQA runs without repeating keys, ``scaling``, ``softcap`` (Gemma 2), attention sinks (gpt-oss's
``s_aux``) and 4-D bool or additive masks (padding, sliding windows) pass through. Without a mask
(transformers leaves it out where SDPA's ``is_causal`` is exact) a causal module is
``causal="top_left"`` as in SDPA, and a single query row sees every key. attnlib computes no
gradients: use it for inference (``torch.no_grad()``, ``generate``); dropout must be 0.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _api, _spec, registry
from .torch import attention as _attention

__all__ = ["register", "attention_forward", "NAME"]

#: the ``attn_implementation`` name
NAME = "attnlib"
_backend: str | None = None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: ``query (B, Hq, Sq, D)``, ``key`` and
    ``value (B, Hkv, Sk, D)`` -> ``(out (B, Sq, Hq, D), None)``."""
    _spec.check_layer_call(dropout)
    causal = False
    if attention_mask is None and query.shape[2] > 1:
        # transformers leaves the mask out where PyTorch SDPA's is_causal (top-left) is exact:
        # Sq == Sk, or a prefill into an empty static cache (keys past Sq are free slots)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = "top_left" if causal else False
    # (B, H, S, D) -> (B, S, H, D): strided views; the output comes back (B, Sq, Hq, D).
    # Under torch.compile through the custom op (one graph node); else directly, which spares
    # the op's dispatch, which on a CPU can cost more than a decode step's attention itself
    call = _attention if torch.compiler.is_compiling() else _api.attention
    out = call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
               mask=attention_mask, scale=scaling, causal=causal, softcap=softcap,
               sinks=kwargs.get("s_aux"), layout="bshd", backend=_backend)
    return out, None


def register(backend: str | None = None) -> None:
    """Make ``attn_implementation="attnlib"`` available to every transformers model;
    ``backend`` (e.g. ``"numba"``) is the attnlib backend its layers use (None: attnlib's
    default choice). Calling it again changes the backend."""
    global _backend
    if backend is not None:
        registry.get_backend(backend)  # an unknown or unavailable name raises here, not per layer
    _backend = backend
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
