"""contract §3: softmax, logsumexp, merge_states and OnlineAttention."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, call_or_unsupported, qkv, randn, rng_for
from attnlib.testing.reference import reference_logsumexp, reference_softmax
from attnlib.testing.tolerance import assert_rule, check_attention


def _naive_softmax(x, axis):
    """Softmax plainly in x's dtype (float32 arithmetic rounded to it for narrow dtypes)."""
    work = np.float64 if x.dtype.itemsize >= 4 else np.float32
    xf = x.astype(work)
    m = np.max(xf, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(xf - m).astype(x.dtype).astype(work)
        return (e / e.sum(axis=axis, keepdims=True).astype(x.dtype).astype(work)).astype(x.dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_logsumexp(attnlib_backend, dtype, axis):
    import attnlib

    x = randn(rng_for("softmax", dtype, axis), (7, 33, 5), dtype, scale=3.0)
    x[2, :, 1] = -np.inf  # an all -inf line along axis 1 and partly along the others
    x[:, 4, :] = -np.inf
    got = call_or_unsupported(attnlib_backend, x.dtype,
                              lambda: attnlib.softmax(x, axis=axis, backend=attnlib_backend))
    if got is None:
        return
    assert got.dtype == x.dtype and got.shape == x.shape
    ref = reference_softmax(x, axis)
    naive = None if x.dtype == np.float64 else _naive_softmax(x, axis)
    assert_rule(np.nan_to_num(got), np.nan_to_num(ref), naive if naive is None else
                np.nan_to_num(naive.astype(np.float64)), "softmax")
    assert not np.isnan(got).any()
    lse = attnlib.logsumexp(x, axis=axis, backend=attnlib_backend)
    assert lse.dtype == (np.float64 if x.dtype == np.float64 else np.float32)
    ref_lse = reference_logsumexp(x, axis)
    assert lse.shape == ref_lse.shape
    assert_rule(lse, ref_lse, None, "logsumexp", slack=1e-5 * (1 + np.abs(ref_lse[
        np.isfinite(ref_lse)]).max()))


def test_softmax_all_neg_inf_rows(attnlib_backend):
    import attnlib

    x = np.full((3, 9), -np.inf, np.float32)
    x[1, 4] = 2.0
    sm = attnlib.softmax(x, backend=attnlib_backend)
    assert (sm[[0, 2]] == 0).all() and sm[1, 4] == 1.0 and not np.isnan(sm).any()
    lse = attnlib.logsumexp(x, backend=attnlib_backend)
    assert np.isneginf(lse[[0, 2]]).all() and lse[1] == 2.0


def test_softmax_of_an_empty_axis(attnlib_backend):
    import attnlib

    x = np.ones((3, 0), np.float32)
    sm = attnlib.softmax(x, backend=attnlib_backend)
    assert sm.shape == (3, 0) and sm.dtype == np.float32
    lse = attnlib.logsumexp(x, backend=attnlib_backend)
    assert lse.shape == (3,) and np.isneginf(lse).all()


def test_softmax_nan_propagates_and_strides(attnlib_backend):
    import attnlib

    base = randn(rng_for("softmax nan"), (11, 40), "float32")
    x = base[::-2, 3::3]  # negative and stepped strides
    x_c = np.ascontiguousarray(x)
    sm = attnlib.softmax(x, backend=attnlib_backend)
    assert_rule(sm, reference_softmax(x_c), None, "softmax")
    bad = x_c.copy()
    bad[2, 5] = np.nan
    got = attnlib.softmax(bad, backend=attnlib_backend)
    assert np.isnan(got[2]).all() and not np.isnan(np.delete(got, 2, axis=0)).any()
    assert np.isnan(attnlib.logsumexp(bad, backend=attnlib_backend)[2])


def test_softmax_of_long_rows(attnlib_backend):
    """Rows longer than a backend's blocks (thousands of elements): a maximum that grows in a
    later block, a leading run of -inf, NaN late in a row and NaN among leading -inf."""
    import attnlib

    x = randn(rng_for("softmax long rows"), (6, 4999), "float32", scale=3.0)
    x[1, 4990] = 40.0  # the maximum arrives at the end of the row
    x[2, :2100] = -np.inf
    x[3, 4500] = np.nan
    x[4, :2100] = -np.inf
    x[4, 7] = np.nan
    sm = attnlib.softmax(x, backend=attnlib_backend)
    lse = attnlib.logsumexp(x, backend=attnlib_backend)
    good = [0, 1, 2, 5]
    assert_rule(sm[good], reference_softmax(x[good]), None, "softmax")
    assert_rule(lse[good], reference_logsumexp(x[good], -1), None, "logsumexp", slack=1e-4)
    assert np.isnan(sm[[3, 4]]).all() and np.isnan(lse[[3, 4]]).all()
    assert (sm[2, :2100] == 0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_merge_equals_attention_over_concatenated_keys(attnlib_backend, dtype, layout):
    import attnlib

    rng = rng_for("merge", dtype, layout)
    q, k, v = qkv(rng, 2, 9, 40, 4, 2, 24, 20, dtype)
    cuts = [0, 7, 7, 23, 40]  # one empty chunk among them
    if layout == "bhsd":
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        ax = 2
    else:
        ax = 1

    def run():
        outs, lses = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            sl = [slice(None)] * 4
            sl[ax] = slice(a, b)
            o, s = attnlib.attention(q, k[tuple(sl)], v[tuple(sl)], return_lse=True,
                                     layout=layout, backend=attnlib_backend)
            outs.append(o)
            lses.append(s)
        return attnlib.merge_states(outs, lses, layout=layout, backend=attnlib_backend)

    res = call_or_unsupported(attnlib_backend, q.dtype, run)
    if res is None:
        return
    out, lse = res
    whole, whole_lse = attnlib.attention(q, k, v, return_lse=True, layout=layout,
                                         backend=attnlib_backend)
    assert out.dtype == q.dtype and out.shape == whole.shape and lse.shape == whole_lse.shape
    from attnlib.testing.reference import naive_attention, reference_attention

    ref, ref_lse = reference_attention(q, k, v, layout=layout)
    naive, naive_lse = (None, None) if q.dtype == np.float64 else naive_attention(
        q, k, v, layout=layout)
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)


def test_merge_of_empty_states(attnlib_backend):
    import attnlib

    outs = [np.zeros((1, 3, 2, 4), np.float32) for _ in range(3)]
    lses = [np.full((1, 2, 3), -np.inf, np.float32) for _ in range(3)]
    out, lse = attnlib.merge_states(outs, lses, backend=attnlib_backend)
    assert (out == 0).all() and np.isneginf(lse).all()
    # one real state among empty ones comes back unchanged
    rng = rng_for("merge one")
    o = randn(rng, (1, 3, 2, 4))
    s = randn(rng, (1, 2, 3))
    out, lse = attnlib.merge_states([outs[0], o, outs[1]], [lses[0], s, lses[1]],
                                    backend=attnlib_backend)
    assert np.allclose(out, o, atol=1e-6) and np.allclose(lse, s, atol=1e-6)


def _stream(backend, q, k, v, chunks, **kw):
    import attnlib

    acc = attnlib.OnlineAttention(q, backend=backend, **kw)
    for a, b in zip(chunks[:-1], chunks[1:]):
        acc.update(k[:, a:b], v[:, a:b])
    return acc


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_streaming_equals_one_shot(attnlib_backend, dtype, causal):
    import attnlib

    rng = rng_for("stream", dtype, causal)
    q, k, v = qkv(rng, 2, 13, 50, 4, 2, 32, 24, dtype)
    chunks = [0, 1, 9, 9, 30, 50]
    kw = dict(causal=causal, softcap=6.0, scale=0.3)
    if causal:
        kw["total_keys"] = 50

    def run():
        return _stream(attnlib_backend, q, k, v, chunks, **kw).result(return_lse=True)

    res = call_or_unsupported(attnlib_backend, q.dtype, run)
    if res is None:
        return
    out, lse = res
    from attnlib.testing.reference import naive_attention, reference_attention

    ref, ref_lse = reference_attention(q, k, v, causal=causal, softcap=6.0, scale=0.3)
    naive, naive_lse = (None, None) if q.dtype == np.float64 else naive_attention(
        q, k, v, causal=causal, softcap=6.0, scale=0.3)
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)
    one = attnlib.attention(q, k, v, causal=causal, softcap=6.0, scale=0.3,
                            backend=attnlib_backend)
    assert out.shape == one.shape and out.dtype == one.dtype


def test_streaming_top_left(attnlib_backend):
    """``causal="top_left"`` streams with its own alignment (key j visible iff j <= i)."""
    from attnlib.testing.reference import reference_attention

    rng = rng_for("stream top_left")
    q, k, v = qkv(rng, 1, 7, 19, 2, 1, 16)
    acc = _stream(attnlib_backend, q, k, v, [0, 5, 19], causal="top_left", total_keys=19)
    out, lse = acc.result(return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, causal="top_left")
    check_attention(out, lse, ref, None, ref_lse, None)


def test_streaming_bhsd_and_result_forms(attnlib_backend):
    import attnlib

    rng = rng_for("stream bhsd")
    q, k, v = qkv(rng, 1, 5, 21, 2, 1, 16)
    qt, kt, vt = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    acc = attnlib.OnlineAttention(qt, layout="bhsd", backend=attnlib_backend)
    out0, lse0 = acc.result(return_lse=True)
    assert out0.shape == (1, 2, 5, 16) and (out0 == 0).all() and np.isneginf(lse0).all()
    for a, b in [(0, 8), (8, 21)]:
        acc.update(kt[:, :, a:b], vt[:, :, a:b])
    out = acc.result()
    assert isinstance(out, np.ndarray) and out.shape == (1, 2, 5, 16)
    ref = attnlib.attention(qt, kt, vt, layout="bhsd", backend=attnlib_backend)
    assert np.allclose(out, ref, atol=1e-5)


def test_streaming_from_memmap(attnlib_backend, tmp_path):
    import attnlib

    rng = rng_for("memmap")
    q, k, v = qkv(rng, 1, 7, 45, 2, 2, 16)
    mk = np.lib.format.open_memmap(tmp_path / "k.npy", mode="w+", dtype=k.dtype, shape=k.shape)
    mv = np.lib.format.open_memmap(tmp_path / "v.npy", mode="w+", dtype=v.dtype, shape=v.shape)
    mk[:] = k
    mv[:] = v
    mk.flush()
    mv.flush()
    rk = np.load(tmp_path / "k.npy", mmap_mode="r")
    rv = np.load(tmp_path / "v.npy", mmap_mode="r")
    acc = attnlib.OnlineAttention(q, causal=True, total_keys=45, backend=attnlib_backend)
    for a in range(0, 45, 10):
        acc.update(rk[:, a:a + 10], rv[:, a:a + 10])
    out, lse = acc.result(return_lse=True)
    from attnlib.testing.reference import reference_attention

    ref, ref_lse = reference_attention(q, k, v, causal=True)
    check_attention(out, lse, ref, None, ref_lse, None)


def test_merge_skips_empty_states_holding_nan(attnlib_backend):
    """An empty state (lse = -inf) contributes nothing even when its out holds NaN, also among
    many states (GPU merge kernels read them in unrolled batches)."""
    import attnlib

    rng = rng_for("merge nan")
    outs = [randn(rng, (2, 3, 2, 8)) for _ in range(11)]
    lses = [randn(rng, (2, 2, 3)) for _ in range(11)]
    for i in (2, 7, 10):
        outs[i] = np.full_like(outs[i], np.nan)
        lses[i] = np.full_like(lses[i], -np.inf)
    keep = [i for i in range(11) if i not in (2, 7, 10)]
    out, lse = attnlib.merge_states(outs, lses, backend=attnlib_backend)
    ref, ref_lse = attnlib.merge_states([outs[i] for i in keep], [lses[i] for i in keep],
                                        backend="numpy")
    out = np.asarray(attnlib.to_numpy(out), np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(attnlib.to_numpy(lse)), ref_lse, atol=1e-5)


#: streamed chunks against one-shot attention over the concatenated keys, where the state's
#: merge meets non-finite values, chunks a row sees nothing of, and empty chunks:
#: name -> (Sq, total keys, key cuts, {key: what is poisoned}, key from which k grows x16)
STREAM_EDGES = {
    # the key with NaN k and v arrives in the last chunk; rows 4-8 see it
    "nan key in a later chunk": (9, 40, [0, 10, 33, 40], {35: "kv"}, None),
    # a NaN state first, then chunks whose scores are far larger (the merge weight of the NaN
    # state underflows in float32: NaN must survive a zero weight as it does in the reference)
    "nan k in the first chunk, larger max later": (9, 40, [0, 10, 33, 40], {4: "k"}, 10),
    "nan v in the first chunk, larger max later": (9, 40, [0, 10, 33, 40], {4: "v"}, 10),
    # chunks some rows see nothing of, holding NaN / inf where those rows cannot see
    "all-masked chunks": (12, 40, [0, 29, 30, 34, 40], {38: "k", 35: "v+inf"}, None),
    # Sq > total keys: rows 0-3 see no key at all (out 0, lse -inf), the last chunk only row 11
    "rows that see nothing": (12, 8, [0, 3, 8], {7: "v"}, None),
    "empty chunks": (9, 20, [0, 0, 5, 5, 5, 20, 20], {17: "kv"}, None),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(STREAM_EDGES))
def test_streaming_nonfinite_and_masked_chunks(attnlib_backend, case, dtype):
    """OnlineAttention fed in chunks gives the float64 one-shot reference's result over all the
    keys: NaN and inf exactly where the reference has them, whichever chunk brings them."""
    from attnlib.testing.reference import naive_attention, reference_attention

    sq, sk, cuts, poison, grow = STREAM_EDGES[case]
    q, k, v = qkv(rng_for("stream edges", case, dtype), 1, sq, sk, 4, 2, 16, dtype=dtype)
    if grow is not None:
        # scores of about a hundred, so that the first chunk's merge weight underflows: q and k
        # on a grid of quarters (k x 16), so that every score is exact in float32 whatever the
        # order of its sum, and the case is about the merge, not about the scores' rounding
        q, k = (np.where(x == 0, 0.25, np.round(x.astype(np.float64) * 4) / 4).astype(dtype)
                for x in (q, k))
        k[:, grow:] *= 16
    for key, what in poison.items():
        if "k" in what:
            k[:, key, 0, 3] = np.nan
        if "v" in what:
            v[:, key, 1, 5] = np.inf if "inf" in what else np.nan
    kw = dict(causal=True, scale=1.0 if grow else None)

    def run():
        return _stream(attnlib_backend, q, k, v, cuts, total_keys=sk, **kw).result(
            return_lse=True)

    res = call_or_unsupported(attnlib_backend, q.dtype, run)
    if res is None:
        return
    out, lse = res
    ref, ref_lse = reference_attention(q, k, v, **kw)
    assert np.isnan(ref).any() or np.isinf(ref).any(), "the case poisons a visible key"
    naive, naive_lse = (None, None) if q.dtype == np.float64 else naive_attention(q, k, v, **kw)
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)
