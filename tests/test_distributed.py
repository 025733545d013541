"""attnlib.distributed under MPI: 1, 2 and 4 ranks (oversubscribed on a small machine) on every
backend: ring and Ulysses attention, merge_across, decoding over sharded KV caches, and, where
the opencl backend runs, the same calls on device arrays of each rank's device (PoCL on a CPU).
Each rank's result is judged against the float64 reference on the whole sequence by the contract's
accuracy rule, lse included; a bad call on one rank raises the same error on every rank.

One ``mpiexec`` launch per rank count runs every case of tests/distributed_worker.py and reports
per case; a launch that hangs is killed after ``TIMEOUT`` seconds and its missing cases fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="attnlib.distributed needs mpi4py: pip install -e '.[mpi]'")

import attnlib  # noqa: E402
from attnlib import _config  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RANKS = (1, 2, 4)
TIMEOUT = 600

_spec = importlib.util.spec_from_file_location("distributed_worker", HERE / "distributed_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

BACKENDS = _config.env_test_backends() or attnlib.available_backends()
CASES = worker.case_ids(BACKENDS)


def mpiexec() -> str:
    """The mpiexec of the MPI that mpi4py was installed with (the pip ``mpich`` package puts it
    beside the interpreter), else the first on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpi4py is installed but no mpiexec was found; pip install -e '.[mpi]'")
    return found


def launch(ranks: int, script: Path, *args: str, timeout: int = TIMEOUT):
    """Run ``script`` on ``ranks`` MPI ranks; kill the whole process group when it hangs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               # oversubscribed ranks that wait in MPI yield the core instead of spinning on it
               MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[killed after {timeout} s: the launch hung]"
    return proc.returncode, output


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(ranks)``: {case id: failures} of one launch per rank count (run on first use)."""
    done: dict[int, tuple[dict, str]] = {}

    def get(ranks: int) -> tuple[dict, str]:
        if ranks not in done:
            out = tmp_path_factory.mktemp(f"ranks{ranks}") / "cases.jsonl"
            rc, output = launch(ranks, HERE / "distributed_worker.py", str(out),
                                ",".join(BACKENDS))
            lines = out.read_text().splitlines() if out.exists() else []
            reports = {r["id"]: r["failures"] for r in map(json.loads, lines)}
            done[ranks] = reports, f"mpiexec exit {rc}; output tail:\n{output[-3000:]}"
        return done[ranks]

    return get


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", CASES)
def test_distributed(results, case, ranks):
    reports, how = results(ranks)
    assert case in reports, f"{case} was not reported on {ranks} ranks. {how}"
    assert not reports[case], "\n".join(reports[case])


def test_distributed_decode_example():
    rc, output = launch(2, ROOT / "examples" / "distributed_decode.py", timeout=300)
    assert rc == 0, output[-3000:]
    assert "max |error|" in output, output[-3000:]
