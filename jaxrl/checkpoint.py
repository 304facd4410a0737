"""Checkpoints of a training run: orbax, written asynchronously, complete or absent.

A checkpoint of step t (t updates applied) holds what the run needs to go on exactly as if it had
not stopped: the train state (LoRA, optimizer state, counters), the PRNG key, the data iterator's
position, with `sampling.partial` the groups pulled and not yet trained (jaxrl/rl/partial.py)
and, with `rewards.max_staleness: 1`, the pending rollout of step t+1 (as
jaxrl/rl/rollout.py packs it), which was sampled with the adapter from before update t while
step t was scored (sampling it again after a resume would need that older adapter). Base weights
are not saved; the checkpoint names its base (its path and a sha256 of its config.json and
safetensors headers, see `base_identity`) and the config values that fix the saved shapes; a
resume with another base or other values is refused.

orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves the previous checkpoints intact and at most an unfinished
`N.orbax-checkpoint-tmp` directory, which is never read (and is replaced when step N is saved
again). Arrays are copied to the host before `save` returns (the train state is donated to
the next step); the write itself, and the PEFT export into `adapter/`, run in the background.

Several processes (jaxrl/distributed.py) save and restore together, every one calling the same
methods: orbax's multi-host save writes each process's shards of the train state, and process 0
the values every process holds alike. The pending rollout is saved whole: each process's rows
are gathered (each block once), and on resume each process takes back the rows it holds, so a
checkpoint does not depend on which process held which rows. Each process's data position is
saved under its process index. run.output_dir must then be storage every process mounts,
which is checked at start. Process 0 alone sets checkpoints aside and exports the adapter.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxrl import distributed
from jaxrl.config import Config, ConfigError, from_dict, to_dict
from jaxrl.hf.export import write_peft_adapter
from jaxrl.hf.load import shard_files
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec

FORMAT = 2
CHECKPOINTS, ADAPTER = "checkpoints", "adapter"
# Config keys whose values the saved arrays, the base's function or the data order depend on.
FIXED = ("quant.mode", "quant.block_size", "quant.double_quant", "quant.scale_dtype",
         "quant.skip", "lora.rank", "lora.alpha", "lora.targets", "data.prompts_per_step",
         "grpo.num_generations")
SAMPLE_BYTES = 1 << 20
# What a trainer keeps across steps beyond its train state: (host arrays [rows, ...], JSON info
# whose list values have one entry per row), e.g. GRPO's pending rollout (jaxrl/rl/rollout.py);
# this process's rows of it.
Pending = tuple[dict[str, np.ndarray], dict[str, Any]]


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


def base_identity(model_dir: str | Path, path: str) -> dict[str, str]:
    """{path, dir, sha256}: sha256 of config.json and, per safetensors shard, its header (names,
    shapes, dtypes) and first MiB of tensor data, which tells two fine-tunes of one
    architecture apart without reading whole checkpoints."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for shard in shard_files(model_dir):
        with open(shard, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(size + SAMPLE_BYTES))
    return {"path": path, "dir": str(model_dir.resolve()), "sha256": digest.hexdigest()}


