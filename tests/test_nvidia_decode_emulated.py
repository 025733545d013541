"""The NVIDIA tensor-core decode kernel (kernels/attn_decode_mma.cl) on any OpenCL device, with
every warp-level PTX instruction emulated in plain OpenCL C (``USE_PTX=0``, kernels/nv_warp.h):
its fragment layouts, split-KV walk, cp.async pipeline, masking, online softmax, warp merge and
the merge.cl hand-off are checked against the float64 oracle by the contract's accuracy rule."""

from __future__ import annotations

import numpy as np
import pytest

import attnlib
from attnlib.backends.base import AttnCall
from attnlib.testing._helpers import paged_twin, randn, rng_for
from attnlib.testing.reference import reference_call, seq_call
from attnlib.testing.tolerance import assert_rule

pytest.importorskip("pyopencl")
if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI always has PoCL
    pytest.skip("no OpenCL device", allow_module_level=True)


def run_and_check(call: AttnCall, *, splits, config=None, fused=False):
    from attnlib.backends.opencl import _nvidia_decode

    be = attnlib.get_backend("opencl")
    out, lse = _nvidia_decode.run(be, be.queue, call, config=config, splits=splits,
                                  use_ptx=False, fused=fused)
    ref, ref_lse = reference_call(call)
    naive, _ = reference_call(call, call.dtype)
    assert out.dtype == call.dtype and lse.dtype == np.float32
    assert_rule(out, ref, naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-2)
    return out


def decode_call(rng, dtype, *, b, q_len, klens, hq, hkv, d, causal=True, **kw):
    """A KV-cache step: sequence s (batch s) has klens[s] cached keys, its q_len new queries at
    the end (positions klens[s] - q_len ...)."""
    cap = max(klens) + 5
    q = randn(rng, (b, q_len, hq, d), dtype)
    k = randn(rng, (b, cap, hkv, d), dtype)
    v = randn(rng, (b, cap, hkv, d), dtype)
    ar = np.arange(b)
    kl = np.asarray(klens)
    return seq_call(q, k, v, q_batch=ar, q_row0=0 * ar, q_len=ar * 0 + q_len, k_batch=ar,
                     k_row0=0 * ar, k_len=kl, q_pos0=kl - q_len, k_pos0=0 * ar, causal=causal,
                     **kw)


CASES = [
    # name, dtype, dict(b, q_len, klens, hq, hkv, d), splits, call options
    ("gqa4 d128 splits with empty ones", "float16",
     dict(b=1, q_len=1, klens=[333], hq=8, hkv=2, d=128), 5, {}),
    ("gqa8 d64 one split bf16", "bfloat16",
     dict(b=1, q_len=1, klens=[200], hq=16, hkv=2, d=64), 1, {}),
    ("mha q_len 3 causal varlen", "float16",
     dict(b=2, q_len=3, klens=[150, 71], hq=3, hkv=3, d=64), 3, {}),
    ("gqa4 q_len 3 causal bf16", "bfloat16",
     dict(b=1, q_len=3, klens=[190], hq=8, hkv=2, d=128), 2, {}),
    ("window softcap alibi q_len 2", "float16",
     dict(b=2, q_len=2, klens=[260, 97], hq=8, hkv=2, d=128), 4,
     {"window": (70, 0), "softcap": 20.0, "alibi": True}),
    ("q_len 3 over 2 keys: a row sees nothing", "float16",
     dict(b=1, q_len=3, klens=[2], hq=8, hkv=2, d=64), 2, {}),
    ("alibi not causal bf16 d64", "bfloat16",
     dict(b=1, q_len=1, klens=[129], hq=4, hkv=1, d=64), 2, {"causal": False, "alibi": True}),
]


@pytest.mark.parametrize("name,dtype,shape,splits,opts", CASES, ids=[c[0] for c in CASES])
def test_decode_emulated(name, dtype, shape, splits, opts):
    rng = rng_for("decode", name)
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi"] = np.linspace(0.05, 0.4, shape["hq"] * shape["b"]).reshape(shape["b"], -1)
    run_and_check(decode_call(rng, dtype, **shape, **kw), splits=splits)


FUSED = ["gqa4 d128 splits with empty ones", "mha q_len 3 causal varlen",
         "window softcap alibi q_len 2", "q_len 3 over 2 keys: a row sees nothing"]


