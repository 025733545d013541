"""attnlib's conformance suite, shipped inside the package so any backend can be checked.

Run it on every available backend, or on your own::

    pytest --pyargs attnlib.testing
    pytest --pyargs attnlib.testing --attnlib-backend mypkg.backend:MyBackend

Every case runs once per backend under test (``--attnlib-backend``, else ``ATTNLIB_TEST_BACKENDS``,
else every available backend) and calls the public API with ``backend=name``; nothing in the suite
names a particular backend, so a new backend needs no change here. A backend may refuse float64
only with ``UnsupportedError`` (and only when its ``unsupported_dtype_reason`` says so); known
gaps are strict xfails listed in :mod:`attnlib.testing.xfails`.

The oracle (:mod:`attnlib.testing.reference`) is a naive dense float64 implementation written
independently of every backend, applying the contract's rules (docs/contract.md) literally; it
is meant for small sizes.
:mod:`attnlib.testing.tolerance` holds FlashAttention's accuracy rule.
"""

from __future__ import annotations

__all__ = ["backends_under_test"]

from attnlib.testing.plugin import backends_under_test
