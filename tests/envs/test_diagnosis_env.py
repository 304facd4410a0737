"""The diagnosis environment: each case tool is a function of a target, calls reveal the case's
outputs, the conclusion is read and judged (Match, Relevant), and quotes of text never seen
count as fabricated; scores worked out by hand."""
import pytest

from jaxrl.config import EnvConfig
from jaxrl.data.generators import generate
from jaxrl.envs.diagnosis import Diagnosis, read_conclusion
from jaxrl.envs.base import case_from_json
from jaxrl.envs.protocol import EpisodeError

CFG = EnvConfig(evidence_bonus=0.1, fabrication_penalty=0.25, turn_cost=0.05,
                relevant_credit=0.5)


def _episode():
    record = generate("diagnosis", 1, seed=4)[0]
    case = case_from_json(record["metadata"]["case"])
    tool, target = next((t, x) for t, outs in case.outputs.items() for x in outs)
    env = Diagnosis(CFG, None)
    env.reset(record)
    return record, case, env, tool, target


def test_case_tools_are_functions_of_a_target_and_reveal_the_outputs():
    record, case, env, tool, target = _episode()
    assert sorted(t["function"]["name"] for t in env.tools) == sorted(case.tools)
    call = f'<tool_call>\n{{"name": "{tool}", "arguments": {{"target": "{target}"}}}}\n</tool_call>'
    turn = env.step(call)
    assert turn.messages == [{"role": "tool", "content": case.outputs[tool][target]}]
    turn = env.step('<tool_call>\n{"name": "strace", "arguments": {"target": "x"}}\n</tool_call>')
    assert "unknown tool 'strace'" in turn.messages[0]["content"]


def _conclude(env, case, quote: str, cause: str):
    text = (f"<answer>\ncategory: {case.gold.coarse}\nroot cause: {cause} on "
            f"{case.gold.component}\nevidence: \"{quote}\"\n</answer>")
    assert env.step(text).done
    return env.episode()


def test_a_grounded_match_scores_outcome_and_evidence_less_turns():
    record, case, env, tool, target = _episode()
    env.step(f'<tool_call>\n{{"name": "{tool}", "arguments": {{"target": "{target}"}}}}'
             '\n</tool_call>')
    quote = case.outputs[tool][target].splitlines()[0][:40]
    episode = _conclude(env, case, quote, case.gold.fine)
    value, components, _ = Diagnosis.score(record, episode, CFG)
    assert components["match"] == components["relevant"] == 1.0
    assert components["fabricated"] == 0.0 and components["quotes"] == 1.0
    assert value == pytest.approx(1.0 + 0.1 - 2 * 0.05)


def test_a_fabricated_quote_without_evidence_scores_negative():
    record, case, env, _, _ = _episode()
    episode = _conclude(env, case, "kernel: EXT4-fs error on /dev/nvme9 journal aborted",
                        "a cosmic ray")
    value, components, _ = Diagnosis.score(record, episode, CFG)
    assert components["match"] == 0.0 and components["relevant"] == 1.0  # the category named
    assert components["fabricated"] == 1.0 and components["evidence"] == 0.0
    assert value == pytest.approx(0.5 - 0.25 - 0.05)


def test_a_conclusion_is_read_from_its_fields_or_whole():
    read = read_conclusion('<answer>category: disk\nroot cause: disk full on node-12\n'
                           'evidence: "df shows 100%" and "write failed"</answer>')
    assert read["category"] == "disk" and read["root_cause"] == "disk full on node-12"
    assert read["quotes"] == ["df shows 100%", "write failed"]
    assert read_conclusion("it is the disk on node-12")["root_cause"] == \
        "it is the disk on node-12"


def test_records_without_a_case_are_refused():
    record = generate("calculator", 1)[0]
    with pytest.raises(EpisodeError, match="metadata\\['case'\\]"):
        Diagnosis(CFG, None).reset(record)
