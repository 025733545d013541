"""Known gaps: conformance cases a backend is known to fail, each with its reason.

Every entry turns the matching cases into strict xfails (an unexpected pass fails the run, so the
list cannot go stale). A case matches when its backend is ``backend`` and ``match`` occurs in its
pytest node id. Third parties add their own with ``--attnlib-xfail FILE``: one gap per line,
``backend  match  reason...`` separated by whitespace (``#`` starts a comment).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest


class Gap(NamedTuple):
    backend: str
    match: str
    reason: str


#: attnlib's own known gaps (empty when every backend passes everything).
KNOWN_GAPS: list[Gap] = []


def read_gaps(path: str) -> list[Gap]:
    gaps = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 2)
            if len(parts) < 3:
                raise pytest.UsageError(f"--attnlib-xfail {path}: bad line {line!r}")
            gaps.append(Gap(*parts))
    return gaps


def apply_xfails(config: pytest.Config, items: list[pytest.Item]) -> None:
    gaps = list(KNOWN_GAPS)
    for path in config.getoption("--attnlib-xfail", default=None) or ():
        gaps.extend(read_gaps(path))
    if not gaps:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "attnlib_backend" not in callspec.params:
            continue
        backend = callspec.params["attnlib_backend"]
        for gap in gaps:
            if gap.backend == backend and gap.match in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=gap.reason, strict=True))
                break
