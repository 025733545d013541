"""Unit tests of the numba backend's internals against the float64 numpy reference.

The conformance suite covers the public contract; these tests aim at the numba kernel's own
moving parts: tile boundaries (sizes just around BLOCK_N / BLOCK_M), GQA row packing, tile
skipping under causal / window, the flash-decoding key split and its merge, the vectorised
exp, hidden non-finite v inside a partly visible tile, and bitwise determinism.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")

import attnlib  # noqa: E402
from attnlib.backends.numba_backend import NumbaBackend  # noqa: E402
from attnlib.backends.numba_backend import _launch as nb  # noqa: E402


def _qkv(rng, b, sq, sk, hq, hkv, d, dv=None, dtype=np.float32):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    return q, k, v


def _check(q, k, v, tol=2e-5, **kw):
    out, lse = attnlib.attention(q, k, v, return_lse=True, backend="numba", **kw)
    ref, ref_lse = attnlib.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), atol=tol, rtol=0)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(fin, np.isfinite(lse))
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=tol * 10, rtol=0)
    return out, lse


@pytest.mark.parametrize("sq,sk", [(127, 129), (129, 255), (1, 257), (200, 3), (257, 127)])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_tile_boundaries(sq, sk, causal):
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = _qkv(rng, 2, sq, sk, 2, 2, 59, 37)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (3, 3)])
def test_gqa_packing_across_blocks(hq, hkv):
    # packed rows = Sq * G cross a BLOCK_M boundary in the middle of a query row's group
    rng = np.random.default_rng(hq)
    sq = nb.BLOCK_M // (hq // hkv) + 3
    q, k, v = _qkv(rng, 1, sq, sq + 40, hq, hkv, 64)
    _check(q, k, v, causal=True)
    _check(q, k, v, window=(17, 5))


@pytest.mark.parametrize("window", [(0, 0), (3, None), (None, 2), (130, 7), (300, 300)])
def test_window_tile_skipping(window):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 301, 333, 2, 1, 32)
    _check(q, k, v, window=window)
    _check(q, k, v, window=window, causal=True)


def test_decode_split_keys_and_merge():
    # one query row per sequence, few tasks and a long cache: the key range is split
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 1, 5 * nb.MIN_KEYS_PER_SPLIT + 77, 4, 1, 64)
    _check(q, k, v)
    _check(q, k, v, causal=True, window=(1000, None))


def test_plan_tasks_split_covers_every_key_once():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 1, 3 * nb.MIN_KEYS_PER_SPLIT + 5, 2, 1, 8)
    calls = []

    class Spy(NumbaBackend):
        def attention(self, call):
            calls.append(call)
            return super().attention(call)

    attnlib.attention(q, k, v, backend=Spy())
    tasks, n_slots = nb.plan_tasks(calls[0], n_threads=2)
    assert n_slots == tasks.shape[0] > 1
    assert tasks[0, 4] == 0 and tasks[-1, 5] == k.shape[1]
    np.testing.assert_array_equal(tasks[1:, 4], tasks[:-1, 5])


def test_hidden_nonfinite_v_in_partial_tile():
    # NaN / inf v rows that causal hides inside a partly visible tile must not leak
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 150, 150, 2, 2, 16)
    v[0, 140, 0, 3] = np.nan
    v[0, 141, 1, :] = np.inf
    k[0, 145, 0, 0] = np.nan
    out, _ = _check(q, k, v, causal=True)
    assert np.isfinite(out[0, :140]).all()
    assert np.isnan(out[0, 140:, 0, 3]).all()


def test_fully_masked_rows_and_tiles():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 40, 300, 2, 2, 16)
    mask = np.ones((1, 1, 40, 300), bool)
    mask[..., :200] = False  # whole key tiles hidden for every row
    mask[:, :, 5, :] = False  # a row that sees nothing
    out, lse = _check(q, k, v, mask=mask)
    assert (out[0, 5] == 0).all() and np.isneginf(lse[0, :, 5]).all()


def test_exp2_kernel_accuracy():
    from attnlib.backends.numba_backend import _flash

    x = np.concatenate([np.linspace(-130, 0, 4001), [-np.inf, np.nan, -1e-30, 0.0]])
    x = x.astype(np.float32)
    nr = x.size
    p = x.copy()
    l_i = np.zeros(nr, np.float32)
    _flash._exp2_f32(p, 1, nr, np.zeros(nr, np.float32), l_i)
    ref = np.exp2(x.astype(np.float64))
    ok = np.isfinite(x) & (x > -125)
    np.testing.assert_allclose(p[ok], ref[ok], rtol=3e-7, atol=0)
    assert (p[x < -127] == 0).all()
    assert np.isnan(p[np.isnan(x)]).all()
    np.testing.assert_array_equal(l_i, p)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.float64])
def test_dtypes_against_reference(dtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 2, 67, 131, 4, 2, 111, dtype=dt)
    tol = 1e-12 if dt == np.float64 else (2e-2 if dt.itemsize == 2 else 2e-5)
    _check(q, k, v, tol=tol, causal=True, softcap=20.0)


def test_bitwise_deterministic():
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 2, 300, 517, 8, 2, 64)
    a = attnlib.attention(q, k, v, causal=True, return_lse=True, backend="numba")
    b = attnlib.attention(q, k, v, causal=True, return_lse=True, backend="numba")
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def test_float32_softmax_special_values_in_every_block():
    """The float32 rows' block max works on integer keys of the float bits: NaN of either sign,
    +inf (inf - inf is NaN), -0.0, subnormals and -inf in any block of a row give the float64
    reference's result."""
    from attnlib.backends.numba_backend import _ops

    blk = _ops._BLOCK
    x = np.random.default_rng(11).standard_normal((9, 2 * blk + 5)).astype(np.float32)
    neg_nan = np.float32(-np.nan)
    assert np.signbit(neg_nan)
    x[0, blk + 3] = neg_nan
    x[1, 2 * blk + 1] = np.nan
    x[2, 2 * blk + 4] = np.inf
    x[3, :blk + 1] = -np.inf
    x[3, blk + 2] = neg_nan
    x[4, :] = -np.inf
    x[4, 3] = np.inf
    x[5, :] = -0.0
    x[6, :] = np.float32(1e-40)  # subnormal
    x[6, blk] = -np.inf
    x[7, :] = -np.inf
    for got, ref in ((attnlib.softmax(x, backend="numba"),
                      attnlib.softmax(x.astype(np.float64), backend="numpy")),
                     (attnlib.logsumexp(x, backend="numba"),
                      attnlib.logsumexp(x.astype(np.float64), backend="numpy"))):
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert np.isnan(got[:5]).all()
        np.testing.assert_allclose(got[5:], ref[5:], rtol=1e-6, atol=1e-7)


