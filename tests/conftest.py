"""Our own test session: the shipped conformance plugin drives every backend.

The plugin normally arrives through its ``pytest11`` entry point; when that is not there (attnlib
not installed as a distribution, or plugin autoload disabled) it is loaded from here instead.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest


def _entry_point_loads_plugin() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "attnlib.testing.plugin" for ep in entry_points(group="pytest11"))


if not _entry_point_loads_plugin():
    pytest_plugins = ["attnlib.testing.plugin"]


# -- the emulation grid ---------------------------------------------------------------------------
# The NVIDIA kernels' emulated builds (USE_PTX=0 on PoCL) cost 5-30 s each. The default run keeps
# every kernel variant the library selects by default (each kernel family, dtype and head dim
# its dispatch takes, the default schedule and shared-memory layout); builds the dispatch never
# makes by default (other tilings, candidate and off-by-default options, head dims not
# dispatched) are marked ``emulation_grid``: deselected by the default ``-m`` of pyproject.toml,
# run by ``python -m pytest -q -n 2 tests -m emulation_grid`` (a step of .ci/run).

#: (file, test) -> which of its cases are grid: True (all), or a predicate on the case's params
#: that says True for a grid case
_GRID = {
    ("test_nvidia_mma_emulated.py", "test_mma_f32_configs"): True,
    ("test_nvidia_mma_emulated.py", "test_mma_sched_options"): True,
    # padded head dims and masks: cold builds cost 15-25 s each, all in the grid step
    ("test_nvidia_mma_emulated.py", "test_mma_shapes_masks"): True,
    # paged prefill (-DPAGE_SIZE builds of every schedule): the grid step
    ("test_nvidia_mma_emulated.py", "test_mma_paged_emulated"): True,
    ("test_nvidia_mma_emulated.py", "test_mma_mask_hidden_tiles"): True,
    # the candidates closest to the 16-bit defaults (DEFAULT_OPTIONS_16) stay in the default run
    ("test_nvidia_mma_emulated.py", "test_mma_candidate_options"):
        lambda p: p.get("name") not in ("kv_split f16 causal", "kv_split+ldsm_bytes f16 dense"),
    ("test_nvidia_decode_emulated.py", "test_decode_configs"): True,
    ("test_nvidia_decode_emulated.py", "test_decode_extra_head_dims"): True,
    # paged decode: the row-offset / hidden-NaN test stays in the default run; the page sizes,
    # tilings and the fused merge are grid
    ("test_nvidia_decode_emulated.py", "test_decode_paged"): True,
    ("test_nvidia_decode_emulated.py", "test_paged_mixed_batch_emulated"): True,
    # quantized K/V on the decode kernel: e4m3 through the front door is test_host_path.py's
    # test_quantized_cache_dispatch (default run); every format and the paged build are grid
    ("test_nvidia_decode_emulated.py", "test_decode_quantized"): True,
    ("test_nvidia_decode_emulated.py", "test_quantized_paged_dispatch_emulated"): True,
    # the default build: serial schedule (every option =0), the 128-byte swizzle (WG_SWIZZLE=1,
    # the default at D = 64 and 128); one key tile in bfloat16 is left to the grid
    ("test_nvidia_wgmma.py", "test_wgmma_kernel_emulated"):
        lambda p: (p.get("swizzle", 1) != 1
                   or any(not o.endswith("=0") for o in p.get("schedule", ()))
                   or p.get("name") == "plain, one key tile"),
}


def _in_grid(item) -> bool:
    rule = _GRID.get((item.path.name, getattr(item, "originalname", item.name)))
    if rule is None or rule is True:
        return rule is True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool(rule(params))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_grid(item):
            item.add_marker(pytest.mark.emulation_grid)


@pytest.fixture
def kernel_launches(monkeypatch):
    """The names of the OpenCL kernels launched while the test runs (every kernel family and
    primitive launches through ``_runtime.launch``)."""
    from attnlib.backends.opencl import _runtime

    names = []
    real = _runtime.launch

    def record(key, make, name, *args, **kw):
        names.append(name)
        return real(key, make, name, *args, **kw)

    monkeypatch.setattr(_runtime, "launch", record)
    return names


@pytest.fixture
def emulated_nvidia(monkeypatch):
    """The dispatch sees an sm_90 device; the tensor-core kernels are built emulated (USE_PTX=0).
    The prefill plans are the mma.sync kernel's: the warpgroup-MMA program needs NVIDIA's
    compiler (a build here would fail and put this device on the fallback list for the whole
    session). The patched compute capability is no switch of the plan keys: the plans are
    forgotten before and after."""
    import attnlib
    from attnlib.backends.opencl import _nvidia_mma, _switches

    monkeypatch.setattr(_nvidia_mma, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(_switches, "WGMMA_ON", False)
    monkeypatch.setattr(_nvidia_mma, "_wgmma_failed", set())
    monkeypatch.setattr(_switches, "EMULATE_PTX", True)
    attnlib.forget_plans()
    yield
    attnlib.forget_plans()
