#!/usr/bin/env bash
# One GRPO run over every GPU of this host, one process: bash launch/multi_gpu.sh CONFIG [k=v ...]
# The mesh covers all visible GPUs (mesh.data=-1 fills what mesh.fsdp * mesh.tensor leave);
# e.g. 8 GPUs with mesh.fsdp=8 shard the base and the adapter's optimizer state 8 ways.
set -euo pipefail
config=${1:?usage: launch/multi_gpu.sh CONFIG [key=value ...]}
shift
# XLA's GPU allocator hands out a fixed share of each card (0.75 when no variable sets it,
# XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION); take 0.90 and leave the rest
# to the CUDA context and libraries. `jaxrl plan --device-memory GIB` fits against the same share.
if [ -z "${XLA_CLIENT_MEM_FRACTION:-}${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]; then
  export XLA_CLIENT_MEM_FRACTION=0.90
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec jaxrl train --config "$config" "$@"
