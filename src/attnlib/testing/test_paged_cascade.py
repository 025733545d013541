"""Paged calls over sequences forked from shared prompts: the shared full pages are read once per
group (cascade: the group's rows over the prefix together, each sequence over its own pages,
merged from float32 partial states). Each call is checked against the float64 reference on each
sequence's tokens and against the same call with the cascade disabled, and the groups the
cascade took are checked too (so a test cannot pass because the cascade silently did not run),
in every dtype, with host queries and, where the backend has device arrays, device queries.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.testing._helpers import DTYPES, randn, unsupported_ok
from attnlib.testing.strategies import SETTINGS
from attnlib.testing.test_paged import Paged
from attnlib.testing.tolerance import as_f64

# how far the cascade may differ from the plain call (both meet the accuracy rule on their own;
# this is a few units in the last place of the output dtype)
_OUT_TOL = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


@contextmanager
def _spying():
    """The cascade on for any shared prefix (one page and up), recording the groups it takes;
    ``off()`` / ``on()`` switch it. Everything is restored on exit."""
    from attnlib import _cascade

    seen: list = []
    real, threshold = _cascade.groups_of, _cascade.MIN_PREFIX_TOKENS

    def spy(call, min_tokens):
        groups = real(call, min_tokens)
        seen.append(groups)
        return groups

    def switch(value):
        _cascade.MIN_PREFIX_TOKENS = value

    _cascade.groups_of = spy
    switch(1)
    try:
        yield SimpleNamespace(seen=seen, off=lambda: switch(None), on=lambda: switch(1))
    finally:
        _cascade.groups_of, _cascade.MIN_PREFIX_TOKENS = real, threshold


@pytest.fixture
def cascade_spy():
    with _spying() as spy:
        yield spy


def _groups(sids, groups):
    """{frozenset of sequence ids: shared pages} from the cascade's (members, pages) groups."""
    return {frozenset(sids[i] for i in m.tolist()): n for m, n in groups}


def _both(p, spy, sids, q_lens, *, packed=True, stateless=False, device=False, **kw):
    """One query call (no new tokens) with the cascade on, then off: every sequence's rows
    against the reference, on against off. Returns the groups the cascade took. ``device``:
    the query as the backend's device array (where it has them; ``paged_attention`` over a
    device pool always)."""
    import attnlib

    n = len(sids)
    if packed:
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q = randn(p.rng, (int(cu[-1]), p.hq, p.d), p.dtype)
        rows = [slice(cu[b], cu[b + 1]) for b in range(n)]
        extra = dict(cu_seqlens_q=cu)
    else:
        q = randn(p.rng, (n, q_lens[0], p.hq, p.d), p.dtype)
        rows = list(range(n))
        extra = {}

    be = attnlib.get_backend(p.backend)
    device = (stateless or device) and be.owns(p.cache.k_pages)
    q_in = be.to_device(q) if device else q

    def run():
        if stateless:
            table = p.cache.block_table(sids)
            lens = p.cache.lengths(sids).astype(np.int32)
            return attnlib.paged_attention(q_in, p.cache.k_pages, p.cache.v_pages, table, lens,
                                           return_lse=True, backend=p.backend, **extra, **kw)
        return attnlib.attention_with_paged_kvcache(q_in, p.cache, sids, return_lse=True,
                                                    backend=p.backend, **extra, **kw)

    spy.seen.clear()
    out, lse = (attnlib.to_numpy(x) for x in run())
    groups = spy.seen[-1]
    spy.off()
    plain, plain_lse = (attnlib.to_numpy(x) for x in run())
    spy.on()
    tol = _OUT_TOL[p.dtype.name]
    np.testing.assert_allclose(as_f64(out), as_f64(plain), rtol=tol, atol=tol)
    lse_tol = 1e-12 if p.dtype == np.float64 else 1e-5
    np.testing.assert_allclose(lse, plain_lse, rtol=lse_tol, atol=lse_tol)
    for b, s in enumerate(sids):
        at = rows[b]
        got_lse = lse[:, at] if packed else lse[at]
        p.check_rows(s, q[at], out[at], got_lse, **kw)
    return _groups(sids, groups)


