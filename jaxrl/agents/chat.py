"""The one interface agents use to reach a model: `ChatClient.chat(messages, max_tokens)`.

Two implementations: `OpenAIChat` (any OpenAI-compatible server, e.g. `jaxrl serve`, vLLM or
OpenAI; the key is read from an environment variable and handed to the client only) and
`LocalChat` (a model loaded in-process with `jaxrl.hf.pretrained.load_pretrained`). Tests inject
a scripted client with the same method.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from jaxrl.config import SamplingConfig


@dataclasses.dataclass(frozen=True)
class ChatReply:
    text: str
    prompt_tokens: int
    completion_tokens: int


class ChatClient(Protocol):
    name: str

    def chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int) -> ChatReply:
        ...


class OpenAIChat:
    """Chat completions from an OpenAI-compatible server at `base_url` (temperature 0)."""

    def __init__(self, base_url: str, model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 max_retries: int = 2):
        import openai

        # Local servers need no key, but the client insists on a non-empty one.
        key = os.environ.get(api_key_env) or "unused"
        self._client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout_s,
                                     max_retries=max_retries)
        self.name = model or self._client.models.list().data[0].id

    def chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int) -> ChatReply:
        response = self._client.chat.completions.create(
            model=self.name, messages=[dict(m) for m in messages], max_tokens=max_tokens,
            temperature=0.0)
        text = (response.choices[0].message.content or "") if response.choices else ""
        usage = response.usage
        return ChatReply(text=text, prompt_tokens=usage.prompt_tokens if usage else 0,
                         completion_tokens=usage.completion_tokens if usage else 0)


class LocalChat:
    """Chat completions from an in-process model (greedy unless temperature > 0). Each call
    folds a counter into the key, so a run is reproducible from its seed."""

    def __init__(self, model, name: str, temperature: float = 0.0, seed: int = 0):
        self._model, self.name = model, name
        self._temperature, self._seed, self._calls = temperature, seed, 0

    def chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int) -> ChatReply:
        import jax

        prompt = self._model.chat_ids(list(messages))
        key = jax.random.fold_in(jax.random.PRNGKey(self._seed), self._calls)
        self._calls += 1
        out = self._model.sample([prompt], key, SamplingConfig(
            temperature=self._temperature, max_new_tokens=max_tokens))
        return ChatReply(text=out.texts[0], prompt_tokens=len(prompt),
                         completion_tokens=int(out.mask[0].sum()))
