"""Multi-turn rollouts through the engine on a tiny random chat model: replies and the
environment's answers alternate in one trajectory whose policy tokens carry exactly the
log-probs one forward over the whole trajectory gives, on one device and on a mesh;
environment tokens are the template's rendering of its answers and stay out of the policy mask;
the token budget cuts an episode and says so; a group shares its opening prompt."""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import EnvConfig, from_dict
from jaxrl.data.generators import generate
from jaxrl.hf.load import load_params
from jaxrl.envs.calculator import Calculator
from jaxrl.hf.tokenizer import continuation_text, eos_token_ids, load_tokenizer
from jaxrl.model.transformer import forward, positions_from_mask
from jaxrl.rl.episodes import Chat, episode_metrics, play
from tests.sharding.grpo_run import mesh_rules


@pytest.fixture(scope="module")
def chat_model(tiny_chat):
    path, _ = tiny_chat
    spec, params = load_params(path)
    tokenizer = load_tokenizer(path)
    return spec, params, Chat(tokenizer, eos_token_ids(tokenizer, path))


def _cfg(**env):
    # first_tool_choice required: every first reply opens with <tool_call>, which random text
    # never closes, so the environment answers it and a second reply follows; replies of 20
    # tokens take two engine steps (chunks of 16)
    return from_dict({"data": {"env": "calculator"}, "sampling": {"max_new_tokens": 20},
                      "env": {"max_turns": 3, "max_tokens": 128,
                              "first_tool_choice": "required", **env}})


@pytest.mark.parametrize("mesh", [None, pytest.param("2,2,2", marks=pytest.mark.slow)])
def test_trajectory_logprobs_equal_one_forward_and_env_tokens_are_masked(chat_model, mesh):
    spec, params, chat = chat_model
    records = [r for r in generate("calculator", 2, seed=1) for _ in range(2)]
    rules = None if mesh is None else mesh_rules(mesh)  # data, fsdp, tensor over 8 devices
    prompts, out, played = play(params, spec, records, jax.random.PRNGKey(0), _cfg(), chat,
                                shardings=rules)
    assert prompts[0] == prompts[1] and prompts[0].endswith("<|im_start|>assistant\n<tool_call>\n")
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = forward(params, jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), spec,
                     attn_mask=jnp.asarray(mask))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    p = out.prompt_tokens.shape[1]
    for row in range(len(records)):
        episode = played[row]["episode"]
        assert episode["turns"] == 2 and episode["calls"][0]["valid"] is False
        cols = np.flatnonzero(out.policy_mask[row])
        want = logp[row, p + cols - 1, out.tokens[row, cols]]
        np.testing.assert_allclose(out.logprobs[row, cols], want, atol=1e-5, rtol=0)
        env_cols = np.flatnonzero(out.mask[row] & ~out.policy_mask[row])
        text = chat.tokenizer.decode(out.tokens[row, env_cols].tolist())
        assert "<|im_start|>tool\nthe tool call could not be read" in text
        assert text.endswith("<|im_start|>assistant\n")
        assert (out.logprobs[row, env_cols] == 0).all()
        assert episode["tokens"] == {"policy": len(cols), "environment": len(env_cols)}
    assert out.finish_reasons == ("stop",) * 4
    metrics = episode_metrics(played)
    assert metrics["episode/turns_mean"] == 2 and metrics["episode/valid_call_frac"] == 0
    assert metrics["episode/concluded_frac"] == 1


def test_a_template_with_tools_renders_them_the_demonstration_and_the_answers(chat_model):
    from tests.serve.scripted import QWEN_TEMPLATE

    tokenizer = copy.deepcopy(chat_model[2].tokenizer)
    tokenizer.chat_template = QWEN_TEMPLATE
    chat = Chat(tokenizer, chat_model[2].eos_ids)
    env = Calculator(EnvConfig(demonstration=True, first_tool_choice="calculator"), chat.syntax)
    text, prefix = chat.opening(env, generate("calculator", 1)[0])
    assert text.startswith("<|im_start|>system\nCall a function with <tool_call>")
    assert '"name": "calculator", "description": "evaluate an arithmetic expression"' in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n' \
        '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>408</tool_response>' in text
    assert prefix == '<tool_call>\n{"name": "calculator", "arguments": '
    assert text.endswith("<|im_start|>assistant\n" + prefix)
    assert continuation_text(tokenizer, [{"role": "tool", "content": "1081"}]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>1081</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_token_budget_cuts_an_episode_and_reports_it(chat_model):
    spec, params, chat = chat_model
    records = generate("calculator", 2, seed=1)
    _, out, played = play(params, spec, records, jax.random.PRNGKey(0), _cfg(max_tokens=30),
                          chat)
    assert out.finish_reasons == ("length", "length")
    for row, record in enumerate(played):
        assert record["episode"]["finish"] == "token_budget"
        assert out.mask[row].sum() <= 30 and out.policy_mask[row].sum() >= 1
    assert episode_metrics(played)["episode/truncated_frac"] == 1
