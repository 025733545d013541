"""The transformers benchmark (bench/transformers_cpu.py) at tiny sizes, so that it cannot rot:
every implementation runs, and the generated tokens agree with eager's (main returns 1 if not)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def test_transformers_cpu_smoke():
    pytest.importorskip("transformers")  # the `[transformers]` extra (CI installs it)
    path = Path(__file__).with_name("transformers_cpu.py")
    spec = importlib.util.spec_from_file_location("transformers_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
