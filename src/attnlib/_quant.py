"""Quantized KV-cache formats (contract §10): K and V stored in 8 bits with one float32 scale
per (token, kv head), ``value = scale * stored``.

A token's row ``x (D,)`` of one kv head gets ``scale = absmax(x) / FMAX`` (FMAX the format's
largest finite value) and ``stored = round(x / scale)`` clipped to ``[-FMAX, FMAX]`` (fp8:
round to nearest even, as ml_dtypes casts; int8: round half to even, as ``np.rint``). A row of
zeros gets scale 0 and stored 0, which dequantize to 0 (never 0 / 0). Every backend decodes a
stored byte exactly (the numpy reference through :func:`decode_table`, the kernels from its bits),
so the value a kernel reads is the value :func:`dequantize` gives.

Nothing here checks user input (``attnlib._spec.check_kv_dtype`` does) or touches a device.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["FORMATS", "KVFormat", "decode_table", "dequantize", "format_of", "quantize"]


class KVFormat:
    """One storage format: its name, numpy storage dtype, largest finite value, and ``code``,
    the number the kernels select it by (OpenCL's ``-D KV_FORMAT``, numba's ``kv_format``)."""

    __slots__ = ("name", "dtype", "fmax", "code")

    def __init__(self, name: str, dtype: np.dtype, fmax: float, code: int) -> None:
        self.name, self.dtype, self.fmax, self.code = name, np.dtype(dtype), float(fmax), code

    def __repr__(self) -> str:
        return f"KVFormat({self.name!r})"


FORMATS: dict[str, KVFormat] = {
    "float8_e4m3fn": KVFormat("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 448.0, 1),
    "float8_e5m2": KVFormat("float8_e5m2", ml_dtypes.float8_e5m2, 57344.0, 2),
    "int8": KVFormat("int8", np.int8, 127.0, 3),
}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def format_of(dtype: np.dtype) -> KVFormat | None:
    """The format whose storage dtype is ``dtype``, or None (a float dtype: not quantized)."""
    return _BY_DTYPE.get(np.dtype(dtype))


_tables: dict[tuple[str, str], np.ndarray] = {}


def decode_table(fmt: KVFormat, dtype: Any = np.float32) -> np.ndarray:
    """``table[b]`` = the value of the stored byte ``b`` (read as uint8), in ``dtype``; exact
    (every 8-bit value is a float32). Made once per (format, dtype); read-only."""
    key = (fmt.name, np.dtype(dtype).str)
    t = _tables.get(key)
    if t is None:
        t = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(dtype)
        t.flags.writeable = False
        _tables[key] = t
    return t


def quantize(x: np.ndarray, fmt: KVFormat) -> tuple[np.ndarray, np.ndarray]:
    """``x (..., D)`` (any float dtype) -> (stored ``(..., D)`` of ``fmt.dtype``, float32 scales
    ``(...)``): one scale per row of the last axis (see the module docstring)."""
    xf = np.asarray(x).astype(np.float32)
    with np.errstate(all="ignore"):
        absmax = np.max(np.abs(xf), axis=-1) if xf.shape[-1] else np.zeros(xf.shape[:-1])
        scale = (absmax / np.float32(fmt.fmax)).astype(np.float32)
        inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, 1), 0)
        y = xf * inv.astype(np.float32)[..., None]
        y = np.where(scale[..., None] > 0, y, xf * 0)  # 0 for a zero row; NaN stays NaN
        y = np.clip(y, -fmt.fmax, fmt.fmax)
        if fmt.dtype == np.int8:
            y = np.nan_to_num(np.rint(y))
        stored = y.astype(fmt.dtype)
    return stored, scale


def dequantize(stored: np.ndarray, scales: np.ndarray,
               dtype: Any = np.float64) -> np.ndarray:
    """``scale * stored`` in ``dtype`` (float64: exact): ``stored (..., D)``, ``scales (...)``."""
    s = np.asarray(stored)
    fmt = format_of(s.dtype)
    vals = decode_table(fmt, np.float64)[s.view(np.uint8)] if fmt is not None else \
        s.astype(np.float64)
    return (vals * np.asarray(scales, np.float64)[..., None]).astype(dtype)
