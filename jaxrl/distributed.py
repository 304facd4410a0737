"""Multi-process runs: joining the processes, and moving batch rows between a process's host
memory and the global arrays the jitted programs see.

Every process runs the same command. Each one holds a contiguous block of the global batch rows:
the rows its devices hold under the batch sharding (jaxrl/sharding.py). It samples, detokenizes
and scores those rows itself; prompts are assigned whole, so all G completions of a prompt stay
on one process. The few numbers that need every row (group advantages under `batch` scaling,
metrics) are gathered on the host, which costs a handful of floats per row.

Processes that share rows. When a batch shard spans several hosts (mesh.fsdp * mesh.tensor
wider than a host's devices, e.g. tensor 8 over hosts of 4 chips), those hosts hold the same
rows. They feed them identically: each queues the same prompts with the same keys, so the
engine's programs see one value per shard, and each scores them. Wherever rows from all
processes meet (`gather_rows`, `gather_row_lists`), a block counts once, taken from the
lowest-numbered process that holds it, so a reward that differs between two scorings (an LLM
judge) cannot make processes disagree. A layout in which two processes hold overlapping but
different rows, or one process holds rows that are not contiguous, is refused at start
(`check_layout`, also run by `jaxrl plan`).

Joining (`initialize_from_env`):
  JAX_COORDINATOR_ADDRESS=host:port JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i   explicit
  JAXRL_DISTRIBUTED=1   JAX's own detection (TPU VM pod slices, SLURM, Open MPI)
  neither               one process
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.config import ConfigError, MeshConfig
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


@functools.lru_cache(maxsize=None)
def batch_shards(rules: MeshRules) -> dict[int, tuple[int, ...]]:
    """process index -> the batch shards its devices hold (row-major over the batch's mesh
    axes; shard k holds rows [k * R / ways, (k + 1) * R / ways) of R rows)."""
    names, axes = rules.mesh.axis_names, rules.mesh_axes("batch")
    sizes = [rules.mesh.shape[a] for a in axes]
    held: dict[int, set[int]] = {}
    for index, device in np.ndenumerate(rules.mesh.devices):
        shard = int(np.ravel_multi_index([index[names.index(a)] for a in axes], sizes)
                    ) if axes else 0
        held.setdefault(device.process_index, set()).add(shard)
    return {p: tuple(sorted(s)) for p, s in sorted(held.items())}


@functools.lru_cache(maxsize=None)
def check_layout(rules: MeshRules) -> None:
    """ConfigError unless every process holds a contiguous run of batch shards, the same number
    as every other process, that it holds alone or shares whole (module docstring)."""
    held = batch_shards(rules)
    if len(held) == 1:
        return
    devices = rules.mesh.devices.size // len(held)
    inner = rules.mesh.devices.size // rules.batch_ways
    fix = (f"config keys mesh.data={rules.mesh.shape['data']}, mesh.fsdp="
           f"{rules.mesh.shape['fsdp']}, mesh.tensor={rules.mesh.shape['tensor']} lay rows out "
           "that no process can feed; choose mesh.fsdp * mesh.tensor (now "
           f"{inner}) dividing the {devices} devices of a host or a multiple of them")
    for p, shards in held.items():
        if shards != tuple(range(shards[0], shards[-1] + 1)):
            raise ConfigError(f"{fix}: process {p} would hold batch shards {list(shards)}, "
                              "which are not contiguous rows")
        for q, other in held.items():
            if set(shards) & set(other) and shards != other:
                raise ConfigError(f"{fix}: processes {p} and {q} would hold batch shards "
                                  f"{list(shards)} and {list(other)}, which overlap without "
                                  "being the same rows")
    if len({len(s) for s in held.values()}) > 1:
        raise ConfigError(f"{fix}: processes would hold different numbers of batch shards "
                          f"({ {p: len(s) for p, s in held.items()} })")


def sharing(rules: MeshRules | None) -> int:
    """How many processes hold this process's rows (1: its own)."""
    if rules is None or jax.process_count() == 1:
        return 1
    mine = batch_shards(rules)[jax.process_index()]
    return sum(s == mine for s in batch_shards(rules).values())


def global_rows(rules: MeshRules | None, local: int) -> int:
    """The step's row count when every process holds `local` rows (processes that share rows
    count once)."""
    if rules is None or jax.process_count() == 1:
        return local
    return local * rules.batch_ways // len(batch_shards(rules)[jax.process_index()])