def test_softmax_and_merge_against_reference():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 37, 3)).astype(np.float32) * 30
    x[1, :, 2] = -np.inf
    for axis in (0, 1, 2):
        np.testing.assert_allclose(attnlib.softmax(x, axis, backend="numba"),
                                   attnlib.softmax(x, axis, backend="numpy"), atol=1e-6)
        np.testing.assert_allclose(attnlib.logsumexp(x, axis, backend="numba"),
                                   attnlib.logsumexp(x, axis, backend="numpy"), atol=1e-5)
    q, k, v = _qkv(rng, 1, 9, 40, 2, 2, 8)
    parts = [attnlib.attention(q, k[:, a:b], v[:, a:b], return_lse=True, backend="numba")
             for a, b in ((0, 13), (13, 13), (13, 40))]
    out, lse = attnlib.merge_states([p[0] for p in parts], [p[1] for p in parts],
                                    backend="numba")
    ref, ref_lse = attnlib.attention(q, k, v, return_lse=True, backend="numpy")
    np.testing.assert_allclose(out, ref, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_cache_is_read_in_place_and_matches_reference(ring, dtype):
    """16-bit caches are widened tile by tile as the kernel loads them: batch_idx subsets,
    partly filled buffers and a ring read across its wrap give the reference's result, and a
    decode step over a long cache allocates far less than one widened copy of its keys."""
    import tracemalloc

    import attnlib

    rng = np.random.default_rng(11)
    caches = {be: attnlib.KVCache(4, 64, 2, 16, dtype=dtype, ring=ring, backend=be)
              for be in ("numba", "numpy")}
    npdt = caches["numpy"].dtype
    steps = [(30, [2, 0]), (20, [2, 0]), (25 if ring else 10, [0, 2]), (1, [2, 0])]
    for n, rows in steps:
        k, v = (rng.standard_normal((2, n, 2, 16)).astype(npdt) for _ in range(2))
        q = rng.standard_normal((2, 1, 4, 16)).astype(npdt)
        got, want = (attnlib.attention_with_kvcache(q, c, k, v, batch_idx=np.array(rows))
                     for c in caches.values())
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=2e-3)
    # memory: 2 x 4096 x 2 x 64 keys are 2 MiB in 16 bits, 4 MiB widened (8 MiB with the values)
    big = attnlib.KVCache(2, 4096, 2, 64, dtype=dtype, ring=ring, backend="numba")
    kv = rng.standard_normal((2, 4096, 2, 64)).astype(npdt)
    big.update(kv, kv, 0)
    q = rng.standard_normal((2, 1, 4, 64)).astype(npdt)
    attnlib.attention_with_kvcache(q, big)  # plans, scratch
    tracemalloc.start()
    try:
        attnlib.attention_with_kvcache(q, big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < kv.nbytes, peak  # the split-key partial states: up to 1 MiB


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2", "float16",
                                 "bfloat16"])
