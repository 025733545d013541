"""attnlib.integrations.torch: the custom op ``attnlib::attention`` against the float64 reference
(random data, odd sizes, GQA, masks, windows, softcap, sinks), its fake implementation, and a
module that calls it compiled by ``torch.compile`` with ``fullgraph=True`` (a graph break
fails)."""

# ruff: noqa: E402  (the optional packages are asked for before the imports that need them)
from __future__ import annotations

import numpy as np
import pytest

# optional: the `torch` extra (CI installs it); without it these skip
torch = pytest.importorskip("torch")

from attnlib.integrations.torch import attention
from attnlib.testing.reference import naive_attention, reference_attention
from attnlib.testing.tolerance import assert_rule


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_op_matches_reference(backend):
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 6, 5, 11), dtype=np.float32)    # (B, Hq, Sq, D)
    k = rng.standard_normal((2, 3, 9, 11), dtype=np.float32)    # (B, Hkv, Sk, D)
    v = rng.standard_normal((2, 3, 9, 7), dtype=np.float32)
    mask = rng.random((2, 1, 5, 9)) < 0.8
    sinks = rng.standard_normal(6, dtype=np.float32)
    kw = dict(scale=0.37, causal=True, window=(4, None), softcap=2.5)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    got = attention(tq, tk, tv, mask=torch.from_numpy(mask), sinks=torch.from_numpy(sinks),
                    backend=backend, **kw)
    assert isinstance(got, torch.Tensor) and got.shape == (2, 6, 5, 7)
    rk = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    ref, _ = reference_attention(q, *rk, mask=mask, sinks=sinks, layout="bhsd", **kw)
    naive, _ = naive_attention(q, *rk, mask=mask, sinks=sinks, layout="bhsd", **kw)
    assert_rule(got.numpy(), ref, naive)
    # (B, S, H, D) storage read through transposed views, and layout="bshd"
    got_t = attention(*(torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
                        for a in (q, k, v)), mask=torch.from_numpy(mask),
                      sinks=torch.from_numpy(sinks), layout="bshd", backend=backend, **kw)
    assert np.array_equal(got_t.numpy(), got.numpy().transpose(0, 2, 1, 3))


def test_fake_and_compile():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(k),
                         causal=True)
    assert fake.shape == (1, 4, 3, 8) and fake.dtype == torch.float32

    class Block(torch.nn.Module):
        def forward(self, x, kv):
            return attention(x * 2.0, kv, kv + 1.0, causal=True, backend="numba").sum(-1)

    block = Block()
    explained = torch._dynamo.explain(block)(q, k)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(q, k), block(q, k))
