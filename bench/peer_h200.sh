#!/usr/bin/env bash
# kvserve side by side with vLLM 0.25 on one H200, one device call per phase (each ends by DEADLINE, 540 s):
#   bash bench/peer_h200.sh chunk            # copy the carried .peer/chunkNN into /tmp/acc (vLLM's wheels)
#   bash bench/peer_h200.sh vllm-engine      # install vLLM, bench/peer_vllm.py, then start `vllm serve`
#   bash bench/peer_h200.sh vllm-agents      # (alias vllm-serve-start) agent steps against vLLM; stops it when done
#   bash bench/peer_h200.sh ours-engine      # (alias ours) bench/engine.py bf16 + float32 match, then `kvserve up`
#   bash bench/peer_h200.sh ours-agents      # agent steps against our stack; stops it when done
#   bash bench/peer_h200.sh sim-calibrate    # simulator/decode_probe.py: the simulator's decode model on this GPU
#   bash bench/peer_h200.sh status           # what is installed, running and done on this machine
#   bash bench/peer_h200.sh stop             # stop both servers (their logs go into stop.tar.gz)
#   bash bench/peer_h200.sh caches-out       # vLLM's and Triton's compile caches back in parts (.caches/ for later)
# Several phases may share one call: `bash bench/peer_h200.sh chunk vllm-engine` (one deadline for all).
# Servers start with setsid, so they outlive the call and keep starting up into the next one on the same warm
# machine; agent steps already done (/tmp/peer-state) are skipped, so repeat an -agents phase until it prints
# "all steps done". Both sides get the same load: STEPS agents x TURNS turns of the Claude Code traces
# (.whl/traces), context scale 0.1, MAX_OUT output tokens, 3 s think time, one load generator call per step,
# the same seed per agent count. Results: $OUT/<phase>.tar.gz (everything so far on this machine) and the
# engine JSONs (default OUT: bench/results/<date>-<machine>-peer-<shape>/raw, PEER_TAG appended);
# bench/peer_results.py assembles them into the run folder's peer.json.
# Calls, back to back (a machine idle for 30 s is given back, and with it /tmp):
#   carry [".peer/chunk00"] .. [".peer/chunk08"]: bash bench/peer_h200.sh chunk
#   carry [".whl"]:                               bash bench/peer_h200.sh vllm-engine
# (the working tree, ~31-34 MB on 2026-12-07, travels beside the carried chunks within the 64 MiB a call takes, and
# .whl is 28 MB. The kits are packed by bench/pack_chunks.py: stored wheels, xz over the set, 26 MiB chunks; vLLM's kit
# in 9 chunks, flash-attn 4's in 3, each a call of its own; an xz set re-splits in place with
# `cat chunk* > all && split -b 26M -d -a 2 all chunk`. Never pipe this script's
# output into `head`: the pipe closing stops it before it has copied every chunk. A kit of plain tar chunks, as ../shared/tools/vllm-peer builds it,
# packs in place: `python bench/pack_chunks.py .peer`, ~7 minutes here; either kind installs.)
#   carry [".whl"]:                               bash bench/peer_h200.sh vllm-agents   (until "all steps done")
#   carry [".fa4/chunk00"] .. [".fa4/chunk02"]:   bash bench/peer_h200.sh chunk  (flash-attn 4, for ours)
#   carry [".whl"]:                               bash bench/peer_h200.sh ours-engine
#   carry [".whl"]:                               bash bench/peer_h200.sh ours-agents   (until "all steps done")
# (FlashInfer instead of FA4: carry [".whl", ".fi"] and no .fa4 chunks.)
# (.peer/ from ../shared/tools/vllm-peer/build_chunks.sh, .whl/ from bench/gpu_kit.sh.)
# Another shape, e.g. DeepSeek-V2-Lite at the traces' real size (issue 14), with vLLM once plain and once with its
# CPU offload (PEER_TAG keeps each vLLM variant's state and results apart; ours runs in either). The engine
# measures take the real shape; the agent steps its 1M-window twin (bench/shapes/dsv2-lite-1m-chat/README.md:
# past 163,840 positions the real one kills vLLM's engine), which the config serves on our side too:
#   SHAPE=dsv2-lite-chat SERVE_SHAPE=dsv2-lite-1m-chat ENGINE_SHAPE=dsv2-lite-chat \
#   CONFIG=bench/configs/agents-dsv2-lite-h200.yaml CONTEXT_SCALE=1.0 MAX_CONTEXT=1048576 \
#   VLLM_MAX_MODEL_LEN=1048576 STEPS=4,8 TURNS=24 STEP_EST=420 STEP_MAX=500 RANDOM_WEIGHTS=uniform \
#   VLLM_ROUTING=uniform_random [PEER_TAG=offload VLLM_ARGS="--kv-offloading-size 64"] \
#   bash bench/peer_h200.sh vllm-engine ...
# (vLLM's CPU offload has been reported to refuse MLA models in some versions and backends: if `vllm serve` with
# it does not come up, its log says why; the variant then did not run, which the results must say.)
# llama-8b past the GPU pool (issue 34, point 2): the default shape and config (its L1 48 GB), more agents than the
# pool holds at context scale 0.1, vLLM once plain and once offloading to the same host memory as our L1:
#   STEPS=64,80,96,112 TURNS=12 [PEER_TAG=offload VLLM_ARGS="--kv-offloading-size 48"] bash bench/peer_h200.sh ...
# (on an H100 the pool is 412,800 tokens and binds from ~20 agents: STEPS=16,24,32,40,48 with ours's
# KVSERVE_L1_HOST_GB=64 and vLLM's --kv-offloading-size 64. On 2026-12-06 (1c38b86) both passed 16 and failed 32 and
# 48, ours on cache hit: an L1 lookup's L0 prefix was evicted before its answer, mended in fe939a8; the simulator,
# whose restores are instant, had ours passing 48: bench/results/2026-12-06-h100-peer-llama-8b-past-pool). With the
# L1 mends (6f457cb), beside vLLM's offload in one lease, both passed 24 and 32; at 40 and 48 vLLM failed on tok/s
# and cache hit, ours failed 40 by 0.4 point of the cache bar and passed 48 (-restored-first). A/B of an L1 switch
# in the same lease, each side with its own PEER_TAG, e.g. STEPS=40 KVSERVE_L1_HOST_GB=64
# KVSERVE_L1_EVICT_WRITTEN_THROUGH_FIRST=false PEER_TAG=llama-wt-off (-written-through-first: on, it lost 2.5 points
# of the optimum at 40 agents and is off by default since); the switches the stack ran with: ours-env.txt. Next:
# STEPS=40,44 KVSERVE_L1_REFRESH_FINISHED=true PEER_TAG=llama-refresh against the default (the simulator, its tier
# judged as the real one: 98.7-99.9% -> 99.9% at 40 and 44, worse at 48:
# bench/results/2026-12-07-cpu-simulate-view-write-through).
# Exclusive tiers (KVSERVE_L1_WRITE_THROUGH=on_evict, off by default): on the H100 on 2026-12-08 ours passed 48 agents
# with it and failed 48 without, in one lease, one run each (bench/results/2026-12-08-h100-llama-8b-on-evict-ab). Next:
# both sides at the same steps in one lease, vLLM first, e.g. STEPS=32,40,48 for vLLM's offload and ours with
# KVSERVE_L1_WRITE_THROUGH=on_evict PEER_TAG=on-evict (and the default under its own tag where time is left), repeated.
# On an H200 both pools can be pinned to the H100's, 25,800 blocks: KVSERVE_NUM_KV_BLOCKS=25800 for ours,
# VLLM_ARGS="... --num-gpu-blocks-override 25800" for vLLM.
# The simulator's step-time model, fitted to the engine of 2026-11-29, ran the H100's cold prompts twice as slowly as
# the GPU did, which is why it passed 44 agents where the H100 failed (bench/results/2026-12-07-cpu-simulate-paced-copies).
# To calibrate it on this GPU, two calls after the .fa4 chunks, each carrying [".whl"]:
#   ENGINE_ONLY=1 bash bench/peer_h200.sh ours-engine    then    bash bench/peer_h200.sh sim-calibrate
# and on this machine: kvserve bench simulate ... --engine-results raw/ours-engine.json --decode-results
# raw/decode-probe.json --calls, then bench/sim_vs_gpu.py against the lease's own agent steps. Done on an H100 on
# 2026-12-07 (bench/results/2026-12-07-h100-peer-llama-8b-gauges: the simulator then gave the GPU's verdicts at 40 and
# 44 agents); again when the engine's speed changes.
# 24 turns, not 12: at the traces' real size a session's first turn is cold and large (up to 783K tokens), so
# over 12 turns the traces' own reuse is 0.81-0.87 at 2-8 agents, under the 0.9 cache bar for any server, and
# the cold first turns are more than 5% of the calls (TTFT p95). Over 24 turns: 0.89 / 0.91 / 0.92 at 2 / 4 / 8
# agents. The simulator puts a 24-turn step at ~285 s (4 agents) and ~385 s (8) on our side
# (bench/results/2026-12-04-cpu-simulate-dsv2-lite/plan-24-turns.json): one step a call, hence STEP_EST and
# STEP_MAX.
# One 1800 s lease for the DeepSeek side by side on a bare machine (no compile caches: .caches/ is not kept between
# sessions), as the calls took on an H100 on 2026-12-06: [".fa4/chunk00"] .. [".fa4/chunk02"] chunk, one a call
# (<1 s each); [".whl"] `ours-agents` with STEPS=8 (kvserve up ~97 s cold, 8 agents ~330 s); .peer/chunk00..08 one
# a call; [".whl"] `vllm-agents` with STEPS=8,4 and DEADLINE=588 (vLLM installs in ~17 s and starts in
# ~270 s cold, so its 8-agent step, ~300 s, starts in the next call: repeat vllm-agents until "all steps done").
# ~1,450 s of calls, the rest for a failed start (~90-135 s). Ours's 4-agent step (~250 s) only where time is left:
# largest_passing_ratio needs vLLM's 4 and 8 and ours's 8 when ours passes 8. Side order: the last same-lease run
# had vLLM first, so ours goes first in the next.
set -uo pipefail
DEADLINE=${DEADLINE:-540}      # seconds this call may use (the device's limit is 600)
PACK_MARGIN=${PACK_MARGIN:-25} # left at the end for packing the results
STEPS=${STEPS:-16,32,48,64}
TURNS=${TURNS:-12}
CONTEXT_SCALE=${CONTEXT_SCALE:-0.1}
MAX_OUT=${MAX_OUT:-64}
STEP_EST=${STEP_EST:-150}      # a step is not started with less time than this left (12 turns take 60-250 s)
STEP_MAX=${STEP_MAX:-300}      # a step still running after this is stopped (vLLM's 80 agents ran 422 s, unfinished)
# Both sides' agent API: vLLM's /v1/messages drops ignore_eos (its calls then stop early and decode less), its chat
# completions honour it, and so do ours: both are driven through `openai` (each step also counts short_outputs)
AGENT_API=${AGENT_API:-${VLLM_API:-openai}}
# More load generator flags, the same for both sides: --messages sends each call as a conversation of messages, as
# Claude Code does (a user message per turn), where the default is one growing user message
LOADGEN_ARGS=${LOADGEN_ARGS:-}
TRACES=${TRACES:-.whl/traces/claude_code}
CONFIG=${CONFIG:-bench/configs/agents-h200.yaml}
SHAPE=${SHAPE:-llama-8b-chat}            # vLLM's model folder in bench/shapes (config + tokenizer) for its engine measures
SERVE_SHAPE=${SERVE_SHAPE:-$SHAPE}       # the one `vllm serve` serves for the agent steps (and its served name)
# bench/engine.py's --shape for ours: the very shape vLLM measures (llama-8b-chat's vocabulary is 49152, plain
# llama-8b's 128256: a larger lm_head to read every decode step, and other prompt ids)
ENGINE_SHAPE=${ENGINE_SHAPE:-$SHAPE}
# The token budget of a step on both sides: bench/engine.py's default, given to vLLM's offline run, to `vllm serve`
# and to `kvserve up` (KVSERVE_MAX_NUM_BATCHED_TOKENS over the config's; before e873209 ours's agent steps ran
# the config's, EngineConfig's 4096). vLLM's own default on an H200 is 16384: VLLM_MAX_BATCHED=0 measures that
# instead, ours then keeping its config's.
VLLM_MAX_BATCHED=${VLLM_MAX_BATCHED:-32768}
# ours' random draw for the engine measures: `uniform` is vLLM's dummy draw, which is what makes MoE routing (so
# the experts a decode step reads) alike on both sides; the dense Llama shape costs the same under either
RANDOM_WEIGHTS=${RANDOM_WEIGHTS:-normal}
VLLM_MAX_MODEL_LEN=${VLLM_MAX_MODEL_LEN:-131072}
VLLM_ARGS=${VLLM_ARGS:-}                 # more `vllm serve` flags (e.g. --kv-offloading-size 64)
ONLY_MEASURES=${ONLY_MEASURES:-}         # -engine phases: these measures of bench/peer_plan.py alone (e.g. the decodes)
PROBE_BLOCKS=${PROBE_BLOCKS:-25800}      # sim-calibrate's pool: an H100's for llama-8b (its 524K-token cases are skipped)
# vLLM's MoE routing for the DeepSeek shape: `uniform_random` (its VLLM_MOE_ROUTING_SIMULATION_STRATEGY) gives each
# token 6 experts at random, as ours routes under either random draw. Its own router cannot with dummy weights: the
# gate's bf16 logits are ~1e-5 apart, torch.softmax of bf16 logits returns bf16, and every one of the 64 scores
# rounds to exactly 2^-6, so top-k sees a 64-way tie and gives every token of a batch the same experts (vLLM 0.25's
# grouped_topk_router.py; its b16 decode, 4.3 ms, was under the 4.7 ms that reading the ~50 experts a layer that 16
# tokens hit takes at the H200's 4.8 TB/s). Recorded in vllm-engine.json's settings.
VLLM_ROUTING=${VLLM_ROUTING:-}
[ -n "$VLLM_ROUTING" ] && export VLLM_MOE_ROUTING_SIMULATION_STRATEGY=$VLLM_ROUTING
MAX_CONTEXT=${MAX_CONTEXT:-131072}       # the load generator's context window
PORT=${PORT:-8080}               # vLLM's port, and our gateway's (gateway_port in $CONFIG)
# our rank's /metrics, scraped after each of ours's steps (kvserve:l1_room_waits_total and the L1 counters)
RANK_METRICS_PORT=${RANK_METRICS_PORT:-9470}
export KVSERVE_RANK_WORKER_METRICS_PORT=$RANK_METRICS_PORT
TAG=${PEER_TAG:+-$PEER_TAG}
STATE=${PEER_STATE:-/tmp/peer-state$TAG}  # what this machine has done: outlives a call, not the machine
WORK=${PEER_WORK:-/tmp/peer-out$TAG}       # every raw result of this machine, packed into each phase's tarball
OURS_RUN=/tmp/kvserve-run                   # `kvserve up`'s state dir: its services' logs under logs/
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
source "$(dirname "$0")/run_folder.sh"
OUT=${OUT:-$(run_folder "peer-${SHAPE%-chat}")/raw$TAG}
mkdir -p "$OUT" "$STATE" "$WORK"
export PYTHONUNBUFFERED=1

