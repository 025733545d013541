"""`attnlib info` on OpenCL: each implementation (platform and version) and device, in words."""

from __future__ import annotations

import pytest

import attnlib

pytest.importorskip("pyopencl")

from attnlib.backends.opencl import OpenCLBackend, _runtime  # noqa: E402

pytestmark = pytest.mark.skipif(
    not OpenCLBackend.is_available(), reason="no OpenCL device (pyopencl[pocl] provides one)"
)


def test_device_types_in_words():
    assert _runtime.device_type_words(2) == "CPU"
    assert _runtime.device_type_words(4 | 1) == "GPU"  # the DEFAULT bit is not a type
    assert _runtime.device_type_words(2 | 4 | 8) == "CPU, GPU, accelerator"
    assert _runtime.device_type_words(0xFFFFFFFF).startswith("every type")


def test_info_names_platform_version_and_device():
    info = attnlib.get_backend("opencl").info()
    assert info["platform_version"].startswith("OpenCL ")
    assert info["opencl"].startswith("OpenCL ")
    assert info["type"] in ("CPU", "GPU", "accelerator", "custom", "CPU, GPU")
    lines = _runtime.describe_platforms()
    mine = [ln for ln in lines if ln.startswith(f"{info['platform']} (")]
    assert any(f"| {info['device']} | {info['type']} |" in ln for ln in mine), lines
    for ln in lines:
        assert "_is_bitfield" not in ln and "ALL" not in ln, ln
