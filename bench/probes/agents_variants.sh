#!/usr/bin/env bash
# Our stack under the agent load of bench/peer_h200.sh (the same steps, turns, context scale, output tokens and
# seeds) with rank settings varied, one fresh stack per variant, on the GPU machine (carry .whl, and .fi for
# FlashInfer): which scheduler settings keep most agents within the bars.
#   bash bench/probes/agents_variants.sh "chunk1024:KVSERVE_MIN_PREFILL_CHUNK_TOKENS=1024" "nobudget:KVSERVE_DECODE_STEP_BUDGET_MS=0"
# A variant is NAME:VAR=VALUE[,VAR=VALUE...] (KVSERVE_* environment overrides of the config); results under
# $OUT/<name>/ (agents-N.json per step, the stack's logs) and one $OUT/variants.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/agents-variants}
STEPS=${STEPS:-48,64}
TURNS=${TURNS:-12}
MAX_OUT=${MAX_OUT:-64}
CONTEXT_SCALE=${CONTEXT_SCALE:-0.1}
STEP_LIMIT=${STEP_LIMIT:-200}  # seconds a step may take before it is stopped (12 turns took 70-145 s)
ROOT_OUT=$OUT
source "$(dirname "$0")/../stack_lib.sh"
if [ -d .fi ]; then source bench/fi_env.sh || exit 1; fi
export PYTHONUNBUFFERED=1
for variant in "$@"; do
  name=${variant%%:*}
  OUT=$ROOT_OUT/$name && mkdir -p "$OUT"
  IFS=, read -r -a settings <<< "${variant#*:}"
  for s in "${settings[@]}"; do export "${s?}"; done
  echo "[$(date +%T)] $name: ${settings[*]}"
  if start_stack "$name"; then
    for n in ${STEPS//,/ }; do
      peer_load "$n" "$n" "$STEP_LIMIT" "$OUT/agents-$n"
      echo "[$(date +%T)] $name, $n agents:"; tail -n 6 "$OUT/agents-$n.log"
    done
    stop_stack "$name"
  fi
  for s in "${settings[@]}"; do unset "${s%%=*}"; done
done
tar czf "$ROOT_OUT/variants.tar.gz" -C "$ROOT_OUT" --exclude variants.tar.gz . 2>/dev/null
