"""Where the numba backend's compiled functions are cached on disk.

numba keeps a ``cache=True`` function's cache next to its source file unless
``numba.config.CACHE_DIR`` is set, and chooses the directory when the function is decorated.
:func:`njit` decorates with ``CACHE_DIR`` set to :func:`attnlib._config.numba_cache_dir` for
that moment only (other libraries' numba functions keep their own places), so that a read-only
install (a system site-packages) caches in the user's cache directory. Where no directory can
be written at all, the function is compiled without a disk cache, in every process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numba
from numba.core import config, event

from ... import _config, _notice

_lock = threading.Lock()


class _FirstCompile(event.Listener):
    """Says on stderr, once per process, that numba compiles attnlib's kernels (a function
    loaded from the disk cache is not compiled, so says nothing)."""

    def on_start(self, ev: event.Event) -> None:
        fn = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
        if getattr(fn, "__module__", "").startswith("attnlib."):
            _notice.say_once("numba", "numba is compiling attnlib's CPU kernels (first use of "
                             "each kind of call: seconds to tens of seconds; cached in "
                             f"{_config.numba_cache_dir()}, so later processes only load them)")

    def on_end(self, ev: event.Event) -> None:
        pass


event.register("numba:compile", _FirstCompile())


def njit(**options: Any) -> Callable:
    """``numba.njit(cache=True, **options)`` caching in attnlib's directory (see the module
    doc); plain ``numba.njit(**options)`` when no cache directory is writable."""

    def decorate(fn: Callable) -> Callable:
        with _lock:
            saved = config.CACHE_DIR
            config.CACHE_DIR = _config.numba_cache_dir()
            try:
                return numba.njit(cache=True, **options)(fn)
            except RuntimeError as e:  # numba: "no locator available" (nowhere to write)
                if "no locator" not in str(e):
                    raise
            finally:
                config.CACHE_DIR = saved
        return numba.njit(**options)(fn)

    return decorate
