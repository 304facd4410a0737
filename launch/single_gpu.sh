#!/usr/bin/env bash
# One GRPO run on one GPU: bash launch/single_gpu.sh CONFIG [key=value ...]
# GPU selects the device (default 0). The sampler and train step run unsharded on it.
set -euo pipefail
config=${1:?usage: launch/single_gpu.sh CONFIG [key=value ...]}
shift
export CUDA_VISIBLE_DEVICES=${GPU:-0}
# XLA's GPU allocator hands out a fixed share of each card (0.75 when no variable sets it,
# XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION); take 0.90 and leave the rest
# to the CUDA context and libraries. `jaxrl plan --device-memory GIB` fits against the same share.
if [ -z "${XLA_CLIENT_MEM_FRACTION:-}${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]; then
  export XLA_CLIENT_MEM_FRACTION=0.90
fi
# allocate as programs need (up to that share) rather than all of it up front
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec jaxrl train --config "$config" "$@"
