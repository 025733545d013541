"""attnlib's conformance suite, shipped inside the package so any backend can be checked.

Run it on every available backend, or on your own::

    pytest --pyargs attnlib.testing
    pytest --pyargs attnlib.testing --attnlib-backend mypkg.backend:MyBackend

The oracle (:mod:`attnlib.testing.reference`) is a naive dense float64 implementation written
independently of every backend, applying the SPEC's rules literally; it is meant for small sizes.
:mod:`attnlib.testing.tolerance` holds FlashAttention's accuracy rule.
"""

from __future__ import annotations

__all__ = ["backends_under_test"]

from attnlib.testing.plugin import backends_under_test
