"""Multi-turn rollouts: episodes of an environment (jaxrl/envs/) played through the decode engine.

Each row of the batch is one episode: its environment's opening messages are rendered by the
chat template (with the tools, where the template renders them) and prefilled once per distinct
prompt, so the G rows of a record share it as in single-turn sampling. Every reply decodes in
the row's slot; when it ends (an EOS id, a stop string of `sampling.stop`, or
`sampling.max_new_tokens`) the reply's text goes to the environment, and its answer, rendered by
the chat template as what follows a reply (`continuation_text`), is appended to the slot's KV
cache behind the reply's kept tokens: the conversation is never prefilled again. Replies of
all rows decode together, each row moving on as soon as its own reply ends.

The trajectory after the opening prompt is the learner's completion: replies (the policy's
tokens, with their sampler log-probs) and environment tokens (log-prob 0, outside the loss:
`policy_mask`), at most `env.max_tokens` of them. Each reply's budget is the smaller of
sampling.max_new_tokens and what the trajectory has left; an episode that runs out of tokens
(a reply at the budget, or an environment answer that does not fit with one more token) is cut
there, with finish reason "length" and episode finish "token_budget". A reply's EOS token is
the policy's; when the template's end-of-turn markup opens with the same token it is not
appended twice. `env.first_tool_choice` (required, or a tool's name) makes the first reply
open with the tool-call markup (`ToolSyntax.forced_prefix`), as `jaxrl serve` honours
tool_choice; that opening is part of the opening prompt.

Keys: row i draws with fold_in(key, i) as in `sample`, its reply t with fold_in of that by t.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.config import Config
from jaxrl.envs import environment
from jaxrl.envs.protocol import Environment
from jaxrl.hf.tokenizer import chat_prompt_text, continuation_text, detokenizer, text_ids
from jaxrl.hf.tool_calls import syntax_of
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import Params
from jaxrl.sampling.buckets import bucket, left_pad
from jaxrl.sampling.engine import Engine
from jaxrl.sampling.requests import Request, row_keys
from jaxrl.sampling.sampler import REFILL_CHUNK, SampleOutput
from jaxrl.sampling.sampling_fns import Decoding
from jaxrl.sampling.stop import cut_at_stop
from jaxrl.sharding import MeshRules


@dataclasses.dataclass
class Episode:
    """One row's episode as it is played."""

    env: Environment
    record: dict
    prompt: list[int]  # the opening prompt's token ids
    prompt_text: str
    prefix: str  # the first reply's forced opening (env.first_tool_choice)
    key: np.ndarray
    tokens: list[int] = dataclasses.field(default_factory=list)  # after the prompt
    policy: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    transcript: list[dict] = dataclasses.field(default_factory=list)  # replies and answers
    cut: bool = False  # ran out of tokens (env.max_tokens)


@dataclasses.dataclass(frozen=True)
class Chat:
    """How an episode's messages become tokens: the model's tokenizer, EOS ids and tool
    markup (None: its template renders no tools, and environments describe them)."""

    tokenizer: object
    eos_ids: tuple[int, ...]

    @property
    def syntax(self):
        """The template's tool-call markup, None when it renders no tools."""
        return syntax_of(self.tokenizer.chat_template)

    def opening(self, env: Environment, record: dict) -> tuple[str, str]:
        """(prompt text, the first reply's forced opening) of an episode."""
        messages = env.reset(record)
        tools = env.tools if env.template_tools else None
        prefix = env.syntax.forced_prefix(env.first_tool_choice())
        return chat_prompt_text(self.tokenizer, messages, tools=tools) + prefix, prefix

    def continuation(self, messages: list[dict], after_eos: int | None) -> list[int]:
        """Token ids of what follows a reply (`continuation_text`); after_eos: the reply's final
        EOS id, which stands for the markup's opening token when they are the same."""
        ids = text_ids(self.tokenizer, continuation_text(self.tokenizer, messages))
        return ids[1:] if ids and after_eos is not None and ids[0] == after_eos else ids


def _episodes(records: Sequence[dict], cfg: Config, chat: Chat, keys: np.ndarray):
    cls = environment(cfg.data.env)
    out = []
    for record, key in zip(records, keys):
        env = cls(cfg.env, chat.syntax)
        text, prefix = chat.opening(env, record)
        out.append(Episode(env, dict(record), text_ids(chat.tokenizer, text), text, prefix,
                           key))
    return out


