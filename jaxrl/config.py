"""Run configuration: typed, frozen dataclasses per concern, loaded from YAML plus dotted overrides.

Every key's type comes from its annotation and every bound or choice is declared once, in the
field's metadata; one generic validator (jaxrl/config_rules.py) walks them, so adding a key is a
one-line change.
List-valued keys are stored as tuples (immutable, hashable) and written back as lists. Reward
workers import this module, so it imports no jax.
"""
import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from jaxrl.config_rules import FLOATS, STRS, TYPE_NAMES, ConfigError, Dumper, Loader
from jaxrl.config_rules import Group as _Group
from jaxrl.config_rules import check_rules as _check_rules
from jaxrl.config_rules import scalar as _scalar
from jaxrl.config_rules import setting as _setting
from jaxrl.model.families import LINEAR_NAMES
from jaxrl.quant.formats import SCALE_DTYPES
from jaxrl.rewards import REWARDS

DTYPES = ("float32", "bfloat16")
QUANT_MODES = ("nf4", "int4", "none")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
REWARD_SCALINGS = ("group", "batch", "none")  # rl/advantages.py says what each one does
POLICY_LOSSES = ("grpo", "cispo")  # rl/losses.py gives the math of each
IMPORTANCE_LEVELS = ("token", "sequence")
SCHEDULES = ("constant", "cosine")
REMAT_CHOICES = ("auto", "none", "dots", "full")
ENV_NAMES = ("calculator", "diagnosis")  # jaxrl/envs/__init__.py registers each

_STRS, _FLOATS = STRS, FLOATS


class UsageError(ValueError):
    """Bad command-line usage (a flag's value, a missing argument); `jaxrl` exits 2, as for a
    ConfigError. Defined here, not in jaxrl.cli, so that `python -m jaxrl.cli` and the
    installed command raise and catch the same class."""


@dataclass(frozen=True)
class RunConfig(_Group):
    """Where a run writes, how many steps it takes, and its seed."""
    output_dir: str = "runs/quickstart"
    steps: int = _setting(100, ge=1)
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig(_Group):
    """Which base model to post-train and the dtype of its unquantized weights."""
    path: str = "default"  # "default" (embedded SmolLM2-135M-Instruct), a local HF dir or a hub id
    dtype: str = _setting("bfloat16", choices=DTYPES)


@dataclass(frozen=True)
class QuantConfig(_Group):
    """How the frozen base weights are quantized."""
    mode: str = _setting("nf4", choices=QUANT_MODES)
    block_size: int = _setting(64, gt=0, even=True)  # even: two 4-bit codes pack into one byte
    double_quant: bool = True
    scale_dtype: str = _setting("float32", choices=SCALE_DTYPES)
    skip: _STRS = ("embed_tokens", "norm", "lm_head")
    # per_layer: kernels stay packed on the device and each layer is dequantized inside the
    # layer loop (the memory-saving path); once: dequantized to model.dtype right after loading
    # (same values, dense speed); auto: once on CPU, where memory is plentiful and per-layer
    # dequantization dominates step time; on GPU and TPU once when the run's memory plan with
    # dense kernels fits the device's memory (jaxrl.planner.dense_fit), else per_layer
    dequantize: str = _setting("auto", choices=("auto", "per_layer", "once"))


@dataclass(frozen=True)
class LoraConfig(_Group):
    """The trainable low-rank adapters."""
    rank: int = _setting(16, ge=1)
    alpha: float = _setting(32.0, gt=0)
    targets: _STRS = _setting(LINEAR_NAMES, choices=LINEAR_NAMES, nonempty=True)
    dropout: float = _setting(0.0, ge=0, lt=1)
    init_from: str = ""  # a PEFT adapter directory to start from; "" = a fresh adapter


@dataclass(frozen=True)
class MeshConfig(_Group):
    """Device mesh axis sizes."""
    data: int = _setting(-1, ge=1, also=(-1,))  # -1: all devices the other axes leave over
    fsdp: int = _setting(1, ge=1)
    tensor: int = _setting(1, ge=1)