# Our wheels (bench/gpu_kit.sh) when carried: the kvserve stack needs them, the load generator (httpx, rich)
# and vLLM's offline run do not. stack_lib.sh installs them into /tmp/site (PYTHONPATH) once per call.
have_kit() { ls .whl/*.whl >/dev/null 2>&1; }
if have_kit; then
  OUT=$WORK source "$(dirname "$0")/stack_lib.sh"
fi
# FlashInfer's wheels and prebuilt FA3 module when carried (.fi): attention_backend auto then takes it
if [ -d .fi ]; then source "$(dirname "$0")/fi_env.sh" || exit 1; fi
# flash-attn 4 when its chunks came (carry .fa4/chunk00 and chunk01, one a call, with the chunk phase): auto then takes it
# for our prefill. Not beside .fi: FA4 needs a newer tvm-ffi than the FlashInfer kit's, and it would shadow it.
# Again after the chunk phase, for a call that brings the last chunk and starts our stack (`chunk ours-agents`): on
# 2026-12-06 such a call set the environment before the chunk came, and the rank ran MLA prefill through SDPA.
FA4_ACC=${FA4_ACC:-/tmp/fa4acc}
FA4_LOADED=0
load_fa4() {
  [ "$FA4_LOADED" = 1 ] && return 0
  if ls "$FA4_ACC"/chunk0* >/dev/null 2>&1 && [ ! -d .fi ]; then
    source "$(dirname "$0")/fa4_env.sh" && FA4_LOADED=1
  fi
  return 0
}
load_fa4
export PYTHONPATH=${PYTHONPATH:-$PWD}

left() { echo $((DEADLINE - SECONDS)); }
# The seconds a command may take, keeping $1 seconds for what follows it and PACK_MARGIN for the packing; fails
# with a message when none are left (a DEADLINE below the reserve gave timeout a negative number)
run_for() {
  local budget=$(($(left) - PACK_MARGIN - $1))
  if [ "$budget" -le 0 ]; then
    say "not started: ${budget} s left after the ${1} s reserve and PACK_MARGIN (DEADLINE=$DEADLINE)" >&2
    return 1
  fi
  echo "$budget"
}
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
pack() {  # everything this machine measured so far, in one file per phase (a call returns at most 8 files)
  cp "$STATE"/vllm-serve.log "$WORK"/ 2>/dev/null || true
  tar czf "$OUT/$1.tar.gz" -C "$WORK" . 2>/dev/null || true
}
gpu_memory_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; }
wait_gpu_free() {  # the last engine's memory back before the next one sizes its KV cache from what is free
  for _ in $(seq 1 60); do
    used=$(gpu_memory_mib); [ -z "$used" ] || [ "$used" -lt 4096 ] && return 0
    sleep 1
  done
  say "GPU memory still in use: ${used} MiB"
}
group_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
servers() {  # vllm or ours: the pidfiles of that side's servers on this machine, this PEER_TAG's and every other's
  # (each tag's state dir is STATE's name with another tag: /tmp/peer-state, /tmp/peer-state-offload, ...)
  local base=${STATE%"$TAG"}
  echo "$STATE/$1.pid"
  ls -d "$base"*/"$1".pid 2>/dev/null | grep -vxF "$STATE/$1.pid" || true
}
stop_group() {  # pidfile, signal: the server's session leader first, then its whole process group
  group_alive "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill -"$2" "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$pid" 2>/dev/null || true
  rm -f "$1"
  wait_gpu_free
}

