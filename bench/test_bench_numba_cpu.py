"""numba backend vs PyTorch SDPA on the CPU, float32, same process, same data.

    pytest bench/test_bench_numba_cpu.py --benchmark-only
    pytest bench/test_bench_numba_cpu.py --benchmark-only -k prefill --benchmark-group-by=group

Each group (one shape) holds the two runners side by side; ``extra_info`` carries GFLOP/s, GB/s
and the first call's time (numba: loading or compiling the kernels). Prefill: (B, H, S, D) in
{(1,8,512,64), (1,8,2048,64), (1,8,4096,64), (1,8,2048,128)} x causal; decode: one query token
over a KV cache of 4k to 32k tokens, 32 query heads over 8 kv heads, D = 128 (memory-bound:
compare GB/s of cache read). bench/numba_vs_torch.py prints the same comparison as a table
(alternating the two runners call by call) for bench/RESULTS.md.

PyTorch is imported when this module is collected, before any numba call: the backend's first
MKL call makes the ``mkl`` wheel's sequential libraries global symbols, and a torch imported
after that sizes its OpenMP pool from their ``mkl_get_max_threads()`` (1), so it would run on one
thread (its SDPA at S=512: 4.7-5.1 ms against 2.5-2.9 here). ``extra_info["threads"]``
records each side's threads.
"""

from __future__ import annotations

import pytest

from attnlib._bench.runners import AttnlibRunner, TorchRunner
from attnlib._bench.shapes import Case

try:  # before the numba backend loads MKL (see the module docstring)
    import torch
except ImportError:
    torch = None

PREFILL = [
    Case(task="prefill", dtype="float32", B=b, H=h, Hkv=h, S=s, D=d, causal=c)
    for (b, h, s, d) in [(1, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 4096, 64), (1, 8, 2048, 128)]
    for c in (False, True)
]
DECODE = [
    Case(task="decode", dtype="float32", B=1, H=32, Hkv=8, L=cache_len, D=128)
    for cache_len in (4096, 8192, 16384, 32768)
]
_RUNNERS: dict[str, object] = {}


def _runner(name: str):
    if name == "torch":
        if torch is None:
            pytest.skip("the torch side of the comparison needs PyTorch")
    else:
        pytest.importorskip("numba")
    if name not in _RUNNERS:
        _RUNNERS[name] = TorchRunner() if name == "torch" else AttnlibRunner(name)
    runner = _RUNNERS[name]
    if name == "torch" and runner.cuda:
        pytest.skip("this suite compares CPU against CPU; torch sees a CUDA device here")
    return runner


def _threads(name: str) -> int:
    if name == "torch":
        return torch.get_num_threads()
    import numba

    return numba.get_num_threads()


# the side varies fastest, so each shape's two runs are neighbours in time (this VM's speed
# drifts over minutes)
@pytest.mark.parametrize("side", ["numba", "torch"])
@pytest.mark.parametrize("case", PREFILL, ids=Case.ident)
def test_numba_cpu_prefill(run_case, case, side, benchmark):
    runner = _runner(side)
    benchmark.extra_info["threads"] = _threads(side)
    run_case(runner, case)


@pytest.mark.parametrize("side", ["numba", "torch"])
@pytest.mark.parametrize("case", DECODE, ids=Case.ident)
def test_numba_cpu_decode(run_case, case, side, benchmark):
    runner = _runner(side)
    benchmark.extra_info["threads"] = _threads(side)
    run_case(runner, case)