@pytest.mark.parametrize("name", FUSED)
def test_decode_fused_merge(name):
    """FUSED_MERGE: the last work-group of each (sequence, kv head) merges the splits (empty
    splits, rows that see nothing, several sequences); twice, as the counters must be reset."""
    _, dtype, shape, splits, opts = next(c for c in CASES if c[0] == name)
    rng = rng_for("decode fused", name)
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi"] = np.linspace(0.05, 0.4, shape["hq"] * shape["b"]).reshape(shape["b"], -1)
    call = decode_call(rng, dtype, **shape, **kw)
    first = run_and_check(call, splits=splits, fused=True)
    again = run_and_check(call, splits=splits, fused=True)
    np.testing.assert_array_equal(first, again)


#: cases with attention sinks (shapes and options of CASES: the same builds): every way the
#: decode kernel ends a row, each folding the sinks once: its own epilogue (one split),
#: merge.cl and the fused merge (split partial states hold none)
SINK_CASES = [("gqa8 d64 one split bf16", None, False),
              ("window softcap alibi q_len 2", None, False),
              ("q_len 3 over 2 keys: a row sees nothing", None, False),
              ("gqa4 d128 splits with empty ones", None, True),
              ("q_len 3 over 2 keys: a row sees nothing", None, True)]


@pytest.mark.parametrize("name,splits,fused", SINK_CASES)
def test_decode_sinks(name, splits, fused):
    from dataclasses import replace

    _, dtype, shape, case_splits, opts = next(c for c in CASES if c[0] == name)
    rng = rng_for("decode sinks", name, splits, fused)
    kw = dict(opts)
    if kw.pop("alibi", False):
        kw["alibi"] = np.linspace(0.05, 0.4, shape["hq"] * shape["b"]).reshape(shape["b"], -1)
    sinks = (rng.standard_normal(shape["hq"]) * np.resize([2.0, 25.0], shape["hq"]))
    call = decode_call(rng, dtype, **shape, **kw)
    call = replace(call, options=replace(call.options, sinks=sinks.astype(np.float32)))
    run_and_check(call, splits=case_splits if splits is None else splits, fused=fused)


def test_decode_fused_merge_many_splits():
    """19 splits (the fused merge's 16-load batches, then the rest), the last 5 empty."""
    rng = rng_for("decode fused many")
    call = decode_call(rng, "float16", b=2, q_len=1, klens=[1333, 700], hq=8, hkv=2, d=64)
    run_and_check(call, splits=19, config=(32, 2, 2), fused=True)


def test_decode_hidden_nan():
    """inf/NaN in v of keys hidden by causal (q_len 3: the last key is seen only by the last
    row) or by the window must not reach the rows that do not see them."""
    rng = rng_for("decode nan")
    call = decode_call(rng, "float16", b=1, q_len=3, klens=[140], hq=8, hkv=2, d=64,
                       window=(100, None))
    call.v[0, 139, 1, 5] = np.nan     # seen by row 2 only (heads 4..7)
    call.v[0, 138, 0, 7] = np.inf     # seen by rows 1, 2 (heads 0..3)
    call.v[0, 3, 0, 2] = np.nan       # outside every row's window
    call.k[0, 10, 1, 0] = np.nan      # outside the window too
    out = run_and_check(call, splits=3)
    assert np.isnan(out[0, 2, 4:, 5]).all() and not np.isnan(out[0, :2]).any()
    assert np.isinf(out[0, 1:, :4, 7]).all() and np.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("fused", [False, True])
def test_decode_nan_in_a_split_of_small_weight(fused):
    """NaN in v of a key every row sees, in a split whose weight underflows against a later
    split's much larger scores: the merge keeps NaN (0 * NaN), as the float64 reference does;
    only empty split states are left out."""
    rng = rng_for("decode nan small weight")
    call = decode_call(rng, "float16", b=1, q_len=1, klens=[300], hq=8, hkv=2, d=64, scale=1.0)
    call.q[:] = np.round(call.q.astype(np.float64) * 4) / 4
    call.k[0, 200:300] *= 16
    call.v[0, 5, 0, 3] = np.nan
    out = run_and_check(call, splits=3, fused=fused)
    assert np.isnan(out[0, 0, :4, 3]).all()


