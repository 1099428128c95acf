# Shared by the GPU benchmark scripts (bench/agents_h200.sh, bench/ranks_h200.sh, bench/peer_h200.sh); source it
# after setting OUT.
# The GPU machine cannot install packages: wheels, a redis-server build and the traces travel in .whl/.
if [ -d .whl ] && [ "${USE_WHEELS:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.whl/redis-bin:$PATH LD_LIBRARY_PATH=$PWD/.whl/redis-bin
fi
TRACES=${TRACES:-.whl/traces/claude_code}
CONFIG=${CONFIG:-bench/configs/agents-h200.yaml}

start_stack() {  # name, then extra `kvserve up` flags; env overrides (KVSERVE_*) apply to every service
  local name=$1; shift
  rm -rf /tmp/kvserve-run
  python3 -m launcher.cli up --config "$CONFIG" --state-dir /tmp/kvserve-run "$@" > "$OUT/up-$name.log" 2>&1 &
  UP_PID=$!
  for _ in $(seq 1 300); do
    grep -qs "Ctrl-C" "$OUT/up-$name.log" && return 0
    kill -0 $UP_PID 2>/dev/null || { tail -n 50 "$OUT/up-$name.log"; tail -n 30 /tmp/kvserve-run/logs/*.log; return 1; }
    sleep 1
  done
  echo "stack not ready"; return 1
}

stop_stack() {
  kill -INT $UP_PID 2>/dev/null || true
  wait $UP_PID 2>/dev/null || true
  cp -r /tmp/kvserve-run/logs "$OUT/logs-$1" 2>/dev/null || true
}

agents() {  # name, then kvserve bench agents flags; SIGINT after STEP_BUDGET s keeps the finished steps
  local name=$1; shift
  timeout -s INT "${STEP_BUDGET:-300}" python3 -m launcher.cli bench agents --url http://127.0.0.1:8080 \
    --trace-path "$TRACES" --no-charts --quiet --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || true
  tail -n 30 "$OUT/$name.log"
}

peer_load() {  # agents, seed, seconds, output prefix: bench/peer_h200.sh's agent load against our gateway
  local n=$1 seed=$2 limit=$3 out=$4
  timeout -k 20 -s INT "$limit" python3 -m loadgen.agents_cli --url http://127.0.0.1:8080 \
    --trace-path "$TRACES" --agents "$n" --turns "${TURNS:-12}" --max-output-tokens "${MAX_OUT:-64}" \
    --context-scale "${CONTEXT_SCALE:-0.1}" --max-context 131072 --seed "$seed" --no-charts --quiet \
    --out "$out.json" > "$out.log" 2>&1
}

sanity() {  # one small request, timed: the path works before the load starts
  local started=$(date +%s.%N)
  curl -s -m 120 http://127.0.0.1:8080/v1/messages -H 'content-type: application/json' \
    -d '{"model": "default", "max_tokens": 32, "ignore_eos": true, "messages": [{"role": "user", "content": "hello"}]}' \
    > "$OUT/sanity-$1.json" || true
  echo "sanity $1: $(python3 -c "print(round($(date +%s.%N) - $started, 2))") s: $(head -c 300 "$OUT/sanity-$1.json")"
}

