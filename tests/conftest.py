"""Our own test session: the shipped conformance plugin drives every backend.

The plugin normally arrives through its ``pytest11`` entry point; when that is not there (attnlib
not installed as a distribution, or plugin autoload disabled) it is loaded from here instead.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points


def _entry_point_loads_plugin() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "attnlib.testing.plugin" for ep in entry_points(group="pytest11"))


if not _entry_point_loads_plugin():
    pytest_plugins = ["attnlib.testing.plugin"]
