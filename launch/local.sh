#!/usr/bin/env bash
# Runs rlx as N processes on this machine (CPU collectives over gloo), the way a
# multi-host job runs: one JAX process per host, joined by jax.distributed.
#
#   launch/local.sh 2 --config configs/grpo_colocated.py --workdir /tmp/rlx-2proc
#
# Each process gets config.mesh.cpu_devices CPU devices (8 unless overridden).
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES --config FILE --workdir DIR [overrides]}
shift
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
