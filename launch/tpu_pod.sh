#!/usr/bin/env bash
# rlx on a Cloud TPU pod slice: the same command on every worker; jax.distributed
# finds the other workers through the TPU metadata server. The workdir and the
# model must be on storage every worker sees (GCS through gcsfuse, or NFS). Colocated: every
# worker samples its share of each prompt batch, then one SPMD update over the whole slice.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh --config configs/grpo_colocated.py \
#       --workdir /mnt/shared/runs/grpo --config.model.path=/mnt/shared/models/Qwen3-8B
#
# Every worker needs rlx installed with JAX's TPU plugin: INSTALL=1 copies this checkout to
# ~/rlx on each worker and installs it (pip install -e ".[tpu]" -c constraints.txt) first.
#
# On GKE, run `python -m rlx.main ... --config.mesh.multihost=true` in each pod of a
# JobSet; the GKE TPU environment is detected the same way.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
if [ "${INSTALL:-0}" = 1 ]; then
  checkout=$(cd "$(dirname "$0")/.." && pwd)
  archive=$(mktemp --suffix=.tgz)
  tar -C "$checkout" --exclude=.venv --exclude=.git -czf "$archive" .
  gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":rlx.tgz --zone "$ZONE" --worker=all
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
    "mkdir -p ~/rlx && tar -xzf ~/rlx.tgz -C ~/rlx && cd ~/rlx && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]' -c constraints.txt"
  rm -f "$archive"
fi
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all \
  --command "cd ~/rlx && { [ -x .venv/bin/python ] && . .venv/bin/activate || true; } && python -m rlx.main $args --config.mesh.multihost=true"