def test_tile_load_decodes_every_code_exactly(fmt):
    """``_load_stored`` gives every stored code's value exactly (NaN codes NaN, subnormals and
    infinities kept): all 256 bytes of an 8-bit format times a row scale against
    :func:`attnlib._quant.decode_table`, all 65536 bit patterns of a 16-bit float against
    numpy's own conversion."""
    import ml_dtypes

    from attnlib import _quant
    from attnlib.backends.numba_backend import _flash

    q = _quant.FORMATS.get(fmt)
    width = 64
    if q is not None:
        codes = np.arange(256, dtype=np.uint8)
        scale = np.float32(0.7)
        want = _quant.decode_table(q) * scale
        code, sc = q.code, np.full(256 // width, scale, np.float32)
        raw = codes
    else:
        dtype = np.float16 if fmt == "float16" else ml_dtypes.bfloat16
        bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        want = bits.view(dtype).astype(np.float32)
        code = _flash.F16 if fmt == "float16" else _flash.BF16
        sc = np.zeros(0, np.float32)
        raw = bits.view(np.uint8)
    rows = want.size // width
    st = np.array([0, width, 0, width], np.int64)  # one batch, one head, contiguous rows
    sst = np.array([0, 1, 0], np.int64)
    got = np.empty(want.size, np.float32)
    _flash._load_stored(raw, st, sc, sst, code, np.zeros((0, 0), np.int64), 0, 0, 0, rows, 0,
                        0, 0, 0, got, width)
    np.testing.assert_array_equal(got, want)


class _MklWithoutJitCode:
    """MKL as on a CPU it generates no JIT code for (AMD): ``mkl_cblas_jit_create_sgemm``
    makes its jitter but answers ``MKL_NO_JIT``; every other function is MKL's own."""

    MKL_NO_JIT = 1

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    @property
    def mkl_cblas_jit_create_sgemm(self):
        real = self._lib.mkl_cblas_jit_create_sgemm

        def create(*args):
            real.restype, real.argtypes = create.restype, create.argtypes
            real(*args)
            return self.MKL_NO_JIT

        create.restype = create.argtypes = None
        return create


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("jit", ["as_installed", "mkl_no_jit"])
def test_full_tiles_with_and_without_mkl_jit(d, causal, jit, monkeypatch):
    """Full 256 x 256 tiles give the reference's result whichever gemm the kernel gets: MKL's
    JIT kernels where MKL makes them, plain gemm where it does not (MKL on AMD answers
    ``MKL_NO_JIT``; OpenBLAS has no JIT). Edge tiles (rows, keys not a multiple of the block) go
    through plain gemm either way. Both paths agree to float32 rounding."""
    from attnlib.backends.numba_backend import _blas

    rng = np.random.default_rng(d + causal)
    q, k, v = _qkv(rng, 1, nb.BLOCK_M + 40, 3 * nb.BLOCK_N + 17, 4, 2, d)
    shape = (np.dtype(np.float32), nb.BLOCK_M, nb.BLOCK_N, d, d, 2 * d, 2 * d)
    monkeypatch.setattr(_blas, "_jitters", {})
    monkeypatch.setattr(nb, "_plans", {})  # the plan memo holds the JIT kernels
    if jit == "mkl_no_jit":
        if _blas.load_mkl() is not None:
            monkeypatch.setattr(_blas, "_mkl", _MklWithoutJitCode(_blas._mkl))
        assert not nb._jit_kernels(*shape).any()
    out, _ = _check(q, k, v, causal=causal)
    monkeypatch.setattr(nb, "_jit_kernels", lambda *a: np.zeros(4, np.int64))
    monkeypatch.setattr(nb, "_plans", {})
    plain, _ = _check(q, k, v, causal=causal)
    np.testing.assert_allclose(plain, out, atol=2e-6, rtol=0)


def test_blas_choice_in_fresh_processes(tmp_path):
    """``ATTNLIB_NUMBA_BLAS`` picks the library; either gives the reference's result, and the
    compiled kernel loads from numba's on-disk cache in a second process (the gemm addresses
    are run-time arguments, not constants in the cached code)."""
    import os
    import subprocess
    import sys

    snippet = (
        "import numpy as np, attnlib\n"
        "from attnlib.backends.numba_backend import _blas, _flash\n"
        "q = np.random.default_rng(0).standard_normal((1, 300, 4, 64), dtype=np.float32)\n"
        "o = attnlib.attention(q, q, q, causal=True, backend='numba')\n"
        "r = attnlib.attention(q, q, q, causal=True, backend='numpy')\n"
        "assert np.abs(o - r).max() < 2e-5\n"
        "print(_blas.describe().split()[0], len(_flash.flash_forward.stats.cache_hits))\n"
    )
    choices = ["openblas"]
    try:
        from attnlib.backends.numba_backend import _blas

        if _blas.load_mkl() is not None:
            choices.append("mkl")
    except Exception:
        pass
    for choice in choices:
        env = dict(os.environ, ATTNLIB_NUMBA_BLAS=choice, NUMBA_CACHE_DIR=str(tmp_path))
        for _ in range(2):
            res = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
        assert res == [choice, "1"], res  # the second process hit the cache


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,d,dv", [(6, 2, 64, 64), (3, 3, 40, 24)])
def test_bhsd_memory_read_in_place(causal, hq, hkv, d, dv):
    """layout="bhsd" hands the kernel (B, S, H, D) views of head-major memory, which it reads in
    place (``_flat``: no copy); the results match the reference and the bshd call's, also over
    full 256 x 256 tiles (MKL JIT kernels made for the head-major row stride)."""
    rng = np.random.default_rng(hq * 10 + d + causal)
    q, k, v = _qkv(rng, 2, nb.BLOCK_M + 37, 2 * nb.BLOCK_N + 11, hq, hkv, d, dv)
    qh, kh, vh = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    x, flat, st = nb._flat(kh.transpose(0, 2, 1, 3), np.dtype(np.float32))
    assert np.shares_memory(flat, kh) and st[1] == d and st[2] == kh.shape[2] * d
    out, lse = attnlib.attention(qh, kh, vh, causal=causal, layout="bhsd", return_lse=True,
                                 backend="numba")
    ref, ref_lse = attnlib.attention(q, k, v, causal=causal, return_lse=True, backend="numpy")
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=0)
    bshd, _ = _check(q, k, v, causal=causal)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), bshd, atol=2e-6, rtol=0)


