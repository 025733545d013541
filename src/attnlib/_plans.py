"""Every plan cache of the library, so that :func:`forget_plans` empties them all.

A plan cache maps what a call's checks or kernel choice read (its key) to what they fixed: the
front door's checked entries (``_api``, ``kv_cache``), the OpenCL plans (``backends/opencl``)
and the numba backend's tilings. Each is a :class:`PlanTable` (a ``dict``: lookups on the hot
path cost what a dict's do) made by :func:`table`, which registers it here; a table owned by an
object (a KV cache's entries) lives as long as the object."""

from __future__ import annotations

import threading
import weakref
from typing import Any


class PlanTable(dict):
    """A plan cache: a dict that :func:`forget_plans` can reach (weakly referenced)."""

    __slots__ = ("__weakref__", "name")


_refs: list[weakref.ref] = []
_lock = threading.Lock()


def _add(cache: Any) -> None:
    with _lock:
        if len(_refs) >= 64 and len(_refs) & (len(_refs) - 1) == 0:  # prune dead ones now and then
            _refs[:] = [r for r in _refs if r() is not None]
        _refs.append(weakref.ref(cache))


def table(name: str) -> PlanTable:
    """A new, empty plan cache, registered for :func:`forget_plans`."""
    t = PlanTable()
    t.name = name
    _add(t)
    return t


def register(cache: Any) -> Any:
    """Register an existing cache (any weakly referable object with ``clear()``, e.g. an
    ``OrderedDict``) for :func:`forget_plans`; returns it."""
    _add(cache)
    return cache


def tables() -> list:
    """The live plan caches."""
    with _lock:
        return [c for c in (r() for r in _refs) if c is not None]


def forget_plans() -> None:
    """Empty every plan cache of the process: the next call of each key plans again, under the
    switches and settings in force then (programs and compiled kernels are kept: they are keyed
    by their full build options)."""
    for cache in tables():
        cache.clear()
