"""The roles of guided decoding built from a local model (one base, an adapter per role) or an
OpenAI-compatible endpoint (proposing and rationale writing; scoring needs local log-probs).

A local agent continues its own chat reply: the prompt is the chat template's rendering of the
question plus the trajectory so far (and, for explicit supervision, the rationale), and each
candidate is sampled up to a sentence end (stop strings). A remote agent is asked for the next
sentence of the steps so far, k independent requests at the agent temperature, and its reply is
cut at the first sentence end.
"""
from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence

import jax

from jaxrl.config import JudgeConfig, SamplingConfig
from jaxrl.hf.pretrained import Pretrained
from jaxrl.lora.lora import Lora
from jaxrl.rationale.guide import Candidate, Propose, Score, WriteRationale
from jaxrl.rationale.prompts import insert_rationale, rationale_messages
from jaxrl.rationale.scoring import ScoreOptions, score_pairs
from jaxrl.rewards.judge import Judge, JudgeFailure
from jaxrl.sampling.sampler import sample

SENTENCE_STOPS = (". ", ".\n", "? ", "?\n", "! ", "!\n", "\n")
AGENT_SYSTEM = ("Solve the problem step by step, one short sentence per step. When you know "
                "the result, write 'The answer is: ' followed by the number.")
_FIRST_SENTENCE = re.compile(r"^\s*(.+?(?:[.!?](?=\s)|\n|$))", re.S)


def agent_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": question}]


def _agent_prefix(trajectory: str, rationale: str | None, template: str) -> str:
    if rationale is None:
        return trajectory
    inserted = insert_rationale(rationale, template)
    return trajectory + (inserted if trajectory else inserted.lstrip())


def local_proposer(model: Pretrained, lora: Lora | None, key: jax.Array, *,
                   temperature: float = 0.7, max_new_tokens: int = 64,
                   template: str = " {rationale}") -> Propose:
    """k sampled sentences continuing the agent's reply; each call draws a fresh key."""
    calls = itertools.count()
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                         stop=SENTENCE_STOPS)

    def propose(question: str, trajectory: str, rationale: str | None, k: int):
        text = model.chat_text(agent_messages(question)) + _agent_prefix(
            trajectory, rationale, template)
        out = sample(model.params, model.spec, [model.ids(text)] * k,
                     jax.random.fold_in(key, next(calls)), cfg, lora=lora,
                     eos_ids=model.eos_ids, detokenize=model.detokenize)
        return [Candidate(t, final=r == "stop" and not t.endswith(SENTENCE_STOPS))
                for t, r in zip(out.texts, out.finish_reasons)]
    return propose


def local_rationale_writer(model: Pretrained, lora: Lora | None, *,
                           max_new_tokens: int = 64) -> WriteRationale:
    """The rationale model's greedy reply to `prompts.rationale_messages(context)`, cut at the
    first line break."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, stop=("\n",))

    def write(context: str) -> str:
        out = sample(model.params, model.spec, [model.chat_ids(rationale_messages(context))],
                     jax.random.PRNGKey(0), cfg, lora=lora, eos_ids=model.eos_ids,
                     detokenize=model.detokenize)
        return out.texts[0].strip()
    return write


def local_scorer(model: Pretrained, lora: Lora | None,
                 opts: ScoreOptions = ScoreOptions(decay=1.0)) -> Score:
    """Mean log-prob per continuation token, all pairs in one bucketed pass."""
    def score(pairs: Sequence[tuple[str, str]]) -> list[float]:
        ids = [(list(model.tokenizer(context)["input_ids"]), model.ids(continuation))
               for context, continuation in pairs]
        sums = score_pairs(model.params, model.spec, ids, lora, opts)
        return [float(s) / len(c) for s, (_, c) in zip(sums, ids)]
    return score


def first_sentence(reply: str) -> str:
    match = _FIRST_SENTENCE.match(reply)
    return "" if match is None else match.group(1).strip()


async def _ask_all(judges: Sequence[Judge], messages: list[dict]) -> list[str]:
    """Each judge's reply ("" when its request failed: a lost candidate, not a lost run)."""
    async def one(judge: Judge) -> str:
        try:
            return (await judge.ask(messages)).text
        except JudgeFailure:
            return ""
        finally:
            await judge.aclose()
    return list(await asyncio.gather(*(one(j) for j in judges)))


def remote_proposer(cfg: JudgeConfig, k: int) -> Propose:
    """k independent requests per step: one client per candidate, since a client shares
    identical requests in flight."""
    judges = [Judge(cfg) for _ in range(k)]

    def propose(question: str, trajectory: str, rationale: str | None, n: int):
        ask = (f"{question}\n\nSteps so far:\n{trajectory.strip() or '(none yet)'}\n\n"
               + (f"Hint for the next step: {rationale}\n\n" if rationale else "")
               + "Write only the next step, one sentence.")
        replies = asyncio.run(_ask_all(judges[:n], [{"role": "system", "content": AGENT_SYSTEM},
                                                    {"role": "user", "content": ask}]))
        sep = " " if trajectory else ""
        return [Candidate(sep + s) for s in map(first_sentence, replies) if s]
    return propose


def remote_rationale_writer(cfg: JudgeConfig) -> WriteRationale:
    judge = Judge(cfg)

    def write(context: str) -> str:
        return first_sentence(asyncio.run(_ask_all([judge], rationale_messages(context)))[0])
    return write
