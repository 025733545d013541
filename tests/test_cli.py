"""`attnlib info` and `attnlib check` (and `python -m attnlib`) as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import attnlib


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlib", *args], capture_output=True,
                          text=True, timeout=600)


def test_info_lists_backends_devices_and_default():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert f"attnlib {attnlib.__version__}" in text
    for name in ("numpy", "numba", "opencl"):  # the built-ins (test plug-ins live in-process)
        assert f"  {name}" in text
    assert "default here:" in text
    assert "OpenCL devices:" in text


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
