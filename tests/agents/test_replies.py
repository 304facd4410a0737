"""JSON replies: extraction, validation messages, bounded retry, token budget."""
import pytest

from jaxrl.agents import schemas
from jaxrl.agents.replies import Asker, ReplyError, json_objects, parse_reply
from tests.agents.scripted import ScriptedChat

RETRIEVE = schemas.retrieve(["dmesg", "df"])


def test_json_is_found_inside_fences_and_prose():
    text = 'Sure! {"a": 1 oops {"tool": "df", "target": "node-1"}\n```json\n{"done": true}\n```'
    assert json_objects(text) == [{"tool": "df", "target": "node-1"}, {"done": True}]
    assert parse_reply(text, RETRIEVE) == {"tool": "df", "target": "node-1"}


@pytest.mark.parametrize("text, error", [
    ("the disk is broken", "no JSON object"),
    ('{"tool": "strace", "target": "x"}', "tool 'strace' is not one of: df, dmesg"),
    ('{"tool": "df", "target": ""}', "'target' must be a non-empty string"),
])
def test_invalid_replies_say_what_is_wrong(text, error):
    with pytest.raises(ReplyError, match=error):
        parse_reply(text, RETRIEVE)


def test_schema_errors_name_the_field():
    with pytest.raises(ReplyError, match=r"confidence of disk must be a number in \[0, 1\]"):
        schemas.hypotheses(["S1"], 3)({"hypotheses": [{"label": "disk", "confidence": 2}]})
    with pytest.raises(ReplyError, match="signal 'S9' is not one of: S1"):
        schemas.hypotheses(["S1"], 3)({"hypotheses": [{"label": "d", "confidence": 0.5,
                                                       "explains": ["S9"]}]})
    with pytest.raises(ReplyError, match="decision 'maybe' is not one of: refine, report"):
        schemas.update(["H1"])({"confidence": {"H1": 0.5}, "decision": "maybe"})


def test_a_retry_shows_the_error_and_counts_it():
    replies = iter(['{"tool": "top"}', '{"tool": "df", "target": "node-1"}'])
    client = ScriptedChat(lambda messages: next(replies))
    events = []
    asker = Asker(client, max_tokens=64, token_budget=1000, retries=1, record=events.append)
    assert asker.ask("expert", [{"role": "user", "content": "go"}], RETRIEVE) == {
        "tool": "df", "target": "node-1"}
    assert (asker.usage.calls, asker.usage.invalid, asker.usage.failed) == (2, 1, 0)
    assert "tool 'top' is not one of" in client.chats[1][-1]["content"]
    assert events[0]["event"] == "invalid_reply" and events[0]["reply"] == '{"tool": "top"}'


def test_out_of_retries_and_out_of_budget_return_none():
    asker = Asker(ScriptedChat(lambda m: "nothing " * 30), max_tokens=64, token_budget=40,
                  retries=2)
    assert asker.ask("central", [{"role": "user", "content": "go"}], RETRIEVE) is None
    # the first reply (30 tokens) and the retry (capped at the 10 left) spend the budget
    assert (asker.usage.calls, asker.usage.invalid, asker.usage.skipped) == (2, 2, 1)
    assert asker.spent and asker.ask("central", [], RETRIEVE) is None
