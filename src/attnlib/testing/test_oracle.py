"""The oracle checked against a second, scalar formulation of contract §2 (no backend)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnlib.testing._helpers import qkv, rng_for
from attnlib.testing.reference import reference_attention, reference_rope


def _scalar(q, k, v, scale, causal, window, mask, softcap, slopes):
    """Row by row, key by key, exactly as contract §2 reads."""
    b_n, sq, hq, _ = q.shape
    sk, hkv, dv = v.shape[1:]
    off = sk - sq
    out = np.zeros((b_n, sq, hq, dv))
    lse = np.full((b_n, hq, sq), -np.inf)
    for b in range(b_n):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                ss, vs = [], []
                for j in range(sk):
                    if causal == "top_left" and not j <= i:
                        continue
                    if causal is True and not j <= i + off:
                        continue
                    if window is not None:
                        lo, hi = window
                        if lo is not None and lo >= 0 and not i + off - lo <= j:
                            continue
                        if hi is not None and hi >= 0 and not j <= i + off + hi:
                            continue
                    s = scale * float(np.dot(q[b, i, h], k[b, j, g]))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[h]) * abs(i + off - j)
                    if mask is not None:
                        mval = mask[b, h, i, j]
                        if mask.dtype == bool:
                            if not mval:
                                continue
                        elif mval == -np.inf:
                            continue
                        else:
                            s += float(mval)
                    ss.append(s)
                    vs.append(v[b, j, g])
                if ss:
                    m = max(ss)
                    p = np.exp(np.array(ss) - m)
                    out[b, i, h] = (p[:, None] * np.array(vs)).sum(0) / p.sum()
                    lse[b, h, i] = m + math.log(p.sum())
    return out, lse


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5)])
def test_oracle_matches_scalar_formulation(causal, sq, sk):
    rng = rng_for("oracle", causal, sq, sk)
    q, k, v = (a.astype(np.float64) for a in qkv(rng, 2, sq, sk, 4, 2, 6, 3))
    mask = np.where(rng.random((2, 4, sq, sk)) < 0.8, rng.standard_normal((2, 4, sq, sk)),
                    -np.inf)
    slopes = rng.random(4).astype(np.float32)
    kw = dict(scale=0.7, causal=causal, window=(3, 1), softcap=2.0)
    out, lse = reference_attention(q, k, v, mask=mask, alibi_slopes=slopes, **kw)
    want, want_lse = _scalar(q, k, v, 0.7, causal, (3, 1), mask, 2.0, slopes)
    assert np.allclose(out, want, atol=1e-12) and np.allclose(lse, want_lse, atol=1e-12)
    bmask = mask != -np.inf
    out, lse = reference_attention(q, k, v, mask=bmask, **kw)
    want, want_lse = _scalar(q, k, v, 0.7, causal, (3, 1), bmask, 2.0, None)
    assert np.allclose(out, want, atol=1e-12) and np.allclose(lse, want_lse, atol=1e-12)


def test_oracle_rope_matches_complex_rotation():
    """Rotate-half equals multiplying (x_t + i x_{t+r/2}) by e^{i pos theta_t}."""
    rng = rng_for("rope oracle")
    x = rng.standard_normal((1, 4, 2, 10))
    pos = np.array([[0, 3, 17, 900]])
    got = reference_rope(x, pos, theta=100.0)
    freq = 100.0 ** (-np.arange(5) * 2 / 10)
    z = (x[..., :5] + 1j * x[..., 5:]) * np.exp(1j * pos[0, :, None, None] * freq)
    assert np.allclose(got, np.concatenate([z.real, z.imag], -1), atol=1e-12)
    got = reference_rope(x, pos, theta=100.0, interleaved=True)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[0, :, None, None] * freq)
    assert np.allclose(got[..., 0::2], z.real) and np.allclose(got[..., 1::2], z.imag)