def _name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def flat_leaves(tree) -> dict[str, Any]:
    """{'lora/weights/layers/q_proj/a': leaf, ...} of any pytree."""
    return {"/".join(_name(k) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return nested


def _fixed(cfg: Config) -> dict[str, Any]:
    values = to_dict(cfg)
    return {key: values[key.split(".")[0]][key.split(".")[1]] for key in FIXED}


def _manager(directory: Path, keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=keep is not None,
                                           enable_async_checkpointing=True)
    handlers = {"arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory.resolve(), item_handlers=handlers, options=options)


def read_checkpoint(directory: Path, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(flat host arrays, meta) of checkpoints/step; any exception means it is unreadable."""
    manager = _manager(directory)
    try:
        tree = manager.item_metadata(step)["arrays"].tree
        target = jax.tree_util.tree_map(lambda m: np.empty(m.shape, m.dtype), tree)
        restored = manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    finally:
        manager.close()
    meta = restored.meta
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"its metadata is not jaxrl checkpoint format {FORMAT}")
    return flat_leaves(restored.arrays), meta


def checkpoint_steps(directory: Path) -> list[int]:
    """Complete checkpoint steps under `directory`, oldest first."""
    if not directory.is_dir():
        return []
    manager = _manager(directory)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def read_newest(directory: Path, steps: list[int], log: Callable[[str], None],
                on_corrupt: Callable[[int], None] | None = None):
    """(step, flat arrays, meta) of the newest readable step among `steps`; an unreadable one
    is reported and the one before it tried. Once one is read, the unreadable newer ones go to
    `on_corrupt` (so that the run can write those steps again)."""
    unreadable = []
    for step in sorted(steps, reverse=True):
        try:
            found = (step, *read_checkpoint(directory, step))
        except Exception as error:  # any damage makes a step unusable, not the run
            log(f"checkpoint {directory / str(step)} is unreadable ({type(error).__name__}: "
                f"{str(error)[:200]}); trying the one before")
            unreadable.append(step)
            continue
        for bad in unreadable if on_corrupt is not None else ():
            on_corrupt(bad)
        return found
    raise CheckpointError(f"no readable checkpoint among steps {sorted(steps)} in {directory}; "
                          "start a new run.output_dir or repair the files")


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any  # the train state, on the devices of the template it was restored into
    key: jax.Array
    pending: Pending | None  # as `after_step` was given it
    carry: dict[str, Any] | None = None  # partial rollouts' state (JSON), as given


def _check_meta(meta: dict[str, Any], cfg: Config, base: dict[str, str], where: Path) -> None:
    """ConfigError naming the first difference that makes the checkpoint unusable here."""
    saved = meta["base"]
    if saved["sha256"] != base["sha256"]:
        raise ConfigError(
            f"checkpoint {where} belongs to base model {saved['path']!r} ({saved['dir']}, "
            f"sha256 {saved['sha256'][:12]} of its config and weights); model.path="
            f"{base['path']!r} is {base['dir']} (sha256 {base['sha256'][:12]}): resume with "
            "the same base, or start a new run.output_dir with checkpoint.resume=never")
    for key, value in _fixed(cfg).items():
        if meta["fixed"][key] != value:
            raise ConfigError(
                f"checkpoint {where} was written with {key}={meta['fixed'][key]!r}; this config "
                f"has {key}={value!r}: resume with {key}={meta['fixed'][key]!r}, or start a "
                "new run.output_dir with checkpoint.resume=never")


def _into(template, flat: dict[str, np.ndarray], where: Path):
    """`template` with every leaf replaced by the saved array (on the template's devices)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, leaf in paths:
        name = "train/" + "/".join(_name(k) for k in path)
        saved = flat.get(name)
        if saved is None or saved.shape != leaf.shape:
            got = "nothing" if saved is None else f"shape {saved.shape}"
            raise ConfigError(f"checkpoint {where} holds {got} for {name}, where this config "
                              f"needs shape {leaf.shape} (optim.max_grad_norm 0 or not changes "
                              "the optimizer state); resume with the config that wrote it")
        leaves.append(jax.device_put(saved.astype(leaf.dtype), leaf.sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _data_state(saved: list) -> Any:
    """This process's data position among the per-process ones a checkpoint holds."""
    if len(saved) == jax.process_count():
        return saved[jax.process_index()]
    if all(state == saved[0] for state in saved):
        return saved[0]
    raise ValueError(f"it holds the data positions of {len(saved)} processes, which differ, "
                     f"and this run has {jax.process_count()}; resume with {len(saved)} "
                     "processes")


def _global_pending(pending: Pending, start: int) -> Pending:
    """This process's rows of `pending` (from global row `start`) -> every process's rows."""
    arrays, info = pending
    return ({k: distributed.gather_rows(v, start) for k, v in arrays.items()},
            {k: distributed.gather_row_lists(v, start) if isinstance(v, list) else v
             for k, v in info.items()})


def _local_pending(arrays: dict[str, np.ndarray], info: dict[str, Any],
                   rows: tuple[int, int] | None) -> Pending:
    """The rows [start, stop) of a pending rollout saved whole (None: all of them)."""
    mine = slice(*rows) if rows is not None else slice(None)
    return ({k: v[mine] for k, v in arrays.items()},
            {k: v[mine] if isinstance(v, list) else v for k, v in info.items()})


class Checkpoints:
    """The checkpoints of one run: where a run starts from, and what it saves as it goes."""

    def __init__(self, cfg: Config, model_dir: Path, spec: ModelSpec,
                 log: Callable[[str], None] = print, *, rows: tuple[int, int] | None = None):
        """rows: [start, stop) of the step's rows this process holds (the pending rollout's);
        None: all of them."""
        self.cfg, self.spec, self.rows, self.log = cfg, spec, rows, log
        self.every = cfg.checkpoint.every
        if self.every or cfg.checkpoint.resume != "never":
            distributed.check_shared_directory(
                Path(cfg.run.output_dir), "checkpointing (or set checkpoint.every=0 "
                "checkpoint.resume=never)")
        self.dir = Path(cfg.run.output_dir) / CHECKPOINTS
        self.base = base_identity(model_dir, cfg.model.path)
        self._manager: ocp.CheckpointManager | None = None
        self._background = concurrent.futures.ThreadPoolExecutor(1, "adapter-export")
        self._exports: list[concurrent.futures.Future] = []
        self._exported = -1

    def _source(self) -> tuple[Path, int | None] | None:
        """(checkpoints directory, step or None for its latest) to resume from, or None."""
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            if checkpoint_steps(self.dir):
                raise ConfigError(
                    f"config key 'checkpoint.resume' is never but {self.dir} holds checkpoints "
                    f"{checkpoint_steps(self.dir)}; use checkpoint.resume=auto to continue that "
                    "run, or choose a new run.output_dir")
            return None
        if resume == "auto":
            return (self.dir, None) if checkpoint_steps(self.dir) else None
        path = Path(resume).expanduser()
        if checkpoint_steps(path / CHECKPOINTS):
            return path / CHECKPOINTS, None
        if path.name.isdigit() and int(path.name) in checkpoint_steps(path.parent):
            return path.parent, int(path.name)
        if checkpoint_steps(path):
            return path, None
        raise ConfigError(f"config key 'checkpoint.resume' = {resume!r} holds no complete "
                          "checkpoint; it must be auto, never, a run directory, its "
                          "checkpoints directory or one checkpoints/N directory")

    def _set_aside(self, step: int, why: str) -> None:
        """Rename checkpoints/step so that the resumed run can write that step again."""
        target = self.dir / f"{why}-{step}"
        n = 1
        while target.exists():
            target, n = self.dir / f"{why}-{step}.{n}", n + 1
        (self.dir / str(step)).rename(target)
        self.log(f"checkpoint: moved {self.dir / str(step)} to {target}")

    def _own(self, directory: Path) -> bool:
        return directory.resolve() == self.dir.resolve()

    def restore(self, template, data) -> Restored | None:
        """The train state restored into `template`'s structure and devices, with `data`'s
        position set, from the checkpoint `checkpoint.resume` selects (None: start fresh)."""
        source = self._source()
        if source is None:
            return None
        directory, step = source
        unreadable: list[int] = []
        step, flat, meta = read_newest(directory, [step] if step is not None else
                                       checkpoint_steps(directory), self.log, unreadable.append)
        where = directory / str(step)
        _check_meta(meta, self.cfg, self.base, where)
        state = _into(template, flat, where)
        try:
            data.set_state(_data_state(meta["data"]))
        except ValueError as error:
            raise ConfigError(f"checkpoint {where}: {error}") from None
        if self._own(directory):
            later = [s for s in checkpoint_steps(directory) if s > step and s not in unreadable]
            self._set_aside_all([(s, "corrupt") for s in unreadable]
                                + [(s, "superseded") for s in later])
        pending = None
        if meta["pending"] is not None:
            pending = _local_pending({k.removeprefix("pending/"): v for k, v in flat.items()
                                      if k.startswith("pending/")}, meta["pending"], self.rows)
        self.log(f"resuming from {where} (step {step})")
        return Restored(step, state, jnp.asarray(flat["key"]), pending, meta.get("carry"))

    def _set_aside_all(self, steps: list[tuple[int, str]]) -> None:
        """`_set_aside` each (step, why), by process 0 once every process has read."""
        several = jax.process_count() > 1
        if several:
            multihost_utils.sync_global_devices("jaxrl checkpoints read")
        if jax.process_index() == 0:
            for step, why in steps:
                self._set_aside(step, why)
        if several:
            multihost_utils.sync_global_devices("jaxrl checkpoints set aside")

    def after_step(self, step: int, state, key: jax.Array, data,
                   pending: Pending | None = None,
                   carry: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Save checkpoint `step` when `checkpoint.every` says so (and at the last step), with
        `pending` (e.g. the rollout already sampled for the next step) and carry() (JSON:
        partial rollouts' groups, jaxrl/rl/partial.py; one process), and export its adapter;
        whether it saved."""
        every = self.every
        if not every or (step % every and step != self.cfg.run.steps):
            return False
        # the arrays themselves: orbax copies each process's shards to the host before `save`
        # returns, before the next step reuses the donated buffers
        arrays = {**{f"train/{k}": v for k, v in flat_leaves(state).items()},
                  "key": np.asarray(jax.device_get(key))}
        info = None
        if pending is not None:
            pending_arrays, info = _global_pending(pending, (self.rows or (0,))[0])
            arrays.update({f"pending/{k}": v for k, v in pending_arrays.items()})
        meta = {"format": FORMAT, "step": step, "base": self.base, "fixed": _fixed(self.cfg),
                "data": distributed.gather_json(data.get_state()), "pending": info,
                "config": to_dict(self.cfg)}
        if carry is not None:
            meta["carry"] = carry()
        if self._manager is None:
            self._manager = _manager(self.dir, self.cfg.checkpoint.keep)
        self._manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(_nest(arrays)), meta=ocp.args.JsonSave(meta)))
        self._export(step, state.lora)
        return True

    def _export(self, step: int, lora: Lora) -> None:
        """Export `lora` (on the devices) as the run's adapter: gathered on every process,
        written by process 0 in the background."""
        host = (jax.device_get(lora) if all(a.is_fully_addressable for a in
                                            jax.tree_util.tree_leaves(lora))
                else multihost_utils.process_allgather(lora, tiled=True))
        self._exported = step
        if jax.process_index():
            return
        for done in [f for f in self._exports if f.done()]:
            done.result()  # an export that failed fails the run here, not silently
            self._exports.remove(done)
        self._exports.append(self._background.submit(
            write_peft_adapter, Path(self.cfg.run.output_dir) / ADAPTER, host, self.spec,
            adapter_base_name(self.cfg, self.base), self.cfg.lora.dropout))

    def export_to(self, directory: Path, lora: Lora) -> None:
        """Export `lora` as a PEFT adapter into `directory` now (process 0 writes; the best
        evaluation's adapter, jaxrl/eval/during.py)."""
        host = (jax.device_get(lora) if all(a.is_fully_addressable for a in
                                            jax.tree_util.tree_leaves(lora))
                else multihost_utils.process_allgather(lora, tiled=True))
        if jax.process_index() == 0:
            write_peft_adapter(Path(directory), host, self.spec,
                               adapter_base_name(self.cfg, self.base), self.cfg.lora.dropout)

    def finish(self, step: int, state) -> None:
        """Export the final adapter (unless the last checkpoint did) and wait for all writes."""
        if self._exported != step:
            self._export(step, state.lora)
        self.close()

    def close(self) -> None:
        """Wait until every save and export in flight is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
        self._background.shutdown(wait=True)
        for future in self._exports:
            future.result()
        self._exports.clear()


def adapter_base_name(cfg: Config, base: dict[str, str]) -> str:
    """base_model_name_or_path of an export: model.path as given (a hub id or a directory),
    the prepared directory for `default` (its weights are what the adapter was trained on)."""
    return base["dir"] if cfg.model.path == "default" else cfg.model.path


def load_run_lora(run_dir: Path, step: int | None = None, log: Callable[[str], None] = print,
                  ) -> tuple[Lora, Config, dict, int]:
    """(adapter, config, base identity, step) of checkpoint `step` of a run (default: its
    newest readable one); CheckpointError when there is none."""
    directory = Path(run_dir) / CHECKPOINTS
    steps = checkpoint_steps(directory)
    if not steps or (step is not None and step not in steps):
        wanted = "" if step is None else f" of step {step}"
        raise CheckpointError(f"{directory} holds no complete checkpoint{wanted}; complete "
                              f"steps: {', '.join(map(str, steps)) or 'none'}")
    step, flat, meta = read_newest(directory, [step] if step is not None else steps, log)
    cfg = from_dict(meta["config"])
    prefix = "train/lora/weights/"
    weights = _nest({k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)})
    lora = Lora(weights=weights, scale=cfg.lora.alpha / cfg.lora.rank, dropout=cfg.lora.dropout)
    return lora, cfg, meta["base"], step
