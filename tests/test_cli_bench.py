"""`attnlib bench` runs and writes well-formed JSON. It is never asked how fast anything is."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import numpy as np
import pytest

from attnlib._bench.cli import main
from attnlib._bench.shapes import Case, parse_shape

TINY = ["--size", "tiny", "--backends", "numpy", "--reps", "3", "-q", "--no-probes"]

RESULT_KEYS = {
    "task", "family", "label", "shape", "dtype", "backend", "device", "device_key", "median_s",
    "min_s", "reps", "first_call_s", "first_call_shape", "flops", "bytes", "intensity",
    "flop_per_s", "byte_per_s", "pct_roof", "bound", "vs_torch", "peak_mem_bytes", "mem_method",
    "error", "skipped",
}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_doc(doc: dict) -> None:
    assert doc["schema"] == "attnlib-bench/1"
    assert {"machine", "versions", "config", "ceilings", "results"} <= set(doc)
    for key, c in doc["ceilings"].items():
        assert set(c) == {"device", "byte_per_s", "flop_per_s", "method", "raised"}, key
        assert _positive(c["byte_per_s"]) and _positive(c["flop_per_s"])
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert r["error"] is None, r
        if r["skipped"] is not None:  # a backend that stopped below this shape: said, not timed
            assert r["median_s"] is None and r["skipped"].startswith("not run"), r
            continue
        assert r["reps"] >= 1 and r["min_s"] <= r["median_s"]
        for k in ("median_s", "min_s", "flops", "bytes", "intensity", "flop_per_s", "byte_per_s"):
            assert _positive(r[k]), (k, r)
        assert r["flop_per_s"] == pytest.approx(r["flops"] / r["median_s"])
        assert r["intensity"] == pytest.approx(r["flops"] / r["bytes"])
        assert r["peak_mem_bytes"] is None or r["peak_mem_bytes"] >= 0
        if doc["ceilings"]:
            assert r["device_key"] in doc["ceilings"]
            assert _positive(r["pct_roof"]) and r["bound"] in ("compute", "memory")
            assert r["pct_roof"] <= 100.0, r


def test_tiny_run_writes_wellformed_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = [a for a in TINY if a != "--no-probes"]  # this one measures the ceilings too
    assert main(argv + ["--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    _check_doc(doc)
    tasks = {r["task"] for r in doc["results"]}
    assert tasks == {"prefill", "decode", "softmax", "merge"}
    causal = {r["shape"]["causal"] for r in doc["results"] if r["task"] == "prefill"}
    assert causal == {False, True}
    assert {r["backend"] for r in doc["results"]} == {"numpy"}
    assert "cpu" in doc["ceilings"]
    out = capsys.readouterr().out
    assert "median" in out and "%roof" in out and "ceilings" in out
    assert out.count("=> only numpy ran this shape") == len({r["label"] for r in doc["results"]})


def test_a_roof_bounds_what_it_roofs(capsys):
    """A probe below what a case then reached (PoCL's FMA probe under its attention kernel; a
    bandwidth probe on a busy machine) is raised to the best achieved: no %roof above 100; each
    table names its fastest backend."""
    from attnlib._bench.probes import Ceiling
    from attnlib._bench.report import annotate, print_table
    from attnlib._bench.suite import Result

    big = Case(task="prefill", B=1, H=8, Hkv=8, S=2048, D=64)  # compute-bound
    small = Case(task="decode", B=1, H=8, Hkv=2, L=4096, D=64)  # memory-bound
    res = [Result(big, "opencl", "PoCL", "cl", median_s=big.flops() / 181e9),
           Result(big, "numpy", "CPU", "cl", median_s=big.flops() / 20e9),
           Result(small, "opencl", "PoCL", "cl", median_s=small.nbytes() / 49e9),
           Result(small, "numpy", "CPU", "cl", error="MemoryError: ")]
    ceil = {"cl": Ceiling("PoCL [OpenCL CPU]", 31e9, 112e9, "probe")}
    annotate(res, ceil)
    assert ceil["cl"].flop_per_s == pytest.approx(181e9)
    assert ceil["cl"].byte_per_s == pytest.approx(49e9)
    assert "112 GFLOP/s" in ceil["cl"].raised and "31 GB/s" in ceil["cl"].raised
    pct = {(r.case.task, r.backend): r.pct_roof for r in res}
    assert pct[("prefill", "opencl")] == pytest.approx(100.0)
    assert pct[("decode", "opencl")] == pytest.approx(100.0)
    assert pct[("prefill", "numpy")] == pytest.approx(100 * 20 / 181)
    print_table(res, ceil, sys.stdout)
    out = capsys.readouterr().out
    assert "=> fastest: opencl (numpy 9.05x its time)" in out
    assert "=> only opencl ran this shape" in out
    assert "raised to the best achieved" in out


def test_every_case_failed_exits_nonzero(monkeypatch, capsys):
    def no_memory(case):
        raise MemoryError("no room")

    monkeypatch.setattr("attnlib._bench.suite.make_inputs", no_memory)
    assert main(TINY + ["--tasks", "softmax"]) == 1
    assert "every case failed" in capsys.readouterr().err


def test_exact_odd_shape(tmp_path):
    path = tmp_path / "bench.json"
    argv = ["--backends", "numpy", "--reps", "2", "-q", "--no-probes", "--json", str(path),
            "--shape", "prefill=2,6,3,37,24,causal", "--shape", "decode=1,4,2,77,24"]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    _check_doc(doc)
    shapes = {r["task"]: r["shape"] for r in doc["results"]}
    assert shapes["prefill"] == {"B": 2, "H": 6, "Hkv": 3, "S": 37, "D": 24, "causal": True}
    assert shapes["decode"] == {"B": 1, "Hq": 4, "Hkv": 2, "L": 77, "D": 24}
    # decode bytes are the K and V cache read once: 2 * B * L * Hkv * D * 4
    dec = next(r for r in doc["results"] if r["task"] == "decode")
    assert dec["bytes"] == 2 * 1 * 77 * 2 * 24 * 4
    assert all(r["reps"] == 2 for r in doc["results"])


def test_causal_flops_count_visible_pairs():
    rng = np.random.default_rng(7)
    for _ in range(5):
        b, h, s, d = (int(x) for x in rng.integers(1, 40, size=4))
        case = Case(task="prefill", B=b, H=h, Hkv=h, S=s, D=d, causal=True)
        visible = int(np.tril(np.ones((s, s), dtype=bool)).sum())
        assert case.flops() == 4 * b * h * d * visible
        full = Case(task="prefill", B=b, H=h, Hkv=h, S=s, D=d)
        assert full.flops() == 4 * b * h * d * s * s


@pytest.mark.parametrize("bad", ["prefill=1,2,3", "nosuch=1,2", "decode=1,3,2,64,16",
                                 "softmax=0,4", "merge=a,b,c,d,e"])
def test_bad_shape_is_rejected(bad):
    with pytest.raises(ValueError, match="--shape"):
        parse_shape(bad, "float32")


@pytest.mark.parametrize("argv", [["--backends", "nosuch"], ["--tasks", "nosuch"],
                                  ["--dtypes", "int8"], ["--shape", "prefill=1"]])
def test_bad_option_exits_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["-q"])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(TINY + ["--plot", str(tmp_path / "r.png")]) == 2
    assert "pip install" in capsys.readouterr().err
    assert not (tmp_path / "r.png").exists()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot is the optional 'plot' extra")
    path = tmp_path / "roof.png"
    assert main(TINY + ["--tasks", "prefill,decode", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_attnlib_bench(tmp_path):
    path = tmp_path / "b.json"
    cp = subprocess.run(
        [sys.executable, "-m", "attnlib", "bench", *TINY, "--tasks", "softmax",
         "--json", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert cp.returncode == 0, cp.stderr
    assert "softmax 64x256 float32" in cp.stdout
    _check_doc(json.loads(path.read_text()))


def test_torch_side_by_side(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is optional; the comparison needs it")
    path = tmp_path / "b.json"
    argv = ["--size", "tiny", "--backends", "numpy,torch", "--tasks", "prefill,merge",
            "--causal", "yes", "--reps", "2", "-q", "--no-probes", "--json", str(path)]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    _check_doc(doc)
    ours = [r for r in doc["results"] if r["backend"] == "numpy"]
    assert ours and all(_positive(r["vs_torch"]) for r in ours)


def test_runs_without_torch(monkeypatch, tmp_path):
    """PyTorch is optional: without it the table has no torch rows and no ratios, and no error."""
    import attnlib
    import attnlib._bench.cli as cli

    monkeypatch.setattr(cli, "_torch_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    # the default backend list, kept to numpy so that no JIT compile slows the test down
    monkeypatch.setattr(attnlib, "available_backends", lambda: ["numpy"])
    path = tmp_path / "b.json"
    argv = ["--size", "tiny", "--tasks", "prefill", "--causal", "no", "--reps", "2", "-q",
            "--no-probes", "--json", str(path)]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    _check_doc(doc)
    assert {r["backend"] for r in doc["results"]} == {"numpy"}
    assert all(r["vs_torch"] is None for r in doc["results"])
    with pytest.raises(SystemExit):
        main(["--backends", "torch", "-q"])


class _CompilingRunner:
    """A runner whose first call of a task compiles for ``compile_s`` (like numba on a cold
    cache) and whose calls then take ``call_s``; it records the order of what happened."""

    device_key, device_label, host_memory = "cpu", "CPU", False

    def __init__(self, name: str, compile_s: float, call_s: float, log: list) -> None:
        self.name, self.compile_s, self.call_s, self.log = name, compile_s, call_s, log
        self.compiled: set[str] = set()
        self.shapes_called: set = set()

    def prepare(self, case, inputs):
        import time

        def fn():
            first_of_task = case.family() not in self.compiled
            self.compiled.add(case.family())
            first_of_shape = case not in self.shapes_called
            self.shapes_called.add(case)
            self.log.append((self.name, "compile" if first_of_task else "call", case.label(),
                             first_of_shape))
            time.sleep(self.compile_s if first_of_task else self.call_s)
            return None

        return fn, lambda _result: None


def test_compiles_happen_before_the_timed_slots_and_every_backend_is_in_every_table(
        monkeypatch, tmp_path, capsys):
    """A backend that compiles for longer than its time slot (numba on a cold cache) still
    appears, timed, in every table; the first-call column is the first call of that shape."""
    import attnlib._bench.cli as cli

    log: list = []
    slow = _CompilingRunner("slowjit", compile_s=1.5, call_s=0.002, log=log)
    fast = _CompilingRunner("nojit", compile_s=0.0, call_s=0.001, log=log)
    monkeypatch.setattr(cli, "_make_runners", lambda names, progress: [slow, fast])
    monkeypatch.setattr(cli, "_pick_backends", lambda args, parser: ["slowjit", "nojit"])
    path = tmp_path / "b.json"
    # a budget far below the compile times: before, the compile ate slowjit's slots
    argv = ["--size", "tiny", "--tasks", "prefill,softmax", "--causal", "no", "--budget", "2",
            "--no-probes", "--json", str(path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    doc = json.loads(path.read_text())
    # every compile came before any timed call
    kinds = [kind for name, kind, _, _ in log if name == "slowjit"]
    assert kinds.count("compile") == 2
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "compile")
    # the progress says so, before the timing starts
    err = captured.err
    assert "warm-up, not timed" in err
    assert err.index("warm-up, not timed") < err.index("timing")
    assert doc["config"]["warm_up_s"]["slowjit"] >= 2 * 1.5
    # every table (case) has a row for both backends, and slowjit's are timed calls
    cases = {r["label"] for r in doc["results"]}
    assert len(cases) >= 2
    for label in cases:
        rows = {r["backend"]: r for r in doc["results"] if r["label"] == label}
        assert set(rows) == {"slowjit", "nojit"}, label
        timed = rows["slowjit"]
        if timed["skipped"] is None:
            assert timed["median_s"] < 0.5, timed  # never a compile
            # the first call of that shape, not a compile on another shape
            dims = " ".join(f"{k}={v}" for k, v in timed["shape"].items() if k != "causal")
            assert timed["first_call_shape"] == dims
            assert timed["first_call_s"] < 0.5
            first = next(e for e in log if e[0] == "slowjit" and e[2] == label)
            assert first[1:] == ("call", label, True)  # its first call ever was a timed one
    assert any(r["backend"] == "slowjit" and r["skipped"] is None for r in doc["results"])
    assert "compile / kernel build before timing" in captured.out


def test_memory_by_default_leaves_out_the_slow_backends(monkeypatch):
    from attnlib._bench.memory import default_memory_backends

    run, slow = default_memory_backends(["numba", "numpy", "torch"])
    assert run == ["numba", "torch"] and slow == ["numpy"]


def test_memory_child_progress_is_passed_on(monkeypatch):
    """The --memory subprocess's stderr lines reach the progress output while it runs, with a
    heartbeat while it is quiet, and its JSON line becomes the row."""
    import attnlib._bench.memory as memory

    monkeypatch.setattr(memory, "HEARTBEAT_S", 0.2)
    script = ("import sys, time, json; print('compiled and warm in 0.0 s', file=sys.stderr, "
              "flush=True); time.sleep(0.7); print(json.dumps({'backend': 'x', 'time_s': 0.7}))")
    lines: list[str] = []
    row = memory._run_child("x", [sys.executable, "-c", script], 60, lines.append)
    assert row == {"backend": "x", "time_s": 0.7}
    assert "  x: compiled and warm in 0.0 s" in lines
    assert any("still running" in line for line in lines)
    assert lines[-1] == "  x: done in 0.7 s"


def test_gpu_bench_without_cuda_torch_runs_attnlib_rows(monkeypatch, capsys):
    """``python bench/gpu/run.py`` without a CUDA PyTorch (none at all, or a CPU build) runs
    attnlib's rows alone and says why the anchors are missing, as ``--no-torch`` does."""
    import importlib.util
    from pathlib import Path

    import attnlib

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "run.py"
    spec = importlib.util.spec_from_file_location("attnlib_gpu_bench", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    calls = []
    monkeypatch.setattr(run, "prefill", lambda dtype, reps, with_torch, rows, portable=False:
                        calls.append(with_torch))

    class _Opencl:
        def info(self):
            return {}

    monkeypatch.setattr(attnlib, "get_backend", lambda name: _Opencl())
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert run.torch_cuda_missing() == "PyTorch is not installed"
    assert run.main(["--only", "prefill32"]) == 0
    assert calls == [False]
    assert "PyTorch is not installed: attnlib's rows only" in capsys.readouterr().out
    cpu_build = types.SimpleNamespace(  # what a CPU wheel of PyTorch answers
        __version__="2.13.0+cpu", version=types.SimpleNamespace(cuda=None),
        cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", cpu_build)
    assert run.torch_cuda_missing() == "PyTorch 2.13.0+cpu is built without CUDA"
