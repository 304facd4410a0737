"""A tiny llama whose greedy replies are scripted, for tool calls end to end.

Its layers add nothing to the residual stream (o_proj and down_proj are zero), so the logits
depend on the current token alone: logits = lm_head @ rms_norm(embed[token]). Each scripted
token t gets an embedding direction of its own, and the lm_head row of its successor points
along it, so greedy decoding walks a chain token by token; every other token's embedding is
orthogonal to those directions, so after it all logits are 0 and greedy picks id 0 (an EOS).
The chains' pieces are added to the default model's tokenizer as whole tokens, so the
replies are exactly the tool-call markup below. Two chat templates written for these tests
render tools the way Qwen2.5 and Llama 3.1 do; their generation prompts end in different
tokens ("\\n" and "\\n\\n"), which start different chains.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

QWEN_CHAIN = ["\n", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": ',
              '{"city": "Paris"}}', "\n</tool_call>", "<|im_end|>"]
LLAMA_CHAIN = ["\n\n", '{"name": "get_time", ', '"parameters": ', '{"tz": "UTC"}}', "<|im_end|>"]

QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_TEMPLATE = """\
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}\
<|end_header_id|>

{% if tools and loop.last %}Answer with JSON {"name": ..., "parameters": ...}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}\
{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}
{%- else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def _weights(tokenizer, hidden: int, vocab: int, seed: int = 0):
    """(embedding [V, E], lm_head [V, E]) that walk both chains (module docstring)."""
    rng = np.random.RandomState(seed)
    ids = lambda chain: [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t))[-1]
                         if i == 0 else tokenizer.convert_tokens_to_ids(t)
                         for i, t in enumerate(chain)]
    chains = [ids(QWEN_CHAIN), ids(LLAMA_CHAIN)]
    steps = [(a, b) for chain in chains for a, b in zip(chain, chain[1:])]
    assert len({a for a, _ in steps}) == len(steps), "a scripted token has two successors"
    embed = rng.randn(vocab, hidden).astype(np.float32)
    embed[:, :len(steps)] = 0.0  # the chain directions belong to scripted tokens alone
    head = np.zeros((vocab, hidden), np.float32)
    for d, (a, b) in enumerate(steps):
        embed[a] = 0.0
        embed[a, d] = 1.0
        head[b, d] += 10.0
    return embed, head


def make_scripted(path: Path, tokenizer_dir: Path) -> Path:
    """Save the scripted model with the default tokenizer plus the chains' tokens to `path`
    (the Qwen-style template is its own; see LLAMA_TEMPLATE for the other)."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.tiny_models import hf_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces = [t for t in QWEN_CHAIN[1:-1] + LLAMA_CHAIN[1:-1]]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in pieces])
    tokenizer.chat_template = QWEN_TEMPLATE
    vocab = -(-len(tokenizer) // 64) * 64
    model = LlamaForCausalLM(hf_config("llama", vocab_size=vocab, layers=1))
    embed, head = _weights(tokenizer, model.config.hidden_size, vocab)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(embed))
        model.lm_head.weight.copy_(torch.from_numpy(head))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    shutil.copy(tokenizer_dir / "generation_config.json", path / "generation_config.json")
    return path
