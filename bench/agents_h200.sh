#!/usr/bin/env bash
# The agent benchmark on the GPU machine, one phase per call (each fits the 10-minute limit):
#   bash bench/agents_h200.sh main      # warm_first steps of N agents (STEPS=8,16,32)
#   bash bench/agents_h200.sh ab        # at N_AB agents, staggered: the cache off, then FIFO, then warm_first
# The whole stack comes up with `kvserve up` (redis-server, kvstore, router, one rank worker, gateway) from
# bench/configs/agents-h200.yaml; results go to $OUT (default bench/results/<date>-<machine>-agents/raw/<phase>,
# the run folder that bench/agents_results.py reads).
set -euo pipefail
PHASE=${1:?phase: main or ab}
source "$(dirname "$0")/run_folder.sh"
OUT=${OUT:-$(run_folder agents)/raw/$PHASE}
mkdir -p "$OUT"
trap 'cp -r /tmp/kvserve-run/logs "$OUT/logs-exit" 2>/dev/null || true' EXIT
source "$(dirname "$0")/stack_lib.sh"
STEPS=${STEPS:-8,16,32}
TURNS=${TURNS:-12}  # the first turn of a session is cold: ~12 turns are needed before 90% of input can be cached
CONTEXT_SCALE=${CONTEXT_SCALE:-0.1}
MAX_OUT=${MAX_OUT:-256}
NOCACHE_N=${NOCACHE_N-16}  # empty: no run with the cache off
N_AB=${N_AB:-16}
# Staggered starts: cold first turns must overlap other agents' warm turns for the policy to matter (with
# every agent starting at once the simulator predicts no difference).
AB_STAGGER=${AB_STAGGER:-60}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt" || true

# Every agent replays TURNS turns (the first of a session is cold, the rest mostly cached), outputs capped at
# MAX_OUT tokens so a step ends within a few minutes.
# One context scale for every run, so the runs with and without the cache replay the same prompts.
run_agents() { agents "$@" --turns "$TURNS" --max-output-tokens "$MAX_OUT" --context-scale "$CONTEXT_SCALE"; }

case $PHASE in
  main)
    start_stack warm_first
    sanity warm_first
    run_agents warm_first --agents "$STEPS" --seed 1
    stop_stack warm_first
    if [ -n "${DECODE_PROBE:-}" ]; then  # the simulator's decode step model, measured on the engine as it is now
      timeout "$DECODE_PROBE" python3 -m simulator.decode_probe --out "$OUT/decode-h200.json" > "$OUT/decode-h200.log" 2>&1 || true
      tail -n 3 "$OUT/decode-h200.log"
    fi
    if [ -n "${NOCACHE_N}" ]; then
      KVSERVE_PREFIX_CACHE=false start_stack nocache  # no L0 and, with it, no L1
      run_agents nocache --agents "$NOCACHE_N" --seed 1
      stop_stack nocache
    fi
    ;;
  ab)  # FIFO vs warm_first at one load with staggered starts, and the same run with the cache off (read rate)
    KVSERVE_PREFIX_CACHE=false start_stack nocache  # no L0 and, with it, no L1
    run_agents nocache --agents "$N_AB" --stagger "$AB_STAGGER" --seed 3
    stop_stack nocache
    KVSERVE_SCHEDULING_POLICY=fifo start_stack fifo
    run_agents ab-fifo --agents "$N_AB" --stagger "$AB_STAGGER" --seed 3
    stop_stack fifo
    KVSERVE_SCHEDULING_POLICY=warm_first start_stack ab-warm_first
    run_agents ab-warm_first --agents "$N_AB" --stagger "$AB_STAGGER" --seed 3
    stop_stack ab-warm_first
    ;;
  readrate)  # one device call: the cache off and on at N_RR agents, a heavier step, then FIFO at it if time is left
    N_RR=${N_RR:-8}; N_HEAVY=${N_HEAVY:-32}; DEADLINE=${DEADLINE:-540}
    KVSERVE_PREFIX_CACHE=false start_stack nocache
    STEP_BUDGET=${NOCACHE_BUDGET:-160} run_agents nocache --agents "$N_RR" --seed 5
    stop_stack nocache
    start_stack warm_first
    STEP_BUDGET=${WARM_BUDGET:-260} run_agents warm_first --agents "$N_RR,$N_HEAVY" --seed 5
    stop_stack warm_first
    left=$((DEADLINE - SECONDS))
    if [ "$left" -gt 150 ]; then
      KVSERVE_SCHEDULING_POLICY=fifo start_stack fifo
      STEP_BUDGET=$((DEADLINE - SECONDS - 10)) run_agents fifo --agents "$N_HEAVY" --seed 5
      stop_stack fifo
    else
      echo "no time left for the FIFO run ($left s)"
    fi
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
echo "commit $COMMIT" > "$OUT/commit.txt"
