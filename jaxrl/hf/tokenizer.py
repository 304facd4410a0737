"""A model directory's tokenizer and chat template, chat prompts as token ids, and EOS ids."""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Chat models end turns with these; each counts as an EOS id where the vocabulary has it.
CHAT_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class TokenizerError(ValueError):
    """A model directory has no usable tokenizer or chat template."""


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer (with its chat template) saved in `model_dir`."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any(model_dir.glob("tokenizer*")):
        raise TokenizerError(f"no tokenizer files (tokenizer.json or tokenizer_config.json) in "
                             f"{model_dir}; save the model's tokenizer there")
    return AutoTokenizer.from_pretrained(model_dir)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(tokenizer, model_dir: str | Path | None = None) -> tuple[int, ...]:
    """Every id that ends a completion, in this order without repeats: the tokenizer's EOS,
    generation_config.json's eos_token_id (an int or a list), then `<|im_end|>` and
    `<|endoftext|>` where the vocabulary has them."""
    ids = _ids(tokenizer.eos_token_id)
    config = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if config is not None and config.is_file():
        ids += _ids(json.loads(config.read_text()).get("eos_token_id"))
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in CHAT_END_TOKENS if t in vocab]
    return tuple(dict.fromkeys(ids))


def chat_prompt_text(tokenizer, messages: Sequence[Mapping[str, str]],
                     add_generation_prompt: bool = True,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     thinking: bool | None = None) -> str:
    """`messages` ([{"role", "content"}, ...]) rendered by the chat template, ending with the
    assistant header when add_generation_prompt; tools: OpenAI function definitions the template
    renders (jaxrl.hf.tool_calls.syntax_of says whether it can); thinking: the template's
    enable_thinking (Qwen3's; templates without it ignore it), None: its default."""
    if not tokenizer.chat_template:
        raise TokenizerError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass a "
                             "chat model's directory or token ids")
    extra = {} if thinking is None else {"enable_thinking": thinking}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **extra)


_REPLY = "\u2063reply\u2063"  # stands for an assistant reply; no template writes it


def continuation_text(tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """The text the chat template writes after an assistant reply's content when `messages`
    (tool results, a user message) follow it: the reply's end-of-turn markup, the messages and
    the next assistant header. Read off a rendered stand-in conversation, so a template that
    renders earlier turns differently (Qwen3 drops past reasoning) still gives what follows a
    reply."""
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _REPLY},
                    *messages]
    text = chat_prompt_text(tokenizer, conversation)
    return text[text.index(_REPLY) + len(_REPLY):]


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text; the template wrote the special tokens, so none are added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered by the chat template (see `chat_prompt_text`)."""
    return text_ids(tokenizer, chat_prompt_text(tokenizer, messages, add_generation_prompt))


def detokenizer(tokenizer) -> Callable[[Sequence[int]], str]:
    """ids -> text without special tokens (EOS ids and template markers are dropped)."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
