#!/usr/bin/env bash
# Source on the GPU machine (carry .fi): FlashInfer 0.6.13 and apache-tvm-ffi from the carried wheels into
# /tmp/fisite, and the environment that makes it use the prebuilt FA3 module in .fi/aot (a stand-in
# flashinfer_jit_cache package) and never compile (FLASHINFER_DISABLE_JIT=1: a missing module fails at once
# instead of building for tens of minutes). Returns non-zero when the kit is not here or does not install.
#   source bench/fi_env.sh && python3 -m pytest tests/rank_worker/test_cuda_attention.py
fi_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -d "$fi_root/.fi/aot/flashinfer_jit_cache" ] || ! ls "$fi_root"/.fi/*.whl >/dev/null 2>&1; then
  echo "bench/fi_env.sh: no .fi kit here (carry .fi)"
  return 1 2>/dev/null || exit 1
fi
if [ ! -f /tmp/fisite/flashinfer/__init__.py ]; then
  timeout 45 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fisite "$fi_root"/.fi/*.whl || { echo "bench/fi_env.sh: pip install failed"; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="/tmp/fisite:$fi_root/.fi/aot${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_DISABLE_JIT=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws  # FlashInfer's log and generated sources; nothing is built there
export FLASHINFER_LOGGING_LEVEL=warning
# tvm-ffi would JIT-build a torch DLPack addon if torch lacked the native exchange API; torch's own is used
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
mkdir -p /tmp/fiws
