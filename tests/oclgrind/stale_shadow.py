"""Oclgrind's stale shadow memory, shown with pyopencl alone (no attnlib kernel).

    python tests/oclgrind/stale_shadow.py     # a few seconds; prints the reports of each mode

Oclgrind hands a released buffer's number to the next buffer made, and its
uninitialised-value plugin keeps the released buffer's shadow under that number: it has no
release handler, and makes a shadow (of the buffer's size) only for a number that has none. A
buffer that takes the number of a smaller one keeps the smaller shadow: stores past that size
are not recorded, loads there read as uninitialised. Oclgrind 19.10 (pyopencl[oclgrind]) and
the upstream tree of 2026-03 behave alike.

Modes (one process each, under run_oclgrind's environment):
  stale     a 128-byte buffer is zeroed by a kernel (its shadow: 128 bytes) and released; a
            224-byte buffer takes its number, is zeroed by a kernel and copied by a kernel:
            24 reports, one per 4-byte word at bytes 128..223.
  nokernel  the 128-byte buffer never reaches a kernel (no shadow made): none.
  hostwrite as stale, and a host write of zeros after the zeroing kernel (a host write makes a
            new shadow of its own size): none.
cases.py keeps every buffer alive under Oclgrind (keep_buffers_alive) for this reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

MODES = ("stale", "nokernel", "hostwrite")
SOURCE = """
__kernel void zero(__global uint *p) { p[get_global_id(0)] = 0; }
__kernel void copy(__global const uint *s, __global uint *d)
{ d[get_global_id(0)] = s[get_global_id(0)]; }
__kernel void where(__global const uint *p, __global ulong *o) { o[0] = (ulong)p; }
"""


def child(mode: str) -> None:
    import pyopencl as cl

    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    prg = cl.Program(ctx, SOURCE).build()
    mf = cl.mem_flags
    probe = cl.Buffer(ctx, mf.READ_WRITE, 8)

    def number(buf):  # Oclgrind's address of a buffer: its number in the top 16 bits
        prg.where(queue, (1,), None, buf, probe)
        host = np.zeros(1, np.uint64)
        cl.enqueue_copy(queue, host, probe)
        return int(host[0]) >> 48

    small = cl.Buffer(ctx, mf.READ_WRITE, 128)
    if mode != "nokernel":
        prg.zero(queue, (32,), None, small)
        print(f"  128-byte buffer: number {number(small)}")
    queue.finish()
    small.release()
    big = cl.Buffer(ctx, mf.READ_WRITE, 224)
    prg.zero(queue, (56,), None, big)  # every byte written by a kernel
    if mode == "hostwrite":
        cl.enqueue_copy(queue, big, np.zeros(56, np.uint32))
    dst = cl.Buffer(ctx, mf.READ_WRITE, 224)
    prg.copy(queue, (56,), None, big, dst)
    out = np.ones(56, np.uint32)
    cl.enqueue_copy(queue, out, dst)
    print(f"  224-byte buffer: number {number(big)}, reads back as zeros: {not out.any()}")


def main() -> int:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from run_oclgrind import is_harmless, oclgrind_env, report_blocks

    for mode in MODES:
        proc = subprocess.run([sys.executable, __file__, mode], env=oclgrind_env(),
                              capture_output=True, text=True, timeout=300)
        bad = [b for b in report_blocks(proc.stderr) if not is_harmless(b)]
        print(f"{mode}: {len(bad)} report(s), exit {proc.returncode}")
        print(proc.stdout, end="")
        if bad:
            print("  first:", bad[0].splitlines()[0])
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in MODES:
        child(sys.argv[1])
    else:
        sys.exit(main())
