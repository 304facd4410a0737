#!/usr/bin/env bash
# One GRPO run on every worker of a Cloud TPU VM slice (v5e-16, v5p-128, ...):
#   TPU_NAME=my-pod ZONE=us-central2-b bash launch/tpu_pod.sh CONFIG [key=value ...]
# Runs the same command on all workers (gcloud ... ssh --worker=all). Each worker joins the
# others through jax.distributed (JAXRL_DISTRIBUTED=1: TPU VMs describe the slice themselves),
# samples and scores its own prompts, and process 0 writes the run log. The repository must be
# at $REPO on every worker (e.g. cloned by the slice's startup script) and the model at a path
# every worker can read. Check the plan first: jaxrl plan --config CONFIG --topology v5e:4x4
set -euo pipefail
config=${1:?usage: TPU_NAME=... ZONE=... launch/tpu_pod.sh CONFIG [key=value ...]}
shift
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
REPO=${REPO:-~/jaxrl}
args=$(printf ' %q' "$config" "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"} \
  --worker=all \
  --command "cd $REPO && pip install -q -e '.[tpu]' && JAXRL_DISTRIBUTED=1 jaxrl train$args"
