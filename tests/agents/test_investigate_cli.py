"""`jaxrl investigate` against a scripted OpenAI-compatible server on 127.0.0.1."""
import json
import socket

from jaxrl.cli import main
from jaxrl.envs.diagnosis import generate_cases
from tests.agents.scripted import ChatServer


def _clueless(messages):
    """Valid coarse hypotheses and baseline answers; every other reply is invalid."""
    prompt = messages[1]["content"]
    if "candidate fault categories" in prompt:
        return json.dumps({"hypotheses": [{"label": "disk", "confidence": 0.7},
                                          {"label": "memory", "confidence": 0.2}]})
    if "Think step by step" in prompt:
        return 'Disk. {"category": "disk", "root_cause": "disk full", "component": "x"}'
    return "not json"


def test_investigate_writes_reports_graphs_traces_and_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INVESTIGATE_TEST_KEY", "sk-secret-123")
    out = tmp_path / "run"
    with ChatServer(_clueless) as server:
        code = main(["investigate", "--generate", "2", "--model", server.base_url,
                     "--api-key-env", "INVESTIGATE_TEST_KEY", "--baseline", "cot",
                     "--out", str(out), "--price-in", "0.5", "--price-out", "2"])
    assert code == 0
    assert server.requests[0]["headers"]["authorization"] == "Bearer sk-secret-123"
    table = capsys.readouterr().out
    assert "gos" in table and "cot" in table and "fabrication_rate" in table
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["gos"]["cases"] == 2 and metrics["cot"]["cases"] == 2
    assert metrics["gos"]["invalid_replies"] > 0 and metrics["gos"]["cost_usd"] > 0
    for case in generate_cases(2, seed=0):
        folder = out / "gos" / case.id
        for name in ("report.json", "graph.json", "graph.png", "trace.jsonl"):
            assert (folder / name).stat().st_size > 0, name
        assert json.loads((folder / "report.json").read_text())["root_cause"] == "disk"
        assert (out / "cot" / case.id / "report.json").exists()
    written = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                      and p.suffix != ".png")
    assert "sk-secret-123" not in written
    replay = tmp_path / "replay"
    with ChatServer(_clueless) as server:
        assert main(["investigate", "--case", str(out / "cases.jsonl"), "--model",
                     server.base_url, "--out", str(replay), "--max-steps", "1"]) == 0
    rows = [json.loads(line) for line in (replay / "results.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == [c.id for c in generate_cases(2, seed=0)]


def test_bad_flags_exit_2_and_an_unreachable_model_exits_1(tmp_path, capsys):
    assert main(["investigate", "--generate", "1", "--model", "http://x/v1",
                 "--gap-delta", "1.5"]) == 2
    assert "--gap-delta must be in [0, 1]" in capsys.readouterr().err
    assert main(["investigate", "--case", str(tmp_path / "none.json"), "--model", "x"]) == 1
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["investigate", "--generate", "1", "--model", f"http://127.0.0.1:{port}/v1",
                 "--model-name", "m", "--max-retries", "0", "--out", str(tmp_path / "r")]) == 1
    assert "failed (APIConnectionError)" in capsys.readouterr().err
