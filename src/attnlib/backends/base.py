"""The contract between attnlib's front door and its backends.

The front door (``attnlib._api`` and ``attnlib._spec``) validates every user input once and hands a
backend only normalised, checked calls described by the frozen dataclasses below. A backend never
re-checks user input; it only says :class:`~attnlib.errors.UnsupportedError` when it cannot run a
call (for example float64 on an OpenCL device without ``cl_khr_fp64``).

One attention primitive covers dense attention, varlen, streaming chunks and the KV cache
------------------------------------------------------------------------------------------------
:class:`AttnCall` describes ``n_seq`` independent *sequences*. Sequence ``s`` owns query rows
``q[q_batch[s], q_row0[s] : q_row0[s] + q_len[s], h, :]`` and keys ``j = 0 .. k_len[s]-1`` stored at
``k[k_batch[s], row(j), hk, :]`` with ``row(j) = k_row0[s] + j``, minus ``ring`` when that reaches
``ring`` (ring > 0 only for a ring-buffer KV cache; then ``k.shape[1] == ring``).

Every query row and key has an absolute *position*: query row ``i`` of sequence ``s`` sits at
``q_pos0[s] + i``, key ``j`` at ``k_pos0[s] + j``. With ``d = kpos - qpos``, key ``j`` is visible
to row ``i`` iff all of

* ``d <= causal_hi[s]``            (``causal_hi`` is None when the call is not causal),
* ``-window_left <= d``            (``window_left`` None = unbounded),
* ``d <= window_right``            (``window_right`` None = unbounded),
* the mask allows it (bool: True; additive: a finite or +inf value, -inf excludes).

Every option of the call (``scale``, ``window_left``, ``window_right``, ``softcap``, ``alibi``,
``mask_kind``, ``sinks``, and the causal alignment the front door turned into ``causal_hi``) is a
field of :class:`AttnOptions`, read as ``call.options.<name>``: one frozen, hashable value that
the front door builds and checks once (``attnlib._spec.attn_options``), so plan keys take it
whole and a new option is one new field.

The score is ``s = scale * dot(q_i, k_j)``, then ``softcap * tanh(s / softcap)`` when softcap is
set, then ``- alibi[s, h] * |qpos - kpos|`` when alibi is set, then ``+ mask`` for an additive
mask. Softmax over visible keys, ``out = sum p v``, ``lse = log sum exp(s)`` (natural log).
A row with no visible key gives out = 0 and lse = -inf, never NaN. Invisible keys contribute
nothing even if their k or v hold NaN or garbage (never multiply them by 0: skip them).

``sinks`` (float32 ``(Hq,)``, or None): one extra logit per query head that joins the
softmax denominator as a key of value zero (gpt-oss's attention sinks), untouched by scale,
softcap, ALiBi, masks, causal and window: with ``m = max(sink_h, max_j s_j)``,
``out = sum_j exp(s_j - m) v_j / (exp(sink_h - m) + sum_j exp(s_j - m))`` and
``lse = log(exp(sink_h) + sum_j exp(s_j))``; a row with no visible key gives out = 0 and
lse = sink_h. It is the state without sinks merged once with the state (0, sink_h): a backend
computes without it and folds it into the final normalisation (after any merge of split-key
partial states, never into each of them).

Arrays: ``q (Bq, Sq_arr, Hq, D)``, ``k (Bk, Sk_arr, Hkv, D)``, ``v (Bk, Sk_arr, Hkv, Dv)``, any
strides (numpy: byte strides as numpy reports them; negative and zero strides occur). q, k, v
share one dtype out of float16, float32, float64, ml_dtypes.bfloat16. Query head ``h`` reads kv head
``h // (Hq // Hkv)``. The backend returns ``out (Bq, Sq_arr, Hq, Dv)`` in q's dtype and
``lse (Bq, Hq, Sq_arr)`` in float32 (float64 for float64 inputs), both fresh C-contiguous arrays of
its own array type (numpy in -> numpy out). Query rows that belong to no sequence are never
produced by the front door (every row of q belongs to exactly one sequence).

Paged keys and values (``block_table`` is not None): ``k`` and ``v`` are page pools
``(num_pages, page_size, Hkv, D)`` / ``(..., Dv)`` and ``k_batch`` is unused (zeros). Key ``j`` of
sequence ``s`` has the logical row ``r = k_row0[s] + j`` and lives at
``k[block_table[s, r // page_size], r % page_size, hk, :]`` (vLLM's and FlashInfer's layout;
``ring`` is 0). ``block_table`` is ``(n_seq, max_pages)`` int32 or int64: a numpy array, or on
OpenCL possibly a device array the caller owns. Host tables reach a backend checked (every page a
sequence needs is in ``[0, num_pages)``); a device table is taken as given, so a backend clamps
every page index it reads into ``[0, num_pages)``: whatever the table holds, no kernel reads or
writes outside the pool.

The mask, when present, is only used by dense calls, where sequence ``s`` is batch ``s``
(``q_batch[s] == s``) and local indices ``i, j`` index it: ``mask_view[s, h, i, j]``.
``mask_view`` is a numpy array already broadcast to ``(n_seq, Hq, Sq_arr, k_len)`` (zero strides
where broadcast). ``mask_kind`` is "bool" or "additive" (any float dtype; read it as float32 or
wider).

Quantized keys and values (``k_scales`` is not None; a load variant, contract §10): ``k`` and
``v`` hold 8-bit codes of one format (their dtype: ``ml_dtypes.float8_e4m3fn``,
``ml_dtypes.float8_e5m2`` or ``int8``; :func:`attnlib._quant.format_of` names it) and
``k_scales`` / ``v_scales`` float32 ``k.shape[:3]`` / ``v.shape[:3]`` (C order) one scale per
(row, kv head): the key read is ``k_scales[b, row, hk] * decode(k[b, row, hk, :])``, with
``decode`` exact (:func:`attnlib._quant.decode_table`), and likewise for v. q, out and the compute
keep q's dtype (``AttnCall.dtype``). A backend dequantizes as it loads (never a dequantized copy of
the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Any, ClassVar

import numpy as np

from .. import _quant

#: the dtypes whose attention output already is a float32-or-wider partial state
_WIDE = (np.dtype(np.float32), np.dtype(np.float64))

__all__ = [
    "AttnCall",
    "AttnOptions",
    "RopeSpec",
    "Backend",
    "HostPages",
]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters. ``rotary_dim`` is even and <= D (already resolved)."""

    theta: float
    interleaved: bool
    rotary_dim: int


