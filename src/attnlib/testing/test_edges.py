"""Empty and fully masked rows, NaN and garbage behind masks, strided views, device arrays."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, check_dense, qkv, rng_for
from attnlib.testing.tolerance import assert_same_nonfinite


def _assert_empty_rows(out, lse, rows):
    """Rows that see no key: out exactly 0, lse exactly -inf, never NaN."""
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, rows] == 0).all()
    assert np.isneginf(lse[:, :, rows]).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_no_keys(attnlib_backend, dtype):
    rng = rng_for("sk0", dtype)
    q, k, v = qkv(rng, 2, 5, 0, 2, 1, 8, 6, dtype)
    res = check_dense(attnlib_backend, q, k, v)
    if res is not None:
        out, lse = res
        assert out.shape == (2, 5, 2, 6)
        _assert_empty_rows(out, lse, slice(None))


def test_no_queries(attnlib_backend):
    import attnlib

    rng = rng_for("sq0")
    q, k, v = qkv(rng, 2, 0, 7, 2, 2, 8, 5)
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True, backend=attnlib_backend)
    assert out.shape == (2, 0, 2, 5) and lse.shape == (2, 2, 0)


def test_rows_before_bottom_right_diagonal_are_empty(attnlib_backend):
    """Sq > Sk with bottom-right causal: the first Sq - Sk rows see nothing."""
    rng = rng_for("sq>sk empty")
    q, k, v = qkv(rng, 1, 20, 7, 2, 2, 16)
    out, lse = check_dense(attnlib_backend, q, k, v, causal=True)
    _assert_empty_rows(out, lse, slice(0, 13))
    assert np.isfinite(lse[:, :, 13:]).all()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows(attnlib_backend, kind):
    rng = rng_for("masked rows", kind)
    q, k, v = qkv(rng, 2, 9, 14, 2, 2, 16)
    keep = rng.random((2, 2, 9, 14)) < 0.7
    keep[:, :, [0, 4, 8]] = False
    mask = keep if kind == "bool" else np.where(keep, 0.25, -np.inf).astype(np.float32)
    out, lse = check_dense(attnlib_backend, q, k, v, mask=mask)
    _assert_empty_rows(out, lse, [0, 4, 8])


def test_window_leaving_rows_empty(attnlib_backend):
    """Sq > Sk: row i sits at position i + Sk - Sq; window (1, 0) shows it keys i-8 .. i-7."""
    rng = rng_for("window empty")
    q, k, v = qkv(rng, 1, 12, 5, 2, 1, 8)
    out, lse = check_dense(attnlib_backend, q, k, v, window=(1, 0))
    _assert_empty_rows(out, lse, slice(0, 7))
    assert np.isfinite(lse[:, :, 7:]).all()


def _hidden_nan_case(rng, hide):
    """NaN in k and v at keys no query row may see under ``hide``; returns (kwargs, q, k, v)."""
    b, h, sq, sk = 2, 2, 11, 19
    q, k, v = qkv(rng, b, sq, sk, h, h, 16)
    kw = {}
    if hide == "causal":
        kw["causal"] = True
        bad = [sk - 1]  # only the last row sees the last key: it alone turns NaN
    elif hide == "top_left":
        kw["causal"] = "top_left"
        bad = list(range(sq, sk))
    elif hide == "window":
        kw["window"] = (2, 1)
        bad = [0, 1]  # row 0 sits at position sk - sq = 8: sees keys 6..9 only
    elif hide == "bool":
        keep = np.ones((b, 1, 1, sk), bool)
        keep[..., [3, 11]] = False
        kw["mask"] = keep
        bad = [3, 11]
    else:
        add = rng.standard_normal((1, 1, sq, sk)).astype(np.float32)
        add[..., [5, 17]] = -np.inf
        kw["mask"] = add
        bad = [5, 17]
    k[:, bad] = np.nan
    v[:, bad] = np.nan
    if hide != "causal":
        v[:, bad[:1], :, :3] = np.inf
    return kw, q, k, v


@pytest.mark.parametrize("hide", ["causal", "top_left", "window", "bool", "additive"])
def test_nan_behind_masks_is_ignored(attnlib_backend, hide):
    kw, q, k, v = _hidden_nan_case(rng_for("nan hidden", hide), hide)
    out, lse = check_dense(attnlib_backend, q, k, v, **kw)
    if hide == "causal":
        assert np.isfinite(out[:, :-1]).all() and np.isnan(out[:, -1]).all()
    else:
        assert np.isfinite(out).all() and not np.isnan(lse).any()


@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_in_visible_key_propagates(attnlib_backend, where):
    rng = rng_for("nan visible", where)
    q, k, v = qkv(rng, 1, 10, 13, 2, 2, 8)
    if where == "q":
        q[0, 4, 1, 2] = np.nan
    elif where == "k":
        k[0, 6, 0, 3] = np.nan
    else:
        v[0, 6, 1, 5] = np.nan
    out, _ = check_dense(attnlib_backend, q, k, v, causal=True)
    assert np.isnan(out).any() and not np.isnan(out).all()


def _strided_views(rng, dtype="float32"):
    """Views with non-contiguous, negative and zero strides over the same logical shapes."""
    b, sq, sk, h, d = 2, 13, 21, 2, 16
    big_q = rng.standard_normal((b, 2 * sq, h + 1, d + 5)).astype(dtype)
    q = big_q[:, ::2, 1:, 3:3 + d]  # stepped and offset
    kbase = rng.standard_normal((b, sk, h, d)).astype(dtype)
    k = kbase[:, ::-1]  # negative stride along keys
    vrow = rng.standard_normal((1, sk, 1, d)).astype(dtype)
    v = np.broadcast_to(vrow, (b, sk, h, d))  # zero strides along batch and heads
    return q, k, v


def test_strided_views(attnlib_backend):
    q, k, v = _strided_views(rng_for("strided"))
    assert not q.flags.c_contiguous and k.strides[1] < 0 and v.strides[0] == 0
    out, lse = check_dense(attnlib_backend, q, k, v, causal=True)
    import attnlib

    dense = attnlib.attention(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True,
                              backend=attnlib_backend)
    assert np.allclose(out, dense, rtol=0, atol=1e-5)


def test_bhsd_views_of_bshd_memory(attnlib_backend):
    """A transposed (non-contiguous) view passed as bhsd."""
    rng = rng_for("bhsd view")
    q, k, v = qkv(rng, 2, 11, 17, 3, 3, 12)
    qt, kt, vt = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    check_dense(attnlib_backend, qt, kt, vt, layout="bhsd", causal=True)


def test_float16_strided_mask(attnlib_backend):
    rng = rng_for("fp16 mask view")
    q, k, v = qkv(rng, 1, 9, 15, 2, 2, 8)
    big = np.where(rng.random((2, 30, 9)) < 0.8, 0.5, -np.inf).astype(np.float16)
    mask = big[:, ::2].transpose(0, 2, 1)[None]  # (1, 2, 9, 15), non-contiguous float16
    check_dense(attnlib_backend, q, k, v, mask=mask)


def test_device_arrays_round_trip(attnlib_backend):
    import attnlib

    rng = rng_for("device")
    q, k, v = qkv(rng, 1, 9, 14, 2, 1, 16)
    host = attnlib.attention(q, k, v, causal=True, backend=attnlib_backend)
    dq, dk, dv = (attnlib.to_device(a, backend=attnlib_backend) for a in (q, k, v))
    dev = attnlib.attention(dq, dk, dv, causal=True, backend=attnlib_backend)
    back = attnlib.to_numpy(dev)
    assert isinstance(back, np.ndarray)
    assert np.array_equal(back, host)
    assert np.array_equal(attnlib.to_numpy(dq), q)


def test_nan_pattern_helper_catches_differences():
    """Guard for the suite itself: the comparison really looks at NaN."""
    with pytest.raises(AssertionError):
        assert_same_nonfinite(np.array([1.0, np.nan]), np.array([1.0, 2.0]))


def test_device_arrays_through_every_primitive(attnlib_backend):
    """Device arrays in give device arrays out (numpy backends: numpy), equal to the host path."""
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    rng = rng_for("device all")
    q, k, v = qkv(rng, 1, 6, 11, 2, 1, 8, 5)
    dev = {name: attnlib.to_device(a, backend=attnlib_backend) for name, a in
           (("q", q), ("k", k), ("v", v))}
    owned = be.owns(dev["q"])

    def same(got, want, atol=1e-6):
        assert be.owns(got) == owned, f"{type(got).__name__} out for {type(dev['q']).__name__} in"
        host = attnlib.to_numpy(got)
        assert host.shape == np.shape(want) and host.dtype == np.asarray(want).dtype
        assert np.allclose(host, want, rtol=0, atol=atol, equal_nan=True)

    x = dev["q"]
    same(attnlib.softmax(x, axis=1, backend=attnlib_backend),
         attnlib.softmax(q, axis=1, backend=attnlib_backend))
    same(attnlib.logsumexp(x, backend=attnlib_backend),
         attnlib.logsumexp(q, backend=attnlib_backend))
    pos = np.arange(6)
    same(attnlib.rope(x, pos, backend=attnlib_backend), attnlib.rope(q, pos,
                                                                     backend=attnlib_backend))
    o1, l1 = attnlib.attention(x, dev["k"], dev["v"], return_lse=True, backend=attnlib_backend)
    same(o1, attnlib.attention(q, k, v, backend=attnlib_backend))
    mo, ml = attnlib.merge_states([o1, o1], [l1, l1], backend=attnlib_backend)
    ho, hl = attnlib.merge_states([attnlib.to_numpy(o1)] * 2, [attnlib.to_numpy(l1)] * 2,
                                  backend=attnlib_backend)
    same(mo, ho)
    same(ml, hl)
    acc = attnlib.OnlineAttention(x, backend=attnlib_backend)
    acc.update(dev["k"], dev["v"])
    same(acc.result(), attnlib.attention(q, k, v, backend=attnlib_backend), atol=1e-5)
    cache = attnlib.KVCache(1, 16, 1, 8, head_dim_v=5, backend=attnlib_backend)
    out = attnlib.attention_with_kvcache(x, cache, dev["k"][:, :6], dev["v"][:, :6],
                                         backend=attnlib_backend)
    same(out, attnlib.attention(q, k[:, :6], v[:, :6], causal=True, backend=attnlib_backend),
         atol=1e-5)


def test_calls_from_several_threads(attnlib_backend):
    """One backend instance used by several threads at once gives each the serial result."""
    from concurrent.futures import ThreadPoolExecutor

    import attnlib

    rng = rng_for("threads")
    cases = [qkv(rng, 1, 5 + 7 * i, 40 + 9 * i, 2, 1, 16) for i in range(4)]

    def run(case):
        q, k, v = case
        out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True,
                                     backend=attnlib_backend)
        sm = attnlib.softmax(q, axis=1, backend=attnlib_backend)
        return out, lse, sm

    serial = [run(c) for c in cases]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            for got, want in zip(pool.map(run, cases), serial):
                for a, b in zip(got, want):
                    assert a.tobytes() == b.tobytes()