def test_decode_ring_varlen():
    """Ring-buffer cache rows that wrap, several sequences of different lengths in one batch
    slot each, one of them with an empty cache (out 0, lse -inf)."""
    rng = rng_for("decode ring")
    ring, hq, hkv, d = 96, 8, 2, 64
    q = randn(rng, (4, 1, hq, d), "float16")
    k = randn(rng, (4, ring, hkv, d), "float16")
    v = randn(rng, (4, ring, hkv, d), "float16")
    klens = np.array([96, 40, 0, 77])
    call = seq_call(q, k, v, q_batch=np.arange(4), q_row0=[0] * 4, q_len=[1] * 4,
                     k_batch=[3, 1, 0, 2], k_row0=[50, 90, 0, 30], k_len=klens,
                     q_pos0=klens + 200 - 1, k_pos0=[200] * 4, causal=True, ring=ring)
    out = run_and_check(call, splits=3)
    assert (out[2] == 0).all()


CONFIGS = [(32, 2, 2), (64, 2, 3), (128, 4, 2)]


@pytest.mark.parametrize("config", CONFIGS, ids=[",".join(map(str, c)) for c in CONFIGS])
def test_decode_configs(config):
    """Other (BLOCK_N, WARPS, STAGES): 16 and 32 keys per warp, two to three buffers; scale 1
    and growing keys make the running max grow past the lazy-rescale threshold."""
    rng = rng_for("decode cfg", *config)
    call = decode_call(rng, "bfloat16", b=1, q_len=1, klens=[301], hq=4, hkv=1, d=128,
                       scale=1.0)
    call.k[0, :301] *= np.linspace(0.2, 2.5, 301)[:, None, None].astype(call.k.dtype)
    run_and_check(call, splits=2, config=config)


@pytest.mark.parametrize("d,dtype", [(32, "float16"), (96, "bfloat16"), (256, "float16")])
def test_decode_extra_head_dims(d, dtype):
    """Head dims built with their default configs but not yet dispatched (EXTRA_HEAD_DIMS):
    D=96 runs 3 warps (12 16-byte chunks per row), D=256 two buffers."""
    from attnlib.backends.opencl import _nvidia_decode

    assert d in _nvidia_decode.EXTRA_HEAD_DIMS
    rng = rng_for("decode extra", d)
    call = decode_call(rng, dtype, b=2, q_len=2, klens=[211, 60], hq=8, hkv=2, d=d)
    run_and_check(call, splits=3)


def test_not_applicable_here():
    """The dispatch needs NVIDIA sm_80+; on other devices the portable kernels run."""
    from attnlib.backends.opencl import _nvidia_decode

    be = attnlib.get_backend("opencl")
    rng = rng_for("decode dispatch")
    call = decode_call(rng, "float16", b=1, q_len=1, klens=[10], hq=4, hkv=1, d=64)
    cc = _nvidia_decode._nvidia_mma.compute_capability(be.device)
    assert (_nvidia_decode.reason(be.device, call) is None) is (cc is not None and cc[0] >= 8)


