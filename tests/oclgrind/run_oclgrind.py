"""Run the OpenCL cases (cases.py) under Oclgrind with its checks on; exit non-zero on any report.

    python tests/oclgrind/run_oclgrind.py            # about a minute or two on 2 cores

Oclgrind checks out-of-bounds accesses always, and here also data races
(OCLGRIND_DATA_RACES), uses of uninitialised memory (OCLGRIND_UNINITIALIZED) and API misuse
(OCLGRIND_CHECK_API). It prints its reports on stderr and still exits 0, so this script reads that
output: every report block fails the run, except the harmless ``clGetDeviceInfo ...
CL_INVALID_VALUE`` API reports pyopencl causes while it queries device properties.

Kernels are built with -cl-opt-disable (OCLGRIND_BUILD_OPTIONS): the uninitialised-value plugin
cannot interpret LLVM's ``freeze`` instruction, which optimised builds contain; pyopencl's binary
cache is bypassed so that those options apply.

ATTNLIB_OCLGRIND_KEEP_BUFFERS=1 makes cases.py keep every buffer alive: a buffer that reuses a
released buffer's number keeps that buffer's shadow memory in Oclgrind's uninitialised-value
plugin, and reads past its size were reported as uninitialised (stale_shadow.py shows it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT_LINE = re.compile(
    r"Oclgrind - |OCLGRIND|Invalid (read|write)|[Uu]ninitiali[sz]ed|data race|divergence|"
    r"out of bounds|^\s*Kernel:",
)


def oclgrind_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYOPENCL_CTX="oclgrind",
        PYOPENCL_NO_CACHE="1",
        OCLGRIND_DATA_RACES="1",
        OCLGRIND_UNINITIALIZED="1",
        OCLGRIND_CHECK_API="1",
        OCLGRIND_BUILD_OPTIONS="-cl-opt-disable",
        PYTHONWARNINGS="ignore",
        ATTNLIB_OCLGRIND_KEEP_BUFFERS="1",  # see cases.keep_buffers_alive
    )
    return env


def report_blocks(stderr: str) -> list[str]:
    """Oclgrind's reports, each whole: a report starts at an unindented line, and its details
    (kernel, entities, ``At line`` locations) are indented lines, with blank lines between them
    inside one report (a race report names two entities, each with its location). Blocks that
    hold none of Oclgrind's report lines (other stderr output) are dropped."""
    blocks: list[list[str]] = []
    for line in stderr.splitlines():
        if line.strip() and not line[0].isspace():
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    texts = ["\n".join(b).strip("\n") for b in blocks]
    return [b for b in texts if any(REPORT_LINE.search(line) for line in b.splitlines())]


def summary_key(block: str) -> str:
    """One report's kind for the summary: its first line (less the address), the kernel, and
    every source location it names."""
    lines = [ln.strip() for ln in block.splitlines()]
    where = "; ".join(ln.rstrip(":") for ln in lines if ln.startswith("At line"))
    kernel = next((ln for ln in lines if ln.startswith("Kernel:")), "")
    return f"{lines[0].split(' at ')[0].split(' address')[0]} | {kernel} | {where}"


def is_harmless(block: str) -> bool:
    """pyopencl's own device queries: an API report about clGetDeviceInfo, not a kernel."""
    return (
        "runtime error detected" in block
        and "clGetDeviceInfo" in block
        and "CL_INVALID_VALUE" in block
        and "Kernel:" not in block
    )


def main() -> int:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / "cases.py"), *sys.argv[1:]],
        env=oclgrind_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout, end="")
    blocks = report_blocks(proc.stderr)
    bad = [b for b in blocks if not is_harmless(b)]
    kinds: dict[str, int] = {}
    for b in bad:
        key = summary_key(b)
        if key not in kinds:
            print(b + "\n", file=sys.stderr)  # the first report of each kind in full
        kinds[key] = kinds.get(key, 0) + 1
    for key, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d} x {key}", file=sys.stderr)
    if "device: Oclgrind" not in proc.stdout:
        print("run_oclgrind: the cases did not run on the Oclgrind device", file=sys.stderr)
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        print(f"run_oclgrind: cases.py exited with {proc.returncode}", file=sys.stderr)
        return 1
    print(
        f"run_oclgrind: {len(bad)} report(s) about our kernels, "
        f"{len(blocks) - len(bad)} harmless pyopencl API report(s) ignored, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
