"""Loaders: small files in each dataset's public format, written here, mapped to records whose
gold answers pass their verifier; missing and malformed datasets are clear errors."""
import csv
import importlib.util
import json
import re

import pandas as pd
import pytest

from jaxrl.data.loaders import DatasetMissingError, UnknownSourceError, load_source
from jaxrl.data.records import RecordError, validate_record
from jaxrl.data.sources import GO_EMOTIONS, SOURCES
from tests.data.reference import perturb, score, score_python


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def _csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


COPA = [  # the Balanced COPA card's example: label 1 is choice1
    {"id": 1, "premise": "My body cast a shadow over the grass.", "choice1": "The sun was rising.",
     "choice2": "The grass was cut.", "question": "cause", "label": 1, "mirrored": False},
    {"id": 2, "premise": "The ice melted.", "choice1": "It got colder.",
     "choice2": "The sun came out.", "question": "cause", "label": 2, "mirrored": True},
    {"id": 3, "premise": "I pushed the glass off the table.", "choice1": "It shattered.",
     "choice2": "It floated.", "question": "effect", "label": 1, "mirrored": False},
]


_ABDUCTION = {"context": "The cat is big. If something is big and red then it is cute.",
              "questions": [{"id": "q1", "text": "The cat is cute.", "label": "The cat is red.",
                             "QCat": "0"},
                            {"id": "q2", "text": "The cat is not cute.",
                             "label": "The cat is red.", "QCat": "0_0"}]}
# (writer, path under the data directory, content): each source in (one of) its public formats
FILES = [
    (_csv, "balanced_copa/train.csv", COPA),
    (_jsonl, "uniadilr/train.jsonl", [
        {"context": ["Tom is tall.", "Tom plays basketball.", "It rained."],
         "hypothesis": "Tom is on a team.", "answer": [2, 1]},
        {"context": "A is red.\nB is blue.", "hypothesis": "B is cold.", "answer": "2"}]),
    (_jsonl, "causelogics/train.jsonl", [
        {"premises": ["The road is wet."], "rules": ["If it rains, the road is wet."],
         "phenomenon": "The road is wet.", "cause": "It rained.", "label": True, "level": 1},
        {"premises": "The lamp is off.", "rules": "If the bulb breaks, the lamp is off.",
         "phenomenon": "The lamp is off.", "cause": "The sun set.", "label": "invalid",
         "level": 2}]),
    (_parquet, "climate_fever/test.parquet", [
        {"claim_id": "0", "claim": "Sea levels are rising.", "claim_label": 0,
         "evidences": [{"evidence_id": "a", "evidence_label": 0, "article": "Sea",
                        "evidence": "Tide gauges show a rise.", "entropy": 0.0,
                        "votes": ["SUPPORTS"]}]},
        {"claim_id": "1", "claim": "CO2 is not a greenhouse gas.", "claim_label": 1,
         "evidences": [{"evidence_id": "b", "evidence_label": 1, "article": "CO2",
                        "evidence": "CO2 absorbs infrared.", "entropy": 0.0,
                        "votes": ["REFUTES"]}]}]),
    *[(_jsonl, f"abductionrules/{variant}/dev.jsonl", [{"id": f"{variant}-0", **_ABDUCTION}])
      for variant in ("Abduction-Animal-Simple", "Abduction-Person")],
    *[(_json, f"list_functions/{name}/task.json", {"name": name, "examples": [
        {"input": json.dumps(x), "target": json.dumps([v + offset for v in x])}
        for x in ([1], [2, 3], [0], [5, 5], [9], [4, 1], [7])]})
      for name, offset in (("c001", 1), ("c002", 2))],
    (_parquet, "art/validation.parquet", [
        {"observation_1": "Chad went to the store.", "observation_2": "Chad came home with milk.",
         "hypothesis_1": "Chad bought milk.", "hypothesis_2": "Chad flew away.", "label": 1},
        {"observation_1": "It was sunny.", "observation_2": "Amy got sunburnt.",
         "hypothesis_1": "Amy stayed inside.", "hypothesis_2": "Amy forgot sunscreen.",
         "label": 2}]),
    (_json, "neulr_abductive/abductive_neutral.json", [
        {"id": 0, "context": "Fact1: NPa is ADPb.\nRule1: If something is ADPb and ADPc then it "
         "is ADPd.\nThe fact is: NPa is ADPd.", "label": "NPa is ADPc.",
         "explain": "[(tripleM) -> rule1]."}]),
    (_jsonl, "defeasible_nli/test.jsonl", [
        {"Premise": "A man rides a bike.", "Hypothesis": "He is outside.",
         "Update": "He is on a trail.", "UpdateType": "strengthener"},
        {"Hypothesis": "You should help friends.", "Update": "The friend asks you to lie.",
         "UpdateType": "weakener"}]),
    (_parquet, "go_emotions/test.parquet", [
        {"text": "Thanks so much, I love it!", "labels": [18, 15], "id": "e1"},
        {"text": "Meh.", "labels": [27], "id": "e2"}]),
    (_csv, "musr/murder_mystery.csv", [
        {"narrative": "In the library...", "question": "Who is the most likely murderer?",
         "choices": str(["Alice", "Bob"]), "answer_index": 1, "answer_choice": "Bob"}]),
    (_jsonl, "medqa/test.jsonl", [
        {"question": "A 30-year-old has a fever. Most likely diagnosis?",
         "options": {"A": "Flu", "B": "Gout", "C": "Fracture", "D": "Acne"}, "answer_idx": "A",
         "answer": "Flu", "meta_info": "step1"}]),
    (_jsonl, "ml_debugging/test.jsonl", [
        {"question": "Loss is NaN after one step. Why?", "choices": ["lr too high", "no bias"],
         "answer": "A"},
        {"question": "Which optimizer step was skipped?", "answer": "zero_grad"}]),
    (_json, "strategyqa/strategyqa_train.json", [
        {"qid": "q1", "term": "Fish", "description": "d", "question": "Can fish climb trees?",
         "answer": False, "facts": ["Fish live in water."], "decomposition": ["Can fish walk?"]}]),
    (_json, "ar_lsat/AR_TestData.json", [  # AR-LSAT: passages, each with its questions
        {"id": "p1", "passage": "Seven children get five lockers.", "questions": [
            {"id": "q1", "question": "Which must be true?",
             "options": ["A) Juan", "B) Paul", "C) Fred"], "answer": "B", "tags": ["ordering"]},
            {"id": "q2", "question": "Which could be true?", "options": ["A) Nita", "B) Rachel"],
             "answer": "A", "tags": []}]}]),
    (_parquet, "zebralogic/grid_mode.parquet", [  # ZebraLogicBench grid_mode, with solutions
        {"id": "lgp-test-3x2-0", "size": "3*2",
         "puzzle": "There are 3 houses. 1. Eric lives in house 3. 2. Arnold has a dog. 3. The "
                   "person with the bird lives directly left of Arnold.",
         "solution": {"header": ["House", "Name", "Pet Animal"],
                      "rows": [["2", "Arnold", "dog"], ["1", "Peter", "bird"],
                               ["3", "Eric", "cat"]]}}]),
]
ZEBRA_GOLD = json.dumps({"House 1": {"Name": "Peter", "Pet Animal": "bird"},
                         "House 2": {"Name": "Arnold", "Pet Animal": "dog"},
                         "House 3": {"Name": "Eric", "Pet Animal": "cat"}})
