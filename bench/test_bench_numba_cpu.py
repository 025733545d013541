"""numba backend vs PyTorch SDPA on the CPU, float32, same process, same data.

    pytest bench/test_bench_numba_cpu.py --benchmark-only
    pytest bench/test_bench_numba_cpu.py --benchmark-only -k prefill --benchmark-group-by=group

Each group (one shape) holds the two runners side by side; ``extra_info`` carries GFLOP/s, GB/s
and the first call's time (numba: loading or compiling the kernels). Prefill: (B, H, S, D) in
{(1,8,512,64), (1,8,2048,64), (1,8,4096,64), (1,8,2048,128)} x causal; decode: one query token
over a KV cache of 4k to 32k tokens, 32 query heads over 8 kv heads, D = 128 (memory-bound:
compare GB/s of cache read). bench/numba_vs_torch.py prints the same comparison as a table
(alternating the two runners call by call) for bench/RESULTS.md.
"""

from __future__ import annotations

import pytest

from attnlib._bench.runners import AttnlibRunner, TorchRunner
from attnlib._bench.shapes import Case

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


@pytest.fixture(params=["numba", "torch"])
def numba_or_torch(request: pytest.FixtureRequest):
    name = request.param
    if name == "torch":
        pytest.importorskip("torch", reason="the torch side of the comparison needs PyTorch")
    else:
        pytest.importorskip("numba")
    if name not in _RUNNERS:
        _RUNNERS[name] = TorchRunner() if name == "torch" else AttnlibRunner(name)
    runner = _RUNNERS[name]
    if name == "torch" and runner.cuda:
        pytest.skip("this suite compares CPU against CPU; torch sees a CUDA device here")
    return runner


@pytest.mark.parametrize("case", PREFILL, ids=Case.ident)
def test_numba_cpu_prefill(run_case, numba_or_torch, case):
    run_case(numba_or_torch, case)


@pytest.mark.parametrize("case", DECODE, ids=Case.ident)
def test_numba_cpu_decode(run_case, numba_or_torch, case):
    run_case(numba_or_torch, case)