@dataclass(frozen=True)
class DataConfig(_Group):
    """Which prompts are trained and evaluated on: a weighted mixture of task sources, each
    generated or loaded, sampled to its count and split into train and validation."""
    tasks: _STRS = _setting(("arithmetic",), nonempty=True)  # NAME or NAME:COUNT; jaxrl data --list
    samples_per_task: int = _setting(1000, ge=1)  # the COUNT of a task given without one
    weights: _FLOATS = _setting((), gt=0)  # one per task; empty = proportional to the counts
    validation_fraction: float = _setting(0.2, ge=0, lt=1)
    seed: int = 42  # generation, sampling, splitting and shuffling
    difficulty: int = _setting(1, choices=(1, 2, 3))  # of generated tasks
    data_dir: str = "data"  # loaded tasks read DATA_DIR/NAME/ (JSON, JSONL, Parquet, CSV)
    from_hub: bool = False  # download a loaded task missing under data_dir from the HF hub
    train_file: str = ""  # records JSONL trained on instead of `tasks`
    eval_file: str = ""  # records JSONL evaluated on instead of the validation split
    prompts_per_step: int = _setting(4, ge=1)
    max_prompt_tokens: int = _setting(256, ge=1)
    # text after the chat template's assistant header, e.g. "<think>" (as R1-style templates
    # do); the completion continues it and the format reward counts it
    response_prefix: str = ""
    # a multi-turn environment that plays the records (jaxrl/envs/); "" = single-turn GRPO
    env: str = _setting("", choices=("",) + ENV_NAMES)


@dataclass(frozen=True)
class SamplingConfig(_Group):
    """How rollouts are decoded."""
    temperature: float = _setting(1.0, ge=0)  # 0 = greedy
    top_p: float = _setting(1.0, gt=0, le=1)
    top_k: int = _setting(0, ge=0)  # 0 = off
    min_p: float = _setting(0.0, ge=0, lt=1)
    max_new_tokens: int = _setting(128, ge=1)
    stop: _STRS = ()
    slots: int = _setting(0, ge=0)  # decode slots; 0 = one per row (fewer: refilled by groups)
    # partial rollouts (jaxrl/rl/partial.py): a rollout ends once a step's groups have
    # finished; freed slots have taken the next prompts, unfinished rows go on next step
    partial: bool = False
    max_carry: int = _setting(1, ge=1)  # rollouts a row may be carried into
    # a row past max_carry: finish (cut at its length) or drop (with its group)
    carry_overflow: str = _setting("finish", choices=("finish", "drop"))


@dataclass(frozen=True)
class EnvConfig(_Group):
    """Multi-turn episodes (data.env): their limits and the process terms of the `episode`
    reward (jaxrl/envs/calculator.py and diagnosis.py say how each environment scores)."""
    max_turns: int = _setting(4, ge=1)  # policy replies per episode
    # tokens after the opening prompt (replies and environment messages): the trajectory budget
    # and the learner's completion width; sampling.max_new_tokens bounds each reply
    max_tokens: int = _setting(512, ge=2)
    # the first reply's tool_choice, as in the OpenAI API: auto (free), required (it opens with
    # the tool-call markup) or a tool's name (it opens with a call of that tool)
    first_tool_choice: str = "auto"
    demonstration: bool = False  # the opening shows one worked episode before the task
    turn_cost: float = _setting(0.0, ge=0)  # subtracted per reply
    evidence_bonus: float = _setting(0.0, ge=0)  # a tool returned output before the conclusion
    fabrication_penalty: float = _setting(0.0, ge=0)  # per quote of text never retrieved
    relevant_credit: float = _setting(0.5, ge=0, le=1)  # diagnosis: only the category right


