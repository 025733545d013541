"""Hypothesis: random shapes and options within limits, against the oracle."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the random cases need hypothesis")

from hypothesis import given, settings  # noqa: E402

from attnlib.testing._helpers import check_dense  # noqa: E402
from attnlib.testing.strategies import SETTINGS, attention_problems, varlen_problems  # noqa: E402
from attnlib.testing.test_varlen import run_varlen  # noqa: E402


@settings(**SETTINGS)
@given(problem=attention_problems())
def test_random_attention(attnlib_backend, problem):
    q, k, v, kw, layout = problem
    check_dense(attnlib_backend, q, k, v, layout=layout, **kw)


@settings(**SETTINGS)
@given(problem=varlen_problems())
def test_random_varlen(attnlib_backend, problem):
    seqs, hq, hkv, d, dv, kw = problem
    run_varlen(attnlib_backend, seqs, hq, hkv, d, dv, **kw)
