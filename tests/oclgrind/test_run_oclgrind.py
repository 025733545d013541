"""The Oclgrind step's reading of Oclgrind's stderr (run_oclgrind.report_blocks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_oclgrind  # noqa: E402

sys.path.pop(0)

# as Oclgrind prints them: blank (tab-only) lines inside a report, an empty line after it
STDERR = """some other output
Read-write data race at local memory address 0x2000000000004
\tKernel: softmax_rows
\t
\tFirst entity:  Global(1,0,0) Local(1,0,0) Group(0,0,0)
\t  store float %32, float addrspace(3)* %arrayidx23, align 4, !dbg !118
\tAt line 129 (column 16) of input.cl:
\t  red_l[lid] = l;
\t
\tSecond entity: Global(0,0,0) Local(0,0,0) Group(0,0,0)
\t  %55 = load float, float addrspace(3)* %arrayidx54, align 4, !dbg !170
\tAt line 138 (column 42) of input.cl:
\t  if (m2 != NEG_INF) ll += red_l[lid + off] * exp(m2 - mm);
\t

Oclgrind - OpenCL runtime error detected
\tFunction: clGetDeviceInfo
\tError:    CL_INVALID_VALUE

Invalid write of size 4 at global memory address 0x1000000000018
\tKernel: softmax_rows
\tEntity: Global(320,0,0) Local(0,0,0) Group(5,0,0)
\tAt line 148 (column 119) of input.cl:
\t  out[row + 1] = 0;
"""


def test_reports_are_read_whole_with_their_locations():
    blocks = run_oclgrind.report_blocks(STDERR)
    assert len(blocks) == 3
    race, api, write = blocks
    assert run_oclgrind.is_harmless(api) and not run_oclgrind.is_harmless(race)
    assert run_oclgrind.summary_key(race) == (
        "Read-write data race | Kernel: softmax_rows | At line 129 (column 16) of input.cl; "
        "At line 138 (column 42) of input.cl")
    assert run_oclgrind.summary_key(write) == (
        "Invalid write of size 4 | Kernel: softmax_rows | At line 148 (column 119) of input.cl")
