"""Two GRPO steps on the tiny model, the way `jaxrl train` runs them on a mesh: each process
samples, scores and advantages its own rows. Run as a module it is one process of a
multi-process run over 4 CPU devices that runs the steps once per mesh given as
DATA,FSDP,TENSOR (`python -m tests.sharding.grpo_run ID COUNT PORT OUT.json MESH ...`) and
writes {mesh: result}."""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # before jax is imported
    from tests.xla_flags import cpu_flags

    os.environ["XLA_FLAGS"] = cpu_flags(4)
    os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl import distributed  # noqa: E402
from jaxrl.config import MeshConfig, SamplingConfig  # noqa: E402
from jaxrl.model.transformer import positions_from_mask  # noqa: E402
from jaxrl.rl.advantages import compute_advantages  # noqa: E402
from jaxrl.rl.logprobs import token_logprobs  # noqa: E402
from jaxrl.rl.train_step import Batch, compile_train_step  # noqa: E402
from jaxrl.sampling.sampler import sample  # noqa: E402
from jaxrl.sharding import MeshRules, make_mesh, place, step_shardings  # noqa: E402
from tests.sharding.common import (G, NEW, OPTS, ROWS, SPEC, model, optimizer_state,  # noqa: E402
                                   prompts, rewards_of)

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=NEW)


@functools.partial(jax.jit, static_argnums=4)
def _reference(params, tokens, positions, mask, start):
    return token_logprobs(params, SPEC, tokens, positions, mask, None, start=start)[0]


def _batch(rules, out, advantages, params) -> Batch:
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    rows = dict(tokens=tokens, positions=np.asarray(positions_from_mask(mask)), mask=mask,
                completion=out.mask, logp_old=out.logprobs, advantages=advantages)
    rows = (jax.tree_util.tree_map(jnp.asarray, rows) if rules is None
            else distributed.rows_to_global(rules, rows))
    ref = _reference(params, rows["tokens"], rows["positions"], rows["mask"],
                     out.prompt_tokens.shape[1])
    return Batch(tokens=rows["tokens"], positions=rows["positions"], attn_mask=rows["mask"],
                 completion_mask=rows["completion"], logp_old=rows["logp_old"],
                 advantages=rows["advantages"], ref_logp=ref)


def grpo_steps(rules: MeshRules | None, steps: int = 2) -> dict:
    """Per-step loss and gradient norm, and the final adapter, as lists."""
    params, lora = model()
    optimizer, state = optimizer_state(lora)
    shardings = None
    if rules is not None:
        shardings = step_shardings(rules, state, params, SPEC, optimizer, ROWS)
        state, params = place((state, params), shardings[0][:2])
    step = compile_train_step(SPEC, optimizer, dataclasses.replace(OPTS, mesh=rules), shardings)
    start, stop = distributed.local_rows(rules, ROWS)
    result = {"loss": [], "grad_norm": []}
    for t in range(steps):
        out = sample(params, SPEC, prompts(ROWS, seed=t)[start:stop], jax.random.PRNGKey(t),
                     SAMPLING, lora=state.lora, eos_ids=(2,), shardings=rules)
        rewards = distributed.gather_rows(rewards_of(out.tokens, out.mask), start)
        advantages = np.asarray(compute_advantages(rewards, G).advantages)[start:stop]
        state, metrics = step(state, params, _batch(rules, out, advantages, params))
        for key in result:
            result[key].append(float(metrics[key]))
    weights = state.lora.weights
    if rules is not None and jax.process_count() > 1:
        weights = multihost_utils.process_allgather(weights, tiled=True)
    result["lora"] = jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), weights)
    return result


def mesh_rules(mesh: str) -> MeshRules:
    """The rules of mesh "DATA,FSDP,TENSOR" over every device."""
    data, fsdp, tensor = (int(n) for n in mesh.split(","))
    return MeshRules(make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor)))


def main(process_id: int, count: int, port: int, out: str, meshes: list[str]) -> None:
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                      JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(process_id))
    distributed.initialize_from_env()
    results = {mesh: grpo_steps(mesh_rules(mesh)) for mesh in meshes}
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