def local_rows(rules: MeshRules | None, count: int) -> tuple[int, int]:
    """[start, stop) of the `count` global batch rows this process holds (all of them in one
    process)."""
    if rules is None or jax.process_count() == 1:
        return 0, count
    if count % rules.batch_ways:
        raise DistributedError(f"{count} rows do not split over the {rules.batch_ways} "
                               "batch shards (mesh.data * mesh.fsdp); with several processes "
                               "every process must hold its own rows")
    check_layout(rules)
    shards = batch_shards(rules)[jax.process_index()]
    per_shard = count // rules.batch_ways
    return shards[0] * per_shard, (shards[-1] + 1) * per_shard


def rows_to_global(rules: MeshRules, tree):
    """This process's rows [R, ...] (numpy) -> global arrays split by rows (processes that
    share rows pass the same values); with one process, a device_put onto the row sharding."""
    def put(local):
        local = np.asarray(local)
        shape = (global_rows(rules, local.shape[0]), *local.shape[1:])
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


def host_gcd(value: int) -> int:
    """The greatest common divisor of `value` over all processes (every process calls it)."""
    if jax.process_count() == 1:
        return value
    return int(np.gcd.reduce(multihost_utils.process_allgather(np.int64(value))))


def _first_of_each_start(starts) -> np.ndarray:
    """Indices of the processes whose blocks make up all rows once, in row order."""
    return np.unique(np.asarray(starts), return_index=True)[1]


def gather_rows(local: np.ndarray, start: int) -> np.ndarray:
    """Every process's rows [R, ...] (starting at global row `start`) -> all rows in order,
    each block once (module docstring)."""
    if jax.process_count() == 1:
        return local
    starts = multihost_utils.process_allgather(np.int64(start))
    blocks = multihost_utils.process_allgather(local)  # [processes, R, ...]
    return np.concatenate([blocks[i] for i in _first_of_each_start(starts)])


def gather_json(value) -> list:
    """Every process's JSON value, in process order (every process calls it)."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value, default=lambda v: v.tolist()).encode(), np.uint8)
    size = host_max(data.size)
    padded = np.zeros(size + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
    padded[8:8 + data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(row[8:8 + int(row[:8].view(np.int64)[0])].tobytes()) for row in gathered]


def gather_row_lists(local: list, start: int) -> list:
    """Every process's per-row JSON values (its rows from global row `start`) -> all rows'
    values in order, each block once, on every process."""
    if jax.process_count() == 1:
        return list(local)
    blocks = gather_json([start, list(local)])
    return [v for i in _first_of_each_start([b[0] for b in blocks]) for v in blocks[i][1]]


def check_shared_directory(path: Path, purpose: str) -> None:
    """ConfigError unless every process sees the files process 0 writes under `path`."""
    if jax.process_count() == 1:
        return
    token = path / ".jaxrl-shared-check"
    nonce = int(multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(4), np.int32)[0]))
    if jax.process_index() == 0:
        path.mkdir(parents=True, exist_ok=True)
        token.write_text(str(nonce))
    multihost_utils.sync_global_devices("jaxrl shared directory written")
    sees = token.is_file() and token.read_text() == str(nonce)
    blind = np.flatnonzero(~multihost_utils.process_allgather(np.bool_(sees)))
    if jax.process_index() == 0:
        token.unlink()
    if blind.size:
        raise ConfigError(
            f"config key 'run.output_dir': processes {blind.tolist()} do not see {path} as "
            f"process 0 writes it; {purpose} needs run.output_dir on storage every process "
            "mounts (NFS, Filestore, gcsfuse)")


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
    rules = MeshRules(make_mesh(cfg))
    check_layout(rules)
    return rules


def prompt_slice(rules: MeshRules | None, prompts: int, group: int) -> slice:
    """The prompts of a step this process samples: those whose `group` rows it holds."""
    start, stop = local_rows(rules, prompts * group)
    if start % group or stop % group:
        raise DistributedError(
            f"this process holds rows [{start}, {stop}), which split a group of {group}; all "
            "completions of a prompt must be on one process: make data.prompts_per_step a "
            f"multiple of the {jax.process_count() // sharing(rules)} row blocks (the process "
            "count; processes that share rows count once)")
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
