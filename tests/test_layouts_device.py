"""layout="bhsd" with each backend's own arrays: results come back contiguous, in the caller's
layout, on the caller's side (device arrays stay on the device), and equal the reference."""

from __future__ import annotations

import numpy as np

import attnlib
from attnlib.testing import reference


def _rng():
    return np.random.default_rng(20261129)


def test_bhsd_attention_and_rope(attnlib_backend):
    rng = _rng()
    q = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)  # (B, H, S, D)
    k = rng.standard_normal((2, 3, 11, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 11, 5)).astype(np.float32)
    dev = [attnlib.to_device(x, backend=attnlib_backend) for x in (q, k, v)]
    ref = reference.reference_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
                                        causal=True)[0].transpose(0, 2, 1, 3)

    out = attnlib.attention(*dev, causal=True, layout="bhsd", backend=attnlib_backend)
    assert type(out) is type(dev[0])
    got = attnlib.to_numpy(out)
    assert got.shape == (2, 3, 7, 5) and got.flags.c_contiguous
    np.testing.assert_allclose(got, ref, atol=2e-5)

    rot = attnlib.to_numpy(attnlib.rope(dev[0], np.arange(7), layout="bhsd",
                                        backend=attnlib_backend))
    want = reference.reference_rope(q.transpose(0, 2, 1, 3), np.arange(7)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(rot, want, atol=2e-5)


def test_bhsd_merge_of_device_outputs(attnlib_backend):
    """merge_states in bhsd on the backend's own arrays equals attention over all keys."""
    rng = _rng()
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    to = lambda x: attnlib.to_device(np.ascontiguousarray(x), backend=attnlib_backend)  # noqa: E731
    outs, lses = [], []
    for sl in (slice(0, 3), slice(3, 9)):
        o, lse = attnlib.attention(to(q), to(k[:, :, sl]), to(v[:, :, sl]), layout="bhsd",
                                   return_lse=True, backend=attnlib_backend)
        outs.append(o)
        lses.append(lse)
    merged, lse = attnlib.merge_states(outs, lses, layout="bhsd", backend=attnlib_backend)
    full, full_lse = attnlib.attention(q, k, v, layout="bhsd", return_lse=True, backend="numpy")
    np.testing.assert_allclose(attnlib.to_numpy(merged), full, atol=2e-5)
    np.testing.assert_allclose(attnlib.to_numpy(lse), full_lse, atol=2e-5)