class _Player:
    """Submits each episode's replies to the engine and answers them with its environment."""

    def __init__(self, engine: Engine, chat: Chat, cfg: Config):
        self.engine, self.chat, self.cfg = engine, chat, cfg
        self.decoding = Decoding.from_config(cfg.sampling)
        self.detokenize = detokenizer(chat.tokenizer)
        self.done: list[Request] = []
        self.owner: dict[int, Episode] = {}

    def start(self, episode: Episode) -> None:
        self._submit(episode, Request(episode.prompt, hold=True), 0)

    def _submit(self, episode: Episode, request: Request, turn: int) -> None:
        room = self.cfg.env.max_tokens - len(episode.tokens)
        request.decoding, request.on_done = self.decoding, self.done.append
        request.max_new_tokens = min(self.cfg.sampling.max_new_tokens, room)
        request.key = row_keys(episode.key, [turn])[0]
        self.owner[id(request)] = episode
        self.engine.submit(request)

    def answer(self, request: Request) -> None:
        """The reply `request` decoded goes to its environment; the episode goes on or ends."""
        episode = self.owner.pop(id(request))
        kept, text, _ = cut_at_stop(request.tokens, self.cfg.sampling.stop, self.detokenize)
        if not episode.transcript:
            text = episode.prefix + text
        episode.tokens += request.tokens[:kept]
        episode.policy += [True] * kept
        episode.logprobs += request.logprobs[:kept]
        episode.transcript.append({"role": "assistant", "content": text})
        turn = episode.env.step(text)
        room = self.cfg.env.max_tokens - len(episode.tokens)
        last = request.tokens[kept - 1]
        ids = [] if turn.done else self.chat.continuation(
            turn.messages, last if last in self.chat.eos_ids else None)
        if turn.done or len(ids) + 1 > room:
            episode.cut = not turn.done
            self.engine.release(request)
            return
        episode.tokens += ids
        episode.policy += [False] * len(ids)
        episode.logprobs += [0.0] * len(ids)
        episode.transcript += turn.messages
        self._submit(episode, Request(ids, hold=True, follows=request, keep=kept),
                     episode.env.turns)

    def run(self) -> None:
        while True:
            self.engine.step()
            done = list(self.done)  # the replies that ended in this step
            self.done.clear()
            for request in done:
                self.answer(request)
            if not distributed.host_max(int(self.engine.busy())):
                return


def transcript_text(episode: Episode) -> str:
    """The episode's replies and the environment's answers, one `[role] content` block each."""
    return "\n".join(f"[{m['role']}] {m['content']}" for m in episode.transcript)


def episode_record(episode: Episode) -> dict:
    """What the rewards read of an episode: the environment's record of it, how it ended (the
    token budget overrides the environment's finish) and its token counts."""
    played = episode.env.episode()
    policy = int(sum(episode.policy))
    return {**played, "finish": "token_budget" if episode.cut else played["finish"],
            "tokens": {"policy": policy, "environment": len(episode.tokens) - policy}}


def _output(episodes: list[Episode], width: int, n: int, pad: int) -> SampleOutput:
    prompt_tokens, prompt_mask = left_pad([e.prompt for e in episodes], width)
    b = len(episodes)
    tokens = np.full((b, n), pad, np.int32)
    mask, policy = np.zeros((b, n), bool), np.zeros((b, n), bool)
    logprobs = np.zeros((b, n), np.float32)
    for row, e in enumerate(episodes):
        k = len(e.tokens)
        tokens[row, :k], mask[row, :k] = e.tokens, True
        policy[row, :k], logprobs[row, :k] = e.policy, e.logprobs
    return SampleOutput(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens,
                        mask=mask, logprobs=logprobs,
                        finish_reasons=tuple("length" if e.cut else "stop" for e in episodes),
                        texts=tuple(transcript_text(e) for e in episodes), policy_mask=policy)


def play(params: Params, spec: ModelSpec, records: Sequence[dict], key: jax.Array, cfg: Config,
         chat: Chat, *, lora: Lora | None = None, shardings: MeshRules | None = None
         ) -> tuple[list[str], SampleOutput, list[dict]]:
    """Play one episode of `cfg.data.env` per record (repeat a record for a group): (opening
    prompts as text, the trajectories as the learner takes them, each record with its
    "episode"). With several processes `records` are this process's rows (as for `sample`)."""
    rows, first = len(records), 0
    if shardings is not None:
        rows = distributed.global_rows(shardings, distributed.host_max(rows))
        first = distributed.local_rows(shardings, rows)[0]
    episodes = _episodes(records, cfg, chat, row_keys(key, range(first, first + len(records))))
    width = bucket(max(len(e.prompt) for e in episodes))
    slots = bucket(rows, minimum=1)
    if cfg.sampling.slots:
        slots = min(slots, bucket(cfg.sampling.slots, minimum=1))
    if shardings is not None:
        width = distributed.host_max(width)
        slots = max(slots, shardings.batch_ways)
    engine = Engine(params, spec, eos_ids=chat.eos_ids, slots=slots,
                    capacity=width + cfg.env.max_tokens,
                    chunk=min(bucket(cfg.sampling.max_new_tokens), REFILL_CHUNK), lora=lora,
                    shardings=shardings)
    player = _Player(engine, chat, cfg)
    for episode in episodes:
        player.start(episode)
    player.run()
    out = _output(episodes, width, cfg.env.max_tokens, chat.eos_ids[0] if chat.eos_ids else 0)
    return ([e.prompt_text for e in episodes], out,
            [{**e.record, "episode": episode_record(e)} for e in episodes])


def episode_metrics(records: Sequence[dict]) -> dict[str, float]:
    """Means over a batch's episodes: replies, tool calls and the share that were valid, how
    the episodes ended, and the environment's share of the trajectory tokens."""
    episodes = [r["episode"] for r in records]
    calls = sum(len(e["calls"]) for e in episodes)
    valid = sum(sum(bool(c["valid"]) for c in e["calls"]) for e in episodes)
    tokens = sum(e["tokens"]["policy"] + e["tokens"]["environment"] for e in episodes)
    share = lambda finish: float(np.mean([e["finish"] == finish for e in episodes]))  # noqa: E731
    return {"episode/turns_mean": float(np.mean([e["turns"] for e in episodes])),
            "episode/calls_mean": calls / len(episodes),
            "episode/valid_call_frac": valid / calls if calls else 0.0,
            "episode/concluded_frac": share("answer"),
            "episode/turn_limit_frac": share("turn_limit"),
            "episode/truncated_frac": share("token_budget"),
            "episode/env_token_frac": (sum(e["tokens"]["environment"] for e in episodes)
                                       / max(tokens, 1))}
