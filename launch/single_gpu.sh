#!/usr/bin/env bash
# One GRPO run on one GPU: bash launch/single_gpu.sh CONFIG [key=value ...]
# GPU selects the device (default 0). The sampler and train step run unsharded on it.
set -euo pipefail
config=${1:?usage: launch/single_gpu.sh CONFIG [key=value ...]}
shift
export CUDA_VISIBLE_DEVICES=${GPU:-0}
# XLA reserves 75% of GPU memory up front by default; the planner's figures are what the run
# needs, so let it take what it needs instead
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec jaxrl train --config "$config" "$@"
