#!/usr/bin/env bash
# Several rank workers on one node (issue 6), one phase per device call (each fits the 10-minute limit):
#   bash bench/ranks_h200.sh one     # one rank: steps of STEPS_ONE agents
#   bash bench/ranks_h200.sh many    # RANKS ranks (GPUS=0,0 puts two on one GPU): steps of STEPS_MANY agents
#   bash bench/ranks_h200.sh kill    # RANKS ranks, N_KILL agents; rank-worker-KILL_RANK is SIGKILLed after
#                                    # KILL_AFTER s; the launcher restarts it and it registers again
# Results (loadgen JSON, gateway/router/rank logs, killed_at.txt) go to $OUT as one tarball per phase, for
# bench/ranks_results.py (default OUT: bench/results/<date>-<machine>-ranks/raw, the run folder's raw files).
set -euo pipefail
PHASE=${1:?phase: one, many or kill}
source "$(dirname "$0")/run_folder.sh"
OUT=${OUT:-$(run_folder ranks)/raw}
WORK=/tmp/ranks-$PHASE
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
FINAL_OUT=$OUT; OUT=$WORK  # stack_lib writes into $OUT; the tarball goes to the real one
trap 'cp -r /tmp/kvserve-run/logs "$OUT/logs-exit" 2>/dev/null || true; find "$OUT" -name redis.log -delete; tar czf "$FINAL_OUT/ranks-$PHASE.tgz" -C "$OUT" .' EXIT
source "$(dirname "$0")/stack_lib.sh"
RANKS=${RANKS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)}
GPUS=${GPUS:-}
TURNS=${TURNS:-20}
MAX_OUT=${MAX_OUT:-64}
CONTEXT_SCALE=${CONTEXT_SCALE:-0.1}
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt" || true
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
[ -n "${COMMIT:-}" ] && echo "$COMMIT" > "$OUT/commit.txt"  # the device copy's git HEAD can be stale
echo "${GPUS:-}" > "$OUT/gpus.txt"
UP_FLAGS=(--ranks "$RANKS")
[ -n "$GPUS" ] && UP_FLAGS+=(--gpus "$GPUS")
run_agents() { agents "$@" --turns "$TURNS" --max-output-tokens "$MAX_OUT" --context-scale "$CONTEXT_SCALE"; }

case $PHASE in
  one)
    start_stack one --ranks 1
    run_agents one --agents "${STEPS_ONE:-8,16,24}" --seed 1
    stop_stack one
    ;;
  many)
    start_stack many "${UP_FLAGS[@]}"
    echo "$RANKS" > "$OUT/ranks.txt"
    run_agents many --agents "${STEPS_MANY:-32,48,64}" --seed 1
    stop_stack many
    ;;
  kill)
    start_stack kill "${UP_FLAGS[@]}"
    echo "$RANKS" > "$OUT/ranks.txt"
    run_agents kill --agents "${N_KILL:-32}" --seed 2 &
    LOADGEN=$!
    sleep "${KILL_AFTER:-60}"
    victim="rank-worker-${KILL_RANK:-1}"
    pid=$(python3 -c "import json,sys; print(next(s['pid'] for s in json.load(open('/tmp/kvserve-run/services.json'))['services'] if s['name'] == sys.argv[1]))" "$victim")
    python3 -c "import time; print(time.time())" > "$OUT/killed_at.txt"
    echo "rank-${KILL_RANK:-1}" > "$OUT/killed_rank.txt"
    kill -9 "$pid"
    echo "killed $victim (pid $pid)"
    wait $LOADGEN || true
    stop_stack kill
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