@dataclass(frozen=True)
class GrpoConfig(_Group):
    """The GRPO objective: group size, KL weight, clipping, loss aggregation and its variants."""
    num_generations: int = _setting(4, ge=2)  # a group of one has no spread to learn from
    beta: float = _setting(0.04, ge=0)
    epsilon_low: float = _setting(0.2, ge=0)
    epsilon_high: float = _setting(0.2, ge=0)
    loss_agg: str = _setting("seq-mean-token-mean", choices=LOSS_AGGS)
    num_iterations: int = _setting(1, ge=1)
    scale_rewards: str = _setting("group", choices=REWARD_SCALINGS)
    filter_zero_spread: bool = False
    # the variants below are off by default; README's GRPO section names the paper of each
    loss: str = _setting("grpo", choices=POLICY_LOSSES)  # cispo: clipped, detached IS weight
    importance_sampling: str = _setting("token", choices=IMPORTANCE_LEVELS)  # sequence: GSPO
    kl_ratio_weighted: bool = False  # k3 times the importance ratio (TRL's bias-corrected KL)
    delta: float = _setting(0.0, ge=0)  # two-sided clip: ratio <= delta when A < 0; 0 = off
    top_entropy_quantile: float = _setting(1.0, ge=0, le=1)  # policy loss on top-entropy tokens
    # truncated importance sampling, 0 = off; > 0: the sampler/learner mismatch correction of
    # verl and TRL: each token's policy term is weighted by min(pi_prox / pi_sampler, tis_cap)
    # (detached), pi_prox being the adapter at the update's start, and the clipped ratio is
    # taken against pi_prox instead of the sampler's log-probs (needs num_iterations 1)
    tis_cap: float = _setting(0.0, ge=0)
    mask_truncated: bool = False  # rows cut at max_new_tokens leave the loss
    dynamic_sampling: bool = False  # sample more prompts until every group has reward spread
    max_sampling_rounds: int = _setting(3, ge=1)  # rollouts per step at most, the first included


@dataclass(frozen=True)
class OptimConfig(_Group):
    """The optimizer over LoRA parameters."""
    lr: float = _setting(1e-5, gt=0)
    max_grad_norm: float = _setting(1.0, ge=0)  # 0 = no clipping
    weight_decay: float = _setting(0.0, ge=0)
    eps: float = _setting(1e-8, gt=0)  # Adam's epsilon (TRL's adam_epsilon)
    warmup_steps: int = _setting(0, ge=0)
    schedule: str = _setting("constant", choices=SCHEDULES)
    micro_batch_size: int = _setting(0, ge=0)  # 0 = whole batch
    # what the update's backward pass recomputes of the forward (jaxrl/rl/remat.py): none saves
    # every layer's intermediates, dots each projection's output, full only each layer's input; auto
    # takes dots, else full, whichever first has a compiled step that fits the device's memory
    remat: str = _setting("auto", choices=REMAT_CHOICES)


@dataclass(frozen=True)
class SftConfig(_Group):
    """Supervised fine-tuning (`jaxrl sft`) on chat records: the loss covers assistant tokens."""
    batch_size: int = _setting(8, ge=1)  # sequences per step
    max_length: int = _setting(1024, ge=2)  # tokens per sequence; longer ones lose their end
    # batches are drawn by length from windows of this many batches (less padding per batch)
    length_window: int = _setting(16, ge=1)
    eval_every: int = _setting(0, ge=0)  # steps between eval losses on data.eval_file; 0 = off


@dataclass(frozen=True)
class RewardEntry:
    """One reward function of `rewards.functions` and its weight in the summed reward. In YAML
    an entry is {name: correctness, weight: 1.0} or just the name (weight 1.0)."""
    name: str
    weight: float = 1.0


_ENTRIES = tuple[RewardEntry, ...]


@dataclass(frozen=True)
class RewardsConfig(_Group):
    """Which reward functions score completions and how the host workers run them."""
    functions: _ENTRIES = _setting((RewardEntry("correctness"), RewardEntry("format")),
                                   nonempty=True)
    max_staleness: int = _setting(1, choices=(0, 1))  # 1: the next rollout overlaps scoring
    workers: int = _setting(2, ge=1)  # processes for CPU-bound rewards
    timeout_s: float = _setting(10.0, gt=0)  # per sample; a CPU worker past it is replaced
    sandbox_timeout_s: float = _setting(5.0, gt=0)  # wall and CPU seconds of one code run
    cedar_weights: _FLOATS = _setting((1.0, 0.25, 0.25), ge=0)  # correctness, coverage, direction
    # DAPO's soft overlong punishment: over the last `overlong_buffer` tokens before
    # sampling.max_new_tokens the penalty grows linearly to -overlong_penalty; 0 = off
    overlong_buffer: int = _setting(0, ge=0)
    overlong_penalty: float = _setting(1.0, ge=0)


