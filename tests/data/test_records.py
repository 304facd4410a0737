"""Records: the schema, its validation messages (file and line), JSONL round trips."""
import json
import re

import pytest

from jaxrl.data.records import (
    VERIFIER_FIELDS,
    RecordError,
    make_record,
    read_jsonl,
    register_verifier_kind,
    validate_record,
    write_jsonl,
)

MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 1 + 1?"}]


def _record(**changes):
    record = make_record("arithmetic", 17, MESSAGES, "2", {"kind": "numeric"}, {"seed": 0})
    record.update(changes)
    return record


def test_make_record_follows_the_contract():
    record = _record()
    assert record == {"id": "arithmetic-00017", "task": "arithmetic", "split": "train",
                      "messages": MESSAGES, "answer": "2", "verifier": {"kind": "numeric"},
                      "metadata": {"seed": 0}}


def test_round_trip(tmp_path):
    records = [_record(), _record(id="arithmetic-00018", split="validation")]
    path = tmp_path / "sub" / "r.jsonl"
    assert write_jsonl(records, path) == 2
    assert read_jsonl(path) == records
    assert all(json.loads(line) for line in path.read_text().splitlines())


@pytest.mark.parametrize("change, message", [
    ({"split": "dev"}, "'split' must be one of train, validation, test; got 'dev'"),
    ({"answer": 2}, "'answer' must be a string; got 2"),
    ({"id": ""}, "'id' must be a non-empty string"),
    # the kinds registered so far follow (generators register theirs when imported)
    ({"verifier": {"kind": "fuzzy"}}, "unknown verifier kind 'fuzzy'; known kinds: "),
    ({"verifier": {"kind": "label"}}, "verifier kind 'label' needs 'labels' as a list"),
    ({"verifier": {"kind": "numeric", "tolerance": "x"}}, "needs 'tolerance' as a number"),
    ({"verifier": {"kind": "python", "entry_point": "f", "tests": [{"input": 1}]}},
     "verifier tests[0] must be {'input': ..., 'output': ...}"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0] must be {'role': one "
                                                            "of system, user"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
     "the last message must have role 'user'"),
    ({"metadata": []}, "'metadata' must be an object"),
    ({"extra": 1}, "unknown key(s) extra; a record has only id, task, split"),
])
def test_validation_names_the_problem(change, message):
    with pytest.raises(RecordError, match=re.escape(message)):
        validate_record(_record(**change))


def test_missing_key():
    record = _record()
    del record["verifier"]
    with pytest.raises(RecordError, match=r"missing key\(s\) verifier"):
        validate_record(record)


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(_record())
    path.write_text(f"{good}\n\n{json.dumps(_record(split='dev'))}\n")
    with pytest.raises(RecordError, match=re.escape(f"file '{path}' line 3: 'split' must be")):
        read_jsonl(path)
    path.write_text(f"{good}\n{{not json\n")
    with pytest.raises(RecordError, match=re.escape(f"file '{path}' line 2: not valid JSON")):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(RecordError, match="line 1: a record must be a JSON object; got list"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="records file .* does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_writing_an_invalid_record_fails_before_writing_it(tmp_path):
    with pytest.raises(RecordError, match="record 1 written to .*'split' must be"):
        write_jsonl([_record(), _record(split="x")], tmp_path / "r.jsonl")


def test_later_verifier_kinds_register_their_fields():
    register_verifier_kind("knk_test", {"roles": (dict, True)})
    try:
        validate_record(_record(verifier={"kind": "knk_test", "roles": {"A": "knight"}}))
        with pytest.raises(RecordError, match="needs 'roles' as an object"):
            validate_record(_record(verifier={"kind": "knk_test"}))
        with pytest.raises(ValueError, match="already registered with other fields"):
            register_verifier_kind("knk_test", {})
    finally:
        VERIFIER_FIELDS.pop("knk_test")