@dataclass(frozen=True, eq=False)
class AttnOptions:
    """The options of one attention call (see the module docstring), checked and normalised by
    the front door. Frozen and hashable: equal options hash equal, array-valued fields by their
    values (read-only copies). A backend reads every option from here; an option it does not
    know yet is a field it never reads. ``plan_key`` (a tuple) is what a launch plan depends
    on: every scalar option, and for each array-valued option (ALiBi slopes, sinks) whether it
    is given (a plan takes their values per call)."""

    scale: float
    causal: str | None = None  # "bottom_right" | "top_left"; the bound itself is causal_hi
    window_left: int | None = None  # >= 0, None: unbounded
    window_right: int | None = None
    softcap: float | None = None  # > 0
    alibi: np.ndarray | None = None  # float32 (n_seq, Hq): one slope per sequence and head
    mask_kind: str | None = None  # "bool" | "additive" (the mask itself: AttnCall.mask_view)
    sinks: np.ndarray | None = None  # float32 (Hq,): one softmax sink logit per query head

    def __post_init__(self) -> None:
        for name in _ARRAY_OPTIONS:
            a = getattr(self, name)
            if a is not None and a.flags.writeable:
                a = np.array(a)
                a.flags.writeable = False
                object.__setattr__(self, name, a)
        key = _option_values(self)
        if any(key[i] is not None for i in _ARRAY_INDEX):
            key = tuple(v is None if i in _ARRAY_INDEX else v for i, v in enumerate(key))
        object.__setattr__(self, "plan_key", key)

    def _key(self) -> tuple:
        key = self.__dict__.get("_key_")
        if key is None:
            key = tuple((v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
                        for v in _option_values(self))
            object.__setattr__(self, "_key_", key)
        return key

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is AttnOptions and self._key() == other._key())

    def __hash__(self) -> int:
        return hash(self._key())

    def for_sequences(self, idx: np.ndarray) -> AttnOptions:
        """The options of the sub-call of sequences ``idx`` (the per-sequence ALiBi slopes)."""
        if self.alibi is None:
            return self
        return replace(self, alibi=self.alibi[idx])


