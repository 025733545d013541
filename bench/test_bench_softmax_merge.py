"""softmax (one streaming pass of online max/sum) and merge_states (combining partial attention
states), float32: both memory-bound, so GB/s (read + write) is the number to compare."""

from __future__ import annotations

import pytest

from attnlib._bench.shapes import Case

SOFTMAX = [
    Case(task="softmax", dtype="float32", rows=r, cols=c)
    for (r, c) in ((4096, 1024), (4096, 4096), (256, 65536))
]
MERGE = [
    Case(task="merge", dtype="float32", n=n, B=1, S=s, H=32, D=128)
    for (n, s) in ((2, 512), (2, 2048), (8, 1024))
]


@pytest.mark.parametrize("case", SOFTMAX, ids=Case.ident)
def test_softmax(run_case, bench_runner, case):
    run_case(bench_runner, case)


@pytest.mark.parametrize("case", MERGE, ids=Case.ident)
def test_merge(run_case, bench_runner, case):
    run_case(bench_runner, case)
