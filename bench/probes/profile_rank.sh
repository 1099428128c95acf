#!/usr/bin/env bash
# Where the rank worker's threads spend their time under the agent load (carry .whl, .fi and .spy: the
# py-spy wheel): our stack with KVSERVE_* overrides from the environment, N agents of bench/peer_h200.sh's
# load (stack_lib.sh's peer_load), and py-spy sampling every thread of the rank worker (collapsed stacks, one line per stack and count)
# for the whole step. Results in $OUT: rank-spy.txt (py-spy --threads), rank-spy-gil.txt (only the thread
# holding the GIL), the step's agents JSON and log, and the stack's logs, packed in profile.tar.gz.
#   python3 bench/probes/spy_report.py rank-spy.txt    # here: the share of samples per thread and frame
# With TRACE="SKIP:COUNT:NAME[,...]" the rank records those iterations with torch.profiler instead
# (KVSERVE_STEP_TRACE, rank_worker/engine/step_trace.py) into $OUT/NAME.json, and bench/probes/trace_gaps.py
# reports on each (NAME-gaps.txt/.json; the traces come back gzipped); SPY_S=0 skips py-spy.
set -uo pipefail
OUT=${OUT:-/tmp/profile-rank}
N=${N:-64}
TURNS=${TURNS:-12}
SPY_S=${SPY_S:-60}  # seconds of each recording: the threads' view, then the GIL holder's
mkdir -p "$OUT"
source "$(dirname "$0")/../stack_lib.sh"
if [ -d .fi ] && [ "${USE_FI:-1}" = 1 ]; then source bench/fi_env.sh || exit 1; fi
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .spy/*.whl >/dev/null 2>&1
SPY=/tmp/spy/bin/py-spy
export PYTHONUNBUFFERED=1
if [ -n "${TRACE:-}" ]; then
  IFS=, read -r -a windows <<< "$TRACE"
  export KVSERVE_STEP_TRACE=$(for w in "${windows[@]}"; do printf '%s:%s,' "${w%:*}" "$OUT/${w##*:}.json"; done | sed 's/,$//')
  echo "step trace: $KVSERVE_STEP_TRACE"
fi
start_stack profile || exit 1
rank=$(pgrep -f "rank_worker" | while read -r p; do
  grep -qa "launcher.parent_death" /proc/"$p"/cmdline || echo "$p"; done | tail -n 1)
echo "rank worker pid ${rank:-none}: $(tr '\0' ' ' < /proc/"$rank"/cmdline | cut -c1-200)"
peer_load "$N" "$N" "${STEP_LIMIT:-170}" "$OUT/agents-$N" &
load=$!
sleep 3
[ "$SPY_S" -gt 0 ] && "$SPY" record --pid "$rank" --threads --nonblocking --rate 250 --duration "$SPY_S" --format raw \
  -o "$OUT/rank-spy.txt" > "$OUT/spy.log" 2>&1
[ "$SPY_S" -gt 0 ] && "$SPY" record --pid "$rank" --threads --gil --nonblocking --rate 250 --duration "$SPY_S" --format raw \
  -o "$OUT/rank-spy-gil.txt" >> "$OUT/spy.log" 2>&1
tail -n 3 "$OUT/spy.log" 2>/dev/null
wait $load
tail -n 6 "$OUT/agents-$N.log"
stop_stack profile
for w in ${TRACE//,/ }; do
  name=${w##*:}
  [ -f "$OUT/$name.json" ] || { echo "no trace $name.json"; continue; }
  python3 bench/probes/trace_gaps.py "$OUT/$name.json" --out "$OUT/$name-gaps.json" | tee "$OUT/$name-gaps.txt"
  gzip -f "$OUT/$name.json"
done
tar czf "$OUT/profile.tar.gz" -C "$OUT" --exclude profile.tar.gz . 2>/dev/null
