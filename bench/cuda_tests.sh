#!/usr/bin/env bash
# The CUDA tests in one device call (carry [".whl"]): the Triton kernel files (tests/rank_worker/test_cuda_*.py,
# every case, the slow ones too: on a GPU they are quick) and the CUDA cases of the other rank worker files
# (named cuda or gpu), then a GPU smoke of the whole stack (`kvserve up` on the DeepSeek-V2-Lite
# shape with random weights, one chat request through the gateway). Logs under $OUT (cuda-tests*.log,
# stack-smoke.json and its logs' tarball), each with the commit and the diff hash it ran.
#     DEADLINE=420 bash bench/cuda_tests.sh
# ONLY_TESTS: these pytest arguments alone instead (cuda-tests-only.log), for a lease with little time, e.g. FA4's MLA
# cases after the .fa4 chunks came:  ONLY_TESTS="tests/rank_worker/test_cuda_mla.py -k fa4" bash bench/cuda_tests.sh
# (its words split as the shell's: a -k expression with spaces, quoted or not, does not survive; name files)
set -uo pipefail
OUT=${OUT:-/tmp/cuda-tests}
mkdir -p "$OUT"
DEADLINE=${DEADLINE:-420}
left() { echo $((DEADLINE - SECONDS)); }
say() { echo "[$(date +%T) +${SECONDS}s] $*"; }
source "$(dirname "$0")/stack_lib.sh"
# flash-attn 4 when its chunks came (bench/peer_h200.sh chunk with .fa4/chunk00..01): its test cases then run too
if ls /tmp/fa4acc/chunk0* >/dev/null 2>&1; then source "$(dirname "$0")/fa4_env.sh" || true; fi
export PYTHONUNBUFFERED=1
{ python3 "$(dirname "$0")/../loadgen/provenance.py" .
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$OUT/provenance.txt" 2>&1

if [ -n "${ONLY_TESTS:-}" ]; then
  say "pytest $ONLY_TESTS"
  # shellcheck disable=SC2086  # the arguments split as pytest's
  timeout -k 10 "$(left)" python3 -m pytest -p no:cacheprovider -q -rs $ONLY_TESTS > "$OUT/cuda-tests-only.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/cuda-tests-only.log"
  tail -n 6 "$OUT/cuda-tests-only.log"
  exit 0
fi

say "Triton kernel tests"
timeout -k 10 $(( $(left) / 2 )) python3 -m pytest -p no:cacheprovider -q -rs -n 4 tests/rank_worker/test_cuda_*.py \
  > "$OUT/cuda-tests-kernels.log" 2>&1
echo "pytest rc=$?" >> "$OUT/cuda-tests-kernels.log"
tail -n 6 "$OUT/cuda-tests-kernels.log"

say "CUDA cases of the other rank worker files"
timeout -k 10 $(( $(left) - 120 )) python3 -m pytest -p no:cacheprovider -q -rs -n 4 tests/rank_worker \
  --ignore-glob='tests/rank_worker/test_cuda_*.py' -k "cuda or gpu" > "$OUT/cuda-tests-named.log" 2>&1
echo "pytest rc=$?" >> "$OUT/cuda-tests-named.log"
tail -n 6 "$OUT/cuda-tests-named.log"

if [ "$(left)" -gt 100 ]; then
  say "stack smoke: kvserve up, DeepSeek-V2-Lite shape"
  CONFIG=bench/configs/agents-dsv2-lite-h200.yaml
  if start_stack smoke; then
    curl -s -m 60 http://127.0.0.1:8080/v1/messages -H 'content-type: application/json' \
      -d '{"model": "default", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}' \
      > "$OUT/stack-smoke.json" 2>&1
    cat "$OUT/stack-smoke.json"; echo
    stop_stack smoke
  fi
  # one file for the stack's logs (a device call brings back at most 8 files)
  tar czf "$OUT/stack-smoke-logs.tar.gz" -C "$OUT" up-smoke.log logs-smoke 2>/dev/null && rm -rf "$OUT/up-smoke.log" "$OUT/logs-smoke"
fi
say "done"
