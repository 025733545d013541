"""OpenCL runtime: device choice, context and queue, kernel sources, program build + memo.

Device choice (contract §5): ``PYOPENCL_CTX`` when set (pyopencl's own syntax), else the first
GPU that is not a simulator, else the first device that is not a simulator. Oclgrind reports every
device-type bit, GPU included, so simulators are recognised by platform name.

Programs are built through pyopencl's ``Program.build``, which keeps its own on-disk binary cache
keyed by source, options and driver; on top of that one in-memory memo per
(context, file, options) avoids even the hashing on every call.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ... import _config, _notice
from ...errors import BackendUnavailableError, KernelBuildError

_SIMULATOR_PLATFORMS = ("oclgrind",)


def is_simulator(device: Any) -> bool:
    """True for devices of a simulator platform (Oclgrind), which auto never picks."""
    name = device.platform.name.lower()
    return any(s in name for s in _SIMULATOR_PLATFORMS)


def list_devices() -> list[Any]:
    import pyopencl as cl

    devices = []
    for platform in cl.get_platforms():
        try:
            devices.extend(platform.get_devices())
        except cl.Error:  # a platform with no device raises instead of returning []
            continue
    return devices


#: device-type bits (cl.device_type) in words, as ``attnlib info`` prints them
_TYPE_WORDS = ((2, "CPU"), (4, "GPU"), (8, "accelerator"), (16, "custom"))
_ALL_TYPES = 0xFFFFFFFF


def device_type_words(bits: int) -> str:
    """``CL_DEVICE_TYPE`` bits in words: "CPU", "GPU", "CPU, GPU", ... (the DEFAULT bit is left
    out; a device that sets every bit, as Oclgrind does, is "every type")."""
    bits = int(bits)
    if bits & _ALL_TYPES == _ALL_TYPES:
        return "every type (all type bits set)"
    words = [w for bit, w in _TYPE_WORDS if bits & bit]
    return ", ".join(words) or "unknown type"


def describe_device(device: Any) -> str:
    """One line naming a device's implementation (platform and its version), the device, its
    type in words, OpenCL version, driver and the limits attnlib's tiling depends on."""
    p = device.platform
    fp64 = "fp64" if "cl_khr_fp64" in device.extensions else "no fp64"
    return (f"{p.name.strip()} ({p.version.strip()}) | {device.name.strip()} | "
            f"{device_type_words(device.type)} | {device.version.strip()} | "
            f"driver {device.driver_version.strip()} | {device.max_compute_units} compute units | "
            f"{device.local_mem_size // 1024} KiB local | "
            f"{device.global_mem_size / 2**30:.1f} GiB | {fp64}")


def describe_platforms() -> list[str]:
    """A line per OpenCL device of every platform (:func:`describe_device`), and one per platform
    that lists no device (Mesa's rusticl lists devices only for the drivers RUSTICL_ENABLE
    names, e.g. RUSTICL_ENABLE=llvmpipe)."""
    import pyopencl as cl

    lines = []
    for p in cl.get_platforms():
        try:
            devices = p.get_devices()
        except cl.Error:
            devices = []
        lines += [describe_device(d) for d in devices]
        if not devices:
            hint = " (set RUSTICL_ENABLE, e.g. llvmpipe)" if "rusticl" in p.name.lower() else ""
            lines.append(f"{p.name.strip()} ({p.version.strip()}) | no device{hint}")
    return lines


def has_gpu() -> bool:
    """True when a non-simulator GPU is present; never raises."""
    try:
        import pyopencl as cl

        return any(
            d.type & cl.device_type.GPU and not is_simulator(d) for d in list_devices()
        )
    except Exception:
        return False


def choose_context() -> Any:
    """A context on the device the contract's rule picks (PYOPENCL_CTX first)."""
    import pyopencl as cl

    wanted = _config.pyopencl_ctx()
    if wanted:
        try:
            return cl.create_some_context(interactive=False)
        except Exception as exc:
            raise BackendUnavailableError(
                f"opencl: PYOPENCL_CTX={wanted!r} selects no usable device "
                f"({exc}); unset it to let attnlib choose"
            ) from exc
    devices = [d for d in list_devices() if not is_simulator(d)]
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    chosen = (gpus or devices or [None])[0]
    if chosen is None:
        raise BackendUnavailableError(
            "opencl: no OpenCL device found (simulators such as Oclgrind are only used when "
            "PYOPENCL_CTX selects them)"
        )
    return cl.Context([chosen])


