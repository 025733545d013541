"""Paged KV cache: one decode step per sequence over a PagedKVCache, beside the same tokens in a
contiguous KVCache, and a mixed batch (prefill chunks and decode steps in one packed call).

GQA (32 query heads over 8 kv heads), D = 128, float32, page size 16. Memory-bound: bytes = the K
and V cache read once (``2 * B * L * Hkv * D * 4``); the GB/s in extra_info is the number to
compare. ``pages``: ``"in-order"`` (a fresh cache: each sequence's pages follow each other in the
pool) or ``"scattered"`` (pages taken from a shuffled free list, none adjacent), the case a
serving engine meets after sequences have come and gone.

``test_paged_shared_prompt``: 32 sequences forked from one prompt, each with tokens of its own,
one decode step each; ``"cascade"`` reads the prompt's shared pages once for all 32 (the default
path), ``"per-sequence"`` is the same call with the cascade disabled (the prompt read once per
sequence). Bytes there are the tokens attended (the per-sequence read), so the GB/s is effective.

    pytest bench/test_bench_paged.py --benchmark-only --bench-backends numba
"""

from __future__ import annotations

import numpy as np
import pytest

HQ, HKV, D, PAGE = 32, 8, 128, 16


def _backends(config) -> list[str]:
    import attnlib

    opt = config.getoption("--bench-backends")
    names = [n.strip() for n in opt.split(",")] if opt else attnlib.available_backends()
    return [n for n in names if n not in ("torch", "numpy")]


def pytest_generate_tests(metafunc):
    if "paged_backend" in metafunc.fixturenames:
        metafunc.parametrize("paged_backend", _backends(metafunc.config))


def _paged_cache(backend, lens, scattered, rng, spare_pages=0):
    """A PagedKVCache holding ``lens`` random tokens per sequence (one sequence id each), with
    ``spare_pages`` free pages besides."""
    import attnlib

    need = sum(-(-n // PAGE) for n in lens)
    cache = attnlib.PagedKVCache(need + spare_pages, PAGE, HKV, D, backend=backend)
    if scattered:  # every page to a one-token sequence, freed in random order
        fill = [cache.new_sequence() for _ in range(need + spare_pages)]
        one = rng.standard_normal((need + spare_pages, 1, HKV, D)).astype(np.float32)
        cache.append(fill, one, one)
        for i in rng.permutation(need + spare_pages):
            cache.free(fill[i])
    sids = [cache.new_sequence() for _ in lens]
    for s, n in zip(sids, lens):
        step = 4096  # appended in chunks
        for a in range(0, n, step):
            k = rng.standard_normal((1, min(step, n - a), HKV, D)).astype(np.float32)
            cache.append([s], k, k)
    return cache, sids


def _record(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    mean = benchmark.stats.stats.mean if benchmark.stats else None
    if mean:
        benchmark.extra_info["GB/s"] = round(nbytes / mean / 1e9, 2)


@pytest.mark.parametrize("cache_len", [4096, 16384, 32768])
@pytest.mark.parametrize("layout", ["contiguous", "paged-in-order", "paged-scattered"])
def test_paged_decode(benchmark, paged_backend, layout, cache_len):
    import attnlib

    benchmark.group = f"paged decode B=1 Hq={HQ} Hkv={HKV} L={cache_len} D={D} page={PAGE}"
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, HQ, D)).astype(np.float32)
    if layout == "contiguous":
        cache = attnlib.KVCache(1, cache_len, HKV, D, backend=paged_backend)
        k = rng.standard_normal((1, cache_len, HKV, D)).astype(np.float32)
        cache.update(k, k, 0)

        def step():
            return attnlib.attention_with_kvcache(q, cache)
    else:
        cache, sids = _paged_cache(paged_backend, [cache_len], layout.endswith("scattered"),
                                   rng)

        def step():
            return attnlib.attention_with_paged_kvcache(q, cache, sids)
    step()  # compile / build
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=2)
    _record(benchmark, 2 * cache_len * HKV * D * 4)


def test_paged_mixed_batch(benchmark, paged_backend):
    """8 sequences: 2 prefill chunks of 512 tokens over 2048 held, 6 decode steps over 8192
    held, one packed call (queries only: the cache is not changed between rounds)."""
    import attnlib

    benchmark.group = f"paged mixed prefill+decode Hq={HQ} Hkv={HKV} D={D} page={PAGE}"
    rng = np.random.default_rng(1)
    lens = [2048 + 512] * 2 + [8192] * 6
    q_lens = [512, 512] + [1] * 6
    cache, sids = _paged_cache(paged_backend, lens, True, rng)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), HQ, D)).astype(np.float32)

    def step():
        return attnlib.attention_with_paged_kvcache(q, cache, sids, cu_seqlens_q=cu)

    step()
    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=1)
    _record(benchmark, 2 * sum(lens) * HKV * D * 4)


@pytest.mark.parametrize("path", ["cascade", "per-sequence"])
def test_paged_shared_prompt(benchmark, paged_backend, path):
    """32 sequences forked from one 8192-token prompt, 256 tokens of their own each, one decode
    step each (batched q), the cache not changed between rounds."""
    import attnlib
    from attnlib import _cascade

    n_seq, prompt, own = 32, 8192, 256
    benchmark.group = (f"paged shared prompt B={n_seq} prompt={prompt} own={own} Hq={HQ} "
                       f"Hkv={HKV} D={D} page={PAGE}")
    rng = np.random.default_rng(2)
    cache, (root,) = _paged_cache(paged_backend, [prompt], True, rng,
                                  spare_pages=n_seq * -(-own // PAGE))
    sids = [cache.fork(root) for _ in range(n_seq)]
    cache.free(root)
    k = rng.standard_normal((n_seq, own, HKV, D)).astype(np.float32)
    cache.append(sids, k, k)
    q = rng.standard_normal((n_seq, 1, HQ, D)).astype(np.float32)

    def step():
        return attnlib.attention_with_paged_kvcache(q, cache, sids)

    threshold = _cascade.MIN_PREFIX_TOKENS
    _cascade.MIN_PREFIX_TOKENS = threshold if path == "cascade" else None
    try:
        step()
        benchmark.pedantic(step, rounds=5 if path == "cascade" else 3, iterations=1,
                           warmup_rounds=1)
    finally:
        _cascade.MIN_PREFIX_TOKENS = threshold
    _record(benchmark, 2 * n_seq * (prompt + own) * HKV * D * 4)
