#!/usr/bin/env bash
# The DeepSeek-V2-Lite engine checks of a lease in one device call (carry [".whl"], after the three .fa4 chunk
# calls of bench/peer_h200.sh), each phase only while its time is left (DEADLINE seconds from the start, 575):
#   1. bench/probes/mla_decode_probe.py --write-launch: the MLA kernel's launches by batch size, graph-timed; the
#      table it writes (rank_worker/model/attention/mla_launch.json) is what the engine measures below take, and
#      comes back as $OUT/mla_launch.json to commit
#   2. the CUDA tests of the DeepSeek paths (MLA, MoE kernels, fused norms, attention)
#   3. bench/probes/decode_profile.py at PROFILE_BATCHES (1; e.g. 1,128): each decode step's kernels, uncaptured
#   4. bench/peer_h200.sh ours-engine with ENGINE_ONLY=1 (bench/engine.py bf16 + the float32 match)
#   5. FP8=1: bench/engine.py with kv_cache_dtype fp8_e4m3 (sessions in HBM, the greedy match), if time is left
# Everything is written under a work folder and comes back as $OUT/dsv2-lease.tar.gz, with mla_launch.json and
# ours-engine.json beside it (a device call returns at most 8 files).
#     DEADLINE=575 bash bench/probes/dsv2_lease.sh
set -uo pipefail
OUT=${OUT:-/tmp/dsv2-lease}
W=${LEASE_WORK:-/tmp/dsv2-lease-work}
mkdir -p "$OUT" "$W"
DEADLINE=${DEADLINE:-575}
PROFILE_BATCHES=${PROFILE_BATCHES:-1}
left() { echo $((DEADLINE - SECONDS)); }
say() { echo "[$(date +%T) +${SECONDS}s] $*"; }
source "$(dirname "$0")/../stack_lib.sh"
if ls /tmp/fa4acc/chunk0* >/dev/null 2>&1; then source bench/fa4_env.sh || true; fi
export PYTHONUNBUFFERED=1
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

say "MLA decode probe"
timeout -k 10 200 python3 bench/probes/mla_decode_probe.py --out "$W/mla-probe.json" --write-launch \
  --source "H200 $(date +%F) $COMMIT" > "$W/mla-probe.log" 2>&1
tail -n 12 "$W/mla-probe.log"
cp rank_worker/model/attention/mla_launch.json "$OUT/" 2>/dev/null

say "CUDA tests"
timeout -k 10 $(( $(left) > 400 ? 150 : 90 )) python3 -m pytest -p no:cacheprovider -q -rs --maxfail=5 \
  tests/rank_worker/test_cuda_mla.py tests/rank_worker/test_cuda_moe_kernels.py \
  tests/rank_worker/test_cuda_moe_mlp_kernel.py tests/rank_worker/test_cuda_fused_norm.py \
  tests/rank_worker/test_cuda_attention.py tests/rank_worker/test_cuda_latent_store.py > "$W/cuda-tests.log" 2>&1
echo "pytest rc=$?" >> "$W/cuda-tests.log"
tail -n 8 "$W/cuda-tests.log"
# the CUDA cases of the other files (L1 copies, decode graphs, fp8 KV, the DeepSeek engine on the GPU)
timeout -k 10 60 python3 -m pytest -p no:cacheprovider -q -rs --maxfail=5 -k "cuda or gpu" \
  tests/rank_worker/test_l1_cuda.py tests/rank_worker/test_l1_copier.py tests/rank_worker/test_decode_graphs.py \
  tests/rank_worker/test_kv_fp8.py tests/rank_worker/test_deepseek_engine.py > "$W/cuda-tests-more.log" 2>&1
echo "pytest rc=$?" >> "$W/cuda-tests-more.log"
tail -n 4 "$W/cuda-tests-more.log"

IFS=, read -r -a batches <<< "$PROFILE_BATCHES"
for batch in "${batches[@]}"; do
  [ "$(left)" -gt 360 ] || { say "no time for the b$batch profile"; continue; }
  say "decode profile, batch $batch"
  timeout -k 10 90 python3 bench/probes/decode_profile.py --shape dsv2-lite-chat --batch "$batch" \
    --random-weights uniform --out "$W/decode-profile-b$batch.json" > "$W/decode-profile-b$batch.log" 2>&1
  sed -n '/--- decode/,/--- prefill/p' "$W/decode-profile-b$batch.log" | head -n 16
done

say "ours-engine ($(left) s left)"
OUT="$W" DEADLINE=$(( $(left) - 5 )) ENGINE_ONLY=1 SHAPE=dsv2-lite-chat ENGINE_SHAPE=dsv2-lite-chat \
  RANDOM_WEIGHTS=uniform PEER_TAG=dsv2 bash bench/peer_h200.sh ours-engine

if [ "${FP8:-0}" = 1 ] && [ "$(left)" -gt 150 ]; then
  say "fp8 KV engine"
  timeout -k 10 $(( $(left) - 15 )) python3 bench/engine.py --shape dsv2-lite-chat --kv-cache-dtype fp8_e4m3 \
    --commit "$COMMIT" --random-weights uniform --out "$W/engine-fp8-dsv2.json" > "$W/engine-fp8-dsv2.log" 2>&1
  tail -n 20 "$W/engine-fp8-dsv2.log"
fi
cp "$W/ours-engine.json" "$OUT/" 2>/dev/null
tar czf "$OUT/dsv2-lease.tar.gz" -C "$W" . 2>/dev/null
say "done"
