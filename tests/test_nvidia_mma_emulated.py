"""The NVIDIA tensor-core kernel (kernels/attn_fwd_mma.cl) on any OpenCL device, with every
warp-level PTX instruction (mma.sync, ldmatrix, cp.async, cvt.rna.tf32) emulated in plain OpenCL C
(``USE_PTX=0``): the fragment layouts, tile walk, masking and online softmax it runs on a GPU
are checked here against the float64 oracle by the contract's accuracy rule, on PoCL in CI.
float32 takes the 3xTF32 build (``IS_TF32=1``), whose emulation rounds operands to tf32 as
``cvt.rna`` does and accumulates the exact products in float32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import attnlib
from attnlib import _spec
from attnlib.testing._helpers import kernel_call, qkv, rng_for
from attnlib.testing.reference import naive_attention, reference_attention
from attnlib.testing.tolerance import assert_rule

pytest.importorskip("pyopencl")
if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI always has PoCL
    pytest.skip("no OpenCL device", allow_module_level=True)

CASES = [
    # name, dtype, (b, sq, sk, hq, hkv, d), options
    ("gqa causal Sq<Sk", "float16", (1, 70, 131, 6, 2, 64), {"causal": True}),
    ("window softcap alibi", "bfloat16", (2, 45, 77, 2, 1, 128),
     {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("causal Sq>Sk empty rows", "float16", (1, 90, 37, 2, 2, 64), {"causal": True}),
    ("f32 gqa causal Sq<Sk", "float32", (1, 70, 131, 6, 2, 64), {"causal": True}),
    ("f32 window softcap alibi", "float32", (2, 45, 77, 2, 1, 128),
     {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("f32 causal Sq>Sk empty rows", "float32", (1, 90, 37, 2, 2, 128), {"causal": True}),
    # scores of tens (scale 1): S's float32 accumulation error shows in the output
    ("f32 scale 1 large logits", "float32", (1, 61, 150, 2, 1, 128), {"scale": 1.0}),
    ("f32 window only, odd", "float32", (1, 53, 99, 3, 3, 64), {"window": (7, 0)}),
]


@pytest.mark.parametrize("name,dtype,shape,opts", CASES, ids=[c[0] for c in CASES])
def test_mma_kernel_emulated(name, dtype, shape, opts):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = qkv(rng_for("mma", name), b, sq, sk, hq, hkv, d, dtype=dtype)
    if "gqa" in name:
        v[0, sk - 1, 0, 3] = np.nan  # hidden from the first rows by causal: must not leak
    call, slopes, kw = kernel_call(q, k, v, opts)
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=False)
    _check(q, k, v, slopes, kw, out, lse)


@pytest.mark.parametrize("name", ["causal Sq>Sk empty rows", "window softcap alibi",
                                  "f32 causal Sq>Sk empty rows"])
def test_mma_sinks_emulated(name):
    """Attention sinks (a run-time argument: the builds of CASES), rows that see no key too."""
    from dataclasses import replace

    from attnlib.backends.opencl import _nvidia_mma

    _, dtype, shape, opts = next(c for c in CASES if c[0] == name)
    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    rng = rng_for("mma sinks", name)
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dtype=dtype)
    call, slopes, kw = kernel_call(q, k, v, opts)
    kw["sinks"] = (rng.standard_normal(hq) * np.resize([2.0, 25.0], hq)).astype(np.float32)
    call = replace(call, options=replace(call.options, sinks=kw["sinks"]))
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=False)
    _check(q, k, v, slopes, kw, out, lse)


def _check(q, k, v, slopes, kw, out, lse):
    ref, ref_lse = reference_attention(q, k, v, alibi_slopes=slopes, **kw)
    naive, _ = naive_attention(q, k, v, alibi_slopes=slopes, **kw)
    assert out.dtype == q.dtype
    assert_rule(out, ref, naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    atol = 1e-4 if q.dtype == np.float32 else 1e-2
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=atol)


# (BLOCK_M, BLOCK_N, WARPS, Q_IN_REGS), -D options: every float32 Q placement (0: local, split
# every tile; 1: hi and lo in registers; 2: hi in registers, lo in local), one and two m-tiles
# per warp, 16-key tiles
F32_CONFIGS = [((64, 32, 4, 0), ()), ((32, 16, 1, 2), ()), ((64, 64, 2, 1), ()),
               ((128, 32, 4, 0), ()), ((128, 16, 4, 0), ())]


@pytest.mark.parametrize("config,extra", F32_CONFIGS,
                         ids=[",".join(map(str, c)) + "".join(e) for c, e in F32_CONFIGS])
def test_mma_f32_configs(config, extra):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    q, k, v = qkv(rng_for("mma f32", *config), 1, 77, 101, 4, 2, 64, dtype="float32")
    v[0, 100, 1, 5] = np.inf  # hidden from the first rows by causal, seen by the last
    kw = {"causal": True}
    call = _spec.dense_call(q, k, v, scale=None, mask=None, layout="bshd", need_lse=True,
                            alibi_slopes=None, causal=True, window=None, softcap=None)
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, config=config,
                               use_ptx=False, extra_options=extra)
    _check(q, k, v, None, kw, out, lse)


# causal scheduling options: WARP_SKIP (a warp skips key tiles its rows cannot see; emulated, the
# tile is computed and then discarded, so a skip of a visible key shows as an error) and
# heads_inner (grid order tile * n_heads + head), on shapes where warps skip on the diagonal
# (bottom-right causal, Sq < Sk), at a window's left edge, and past the last valid row
SCHED_CASES = [
    ("f32 causal skip+inner", "float32", (2, 77, 101, 4, 2, 64), (128, 32, 4, 0),
     ("-DWARP_SKIP=1",), True, {"causal": True}),
    ("f32 window skip", "float32", (1, 70, 90, 2, 1, 64), (64, 16, 2, 0),
     ("-DWARP_SKIP=1",), False, {"window": (9, 3)}),
    ("f32 causal Sq>Sk inner", "float32", (1, 90, 37, 3, 1, 64), (64, 32, 2, 0),
     ("-DWARP_SKIP=1",), True, {"causal": True}),
    ("f16 causal skip+inner", "float16", (1, 100, 131, 2, 2, 64), (64, 32, 4, 1),
     ("-DWARP_SKIP=1",), True, {"causal": True}),
]


@pytest.mark.parametrize("name,dtype,shape,config,extra,inner,opts", SCHED_CASES,
                         ids=[c[0] for c in SCHED_CASES])
def test_mma_sched_options(name, dtype, shape, config, extra, inner, opts):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = qkv(rng_for("mma sched", name), b, sq, sk, hq, hkv, d, dtype=dtype)
    v[0, sk - 1, 0, 3] = np.nan  # hidden from some rows (causal / window): must not leak
    call = _spec.dense_call(q, k, v, scale=None, mask=None, layout="bshd", need_lse=True,
                            alibi_slopes=None, causal=opts.get("causal", False),
                            window=opts.get("window"), softcap=None)
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, config=config,
                               use_ptx=False, extra_options=extra, heads_inner=inner)
    _check(q, k, v, None, opts, out, lse)


def test_mma_f32_nonfinite_v_unmasked():
    """inf/NaN in V at keys every row sees (no mask: the tiles take the unmasked path; every
    float32 V tile is scanned for them, so the 3xTF32 split never meets inf: inf - inf would
    make NaN of a product with a P whose lo is 0)."""
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    q, k, v = qkv(rng_for("mma f32 inf v"), 1, 40, 70, 2, 1, 64, dtype="float32")
    v[0, 5, 0, 3] = np.inf
    v[0, 40, 0, 7] = -np.inf
    v[0, 66, 0, 9] = np.nan
    call = _spec.dense_call(q, k, v, scale=None, mask=None, layout="bshd", need_lse=True,
                            alibi_slopes=None, causal=False, window=None, softcap=None)
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, config=(32, 32, 2, 0),
                               use_ptx=False)
    _check(q, k, v, None, {}, out, lse)
    assert np.isposinf(out[..., 3]).all() and np.isneginf(out[..., 7]).all()


def test_tf32_rounding_emulated():
    """The emulated cvt.rna.tf32.f32: nearest with ties away from zero to 10 mantissa bits,
    carries into the exponent, inf/NaN kept; the split hi + lo is x exactly (lo = x - hi)."""
    import pyopencl as cl

    from attnlib.backends.opencl._runtime import kernel_source

    # the header's context in attn_fwd_mma.cl: nv_warp.h (the emulation's operand exchange) first
    header = kernel_source("nv_warp.h") + kernel_source("attn_fwd_mma_tf32.h")
    src = "#define USE_PTX 0\n" + header + """