EXPECTED = {
    "balanced_copa": ["A", "B"], "copa_effect": ["A"], "uniadilr": ["1, 2", "2"],
    "causelogics": ["yes", "no"], "climate_fever": ["SUPPORTS", "REFUTES"],
    "abductionrules": ["The cat is red."] * 4, "list_functions": ["", ""], "art": ["A", "B"],
    "neulr_abductive": ["NPa is ADPc."], "defeasible_nli": ["strengthener", "weakener"],
    "go_emotions": ["gratitude, love", "neutral"], "musr": ["B"], "medqa": ["A"],
    "ml_debugging": ["A", "zero_grad"], "strategyqa": ["no"], "ar_lsat": ["B", "A"],
    "zebralogic": [ZEBRA_GOLD],
}


def _write_all(d):
    """Write every source's small dataset under d; returns the expected gold answers."""
    for write, path, content in FILES:
        write(d / path, content)
    return EXPECTED


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return d, _write_all(d)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_source_maps_its_public_format(data_dir, name):
    d, expected = data_dir
    records = load_source(name, d)
    assert [r["answer"] for r in records] == expected[name]
    split = "train" if SOURCES[name].role == "train" else "test"
    for i, r in enumerate(records):
        validate_record(r)
        assert r["id"] == f"{name}-{i:05d}" and r["task"] == name and r["split"] == split
        assert r["metadata"]["file"].startswith(str(d))
        if r["verifier"]["kind"] != "python":
            assert score(r, r["answer"]) == 1.0 and score(r, perturb(r)) == 0.0