@dataclass(frozen=True)
class JudgeConfig(_Group):
    """The LLM judge used by judge-based rewards: an OpenAI-compatible server (base_url,
    model), or with `local` one decoded in the training process's own engine."""
    base_url: str = ""
    model: str = ""
    # "" (a server at base_url), base (the policy's frozen base, no adapter), adapter:DIR (a PEFT
    # adapter over that base) or model:PATH (a second model, NF4, held beside the policy's)
    local: str = ""
    slots: int = _setting(4, ge=1)  # local: the engine's slots for judge rows
    # local: cache columns a judge prompt may fill (0: data.max_prompt_tokens +
    # sampling.max_new_tokens + 1024 for the judge's instructions)
    max_prompt_tokens: int = _setting(0, ge=0)
    thinking: bool = False  # local: the chat template's thinking mode for the judge
    api_key_env: str = "OPENAI_API_KEY"
    api_key: str = _setting("", secret=True)
    timeout_s: float = _setting(60.0, gt=0)  # per request
    max_retries: int = _setting(3, ge=0)
    concurrency: int = _setting(8, ge=1)  # requests in flight per judge-based reward
    temperature: float = _setting(0.0, ge=0)
    max_tokens: int = _setting(2048, ge=1)
    # json_object: a server judge is sent response_format {"type": "json_object"} (replies are
    # JSON objects where it supports that, as jaxrl serve and vLLM do); a local judge decodes
    # its replies under that grammar's token masks
    response_format: str = _setting("", choices=("", "json_object"))
    backoff_s: float = _setting(1.0, gt=0)  # first retry delay; doubles, with jitter
    max_backoff_s: float = _setting(30.0, gt=0)  # cap on one delay, Retry-After included
    cache: bool = True  # judge_cache.sqlite in run.output_dir


@dataclass(frozen=True)
class EvalConfig(_Group):
    """Held-out evaluation inside `jaxrl train` and `jaxrl sft` (jaxrl/eval/during.py)."""
    every: int = _setting(0, ge=0)  # steps between evaluations, and after the last (0: off)
    records: int = _setting(0, ge=0)  # the first N evaluation records (0: all of them)
    batch_size: int = _setting(16, ge=1)  # prompts per sampler call, as jaxrl eval's


@dataclass(frozen=True)
class CheckpointConfig(_Group):
    """How often checkpoints are written and kept, and whether a run resumes from them."""
    every: int = _setting(50, ge=0)  # 0 = off (the adapter is still exported at the end)
    keep: int = _setting(3, ge=1)
    # auto: from the latest complete checkpoint in run.output_dir, if any; never: start fresh
    # (refused when run.output_dir holds checkpoints); or a run directory or checkpoints/N
    resume: str = "auto"
    # an eval/ metric (e.g. eval/accuracy): the adapter of the best evaluation so far is kept
    # in adapter-best/ ("": none)
    keep_best: str = ""


@dataclass(frozen=True)
class LoggingConfig(_Group):
    """What is logged besides metrics.jsonl."""
    samples_every: int = _setting(10, ge=0)  # 0 = off
    tensorboard: bool = False
    # trackers, through their own libraries (jaxrl/trackers.py; pip install -e '.[wandb]')
    wandb: bool = False  # Weights & Biases: metrics, sample tables, report.png, the config
    wandb_project: str = "jaxrl"
    wandb_entity: str = ""  # "" = the account's default entity
    wandb_name: str = ""  # the run's display name; "" = the run directory's name
    wandb_tags: _STRS = ()
    # "" = the library's default (WANDB_MODE when set, else online); offline: sync later
    wandb_mode: str = _setting("", choices=("", "online", "offline", "disabled"))
    # true: a tracker that cannot start (library missing, unreachable) stops the run at start;
    # false: one warning and the run goes on without it
    tracker_required: bool = True


@dataclass(frozen=True)
class Config:
    """A whole run: one frozen group per concern; Config() is the built-in defaults."""
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