_OPTION_NAMES = tuple(f.name for f in fields(AttnOptions))
_ARRAY_OPTIONS = tuple(f.name for f in fields(AttnOptions) if "ndarray" in str(f.type))
_ARRAY_INDEX = frozenset(_OPTION_NAMES.index(n) for n in _ARRAY_OPTIONS)
_option_values = attrgetter(*_OPTION_NAMES)


@dataclass(frozen=True, eq=False)
class AttnCall:
    """One normalised attention call (see the module docstring for the exact semantics)."""

    q: Any
    k: Any
    v: Any
    # per-sequence int64 numpy arrays, all of length n_seq
    q_batch: np.ndarray
    q_row0: np.ndarray
    q_len: np.ndarray
    k_batch: np.ndarray
    k_row0: np.ndarray
    k_len: np.ndarray
    q_pos0: np.ndarray
    k_pos0: np.ndarray
    causal_hi: np.ndarray | None  # None iff options.causal is None
    options: AttnOptions
    mask_view: np.ndarray | None = None  # broadcast (n_seq, Hq, Sq_arr, Sk) view
    ring: int = 0
    dense: bool = False  # q_batch == k_batch == arange(n_seq), rows start at 0, no ring
    need_lse: bool = True
    block_table: Any = None  # (n_seq, max_pages) int32/int64: paged k, v (see the docstring)
    page_size: int = 0
    k_scales: Any = None  # float32 k.shape[:3]: k, v hold 8-bit codes (see the docstring)
    v_scales: Any = None

    @property
    def n_seq(self) -> int:
        return int(self.q_len.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[3])

    @property
    def head_dim_v(self) -> int:
        return int(self.v.shape[3])

    @property
    def n_heads(self) -> int:
        return int(self.q.shape[2])

    @property
    def n_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.q.dtype)

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None


