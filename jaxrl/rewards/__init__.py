"""Host-side rewards: the registries of reward functions and correctness verifier kinds.

Both registries map a name to a `module:attribute` target that is imported on first use, so this
module imports nothing heavy (config validation reads `REWARDS` to check reward names) and never
imports jax. A reward target is a callable `(cfg: jaxrl.config.Config) -> RewardFunction`; a
verifier target is a `jaxrl.rewards.correctness.Verifier`.

New entries go here (or through `register_reward` / `register_verifier` in a module that this
one imports): worker processes start with `spawn`, so a registration made at run time in the
trainer is passed to the reward workers for reward functions, but verifier kinds must be
registered at import time to exist in the workers.
"""
import importlib

REWARDS = {
    "correctness": "jaxrl.rewards.correctness:Correctness",
    "format": "jaxrl.rewards.format:FormatReward",
    "cedar_coverage": "jaxrl.rewards.cedar:CoverageJudge",
    "cedar_directionality": "jaxrl.rewards.cedar:DirectionalityJudge",
    "cedar": "jaxrl.rewards.cedar:Cedar",
    "spring": "jaxrl.rewards.spring:Spring",
    "episode": "jaxrl.rewards.episode:EpisodeReward",
}

VERIFIERS = {
    "exact": "jaxrl.rewards.correctness:EXACT",
    "label": "jaxrl.rewards.correctness:LABEL",
    "set": "jaxrl.rewards.correctness:SET",
    "numeric": "jaxrl.rewards.correctness:NUMERIC",
    "mcq": "jaxrl.rewards.correctness:MCQ",
    "python": "jaxrl.rewards.correctness:PYTHON",
    "knk": "jaxrl.rewards.puzzles:KNK",
    "zebra": "jaxrl.rewards.puzzles:ZEBRA",
}


def _check_target(target: str) -> None:
    module, sep, attr = target.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"registry target {target!r} must have the form "
                         "'package.module:attribute'")


def register_reward(name: str, target: str) -> None:
    """Add (or replace) a reward function: `target` is 'module:factory'."""
    _check_target(target)
    REWARDS[name] = target


def register_verifier(kind: str, target: str) -> None:
    """Add (or replace) a correctness verifier kind: `target` is 'module:Verifier instance'."""
    _check_target(target)
    VERIFIERS[kind] = target


def load_target(target: str):
    """The object a 'module:attribute' target names (imports the module)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