def test_prompts_carry_the_fields(data_dir):
    d, _ = data_dir
    copa = load_source("balanced_copa", d)[0]["messages"][-1]["content"]
    assert "A. The sun was rising.\nB. The grass was cut." in copa and "cause" in copa
    assert "letter of the correct option (A, B)" in copa
    fever = load_source("climate_fever", d)[0]
    assert "1. Tide gauges show a rise." in fever["messages"][-1]["content"]
    assert fever["verifier"]["labels"] == ["SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO", "DISPUTED"]
    emotions = load_source("go_emotions", d)[0]
    assert emotions["verifier"] == {"kind": "set"} and ", ".join(GO_EMOTIONS) in \
        emotions["messages"][-1]["content"]
    assert "Premise:" not in load_source("defeasible_nli", d)[1]["messages"][-1]["content"]
    groups = {r["metadata"]["group"] for r in load_source("abductionrules", d)}
    assert groups == {"Abduction-Animal-Simple", "Abduction-Person"}
    assert load_source("musr", d)[0]["verifier"] == {"kind": "mcq", "choices": ["A", "B"]}
    lsat = load_source("ar_lsat", d)[0]  # ready-made prompts (Problem.fields["messages"])
    assert lsat["verifier"] == {"kind": "mcq", "choices": ["A", "B", "C"]}
    assert "Seven children" in lsat["messages"][-1]["content"]
    assert "A. Juan\nB. Paul\nC. Fred" in lsat["messages"][-1]["content"]
    zebra = load_source("zebralogic", d)[0]
    assert zebra["verifier"]["attributes"] == {"Name": ["Arnold", "Eric", "Peter"],
                                               "Pet Animal": ["bird", "cat", "dog"]}
    assert "Eric lives in house 3" in zebra["messages"][-1]["content"]
    assert zebra["metadata"]["source_id"] == "lgp-test-3x2-0"


def test_list_functions_holds_out_the_tail(data_dir):
    d, _ = data_dir
    records = load_source("list_functions", d)
    assert [r["metadata"]["function"] for r in records] == ["c001", "c002"]
    first = records[0]
    assert first["verifier"]["tests"] == [{"input": [4, 1], "output": [5, 2]},
                                          {"input": [7], "output": [8]}]
    assert "[5, 5] -> [6, 6]" in first["messages"][-1]["content"]
    solution = "def transform(lst):\n    return [x + 1 for x in lst]\n"
    assert score_python([(first, solution), (records[1], solution)]) == [1.0, 0.0]


def test_single_file_form_and_copa_zero_based_labels(tmp_path):
    rows = [{**row, "label": row["label"] - 1} for row in COPA]  # SuperGLUE style: 0 = choice1
    _jsonl(tmp_path / "balanced_copa.jsonl", rows)
    assert [r["answer"] for r in load_source("balanced_copa", tmp_path)] == ["A", "B"]


def test_missing_dataset_says_where_to_put_it(tmp_path):
    with pytest.raises(DatasetMissingError) as err:
        load_source("balanced_copa", tmp_path)
    message = str(err.value)
    assert f"'{tmp_path}/balanced_copa/'" in message and "premise, choice1, choice2" in message
    assert "pkavumba/balanced-copa" in message and "data.from_hub=true" in message
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(DatasetMissingError, match="not on the Hugging Face hub"):
        load_source("neulr_abductive", tmp_path, from_hub=True)
    with pytest.raises(UnknownSourceError, match="unknown dataset 'copa'; loadable datasets: "):
        load_source("copa", tmp_path)


def test_malformed_rows_name_file_and_row(tmp_path):
    path = tmp_path / "art" / "dev.jsonl"
    good = {"observation_1": "a", "observation_2": "b", "hypothesis_1": "c",
            "hypothesis_2": "d", "label": 1}
    _jsonl(path, [good, {k: v for k, v in good.items() if k != "hypothesis_2"}])
    with pytest.raises(RecordError, match=re.escape(
            f"file '{path}' row 2: missing field 'hypothesis_2'")):
        load_source("art", tmp_path)
    _jsonl(path, [good, {**good, "label": 0}])
    with pytest.raises(RecordError, match="row 2: label 0 is not 1 or 2"):
        load_source("art", tmp_path)
    path.write_text('{"observation_1": \n')
    with pytest.raises(RecordError, match=re.escape(f"file '{path}' cannot be read as json")):
        load_source("art", tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("jaxrl.rewards.correctness") is None,
                    reason="jaxrl.rewards.correctness is not there yet")
def test_the_real_correctness_reward_accepts_every_loaded_gold(data_dir):
    from jaxrl.rewards.base import sample_from_record
    from jaxrl.rewards.correctness import Correctness

    d, _ = data_dir
    records = [r for name in sorted(SOURCES) for r in load_source(name, d)
               if r["verifier"]["kind"] != "python"]
    reward = Correctness()
    for answer, expected in ((lambda r: r["answer"], 1.0), (perturb, 0.0)):
        samples = [sample_from_record(r, f"<think>x</think><answer>{answer(r)}</answer>")
                   for r in records]
        assert [res.value for res in reward.score(samples)] == [expected] * len(records)