__kernel void split(__global const float *x, __global uint *hi, __global uint *lo) {
  const int i = get_global_id(0);
  uint h, l;
  SPLIT_TF32(x[i], h, l);
  hi[i] = h;
  lo[i] = l;
}"""
    be = attnlib.get_backend("opencl")
    prg = cl.Program(be.context, src).build()
    rng = rng_for("tf32 rna")
    bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**19, 64, dtype=np.uint64).astype(np.uint32) << 13) | 0x1000
    special = np.array([0x3f800fff, 0x3f801000, 0x3f803000, 0xbf801000, 0x7f7ff000, 0x00001000,
                        0x7f800000, 0xff800000, 0x7fc00000, 0], np.uint32)
    x = np.concatenate([bits, ties, special]).view(np.float32)
    hi, lo = np.empty(x.size, np.uint32), np.empty(x.size, np.uint32)
    xb = cl.Buffer(be.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=x)
    hb = cl.Buffer(be.context, cl.mem_flags.WRITE_ONLY, hi.nbytes)
    lb = cl.Buffer(be.context, cl.mem_flags.WRITE_ONLY, lo.nbytes)
    prg.split(be.queue, (x.size,), None, xb, hb, lb)
    cl.enqueue_copy(be.queue, hi, hb)
    cl.enqueue_copy(be.queue, lo, lb)

    def rna(v: np.ndarray) -> np.ndarray:
        """Round half away from zero to 10 mantissa bits, in float64 (exact for these)."""
        u = v.view(np.uint32)
        m, e = np.frexp(v.astype(np.float64))  # |m| in [0.5, 1): 11 significant bits of m
        sub = (u & 0x7F800000) == 0  # subnormal: a fixed quantum of 2^-136
        q = np.where(sub, 2.0**-136, np.ldexp(1.0, e - 11))
        r = np.sign(v) * np.floor(np.abs(v.astype(np.float64)) / q + 0.5) * q
        return r.astype(np.float32)

    fin = np.isfinite(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want_hi = rna(x[fin])
        got_hi = hi[fin].view(np.float32)
        assert np.array_equal(got_hi, want_hi)
        ok = np.isfinite(got_hi)
        want_lo = x[fin][ok] - got_hi[ok]
        assert np.array_equal(lo[fin].view(np.float32)[ok], want_lo)
    assert np.array_equal(hi[~fin], x[~fin].view(np.uint32))
    xs = x[fin][ok].astype(np.float64)
    got = hi[fin].view(np.float32)[ok] + lo[fin].view(np.float32)[ok].astype(np.float64)
    assert np.array_equal(got, xs)


# -D options of the 16-bit kernel (DEFAULT_OPTIONS_16): LDSM_BYTES (ldmatrix / fast
# cp.async at per-thread byte addresses plus constants), KV_SPLIT_STAGES (FlashAttention-2's
# one-K-one-V-buffer schedule), alone and together; with Q in registers and in local memory,
# several key tiles, hidden inf/NaN in v, causal (WARP_SKIP and heads_inner on) and windows
CAND_CASES = [
    ("ldsm_bytes f16 causal q_regs", "float16", (1, 77, 101, 4, 2, 64), (64, 32, 2, 1),
     ("-DLDSM_BYTES=1",), {"causal": True}),
    ("ldsm_bytes bf16 window softcap alibi", "bfloat16", (2, 45, 141, 2, 1, 128),
     (128, 64, 4, 0), ("-DLDSM_BYTES=1",), {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("kv_split f16 causal", "float16", (1, 70, 203, 2, 2, 128), (128, 64, 4, 0),
     ("-DKV_SPLIT_STAGES=1",), {"causal": True}),
    ("kv_split+ldsm_bytes bf16 window", "bfloat16", (1, 93, 117, 3, 1, 64), (64, 32, 2, 0),
     ("-DKV_SPLIT_STAGES=1", "-DLDSM_BYTES=1"), {"window": (9, 3)}),
    ("kv_split+ldsm_bytes f16 dense", "float16", (1, 33, 150, 2, 1, 128), (128, 64, 4, 0),
     ("-DKV_SPLIT_STAGES=1", "-DLDSM_BYTES=1"), {}),
    # SOFTMAX_PIPE (half-tile software pipeline, attn_fwd_mma_pipe.h), with and without WARP_SKIP
    ("softmax_pipe f16 dense", "float16", (1, 61, 203, 2, 1, 128), (128, 64, 4, 0),
     ("-DSOFTMAX_PIPE=1",), {}),
    ("softmax_pipe+ldsm_bytes bf16 causal q_regs", "bfloat16", (1, 77, 150, 4, 2, 64),
     (64, 32, 2, 1), ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1", "-DWARP_SKIP=0"),
     {"causal": True, "softcap": 30.0, "alibi": True}),
    ("softmax_pipe+warp_skip f16 causal", "float16", (1, 100, 131, 2, 2, 64), (128, 64, 4, 1),
     ("-DSOFTMAX_PIPE=1", "-DLDSM_BYTES=1"), {"causal": True}),  # WARP_SKIP=1 added by run
]


@pytest.mark.parametrize("name,dtype,shape,config,extra,opts", CAND_CASES,
                         ids=[c[0] for c in CAND_CASES])
def test_mma_candidate_options(name, dtype, shape, config, extra, opts):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = qkv(rng_for("mma cand", name), b, sq, sk, hq, hkv, d, dtype=dtype)
    v[0, sk - 1, 0, 3] = np.nan  # hidden from some rows (causal / window): must not leak
    v[0, sk // 2, 0, 1] = np.inf  # seen by the rows whose window holds it
    call, slopes, kw = kernel_call(q, k, v, opts)
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, config=config,
                               use_ptx=False, extra_options=extra)
    _check(q, k, v, slopes, kw, out, lse)


@pytest.mark.parametrize("extra", [("-DLDSM_BYTES=1",), ("-DKV_SPLIT_STAGES=1",),
                                   ("-DSOFTMAX_PIPE=1",)])
def test_mma_candidate_options_refuse_f32(extra):
    """The 16-bit-only candidates stop the float32 build with their own message."""
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    q, k, v = qkv(rng_for("mma cand f32"), 1, 20, 20, 2, 1, 64, dtype="float32")
    call = _spec.dense_call(q, k, v, scale=None, mask=None, layout="bshd", need_lse=True,
                            alibi_slopes=None, causal=False, window=None, softcap=None)
    with pytest.raises(Exception, match="is for the 16-bit kernel"):
        _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=False,
                        extra_options=extra)


def _mask(rng, name, shape):
    """A bool (keeps ~70% of keys) or additive (normal values, ~20% -inf; float32, or the dtype
    the name says: "bf16 values", "f16 values") mask of ``shape``."""
    if "bool" in name:
        return rng.random(shape) < 0.7
    m = rng.standard_normal(shape).astype(np.float32)
    m[rng.random(shape) < 0.2] = -np.inf
    if "bf16 values" in name:
        return m.astype(ml_dtypes.bfloat16)
    return m.astype(np.float16) if "f16 values" in name else m


# head dims other than 64/128 (padded to 16 inside the kernel; D = 59 and 111 also read their
# unaligned rows element by element, -DVEC_LOADS=0), D != Dv, in 16 bits and float32, and masks
# of several broadcast shapes, with each tier's default config and options (PADDED_CONFIGS:
# causal D <= 64 runs SOFTMAX_PIPE, past 128 KV_SPLIT_STAGES; float32: PADDED_CONFIGS_F32).
# mask: the shape of the mask before broadcasting.
SHAPE_CASES = [
    # name, dtype, (b, sq, sk, hq, hkv, d, dv), mask shape or None, options
    ("f16 d80 causal gqa", "float16", (1, 21, 40, 2, 1, 80, 80), None, {"causal": True}),
    ("f16 d59/48 bool mask", "float16", (2, 20, 35, 2, 1, 59, 48), (2, 1, 20, 35), {}),
    ("bf16 d192/128 window softcap alibi", "bfloat16", (1, 45, 77, 2, 1, 192, 128), None,
     {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("f16 d256 causal Sq>Sk", "float16", (1, 90, 37, 2, 1, 256, 256), None, {"causal": True}),
    ("bf16 d111 causal", "bfloat16", (1, 70, 101, 2, 2, 111, 111), None, {"causal": True}),
    ("f16 d32 additive mask per head", "float16", (2, 40, 61, 2, 1, 32, 32), (1, 2, 1, 61),
     {"causal": True}),
    ("f16 d48 bool mask causal pipe", "float16", (1, 70, 101, 2, 1, 48, 48), (70, 101),
     {"causal": True, "alibi": True}),
    ("bf16 d160/96 additive mask f16 values window softcap", "bfloat16", (1, 50, 90, 2, 1, 160, 96),
     (1, 1, 50, 90), {"window": (30, 10), "softcap": 20.0}),
    ("f16 d224 bool mask rows", "float16", (1, 40, 64, 2, 2, 224, 224), (40, 1), {}),
    ("f16 d96 additive mask bf16 values", "float16", (2, 30, 45, 2, 1, 96, 96), (2, 2, 30, 45),
     {"scale": 0.3}),
    ("f32 d64 bool mask causal", "float32", (1, 45, 70, 2, 1, 64, 64), (1, 1, 45, 70),
     {"causal": True}),
    ("f32 d128 additive mask", "float32", (1, 30, 50, 2, 2, 128, 128), (1, 2, 30, 50), {}),
    # float32 at padded head dims (PADDED_CONFIGS_F32; D = 59: element-wise loads)
    ("f32 d96/80 causal window", "float32", (1, 45, 77, 2, 1, 96, 80), None,
     {"causal": True, "window": (20, 5)}),
    ("f32 d59 bool mask", "float32", (1, 20, 35, 2, 1, 59, 59), (1, 1, 20, 35), {}),
    ("f32 d192/128 softcap alibi", "float32", (1, 40, 70, 2, 1, 192, 128), None,
     {"softcap": 30.0, "alibi": True}),
    ("f32 d256 causal Sq>Sk", "float32", (1, 70, 37, 2, 1, 256, 256), None, {"causal": True}),
]


@pytest.mark.parametrize("name,dtype,shape,mask,opts", SHAPE_CASES,
                         ids=[c[0] for c in SHAPE_CASES])
def test_mma_shapes_masks(name, dtype, shape, mask, opts):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d, dv = shape
    rng = rng_for("mma shapes", name)
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dv, dtype=dtype)
    opts = dict(opts)
    if mask is not None:
        m = _mask(rng, name, mask)
        if mask[-1] == sk:
            # key sk - 2 hidden from every row by the mask alone (False, or -inf added): the NaN
            # in its k and v must not leak
            m[..., sk - 2] = False if "bool" in name else -np.inf
            k[0, sk - 2, 0, 0] = np.nan
            v[0, sk - 2, 0, dv - 1] = np.nan
        opts["mask"] = m
    else:
        v[0, sk - 1, 0, dv - 1] = np.nan  # hidden from some rows (causal / window) or seen
    call, slopes, kw = kernel_call(q, k, v, opts)
    kinds = {"bool": 1, "bf16 values": 4, "f16 values": 3}
    assert _nvidia_mma.mask_kind(call) == (0 if mask is None else next(
        (n for key, n in kinds.items() if key in name), 2))
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=False)
    assert out.shape == (b, sq, hq, dv)
    _check(q, k, v, slopes, kw, out, lse)


# Paged K/V pools (-DPAGE_SIZE: each key row's address from the block table, the entries staged
# ahead of the loads): page sizes below, at and above a key tile (and 5, which divides nothing),
# with each schedule the defaults pick (plain double buffer, KV_SPLIT_STAGES, SOFTMAX_PIPE, the
# float32 3xTF32 build, padded head dims with element-wise loads), GQA, causal, window, softcap,
# ALiBi and sinks; the pages scattered, unused pages NaN, garbage table columns past each
# sequence's pages, keys from mid-page (k_row0 > 0), NaN in v of a key some rows do not see.
PAGED_CASES = [
    # name, page size, dtype, (b, sq, sk, hq, hkv, d, dv), options
    ("f16 d64 causal pipe", 16, "float16", (2, 70, 131, 4, 2, 64, 64), {"causal": True}),
    ("f16 d128 causal kv_split", 1, "float16", (1, 45, 101, 2, 1, 128, 128), {"causal": True}),
    ("bf16 d128 window softcap alibi", 8, "bfloat16", (2, 45, 141, 2, 1, 128, 128),
     {"window": (20, 5), "softcap": 30.0, "alibi": True}),
    ("f16 d64 kv_split sinks", 5, "float16", (1, 33, 150, 4, 1, 64, 64), {"sinks": True}),
    ("f32 d64 causal", 32, "float32", (1, 70, 131, 4, 2, 64, 64), {"causal": True}),
    ("f16 d80 gqa", 128, "float16", (1, 40, 101, 4, 2, 80, 80), {}),
    ("f16 d59/48 causal", 16, "float16", (1, 21, 70, 2, 1, 59, 48), {"causal": True}),
    ("bf16 d192/128 causal", 64, "bfloat16", (1, 50, 90, 2, 1, 192, 128), {"causal": True}),
]


@pytest.mark.parametrize("name,page,dtype,shape,opts", PAGED_CASES,
                         ids=[c[0] for c in PAGED_CASES])
def test_mma_paged_emulated(name, page, dtype, shape, opts):
    _paged_case(name, page, dtype, shape, opts, use_ptx=False)


def _native() -> bool:
    from attnlib.backends.opencl import _nvidia_mma

    cc = _nvidia_mma.compute_capability(attnlib.get_backend("opencl").device)
    return cc is not None and cc[0] >= 8


@pytest.mark.skipif(not _native(), reason="needs an NVIDIA sm_80+ device (the emulated twin "
                    "test_mma_paged_emulated runs everywhere)")
@pytest.mark.parametrize("name,page,dtype,shape,opts", PAGED_CASES,
                         ids=[c[0] for c in PAGED_CASES])
def test_mma_paged_native(name, page, dtype, shape, opts):
    """The same paged builds in the device's own PTX."""
    _paged_case(name, page, dtype, shape, opts, use_ptx=None)


