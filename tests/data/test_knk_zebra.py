"""Knights and Knaves and Zebra: exactly one solution (brute force, independent of Z3), gold
answers score 1, gold formal clues pass Spring's gate, same seed same puzzles; the AR-LSAT and
ZebraLogicBench loaders."""
import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.data.generators import knk, zebra
from jaxrl.data.records import RecordError, make_record, validate_record
from jaxrl.data.spring_loaders import load_ar_lsat, load_zebralogic
from jaxrl.rewards.base import Sample
from jaxrl.rewards.correctness import Correctness
from jaxrl.rewards.spring import Spring


def generate(task, n, seed, difficulty):
    """Records as the generator registry makes them (seeded the same way) once knk and zebra
    are registered there."""
    make = {"knk": knk.make, "zebra": zebra.make}[task]
    rng = random.Random(f"{task}:{seed}:{difficulty}")
    problems = [make(rng, difficulty) for _ in range(n)]
    return [make_record(task, i, p.fields["messages"], p.answer, p.verifier,
                        {**p.metadata, "seed": seed, "difficulty": difficulty})
            for i, p in enumerate(problems)]


def _knk_solutions(puzzle):
    found = []
    for bits in itertools.product((True, False), repeat=len(puzzle.people)):
        knights = dict(zip(puzzle.people, bits))
        if all(knk.evaluate(s, knights) == knights[p] for p, s in puzzle.statements.items()):
            found.append(knights)
    return found


def _zebra_solutions(puzzle, stop_after=2):
    attrs = list(puzzle.attributes)
    found = []
    for perms in itertools.product(*(itertools.permutations(puzzle.attributes[a])
                                     for a in attrs)):
        where = {(a, v): h for a, perm in zip(attrs, perms) for h, v in enumerate(perm, 1)}
        if all(clue.holds(where) for clue in puzzle.clues):
            found.append({a: list(p) for a, p in zip(attrs, perms)})
            if len(found) == stop_after:
                break
    return found


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(2, 8), depth=st.integers(1, 2))
def test_knk_puzzles_have_exactly_one_solution(seed, n, depth):
    puzzle = knk.make_puzzle(random.Random(seed), n, depth)
    assert _knk_solutions(puzzle) == [puzzle.knights]


SMALL = [(h, m) for h in (2, 3, 4) for m in (2, 3, 4) if math.factorial(h) ** m <= 13_824]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.sampled_from(SMALL))
def test_zebra_puzzles_have_exactly_one_solution(seed, size):
    puzzle = zebra.make_puzzle(random.Random(seed), *size)
    assert _zebra_solutions(puzzle) == [puzzle.solution]
    for index in range(len(puzzle.clues)):  # minimal: every clue is needed
        fewer = zebra.ZebraPuzzle(puzzle.attributes, puzzle.solution,
                                  puzzle.clues[:index] + puzzle.clues[index + 1:])
        assert len(_zebra_solutions(fewer)) == 2


def _gold_completion(record):
    premises = "\n".join(f"(assert {c})" for c in record["metadata"]["clues_formal"])
    return f"<think>{premises}</think><answer>{record['answer']}</answer>"


@pytest.mark.parametrize("task", ("knk", "zebra"))
@pytest.mark.parametrize("difficulty", (1, 2, 3))
def test_gold_answers_and_gold_clues_score_full_marks(task, difficulty):
    records = generate(task, 6, seed=difficulty, difficulty=difficulty)
    correctness, spring = Correctness(), Spring()
    for record in records:
        validate_record(record)
        assert correctness.score_one(Sample("", f"<answer>{record['answer']}</answer>",
                                            record)).value == 1.0
        result = spring.score_one(Sample("", _gold_completion(record), record))
        assert result.info["base"] == "unique"
        assert result.components["accuracy"] == result.components["parsed"] == 1.0
        user = record["messages"][-1]["content"]
        assert "(assert FORMULA)" in user and "(step K FORMULA)" in user and "<answer>" in user


def test_wrong_answers_score_partial_accuracy():
    puzzle = generate("knk", 1, seed=5, difficulty=2)[0]
    first = puzzle["verifier"]["people"][0]
    role = "knight" if f"{first} is a knave" in puzzle["answer"] else "knave"
    flipped = f"{first} is a {role}, " + puzzle["answer"].split(", ", 1)[1]
    result = Correctness().score_one(Sample("", f"<answer>{flipped}</answer>", puzzle))
    people = len(puzzle["verifier"]["people"])
    assert result.value == 0.0 and result.components["person_accuracy"] == (people - 1) / people
    grid = generate("zebra", 1, seed=5, difficulty=1)[0]
    answer = json.loads(grid["answer"])
    answer["House 1"]["Name"], answer["House 2"]["Name"] = (answer["House 2"]["Name"],
                                                            answer["House 1"]["Name"])
    result = Correctness().score_one(Sample("", f"<answer>{json.dumps(answer)}</answer>", grid))
    cells = len(answer) * len(answer["House 1"])
    assert result.value == 0.0 and result.components["cell_accuracy"] == (cells - 2) / cells


@pytest.mark.parametrize("task", ("knk", "zebra"))
def test_same_seed_same_puzzles(task):
    first = generate(task, 8, seed=11, difficulty=2)
    assert first == generate(task, 8, seed=11, difficulty=2)
    assert first[:3] == generate(task, 3, seed=11, difficulty=2)
    assert [r["answer"] for r in first] != [r["answer"] for r in generate(task, 8, seed=12,
                                                                           difficulty=2)]