def test_torch_imported_after_the_backend_keeps_its_threads():
    """The backend's MKL (sequential layer, loaded into the global symbol scope) must not make
    a PyTorch imported later single-threaded: it is imported before MKL loads (_blas)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI installs it)")
    alone = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=300)
    after = subprocess.run([sys.executable, "-c", (
        "import numpy as np, attnlib\n"
        "from attnlib.backends.numba_backend import _blas\n"
        "q = np.random.default_rng(0).standard_normal((1, 64, 2, 64)).astype(np.float32)\n"
        "attnlib.attention(q, q, q, backend='numba')\n"
        "import torch\n"
        "print(torch.get_num_threads(), _blas._mkl is not None)\n")],
        capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and after.returncode == 0, after.stderr[-2000:]
    threads, mkl_loaded = after.stdout.split()
    assert threads == alone.stdout.strip(), (alone.stdout, after.stdout)
    if mkl_loaded != "True":
        pytest.skip("MKL did not load here: the case the test is about did not arise")


_CACHE_SNIPPET = (
    "import numpy as np, attnlib\n"
    "from attnlib.backends.numba_backend import _ops\n"
    "x = np.random.default_rng(0).standard_normal((37, 300)).astype(np.float32)\n"
    "got = attnlib.softmax(x, backend='numba')\n"
    "assert attnlib.__file__.startswith({pkg!r}), attnlib.__file__\n"
    "assert np.abs(got - attnlib.softmax(x, backend='numpy')).max() < 1e-6\n"
    "print(len(_ops._softmax_rows_f32.stats.cache_hits))\n"
)


def _read_only_install(tmp_path):
    """A copy of the package in which nothing can be written next to the sources, even by root
    (``__pycache__`` of the numba backend is a file): numba's own default place is unusable."""
    import shutil

    import attnlib

    site = tmp_path / "site"
    pkg = site / "attnlib"
    shutil.copytree(os.path.dirname(attnlib.__file__), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "backends" / "numba_backend" / "__pycache__").write_text("not a directory")
    return site