def _paged_case(name, page, dtype, shape, opts, use_ptx):
    from dataclasses import replace

    from attnlib.backends.opencl import _nvidia_mma
    from attnlib.testing._helpers import paged_twin

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d, dv = shape
    rng = rng_for("mma paged", name)
    q, k, v = qkv(rng, b, sq, sk + 7, hq, hkv, d, dv, dtype=dtype)
    opts = dict(opts)
    sinks = opts.pop("sinks", False)
    # keys from row 7 of k (mid-page): the contiguous twin is q over k[:, 7:]
    call, slopes, kw = kernel_call(q, k[:, 7:], v[:, 7:], opts)
    v[0, 7 + sk - 1, 0, dv - 1] = np.nan  # hidden from the first rows by causal, else seen
    call = replace(call, k=k, v=v, k_row0=call.k_row0 + 7)
    if sinks:
        kw["sinks"] = (rng.standard_normal(hq) * np.resize([2.0, 25.0], hq)).astype(np.float32)
        call = replace(call, options=replace(call.options, sinks=kw["sinks"]))
    paged = paged_twin(rng, call, page)
    assert _nvidia_mma.page_size(paged) == page
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, paged, use_ptx=use_ptx)
    _check(q, k[:, 7:], v[:, 7:], slopes, kw, out, lse)


