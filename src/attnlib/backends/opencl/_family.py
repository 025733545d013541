"""The interface every kernel family of the attention primitive implements, and the named
argument lists their plans launch with.

A family (portable, NVIDIA mma.sync, wgmma, NVIDIA decode, ...; the ordered list is
``_dispatch.FAMILIES``) answers two questions:

* :meth:`Family.applicable` ``(be, call, max_rows)``: None when it can run the call, else the
  reason it cannot (``attnlib.backends.opencl.why`` shows them, as PyTorch's SDPA says why it
  skipped a backend);
* :meth:`Family.plan` ``(be, queue, call, max_rows)``: a :class:`Plan` of everything the call's
  description (``_dispatch.plan_key``) fixes.

A plan answers two more: :meth:`Plan.step` (what the per-sequence values fix: tables, work-group
counts, key splits; made again only when those values change) and :meth:`Plan.enqueue` (one
call's buffers bound and its kernels launched). :meth:`Plan.run` does what every family's call
does around them (outputs from the pool, host copies for host inputs). The first call of a key
and every repeat take this one path (``_dispatch.attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from . import _pool

if TYPE_CHECKING:
    from ..base import AttnCall


class NotBuilt(Exception):
    """Raised by :meth:`Family.plan` when the family's kernel did not build on this device (it
    has warned and will say so in :meth:`Family.applicable` from now on): the dispatch takes the
    next family."""


class ArgList:
    """A kernel's argument list with named slots, in the order of the kernel's parameters:
    ``add(name, *values)`` appends a slot of one or more arguments (None: set per call);
    ``at(name)`` is the index of its first argument, ``span(name)`` its slice."""

    __slots__ = ("values", "slots")

    def __init__(self) -> None:
        self.values: list = []
        self.slots: dict[str, tuple[int, int]] = {}

    def add(self, name: str, *values: Any) -> None:
        self.slots[name] = (len(self.values), len(values))
        self.values += values

    def at(self, name: str) -> int:
        return self.slots[name][0]

    def span(self, name: str) -> slice:
        first, n = self.slots[name]
        return slice(first, first + n)

    def has(self, name: str) -> bool:
        return name in self.slots

    def indices(self, *names: str) -> tuple[int, ...]:
        """Every argument index of the slots ``names`` (those the list has)."""
        out: list[int] = []
        for name in names:
            if name in self.slots:
                first, n = self.slots[name]
                out += range(first, first + n)
        return tuple(out)


class Family:
    """One kernel family of the attention primitive (see the module)."""

    name: ClassVar[str]
    #: what a plan of this family depends on of the call's largest packed row count:
    #: ``plan_rows(max_rows)`` (0: one plan per key whatever the rows)
    def plan_rows(self, max_rows: int) -> int:
        return 0

    def applicable(self, be: Any, call: AttnCall, max_rows: int) -> str | None:
        raise NotImplementedError

    def plan(self, be: Any, queue: Any, call: AttnCall, max_rows: int) -> Plan:
        raise NotImplementedError


class Plan:
    """What one call description fixes for one family (see the module). Subclasses set
    ``queue``, ``lse_dtype`` and implement :meth:`step` and :meth:`enqueue`."""

    queue: Any
    lse_dtype: np.dtype = np.dtype(np.float32)

    def step(self, call: AttnCall, vals: np.ndarray, col: list | None) -> Any:
        """What the per-sequence values give (``vals``: int64 rows q_batch, q_row0, q_len,
        k_batch, k_row0, k_len, q_pos0, k_pos0[, causal_hi]; ``col``: its one column as Python
        ints when the call has one sequence); None: nothing to launch."""
        raise NotImplementedError

    def enqueue(self, step: Any, call: AttnCall, out: Any, lse: Any, keep: Any) -> list:
        """Bind ``call``'s buffers and launch into the buffers ``out``, ``lse``; the events.
        ``keep``: the output Array, which holds per-call uploads until they are done."""
        raise NotImplementedError

    def run(self, call: AttnCall, step: Any) -> tuple[Any, Any]:
        """``(out, lse)`` of ``call``: pooled outputs, :meth:`enqueue`, and for host inputs host
        copies (device inputs: Arrays; without ``need_lse`` the LSE goes to scratch, None)."""
        queue, q = self.queue, call.q
        bq, sq, hq, _ = q.shape
        host = isinstance(q, np.ndarray)
        out = _pool.empty(queue, (bq, sq, hq, call.v.shape[3]), q.dtype)
        if call.need_lse or host:
            lse = _pool.empty(queue, (bq, hq, sq), self.lse_dtype)
            lse_buf = lse.base_data
        else:
            lse, lse_buf = None, _pool.scratch(queue, bq * sq * hq * self.lse_dtype.itemsize)
        if step is not None and out.base_data is not None:
            for e in self.enqueue(step, call, out.base_data, lse_buf, out):
                if e is not None:
                    out.add_event(e)
                    if lse is not None:
                        lse.add_event(e)
        if host:
            return results(queue, out, lse)
        return out, lse


#: the per-sequence fields of an AttnCall a plan's step reads, in the order of its ``vals``
PER_SEQUENCE = ("q_batch", "q_row0", "q_len", "k_batch", "k_row0", "k_len", "q_pos0", "k_pos0")


def per_sequence(call: AttnCall) -> tuple[np.ndarray, list | None]:
    """(vals, col) of :meth:`Plan.step` for ``call``: its per-sequence fields (causal_hi last
    when causal) as int64 rows, and their one column as Python ints for one sequence."""
    fields = [getattr(call, f) for f in PER_SEQUENCE]
    if call.causal_hi is not None:
        fields.append(call.causal_hi)
    vals = np.array(fields, np.int64).reshape(len(fields), -1)
    return vals, (vals[:, 0].tolist() if vals.shape[1] == 1 else None)


def results(queue: Any, out: Any, lse: Any) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of a host call's outputs (the raw bytes: bfloat16 included)."""
    import pyopencl as cl

    out_h = np.empty(out.shape, out.dtype)
    lse_h = np.empty(lse.shape, lse.dtype)
    if out_h.size:
        cl.enqueue_copy(queue, out_h.view(f"u{out_h.itemsize}"), out.base_data)
        cl.enqueue_copy(queue, lse_h, lse.base_data)
    return out_h, lse_h