def _read_kernel_file(filename: str) -> str:
    try:
        res = resources.files("attnlib").joinpath("kernels", filename)
        if res.is_file():
            return res.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = Path(__file__).resolve().parents[4] / "kernels" / filename
    return path.read_text(encoding="utf-8")


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def kernel_source(filename: str) -> str:
    """The text of ``kernels/<filename>`` (the installed wheel's attnlib/kernels, else the repo),
    with its ``#include "x.h"`` lines replaced by kernels/x.h: the program's source then holds
    everything it depends on, so pyopencl's cache key covers the headers too and no ``-I`` path
    has to survive every vendor's compiler."""
    return _INCLUDE.sub(lambda m: kernel_source(m.group(1)), _read_kernel_file(filename))


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of one kernel file; every field becomes ``-D NAME=value``.

    Subclasses name their fields in UPPER_CASE, exactly as the macros are spelt in the .cl file.
    """

    def options(self) -> tuple[str, ...]:
        """The sorted ``-D`` options of this config (the memo and pyopencl's cache key)."""
        return _options(self)


@functools.lru_cache(maxsize=1024)
def _options(cfg: KernelConfig) -> tuple[str, ...]:
    defs = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, bool):
            value = int(value)
        defs.append(f"-D{f.name}={value}")
    return tuple(sorted(defs))


_program_lock = threading.Lock()
#: every built program of the process, by (context, device or None, file, options, std)
_programs: dict[tuple, Any] = {}
_sources: dict[str, str] = {}


def program(ctx: Any, filename: str, options: tuple[str, ...], *, device: Any = None,
            std: str | None = "CL1.2", build: Any = None) -> Any:
    """The program of kernels/<filename> built with ``options``: one per context, device, file,
    options and OpenCL C version for the whole process (the one program cache of the backend;
    pyopencl keeps the binaries on disk, keyed by source, options and device, so a new process
    compiles nothing it compiled before). Built by :func:`build_program` for ``device`` (None:
    every device of ``ctx``), or by ``build()`` for a program not built from the file's text
    alone (the warpgroup-MMA kernel, built through its PTX)."""
    key = (ctx.int_ptr, None if device is None else device.int_ptr, filename, options, std)
    prg = _programs.get(key)
    if prg is not None:
        return prg
    with _program_lock:
        prg = _programs.get(key)
        if prg is None:
            if build is None:
                src = _sources.get(filename)
                if src is None:
                    src = _sources[filename] = kernel_source(filename)
                prg = build_program(ctx, filename, src, options, std=std,
                                    devices=None if device is None else [device])
            else:
                prg = build()
            _programs[key] = prg
    return prg


def build_program(ctx: Any, filename: str, source: str, options: tuple[str, ...], *,
                  std: str | None = "CL1.2", devices: list | None = None) -> Any:
    """Build ``source`` (for ``devices``, default every device of ``ctx``; ``std=None``: the
    compiler's default OpenCL C version); a failure raises KernelBuildError naming the file,
    options and log."""
    import pyopencl as cl

    opts = list(options) + ([f"-cl-std={std}"] if std else [])
    names = ", ".join(d.name.strip() for d in (devices or ctx.devices))
    try:
        with _notice.if_slow("opencl", f"building OpenCL kernels/{filename} for {names} "
                             "(first use of each kernel variant; the driver's or pyopencl's "
                             "cache keeps the binaries for later processes)"):
            return cl.Program(ctx, source).build(options=opts, devices=devices)
    except cl.Error as exc:
        log = str(exc)
        raise KernelBuildError(
            f"opencl: building kernels/{filename} failed on {names} with options "
            f"{' '.join(opts)}:\n{log}"
        ) from exc


# clSetKernelArg on a kernel object is not thread-safe: arguments are set and the kernel
# enqueued under one lock, shared by every launch of the backend (re-entrant: a repeat-call plan
# rewrites its device tables and launches under it, see _attention and _nvidia_decode)
launch_lock = threading.RLock()


