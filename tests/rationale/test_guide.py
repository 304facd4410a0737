"""Guided decoding selects as specified (scripted roles whose preferences are known), and the
local and remote roles plug into it (`jaxrl guide` on a tiny model and a scripted server)."""
import json

import pytest

from jaxrl.cli import main
from jaxrl.rationale.guide import Candidate, GuideSettings, guide

QUESTION = "Ann has 5 pens and buys 3 more. How many pens does she have?"
STEPS = [[" She buys 3 pens.", " She loses 2 pens.", " She buys 3 pens."],
         [" 5 + 3 = 8.", " 5 - 3 = 2.", " The answer is: 2"],
         [" The answer is: 8", " The answer is: 9"]]
# mean log p(candidate | context [+ rationale]) by candidate; the rationale shifts it
GUIDED = {" She buys 3 pens.": -1.0, " She loses 2 pens.": -2.0, " 5 + 3 = 8.": -1.5,
          " 5 - 3 = 2.": -0.5, " The answer is: 2": -3.0, " The answer is: 8": -1.0,
          " The answer is: 9": -4.0}
PLAIN = {c: v - 1.0 for c, v in GUIDED.items()} | {" 5 - 3 = 2.": -0.1}


class Script:
    def __init__(self, steps=STEPS):
        self.steps, self.shown, self.contexts, self.pairs = steps, [], [], []

    def propose(self, question, trajectory, rationale, k):
        assert question == QUESTION and k == 3
        self.shown.append(rationale)
        return [Candidate(c) for c in self.steps[len(self.shown) - 1]]

    def write(self, context):
        self.contexts.append(context)
        return f"  hint {len(self.contexts)}\n"

    def score(self, pairs):
        self.pairs.append(list(pairs))
        return [(GUIDED if "hint" in ctx else PLAIN)[" " + c.strip()] for ctx, c in pairs]


def test_implicit_supervision_takes_the_best_guided_candidate():
    s = Script()
    result = guide(QUESTION, s.propose, s.write, s.score, GuideSettings())
    assert result.trajectory == "She buys 3 pens. 5 - 3 = 2. The answer is: 8"
    assert (result.answer, result.finish) == ("8", "answer")
    assert s.shown == [None, None, None]  # the agent never sees the rationale
    first = result.steps[0]
    assert first.candidates == ("She buys 3 pens.", "She loses 2 pens.")  # deduplicated
    assert first.rationale == "hint 1" and first.chosen == 0
    assert s.contexts[1] == QUESTION + "\n\nShe buys 3 pens."
    assert s.pairs[1][0] == (QUESTION + "\n\nShe buys 3 pens. hint 2", " 5 + 3 = 8.")


def test_contrastive_scores_subtract_the_unguided_log_prob():
    s = Script()
    result = guide(QUESTION, s.propose, s.write, s.score, GuideSettings(contrastive=True))
    # step 2 gains: 5 + 3 = 8 by 1.0, 5 - 3 = 2 by -0.4, the answer 2 by 1.0 (first wins ties)
    assert result.steps[1].chosen == 0
    assert result.steps[1].scores == pytest.approx((1.0, -0.4, 1.0))
    assert result.trajectory.endswith("5 + 3 = 8. The answer is: 8")


def test_explicit_supervision_shows_the_rationale_to_the_agent():
    s = Script()
    guide(QUESTION, s.propose, s.write, s.score, GuideSettings(mode="explicit"))
    assert s.shown == ["hint 1", "hint 2", "hint 3"]


def test_budget_end_of_reply_and_no_candidates_stop_decoding():
    s = Script([[" Step."]] * 5)
    assert guide(QUESTION, s.propose, s.write, lambda p: [0.0] * len(p),
                 GuideSettings(max_steps=3)).finish == "budget"
    ended = guide(QUESTION, lambda *a: [Candidate(" Done", final=True)], s.write,
                  lambda p: [0.0] * len(p))
    assert (ended.finish, ended.trajectory, ended.answer) == ("end", "Done", None)
    assert guide(QUESTION, lambda *a: [Candidate("  ")], s.write, s.score).finish == \
        "no_candidates"
    with pytest.raises(ValueError, match="implicit or explicit"):
        GuideSettings(mode="both")


def test_guide_cli_runs_local_scorer_with_remote_agent_and_rationale(tiny_chat, tmp_path):
    from tests.rationale.scripted_server import ScriptedServer

    path, _ = tiny_chat
    answers = iter(["Ann starts with 5 pens. Then more.", "She adds 3.", "5 + 3 = 8 in all.",
                    "The answer is: 8. Done.", "The answer is: 7", "The answer is: 9"])

    def reply(messages):
        if "implicit rationale" in messages[0]["content"]:
            return "Add what she buys to what she has.\nMore text."
        return next(answers)

    with ScriptedServer(reply) as server:
        assert main(["guide", "--model", str(path), "--question", QUESTION, "--out",
                     str(tmp_path / "out.jsonl"), "--agent-url", server.base_url,
                     "--agent-model", "a", "--rationale-url", server.base_url,
                     "--rationale-model", "r"]) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    # the k requests run concurrently, so the scripted replies arrive in any order
    assert sorted(row["steps"][0]["candidates"]) == ["5 + 3 = 8 in all.",
                                                     "Ann starts with 5 pens.", "She adds 3."]
    assert row["steps"][0]["rationale"] == "Add what she buys to what she has."
    assert row["finish"] == "answer" and row["answer"] in ("8", "7", "9")
    assert len(row["steps"]) == 2 and row["trajectory"].count("The answer is") == 1