class Backend:
    """Base class of every backend. Subclasses implement the primitives below.

    A backend instance holds its device state (for OpenCL: context, queue, compiled programs)
    and is reused across calls; it must be safe to call from several threads at once.
    """

    name: ClassVar[str] = "base"
    #: a short human description shown by ``attnlib info``
    description: ClassVar[str] = ""

    @classmethod
    def is_available(cls) -> bool:
        """Cheap, never raises: can this backend run here at all?"""
        return False

    @classmethod
    def auto_priority(cls) -> int:
        """Order for ``"auto"``: higher first. Never raises. 0 = never picked by auto."""
        return 0

    def info(self) -> dict:
        """Facts for ``attnlib info`` (device names, versions)."""
        return {}

    # ---- arrays -------------------------------------------------------------------------------
    def owns(self, x: Any) -> bool:
        """True if ``x`` is this backend's device array type (numpy backends: never)."""
        return False

    def to_device(self, x: np.ndarray) -> Any:
        """Copy a host array to this backend's device (numpy backends return x itself)."""
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def unsupported_dtype_reason(self, dtype: np.dtype) -> str | None:
        """Why ``dtype`` cannot run here (the message of an UnsupportedError); None when it can."""
        return None

    # ---- primitives ---------------------------------------------------------------------------
    def attention(self, call: AttnCall) -> tuple[Any, Any]:
        """Return ``(out (Bq, Sq_arr, Hq, Dv), lse (Bq, Hq, Sq_arr))``; see the module docstring.
        When ``call.need_lse`` is False the caller drops the LSE, and a backend may return None
        in its place."""
        raise NotImplementedError

    def attention_state(self, call: AttnCall) -> tuple[Any, Any] | None:
        """:meth:`attention` with ``out`` kept in float32 or wider (float64 for float64 calls):
        a partial state for an exact merge (a float16 / bfloat16 ``out`` rounded before a merge
        would be rounded twice). The default: :meth:`attention` itself where its output already
        is float32 / float64; None (this backend cannot) for float16 / bfloat16."""
        if call.dtype in _WIDE:
            return self.attention(call)
        return None

    def attention_parts(self, call: AttnCall, n_parts: int) -> tuple[Any, Any] | None:
        """The merge of ``n_parts`` partial states of the same query rows, made in one call
        (the shared-prompt cascade's primitive, ``attnlib._cascade``).

        ``call.q`` is ``(B, S, Hq, D)`` (numpy, or a C-contiguous device array) and its
        ``R = B * S`` rows are read flat: sequence ``s`` has the rows ``q_row0[s] ..
        q_row0[s] + q_len[s] - 1`` of ``q.reshape(1, R, Hq, D)``, and ``call.q_batch[s]`` is
        its *part* (0 .. n_parts - 1), not a batch of ``q``. The query rows are the same in
        every part, each row belongs to exactly one sequence of each part, and a row's parts
        see disjoint keys. Returns ``merge_states`` of each row's ``n_parts`` states with
        ``call.options.sinks`` folded in once after it: ``out (B, S, Hq, Dv)`` in ``call.dtype`` and
        ``lse (B, Hq, S)`` (float32; float64 for float64), in the backend's array type, what one
        call over the union of each row's keys gives; the states are kept in float32 or wider.
        None: the caller merges :meth:`attention_state`'s states itself (the default)."""
        return None

    def parts_limits(self, call: AttnCall) -> tuple[int | None, int | None]:
        """(packed query rows, keys): the most packed rows (query rows times query heads per kv
        head) and keys one sequence of an :meth:`attention_parts` call made from ``call``
        should have here, for speed (a kernel that groups at most so many rows); None: any."""
        return None, None

    def softmax(self, x: Any, axis: int, log: bool) -> Any:
        """Softmax of ``x`` along ``axis`` (non-negative), x's dtype out; with ``log=True``
        return logsumexp along ``axis`` instead (float32, float64 for float64 x; axis removed).
        One streaming pass of online max/sum. An all -inf row: zeros (softmax) / -inf (lse).
        NaN propagates. ``x`` has any float dtype of the contract and any strides; size >= 1 along
        ``axis`` is not guaranteed (an empty axis gives an empty softmax / -inf lse)."""
        raise NotImplementedError

    def merge_states(self, outs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
        """Merge partial attention states over disjoint key sets.

        ``outs[i]`` is ``(B, Sq, H, Dv)`` (bshd) and ``lses[i]`` ``(B, H, Sq)``, n >= 1 of each,
        same shapes; out dtype = outs' dtype, lse float32 (float64 when outs are float64).
        ``lse = log sum_i exp(lse_i)``, ``out = sum_i exp(lse_i - lse) out_i``; states with
        lse = -inf contribute nothing; all -inf gives (0, -inf), never NaN.
        """
        raise NotImplementedError

    def rope(self, x: Any, positions: np.ndarray, spec: RopeSpec) -> Any:
        """Rotate ``x (B, S, H, D)`` (bshd, any strides) at ``positions`` (int64 numpy (B, S)).

        Non-interleaved (GPT-NeoX): pairs (t, t + r/2) for t < r/2, r = rotary_dim;
        interleaved (GPT-J): pairs (2t, 2t+1). Pair t uses angle ``pos * theta**(-2t/r)``;
        ``(a, b) -> (a cos - b sin, a sin + b cos)``. Dims >= r are copied. Compute the angle in
        float64 on the host or float32 on a device (float64 for float64 x); out has x's dtype.
        Returns a fresh C-contiguous array.
        """
        raise NotImplementedError

    # ---- KV cache storage ----------------------------------------------------------------------
    def cache_alloc(self, shape: tuple[int, int, int, int], dtype: np.dtype) -> Any:
        """Allocate one cache buffer ``(max_batch, max_seq_len, Hkv, D)`` on the device, zeroed."""
        raise NotImplementedError

    def cache_write(
        self,
        buf: Any,
        src: Any,
        rows: np.ndarray,
        start_pos: np.ndarray,
        rope: RopeSpec | None,
        scales: Any = None,
    ) -> None:
        """Write ``src (B, S_new, Hkv, D)`` (any strides, buf's dtype) into ``buf``:
        ``buf[rows[b], (start_pos[b] + s) % max_seq_len] = src[b, s]`` (rotated at absolute
        position ``start_pos[b] + s`` when ``rope`` is given; fuse it where the backend can).
        ``rows``, ``start_pos``: int64 numpy (B,). Already validated: nothing can fail half-way
        for a user reason. ``scales`` (float32 ``buf.shape[:3]``): ``buf`` holds 8-bit codes
        and ``src`` the cache's float dtype; each row is rotated, then quantized as
        :func:`attnlib._quant.quantize` does, its scale written to the same slot of ``scales``.
        """
        raise NotImplementedError

    # ---- paged KV cache storage ---------------------------------------------------------------
    def page_alloc(self, shape: tuple[int, int, int, int], dtype: np.dtype) -> Any:
        """Allocate one page pool of shape ``(num_pages, page_size, Hkv, D)``, zeroed. Its
        memory order is the backend's choice (the default: C order, as ``cache_alloc``)."""
        return self.cache_alloc(shape, dtype)

    def cache_write_slots(
        self,
        buf: Any,
        src: Any,
        slot_mapping: np.ndarray,
        positions: np.ndarray,
        rope: RopeSpec | None,
        scales: Any = None,
    ) -> None:
        """Write the packed tokens ``src (T, Hkv, D)`` (any strides, buf's dtype) into the page
        pool ``buf (num_pages, page_size, Hkv, D)``: token ``t`` goes to flat slot
        ``slot_mapping[t]`` (``page * page_size + slot``, vLLM's ``slot_mapping``), rotated at
        absolute position ``positions[t]`` when ``rope`` is given (fused where the backend can).
        ``slot_mapping``, ``positions``: int64 numpy (T,), validated, distinct slots.
        ``scales``: the scale pool ``(num_pages, page_size, Hkv)`` of a quantized ``buf``, as in
        :meth:`cache_write`."""
        raise NotImplementedError

    def copy_pages(self, buf: Any, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
        """``buf[dst_pages[i]] = buf[src_pages[i]]`` for every i (copy-on-write of shared pages;
        int64 numpy arrays, validated, no page both a source and a destination). ``buf`` is a
        page pool or a scale pool ``(num_pages, page_size, Hkv)``."""
        raise NotImplementedError

    def cache_append(
        self,
        k_buf: Any,
        v_buf: Any,
        k: Any,
        v: Any,
        q: Any,
        rows: np.ndarray,
        start: np.ndarray,
        rope: RopeSpec | None,
        k_scales: Any = None,
        v_scales: Any = None,
    ) -> Any:
        """One decode step's append in fewer launches, where the backend has a way: ``k`` and
        ``v`` written as two :meth:`cache_write` calls would (k rotated with ``rope``; with
        ``k_scales`` / ``v_scales``, quantized as :meth:`cache_write` does), and the
        query returned, rotated at positions ``start[b] + s`` with ``rope`` (q has as many rows
        as the new tokens then), else ``q`` itself. None when the backend does not take the
        call: then nothing was written and the caller makes the primitive calls. The default
        takes none."""
        return None

    def cache_read(self, buf: Any) -> np.ndarray:
        """The whole buffer as a numpy array (tests and debugging)."""
        return self.to_numpy(buf)


class HostPages:
    """The paged KV cache's writes for backends whose arrays are numpy arrays on the host (mixed
    in by the numpy and numba backends; each rotates with its own :meth:`Backend.rope`)."""

    def cache_write_slots(self, buf: np.ndarray, src: Any, slot_mapping: np.ndarray,
                          positions: np.ndarray, rope: RopeSpec | None,
                          scales: np.ndarray | None = None) -> None:
        chunk = np.asarray(src)
        if rope is not None:
            chunk = self.rope(chunk[None], np.asarray(positions, np.int64)[None], rope)[0]
        ps = buf.shape[1]
        if scales is not None:
            chunk, sc = _quant.quantize(chunk, _quant.format_of(buf.dtype))
            scales[slot_mapping // ps, slot_mapping % ps] = sc
        buf[slot_mapping // ps, slot_mapping % ps] = chunk

    def copy_pages(self, buf: np.ndarray, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
        buf[dst_pages] = buf[src_pages]
