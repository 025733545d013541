"""The README's examples run as doctests: the online-softmax walk-through (logits [2, 4] then
[1, 5] with values [10, 20] then [30, 40], streamed, merged and one-shot) must hold."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


#: the README section whose examples need PyTorch and transformers (the `[transformers]` extra)
FRAMEWORKS = "## PyTorch, JAX and Hugging Face transformers"


def _readme_parts() -> tuple[str, str]:
    """The README without its frameworks section, and that section (with the tour's imports,
    which it uses)."""
    text = README.read_text()
    start = text.index(FRAMEWORKS)
    end = text.index("\n## ", start + 1)
    return text[:start] + text[end:], ">>> import numpy as np, attnlib\n\n" + text[start:end]


def _run_doctests(text: str, name: str) -> doctest.TestResults:
    test = doctest.DocTestParser().get_doctest(text, {}, name, str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    return runner.summarize(verbose=False)


def test_readme_doctests():
    """Every example of the README but the frameworks section (which the next test runs where
    PyTorch and transformers are installed)."""
    result = _run_doctests(_readme_parts()[0], "README.md")
    assert result.attempted >= 10, "the walk-through's examples are missing from the README"
    assert result.failed == 0


def test_readme_framework_doctests():
    """The README's PyTorch and transformers examples (CI installs both; without the
    `[transformers]` extra this skips)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    result = _run_doctests(_readme_parts()[1], "README.md (frameworks)")
    assert result.attempted >= 8, "the frameworks section's examples are missing"
    assert result.failed == 0


def test_readme_walkthrough_numbers():
    """The walk-through's claim, recomputed here without the README's own arithmetic."""
    import numpy as np

    import attnlib

    logits = np.array([2.0, 4.0, 1.0, 5.0])
    values = np.array([10.0, 20.0, 30.0, 40.0])
    p = np.exp(logits - logits.max())
    want = float(p @ values / p.sum())
    text = README.read_text()
    assert f"{want:.5f}" in text
    q = np.ones((1, 1, 1, 1))
    acc = attnlib.OnlineAttention(q, scale=1.0, backend="numpy")
    acc.update(logits[:2].reshape(1, 2, 1, 1), values[:2].reshape(1, 2, 1, 1))
    acc.update(logits[2:].reshape(1, 2, 1, 1), values[2:].reshape(1, 2, 1, 1))
    assert round(float(acc.result()[0, 0, 0, 0]), 5) == round(want, 5)


def test_readme_lists_every_environment_variable():
    """The README's table of environment variables names every variable attnlib reads
    (src/attnlib/_config.py holds them all)."""
    from attnlib import _config

    text = README.read_text()
    table = text[text.index("## Environment variables"):]
    table = table[:table.index("\n## ", 1)]
    missing = [name for name in _config.VARIABLES if f"`{name}`" not in table]
    assert not missing, missing


def test_readme_own_backend_template_passes_the_suite(tmp_path):
    """The README's own-backend template, written to ``mypkg/backend.py`` as the recipe says,
    passes the shipped suite run by the recipe's command (one test's 16 cases here; all 366
    take minutes)."""
    import subprocess
    import sys

    text = README.read_text()
    start = text.index("# mypkg/backend.py")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "backend.py").write_text(text[start:text.index("```", start)])
    recipe = "python -m pytest --pyargs attnlib.testing --attnlib-backend mypkg.backend:MyBackend"
    assert recipe in text
    cp = subprocess.run([sys.executable, *recipe.split()[1:], "-q", "-p", "no:cacheprovider",
                         "-k", "test_causal_alignment"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "16 passed" in cp.stdout, cp.stdout[-3000:]
