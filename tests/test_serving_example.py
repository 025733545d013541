"""examples/serving.py at tiny sizes on the numpy backend: 16 requests and their forks served with
continuous batching and rollback; every page back in the pool; a fork and a rolled-back sequence
recomputed from their tokens alone give their last step's logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serving.py"


def test_serving_example_tiny(capsys):
    spec = importlib.util.spec_from_file_location("serving_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    done, free, worst = mod.main(["--tiny", "--backend", "numpy"])
    out = capsys.readouterr().out
    assert "tokens/s" in out
    names = {s.name for s in done}
    assert {f"r{i}" for i in range(16)} <= names
    assert sum(n.endswith("-fork") for n in names) == 4
    assert any(s.rolled_back for s in done)
    assert all(f == 256 for f in free)
    assert worst < 1e-4
