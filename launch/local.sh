#!/usr/bin/env bash
# Runs rlx as several processes on this machine (CPU collectives over gloo), the way a
# multi-host job runs: one JAX process per host, joined by jax.distributed.
#
# Colocated across N processes:
#   launch/local.sh --processes 2 --config configs/grpo_colocated.py --workdir /tmp/rlx-2proc \
#       --config.mesh.cpu_devices=1
#   starts N copies of `python -m rlx.main ARGS --config.mesh.multihost=true` with
#   JAX_COORDINATOR_ADDRESS (a free local port), JAX_NUM_PROCESSES and JAX_PROCESS_ID set.
#   Each process samples its share of every prompt batch on its own devices
#   (config.mesh.cpu_devices each, 8 unless overridden); all join one SPMD update.
#
# Split as jobs, a learner job of N processes and M generator jobs of one process each:
#   launch/local.sh --learner 1 --generator 1 --config configs/dapo_split.py \
#       --workdir /tmp/rlx-jobs --config.mesh.cpu_devices=1
#   starts `python -m rlx.main ARGS --config.mesh.role=learner --config.mesh.weight_sync=delta`
#   (N > 1: joined by their own coordinator) and M times the same with role=generator and
#   --config.mesh.generator_id=0..M-1 (all with --config.mesh.generators=M). The jobs share
#   only the workdir: weights as Orbax versions, rollouts as files; generator job g writes
#   rollouts g, g + M, ... from every M-th prompt.
#
# Process 0 of each job prints. As soon as any process fails, the others are stopped (SIGTERM:
# each saves and stops; SIGKILL after 60 s) and this script exits with the failed process's
# status; otherwise it returns when all have finished. Ctrl-C reaches every process (each
# saves and stops).
set -euo pipefail
source "$(dirname "$0")/wait_all.sh"
usage="usage: launch/local.sh (--processes N | --learner N --generator M) --config FILE --workdir DIR [--config.a.b=value ...]"
processes=0 learner=0 generator=0
while [ $# -gt 0 ]; do
  case "$1" in
    --processes) processes=${2:?$usage}; shift 2 ;;
    --learner) learner=${2:?$usage}; shift 2 ;;
    --generator) generator=${2:?$usage}; shift 2 ;;
    [0-9]*) processes=$1; shift ;;
    *) break ;;
  esac
done
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
pids=()
# start_job NAME N ARGS...: N processes of one job (joined by jax.distributed when N > 1)
start_job() {
  local name=$1 n=$2 port
  shift 2
  if [ "$n" -eq 1 ]; then
    python -m rlx.main "$@" &
    pids+=($!)
    RLX_ROLES[$!]="$name"
    return
  fi
  port=$(free_port)
  for ((i = 0; i < n; i++)); do
    JAX_COORDINATOR_ADDRESS="localhost:${port}" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i" \
      python -m rlx.main "$@" --config.mesh.multihost=true &
    pids+=($!)
    RLX_ROLES[$!]="$name (process $i)"
  done
}
if [ "$learner" -gt 0 ] || [ "$generator" -gt 0 ]; then
  if [ "$learner" -lt 1 ] || [ "$generator" -lt 1 ]; then echo "$usage" >&2; exit 2; fi
  start_job "the learner" "$learner" "$@" --config.mesh.mode=split --config.mesh.role=learner \
    --config.mesh.weight_sync=delta --config.mesh.generators="$generator"
  for ((g = 0; g < generator; g++)); do
    start_job "the generator $g" 1 "$@" --config.mesh.mode=split --config.mesh.role=generator \
      --config.mesh.weight_sync=delta --config.mesh.generators="$generator" \
      --config.mesh.generator_id="$g"
  done
elif [ "$processes" -gt 0 ]; then
  port=${RLX_COORDINATOR_PORT:-$(free_port)}
  for ((i = 0; i < processes; i++)); do
    JAX_COORDINATOR_ADDRESS="localhost:${port}" JAX_NUM_PROCESSES="$processes" JAX_PROCESS_ID="$i" \
      python -m rlx.main "$@" --config.mesh.multihost=true &
    pids+=($!)
    RLX_ROLES[$!]="process $i"
  done
else
  echo "$usage" >&2
  exit 2
fi
status=0
wait_all "${pids[@]}" || status=$?
exit "$status"
