"""contract §4, attnlib.rope, against a plain rotate-half / adjacent-pair implementation."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, call_or_unsupported, randn, rng_for
from attnlib.testing.reference import reference_rope
from attnlib.testing.tolerance import assert_rule

MAX_POS = 4096


def angle_slack(x):
    """A device may compute the angle ``pos * theta**(-2t/r)`` in float32 (base.py allows it):
    a few float32 roundings of an angle up to MAX_POS rad, times the largest |x|."""
    if x.dtype == np.float64:
        return 1e-9
    return 8 * MAX_POS * 2.0**-24 * float(np.abs(x.astype(np.float64)).max()) + 1e-5


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8, 18])
def test_rope(attnlib_backend, dtype, interleaved, rotary_dim):
    import attnlib

    rng = rng_for("rope", dtype, interleaved, rotary_dim)
    x = randn(rng, (2, 13, 3, 26), dtype)
    pos = rng.integers(0, MAX_POS, size=(2, 13))
    kw = dict(theta=10000.0, interleaved=interleaved, rotary_dim=rotary_dim)
    got = call_or_unsupported(attnlib_backend, x.dtype,
                              lambda: attnlib.rope(x, pos, backend=attnlib_backend, **kw))
    if got is None:
        return
    assert got.shape == x.shape and got.dtype == x.dtype
    ref = reference_rope(x, pos, **kw)
    naive = None
    if x.dtype != np.float64:
        # the same rotation rounded to the dtype: the budget of an exact-angle implementation
        naive = ref.astype(x.dtype).astype(np.float64)
    assert_rule(got, ref, naive, "rope", slack=angle_slack(x))
    if rotary_dim is not None:
        assert np.array_equal(got[..., rotary_dim:], x[..., rotary_dim:]), "dims >= r are copied"


def test_rope_positions_1d_and_layout(attnlib_backend):
    import attnlib

    rng = rng_for("rope 1d")
    x = randn(rng, (2, 9, 4, 12))
    pos = np.arange(100, 109)
    got = attnlib.rope(x, pos, backend=attnlib_backend)
    assert_rule(got, reference_rope(x, pos[None]), None, "rope", slack=1e-5)
    xt = x.transpose(0, 2, 1, 3)  # bhsd view
    got_t = attnlib.rope(xt, pos, layout="bhsd", backend=attnlib_backend)
    assert got_t.shape == xt.shape
    assert_rule(got_t.transpose(0, 2, 1, 3), reference_rope(x, pos[None]), None, "rope bhsd",
                slack=1e-5)


def test_rope_position_zero_is_identity_and_norm_is_kept(attnlib_backend):
    import attnlib

    x = randn(rng_for("rope id"), (1, 5, 2, 10), "float64")
    pos = np.array([[0, 1, 2, 3, 4]])
    got = call_or_unsupported(attnlib_backend, x.dtype,
                              lambda: attnlib.rope(x, pos, backend=attnlib_backend))
    if got is None:
        return
    assert np.allclose(got[:, 0], x[:, 0], atol=1e-12)
    assert np.allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), atol=1e-12)