_GROUPS = {f.name: f.type for f in fields(Config)}


def _unknown(kind: str, name: str, valid: list[str], label: str, prefix: str = "") -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
    return ConfigError(f"unknown config {kind} {prefix + name!r}; {label}: "
                       f"{', '.join(sorted(valid))}{hint}")


def _group_class(group: str) -> type:
    if group not in _GROUPS:
        raise _unknown("group", group, list(_GROUPS), "valid groups")
    return _GROUPS[group]


def _field_of(group: str, name: str) -> dataclasses.Field:
    by_name = {f.name: f for f in fields(_group_class(group))}
    if name not in by_name:
        raise _unknown("key", name, list(by_name), f"valid keys in {group!r}", prefix=f"{group}.")
    return by_name[name]


def _entry(key: str, item) -> RewardEntry:
    """A reward entry from a name, a {name, weight} mapping or an entry."""
    if isinstance(item, str):
        item = {"name": item}
    if isinstance(item, RewardEntry):
        item = dataclasses.asdict(item)
    weight = _scalar(float, item.get("weight", 1.0)) if isinstance(item, Mapping) else None
    if (weight is None or not isinstance(item.get("name"), str) or not item["name"]
            or set(item) - {"name", "weight"} or not math.isfinite(weight)):
        raise ConfigError(f"config key {key!r} entries must be a reward name or a mapping "
                          f"{{name: NAME, weight: FLOAT}}; got {item!r}")
    return RewardEntry(item["name"], weight)


def _coerce(key: str, typ, value):
    """Check value against the key's type: ints widen to floats; list keys take a list or one
    scalar and store a tuple."""
    if typ is _ENTRIES:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_entry(key, item) for item in items)
    if typ in (_STRS, _FLOATS):
        items = value if isinstance(value, (list, tuple)) else [value]
        result = tuple(_scalar(typ.__args__[0], item) for item in items)
        ok = None not in result
    else:
        result = _scalar(typ, value)
        ok = result is not None
    if not ok:
        raise ConfigError(f"config key {key!r} expects {TYPE_NAMES[typ]}, "
                          f"got {value!r} ({type(value).__name__})")
    return result