# --- compile caches ---
# vLLM's first start on a bare machine took 268 s for the DeepSeek shape, its next ones 41-63 s (2026-12-05, H100):
# torch.compile's artifacts and the Triton kernels it JIT-compiles (fused_moe and others; ours's too, and ours's FA4
# kernels, ~20 s of its 57 s start) are cached on disk and a
# machine starts bare every lease. `caches-out` sends them back in 15 MB parts (keep them in .caches/, ignored);
# carried with the `chunk` calls of a later lease (one part a call, beside a .peer chunk where they fit), they are
# unpacked once all have come (a partial set does not unpack and is left alone). Same GPU generation only (SM90:
# H100 and H200 alike); a cache from other code or settings is simply not hit.
CACHE_DIRS=(.cache/vllm .triton/cache .cache/flashinfer .cache/fa4-cute)  # the last: ours's FA4 (fa4_env.sh)
CACHE_ACC=${CACHE_ACC:-/tmp/cacheacc}  # the parts carried so far (and, once unpacked, $CACHE_ACC/restored)
caches_restore() {
  [ -f "$CACHE_ACC/restored" ] && return 0
  ls "$CACHE_ACC"/caches.part* >/dev/null 2>&1 || return 0
  if cat "$CACHE_ACC"/caches.part* | gzip -t 2>/dev/null && cat "$CACHE_ACC"/caches.part* | tar xzf - -C "$HOME"; then
    touch "$CACHE_ACC/restored" && say "compile caches restored: $(du -sh "$HOME/.cache/vllm" 2>/dev/null | cut -f1) of vLLM's"
  else
    say "the cache parts so far do not make a whole tarball: waiting for the rest"
  fi
}
caches_out() {
  local dirs=() d
  for d in "${CACHE_DIRS[@]}"; do [ -d "$HOME/$d" ] && dirs+=("$d"); done
  [ ${#dirs[@]} -gt 0 ] || { say "no compile caches on this machine"; return 0; }
  tar czf /tmp/caches.tar.gz -C "$HOME" "${dirs[@]}" || return 1
  local mb; mb=$(du -m /tmp/caches.tar.gz | cut -f1)
  if [ "$mb" -gt 105 ]; then  # a call sends back 8 files of 16 MiB at most: 7 parts and the phase's own tarball
    say "compile caches are ${mb} MB, more than a call sends back: not sent"
    return 0
  fi
  split -b 15M -d /tmp/caches.tar.gz "$OUT/caches.part" && say "compile caches: ${mb} MB in $(ls "$OUT"/caches.part* | wc -l) parts"
}

# --- vLLM ---
vllm_install() {
  [ -f /tmp/vsite/vllm/__init__.py ] && return 0
  ls /tmp/acc/chunk* >/dev/null 2>&1 || { say "no /tmp/acc/chunk*: send the chunks first (phase chunk)"; return 1; }
  say "installing vLLM from $(ls /tmp/acc | wc -l) chunks"
  rm -rf /tmp/vw /tmp/vsite
  python3 "$(dirname "$0")/unpack_chunks.py" /tmp/acc /tmp/vw || return 1  # a tar, or xz (bench/pack_chunks.py)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/vw/*.whl || return 1
  rm -rf /tmp/vw
  say "vLLM installed"
}
serve_flags() {  # on one line: VLLM_ARGS, and the step budget unless VLLM_MAX_BATCHED=0 asks for vLLM's default
  local budget=""
  [ "$VLLM_MAX_BATCHED" != 0 ] && budget="--max-num-batched-tokens $VLLM_MAX_BATCHED"
  echo "$VLLM_ARGS $budget"
}
vllm_up() { curl -sf -m 5 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; }
vllm_start() {  # in a session of its own: it outlives this call and keeps compiling into the next
  ours_stop  # first: our gateway answers /health on the same port
  group_alive "$STATE/vllm.pid" && return 0  # this PEER_TAG's server, up or still starting
  # A server of another PEER_TAG has other flags: stop it (on 2026-12-06 an offload run found the plain server,
  # whose last step had not finished, still answering on the port, and measured that)
  local pidfile
  for pidfile in $(servers vllm); do
    [ "$pidfile" != "$STATE/vllm.pid" ] && group_alive "$pidfile" && say "stopping another run's vllm serve ($pidfile)" && stop_group "$pidfile" TERM
  done
  vllm_up && { say "something other than this run's vllm serve answers on port $PORT"; return 1; }
  wait_gpu_free
  say "starting vllm serve"
  # shellcheck disable=SC2016  # $$ is the new session's own pid, written by the child
  PYTHONPATH=/tmp/vsite setsid bash -c 'echo $$ > '"$STATE"'/vllm.pid; exec python3 -m vllm.entrypoints.openai.api_server \
      --model bench/shapes/'"$SERVE_SHAPE"' --load-format dummy --dtype bfloat16 --served-model-name '"$SERVE_SHAPE"' \
      --max-model-len '"$VLLM_MAX_MODEL_LEN"' --gpu-memory-utilization 0.9 --max-num-seqs 128 --enable-prefix-caching \
      --enable-prompt-tokens-details --uvicorn-log-level warning --host 127.0.0.1 --port '"$PORT $(serve_flags)" \
    > "$STATE/vllm-serve.log" 2>&1 < /dev/null &
  sleep 2
}
vllm_wait() {  # until /health answers or only the packing margin is left
  while [ "$(left)" -gt "$PACK_MARGIN" ]; do
    vllm_up && { say "vllm serve is up"; return 0; }
    group_alive "$STATE/vllm.pid" || { say "vllm serve exited"; tail -n 40 "$STATE/vllm-serve.log"; return 1; }
    sleep 5
  done
  say "vllm serve not up yet: it goes on starting into the next call"
  return 1
}
vllm_stop() {  # this PEER_TAG's server and any other's: the next engine needs the GPU and the port
  local pidfile
  for pidfile in $(servers vllm); do
    group_alive "$pidfile" && say "stopping vllm serve ($pidfile)"
    stop_group "$pidfile" TERM
  done
}

# --- our stack ---
ours_up() { grep -qs "Ctrl-C" "$STATE/ours-up.log" && group_alive "$STATE/ours.pid"; }
ours_budget() {  # the environment that gives `kvserve up` vLLM's step budget (nothing where vLLM runs its default)
  [ "$VLLM_MAX_BATCHED" != 0 ] && echo "KVSERVE_MAX_NUM_BATCHED_TOKENS=$VLLM_MAX_BATCHED"
}
ours_start() {
  ours_up && return 0
  group_alive "$STATE/ours.pid" && return 0
  have_kit || { say "no wheels in .whl: our stack needs the kit (bench/gpu_kit.sh; carry .whl)"; return 1; }
  vllm_stop
  wait_gpu_free
  say "starting kvserve up"
  rm -rf "$OURS_RUN"
  # what the stack ran with beyond its config (an A/B's switch): the step files do not say it
  { env | grep '^KVSERVE_' | sort; ours_budget | tr ' ' '\n'; } > "$WORK/ours-env.txt"
  # shellcheck disable=SC2016
  # shellcheck disable=SC2046  # ours_budget's assignment, or nothing
  env $(ours_budget) setsid bash -c 'echo $$ > '"$STATE"'/ours.pid; exec python3 -m launcher.cli up --config '"$CONFIG"' --state-dir '"$OURS_RUN" \
    > "$STATE/ours-up.log" 2>&1 < /dev/null &
  sleep 2
}
ours_wait() {
  while [ "$(left)" -gt "$PACK_MARGIN" ]; do
    ours_up && { say "kvserve is up"; return 0; }
    group_alive "$STATE/ours.pid" || { say "kvserve up exited"; tail -n 40 "$STATE/ours-up.log"; return 1; }
    sleep 3
  done
  say "kvserve not up yet: it goes on starting into the next call"
  return 1
}
ours_stop() {  # this PEER_TAG's stack and any other's (they share the port, the GPU and OURS_RUN)
  # On 2026-12-06 a stack left up for its next step (another PEER_TAG) still answered on the port when vLLM's
  # call came, and its 80 GiB arena stayed in /dev/shm after a kill: stopped here with SIGINT, it removes it.
  local pidfile
  for pidfile in $(servers ours); do
    group_alive "$pidfile" || continue
    say "stopping kvserve ($pidfile)"
    stop_group "$pidfile" INT  # `kvserve up` stops every service on SIGINT
    # its logs come back with this call's tarball (another tag's own calls may never come)
    cp "$(dirname "$pidfile")/ours-up.log" "$WORK/" 2>/dev/null || true
    mkdir -p "$WORK/ours-logs" && cp -r "$OURS_RUN"/logs/. "$WORK/ours-logs/" 2>/dev/null || true
  done
}

# --- agent steps, the same for both sides ---
step_done() { grep -qsx "$2" "$STATE/$1-done"; }
# The rank's gauges every 2 s through a step, one line each: epoch seconds, then name value pairs. The scrape after the
# step sees the rank idle: what holds L0 while a step runs (copies in flight, running and waiting requests) shows only
# here. (The H100's L0 share at 44 agents, 30% against the simulator's 55%, came from the simulator's stale step-time
# calibration, not from copies in flight: bench/results/2026-12-07-cpu-simulate-paced-copies.)
sample_gauges() {  # file; runs until killed
  local pattern='^(kvserve:l0_cached_blocks|kvserve:l1_copies_in_flight|vllm:kv_cache_usage_perc|vllm:num_requests_(running|waiting))[{ ]'
  while sleep 2; do
    printf '%s' "$(date +%s)"
    curl -sf -m 2 "http://127.0.0.1:$RANK_METRICS_PORT/metrics" 2>/dev/null | grep -E "$pattern" \
      | sed -E 's/\{[^}]*\}//' | while read -r name value; do printf ' %s %s' "$name" "$value"; done
    echo
  done >> "$1"
}
run_steps() {  # side (vllm or ours), then extra load generator flags; 0 when every step is done
  local side=$1; shift
  local n attempt seed budget file sampler
  [ -d "$TRACES" ] || { say "no traces at $TRACES: carry .whl (or .whl/traces)"; return 1; }
  for n in ${STEPS//,/ }; do
    step_done "$side" "$n" && continue
    budget=$(($(left) - PACK_MARGIN))
    capped=0
    [ "$budget" -gt "$STEP_MAX" ] && budget=$STEP_MAX && capped=1
    if [ "$budget" -lt "$STEP_EST" ]; then
      say "$side: the $n-agent step is left for the next call (${budget} s left)"
      return 1
    fi
    attempt=$(grep -csx "$n" "$STATE/$side-tried" || true)
    echo "$n" >> "$STATE/$side-tried"
    seed=$((100 * ${attempt:-0} + n))  # the same prompts on both sides; a retry gets fresh ones (no stale cache)
    file=$WORK/$side-agents-$n
    say "$side: $n agents x $TURNS turns (seed $seed, at most $budget s)"
    sampler=""
    if [ "$side" = ours ]; then
      sample_gauges "$file.rank-gauges.txt" &
      sampler=$!
    fi
    timeout -k 20 -s INT "$budget" python3 -m loadgen.agents_cli --url "http://127.0.0.1:$PORT" \
      --trace-path "$TRACES" --agents "$n" --turns "$TURNS" --max-output-tokens "$MAX_OUT" \
      --context-scale "$CONTEXT_SCALE" --max-context "$MAX_CONTEXT" --seed "$seed" --no-charts --quiet \
      --out "$file.json" "$@" > "$file.log" 2>&1
    [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
    tail -n 8 "$file.log"
    if [ "$side" = ours ]; then
      # the rank's counters after the step (cumulative: restored tokens, room waits, preemptions)
      curl -sf -m 5 "http://127.0.0.1:$RANK_METRICS_PORT/metrics" > "$file.rank-metrics.txt" 2>/dev/null
      # and where its warm calls lost cache hits (L0 / L1 split per call, from the rank's log): a failing step's
      # cause comes back with it (2026-12-06: L1's capacity at 40 agents, found by hand after the lease)
      python3 "$(dirname "$0")/cache_losses.py" "$file.json" "$OURS_RUN"/logs/rank-worker-0.log \
        --json "$file.losses.json" --top 5 > "$file.losses.txt" 2>&1 || true
    fi
    if python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["steps"] else 1)' "$file.json" 2>/dev/null; then
      echo "$n" >> "$STATE/$side-done"
    elif [ "$capped" = 1 ]; then
      # Not this call's deadline but the step's own: N agents overload the side. Not retried; it fails, and
      # the marker says so to bench/peer_results.py (the load generator's JSON of a stopped step has no step).
      say "$side: the $n-agent step did not finish in STEP_MAX=${STEP_MAX} s: it fails, the next step goes on"
      printf '{"side": "%s", "agents": %s, "step_max_s": %s, "seed": %s, "date": "%s"}\n' \
        "$side" "$n" "$STEP_MAX" "$seed" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$file.unfinished.json"
      echo "$n" >> "$STATE/$side-done"
    else
      say "$side: the $n-agent step did not finish"
      return 1
    fi
  done
  say "$side: all steps done ($STEPS)"
}

agents_part() {  # side: its server started if need be, the steps left in this call's time, stopped when all are done
  case $1 in
    # shellcheck disable=SC2086  # LOADGEN_ARGS: its words are the load generator's flags
    vllm) vllm_install && vllm_start && vllm_wait && run_steps vllm --api "$AGENT_API" $LOADGEN_ARGS && vllm_stop ;;
    # shellcheck disable=SC2086
    ours) ours_start && ours_wait && run_steps ours --api "$AGENT_API" $LOADGEN_ARGS && ours_stop ;;
  esac
}

phase() {
  case $1 in
    chunk)
      mkdir -p /tmp/acc
      for c in .peer/chunk*; do
        [ -f "$c" ] || continue
        cp "$c" /tmp/acc/ && say "$c -> /tmp/acc ($(du -m "$c" | cut -f1) MB)"
      done
      for c in .fa4/chunk*; do  # flash-attn 4's kit (bench/fa4_kit.sh), for ours
        [ -f "$c" ] || continue
        mkdir -p "$FA4_ACC" && cp "$c" "$FA4_ACC"/ && say "$c -> $FA4_ACC ($(du -m "$c" | cut -f1) MB)"
      done
      for c in .caches/caches.part*; do  # the compile caches an earlier lease sent back (phase caches-out)
        [ -f "$c" ] || continue
        mkdir -p "$CACHE_ACC" && cp "$c" "$CACHE_ACC"/ && say "$c -> $CACHE_ACC ($(du -m "$c" | cut -f1) MB)"
      done
      caches_restore
      load_fa4
      ls -la /tmp/acc "$FA4_ACC" "$CACHE_ACC" 2>/dev/null || true  # (a folder not made yet is no failure)
      ;;
    caches-out)
      caches_out
      ;;
    vllm-engine)
      ours_stop
      vllm_stop
      vllm_install || return 1
      wait_gpu_free
      say "bench/peer_vllm.py"
      rm -f "$WORK/vllm-engine.json" "$WORK/vllm-engine.log"  # a failed run must not pass off an earlier call's files
      budget=$(run_for 60) &&
      timeout -k 20 "$budget" env PYTHONPATH=/tmp/vsite python3 bench/peer_vllm.py \
        --shape "$SHAPE" --commit "$COMMIT" --max-num-batched-tokens "$VLLM_MAX_BATCHED" ${ONLY_MEASURES:+--only-measures "$ONLY_MEASURES"} \
        --out "$WORK/vllm-engine.json" > "$WORK/vllm-engine.log" 2>&1
      tail -n 20 "$WORK/vllm-engine.log"
      cp "$WORK/vllm-engine.json" "$OUT/" 2>/dev/null || say "no vllm-engine.json"
      wait_gpu_free
      [ "${ENGINE_ONLY:-0}" != 1 ] && [ "$(left)" -gt 60 ] && agents_part vllm  # the server's start-up goes on into the next call
      pack vllm-engine
      ;;
    vllm-agents | vllm-serve-start)
      agents_part vllm
      pack "$1"
      ;;
    ours-engine | ours)
      vllm_stop
      ours_stop
      wait_gpu_free
      say "bench/engine.py --shape $ENGINE_SHAPE"
      rm -f "$WORK/ours-engine.json" "$WORK/ours-engine.log"  # a failed run must not pass off an earlier call's files
      budget=$(run_for 120) &&
      timeout -k 20 "$budget" python3 bench/engine.py --shape "$ENGINE_SHAPE" --commit "$COMMIT" \
        --random-weights "$RANDOM_WEIGHTS" ${ONLY_MEASURES:+--only-measures "$ONLY_MEASURES"} \
        --out "$WORK/ours-engine.json" > "$WORK/ours-engine.log" 2>&1
      tail -n 30 "$WORK/ours-engine.log"
      if [ -f "$WORK/ours-engine.json" ] && [ -z "${ONLY_MEASURES:-}" ]; then
        say "bench/engine.py --dtype float32 --only-match"
        budget=$(run_for 30) &&
        timeout -k 20 "$budget" python3 bench/engine.py --shape "$ENGINE_SHAPE" --dtype float32 \
          --random-weights "$RANDOM_WEIGHTS" --only-match --merge-into "$WORK/ours-engine.json" > "$WORK/ours-match-float32.log" 2>&1
        tail -n 3 "$WORK/ours-match-float32.log"
      fi
      cp "$WORK/ours-engine.json" "$OUT/" 2>/dev/null || say "no ours-engine.json"
      wait_gpu_free
      [ "${ENGINE_ONLY:-0}" != 1 ] && [ "$(left)" -gt 60 ] && agents_part ours
      pack "$1"
      ;;
    ours-agents)
      agents_part ours
      pack ours-agents
      ;;
    sim-calibrate)
      # the simulator's decode model on this GPU (simulator/decode_probe.py), against this call's engine run where
      # ours-engine ran before it on this machine: with ours-engine.json, `kvserve bench simulate --engine-results
      # ours-engine.json --decode-results decode-probe.json` replays at this engine's speed (its calibration of
      # 2026-11-29 ran cold prompts twice as slowly as the H100: bench/results/2026-12-07-cpu-simulate-paced-copies)
      vllm_stop
      ours_stop
      wait_gpu_free
      engine_json=simulator/results/engine-h200.json
      [ -f "$WORK/ours-engine.json" ] && engine_json=$WORK/ours-engine.json
      say "simulator/decode_probe.py --shape $ENGINE_SHAPE --num-blocks $PROBE_BLOCKS (model: $engine_json)"
      rm -f "$WORK/decode-probe.json" "$WORK/decode-probe.log"
      budget=$(run_for 10) &&
      timeout -k 20 "$budget" "${PYTHON:-python3}" -m simulator.decode_probe --shape "$ENGINE_SHAPE" --num-blocks "$PROBE_BLOCKS" \
        --engine-results "$engine_json" --out "$WORK/decode-probe.json" > "$WORK/decode-probe.log" 2>&1
      tail -n 30 "$WORK/decode-probe.log"
      cp "$WORK/decode-probe.json" "$OUT/" 2>/dev/null || say "no decode-probe.json"
      pack sim-calibrate
      ;;
    stop)
      vllm_stop
      ours_stop
      pack stop
      ;;
    status)
      say "vLLM installed: $([ -f /tmp/vsite/vllm/__init__.py ] && echo yes || echo no); chunks: $(ls /tmp/acc 2>/dev/null | tr '\n' ' ')"
      say "vllm serve: $(vllm_up && echo up || (group_alive "$STATE/vllm.pid" && echo starting) || echo down)"
      say "kvserve: $(ours_up && echo up || (group_alive "$STATE/ours.pid" && echo starting) || echo down)"
      say "steps done: vllm $(cat "$STATE/vllm-done" 2>/dev/null | tr '\n' ' '); ours $(cat "$STATE/ours-done" 2>/dev/null | tr '\n' ' ')"
      say "GPU memory used: $(gpu_memory_mib) MiB"
      say "flash-attn 4 for our prefill: $([ "$FA4_LOADED" = 1 ] && echo on || echo off)"
      say "step budget: vllm serve ${VLLM_MAX_BATCHED/#0/its default}; kvserve up ${VLLM_MAX_BATCHED/#0/its config\'s} ($(ours_budget))"
      ;;
    *) echo "unknown phase $1 (chunk, vllm-engine, vllm-agents, ours-engine, ours-agents, sim-calibrate, caches-out, status, stop)"; return 2 ;;
  esac
}

[ $# -gt 0 ] || { echo "usage: bash bench/peer_h200.sh PHASE [PHASE...]"; exit 2; }
nvidia-smi --query-gpu=name --format=csv,noheader > "$WORK/gpu.txt" 2>/dev/null || true
# what this machine's code is, in every tarball: the commit and the hash of its uncommitted diff (loadgen/provenance.py)
python3 "$(dirname "$0")/../loadgen/provenance.py" . > "$WORK/provenance.json" 2>/dev/null ||
  echo "commit $COMMIT" > "$WORK/provenance.json"
status=0
for p in "$@"; do
  phase "$p" || status=$?
done
exit $status
