"""Hypothesis strategies for random attention problems within the oracle's size limits."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from attnlib import _config

__all__ = ["attention_problems", "varlen_problems", "SETTINGS"]

#: reproducible in CI and bounded in time; shapes stay small (the oracle is dense).
#: ATTNLIB_TEST_EXAMPLES=N asks for a deeper run (N examples per random test).
SETTINGS = dict(
    max_examples=_config.test_examples(),
    deadline=None,
    derandomize=True,
    print_blob=True,
)

_CAUSAL = st.sampled_from([False, True, "top_left"])
# head dims from a fixed odd/even set: compiled backends specialise on HEAD_DIM, and random
# sizes within it keep every example cheap after the first
_HEAD_DIMS = st.sampled_from([1, 7, 16, 33, 59, 64])
_SIDE = st.one_of(st.none(), st.integers(-1, 12))


@st.composite
def attention_problems(draw, dtypes=("float32", "float16", "bfloat16", "float64")):
    """(q, k, v, kwargs, layout) for attnlib.attention: random shapes and options."""
    from attnlib.testing._helpers import DTYPES

    b = draw(st.integers(1, 3))
    sq = draw(st.integers(0, 40))
    sk = draw(st.integers(0, 48))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    d = draw(_HEAD_DIMS)
    dv = draw(st.one_of(st.just(d), _HEAD_DIMS))
    dtype = DTYPES[draw(st.sampled_from(dtypes))]
    layout = draw(st.sampled_from(["bshd", "bhsd"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    kw = {"causal": draw(_CAUSAL)}
    if draw(st.booleans()):
        kw["window"] = (draw(_SIDE), draw(_SIDE))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 50.0))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.01, 2.0))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(hq,), (b, hq)]))
        kw["alibi_slopes"] = (rng.random(shape) * 0.5).astype(np.float32)
    mask_kind = draw(st.sampled_from([None, "bool", "additive"]))
    if mask_kind is not None:
        shape = draw(st.sampled_from([(sq, sk), (b, 1, sq, sk), (b, hq, sq, sk), (1, hq, 1, sk)]))
        keep = rng.random(shape) < 0.75
        kw["mask"] = keep if mask_kind == "bool" else np.where(
            keep, rng.standard_normal(shape), -np.inf).astype(
            draw(st.sampled_from([np.float32, np.float16, np.float64])))
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    if draw(st.booleans()):  # a strided view of the same values
        k = np.ascontiguousarray(k[:, :, ::-1])[:, :, ::-1]
    return q, k, v, kw, layout


@st.composite
def varlen_problems(draw):
    """(seqs, hq, hkv, d, dv, kwargs) for attnlib.attention_varlen."""
    n = draw(st.integers(1, 5))
    seqs = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 24)), min_size=n,
                         max_size=n))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    d = draw(_HEAD_DIMS)
    dv = draw(st.one_of(st.just(d), _HEAD_DIMS))
    kw = {"causal": draw(_CAUSAL)}
    if draw(st.booleans()):
        kw["window"] = (draw(_SIDE), draw(_SIDE))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.5, 50.0))
    return seqs, hq, hkv, d, dv, kw
