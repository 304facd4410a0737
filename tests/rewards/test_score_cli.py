"""`jaxrl score`: saved completions in, scored lines out, through the pool."""
import json

import pytest

from jaxrl.cli import main
from jaxrl.rewards.judge import CACHE_FILE
from tests.rewards.openai_stub import StubServer
from tests.rewards.test_correctness import RECORDS


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def _records():
    lines = []
    for kind, (record, wrong) in sorted(RECORDS.items()):
        for answer in (record["answer"], wrong):
            lines.append({"id": f"{kind}-{len(lines)}", "task": "list_fn", "split": "train",
                          "messages": [{"role": "user", "content": f"Solve the {kind} task."}],
                          "metadata": {}, **record,
                          "completion": f"<think>t</think><answer>{answer}</answer>"})
    return lines


def test_score_correctness(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", _records())
    out = tmp_path / "out.jsonl"
    assert main(["score", "--reward", "correctness", "--input", str(src), "--out", str(out),
                 f"run.output_dir={tmp_path}"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["reward"] for line in lines] == [1.0, 0.0] * len(RECORDS)
    assert all(line["components"]["correctness"] == line["reward"] for line in lines)
    assert lines[1]["info"]["error"] and lines[0]["id"] == _records()[0]["id"]
    assert (f"scored {2 * len(RECORDS)} completions with correctness: mean reward 0.5000"
            in capsys.readouterr().err)


def test_score_cedar_against_a_local_judge(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", _records()[:2])
    with StubServer() as server:
        assert main(["score", "--reward", "cedar", "--input", str(src),
                     f"judge.base_url={server.base_url}", "judge.model=stub",
                     f"run.output_dir={tmp_path / 'run'}"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["reward"] for line in lines] == pytest.approx([1 + 0.25 * 2 / 3 + 0.25,
                                                                0.25 * 2 / 3 + 0.25])
    assert set(lines[0]["components"]) == {"correctness", "coverage", "directionality"}
    assert (tmp_path / "run" / CACHE_FILE).is_file() and "failures: none" in captured.err


@pytest.mark.parametrize("content,message", [
    (None, "cannot be read"),
    ("{not json\n", "line 1 is not JSON"),
    ('{"id": 1}\n', "line 1 must be a JSON object with a string `completion` field"),
    ('{"id": "r", "answer": "1", "verifier": {"kind": "zebra9"}, "completion": "x"}\n',
     "unknown verifier kind 'zebra9'"),
])
def test_bad_input_exits_2(tmp_path, capsys, content, message):
    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_text(content, encoding="utf-8")
    assert main(["score", "--reward", "correctness", "--input", str(src)]) == 2
    assert message in capsys.readouterr().err


def test_unknown_reward_and_judge_without_server_exit_2(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", _records()[:1])
    with pytest.raises(SystemExit) as err:
        main(["score", "--reward", "spring2", "--input", str(src)])
    assert err.value.code == 2 and "cedar_coverage" in capsys.readouterr().err
    assert main(["score", "--reward", "cedar_coverage", "--input", str(src)]) == 2
    assert "judge.base_url" in capsys.readouterr().err
