"""`echo` with `logprobs` on /v1/completions through the openai client: the prompt tokens'
log-probs equal a teacher-forced forward of the requested model (the base, or an adapter
served beside it), max_tokens 0 returns the prompt alone, and with max_tokens > 0 the prompt
comes first and the completion is the one a plain request gets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.hf.peft_io import load_peft_adapter
from jaxrl.model.transformer import forward
from jaxrl.rl.logprobs import token_logprobs
from jaxrl.serve import start_server
from tests.serve.helpers import SERVE, client, post
from tests.serve.test_adapters import _adapter

PROMPT = "Once upon a time, the cat sat on the mat"


@pytest.fixture(scope="module")
def served(tiny_chat_model, tmp_path_factory):
    lora = load_peft_adapter(_adapter(tmp_path_factory.mktemp("echo") / "a", 3),
                             tiny_chat_model.spec)
    with start_server(tiny_chat_model, port=0, adapters={"tuned": lora}, **SERVE) as handle:
        yield handle, lora


def _reference(model, ids, lora=None):
    """(log p of tokens 1.., the log-softmax [n - 1, V]) by a teacher-forced forward."""
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids))[None]
    logp, _ = token_logprobs(model.params, model.spec, tokens, positions, lora=lora)
    logits, _ = forward(model.params, tokens, positions, model.spec, lora=lora)
    return np.asarray(logp[0]), np.asarray(jax.nn.log_softmax(logits[0, :-1]))


@pytest.mark.parametrize("adapter", [False, True])
def test_prompt_logprobs_equal_a_teacher_forced_forward(served, tiny_chat_model, adapter):
    handle, lora = served
    model = tiny_chat_model
    ids = model.ids(PROMPT)
    want, table = _reference(model, ids, lora if adapter else None)
    reply = client(handle).completions.create(
        model="tuned" if adapter else handle.model_id, prompt=PROMPT, echo=True, logprobs=3,
        max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [model.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want, rtol=1e-4, atol=1e-5)
    for j, top in enumerate(lp.top_logprobs[1:]):
        best = np.sort(table[j])[::-1][:3]
        np.testing.assert_allclose(sorted(top.values(), reverse=True), best, rtol=1e-4,
                                   atol=1e-5)
    # each token's text starts where the text before it ends
    assert lp.text_offset[0] == 0
    assert all(PROMPT[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))


def test_the_adapter_changes_the_prompt_logprobs(served):
    handle, _ = served
    c = client(handle)
    base, tuned = (c.completions.create(model=m, prompt=PROMPT, echo=True, logprobs=0,
                                        max_tokens=0).choices[0].logprobs.token_logprobs[1:]
                   for m in (handle.model_id, "tuned"))
    assert not np.allclose(base, tuned, atol=1e-3)


def test_echo_then_the_completion(served, tiny_chat_model):
    handle, _ = served
    model, c = tiny_chat_model, client(handle)
    prompts = [model.ids(PROMPT), model.ids("Hello there")]  # token ids, two prompts
    plain = c.completions.create(model=handle.model_id, prompt=prompts, temperature=0,
                                 max_tokens=6, logprobs=2)
    echoed = c.completions.create(model=handle.model_id, prompt=prompts, temperature=0,
                                  max_tokens=6, logprobs=2, echo=True, n=2)
    assert len(echoed.choices) == 4
    for choice in echoed.choices:
        i = choice.index // 2
        ids, ref = prompts[i], plain.choices[i]
        text = model.tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.text == text + ref.text
        lp, n = choice.logprobs, len(ids)
        want, _ = _reference(model, ids)
        np.testing.assert_allclose(lp.token_logprobs[1:n], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lp.token_logprobs[n:], ref.logprobs.token_logprobs,
                                   rtol=1e-5)
        assert lp.tokens[n:] == ref.logprobs.tokens
        assert lp.text_offset[n:] == [len(text) + o for o in ref.logprobs.text_offset]
    # echo without logprobs: the text alone
    bare = c.completions.create(model=handle.model_id, prompt=PROMPT, echo=True, max_tokens=0)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


def test_a_stream_echoes_first(served):
    handle, _ = served
    c = client(handle)
    whole = c.completions.create(model=handle.model_id, prompt=PROMPT, echo=True, logprobs=1,
                                 max_tokens=4, temperature=0)
    chunks = list(c.completions.create(model=handle.model_id, prompt=PROMPT, echo=True,
                                       logprobs=1, max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    joined = [t for ch in chunks if ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.token_logprobs]
    assert joined == whole.choices[0].logprobs.token_logprobs


def test_max_tokens_0_needs_echo(served):
    handle, _ = served
    status, body = post(handle, "/completions", {"model": handle.model_id, "prompt": PROMPT,
                                                 "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert "echo" in body["error"]["message"]
    status, body = post(handle, "/chat/completions", {
        "model": handle.model_id, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
