"""SFT data: chat records as token ids with a mask of the assistant tokens, and batches drawn
by length.

Masking: the conversation is rendered by the model's chat template and cut at the start and
end of each assistant turn, where the start is the end of the rendered preceding messages with
the assistant header (what generation would be prompted with) and the end is the end of the
rendered conversation through that turn (so the end-of-turn marker is learned too). Each piece
is tokenized on its own, as a prompt and its completion are at generation time; the tokens of
assistant pieces are the loss tokens. A template that does not render earlier messages as a
prefix of later ones (one that rewrites past turns) is refused by name.

Batches: the index stream runs through shuffled epochs; each window of `length_window`
batches is sorted by length and cut into batches, whose order is then shuffled, so rows of a
batch have similar lengths and are padded to the same width, four widths per octave
(jaxrl.sampling.buckets.quarter_bucket). Everything follows
from (seed, batches drawn), which is the iterator's whole state for checkpoints.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.hf.tokenizer import chat_prompt_text, text_ids
from jaxrl.sampling.buckets import quarter_bucket

ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages, where: str) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise ConfigError(f"{where}: `messages` must be a non-empty list of {{role, content}} "
                          f"with role one of {', '.join(ROLES)}")
    if messages[0]["role"] == "assistant" or all(m["role"] != "assistant" for m in messages):
        raise ConfigError(f"{where}: a record needs an assistant message after a system or "
                          "user message (the loss covers assistant tokens only)")
    return messages


def read_chat_records(path: str, key: str) -> list[list[dict]]:
    """The `messages` of each JSONL line of `path` (the value of config key `key`)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config key {key!r} = {path!r} is not a file; it must be a JSONL "
                          "file of chat records ({\"messages\": [{\"role\", \"content\"}, ...]})")
    conversations = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"config key {key!r}: file '{path}' line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
        conversations.append(_check_messages(
            record.get("messages") if isinstance(record, dict) else None, where))
    if not conversations:
        raise ConfigError(f"config key {key!r}: file '{path}' holds no records")
    return conversations


def _assistant_spans(tokenizer, messages: Sequence[Mapping[str, str]]):
    """(rendered text, [(start, end)] character spans of the assistant turns)."""
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = chat_prompt_text(tokenizer, messages[:i], add_generation_prompt=True)
        through = chat_prompt_text(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(start) and text.startswith(through)):
            raise ConfigError(f"the chat template of {tokenizer.name_or_path!r} does not render "
                              f"the messages before turn {i} as a prefix of the conversation; "
                              "SFT masks need a template that leaves earlier turns as they are")
        spans.append((len(start), len(through)))
    return text, spans


def encode_chat(tokenizer, messages: Sequence[Mapping[str, str]]):
    """(ids [T] int32, loss mask [T] bool: the assistant tokens)."""
    text, spans = _assistant_spans(tokenizer, messages)
    cuts = sorted({0, len(text), *(c for span in spans for c in span)})
    ids, mask = [], []
    for a, b in zip(cuts, cuts[1:]):
        piece = text_ids(tokenizer, text[a:b])
        ids += piece
        mask += [any(s <= a < e for s, e in spans)] * len(piece)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def encode_all(tokenizer, conversations, max_length: int):
    """([(ids, mask)] cut to max_length, counts): rows left without loss tokens are dropped."""
    rows, truncated = [], 0
    for messages in conversations:
        ids, mask = encode_chat(tokenizer, messages)
        truncated += len(ids) > max_length
        ids, mask = ids[:max_length], mask[:max_length]
        if mask[1:].any():  # the first token is never a target
            rows.append((ids, mask))
    return rows, {"records": len(conversations), "truncated": truncated,
                  "dropped": len(conversations) - len(rows)}


class BatchStream:
    """Index batches of `batch_size` rows, drawn by length (module docstring); resumable
    through get_state / set_state."""

    def __init__(self, lengths: Sequence[int], batch_size: int, window: int, seed: int):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.window, self.seed = batch_size, window, seed
        self.drawn = 0

    def _stream(self, start: int, count: int) -> np.ndarray:
        n = len(self.lengths)
        epochs = range(start // n, (start + count - 1) // n + 1)
        joined = np.concatenate([np.random.default_rng([self.seed, e]).permutation(n)
                                 for e in epochs])
        offset = start - epochs[0] * n
        return joined[offset:offset + count]

    def batch(self, k: int) -> np.ndarray:
        """The indices of batch k."""
        w, b = self.window, self.batch_size
        window = self._stream((k // w) * w * b, w * b)
        ordered = window[np.argsort(self.lengths[window], kind="stable")].reshape(w, b)
        return ordered[np.random.default_rng([self.seed, k // w, 1]).permutation(w)[k % w]]

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        self.drawn += 1
        return self.batch(self.drawn - 1)

    def get_state(self) -> dict:
        return {"seed": self.seed, "batch_size": self.batch_size, "window": self.window,
                "drawn": self.drawn}

    def set_state(self, state: Mapping) -> None:
        mine = self.get_state()
        for key in ("seed", "batch_size", "window"):
            if state.get(key) != mine[key]:
                raise ValueError(f"the saved batch order has {key} {state.get(key)!r}, this "
                                 f"run {mine[key]!r}; resume with the same value")
        self.drawn = int(state["drawn"])


def pad_rows(rows: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int = 0):
    """tokens, attention mask, loss mask [B, W] (numpy), right-padded to W of
    jaxrl.sampling.buckets.quarter_bucket (four widths per octave)."""
    width = quarter_bucket(max(len(ids) for ids, _ in rows))
    tokens = np.full((len(rows), width), pad_id, np.int32)
    attn, loss = np.zeros((len(rows), width), bool), np.zeros((len(rows), width), bool)
    for r, (ids, mask) in enumerate(rows):
        tokens[r, :len(ids)], attn[r, :len(ids)], loss[r, :len(ids)] = ids, True, mask
    return tokens, attn, loss
