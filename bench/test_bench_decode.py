"""Decode: one query token per sequence over a KV cache of 4k to 32k tokens, GQA (32 query heads
over 8 kv heads), D = 128, float32. Memory-bound: bytes = the K and V cache read once
(``2 * B * L * Hkv * D * 4``); the GB/s in extra_info is the number to compare.
"""

from __future__ import annotations

import pytest

from attnlib._bench.shapes import Case

CASES = [
    Case(task="decode", dtype="float32", B=1, H=32, Hkv=8, L=cache_len, D=128)
    for cache_len in (4096, 8192, 16384, 32768)
]


@pytest.mark.parametrize("case", CASES, ids=Case.ident)
def test_decode(run_case, bench_runner, case):
    run_case(bench_runner, case)
