"""The AttnlibError family: every error attnlib raises on purpose derives from AttnlibError."""

from __future__ import annotations

__all__ = [
    "AttnlibError",
    "ShapeError",
    "DTypeError",
    "ArgumentError",
    "UnsupportedError",
    "BackendUnavailableError",
    "CacheOverflowError",
    "KernelBuildError",
]


class AttnlibError(Exception):
    """Base class of every error attnlib raises on purpose."""


class ShapeError(AttnlibError, ValueError):
    """An array's shape or size does not fit the call."""


class DTypeError(AttnlibError, TypeError):
    """An array's dtype is not supported, or a non-array was given where an array belongs."""


class ArgumentError(AttnlibError, ValueError, TypeError):
    """Any other bad argument: a wrong scalar value or type, an option, bad cu_seqlens, ..."""


class UnsupportedError(AttnlibError, NotImplementedError):
    """The chosen backend cannot run this call (it never falls back silently)."""


class BackendUnavailableError(AttnlibError, RuntimeError):
    """The backend exists but cannot run on this machine (missing package or device)."""


class CacheOverflowError(AttnlibError, ValueError):
    """A write past a non-ring KV cache's capacity; the cache is left unchanged."""


class KernelBuildError(AttnlibError, RuntimeError):
    """A device kernel failed to build; the message carries the options and the build log."""
