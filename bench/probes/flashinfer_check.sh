#!/usr/bin/env bash
# FlashInfer FA3 as an attention backend, on the GPU machine, in one command, under 4 minutes (carry: .fi):
#   bash bench/probes/flashinfer_check.sh
# Installs the carried wheels (.fi/*.whl: flashinfer-python 0.6.13, apache-tvm-ffi 0.1.9) into /tmp/fisite,
# points FlashInfer at the prebuilt FA3 module (.fi/aot: a stand-in flashinfer_jit_cache package), forbids
# JIT compilation (FLASHINFER_DISABLE_JIT=1: a missing module fails at once instead of compiling for tens of
# minutes), then runs bench/probes/flashinfer_probe.py. Ends with PASS, or a FAIL line that says why.
set -u
cd "$(dirname "$0")/../.." || exit 1
fail() { echo "FAIL: $*"; exit 1; }
started=$(date +%s)

[ -d .fi/aot/flashinfer_jit_cache ] || fail ".fi/aot not here: carry .fi"
ls .fi/*.whl >/dev/null 2>&1 || fail "no wheels in .fi: carry .fi"
so=$(ls .fi/aot/flashinfer_jit_cache/jit_cache/*/*.so 2>/dev/null | head -1)
[ -n "$so" ] || fail "no prebuilt module in .fi/aot/flashinfer_jit_cache/jit_cache"
echo "prebuilt: $so ($(du -h "$so" | cut -f1))"
command -v cuobjdump >/dev/null && { timeout 10 cuobjdump --list-elf "$so" | head -5; }

source bench/fi_env.sh || fail "bench/fi_env.sh"
export PYTHONUNBUFFERED=1

timeout 30 python3 -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, 'tvm_ffi', tvm_ffi.__version__)" \
  || fail "import flashinfer (exit $?)"

timeout 150 python3 bench/probes/flashinfer_probe.py "$@"
rc=$?
[ $rc -eq 124 ] && fail "flashinfer_probe.py ran past 150 s"
# any ninja/nvcc output FlashInfer would have written had it compiled
if [ -d /tmp/fiws/.cache/flashinfer ] && find /tmp/fiws/.cache/flashinfer -name '*.o' -o -name 'build.ninja' | grep -q .; then
  echo "FAIL: FlashInfer wrote build files under /tmp/fiws (it tried to compile)"; rc=1
fi
echo "flashinfer_check: $(( $(date +%s) - started )) s, exit $rc"
exit $rc
