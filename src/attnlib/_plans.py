"""Every plan cache of the library, so that :func:`forget_plans` empties them all.

A plan cache maps what a call's checks or kernel choice read (its key) to what they fixed: the
front door's checked entries (``_api``, ``kv_cache``), the OpenCL plans (``backends/opencl``)
and the numba backend's tilings. Each is a plain ``dict`` (a lookup on the hot path costs what a
dict's does) made by :func:`table`, which registers it here: for the process, or for as long as
its ``owner`` lives (a KV cache's entries)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
#: the caches of the process (modules' plan tables)
_tables: list = []
#: owner -> its plan tables (dropped with the owner)
_owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def table(owner: Any = None) -> dict:
    """A new, empty plan cache, registered for :func:`forget_plans`: for the process, or for as
    long as ``owner`` (an object that is weakly referable and hashable) lives."""
    return register({}, owner)


def register(cache: Any, owner: Any = None) -> Any:
    """Register an existing cache (anything with ``clear()``, e.g. an ``OrderedDict``) as
    :func:`table` does; returns it."""
    with _lock:
        if owner is None:
            _tables.append(cache)
        else:
            _owned.setdefault(owner, []).append(cache)
    return cache


def tables() -> list:
    """The live plan caches."""
    with _lock:
        return _tables + [t for ts in list(_owned.values()) for t in ts]


def forget_plans() -> None:
    """Empty every plan cache of the process: the next call of each key plans again, under the
    switches and settings in force then (programs and compiled kernels are kept: they are keyed
    by their full build options)."""
    for cache in tables():
        cache.clear()
