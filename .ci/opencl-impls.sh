#!/usr/bin/env bash
# More OpenCL implementations for CI, next to PoCL (which pyopencl's wheel brings):
#   Intel's OpenCL CPU runtime (PyPI: intel-opencl-rt; OpenCL 3.x, fp64, 256 KiB local memory)
#   Mesa's rusticl on llvmpipe (Debian: mesa-opencl-icd; OpenCL 3.0, no fp64, 32 KiB local)
#
#   .ci/opencl-impls.sh install      install both into the active venv / the system (as root),
#                                    write the ICD folder, and fail loudly unless each shows a device
#   .ci/opencl-impls.sh suite NAME   the whole conformance suite on intel, rusticl or pocl
#   .ci/opencl-impls.sh suites NAME.. those suites side by side, each log printed when it is done
#
# How the implementations are found: pyopencl's wheel ships its own ICD loader (ocl-icd), which
# reads the .icd files of the folder named by OCL_ICD_VENDORS (default /etc/OpenCL/vendors) and,
# in addition, those next to itself in pyopencl/.libs (PoCL, Oclgrind): PoCL stays visible whatever
# OCL_ICD_VENDORS says. The intel-opencl-rt wheel's own .icd names a path that does not exist, so
# this script writes one naming the wheel's lib/libintelocl.so, and copies rusticl's from
# /etc/OpenCL/vendors, into a folder of its own. Only `suite` sets OCL_ICD_VENDORS to that folder:
# every other step of CI sees PoCL and Oclgrind only. Devices are chosen by platform name
# (PYOPENCL_CTX='Intel(R) OpenCL:0', 'rusticl:0', 'Portable:0'), never by number.
set -euo pipefail
cd "$(dirname "$0")/.."

VENDORS="$(python -c 'import sys; print(sys.prefix)')/opencl-vendors"

fail() {
  echo "!! OpenCL implementations: $*" >&2
  echo "!! an optional OpenCL implementation could not be installed or shows no device: CI FAILS" >&2
  exit 1
}

install() {
  python -m pip install -q intel-opencl-rt intel-cmplr-lib-rt \
    || fail "pip install intel-opencl-rt intel-cmplr-lib-rt failed"
  local lib
  lib="$(python -c 'import sys; print(sys.prefix)')/lib/libintelocl.so"
  [ -f "$lib" ] || fail "intel-opencl-rt installed no $lib"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || fail "apt-get update failed"
  apt-get install -y -q --no-install-recommends mesa-opencl-icd >/dev/null \
    || fail "apt-get install mesa-opencl-icd failed"
  [ -f /etc/OpenCL/vendors/rusticl.icd ] || fail "mesa-opencl-icd installed no rusticl.icd"
  mkdir -p "$VENDORS"
  echo "$lib" > "$VENDORS/intel-cpu.icd"
  cp /etc/OpenCL/vendors/rusticl.icd "$VENDORS/rusticl.icd"
  # each implementation must show a device, or CI fails here rather than testing less
  OCL_ICD_VENDORS="$VENDORS" RUSTICL_ENABLE=llvmpipe python - <<'EOF' || fail "see above"
import sys

import pyopencl as cl

from attnlib.backends.opencl._runtime import describe_platforms

for line in describe_platforms():
    print("   ", line)
for ctx in ("Intel(R) OpenCL:0", "rusticl:0", "Portable:0"):
    try:
        dev = cl.create_some_context(interactive=False, answers=ctx.split(":")).devices[0]
    except Exception as exc:
        sys.exit(f"!! PYOPENCL_CTX={ctx!r} selects no device: {exc}")
    print(f"    PYOPENCL_CTX={ctx!r}: {dev.name.strip()} on {dev.platform.name.strip()}")
EOF
}

suite() {
  local ctx
  case "${1:-}" in
    intel) ctx='Intel(R) OpenCL:0' ;;
    rusticl) ctx='rusticl:0' ;;
    pocl) ctx='Portable:0' ;;
    *) echo "usage: $0 suite intel|rusticl|pocl" >&2; exit 2 ;;
  esac
  [ -d "$VENDORS" ] || fail "run '$0 install' first"
  OCL_ICD_VENDORS="$VENDORS" RUSTICL_ENABLE=llvmpipe PYOPENCL_CTX="$ctx" \
    python -m attnlib info | sed -n '/^  opencl/p'
  OCL_ICD_VENDORS="$VENDORS" RUSTICL_ENABLE=llvmpipe PYOPENCL_CTX="$ctx" \
    python -m pytest -q -p no:cacheprovider --pyargs attnlib.testing --attnlib-backend opencl
}

# several suites side by side, each with its own log, time and exit status (rusticl's time is
# mostly llvmpipe compiling each kernel variant on one core: the other core runs the other suite)
suites() {
  local name logs pids=() names=() t0 rc=0 i
  logs=$(mktemp -d)
  t0=$(date +%s)
  for name in "$@"; do
    ( s0=$(date +%s); set +e; suite "$name"; r=$?
      echo "== conformance suite on $name: exit $r, $(( $(date +%s) - s0 )) s"; exit $r
    ) > "$logs/$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "== conformance suite, opencl on ${names[$i]}"
    cat "$logs/${names[$i]}.log"
  done
  rm -rf "$logs"
  echo "== suites on $*: $(( $(date +%s) - t0 )) s in all"
  [ "$rc" = 0 ] || fail "the conformance suite failed on at least one implementation (above)"
}

case "${1:-}" in
  install) install ;;
  suite) suite "${2:-}" ;;
  suites) shift; suites "$@" ;;
  *) echo "usage: $0 install | suite intel|rusticl|pocl | suites NAME..." >&2; exit 2 ;;
esac
