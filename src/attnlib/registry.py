"""Backend registry: built-ins (imported lazily), entry points, and the choice of backend.

Precedence, first that applies: the ``backend=`` argument; the innermost ``use_backend``
(a contextvar, so threads and asyncio tasks each see their own); ``set_backend``; the
``ATTNLIB_BACKEND`` environment variable (read at call time); ``"auto"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import _config, _spec
from .backends.base import Backend

__all__ = [
    "available_backends",
    "get_backend",
    "register_backend",
    "set_backend",
    "use_backend",
    "resolve_backend",
    "current_choice",
    "known_backends",
]

_BUILTINS: dict[str, str] = {
    "numpy": "attnlib.backends.numpy_backend:NumpyBackend",
    "numba": "attnlib.backends.numba_backend:NumbaBackend",
    "opencl": "attnlib.backends.opencl:OpenCLBackend",
}
_ENTRY_POINT_GROUP = "attnlib.backends"
_REQUIRED_METHODS = (
    "is_available", "attention", "softmax", "merge_states", "rope", "cache_alloc", "cache_write",
)

_lock = threading.RLock()
_classes: dict[str, type[Backend]] = {}
_registered: dict[str, Any] = {}  # name -> class, or "module:attr" string still to import
_instances: dict[str, Backend] = {}
_entry_points_loaded = False
_global_choice: str | Backend | None = None
_context_choice: contextvars.ContextVar[str | Backend | None] = contextvars.ContextVar(
    "attnlib_backend", default=None
)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    try:
        eps = entry_points(group=_ENTRY_POINT_GROUP)
    except Exception as exc:  # a broken environment must not break the built-ins
        warnings.warn(f"attnlib: could not read entry points: {exc}", RuntimeWarning, stacklevel=3)
        return
    for ep in eps:
        if ep.name in _BUILTINS or ep.name in _registered:
            continue
        _registered[ep.name] = ep


def known_backends() -> list[str]:
    """Every backend name attnlib knows (available here or not)."""
    with _lock:
        _load_entry_points()
        return list(_BUILTINS) + [n for n in _registered if n not in _BUILTINS]


def _load_class(name: str) -> type[Backend] | None:
    """The class for ``name``, or None when its module cannot be imported (warns for plug-ins)."""
    if name in _classes:
        return _classes[name]
    target = _BUILTINS.get(name) or _registered.get(name)
    if target is None:
        return None
    try:
        if isinstance(target, str):
            mod_name, attr = target.split(":")
            cls = getattr(importlib.import_module(mod_name), attr)
        elif isinstance(target, type):
            cls = target
        else:  # an entry point
            cls = target.load()
        _spec.check_backend_class(name, cls, _REQUIRED_METHODS)
    except Exception as exc:
        if name not in _BUILTINS:
            warnings.warn(
                f"attnlib: backend plug-in {name!r} failed to load and is ignored: {exc!r}",
                RuntimeWarning,
                stacklevel=3,
            )
        if name not in _BUILTINS:
            _registered.pop(name, None)
        return None
    _classes[name] = cls
    return cls


def _safe_available(cls: type[Backend]) -> bool:
    try:
        return bool(cls.is_available())
    except Exception:
        return False


def _priority(cls: type[Backend]) -> int:
    try:
        return int(cls.auto_priority())
    except Exception:
        return 0


def available_backends() -> list[str]:
    """Names of the backends that can run here, in ``"auto"``'s order (best first)."""
    with _lock:
        found = []
        for i, name in enumerate(known_backends()):
            cls = _load_class(name)
            if cls is not None and _safe_available(cls):
                found.append((-_priority(cls), i, name))
        return [name for _, _, name in sorted(found)]


def register_backend(name: str, cls: type[Backend]) -> None:
    """Add a third-party backend class under ``name`` (replacing a previous registration)."""
    _spec.check_backend_register_name(name)
    _spec.check_backend_class(name, cls, _REQUIRED_METHODS)
    with _lock:
        _load_entry_points()
        _registered[name] = cls
        _classes[name] = cls
        _instances.pop(name, None)


class _FromEnv(str):
    """A backend name that came from the ATTNLIB_BACKEND variable: errors it causes name the
    variable, so that a user who never wrote ``backend=`` learns where the name came from."""


def _origin(name: Any) -> str:
    return _spec.backend_origin(name, isinstance(name, _FromEnv))


def get_backend(name: str = "auto", **options: Any) -> Backend:
    """A backend instance. Without options the shared default instance is returned;
    with options (e.g. ``get_backend("opencl", queue=q)``) a new instance is made."""
    if isinstance(name, Backend):
        return name
    _spec.check_backend_str(name, known_backends)
    origin = _origin(name)
    name = _FromEnv(name.strip()) if isinstance(name, _FromEnv) else name.strip()
    if name == "auto":
        avail = available_backends()
        name = avail[0]
    with _lock:
        _spec.check_backend_known(name, known_backends, isinstance(name, _FromEnv))
        name = str(name)
        cls = _load_class(name)
        _spec.check_backend_importable(cls, origin, name)
        if options:
            return cls(**options)
        inst = _instances.get(name)
        if inst is not None:
            return inst
        _spec.check_backend_available(_safe_available(cls), origin, name, available_backends)
        inst = cls()
        _instances[name] = inst
        return inst


def _validate_choice(name: Any) -> str | Backend | None:
    if name is None or isinstance(name, Backend):
        return name
    _spec.check_backend_choice_type(name)
    name = name.strip()
    _spec.check_backend_known(name, known_backends, allow_auto=True)
    return name


def set_backend(name: str | Backend | None) -> None:
    """Set the process-wide default backend; ``set_backend(None)`` undoes it."""
    global _global_choice
    _global_choice = _validate_choice(name)


@contextlib.contextmanager
def use_backend(name: str | Backend) -> Iterator[None]:
    """Use ``name`` inside the ``with`` block (per thread / asyncio task)."""
    _spec.check_backend_not_none(name)
    token = _context_choice.set(_validate_choice(name))
    try:
        yield
    finally:
        _context_choice.reset(token)


def shared_instance(name: str) -> Backend | None:
    """The shared default instance of backend ``name`` if :func:`get_backend` has made it, else
    None (never makes one)."""
    return _instances.get(name)


def current_choice(backend: str | Backend | None = None) -> str | Backend | None:
    """The explicit choice in force (argument > use_backend > set_backend > env), or None."""
    for choice in (backend, _context_choice.get(), _global_choice):
        if choice is not None:
            return choice
    env = _config.env_backend()
    return None if env is None else _FromEnv(env)


def resolve_backend(backend: str | Backend | None = None) -> Backend:
    """The backend a call uses, by the precedence rule of the module docstring."""
    choice = current_choice(backend)
    return get_backend("auto" if choice is None else choice)
