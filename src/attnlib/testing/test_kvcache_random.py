"""Hypothesis: random decoding sessions on a KV cache (appends, rollbacks, continuous batching,
ring wrap-around, RoPE, GQA) against the plain model of the cache."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the random cases need hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnlib.testing.strategies import SETTINGS  # noqa: E402
from attnlib.testing.test_kvcache import Pair  # noqa: E402


@st.composite
def sessions(draw):
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        max_batch=draw(st.integers(1, 3)),
        max_seq=draw(st.sampled_from([5, 8, 13])),
        ring=draw(st.booleans()),
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 3])),
        d=draw(st.sampled_from([16, 59])),
        dv=draw(st.sampled_from([16, 7])),
        dtype=draw(st.sampled_from(["float32", "float16"])),
        rope=draw(st.sampled_from([None, dict(theta=1000.0, interleaved=False, rotary_dim=None),
                                   dict(theta=10000.0, interleaved=True, rotary_dim=12)])),
        window=draw(st.sampled_from([None, (3, 0)])),
        seed=draw(st.integers(0, 2**31)),
        n_ops=draw(st.integers(2, 6)),
    )


def _start_positions(rng, p, rows, new):
    """A valid start_pos per row: an append or a rollback onto a position still held."""
    out = []
    for row in rows:
        length = int(p.model.lengths[row])
        held, _ = p.model.held(row)
        lo = int(held[0]) if held.size else length
        if not p.model.ring:
            hi = min(length, p.model.max_seq - new)
            lo = min(lo, hi)
        else:
            hi = length
        out.append(int(rng.integers(lo, hi + 1)) if hi >= lo else length)
    return np.array(out)


@settings(**SETTINGS)
@given(cfg=sessions())
def test_random_decoding_session(attnlib_backend, cfg):
    rope = None if cfg["rope"] is None else dict(cfg["rope"])
    if rope is not None and rope["rotary_dim"] is None and cfg["d"] % 2:
        rope["rotary_dim"] = cfg["d"] - 1  # an odd head dim rotates its first D - 1 dims
    p = Pair(attnlib_backend, cfg["max_batch"], cfg["max_seq"], dv=cfg["dv"], dtype=cfg["dtype"],
             ring=cfg["ring"], seed=cfg["seed"], hq=cfg["hq"], hkv=cfg["hkv"], d=cfg["d"])
    rng = np.random.default_rng(cfg["seed"])
    for _ in range(cfg["n_ops"]):
        nb = int(rng.integers(1, cfg["max_batch"] + 1))
        rows = rng.permutation(cfg["max_batch"])[:nb]
        new = int(rng.integers(1, min(cfg["max_seq"], 6) + 1))
        if not cfg["ring"] and (p.model.lengths[rows] + 0 > cfg["max_seq"] - new).all():
            new = 1
        start = _start_positions(rng, p, rows, new)
        if not cfg["ring"] and (start + new > cfg["max_seq"]).any():
            p.cache.reset()
            p.model.reset()
            start = np.zeros(nb, np.int64)
        held_after = start + new
        sq = int(rng.integers(1, int(held_after.min()) + 1))
        p.attend(sq, new=new, start_pos=start, batch_idx=rows, rope=rope,
                 window=cfg["window"], causal=bool(rng.integers(0, 4)))
