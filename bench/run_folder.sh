# The default results folder of a benchmark script, sourced by bench/agents_h200.sh, bench/ranks_h200.sh and
# bench/peer_h200.sh: bench/results/<date>-<machine>-<bench>, one folder per run (bench/results/README.md).
run_folder() {  # bench name, e.g. agents or peer-llama-8b
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  gpu=${gpu#NVIDIA }
  gpu=${gpu%% *}
  echo "bench/results/$(date -u +%F)-$(echo "${gpu:-cpu}" | tr '[:upper:]' '[:lower:]')-$1"
}