def _check_rewards(rewards: RewardsConfig) -> None:
    names = [entry.name for entry in rewards.functions]
    for name in names:
        if name not in REWARDS:
            close = difflib.get_close_matches(name, list(REWARDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"config key 'rewards.functions' names unknown reward {name!r}; "
                              f"valid rewards: {', '.join(sorted(REWARDS))}{hint}")
        if names.count(name) > 1:
            raise ConfigError(f"config key 'rewards.functions' lists {name!r} twice; "
                              "give each reward once with its weight")
    if len(rewards.cedar_weights) != 3:
        raise ConfigError("config key 'rewards.cedar_weights' needs 3 weights (correctness, "
                          f"coverage, directionality); got {list(rewards.cedar_weights)}")
    if rewards.timeout_s <= rewards.sandbox_timeout_s:
        raise ConfigError(f"config key 'rewards.timeout_s' ({rewards.timeout_s}) must exceed "
                          f"'rewards.sandbox_timeout_s' ({rewards.sandbox_timeout_s}): a "
                          "worker is replaced at the former, a code run stops at the latter")


def _check_grpo(grpo: GrpoConfig) -> None:
    if grpo.delta and grpo.loss != "grpo":
        raise ConfigError(f"config key 'grpo.delta' ({grpo.delta}) caps the clipped surrogate "
                          f"of grpo.loss=grpo; grpo.loss={grpo.loss} has none: set grpo.delta=0")
    if grpo.delta and grpo.delta <= 1 + grpo.epsilon_high:
        raise ConfigError(f"config key 'grpo.delta' must be 0 (off) or > 1 + grpo.epsilon_high "
                          f"= {1 + grpo.epsilon_high:g}, so that it caps only ratios the clip "
                          f"leaves alone; got {grpo.delta}")
    if grpo.loss == "cispo" and grpo.loss_agg != "token-mean":
        raise ConfigError("grpo.loss=cispo normalizes by the batch's token count, as MiniMax-M1 "
                          "does: set config key 'grpo.loss_agg' to token-mean; got "
                          f"{grpo.loss_agg!r}")
    if grpo.tis_cap and grpo.num_iterations != 1:
        raise ConfigError(f"config key 'grpo.tis_cap' ({grpo.tis_cap}) needs "
                          f"'grpo.num_iterations' = 1; got {grpo.num_iterations}: its proximal "
                          "policy is the adapter at the update's start, which with one iteration "
                          "is the one being updated (the loss's own log-probs, detached); "
                          "several iterations would need a pass of their own to score it. Set "
                          "grpo.num_iterations=1 or grpo.tis_cap=0")


def _check_env(cfg: Config) -> None:
    episode = any(entry.name == "episode" for entry in cfg.rewards.functions)
    if episode and not cfg.data.env:
        raise ConfigError("reward 'episode' scores multi-turn episodes; set config key "
                          f"'data.env' to one of {', '.join(ENV_NAMES)} or drop the reward")
    if cfg.data.env and cfg.rewards.overlong_buffer:
        raise ConfigError("config key 'rewards.overlong_buffer' penalizes single completions "
                          "near sampling.max_new_tokens; with data.env an episode's length is "
                          "env.max_tokens: set rewards.overlong_buffer=0 (env.turn_cost prices "
                          "each reply)")


def _check_judge(judge: JudgeConfig) -> None:
    kind, _, path = judge.local.partition(":")
    if judge.local and not (judge.local == "base" or (kind in ("adapter", "model")
                                                      and path.strip())):
        raise ConfigError(f"config key 'judge.local' must be empty (a judge server at "
                          "judge.base_url), base, adapter:DIR or model:PATH; got "
                          f"{judge.local!r}")


def _check_partial(cfg: Config) -> None:
    """What sampling.partial does not combine with, and why."""
    if not cfg.sampling.partial:
        return
    refused = {
        "data.env": (cfg.data.env, "an episode alternates the policy's replies with its "
                     "environment's on the host, which a carried row would have to resume"),
        "grpo.dynamic_sampling": (cfg.grpo.dynamic_sampling, "its extra rounds sample whole "
                                  "groups outside the carried rows; use one or the other"),
        "judge.local": (cfg.judge.local, "the local judge decodes in the rollout's engine, "
                        "which partial rollouts keep to themselves; serve the judge "
                        "(judge.base_url) instead"),
    }
    for key, (value, why) in refused.items():
        if value:
            raise ConfigError(f"config key 'sampling.partial' does not combine with {key} "
                              f"({value!r}): {why}")


def _check_cross(cfg: Config) -> None:
    if not cfg.model.path.strip():
        raise ConfigError("config key 'model.path' is empty: this config needs a base model; "
                          "pass model.path=DIR (a local Hugging Face directory, e.g. a download "
                          "of Qwen/Qwen3-4B), model.path=ORG/NAME (a hub id, when the network "
                          "allows) or model.path=default (the embedded SmolLM2-135M-Instruct)")
    if not cfg.checkpoint.resume.strip():
        raise ConfigError("config key 'checkpoint.resume' must be auto, never or the path of a "
                          "run directory or checkpoints/N directory; got ''")
    _check_rewards(cfg.rewards)
    _check_grpo(cfg.grpo)
    _check_env(cfg)
    _check_judge(cfg.judge)
    _check_partial(cfg)
    if cfg.checkpoint.keep_best and not (cfg.checkpoint.keep_best.startswith("eval/")
                                         and cfg.eval.every):
        raise ConfigError(f"config key 'checkpoint.keep_best' ({cfg.checkpoint.keep_best!r}) "
                          "names an eval/ metric (e.g. eval/accuracy) of the evaluation that "
                          "eval.every > 0 runs")
    if cfg.rewards.overlong_buffer > cfg.sampling.max_new_tokens:
        raise ConfigError(f"config key 'rewards.overlong_buffer' ({cfg.rewards.overlong_buffer}) "
                          "must be at most 'sampling.max_new_tokens' "
                          f"({cfg.sampling.max_new_tokens}): the penalty zone ends there")


def validate(cfg: Config) -> Config:
    """Check every key's type, choices and bounds plus cross-key rules; returns cfg normalized
    (lists as tuples, ints in float keys as floats)."""
    groups = {}
    for group in fields(cfg):
        section = getattr(cfg, group.name)
        values = {}
        for f in fields(section):
            key = f"{group.name}.{f.name}"
            values[f.name] = _coerce(key, f.type, getattr(section, f.name))
            _check_rules(key, values[f.name], f.metadata)
        groups[group.name] = replace(section, **values)
    cfg = Config(**groups)
    _check_cross(cfg)
    return cfg


def _build(d) -> Config:
    """Config from the nested-dict form with YAML-file strictness, not yet validated."""
    if not isinstance(d, Mapping):
        raise ConfigError("the top level must be a mapping of group -> mapping of key: value "
                          f"(e.g. 'grpo: {{beta: 0.04}}'); got {type(d).__name__}")
    groups = {}
    for group, section in d.items():
        group = str(group)
        cls = _group_class(group)
        section = {} if section is None else section
        if not isinstance(section, Mapping):
            raise ConfigError(f"config group {group!r} must be a mapping of key: value; "
                              f"got {section!r} ({type(section).__name__})")
        groups[group] = cls(**{
            name: _coerce(f"{group}.{name}", _field_of(group, str(name)).type, value)
            for name, value in section.items()})
    return Config(**groups)


def from_dict(d: Mapping) -> Config:
    """Config from {group: {key: value}}; missing groups and keys keep their defaults."""
    return validate(_build(d))


def _plain(value):
    """A key's value as plain YAML data: tuples as lists, entries as mappings."""
    if isinstance(value, tuple):
        return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return value


def to_dict(cfg: Config, include_secrets: bool = False) -> dict:
    """{group: {key: value}} of plain values (lists, not tuples); secrets only when asked for."""
    out = {}
    for group in fields(cfg):
        section = getattr(cfg, group.name)
        values = {f.name: getattr(section, f.name) for f in fields(section)
                  if include_secrets or not f.metadata.get("secret")}
        out[group.name] = {k: _plain(v) for k, v in values.items()}
    return out


def dump_yaml(cfg: Config, path: str | os.PathLike) -> None:
    """Write cfg (secrets removed) as YAML that load_config reads back to an equal Config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(to_dict(cfg), Dumper=Dumper, sort_keys=False), encoding="utf-8")


def _parse_cli(typ, text: str):
    """An override's text as YAML, falling back to the text itself where YAML would give a
    str key a non-string (`run.output_dir=123`) or a list key a scalar (`lora.targets=q,v`)."""
    try:
        value = yaml.load(text, Loader=Loader)
    except yaml.YAMLError:
        value = text
    if typ is str and not isinstance(value, str):
        return text
    if typ in (_STRS, _FLOATS, _ENTRIES) and not isinstance(value, list):
        parts = [part.strip() for part in text.split(",") if part.strip()]
        return [_parse_cli(float, part) for part in parts] if typ is _FLOATS else parts
    return value


def _override(cfg: Config, overrides: Sequence[str]) -> Config:
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        group, dot, name = key.partition(".")
        if not sep or not dot:
            raise ConfigError(f"override {item!r} must have the form group.key=value "
                              "(e.g. grpo.beta=0.01)")
        typ = _field_of(group, name).type
        section = replace(getattr(cfg, group), **{name: _coerce(key, typ, _parse_cli(typ, text))})
        cfg = replace(cfg, **{group: section})
    return cfg


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """cfg with each `group.key=value` applied in order (later ones win), then validated."""
    return validate(_override(cfg, overrides))


def _load_file(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or getattr(e, "context", None) or e
        raise ConfigError(f"config file '{path}' is not valid YAML: {where}{problem}") from None
    try:
        return Config() if data is None else _build(data)
    except ConfigError as e:
        raise ConfigError(f"config file '{path}': {e}") from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, updated by the YAML file at path (if any), then by overrides; validated once at
    the end, so an override may repair what the file alone would fail on."""
    cfg = Config() if path is None else _load_file(Path(path))
    return validate(_override(cfg, overrides))