class KernelSlot:
    """A kernel object and the arguments last set on it.

    ``clSetKernelArg`` is per-object state, so a launch sets only the arguments that differ from
    the last launch of the same object: scalars compared by type and value, pooled buffers by
    their ``cl_mem`` handle (a pooled block handed out again is the same memory), every other
    buffer set again. A handle is only a name: once its object is released the driver may give
    the same value to a new buffer, and a kernel argument set from the old one may still address
    the old memory (Oclgrind resolves the address when the argument is set, and caught a fresh
    input buffer read through such a stale argument in CI). So the slot retains each pooled
    handle it set (``held``), which keeps that value from being reused while it is compared
    against; a non-pooled buffer (an input uploaded for one call) is not retained, so that its
    memory is freed with it, and is set on every launch. ``owner`` is the plan that set every
    argument last; a launch by that plan compares only its ``varying`` slots (its other
    arguments are buffers the plan itself holds)."""

    __slots__ = ("knl", "last", "held", "kinds", "owner", "plain")

    def __init__(self, knl: Any, args: Sequence[Any]) -> None:
        import numpy as np

        global _POOLED
        if _POOLED is None:
            _POOLED = _pooled_type()
        self.knl = knl
        #: per argument: None for a buffer (or NULL), else the pack character of its scalar type
        self.kinds = [a.dtype.char.encode() if isinstance(a, np.generic) else None
                      for a in args]
        self.last: list = [_UNSET] * len(args)
        self.held: list = [None] * len(args)
        self.owner: Any = None
        # pyopencl's per-group setters (what its generated set_args calls); without them, or
        # for a scalar type they do not pack, every launch sets every argument
        self.plain = not (hasattr(knl, "_set_arg_multi")
                          and hasattr(knl, "_set_arg_buf_pack_multi")
                          and all(k is None or k in _PACK_CHARS for k in self.kinds))
        if self.plain:
            knl.set_scalar_arg_dtypes(
                [a.dtype if isinstance(a, np.generic) else None for a in args])

    def set(self, args: Sequence[Any], slots: Any) -> None:
        """Set the arguments of ``slots`` (indices) that changed since the last launch."""
        if self.plain:
            self.knl.set_args(*args)
            return
        last, kinds = self.last, self.kinds
        mems: list = []
        packs: list = []
        for i in slots:
            a = args[i]
            kind = kinds[i]
            if kind is None:
                if a is None:
                    if last[i] != 0:
                        mems += (i, a)
                        last[i], self.held[i] = 0, None
                elif type(a) is _POOLED:
                    ptr = a.int_ptr
                    if ptr != last[i]:
                        mems += (i, a)
                        last[i], self.held[i] = ptr, _retain(ptr)
                else:
                    mems += (i, a)
                    last[i], self.held[i] = _UNSET, None
            else:
                prev = last[i]
                if prev is _UNSET or type(a) is not type(prev) or a != prev:
                    packs += (i, kind, a)
                    last[i] = a
        if mems:
            self.knl._set_arg_multi(tuple(mems))
        if packs:
            self.knl._set_arg_buf_pack_multi(tuple(packs))


_UNSET = object()


def _pooled_type() -> Any:
    try:
        import pyopencl._cl as _cl

        return _cl.PooledBuffer
    except (ImportError, AttributeError):  # pragma: no cover - every buffer is then set again
        return type("NoPooledBuffer", (), {})


def _retain(ptr: int) -> Any:
    """A new reference to the ``cl_mem`` ``ptr`` (``clRetainMemObject``), released with it."""
    import pyopencl as cl

    return cl.Buffer.from_int_ptr(ptr, retain=True)


#: pyopencl's PooledBuffer type, looked up when the first KernelSlot is made
_POOLED: Any = None
#: scalar type characters pyopencl's ``_set_arg_buf_pack_multi`` packs (its invoker's list)
_PACK_CHARS = frozenset(c.encode() for c in "cbBhHiIlLfd")


#: every kernel object of the process (a KernelSlot), by the key its launches give
kernels: dict[tuple, KernelSlot] = {}


def launch(key: tuple, make_program: Any, name: str, queue: Any, gsize: tuple,
           lsize: tuple | None, args: Sequence[Any], wait_for: Any = None,
           varying: Sequence[int] | None = None, owner: Any = None) -> Any:
    """Enqueue kernel ``name`` and return its event. :data:`kernels` holds one
    :class:`KernelSlot` per ``key`` (the context, the program's file and options, the kernel:
    what fixes the object), made on first use from ``make_program()``: a fresh ``cl.Kernel`` per
    call makes
    pyopencl generate its argument invoker again (a large cost per call on a GPU host,
    bench/RESULTS.md). Only the arguments that changed since the object's last launch are set;
    with ``owner`` (a plan whose other arguments are fixed) only its ``varying`` slots are
    compared when that plan launched the object last."""
    import pyopencl as cl

    slot = kernels.get(key)
    if slot is None:
        prg = make_program()  # builds outside the launch lock
        with launch_lock:
            slot = kernels.get(key)
            if slot is None:
                slot = kernels[key] = KernelSlot(cl.Kernel(prg, name), args)
    with launch_lock:
        if owner is not None and slot.owner is owner:
            slot.set(args, varying)
        else:
            slot.set(args, range(len(args)))
            slot.owner = owner
        return _enqueue(queue, slot.knl, gsize, lsize, None, wait_for)


def _enqueue_wrapped(queue, knl, gsize, lsize, offset, wait_for):  # pragma: no cover
    import pyopencl as cl

    return cl.enqueue_nd_range_kernel(queue, knl, gsize, lsize, offset, wait_for)


def _low_level_enqueue() -> Any:
    """pyopencl's C-level ``enqueue_nd_range_kernel`` (what the Python name is bound to in
    2024.x-2026.x), else the Python wrapper."""
    try:
        from pyopencl import _cl

        return _cl.enqueue_nd_range_kernel
    except (ImportError, AttributeError):  # pragma: no cover
        return _enqueue_wrapped


_enqueue = _low_level_enqueue()
