"""The environment protocol on the calculator environment: tools described or rendered, calls
run and answered, unreadable and invalid calls answered with what is wrong, a reply without a
call concluding, the turn limit, the safe evaluator, and the score worked out by hand."""
import json

import pytest

from jaxrl.config import EnvConfig
from jaxrl.data.generators import generate
from jaxrl.envs import ENVIRONMENTS, environment
from jaxrl.envs.calculator import Calculator, evaluate
from jaxrl.envs.protocol import EpisodeError, ToolError
from jaxrl.hf.tool_calls import ToolSyntax

RECORD = {"id": "calculator-00000", "answer": "1081",
          "messages": [{"role": "user", "content": "There are 23 boxes with 47 pencils each."}]}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23 * 47"}}\n</tool_call>'


def test_registry_names_the_config_choices():
    from jaxrl.config import ENV_NAMES

    assert tuple(ENVIRONMENTS) == ENV_NAMES
    assert environment("calculator") is Calculator
    with pytest.raises(ValueError, match="unknown environment 'chess'; environments: calc"):
        environment("chess")


def test_tools_are_described_only_for_templates_that_render_none():
    described = Calculator(EnvConfig(), None).reset(RECORD)
    assert [m["role"] for m in described] == ["system", "user"]
    assert "Tools:\n- calculator: evaluate an arithmetic expression" in described[0]["content"]
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n' \
        '</tool_call>' in described[0]["content"]
    rendered = Calculator(EnvConfig(), ToolSyntax("qwen")).reset(RECORD)
    assert "Tools:" not in rendered[0]["content"] and rendered[1] == RECORD["messages"][0]


def test_a_demonstration_is_shown_before_the_task():
    shown = Calculator(EnvConfig(demonstration=True), None).reset(RECORD)
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "tool", "assistant",
                                          "user"]
    assert shown[2]["content"] == ('<tool_call>\n{"name": "calculator", "arguments": '
                                   '{"expression": "12 * 34"}}\n</tool_call>')
    assert shown[3]["content"] == "408" and shown[4]["content"] == "<answer>408</answer>"
    templated = Calculator(EnvConfig(demonstration=True), ToolSyntax("qwen")).reset(RECORD)
    assert templated[2]["tool_calls"] == [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "12 * 34"}}}]


def test_the_first_tool_choice_names_a_tool_of_the_environment():
    env = Calculator(EnvConfig(first_tool_choice="calculator"), None)
    env.reset(RECORD)
    assert env.first_tool_choice() == {"function": {"name": "calculator"}}
    env = Calculator(EnvConfig(first_tool_choice="abacus"), None)
    env.reset(RECORD)
    with pytest.raises(EpisodeError, match="auto, required or one of the calculator tools"):
        env.first_tool_choice()


def test_a_call_is_run_and_a_reply_without_one_concludes():
    env = Calculator(EnvConfig(), None)
    env.reset(RECORD)
    turn = env.step("Let me compute. " + CALL)
    assert turn.messages == [{"role": "tool", "content": "1081"}] and not turn.done
    assert turn.info == {"calls": 1, "valid_calls": 1}
    turn = env.step("The answer is <answer>1081</answer>")
    assert turn.done and turn.messages == [] and turn.info["finish"] == "answer"
    episode = env.episode()
    assert episode["conclusion"]["answer"] == "1081" and episode["turns"] == 2
    assert episode["calls"] == [{"name": "calculator", "arguments": {"expression": "23 * 47"},
                                 "valid": True, "output": "1081"}]
    json.dumps(episode)  # rewards receive it as JSON


def test_unreadable_and_invalid_calls_are_answered_with_what_is_wrong():
    env = Calculator(EnvConfig(max_turns=3), None)
    env.reset(RECORD)
    turn = env.step('<tool_call>\n{"name": "calculator", "arguments": {"expr')
    assert "could not be read" in turn.messages[0]["content"] and not turn.done
    turn = env.step('<tool_call>\n{"name": "abacus", "arguments": {"expression": "1"}}'
                    '\n</tool_call>')
    assert turn.messages[0]["content"].startswith("error: unknown tool 'abacus'")
    assert turn.info == {"calls": 1, "valid_calls": 0}
    turn = env.step(CALL)  # the third reply: the turn limit ends the episode after it
    assert turn.done and turn.info["finish"] == "turn_limit"
    assert [c["valid"] for c in env.episode()["calls"]] == [False, False, True]


def test_llama3_markup_is_read_when_the_template_uses_it():
    env = Calculator(EnvConfig(), ToolSyntax("llama3"))
    env.reset(RECORD)
    turn = env.step('{"name": "calculator", "parameters": {"expression": "2 * (3 + 4)"}}')
    assert turn.messages == [{"role": "tool", "content": "14"}]


def test_the_evaluator_allows_arithmetic_only():
    assert evaluate("23 * 47") == 1081 and evaluate("7 / 2") == 3.5 and evaluate("-(2**10)") \
        == -1024
    for bad, message in (("__import__('os')", "only numbers"), ("2 ** 1000", "exponents"),
                         ("1 / 0", "division by zero"), ("12 *", "cannot read")):
        with pytest.raises(ToolError, match=message):
            evaluate(bad)


def test_score_worked_by_hand():
    cfg = EnvConfig(evidence_bonus=0.2, turn_cost=0.05)
    episode = {"env": "calculator", "turns": 2, "finish": "answer",
               "calls": [{"name": "calculator", "arguments": {}, "valid": True, "output": "1081"}],
               "conclusion": {"text": "", "answer": "1,081"}}
    value, components, info = Calculator.score(RECORD, episode, cfg)
    assert value == pytest.approx(1 + 0.2 - 2 * 0.05)  # correct, evidence, two replies
    assert components == {"correct": 1.0, "evidence": 1.0, "turns": 2.0, "calls": 1.0,
                          "valid_calls": 1.0}
    wrong = {**episode, "calls": [], "turns": 1, "conclusion": {"text": "", "answer": "1080"}}
    assert Calculator.score(RECORD, wrong, cfg)[0] == pytest.approx(-0.05)
    assert Calculator.score(RECORD, wrong, cfg)[2]["error"] == "wrong_answer"
    cut = {**episode, "conclusion": None, "finish": "token_budget"}
    value, components, info = Calculator.score(RECORD, cut, cfg)
    assert value == pytest.approx(-0.1) and info["error"] == "no_answer"
    assert components["evidence"] == 0.0  # nothing was concluded from the result


def test_records_without_a_numeric_answer_are_refused():
    record = generate("diagnosis", 1)[0]
    with pytest.raises(EpisodeError, match="numeric answer"):
        Calculator(EnvConfig(), None).reset(record)


def test_calculator_problems_need_the_tool():
    records = generate("calculator", 50, seed=0)
    for r in records:
        assert int(r["answer"]) == evaluate(r["metadata"]["expression"]) >= 144
        assert [m["role"] for m in r["messages"]] == ["user"]
