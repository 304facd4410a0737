"""`jaxrl data`: writes records, lists tasks, exit codes."""
import pytest

from jaxrl.cli import main
from jaxrl.data.generators import generate
from jaxrl.data.records import read_jsonl


def test_writes_generated_records(tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["data", "--task", "crypto", "--n", "7", "--seed", "3", "--out", str(out)]) == 0
    assert read_jsonl(out) == generate("crypto", 7, seed=3)
    assert f"wrote 7 crypto records to {out}" in capsys.readouterr().err
    assert main(["data", "--task", "list_fn", "--n", "3", "--difficulty", "3", "--out",
                 str(out)]) == 0
    assert read_jsonl(out) == generate("list_fn", 3, seed=0, difficulty=3)
    assert main(["data", "--task", "knk", "--n", "2", "--out", str(out)]) == 0
    assert read_jsonl(out) == generate("knk", 2, seed=0)


def test_list_names_every_task_and_its_kind(capsys):
    assert main(["data", "--list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for name in ("arithmetic", "crypto", "list_fn", "abduction_rules", "knk", "zebra"):
        assert "generated" in lines[name] and "not yet" not in lines[name]
    assert "[verifier knk]" in lines["knk"] and "[verifier zebra]" in lines["zebra"]
    assert "loaded" in lines["balanced_copa"] and "CEDAR training" in lines["balanced_copa"]
    assert "loaded (format assumed)" in lines["uniadilr"]
    assert "CEDAR evaluation" in lines["musr"]
    for name in ("ar_lsat", "zebralogic"):
        assert "loaded" in lines[name] and "[Spring evaluation]" in lines[name]
        assert "CEDAR" not in lines[name]


def test_writes_a_sample_of_a_loaded_task(tmp_path):
    from tests.data.test_loaders import _write_all

    _write_all(tmp_path)
    out = tmp_path / "copa.jsonl"
    assert main(["data", "--task", "balanced_copa", "--n", "2", "--data-dir", str(tmp_path),
                 "--out", str(out)]) == 0
    assert sorted(r["answer"] for r in read_jsonl(out)) == ["A", "B"]


@pytest.mark.parametrize("argv, message", [
    (["--task", "knights", "--n", "3", "--out", "x.jsonl"],
     "task 'knights' is not available; generated tasks: abduction_rules, arithmetic, "
     "calculator, crypto, diagnosis, knk, knk-brief, list_fn, zebra; loaded tasks: "),
    (["--task", "arithmetic"], "needs --n, --out (or --list)"),
    (["--task", "arithmetic", "--n", "0", "--out", "x.jsonl"], "--n must be >= 1; got 0"),
])
def test_bad_usage_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(["data", *argv])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_dataset_exits_1_and_says_where(tmp_path, capsys):
    code = main(["data", "--task", "medqa", "--n", "2", "--data-dir", str(tmp_path),
                 "--out", str(tmp_path / "m.jsonl")])
    assert code == 1
    assert f"put its JSONL, JSON, Parquet or CSV file(s) in '{tmp_path}/medqa/'" in \
        capsys.readouterr().err


def test_malformed_dataset_exits_1(tmp_path, capsys):
    (tmp_path / "strategyqa.jsonl").write_text('{"question": "q"}\n')
    code = main(["data", "--task", "strategyqa", "--n", "1", "--data-dir", str(tmp_path),
                 "--out", str(tmp_path / "s.jsonl")])
    assert code == 1
    assert "row 1: missing field 'answer'" in capsys.readouterr().err
