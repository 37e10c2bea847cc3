#!/usr/bin/env bash
# Runs rlx as N processes on this machine (CPU collectives over gloo), the way a
# multi-host job runs: one JAX process per host, joined by jax.distributed, colocated.
#
#   launch/local.sh --processes 2 --config configs/grpo_colocated.py --workdir /tmp/rlx-2proc \
#       --config.mesh.cpu_devices=1
#
# What it starts: N copies of `python -m rlx.main ARGS --config.mesh.multihost=true`, with
# JAX_COORDINATOR_ADDRESS (a free local port), JAX_NUM_PROCESSES and JAX_PROCESS_ID set.
# Each process samples its share of every prompt batch on its own devices
# (config.mesh.cpu_devices each, 8 unless overridden) and all of them join one SPMD
# update over every device; process 0 prints and writes the metrics. Exits with the first
# failing process's status; Ctrl-C reaches every process (each saves and stops).
set -euo pipefail
usage="usage: launch/local.sh --processes N --config FILE --workdir DIR [--config.a.b=value ...]"
if [ "${1:-}" = "--processes" ]; then
  n=${2:?$usage}
  shift 2
else
  n=${1:?$usage}
  shift
fi
port=${RLX_COORDINATOR_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
pids=()
for ((i = 0; i < n; i++)); do
  JAX_COORDINATOR_ADDRESS="localhost:${port}" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i" \
    python -m rlx.main "$@" --config.mesh.multihost=true &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