def _run_cached(site, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", **env_vars)
    proc = subprocess.run([sys.executable, "-c", _CACHE_SNIPPET.format(pkg=str(site))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


def _cache_files(root):
    return [p for p in root.rglob("*") if p.suffix in (".nbi", ".nbc")]


def test_numba_cache_of_a_read_only_install(tmp_path):
    """A read-only install caches in the user cache directory ($XDG_CACHE_HOME/attnlib/numba):
    the second process loads what the first compiled; NUMBA_CACHE_DIR, when set, is where the
    cache goes instead; with nowhere to write, the backend still runs (compiling each time)."""
    site = _read_only_install(tmp_path)
    xdg = tmp_path / "xdg"
    assert _run_cached(site, XDG_CACHE_HOME=str(xdg)) == 0
    assert _run_cached(site, XDG_CACHE_HOME=str(xdg)) == 1
    assert _cache_files(xdg / "attnlib" / "numba") and not _cache_files(site)
    own = tmp_path / "numba-cache"
    assert _run_cached(site, XDG_CACHE_HOME=str(xdg), NUMBA_CACHE_DIR=str(own)) == 0
    assert _cache_files(own)
    nowhere = tmp_path / "a-file"
    nowhere.write_text("")
    assert _run_cached(site, XDG_CACHE_HOME=str(nowhere), HOME=str(nowhere)) == 0
    assert not _cache_files(site)