def _forest(p):
    """Two forked prompts, a prompt forked with nothing of its own, an unrelated sequence
    (page size 4):

    - ``a`` 13 tokens (3 full pages + 2 slots), forks ``c1 c2 c3`` then 1, 6, 9 tokens of their
      own each (the shared partial page is copied on write): 3 shared full pages;
    - ``b`` 9 tokens, fork ``d1`` + 3 tokens: 2 shared full pages;
    - ``e`` 8 tokens and its fork ``e1``, nothing else: both are exactly the 2-page prefix;
    - ``u`` 10 tokens of its own.
    """
    a, b, e, u = p.new(4)
    p.append([a, b, e, u], [13, 9, 8, 10])
    c1, c2, c3, d1, e1 = p.fork(a), p.fork(a), p.fork(a), p.fork(b), p.fork(e)
    p.append([c1, c2, c3, d1], [1, 6, 9, 3])
    return SimpleNamespace(a=a, b=b, e=e, u=u, c1=c1, c2=c2, c3=c3, d1=d1, e1=e1)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forked_groups(attnlib_backend, dtype, cascade_spy):
    if unsupported_ok(attnlib_backend, dtype):
        return
    p = Paged(attnlib_backend, 48, 4, dv=11, dtype=dtype)
    f = _forest(p)
    sids = [f.a, f.c1, f.u, f.c2, f.b, f.d1, f.c3, f.e, f.e1]
    want = {frozenset([f.a, f.c1, f.c2, f.c3]): 3, frozenset([f.b, f.d1]): 2,
            frozenset([f.e, f.e1]): 2}
    # decode rows and multi-row chunks (c2: 2 rows, u: 3 rows), packed
    assert _both(p, cascade_spy, sids, [1, 1, 3, 2, 1, 1, 1, 1, 1]) == want
    # batched decode step, the query on the device where the backend has device arrays (a's
    # group in consecutive rows: one run of rows over its prefix)
    batch = [f.a, f.c1, f.c2, f.c3, f.u, f.b, f.d1, f.e, f.e1]
    assert _both(p, cascade_spy, batch, [1] * len(batch), packed=False, device=True) == want
    # appended chunks past the prefix, then a decode step, through the appending path
    cascade_spy.seen.clear()
    p.attend([f.c1, f.c3, f.d1, f.u], [3, 1, 2, 1], [3, 1, 2, 1])
    assert _groups([f.c1, f.c3, f.d1, f.u], cascade_spy.seen[-1]) == {
        frozenset([f.c1, f.c3]): 3}
    cascade_spy.seen.clear()
    p.attend([f.a, f.c1, f.c2, f.c3], [1] * 4, [1] * 4, packed=False)
    assert _groups([f.a, f.c1, f.c2, f.c3], cascade_spy.seen[-1]) == {
        frozenset([f.a, f.c1, f.c2, f.c3]): 3}


