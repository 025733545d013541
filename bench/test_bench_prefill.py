"""Prefill: dense attention, float32 on the CPU, shapes (B, H, S, D) x causal.

One benchmark group per shape: every backend and PyTorch SDPA side by side. FLOPs are
``4 * B * H * D * (visible query-key pairs)`` (causal counts the pairs exactly).
"""

from __future__ import annotations

import pytest

from attnlib._bench.shapes import Case

# ascending work, so a slow backend's rate on a small shape predicts the large ones
SHAPES = [(1, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 2048, 128), (1, 8, 4096, 64)]
CASES = [
    Case(task="prefill", dtype="float32", B=b, H=h, Hkv=h, S=s, D=d, causal=c)
    for (b, h, s, d) in SHAPES
    for c in (False, True)
]


@pytest.mark.parametrize("case", CASES, ids=Case.ident)
def test_prefill(run_case, bench_runner, case):
    run_case(bench_runner, case)
