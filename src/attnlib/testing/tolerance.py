"""FlashAttention's accuracy rule and the comparisons the suite makes with it.

docs/contract.md §1: ``max|out - ref64| <= 2 * max|naive_same_dtype - ref64| + 1e-5``. Non-finite
reference entries must match exactly (NaN where the reference has NaN, the same infinities);
everything else is judged by the rule over all finite entries together.
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_f64", "budget", "assert_rule", "assert_same_nonfinite", "check_attention"]


def as_f64(x) -> np.ndarray:
    """Any array the API returned (numpy or a device array) as a float64 numpy array."""
    if not isinstance(x, np.ndarray):
        import attnlib

        x = attnlib.to_numpy(x)
    return np.asarray(x).astype(np.float64)


def _maxdiff(a, b, finite) -> float:
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(a[finite] - b[finite])))


def assert_same_nonfinite(got, ref, what="out") -> None:
    got, ref = as_f64(got), as_f64(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    bad = np.isnan(got) != np.isnan(ref)
    assert not bad.any(), (
        f"{what}: NaN pattern differs from the reference at {np.argwhere(bad)[:5].tolist()} "
        f"({int(np.isnan(got).sum())} NaN here, {int(np.isnan(ref).sum())} in the reference)"
    )
    infs = np.isinf(ref) | np.isinf(got)
    assert np.array_equal(got[infs], ref[infs]), (
        f"{what}: infinities differ from the reference at {np.argwhere(infs)[:5].tolist()}"
    )


def budget(naive, ref, slack: float = 1e-5) -> float:
    """The rule's right-hand side: 2 * max|naive_same_dtype - ref64| + slack."""
    naive, ref = as_f64(naive), as_f64(ref)
    return 2.0 * _maxdiff(naive, ref, np.isfinite(ref) & np.isfinite(naive)) + slack


def assert_rule(got, ref, naive=None, what="out", slack: float = 1e-5) -> None:
    """Assert the accuracy rule (``naive=None``: the float64 case, budget = slack)."""
    got, ref = as_f64(got), as_f64(ref)
    assert_same_nonfinite(got, ref, what)
    tol = slack if naive is None else budget(naive, ref, slack)
    finite = np.isfinite(ref)
    err = _maxdiff(got, ref, finite)
    assert err <= tol, f"{what}: max|got - ref64| = {err:.3g} > allowed {tol:.3g}"


def unit_roundoff(dtype) -> float:
    """Half the machine epsilon of ``dtype`` (float16: 2**-11, bfloat16: 2**-8)."""
    import ml_dtypes

    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def check_attention(out, lse, ref, naive, ref_lse=None, naive_lse=None) -> None:
    """Judge ``out`` by the accuracy rule, and ``lse`` by the same rule with a slack of one
    rounding of the input dtype relative to its size: the lse is a float32 log of a sum of
    exponentials of scores that already carry the inputs' rounding, and with few keys the naive
    run's own error is too small a yardstick for it."""
    if not isinstance(out, np.ndarray):
        import attnlib

        out = attnlib.to_numpy(out)
    u = max(1e-5, unit_roundoff(out.dtype))
    assert_rule(out, ref, naive, "out")
    if lse is not None and ref_lse is not None:
        lref = as_f64(ref_lse)
        finite = np.isfinite(lref)
        size = 1.0 + (float(np.max(np.abs(lref[finite]))) if finite.any() else 0.0)
        assert_rule(lse, lref, naive_lse, "lse", slack=u * size)
