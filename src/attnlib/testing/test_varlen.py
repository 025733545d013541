"""contract §2, attention_varlen: each packed sequence attends only to itself."""

from __future__ import annotations

import numpy as np
import pytest

from attnlib.testing._helpers import DTYPES, call_or_unsupported, randn, rng_for
from attnlib.testing.reference import reference_varlen
from attnlib.testing.tolerance import check_attention

# per-sequence (len_q, len_k); zero-length sequences and Sq > Sk included
SEQS = [
    [(5, 9)],
    [(7, 7), (1, 13), (11, 4)],
    [(0, 5), (3, 0), (6, 6), (9, 17), (0, 0), (2, 2)],
]


def run_varlen(backend, seqs, hq, hkv, d, dv, dtype="float32", **kw):
    import attnlib

    rng = rng_for("varlen", seqs, hq, hkv, d, dv, dtype, sorted(kw))
    lq = [a for a, _ in seqs]
    lk = [b for _, b in seqs]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), hq, d), dtype)
    k = randn(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = randn(rng, (int(cu_k[-1]), hkv, dv), dtype)
    res = call_or_unsupported(
        backend, q.dtype,
        lambda: attnlib.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=backend,
                                         **kw),
    )
    if res is None:
        return None
    out, lse = res
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert lse.shape == (hq, q.shape[0]), "varlen lse is (Hq, total_q)"
    naive = naive_lse = None
    if q.dtype != np.float64:
        naive, naive_lse = reference_varlen(q, k, v, cu_q, cu_k, dtype=q.dtype, **kw)
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)
    return out, lse


@pytest.mark.parametrize("seqs_i", range(len(SEQS)))
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_varlen_causal(attnlib_backend, seqs_i, causal):
    run_varlen(attnlib_backend, SEQS[seqs_i], 4, 2, 24, 24, causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_dtypes(attnlib_backend, dtype):
    run_varlen(attnlib_backend, SEQS[2], 3, 1, 59, 33, dtype, causal=True)


def test_varlen_options(attnlib_backend):
    slopes = np.array([0.3, 0.1, 0.05, 0.2], np.float32)
    run_varlen(attnlib_backend, SEQS[1], 4, 2, 16, 8, causal=True, window=(3, 0), softcap=5.0,
               alibi_slopes=slopes, scale=0.4)


def test_varlen_alibi_per_sequence(attnlib_backend):
    slopes = np.linspace(0.01, 0.5, 3 * 2).reshape(3, 2).astype(np.float32)
    run_varlen(attnlib_backend, SEQS[1], 2, 2, 16, 16, alibi_slopes=slopes)


def test_varlen_empty_sequences_give_zero_and_neg_inf(attnlib_backend):
    out, lse = run_varlen(attnlib_backend, [(4, 0), (3, 5)], 2, 2, 8, 8)
    assert (out[:4] == 0).all() and np.isneginf(lse[:, :4]).all()
    assert not np.isnan(out).any()