def test_zebra_difficulty_is_log10_of_the_search_space():
    for level, ((h0, h1), (m0, m1)) in zebra.LEVELS.items():
        for record in generate("zebra", 5, seed=0, difficulty=level):
            n, m = record["metadata"]["houses"], record["metadata"]["attributes"]
            assert h0 <= n <= h1 and m0 <= m <= m1
            assert record["metadata"]["log10_space"] == round(m * math.log10(math.factorial(n)),
                                                              3)


def test_zebra_prompt_lists_values_sorted_not_by_house():
    record = generate("zebra", 1, seed=3, difficulty=3)[0]
    for attr, values in record["verifier"]["attributes"].items():
        assert values == sorted(values) and f" - {attr}: {', '.join(values)}" in \
            record["messages"][-1]["content"]


LSAT = [{"id": "p1", "passage": "Seven children get five lockers.", "questions": [
    {"id": "q1", "question": "Which must be true?", "options": ["A) Juan", "B) Paul", "C) Fred"],
     "answer": "B", "tags": ["ordering"]},
    {"id": "q2", "question": "Which could be true?", "options": ["Nita", "Rachel"],
     "answer": "a"}]}]


def test_ar_lsat_loader(tmp_path):
    path = tmp_path / "AR_TestData.json"
    path.write_text(json.dumps(LSAT), encoding="utf-8")
    records = load_ar_lsat(path)
    assert [r["answer"] for r in records] == ["B", "A"]
    assert records[0]["verifier"] == {"kind": "mcq", "choices": ["A", "B", "C"]}
    assert "A. Juan\nB. Paul\nC. Fred" in records[0]["messages"][-1]["content"]
    assert Correctness().score_one(Sample("", "<answer>(B)</answer>", records[0])).value == 1.0
    with pytest.raises(FileNotFoundError, match="zhongwanjun/AR-LSAT"):
        load_ar_lsat(tmp_path / "missing.json")
    path.write_text(json.dumps([{"passage": "x", "questions": [{"question": "q", "options":
                                                               ["a"], "answer": "E"}]}]))
    with pytest.raises(RecordError, match="passage 1.*'E' is not one of A"):
        load_ar_lsat(path)


ZEBRA_ROW = {"id": "lgp-test-3x2-0", "size": "3*2",
             "puzzle": "There are 3 houses ... 1. Eric lives in house 3. 2. Arnold has a dog. "
                       "3. The person with the bird lives directly left of Arnold. "
                       "4. Peter does not have the cat.",
             "solution": {"header": ["House", "Name", "Pet Animal"],
                          "rows": [["2", "Arnold", "dog"], ["1", "Peter", "bird"],
                                   ["3", "Eric", "cat"]]}}


@pytest.mark.parametrize("suffix", (".json", ".jsonl", ".parquet"))
def test_zebralogic_loader(tmp_path, suffix):
    path = tmp_path / f"grid_mode{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([ZEBRA_ROW]), path)
    else:
        path.write_text(json.dumps([ZEBRA_ROW]) if suffix == ".json" else
                        json.dumps(ZEBRA_ROW) + "\n", encoding="utf-8")
    [record] = load_zebralogic(path)
    assert json.loads(record["answer"])["House 1"] == {"Name": "Peter", "Pet Animal": "bird"}
    assert record["verifier"]["attributes"]["Pet Animal"] == ["bird", "cat", "dog"]
    premises = ("(assert (= Eric 3)) (assert (= Arnold dog)) (assert (= (+ bird 1) Arnold)) "
                "(assert (distinct Peter cat))")
    completion = f"<think>{premises}</think><answer>{record['answer']}</answer>"
    result = Spring().score_one(Sample("", completion, record))
    assert result.info["base"] == "unique" and result.components["accuracy"] == 1.0
    assert "PetAnimal" in record["messages"][-1]["content"]


def test_zebralogic_without_solutions_is_a_clear_error(tmp_path):
    path = tmp_path / "public.jsonl"
    path.write_text(json.dumps({**ZEBRA_ROW, "solution": None}) + "\n", encoding="utf-8")
    with pytest.raises(RecordError, match="row 1: no 'solution'.*ZebraLogicBench-private"):
        load_zebralogic(path)
    with pytest.raises(FileNotFoundError, match="zebralogic file .* does not exist"):
        load_zebralogic(tmp_path / "absent.parquet")


def test_knk_brief_words_the_same_puzzles_and_splits_them_alike():
    from jaxrl.data.generators import generate as registered
    from jaxrl.data.pipeline import split_records

    full, brief = registered("knk", 40, seed=3), registered("knk-brief", 40, seed=3)
    assert [r["answer"] for r in brief] == [r["answer"] for r in full]
    assert [r["metadata"] for r in brief] == [r["metadata"] for r in full]
    assert all(r["task"] == "knk-brief" and r["verifier"]["kind"] == "knk" for r in brief)
    for short, long in zip(brief, full):
        puzzle = long["messages"][-1]["content"].split("\n\n")[0]
        text = short["messages"][-1]["content"]
        assert text.startswith(puzzle + "\n\n") and len(text) < 0.5 * len(long["messages"][-1]
                                                                          ["content"])
        assert "(assert (= (knight X) S))" in text and "(step K FORMULA)" in text
        assert f"<answer>{short['verifier']['people'][0]} is a knight" in text
    held_out = [[r["answer"] for r in split_records(records, 0.25, 42, name)[1]]
                for records, name in ((full, "knk"), (brief, "knk-brief"))]
    assert held_out[0] == held_out[1] and len(held_out[0]) == 10
    gold = f"<think>{chr(10).join(f'(assert {c})' for c in brief[0]['metadata']['clues_formal'])}"
    result = Spring().score_one(Sample("", f"{gold}</think><answer>{brief[0]['answer']}</answer>",
                                       brief[0]))
    assert result.components["accuracy"] == result.components["parsed"] == 1.0
