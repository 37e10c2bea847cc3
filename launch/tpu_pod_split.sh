#!/usr/bin/env bash
# A split rlx run on Cloud TPU as jobs: the learner job on every worker of one slice (joined
# by jax.distributed through the TPU metadata server), and one generator job on each of
# the single-host TPU VMs listed (a generator job is one process). They share only the
# workdir, which must be on storage all of them see (NFS / Filestore, or GCS through
# gcsfuse): weights go as Orbax versions in WORKDIR/policy_versions, rollouts as files in
# WORKDIR/rollouts; generator job g of M writes rollouts g, g + M, ... from every M-th prompt.
#
#   LEARNER_TPU=my-v5p-32 GENERATOR_TPUS=gen-v6e-8-a,gen-v6e-8-b ZONE=us-east5-a \
#     launch/tpu_pod_split.sh --config configs/dapo_split.py --workdir /mnt/shared/runs/dapo \
#       --config.model.path=/mnt/shared/models/Qwen3-8B
#
# Exits with a failing job's status.
set -euo pipefail
source "$(dirname "$0")/wait_all.sh"
: "${LEARNER_TPU:?set LEARNER_TPU}" "${GENERATOR_TPUS:?set GENERATOR_TPUS}" "${ZONE:?set ZONE}"
IFS=, read -r -a generators <<< "$GENERATOR_TPUS"
args=$(printf '%q ' "$@")
common="--config.mesh.mode=split --config.mesh.weight_sync=delta --config.mesh.generators=${#generators[@]}"
pids=()
gcloud compute tpus tpu-vm ssh "$LEARNER_TPU" --zone "$ZONE" --worker=all --command \
  "cd ~/rlx && python -m rlx.main $args $common --config.mesh.role=learner --config.mesh.multihost=true" &
pids+=($!)
RLX_ROLES[$!]="the learner on $LEARNER_TPU"
for g in "${!generators[@]}"; do
  gcloud compute tpus tpu-vm ssh "${generators[$g]}" --zone "$ZONE" --worker=0 --command \
    "cd ~/rlx && python -m rlx.main $args $common --config.mesh.role=generator --config.mesh.generator_id=$g" &
  pids+=($!)
  RLX_ROLES[$!]="the generator $g on ${generators[$g]}"
done
# a failed job stops the others' ssh sessions at once (and with them their processes); a job
# that loses its peer without that signal stops itself (config.mesh.job_timeout_s)
status=0
wait_all "${pids[@]}" || status=$?
exit "$status"
