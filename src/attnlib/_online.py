"""OnlineAttention: attention over keys that arrive in chunks (out-of-core KV, streaming)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from . import _spec
from ._common import from_bshd, pick_backend
from .backends.base import AttnCall, Backend


class OnlineAttention:
    """Stream keys and values in chunks of any size; the result equals one-shot attention.

    The running state per query row is the online-softmax triple ``(m, l, O)``, kept here as the
    equivalent normalised pair ``(O / l, lse = m + log l)`` in float32 (float64 for float64 q),
    and each chunk is folded in with ``merge_states``: the rescale by ``alpha = exp(m_old -
    m_new)`` is the merge's weight. With ``causal`` the keys arrive in order and
    ``total_keys`` (the final Sk) must be given, so that the bottom-right alignment is known.
    ``sinks`` (float32 ``(Hq,)``, as in ``attention``) join the first chunk's state only, so
    they count once however the keys are chunked; before any key, the state is (0, sinks).

    >>> import numpy as np, attnlib
    >>> q = np.ones((1, 1, 1, 2)); acc = attnlib.OnlineAttention(q, backend="numpy")
    >>> acc.result(return_lse=True)[1].tolist()
    [[[-inf]]]
    """

    @_spec.front_door(remember=True)
    @_spec.keywords_checked
    def __init__(self, q: Any, *, scale: float | None = None, causal: bool | str = False,
                 softcap: float | None = None, sinks: Any = None, layout: str = "bshd",
                 backend: str | Backend | None = None, total_keys: int | None = None) -> None:
        self._layout = _spec.check_layout(layout)
        _spec.check_array(q, "q", ndim=4)
        self._dtype = _spec.check_float_dtype(q, "q")
        self._q = _spec.to_bshd(q, self._layout)
        b, _, hq, d = self._q.shape
        self._options = _spec.attn_options(d, hq, b, scale=scale, causal=causal, softcap=softcap,
                                           sinks=sinks)
        # the sinks join the first chunk's state only
        self._later = replace(self._options, sinks=None)
        self._total = _spec.check_total_keys(total_keys, self._options.causal)
        self._backend = pick_backend(backend, (q,), self._dtype)
        self._seen = 0
        self._state = None  # (out float32/64 bshd, lse)

    @property
    def keys_seen(self) -> int:
        return self._seen

    @_spec.front_door(method=True)
    def update(self, k_chunk: Any, v_chunk: Any) -> None:
        """Fold one chunk ``k (B, n, Hkv, D)``, ``v (B, n, Hkv, Dv)`` (layout as for q) in."""
        dv_before = None if self._state is None else self._state[0].shape[3]
        k, v = _spec.check_online_chunk(self._q, k_chunk, v_chunk, self._layout, dv_before,
                                        self._seen, self._total)
        b, sq = self._q.shape[:2]
        n = k.shape[1]
        if n == 0:
            return
        be = self._backend
        _spec.check_chunk_readable(k, be)
        off = (self._total if self._total is not None else self._seen + n) - sq
        ones = np.ones(b, dtype=np.int64)
        idx = np.arange(b, dtype=np.int64)
        call = AttnCall(
            q=self._q, k=k, v=v,
            q_batch=idx, q_row0=0 * ones, q_len=sq * ones,
            k_batch=idx, k_row0=0 * ones, k_len=n * ones,
            q_pos0=off * ones, k_pos0=self._seen * ones,
            causal_hi=_spec.causal_bound(self._options.causal, off * ones),
            options=self._options if self._state is None else self._later, need_lse=True,
        )
        out, lse = be.attention(call)
        acc = np.float64 if self._dtype == np.float64 else np.float32
        out = out.astype(acc)
        if self._state is None:
            self._state = (out, lse)
        else:
            self._state = be.merge_states([self._state[0], out], [self._state[1], lse])
        self._seen += n

    @_spec.front_door(method=True)
    def result(self, return_lse: bool = False) -> Any:
        """``out`` (layout as for q, q's dtype), or ``(out, lse)``; before any update: zeros and
        -inf (the empty state)."""
        return_lse = _spec.check_bool(return_lse, "return_lse")
        b, sq, hq, _ = self._q.shape
        if self._state is None:
            acc = np.float64 if self._dtype == np.float64 else np.float32
            out = np.zeros((b, sq, hq, self._q.shape[3]), dtype=self._dtype)
            lse = np.full((b, hq, sq), -np.inf, dtype=acc)
            if self._options.sinks is not None:
                lse[:] = self._options.sinks.astype(acc)[None, :, None]
            if _spec.is_device_array(self._q):
                out, lse = self._backend.to_device(out), self._backend.to_device(lse)
        else:
            out, lse = self._state
            out = out.astype(self._dtype)
        out = from_bshd(out, self._layout, self._backend)
        return (out, lse) if return_lse else out
