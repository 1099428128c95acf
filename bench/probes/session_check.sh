#!/usr/bin/env bash
# One device call at the start of a GPU session (carry .whl, and .fi for FlashInfer or, after the .fa4 chunk
# calls, nothing more for flash-attn 4): the CUDA tests, then the
# decode rows of bench/engine.py with each of the settings given (KVSERVE_* overrides), one engine per setting.
#   [SKIP_TESTS=1] bash bench/probes/session_check.sh "plain:KVSERVE_PIPELINE_STEPS=false" "pipelined:KVSERVE_PIPELINE_STEPS=true"
# Results under $OUT: cuda-tests.log, decode-<name>.json/.log, and check.tar.gz with all of them.
set -uo pipefail
OUT=${OUT:-/tmp/session-check}
mkdir -p "$OUT"
TEST_LIMIT=${TEST_LIMIT:-240}
MEASURES=${MEASURES:-decode_4k_b1,decode_4k_b16,decode_4k_b64,decode_4k_b128}
source "$(dirname "$0")/../stack_lib.sh"
if [ -d .fi ]; then source bench/fi_env.sh || exit 1; fi
# flash-attn 4 when its two chunks came first (carry .fa4/chunk00, then chunk01: bench/peer_h200.sh chunk);
# not beside .fi, whose older tvm-ffi it would shadow
if ls /tmp/fa4acc/chunk0* >/dev/null 2>&1 && [ ! -d .fi ]; then source bench/fa4_env.sh || true; fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true

if [ "${SKIP_TESTS:-0}" != 1 ]; then
echo "[$(date +%T)] CUDA tests"
timeout -k 10 "$TEST_LIMIT" python3 -m pytest -p no:cacheprovider -q -rs \
  tests/rank_worker/test_cuda_attention.py tests/rank_worker/test_cuda_mla.py tests/rank_worker/test_gpu_timer.py \
  tests/rank_worker/test_l1_cuda.py > "$OUT/cuda-tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/cuda-tests.log"
tail -n 25 "$OUT/cuda-tests.log"
fi

for variant in "$@"; do
  name=${variant%%:*}
  IFS=, read -r -a settings <<< "${variant#*:}"
  echo "[$(date +%T)] decode, $name: ${settings[*]}"
  env "${settings[@]}" timeout -k 10 "${DECODE_LIMIT:-150}" python3 bench/engine.py --shape llama-8b \
    --only-measures "$MEASURES" --out "$OUT/decode-$name.json" > "$OUT/decode-$name.log" 2>&1
  tail -n 18 "$OUT/decode-$name.log"
done
tar czf "$OUT/check.tar.gz" -C "$OUT" --exclude check.tar.gz . 2>/dev/null
