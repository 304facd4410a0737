"""Request bodies to engine-ready prompts, run on worker threads so that parsing, rendering and
tokenizing a large prompt never holds up the event loop.

Each worker thread tokenizes with its own copy of the tokenizer (a fast tokenizer may not be
entered from two threads at once); the event loop decodes with one more copy of its own.
Prompts are checked against the engine's cache: prompt plus max_tokens must fit in
`context` tokens. With `echo`, each prompt's text is decoded here too (`Echo`): the text the
reply starts with and where each prompt token's text begins in it.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jinja2 import TemplateError

from jaxrl.hf.tokenizer import TokenizerError, text_ids
from jaxrl.sampling.requests import row_keys
from jaxrl.serve import protocol as p
from jaxrl.serve.structured import Constraint, Structured
from jaxrl.serve.textstream import TextStream
from jaxrl.hf.tool_calls import ToolSyntax, syntax_of


@dataclasses.dataclass(frozen=True)
class Echo:
    """A prompt as an echoing reply shows it: its text (decoded without special tokens), each
    token's own text and where each token's text starts in `text`."""

    text: str
    tokens: list[str]
    offsets: list[int]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked request: its served model, prompts as token ids, settings and row keys."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: list[list[int]]
    settings: p.Settings
    max_tokens: list[int]  # per prompt
    keys: np.ndarray  # [len(prompts) * n, 2]: choice j of prompt i is row i * n + j
    tools: p.Tools | None = None
    syntax: ToolSyntax | None = None
    prefix: str = ""  # the forced opening of a tool call, part of the reply's text
    echo: list[Echo] = dataclasses.field(default_factory=list)  # per prompt, with echo
    constraints: list[Constraint] | None = None  # per row: structured output (structured.py)

    def constraint(self, row: int) -> Constraint | None:
        return None if self.constraints is None else self.constraints[row]


def parse_json(raw: bytes):
    """The body as JSON; invalid JSON and lone surrogates (not Unicode) are 400s."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise p.ApiError(400, "the request body holds a lone UTF-16 surrogate escape (such as "
                         "\\ud800), which is not valid Unicode text") from None
    except (ValueError, RecursionError) as error:
        raise p.ApiError(400, f"the request body is not valid JSON: {error}") from None
    return body


class Preparer:
    """Turns request bodies into `Prepared` requests (module docstring)."""

    def __init__(self, tokenizer, models: Sequence[str], vocab_size: int, context: int,
                 default_max_tokens: int, seed: int, eos_ids: Sequence[int] = ()):
        self._tokenizer, self.models, self.vocab_size = tokenizer, list(models), vocab_size
        self.structured = Structured(tokenizer, eos_ids)
        self.context, self.default_max_tokens = context, default_max_tokens
        self.syntax = syntax_of(tokenizer.chat_template)
        self.unknown = p.UnknownFields()
        self._local = threading.local()
        self._key = jax.random.PRNGKey(seed)
        self._calls = itertools.count()
        self._lock = threading.Lock()

    def tokenizer(self):
        """This thread's own copy of the tokenizer."""
        if not hasattr(self._local, "tokenizer"):
            with self._lock:
                self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return self._local.tokenizer

    def _model(self, body) -> str:
        if body["model"] not in self.models:
            raise p.ApiError(404, f"the model {body['model']!r:.100} does not exist; this "
                             f"server serves {', '.join(map(repr, self.models))}",
                             param="model", code="model_not_found")
        return body["model"]

    def chat(self, raw: bytes) -> Prepared:
        body = parse_json(raw)
        p.check_fields(body, p.CHAT_FIELDS, ("model", "messages"), self.unknown)
        model = self._model(body)
        s = p.settings(body, self.vocab_size, p.chat_logprobs(body))
        messages, tools = p.chat_messages(body), p.chat_tools(body)
        if tools is not None and self.syntax is None:
            raise p.bad("tools", "this model's chat template renders no tools (it has neither "
                        "Qwen's <tool_call> nor Llama 3.1's ipython markup); send no tools or "
                        "tool_choice \"none\"")
        constraints = self.structured.constraints(body, s.n)
        if tools is not None and constraints is not None:
            raise p.bad("tools", "tools and structured output (response_format, guided_*) "
                        "cannot be combined; send one, or tool_choice \"none\"")
        prefix = "" if tools is None else self.syntax.forced_prefix(tools.choice)
        ids = self._render(messages, tools, prefix)
        return self._prepared("chat", model, [ids], s, self.default_max_tokens, "messages",
                              tools=tools, syntax=self.syntax if tools else None, prefix=prefix,
                              constraints=constraints)

    def _render(self, messages: list[dict], tools: p.Tools | None, prefix: str) -> list[int]:
        tokenizer = self.tokenizer()
        if not tokenizer.chat_template:
            raise p.bad("messages", "the model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=None if tools is None else tools.tools, tokenize=False,
                add_generation_prompt=True)
        except (TemplateError, TokenizerError) as error:
            raise p.bad("messages", f"the chat template cannot render them: {error}") from None
        return text_ids(tokenizer, text + prefix)

    def completion(self, raw: bytes) -> Prepared:
        body = parse_json(raw)
        p.check_fields(body, p.COMPLETION_FIELDS, ("model", "prompt"), self.unknown)
        model = self._model(body)
        s = p.settings(body, self.vocab_size, p.completion_logprobs(body),
                       p.completion_echo(body))
        prompts = [text_ids(self.tokenizer(), x) if isinstance(x, str) else x
                   for x in p.completion_prompts(body, self.vocab_size)]
        if not all(prompts):
            raise p.bad("prompt", "a prompt has no tokens")
        echo = [self._echo(ids) for ids in prompts] if s.echo else []
        constraints = self.structured.constraints(body, len(prompts) * s.n)
        return self._prepared("completion", model, prompts, s, 16, "prompt", echo=echo,
                              constraints=constraints)

    def _echo(self, ids: list[int]) -> Echo:
        tokenizer = self.tokenizer()
        stream = TextStream(lambda t: tokenizer.decode(list(t), skip_special_tokens=True))
        for token in ids:
            stream.push(token)
        stream.finish()
        return Echo(stream.text, [tokenizer.decode([t]) for t in ids], stream.offsets)

    def _prepared(self, kind: str, model: str, prompts: list[list[int]], s: p.Settings,
                  default: int, field: str, **extra) -> Prepared:
        """The OpenAI API's default max_tokens: 16 for completions; chat: --default-max-tokens,
        within the context either way."""
        max_tokens = [self._max_tokens(ids, s, default, field) for ids in prompts]
        key = (jax.random.PRNGKey(s.seed) if s.seed is not None
               else jax.random.fold_in(self._key, next(self._calls)))
        keys = row_keys(key, range(len(prompts) * s.n))
        return Prepared(kind, model, prompts, s, max_tokens, keys, **extra)

    def _max_tokens(self, prompt: list[int], s: p.Settings, default: int, field: str) -> int:
        room = self.context - len(prompt)
        if s.max_tokens == 0 and room >= 0:  # echo alone: the prompt only
            return 0
        if room < 1:
            raise p.bad(field, f"this server's context is {self.context} tokens and the prompt "
                        f"has {len(prompt)}, which leaves no room for a completion")
        if s.max_tokens is None:
            return min(default, room)
        if s.max_tokens > room:
            raise p.bad("max_tokens", f"this server's context is {self.context} tokens; "
                        f"{len(prompt)} in the prompt plus max_tokens {s.max_tokens} exceed it")
        return s.max_tokens