@pytest.mark.parametrize("opts", [
    dict(softcap=2.5, scale=0.3),
    dict(causal=False),
    dict(window=(40, 0)),
], ids=["softcap", "noncausal", "wide-window"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_options_that_keep_the_cascade(attnlib_backend, opts, heads, cascade_spy):

    hq, hkv = heads
    p = Paged(attnlib_backend, 48, 4, hq=hq, hkv=hkv, dv=7)
    f = _forest(p)
    sids = [f.c2, f.a, f.u, f.c1, f.e1, f.e]
    want = {frozenset([f.a, f.c1, f.c2]): 3, frozenset([f.e, f.e1]): 2}
    assert _both(p, cascade_spy, sids, [2, 1, 1, 1, 1, 1], **opts) == want
    # paged_attention (a device query over a device pool)
    assert _both(p, cascade_spy, sids, [1] * len(sids), stateless=True, **opts) == want


def test_where_the_cascade_must_not_apply(attnlib_backend, cascade_spy):
    """ALiBi (a position-dependent bias), a window that cuts the prefix for some row, a chunk
    whose first rows sit inside the prefix: those sequences run the plain call, still exact."""
    p = Paged(attnlib_backend, 48, 4, dv=9)
    f = _forest(p)
    sids = [f.a, f.c1, f.c2, f.c3, f.b, f.d1]
    slopes = (p.rng.random(p.hq) * 0.5).astype(np.float32)
    assert _both(p, cascade_spy, sids, [1] * 6, alibi_slopes=slopes) == {}
    # window (13, 0): c3 (22 tokens) and c2 (19) do not see token 0 from their last row; a (13)
    # and c1 (14) do, b and d1 too
    assert _both(p, cascade_spy, sids, [1] * 6, window=(13, 0)) == {
        frozenset([f.a, f.c1]): 3, frozenset([f.b, f.d1]): 2}
    assert _both(p, cascade_spy, sids, [1] * 6, window=(3, 0)) == {}
    # c2's chunk of 9 rows starts at position 10, inside the 12-token prefix: c2 leaves the group
    assert _both(p, cascade_spy, sids, [1, 1, 9, 1, 1, 1]) == {
        frozenset([f.a, f.c1, f.c3]): 3, frozenset([f.b, f.d1]): 2}


def test_caller_table_rewritten_in_place(attnlib_backend, cascade_spy):
    """``paged_attention`` with one host table object that the caller rewrites between calls
    (as an engine reusing its buffer does): the second call's groups and result are its own."""
    import attnlib

    p = Paged(attnlib_backend, 48, 4, dv=11)
    be = attnlib.get_backend(attnlib_backend)
    f = _forest(p)
    first, second = [f.a, f.c1, f.c2, f.c3], [f.b, f.d1, f.e, f.e1]
    table = p.cache.block_table(first)
    for sids, want in ((first, {frozenset(first): 3}),
                       (second, {frozenset([f.b, f.d1]): 2, frozenset([f.e, f.e1]): 2})):
        now = p.cache.block_table(sids)
        table[:] = -1
        table[:, :now.shape[1]] = now
        q = randn(p.rng, (4, 1, p.hq, p.d), p.dtype)
        cascade_spy.seen.clear()
        q_in = be.to_device(q) if be.owns(p.cache.k_pages) else q
        out, lse = (attnlib.to_numpy(x) for x in attnlib.paged_attention(
            q_in, p.cache.k_pages, p.cache.v_pages, table,
            p.cache.lengths(sids).astype(np.int32), return_lse=True, backend=attnlib_backend))
        assert _groups(sids, cascade_spy.seen[-1]) == want
        for b, s in enumerate(sids):
            p.check_rows(s, q[b], out[b], lse[b])


def test_shared_prefix_threshold(attnlib_backend, cascade_spy):
    """Below the threshold (in tokens) no group is taken; the result is the same."""
    from attnlib import _cascade

    p = Paged(attnlib_backend, 48, 4)
    f = _forest(p)
    sids = [f.a, f.c1, f.b, f.d1]
    _cascade.MIN_PREFIX_TOKENS = 12
    try:
        assert _both(p, cascade_spy, sids, [1] * 4) == {frozenset([f.a, f.c1]): 3}
    finally:
        _cascade.MIN_PREFIX_TOKENS = 1
    # a device table runs the plain call
    import attnlib

    be = attnlib.get_backend(attnlib_backend)
    if be.owns(p.cache.k_pages):
        q = randn(p.rng, (4, 1, p.hq, p.d), p.dtype)
        table = be.to_device(p.cache.block_table(sids))
        lens = p.cache.lengths(sids).astype(np.int32)
        cascade_spy.seen.clear()
        out = attnlib.to_numpy(attnlib.paged_attention(
            be.to_device(q), p.cache.k_pages, p.cache.v_pages, table, lens,
            backend=attnlib_backend))
        assert cascade_spy.seen[-1] == []
        for b, s in enumerate(sids):
            p.check_rows(s, q[b], out[b], None)



@settings(**SETTINGS)
@given(data=st.data())
def test_random_forks(attnlib_backend, data):
    """A prompt of random length forked a random number of times, random tokens of each fork's
    own (0 included: a fork that is exactly the prompt), an unrelated sequence, random query
    rows and options, in random order: the cascade takes exactly the members whose rows all see
    the prompt's full pages, and the result is the reference's and the plain call's."""
    draw = data.draw
    dtype = draw(st.sampled_from(["float32", "float64"]))
    if unsupported_ok(attnlib_backend, dtype):
        dtype = "float32"
    ps = draw(st.sampled_from([1, 3, 4, 16]))
    prompt = draw(st.integers(ps, 40))
    n_forks = draw(st.integers(1, 4))
    own = draw(st.lists(st.integers(0, 9), min_size=n_forks + 1, max_size=n_forks + 1))
    hq, hkv = draw(st.sampled_from([(2, 1), (4, 2), (3, 3)]))
    opts = draw(st.sampled_from([{}, dict(softcap=2.0, scale=0.2), dict(causal=False),
                                 dict(window=(60, 0)), dict(window=(20, 2)),
                                 dict(causal=False, window=(30, 3))]))
    p = Paged(attnlib_backend, prompt + sum(own) + 13, ps, hq=hq, hkv=hkv, d=8, dv=5, dtype=dtype,
              seed=draw(st.integers(0, 2**31)))
    (a,) = p.new(1)
    p.append([a], [prompt])
    family = [a] + [p.fork(a) for _ in range(n_forks)]
    grow = [(s, n) for s, n in zip(family, own) if n]
    if grow:
        p.append([s for s, _ in grow], [n for _, n in grow])
    (u,) = p.new(1)
    p.append([u], [draw(st.integers(1, 12))])
    sids = draw(st.permutations(family + [u]))
    q_lens = [draw(st.integers(1, min(3, len(p.k[s])))) for s in sids]
    n_keys = prompt // ps * ps
    wl, wr = opts.get("window", (None, None))
    members = []
    for s, n in zip(sids, q_lens):
        first_q, last_q = len(p.k[s]) - n, len(p.k[s]) - 1
        ok = s != u and (not opts.get("causal", True) or n_keys - 1 <= first_q)
        ok = ok and (wl is None or last_q <= wl) and (wr is None or n_keys - 1 - first_q <= wr)
        if ok:
            members.append(s)
    want = {frozenset(members): prompt // ps} if len(members) >= 2 else {}
    with _spying() as spy:
        assert _both(p, spy, sids, q_lens, **opts) == want
