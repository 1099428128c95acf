#!/usr/bin/env bash
# One device call (carry .whl and .fi, after the two .fa4 chunk calls): the CUDA tests, FlashInfer's probe with
# its pool-layout study, then flash-attn 4's probe over the same steps and layouts. Results in $OUT/attention.tar.gz.
#   SKIP_TESTS=1 TEST_LIMIT=200 bash bench/probes/attention_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/attention-session}
mkdir -p "$OUT/session"
cd "$(dirname "$0")/../.." || exit 1
OUT=$OUT/session bash bench/probes/session_check.sh
echo "[$(date +%T)] FlashInfer probe"
OUT=$OUT/session timeout -k 5 "${FI_LIMIT:-170}" bash bench/probes/flashinfer_check.sh > "$OUT/session/flashinfer.log" 2>&1
tail -n 16 "$OUT/session/flashinfer.log"
echo "[$(date +%T)] FA4 probe"
(
  source bench/stack_lib.sh
  source bench/fa4_env.sh || exit 1
  OUT=$OUT/session timeout -k 5 "${FA4_LIMIT:-240}" python3 bench/probes/fa4_probe.py
) > "$OUT/session/fa4.log" 2>&1
grep -v "^correctness" "$OUT/session/fa4.log" | tail -n 30
tar czf "$OUT/attention.tar.gz" -C "$OUT/session" .
rm -rf "$OUT/session"