def _tile_mask(name, b, hq, sq, sk):
    """Masks that hide whole key tiles from whole row blocks (the kernel skips those tiles of a
    bool mask): key padding per sequence, block diagonal (bool, and additive: no skip), per-head
    key ranges with a row that sees nothing, and a mask that hides every key."""
    if "key padding" in name:  # (b, 1, 1, sk): sequence i sees its first lens[i] keys
        lens = np.array([sk - 130, sk - 67])[:b]
        return np.arange(sk)[None, None, None, :] < lens[:, None, None, None]
    if "block diagonal" in name:  # (sq, sk): inside 50 x 50 blocks (additive: 0, else -inf)
        blk = (np.arange(sq)[:, None] // 50) == (np.arange(sk)[None, :] // 50)
        return np.where(blk, 0.0, -np.inf).astype(np.float32) if "additive" in name else blk
    if "per head" in name:  # (1, hq, sq, sk): head 0 keys < 60, head 1 keys >= 130
        j = np.arange(sk)[None, None, :]
        m = np.concatenate([np.broadcast_to(j < 60, (1, sq, sk)),
                            np.broadcast_to(j >= 130, (1, sq, sk))])[None]
        m = m.copy()
        m[0, 1, 7, :] = False  # a row that sees nothing: out 0, lse -inf
        return m
    return np.zeros((1, 1, 1, sk), bool)  # every key hidden


TILE_MASK_CASES = [
    # name, dtype, (b, sq, sk, hq, hkv, d), options
    ("f16 d64 key padding", "float16", (2, 70, 200, 2, 1, 64), {}),
    ("bf16 d128 block diagonal causal", "bfloat16", (1, 150, 150, 2, 2, 128),
     {"causal": True}),
    # additive masks take one unbounded range: every tile visited and masked
    ("f16 d64 block diagonal additive", "float16", (1, 150, 150, 2, 1, 64), {}),
    ("f32 d64 bool per head", "float32", (1, 90, 200, 2, 1, 64), {}),
    ("f16 d64 hides every key", "float16", (1, 40, 150, 2, 1, 64), {}),
]


@pytest.mark.parametrize("name,dtype,shape,opts", TILE_MASK_CASES,
                         ids=[c[0] for c in TILE_MASK_CASES])
def test_mma_mask_hidden_tiles(name, dtype, shape, opts):
    """Key tiles a mask hides from every row of a block are skipped (the host's tile range per
    row block, ``mask_tile_args``): the result is that of the mask read per score, NaN in k and
    v of hidden keys included."""
    _tile_mask_case(name, dtype, shape, opts, use_ptx=False)


@pytest.mark.skipif(not _native(), reason="needs an NVIDIA sm_80+ device (the emulated twin "
                    "test_mma_mask_hidden_tiles runs everywhere)")
@pytest.mark.parametrize("name,dtype,shape,opts", TILE_MASK_CASES,
                         ids=[c[0] for c in TILE_MASK_CASES])
def test_mma_mask_hidden_tiles_native(name, dtype, shape, opts):
    """The same masked builds in the device's own PTX."""
    _tile_mask_case(name, dtype, shape, opts, use_ptx=None)


def _tile_mask_case(name, dtype, shape, opts, use_ptx):
    from attnlib.backends.opencl import _nvidia_mma

    be = attnlib.get_backend("opencl")
    b, sq, sk, hq, hkv, d = shape
    rng = rng_for("mma tile masks", name)
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dtype=dtype)
    mask = _tile_mask(name, b, hq, sq, sk)
    hidden = np.flatnonzero(~np.broadcast_to(mask if mask.dtype == bool else mask > -np.inf,
                                             (b, hq, sq, sk)).any(axis=(1, 2))[0])
    if hidden.size:
        k[0, hidden[-1], 0, 0] = np.nan
        v[0, hidden[0], 0, 1] = np.nan
    call, slopes, kw = kernel_call(q, k, v, {**opts, "mask": mask})
    out, lse = _nvidia_mma.run(be.context, be.queue, be.device, call, use_ptx=use_ptx)
    _check(q, k, v, slopes, kw, out, lse)


