"""`attnlib info` and `attnlib check` (and `python -m attnlib`) as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import attnlib
from attnlib.testing.reference import reference_attention


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlib", *args], capture_output=True,
                          text=True, timeout=600)


def test_info_lists_backends_devices_and_default():
    res = _run("info", "--why")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert f"attnlib {attnlib.__version__}" in text
    for name in ("numpy", "numba", "opencl"):  # the built-ins (test plug-ins live in-process)
        assert f"  {name}" in text
    assert "default here:" in text
    assert "OpenCL devices:" in text
    # --why: each typical call names the kernel family that runs it and why the others did not
    families = _section(text, "OpenCL kernel families for typical calls")
    if "opencl" in attnlib.available_backends():
        runs = [line for line in families if line.strip().endswith("runs it")]
        assert len(runs) == 4 and all("skipped: " in line for line in families
                                      if line.startswith("    ") and line not in runs)


def test_check_runs_the_suite_and_fails_for_unknown_backends():
    res = _run("check", "--backend", "numpy")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "failed" not in res.stdout
    bad = _run("check", "--backend", "no-such-backend")
    assert bad.returncode != 0


def test_no_command_is_a_usage_error():
    res = _run()
    assert res.returncode == 2
    assert "usage" in res.stderr.lower()


def _env_run(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "attnlib", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def _section(text: str, header: str) -> list[str]:
    """The indented lines that follow ``header`` up to the next unindented line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        out.append(line)
    return out


def test_info_reports_a_bad_attnlib_backend_and_does_not_fail():
    res = _env_run({"ATTNLIB_BACKEND": "bogus"}, "info")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    default = next(line for line in res.stdout.splitlines() if line.startswith("default here:"))
    assert "ATTNLIB_BACKEND='bogus'" in default and "not a known backend" in default
    for name in ("numpy", "numba", "opencl"):
        assert name in default  # the valid names are listed
    assert "OpenCL devices:" in res.stdout  # the rest of the report still comes


def test_info_names_the_variable_that_chose_the_default():
    res = _env_run({"ATTNLIB_BACKEND": "numpy"}, "info")
    assert res.returncode == 0, res.stderr
    assert "default here: numpy (chosen by ATTNLIB_BACKEND=numpy)" in res.stdout


def test_info_lists_backends_in_autos_order():
    env = {k: v for k, v in os.environ.items() if k != "ATTNLIB_BACKEND"}
    order = subprocess.run(
        [sys.executable, "-c", "import attnlib; print(','.join(attnlib.available_backends()))"],
        capture_output=True, text=True, timeout=600, env=env, check=True).stdout.strip()
    res = subprocess.run([sys.executable, "-m", "attnlib", "info"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in _section(res.stdout, "backends, in the order auto tries")
            if not line.startswith("   ")]  # backend rows; their info() is indented deeper
    shown = [r[0] for r in rows if r[1] == "available"]
    assert shown == order.split(","), (shown, order)
    assert f"default here: {shown[0]} (chosen by auto)" in res.stdout


def test_info_prints_opencl_device_types_as_words():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    lines = _section(res.stdout, "OpenCL devices:")
    assert lines
    words = {"GPU", "CPU", "accelerator", "custom"}
    for line in lines:
        if line.strip().startswith("("):  # no pyopencl / no platform: said in words
            continue
        cols = line.split(" | ")
        if cols[1].startswith("no device"):  # a platform that lists no device
            continue
        kind = cols[2]
        assert set(kind.split(", ")) <= words, line
        assert "_is_bitfield" not in line and "ALL" not in kind


def test_a_bad_attnlib_backend_raises_errors_that_name_it(monkeypatch):
    import numpy as np

    from attnlib import registry
    from attnlib.errors import ArgumentError, BackendUnavailableError

    rng = np.random.default_rng(13)
    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    monkeypatch.setenv("ATTNLIB_BACKEND", "bogus")
    with pytest.raises(ArgumentError, match=r"ATTNLIB_BACKEND='bogus'.*numpy.*numba.*opencl"):
        attnlib.attention(q, q, q)
    with pytest.raises(ArgumentError, match="ATTNLIB_BACKEND"):
        attnlib.softmax(q)
    with pytest.raises(ArgumentError, match="ATTNLIB_BACKEND"):
        attnlib.to_device(q)
    # an explicit choice still wins over the variable, and its own error does not blame it
    out = attnlib.attention(q, q, q, backend="numpy")
    ref = reference_attention(q, q, q)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ArgumentError) as err:
        attnlib.attention(q, q, q, backend="bogus2")
    assert "ATTNLIB_BACKEND" not in str(err.value)

    class Absent(registry.get_backend("numpy").__class__):
        @classmethod
        def is_available(cls):
            return False

    attnlib.register_backend("absent-here", Absent)
    try:
        monkeypatch.setenv("ATTNLIB_BACKEND", "absent-here")
        with pytest.raises(BackendUnavailableError, match="ATTNLIB_BACKEND='absent-here'"):
            attnlib.attention(q, q, q)
    finally:
        registry._registered.pop("absent-here", None)
        registry._classes.pop("absent-here", None)


def test_first_compile_says_so_once(monkeypatch, capsys):
    """A build that outlasts the threshold prints one line on stderr, once per kind; a fast one
    (a cache hit) prints nothing."""
    import time

    from attnlib import _notice

    monkeypatch.setattr(_notice, "_said", set())
    with _notice.if_slow("k", "fast", after_s=5.0):
        pass
    for _ in range(2):
        with _notice.if_slow("k", "slow build", after_s=0.01):
            time.sleep(0.2)
    assert capsys.readouterr().err == "attnlib: slow build\n"
