#!/usr/bin/env bash
# One GRPO run on every worker of a Cloud TPU VM slice (v5e-16, v5p-128, ...):
#   TPU_NAME=my-pod ZONE=us-central2-b bash launch/tpu_pod.sh CONFIG [key=value ...]
# Runs the same command on all workers (gcloud ... ssh --worker=all). Each worker joins the
# others through jax.distributed (JAXRL_DISTRIBUTED=1: TPU VMs describe the slice themselves),
# samples and scores the rows its chips hold (hosts whose chips share a batch shard do so
# alike), and process 0 writes the run log. The repository must be at $REPO on every worker
# (e.g. cloned by the slice's startup script), the model at a path every worker can read, and
# run.output_dir on storage every worker mounts (NFS, Filestore, gcsfuse) for checkpoints.
# Check the plan first: jaxrl plan --config CONFIG --topology v5e:4x4
#
# Installing: on each worker, `pip install -e '.[tpu]'` (jax, jaxlib and libtpu at the versions
# setup.py pins) runs when setup.py differs from the one installed last, whose sha256 is kept in
# $REPO/.jaxrl-installed; every later launch goes straight to training. JAXRL_REINSTALL=1
# installs again. Each worker prints the versions it runs before it joins.
set -euo pipefail
config=${1:?usage: TPU_NAME=... ZONE=... launch/tpu_pod.sh CONFIG [key=value ...]}
shift
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
REPO=${REPO:-~/jaxrl}
args=$(printf ' %q' "$config" "$@")
remote="set -e
cd $REPO
want=\$(sha256sum setup.py | cut -d' ' -f1)
if [ ${JAXRL_REINSTALL:-0} = 1 ] || [ \"\$(cat .jaxrl-installed 2>/dev/null)\" != \"\$want\" ]; then
  pip install -q -e '.[tpu]'
  echo \"\$want\" > .jaxrl-installed
fi
python -c 'import jax, jaxlib, libtpu, socket; print(socket.gethostname(), \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"libtpu\", libtpu.__version__)'
JAXRL_DISTRIBUTED=1 jaxrl train$args"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"} \
  --worker=all --command "$remote"
