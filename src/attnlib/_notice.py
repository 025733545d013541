"""One line on stderr the first time a process compiles kernels: numba's JIT of the CPU kernels
and an OpenCL program build can take seconds on a first call, which then says why instead of
looking hung. Each kind of compile says so once per process; cache hits say nothing."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_said: set[str] = set()

#: an OpenCL build still running after this many seconds is a real compile, not a cache hit
SLOW_BUILD_S = 0.5


def say_once(kind: str, line: str) -> None:
    """Print ``attnlib: <line>`` on stderr unless a line of ``kind`` was printed already."""
    with _lock:
        if kind in _said:
            return
        _said.add(kind)
    print(f"attnlib: {line}", file=sys.stderr, flush=True)


@contextmanager
def if_slow(kind: str, line: str, after_s: float = SLOW_BUILD_S) -> Iterator[None]:
    """:func:`say_once` while the block still runs after ``after_s`` (a build the driver's or
    pyopencl's cache answers takes milliseconds and says nothing)."""
    if kind in _said:
        yield
        return
    timer = threading.Timer(after_s, say_once, (kind, line))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