def test_mask_tile_ranges():
    """The host's key-tile range per (sequence, head, row block) of a bool mask (no kernel): the
    first and last tile holding a key some row of the block sees, against a loop over the
    broadcast mask, for several broadcast shapes and key counts that do and do not fill the last
    tile (last < first where a block sees nothing; a mask broadcast over keys gives all tiles or
    none)."""
    from attnlib._spec._arrays import check_mask
    from attnlib.backends.opencl._nvidia_tables import mask_tile_ranges

    rng = rng_for("mask tile ranges")
    b, hq, sq, bm, bn = 2, 3, 45, 16, 8
    for sk in (70, 72):
        for shape in [(b, hq, sq, sk), (b, 1, 1, sk), (1, hq, sq, 1), (sq, sk), (b, 1, sq, sk)]:
            # sparse: whole tiles of whole row blocks hidden, some blocks seeing nothing
            vis = rng.random(shape) < (0.005 if len(shape) > 2 and shape[-2] > 1 else 0.1)
            mv, _ = check_mask(vis, (b, hq, sq, sk))
            got = mask_tile_ranges(mv, bm, bn)
            full = np.broadcast_to(vis, (b, hq, sq, sk))
            for s in range(b):
                for h in range(hq):
                    for rb in range(-(-sq // bm)):
                        at = tuple(0 if n == 1 else x for n, x in zip(got.shape, (s, h, rb)))
                        lo, hi = got[at]
                        cols = full[s, h, rb * bm:(rb + 1) * bm].any(axis=0)
                        seen = np.flatnonzero(cols) // bn
                        if seen.size == 0:
                            assert hi < lo, (sk, shape)
                        elif shape[-1] > 1:
                            assert (lo, hi) == (seen[0], seen[-1]), (sk, shape)
                        else:
                            assert lo <= seen[0] and hi >= seen[-1], (sk, shape)
