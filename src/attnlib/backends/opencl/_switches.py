"""Process-wide switches that change what an attention call builds or which kernel family runs
it (A/B runs, benchmarks, the emulated tests). Every plan key holds :data:`KEY`, so changing
one never serves a plan made under another."""

from __future__ import annotations

import sys
import types

from ... import _config

#: float32 through 3xTF32 on the tensor cores of sm_80+ (False: float32 stays on the portable
#: kernel)
F32_ON = True
#: Hopper (compute capability 9.0): float16/bfloat16 prefill on the warpgroup-MMA kernel
#: (``_nvidia_wgmma``); ATTNLIB_NV_WGMMA=0 turns it off, e.g. to compare with mma.sync
WGMMA_ON = _config.nv_wgmma()
#: the tensor-core prefill kernel's grid order for every call (kernel -DHEADS_INNER): False:
#: (tile, head) on dimensions 0, 1; True: one dimension, tile * n_heads + head (causal calls
#: take it whatever this says, see ``_nvidia_mma.kernel_options``)
HEADS_INNER = False
#: tests only: the tensor-core families build their emulated kernels (USE_PTX=0), so they run
#: on PoCL under a patched compute capability
EMULATE_PTX = False
#: the tensor-core decode kernel's last work-group of a (sequence, kv head) merges the splits
#: (no merge.cl launch)
FUSED_MERGE = True
#: ATTNLIB_OPENCL_CP_ASYNC=0/1 forces the portable kernel's K/V staging (A/B runs, tests): on
#: devices without cp.async, 1 builds with CP_ASYNC_EMULATE (plain copies, the same tile walk)
CP_ASYNC_FORCE: bool | None = _config.opencl_cp_async()


_NAMES = ("F32_ON", "WGMMA_ON", "HEADS_INNER", "EMULATE_PTX", "FUSED_MERGE", "CP_ASYNC_FORCE")
#: each combination of switch values seen, numbered (a plan key holds the number: one small int
#: to hash per call)
_COMBINATIONS: dict[tuple, int] = {}


def values() -> tuple:
    """The switches in force."""
    return tuple(globals()[n] for n in _NAMES)


#: the number of :func:`values` in force, part of every plan key; kept up to date by every
#: assignment to a switch of this module (``monkeypatch.setattr`` included)
KEY = _COMBINATIONS.setdefault(values(), len(_COMBINATIONS))


class _Switches(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in _NAMES:
            super().__setattr__("KEY", _COMBINATIONS.setdefault(values(), len(_COMBINATIONS)))


sys.modules[__name__].__class__ = _Switches
