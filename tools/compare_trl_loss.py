"""jaxrl's GRPO loss against TRL's `GRPOTrainer._compute_loss` on identical inputs, per variant.

Both losses get the same per-token log-probs (the leaf that is differentiated), old and
reference log-probs, advantages, completion mask and entropies, in float32; the table gives the
loss difference, the largest gradient difference (d loss / d logp) relative to the largest
gradient, and the differences of the metrics both report (clipped fraction, KL), beside the
jaxrl metric that shows what the variant did on these inputs.
Each variant runs on two input sets: on-policy (num_iterations 1: old = logp, which TRL gets as
`per_token_logps.detach()`) and off-policy (num_iterations > 1: old log-probs moved by noise, so
that ratios fall on both sides of every clip edge). The overlong penalty is compared with
`trl.rewards.get_soft_overlong_punishment` on every length 0..L.

TRL's method is called on a stand-in for the trainer that holds just the attributes it reads
(one process, no gradient accumulation, no vLLM), with `_get_per_token_logps_and_entropies`
returning the prepared log-probs instead of running a model. TRL is not a jaxrl dependency:

    pip download --no-deps trl==1.16.0 -d /tmp/trl && \
        pip install --no-deps --target /tmp/trl-site /tmp/trl/trl-1.16.0-py3-none-any.whl
    PYTHONPATH=/tmp/trl-site python tools/compare_trl_loss.py
"""
from __future__ import annotations

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxrl.config import GrpoConfig
from jaxrl.rewards.overlong import overlong_penalties
from jaxrl.rl.losses import grpo_loss

