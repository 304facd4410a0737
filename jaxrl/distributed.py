"""Multi-process runs: joining the processes, and moving batch rows between a process's host
memory and the global arrays the jitted programs see.

Every process runs the same command. Each one owns a contiguous block of the global batch rows:
the rows its devices hold under the batch sharding (jaxrl/sharding.py). It samples, detokenizes
and scores those rows itself; prompts are assigned whole, so all G completions of a prompt stay
on one process. The few numbers that need every row (group advantages under `batch` scaling,
metrics) are gathered on the host, which costs a handful of floats per row.

Joining (`initialize_from_env`):
  JAX_COORDINATOR_ADDRESS=host:port JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i   explicit
  JAXRL_DISTRIBUTED=1   JAX's own detection (TPU VM pod slices, SLURM, Open MPI)
  neither               one process
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.config import MeshConfig
from jaxrl.hf import load as hf_load
from jaxrl.model.params import unflatten
from jaxrl.quant.qparams import dequantize_params
from jaxrl.sharding import MeshRules, make_mesh, param_shardings, place


class DistributedError(RuntimeError):
    """The processes of a multi-process run cannot be joined or do not agree."""


def initialize_from_env(env=os.environ) -> None:
    """Joins the other processes as the environment says (module docstring); idempotent."""
    if jax.distributed.is_initialized():
        return
    address = env.get("JAX_COORDINATOR_ADDRESS")
    if address:
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(k)]
        if missing:
            raise DistributedError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not; "
                                   "set all three (address host:port, process count, this id)")
        jax.distributed.initialize(address, int(env["JAX_NUM_PROCESSES"]),
                                   int(env["JAX_PROCESS_ID"]))
    elif env.get("JAXRL_DISTRIBUTED", "0") not in ("", "0"):
        jax.distributed.initialize()


def local_rows(rules: MeshRules | None, global_rows: int) -> tuple[int, int]:
    """[start, stop) of the global batch rows this process holds (all of them in one process)."""
    if rules is None or jax.process_count() == 1:
        return 0, global_rows
    sharding = rules.rows((global_rows,))
    if global_rows % rules.batch_ways:
        raise DistributedError(f"{global_rows} rows do not split over the {rules.batch_ways} "
                               "batch shards (mesh.data * mesh.fsdp); with several processes "
                               "every process must hold its own rows")
    spans = sorted({(i[0].start or 0, i[0].stop or global_rows)
                    for i in sharding.addressable_devices_indices_map((global_rows,)).values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise DistributedError(f"this process's rows {spans} are not contiguous; lay the mesh "
                               "out so that mesh.tensor stays within one host")
    return start, stop


def rows_to_global(rules: MeshRules, tree):
    """This process's rows [R, ...] (numpy) -> global arrays [R * processes, ...] split by
    rows; with one process, a device_put onto the row sharding."""
    def put(local):
        local = np.asarray(local)
        shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
        return jax.make_array_from_process_local_data(rules.rows(shape), local, shape)
    return jax.tree_util.tree_map(put, tree)


def rows_to_local(tree):
    """Global arrays split by rows -> numpy arrays of this process's rows, in row order."""
    def get(x):
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        blocks = {}
        for shard in x.addressable_shards:
            blocks.setdefault(shard.index[0].start or 0, shard.data)
        return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])
    return jax.tree_util.tree_map(get, tree)


def host_max(value: int) -> int:
    """The largest `value` over all processes (every process calls it)."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.int64(value))))


def gather_rows(local: np.ndarray, start: int) -> np.ndarray:
    """Every process's rows [R, ...] (starting at global row `start`) -> all rows in order."""
    if jax.process_count() == 1:
        return local
    starts = multihost_utils.process_allgather(np.int64(start))
    blocks = multihost_utils.process_allgather(local)  # [processes, R, ...]
    return np.concatenate([blocks[i] for i in np.argsort(starts)])


def combine_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Per-process metrics of equal row counts -> the run's: maxima of `*_max`, means of the
    rest (every process calls it with the same keys)."""
    if jax.process_count() == 1:
        return metrics
    keys = sorted(metrics)
    values = multihost_utils.process_allgather(np.array([metrics[k] for k in keys], np.float64))
    return {k: float(values[:, i].max() if k.endswith("_max") else values[:, i].mean())
            for i, k in enumerate(keys)}


def session_rules(cfg: MeshConfig) -> MeshRules | None:
    """Joins the other processes, then the run's mesh over every device; None runs on one
    device. On CPU one process shards only when the config asks (mesh.data set, or fsdp or
    tensor above 1): its CPU devices share one memory and one set of cores, so splitting over
    them adds partitioning and nothing else (tests fake 8 of them)."""
    initialize_from_env()
    asked = (cfg.data, cfg.fsdp, cfg.tensor) != (-1, 1, 1)
    single_cpu = jax.process_count() == 1 and jax.default_backend() == "cpu" and not asked
    if jax.device_count() == 1 or single_cpu or (cfg.data, cfg.fsdp, cfg.tensor) == (1, 1, 1):
        return None
    return MeshRules(make_mesh(cfg))


def prompt_slice(rules: MeshRules | None, prompts: int, group: int) -> slice:
    """The prompts of a step this process samples: those whose `group` rows it holds."""
    start, stop = local_rows(rules, prompts * group)
    if start % group or stop % group:
        raise DistributedError(
            f"this process holds rows [{start}, {stop}), which split a group of {group}; all "
            "completions of a prompt must be on one process: make data.prompts_per_step a "
            "multiple of the process count")
    return slice(start // group, stop // group)


def load_params(model_dir, spec, dtype, quant, rules: MeshRules | None):
    """The checkpoint's params on the mesh. Every process reads and quantizes each tensor
    whole (double quantization's statistics span a tensor) and transfers to its devices only
    the slices they hold; without a mesh, `jaxrl.hf.load.load_params`."""
    if rules is None:
        return hf_load.load_params(model_dir, spec, dtype, quant)[1]
    host = unflatten(hf_load.load_host_params(model_dir, spec, np.dtype(dtype), quant))
    return place(host, param_shardings(rules, host, spec))


def dequantized(params, dtype, spec, rules: MeshRules | None):
    """`dequantize_params`, the dense kernels laid out as the mesh holds them."""
    dense = dequantize_params(params, dtype)
    return dense if rules is None else jax.device_put(dense, param_shardings(rules, dense, spec))


def to_device(rules: MeshRules | None, tree):
    """This process's rows onto the devices: global arrays on a mesh, else plain arrays."""
    return jax.tree_util.tree_map(jnp.asarray, tree) if rules is None else rows_to_global(
        rules, tree)
