#!/usr/bin/env bash
# Source on the GPU machine after the .fa4 chunk calls (bench/fa4_kit.sh): installs flash-attn 4 and its
# wheels from /tmp/fa4acc into /tmp/fa4site (once per warm machine) and puts that site first on PYTHONPATH.
# Returns non-zero when the chunks are not there or do not install. FA4_ACC and FA4_SITE move both (tests).
FA4_ACC=${FA4_ACC:-/tmp/fa4acc}
FA4_SITE=${FA4_SITE:-/tmp/fa4site}
if [ ! -f "$FA4_SITE"/flash_attn/cute/__init__.py ]; then
  if [ "$(ls "$FA4_ACC"/chunk0* 2>/dev/null | wc -l)" -lt "${FA4_CHUNKS:-3}" ]; then  # 3: packed (pack_chunks.py, 26 MiB)
    echo "bench/fa4_env.sh: not every chunk is in $FA4_ACC yet (send .fa4/chunk00..chunk02 first)"
    return 1 2>/dev/null || exit 1
  fi
  rm -rf /tmp/fa4w && python3 "$(dirname "${BASH_SOURCE[0]}")/unpack_chunks.py" "$FA4_ACC" /tmp/fa4w &&
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FA4_SITE" \
      /tmp/fa4w/*.whl || { echo "bench/fa4_env.sh: install failed"; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
# FA4's compiled kernels on disk, where bench/peer_h200.sh's caches-out takes them for the next lease (its CACHE_DIRS):
# ~20 s of compiling at each bare start (DeepSeek-V2-Lite's MLA prefill, H100, 2026-12-05)
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$HOME/.cache/fa4-cute"
mkdir -p "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