B, T, BETA = 6, 9, 0.04
AGGS = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
# name: (jaxrl grpo settings, TRL settings besides loss_type / beta / epsilons, the jaxrl
# metric that shows what the variant did)
VARIANTS = {
    "grpo (seq-mean-token-mean)": ({}, {}, "clip_frac"),
    "dapo (token-mean)": ({"loss_agg": "token-mean"}, {}, "clip_frac"),
    "dr_grpo (token-sum-norm)": ({"loss_agg": "seq-mean-token-sum-norm"}, {}, "clip_frac"),
    "kl_ratio_weighted": ({"kl_ratio_weighted": True}, {"use_bias_correction_kl": True},
                          "kl_weighted"),
    "gspo (sequence, eps 3e-4 / 4e-4)": (
        {"importance_sampling": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        {"importance_sampling_level": "sequence"}, "seq_clip_frac"),
    "gspo + kl_ratio_weighted": (
        {"importance_sampling": "sequence", "kl_ratio_weighted": True},
        {"importance_sampling_level": "sequence", "use_bias_correction_kl": True},
        "seq_clip_frac"),
    "delta 1.5": ({"delta": 1.5}, {"delta": 1.5}, "delta_clip_frac"),
    "cispo (TRL epsilon_high 1.5)": (
        {"loss": "cispo", "loss_agg": "token-mean", "epsilon_low": 1.0, "epsilon_high": 0.5}, {},
        "clip_frac"),
    "top_entropy_quantile 0.2": ({"top_entropy_quantile": 0.2}, {"top_entropy_quantile": 0.2},
                                 "entropy_selected_frac"),
    "top_entropy_quantile 0.5, dapo": ({"top_entropy_quantile": 0.5, "loss_agg": "token-mean"},
                                       {"top_entropy_quantile": 0.5}, "entropy_selected_frac"),
}


def _inputs(off_policy: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    lengths = np.array([9, 3, 6, 9, 1, 5])
    logp = rng.uniform(-4.0, -0.05, (B, T))
    return {"logp": logp, "old": logp + (rng.normal(0, 0.5, (B, T)) if off_policy else 0.0),
            "ref": logp + rng.normal(0, 0.4, (B, T)), "entropy": rng.uniform(0, 4, (B, T)),
            "adv": rng.normal(0, 1, B), "mask": np.arange(T)[None, :] < lengths[:, None]}


def _jaxrl(x, cfg: GrpoConfig, off_policy: bool):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

    def loss(lp):
        old = f32(x["old"]) if off_policy else jax.lax.stop_gradient(lp)
        return grpo_loss(lp, old, f32(x["adv"]), x["mask"], cfg, ref_logp=f32(x["ref"]),
                         max_new_tokens=T, entropy=f32(x["entropy"]))
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(f32(x["logp"]))
    return float(value), np.asarray(grad, np.float64), {k: float(v) for k, v in metrics.items()}


class _OneProcess:
    """What TRL's loss asks of accelerate's Accelerator, for one process."""

    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl(x, cfg: GrpoConfig, trl_args: dict, off_policy: bool):
    from trl.trainer.grpo_trainer import GRPOTrainer

    logp = torch.tensor(x["logp"], dtype=torch.float32, requires_grad=True)
    mask = torch.tensor(x["mask"], dtype=torch.int64)
    cispo = cfg.loss == "cispo"
    args = types.SimpleNamespace(use_bias_correction_kl=trl_args.get("use_bias_correction_kl",
                                                                     False),
                                 delta=trl_args.get("delta"), steps_per_generation=1)
    trainer = types.SimpleNamespace(
        args=args, beta=BETA, loss_type="cispo" if cispo else AGGS[cfg.loss_agg],
        epsilon_low=cfg.epsilon_low,
        epsilon_high=1 + cfg.epsilon_high if cispo else cfg.epsilon_high,
        importance_sampling_level=trl_args.get("importance_sampling_level", "token"),
        top_entropy_quantile=trl_args.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        max_completion_length=T, model=types.SimpleNamespace(training=True),
        accelerator=_OneProcess(), _metrics={"train": collections.defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            logp, torch.tensor(x["entropy"], dtype=torch.float32), None))
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    inputs = {"prompt_ids": torch.zeros((B, 2), dtype=torch.int64),
              "prompt_mask": torch.ones((B, 2), dtype=torch.int64),
              "completion_ids": torch.zeros((B, T), dtype=torch.int64), "completion_mask": mask,
              "advantages": torch.tensor(x["adv"], dtype=torch.float32),
              "ref_per_token_logps": torch.tensor(x["ref"], dtype=torch.float32),
              "num_items_in_batch": mask.sum()}
    if off_policy:
        inputs["old_per_token_logps"] = torch.tensor(x["old"], dtype=torch.float32)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), logp.grad.double().numpy(), metrics


def _metric_gaps(ours: dict, theirs: dict, cfg: GrpoConfig) -> tuple[float, float]:
    """(clipped-fraction difference, NaN where TRL reports none; KL difference). TRL's KL
    metric is the weighted one under use_bias_correction_kl, its clip fraction per sequence
    under sequence-level ratios."""
    clip = float("nan")
    if "clip_ratio/region_mean" in theirs:
        key = "seq_clip_frac" if cfg.importance_sampling == "sequence" else "clip_frac"
        clip = abs(ours[key] - theirs["clip_ratio/region_mean"])
    return clip, abs(ours["kl_weighted" if cfg.kl_ratio_weighted else "kl"] - theirs["kl"])


def compare() -> list[tuple]:
    rows = []
    for name, (ours, theirs, shows) in VARIANTS.items():
        cfg = dataclasses.replace(GrpoConfig(beta=BETA, epsilon_low=0.2, epsilon_high=0.28), **ours)
        for off_policy in (False, True):
            x = _inputs(off_policy)
            loss, grad, metrics = _jaxrl(x, cfg, off_policy)
            trl_loss, trl_grad, trl_metrics = _trl(x, cfg, theirs, off_policy)
            scale = max(np.abs(trl_grad).max(), 1e-12)
            rows.append((name, "off" if off_policy else "on", f"{shows} {metrics[shows]:.3f}",
                         trl_loss, abs(loss - trl_loss), np.abs(grad - trl_grad).max() / scale,
                         *_metric_gaps(metrics, trl_metrics, cfg)))
    return rows


def _overlong_gap(max_new: int = 64, buffer: int = 16) -> float:
    from trl.rewards import get_soft_overlong_punishment

    lengths = np.arange(max_new + 1)
    theirs = get_soft_overlong_punishment(max_new, buffer)([[0] * n for n in lengths])
    return float(np.abs(overlong_penalties(lengths, max_new, buffer, 1.0) - theirs).max())


def main() -> None:
    import trl

    print(f"TRL {trl.__version__}, torch {torch.__version__}, jax {jax.__version__}; "
          f"B={B}, T={T}, beta={BETA}, float32\n")
    print("| variant | ratios | what it did (jaxrl) | TRL loss | loss diff | grad diff (rel.) "
          "| clip frac diff | KL diff |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, policy, did, trl_loss, dloss, dgrad, dclip, dkl in compare():
        clip = "n/a" if np.isnan(dclip) else f"{dclip:.1e}"
        print(f"| {name} | {policy}-policy | {did} | {trl_loss:.6f} | {dloss:.1e} | "
              f"{dgrad:.1e} | {clip} | {dkl:.1e} |")
    print(f"\noverlong penalty (L 64, buffer 16, lengths 0..64): largest difference "
          f"{_overlong_gap():.1e}")


if __name__ == "__main__":
    main()