def test_choose_splits():
    """132 SMs (an H200), two D=128 work-groups each: whole waves of work-groups, fewest splits on
    ties, at least two tiles per split; long batches take one split."""
    from attnlib.backends.opencl import _nvidia_decode as nd

    cfg = (64, 4, 3)  # 109 KB: two work-groups per SM
    assert nd.SM_LOCAL_BYTES // nd.local_bytes(128, cfg) == 2
    assert nd.choose_splits(132, 8, 131072 // 64, 128, cfg) == 33   # 264 groups of 63 tiles
    assert nd.choose_splits(132, 8, 8192 // 64, 128, cfg) == 32     # 256 groups of 4 tiles
    assert nd.choose_splits(132, 64, 8192 // 64, 128, cfg) == 4     # 256 groups, not 5 (320)
    assert nd.choose_splits(132, 8, 16, 128, cfg) == 8              # 2 tiles per split
    assert nd.choose_splits(132, 512, 4096 // 64, 128, cfg) == 1
    assert nd.choose_splits(132, 8, 3, 128, cfg) == 1
    # the default (128-key tiles, 144 KB: one work-group per SM)
    cfg = nd.DEFAULT_CONFIGS[128]
    assert nd.SM_LOCAL_BYTES // nd.local_bytes(128, cfg) == 1
    assert nd.choose_splits(132, 8, 131072 // 128, 128, cfg) == 16
    assert nd.choose_splits(132, 8, 8192 // 128, 128, cfg) == 16
    assert nd.choose_splits(132, 64, 8192 // 128, 128, cfg) == 2


_OCLGRIND_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_nvidia_decode_emulated import decode_call, run_and_check
from attnlib.testing._helpers import rng_for
call = decode_call(rng_for("ocg"), "float16", b=1, q_len=2, klens=[45], hq=4, hkv=1, d=32,
                   window=(30, None))
call.v[0, 44, 0, 3] = np.nan
run_and_check(call, splits=2, config=(32, 2, 2))
call = decode_call(rng_for("ocg2"), "bfloat16", b=2, q_len=1, klens=[40, 9], hq=2, hkv=1, d=32)
run_and_check(call, splits=1, config=(32, 2, 3))
print("decode cases ran")
"""


def test_decode_oclgrind():
    """The emulated kernel and its merge under Oclgrind (data races, uninitialised reads, out of
    bounds), small: the split path with the hidden-inf/NaN scan, and the direct-write path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here / "oclgrind"))
    try:
        import run_oclgrind
    finally:
        sys.path.pop(0)
    import pyopencl as cl

    if not any("oclgrind" in p.name.lower() for p in cl.get_platforms()):
        pytest.skip("Oclgrind's OpenCL platform is not installed")
    env = run_oclgrind.oclgrind_env()
    proc = subprocess.run([sys.executable, "-c", _OCLGRIND_SCRIPT.format(tests=str(here))],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decode cases ran" in proc.stdout
    reports = [b for b in run_oclgrind.report_blocks(proc.stderr)
               if not run_oclgrind.is_harmless(b)]
    assert not reports, "\n\n".join(reports[:3])


def run_paged_and_check(call: AttnCall, page_size: int, *, splits, config=None, fused=False,
                        rng=None, table_dtype=np.int32):
    """The decode kernel on the paged twin of ``call`` against the float64 reference of the
    contiguous ``call``."""
    from attnlib.backends.opencl import _nvidia_decode

    be = attnlib.get_backend("opencl")
    paged = paged_twin(rng, call, page_size, table_dtype=table_dtype)
    out, lse = _nvidia_decode.run(be, be.queue, paged, config=config, splits=splits,
                                  use_ptx=False, fused=fused)
    ref, ref_lse = reference_call(call)
    naive, _ = reference_call(call, call.dtype)
    assert_rule(out, ref, naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-2)
    return out


PAGED = [
    # page size, dtype, dict(b, q_len, klens, hq, hkv, d), splits, config, fused, call options
    (16, "float16", dict(b=3, q_len=1, klens=[333, 47, 190], hq=8, hkv=2, d=128), 3,
     (32, 2, 2), True, {}),
    (1, "bfloat16", dict(b=2, q_len=2, klens=[77, 130], hq=8, hkv=2, d=64), 2,
     (32, 2, 3), False, {}),
    # the dispatch's build for page 8, D=64, one split (test_paged_dispatch_emulated)
    (8, "float16", dict(b=2, q_len=1, klens=[141, 9], hq=4, hkv=1, d=64), 1,
     None, False, {"window": (50, None)}),
    (32, "bfloat16", dict(b=1, q_len=3, klens=[257], hq=6, hkv=2, d=128), 4,
     (32, 2, 2), True, {"softcap": 15.0}),
    (5, "float16", dict(b=2, q_len=1, klens=[99, 201], hq=4, hkv=2, d=64), 2,
     (32, 2, 3), False, {}),
    (64, "float16", dict(b=2, q_len=1, klens=[100, 301], hq=8, hkv=1, d=64), 3,
     (32, 2, 2), False, {}),
]


@pytest.mark.parametrize("page,dtype,shape,splits,config,fused,opts", PAGED,
                         ids=[f"page{c[0]}-{c[1]}-d{c[2]['d']}" for c in PAGED])
def test_decode_paged(page, dtype, shape, splits, config, fused, opts):
    """Paged K/V pools (PAGE_SIZE): pages scattered by a shuffled free list, page sizes below,
    equal to and above a tile's keys (and one that divides nothing), unused pages of NaN and
    garbage table columns past each sequence's pages, against the float64 reference of the
    contiguous cache."""
    rng = rng_for("decode paged", page, dtype)
    call = decode_call(rng, dtype, **shape, **opts)
    run_paged_and_check(call, page, splits=splits, config=config, fused=fused, rng=rng)


@pytest.mark.parametrize("i", [0, 2, 4], ids=["fused", "one split", "merge.cl"])
def test_decode_paged_sinks(i):
    """Attention sinks over paged pools (the builds of PAGED's cases)."""
    from dataclasses import replace

    page, dtype, shape, splits, config, fused, opts = PAGED[i]
    rng = rng_for("decode paged sinks", i)
    sinks = (rng.standard_normal(shape["hq"]) * np.resize([2.0, 25.0], shape["hq"]))
    call = decode_call(rng, dtype, **shape, **opts)
    call = replace(call, options=replace(call.options, sinks=sinks.astype(np.float32)))
    run_paged_and_check(call, page, splits=splits, config=config, fused=fused, rng=rng)


def test_decode_paged_row_offsets_and_hidden_nan():
    """Sequences starting mid-page (k_row0 > 0, keys from slot 3 and 5 of their pages), inf/NaN
    in v of keys outside the window (the kernel's hidden-v path reads the table directly), an
    int64 table, and a sequence with no key (out 0, lse -inf)."""
    import dataclasses

    rng = rng_for("decode paged offsets")
    call = decode_call(rng, "float16", b=3, q_len=2, klens=[150, 60, 0], hq=8, hkv=2, d=64,
                       window=(40, None))
    call = dataclasses.replace(call, k_row0=np.array([3, 13, 0]))
    call.v[0, 3 + 5, 1, 2] = np.nan  # key 5 of sequence 0: outside every row's window
    call.k[1, 13 + 2, 0, 0] = np.inf
    # the build of the page-8 case of test_decode_paged
    out = run_paged_and_check(call, 8, splits=1, rng=rng,
                              table_dtype=np.int64)
    assert (out[2] == 0).all() and np.isfinite(out[:2]).all()


@pytest.fixture
def emulated_sm90(emulated_nvidia, kernel_launches):
    """The dispatch sees an sm_90 device, the tensor-core kernels built emulated (USE_PTX=0);
    the names of the kernels launched (the fixture's list)."""
    return kernel_launches


def test_paged_mixed_batch_emulated(emulated_sm90):
    """A paged call of a prefill chunk (36 packed rows: the tensor-core prefill kernel's
    PAGE_SIZE build) beside decode steps (4 and 8 rows): with host arrays the decode sequences
    run the tensor-core decode kernel, the chunk the prefill kernel; with device arrays the
    whole call runs the prefill kernel. Every sequence's rows checked against plain attention
    over its tokens. (Grid: the paged prefill build it adds.)"""
    from attnlib.testing.test_paged import Paged

    be = attnlib.get_backend("opencl", num_splits=1)
    p = Paged(be, 40, 8, hq=8, hkv=2, d=64, dv=64, dtype="float16", seed="paged mixed")
    a, b = p.new(2)
    p.append([a, b], [30, 13])
    c = p.fork(a)
    p.attend([a, b, c], [9, 1, 2], [9, 1, 2])
    assert emulated_sm90.count("attn_decode_mma") == 1
    assert emulated_sm90.count("attn_fwd_mma") == 1
    cu = np.array([0, 9, 10, 12], np.int32)
    q = randn(p.rng, (12, 8, 64), "float16")
    out = attnlib.attention_with_paged_kvcache(attnlib.to_device(q, backend=be), p.cache,
                                               [a, b, c], cu_seqlens_q=cu)
    out = attnlib.to_numpy(out)
    assert emulated_sm90.count("attn_decode_mma") == 1
    assert emulated_sm90.count("attn_fwd_mma") == 2
    for i, s in enumerate([a, b, c]):
        p.check_rows(s, q[cu[i]:cu[i + 1]], out[cu[i]:cu[i + 1]], None)


def test_paged_dispatch_emulated(emulated_sm90):
    """Through the front door: on an (emulated) sm_90 device, paged decode steps of a
    PagedKVCache (scattered pages, packed appends, a fork, a truncate, two query rows; host
    queries, then device queries through the repeat-call plans with a new block table per call)
    run the tensor-core decode kernel, checked against plain attention over each sequence's
    tokens."""
    from attnlib.testing.test_paged import Paged

    launches = emulated_sm90
    be = attnlib.get_backend("opencl", num_splits=1)
    p = Paged(be, 40, 8, hq=8, hkv=2, d=64, dv=64, dtype="float16", seed="paged dispatch")
    a, b = p.new(2)
    p.append([a, b], [37, 13])
    c = p.fork(a)
    p.attend([a, b, c], [1, 1, 1], [1, 1, 1])
    assert launches.count("attn_decode_mma") == 1, "the tensor-core decode kernel did not run"
    p.truncate(c, 20)
    p.attend([c, a], [2, 1], [2, 1])
    p.attend([b, c], [1, 1], packed=False)
    assert launches.count("attn_decode_mma") == 3
    # device queries: the repeat-call plans, the block table set per call
    for sids in ([a, c], [c, a], [b, a], [b, a]):
        q = randn(p.rng, (2, 1, 8, 64), "float16")
        out = attnlib.attention_with_paged_kvcache(attnlib.to_device(q, backend=be),
                                                   p.cache, sids)
        out = attnlib.to_numpy(out)
        for i, s in enumerate(sids):
            p.check_rows(s, q[i], out[i], None)
    assert launches.count("attn_decode_mma") == 7


def test_cascade_emulated(emulated_sm90, monkeypatch):
    """Shared prompts on the (emulated) tensor-core decode kernel through the front door: 7 forks
    of a 23-token prompt (4 full pages of 5) with tokens of their own and an unrelated sequence,
    float16, sinks, the prefix in chunks of 2 pages (``PARTS_KEYS``) and its 7 x 4 packed rows in
    runs of 4 (one m16 tile): one decode launch writes every float32 partial state and merge.cl
    merges them, for a device query, each sequence's rows checked against the float64
    reference. (Emulation: the device is patched to sm_90; the test also holds on a card.
    The kernel build is test_decode_paged_sinks' "merge.cl" case's, as is its tiling.)"""
    from attnlib.backends.opencl import _nvidia_decode
    from attnlib.testing.test_paged import Paged
    from attnlib.testing.test_paged_cascade import _groups, _spying

    monkeypatch.setattr(_nvidia_decode, "PARTS_KEYS", 10)
    monkeypatch.setitem(_nvidia_decode.DEFAULT_CONFIGS, 64, PAGED[4][4])
    be = attnlib.get_backend("opencl", num_splits=2)
    p = Paged(be, 40, 5, hq=8, hkv=2, d=64, dv=64, dtype="float16", seed="cascade emulated")
    root, u = p.new(2)
    p.append([root, u], [23, 11])
    forks = [root] + [p.fork(root) for _ in range(6)]
    p.append(forks[1:], [1, 4, 2, 7, 3, 1])
    sids = forks[:3] + [u] + forks[3:]
    sinks = (p.rng.standard_normal(8) * 2).astype(np.float32)
    q = randn(p.rng, (len(sids), 1, 8, 64), "float16")
    with _spying() as spy:
        out = attnlib.attention_with_paged_kvcache(attnlib.to_device(q, backend=be), p.cache,
                                                   sids, sinks=sinks)
        assert _groups(sids, spy.seen[-1]) == {frozenset(forks): 4}
    assert emulated_sm90.count("attn_decode_mma") == 1, "the decode kernel did not run"
    assert emulated_sm90.count("merge_states") == 1
    out = attnlib.to_numpy(out)
    for i, s in enumerate(sids):
        p.check_rows(s, q[i], out[i], None, sinks=sinks)


# ---- quantized K/V (the KV_FORMAT load variant): 8-bit codes and per-(row, kv head) scales -----

QUANT = [
    # name, kv format, compute dtype, shape, splits, call options
    ("e4m3 gqa4 d128 odd length sinks", "float8_e4m3fn", "float16",
     dict(b=2, q_len=1, klens=[333, 70], hq=8, hkv=2, d=128), 3, {"sinks": True}),
    ("e5m2 q_len 2 bf16 window", "float8_e5m2", "bfloat16",
     dict(b=1, q_len=2, klens=[201], hq=8, hkv=2, d=64), 2, {"window": (90, 0)}),
    ("int8 mha q_len 3 one split", "int8", "float16",
     dict(b=1, q_len=3, klens=[150], hq=4, hkv=4, d=64), 1, {}),
]


def quantized(call: AttnCall, fmt_name: str) -> tuple[AttnCall, AttnCall]:
    """``call`` with k and v stored in the 8-bit format (codes and scales), and the same call over
    the dequantized values in float64 (the reference's input)."""
    from dataclasses import replace

    from attnlib import _quant

    fmt = _quant.FORMATS[fmt_name]
    (kc, ks), (vc, vs) = (_quant.quantize(np.asarray(x, np.float32), fmt)
                          for x in (call.k, call.v))
    deq = replace(call, k=_quant.dequantize(kc, ks), v=_quant.dequantize(vc, vs))
    return replace(call, k=kc, v=vc, k_scales=ks, v_scales=vs), deq


@pytest.mark.parametrize("name,fmt,dtype,shape,splits,opts", QUANT, ids=[c[0] for c in QUANT])
def test_decode_quantized(name, fmt, dtype, shape, splits, opts):
    """8-bit K/V decoded and scaled as the kernel stages them, against the float64 reference on
    the dequantized cache (exact emulation)."""
    from dataclasses import replace

    from attnlib.backends.opencl import _nvidia_decode

    rng = rng_for("decode quant", name)
    opts = dict(opts)
    sinks = opts.pop("sinks", False)
    call = decode_call(rng, dtype, **shape, **opts)
    if sinks:
        sink_logits = rng.standard_normal(shape["hq"]).astype(np.float32)
        call = replace(call, options=replace(call.options, sinks=sink_logits))
    qcall, deq = quantized(call, fmt)
    be = attnlib.get_backend("opencl")
    out, lse = _nvidia_decode.run(be, be.queue, qcall, splits=splits, use_ptx=False)
    ref, ref_lse = reference_call(deq)
    naive, _ = reference_call(replace(deq, k=deq.k.astype(call.dtype), v=deq.v.astype(call.dtype)),
                              call.dtype)
    assert out.dtype == call.dtype
    assert_rule(out, ref, naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-2)


def test_quantized_paged_dispatch_emulated(emulated_sm90):
    """Through the front door on an (emulated) sm_90 device: decode steps over an int8
    PagedKVCache (odd lengths, GQA, sinks) run the tensor-core decode kernel's KV_FORMAT variant,
    checked against the float64 reference on ``cache.dequantized()``."""
    be = attnlib.get_backend("opencl", num_splits=2)
    rng = rng_for("decode quant paged dispatch")
    hq, hkv, d = 8, 2, 64
    cache = attnlib.PagedKVCache(12, 8, hkv, d, dtype="float16", kv_dtype="int8", backend=be)
    sids = [cache.new_sequence(), cache.new_sequence()]
    for s, n in zip(sids, (37, 13)):
        cache.append([s], randn(rng, (1, n, hkv, d), "float16"),
                     randn(rng, (1, n, hkv, d), "float16"))
    q = randn(rng, (2, 1, hq, d), "float16")
    sinks = rng.standard_normal(hq).astype(np.float32)
    out = attnlib.attention_with_paged_kvcache(q, cache, sids, sinks=sinks)
    assert emulated_sm90.count("attn_decode_mma") == 1, "the tensor-core decode kernel did not run"
    k, v = cache.dequantized(sids)
    ends = np.cumsum(cache.lengths(sids))
    for i, (lo, hi) in enumerate(zip(np.r_[0, ends[:-1]], ends)):
        args = (q[i:i + 1], k[None, lo:hi], v[None, lo:hi])
        ref = attnlib.attention(*(x.astype(np.float64) for x in args), sinks=sinks,
                                backend="numpy")
        naive = attnlib.attention(*(x.astype(np.float16) for x in args), sinks=sinks,
                                  backend="numpy")
        assert_rule(out[i:i + 1], ref, naive)
