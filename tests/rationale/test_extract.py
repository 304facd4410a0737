"""Extraction: edit similarity, parsing of <BOT>…<EOT>, and `jaxrl rationale extract` against a
scripted OpenAI-compatible server (kept, changed, malformed and failed outputs)."""
import json
import random

import pytest

from jaxrl.cli import main
from jaxrl.rationale.extract import (
    annotation_records,
    edit_distance,
    parse_annotated,
    sentence_chunks,
    similarity,
)
from tests.rationale.scripted_server import ScriptedServer


def _reference_distance(a, b):
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def test_edit_distance_equals_the_textbook_recurrence():
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abc ") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("abc ") for _ in range(rng.randrange(12)))
        assert edit_distance(a, b) == _reference_distance(a, b), (a, b)
    assert similarity("a  b\nc", "a b c") == 1.0 and similarity("abcd", "abxd") == 0.75


def test_parsing_keeps_the_text_and_one_space_around_each_rationale():
    clean, found = parse_annotated("One. <BOT>Why two.<EOT> Two.<BOT>Why\nthree.<EOT>\nThree.")
    assert clean == "One. Two.\nThree." and found == [(4, "Why two."), (9, "Why three.")]
    assert parse_annotated("One. <BOT>open Two.") is None
    records, dropped = annotation_records("Q? <BOT>r<EOT> A.", "Q? A.", "Question", 0.9)
    assert dropped is None
    assert records == [{"preceding": "Question\n\nQ?", "rationale": "r", "following": " A."}]
    assert annotation_records("Something else. <BOT>r<EOT> entirely.", "Q? A.", None, 0.9) == \
        ([], "changed_text")
    assert sentence_chunks("A b. C d. E f.", 9) == ["A b. C d.", "E f."]


DOCS = {
    "The road froze overnight. Many cars slid into the ditch.":
        "The road froze overnight. <BOT>Ice makes tyres lose their grip.<EOT> Many cars slid "
        "into the ditch.",
    "Prices rose in March. Sales fell in April.":
        "Prices went up a lot in March. <BOT>x<EOT> Nobody bought anything in April at all.",
    "She studied every night. She passed the exam.":
        "She studied every night. <BOT>Practice leads to success. She passed the exam.",
    "The server failed. Nobody could log in.": 500,
}


def _reply(messages):
    user = messages[-1]["content"]
    if user.startswith("Question:"):
        return ("He buys 3 * 4 = 12 apples. <BOT>The apples he eats are no longer his.<EOT> "
                "He keeps 12 - 2 = 10 apples.")
    return DOCS[user.removeprefix("Text:\n")]


def test_extract_cli_keeps_faithful_outputs_and_counts_the_rest(tmp_path, capsys):
    items = [{"id": f"d{i}", "text": t, "source": "pile"} for i, t in enumerate(DOCS)]
    items.append({"id": "g0", "question": "Tom buys 3 bags of 4 apples and eats 2. How many "
                  "are left?", "answer": "He buys 3 * 4 = 12 apples. He keeps 12 - 2 = 10 "
                  "apples.", "source": "gsm8k"})
    items.append({"id": "empty"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    with ScriptedServer(_reply) as server:
        code = main(["rationale", "extract", "--input", str(tmp_path / "in.jsonl"), "--out",
                     str(tmp_path / "out.jsonl"), "--base-url", server.base_url, "--model", "m",
                     "--text-field", "answer", "--max-retries", "0"])
        assert code == 0
        rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert rows == [{"id": "g0-0", "source": "gsm8k", "preceding": items[-2]["question"]
                         + "\n\nHe buys 3 * 4 = 12 apples.",
                         "rationale": "The apples he eats are no longer his.",
                         "following": " He keeps 12 - 2 = 10 apples."}]  # only g0 has `answer`
        assert main(["rationale", "extract", "--input", str(tmp_path / "in.jsonl"), "--out",
                     str(tmp_path / "out.jsonl"), "--base-url", server.base_url, "--model", "m",
                     "--max-retries", "0"]) == 0
        system = server.bodies[-1]["messages"][0]["content"]
    assert "final answer" in system and "word for word" in system
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows == [{"id": "d0-0", "source": "pile", "preceding": "The road froze overnight.",
                     "rationale": "Ice makes tyres lose their grip.",
                     "following": " Many cars slid into the ditch."}]
    err = capsys.readouterr().err
    for part in ("items 6", "requests 4", "changed_text 1", "malformed 1",
                 "judge_http_error 1", "no_text 2", "records 1"):
        assert part in err, err


@pytest.mark.parametrize("flag,value", [("--min-similarity", "0"), ("--concurrency", "0")])
def test_bad_flags_exit_2(tmp_path, capsys, flag, value):
    (tmp_path / "in.jsonl").write_text("{}\n")
    assert main(["rationale", "extract", "--input", str(tmp_path / "in.jsonl"), "--out",
                 str(tmp_path / "o.jsonl"), "--base-url", "http://127.0.0.1:9/v1", "--model",
                 "m", flag, value]) == 2
    assert flag in capsys.readouterr().err
