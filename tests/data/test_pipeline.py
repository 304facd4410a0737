"""Pipeline: pools (counts, disjoint splits, sampling), the grain mixture (proportions), and the
iterator state (JSON, restored exactly in a new process, refused for another pool)."""
import collections
import json
import re
import subprocess
import sys

import pytest

from jaxrl.config import ConfigError, DataConfig, apply_overrides, load_config
from jaxrl.data.loaders import sample_records
from jaxrl.data.pipeline import PromptIterator, build_pool, parse_tasks, train_iterator
from jaxrl.data.records import write_jsonl
from tests.data.test_loaders import _write_all

MIXTURE = ["data.tasks=[arithmetic:300, crypto:100, list_fn:100, abduction_rules:200]",
           "data.prompts_per_step=8", "data.seed=11"]


def _data(overrides) -> DataConfig:
    return apply_overrides(load_config(), overrides).data


def _prompt(record) -> str:
    return record["messages"][-1]["content"]


def test_pool_counts_and_disjoint_splits():
    pool = build_pool(_data(MIXTURE))
    assert {k: len(v) for k, v in pool.train.items()} == {
        "arithmetic": 240, "crypto": 80, "list_fn": 80, "abduction_rules": 160}
    assert collections.Counter(r["task"] for r in pool.validation) == {
        "arithmetic": 60, "crypto": 20, "list_fn": 20, "abduction_rules": 40}
    train = [r for records in pool.train.values() for r in records]
    assert {r["split"] for r in train} == {"train"}
    assert {r["split"] for r in pool.validation} == {"validation"}
    assert not {r["id"] for r in train} & {r["id"] for r in pool.validation}
    assert not {_prompt(r) for r in train} & {_prompt(r) for r in pool.validation}
    assert pool.weights == {"arithmetic": 300.0, "crypto": 100.0, "list_fn": 100.0,
                            "abduction_rules": 200.0}
    assert build_pool(_data(MIXTURE)) == pool


def test_mixture_proportions_over_10000_draws():
    cfg = _data(MIXTURE + ["data.weights=[5, 2, 2, 1]", "data.prompts_per_step=100"])
    iterator = train_iterator(build_pool(cfg), cfg)
    counts = collections.Counter(r["task"] for _ in range(100) for r in next(iterator))
    expected = {"arithmetic": 0.5, "crypto": 0.2, "list_fn": 0.2, "abduction_rules": 0.1}
    for task, share in expected.items():
        assert abs(counts[task] / 10_000 - share) < 0.01, (task, counts)


def test_batches_are_shuffled_and_cover_each_source():
    cfg = _data(MIXTURE)
    pool = build_pool(cfg)
    iterator = train_iterator(pool, cfg)
    seen = [r["id"] for _ in range(40) for r in next(iterator)]  # 320 of 560 train records
    assert len(set(seen)) > 300
    assert {s.split("-")[0] for s in seen} == set(pool.train)
    assert seen[:8] != sorted(seen[:8])


_RESTORE = """
import json, sys
from jaxrl.config import apply_overrides, load_config
from jaxrl.data.pipeline import build_pool, train_iterator
cfg = apply_overrides(load_config(), json.loads(sys.argv[1])).data
iterator = train_iterator(build_pool(cfg), cfg)
iterator.set_state(json.loads(sys.argv[2]))
print(json.dumps([[r["id"] for r in next(iterator)] for _ in range(int(sys.argv[3]))]))
"""


def test_state_restores_exactly_in_a_new_process():
    cfg = _data(MIXTURE)
    iterator = train_iterator(build_pool(cfg), cfg)
    for _ in range(7):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [[r["id"] for r in next(iterator)] for _ in range(5)]
    proc = subprocess.run([sys.executable, "-c", _RESTORE, json.dumps(MIXTURE),
                           json.dumps(state), "5"], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout) == expected
    iterator.set_state(state)
    assert [[r["id"] for r in next(iterator)] for _ in range(5)] == expected


def test_state_of_another_pool_is_refused():
    cfg = _data(MIXTURE)
    state = train_iterator(build_pool(cfg), cfg).get_state()
    other = _data(MIXTURE + ["data.seed=12"])
    with pytest.raises(ValueError, match="saved for a different pool or mixture"):
        train_iterator(build_pool(other), other).set_state(state)
    with pytest.raises(ValueError, match="must be a dict with version 1"):
        train_iterator(build_pool(cfg), cfg).set_state({"next_index": 3})


def test_batches_are_copies():
    sources = {"a": [{"id": "a-0", "task": "a", "metadata": {}}]}
    iterator = PromptIterator(sources, {"a": 1.0}, batch_size=2, seed=0)
    next(iterator)[0]["metadata"]["x"] = 1
    assert sources["a"][0]["metadata"] == {} and next(iterator)[0]["metadata"] == {}


@pytest.mark.parametrize("overrides, message", [
    (["data.tasks=[arith]"], "config key 'data.tasks' has unknown task 'arith'; generated: "
                             "abduction_rules, arithmetic, calculator, crypto, diagnosis, knk, "
                             "knk-brief, list_fn, zebra; loaded: "),
    (["data.tasks=[knk, zebralogic, zebra:5]", "data.weights=[1]"],
     "config key 'data.weights' has 1 entries but 'data.tasks' has 3 (knk, zebralogic, zebra)"),
    (["data.tasks=[crypto:0]"], "entry 'crypto:0' must be NAME or NAME:COUNT"),
    (["data.tasks=[crypto:x]"], "entry 'crypto:x' must be NAME or NAME:COUNT"),
    (["data.tasks=[crypto, crypto:3]"], "names a task twice: crypto, crypto"),
    (["data.tasks=[crypto, list_fn]", "data.weights=[1]"],
     "config key 'data.weights' has 1 entries but 'data.tasks' has 2 (crypto, list_fn)"),
])
def test_task_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_tasks(_data(overrides))


def test_config_bounds():
    with pytest.raises(ConfigError, match="'data.weights' entries must be > 0"):
        _data(["data.weights=[1, 0]"])
    with pytest.raises(ConfigError, match="'data.difficulty' must be one of 1, 2, 3"):
        _data(["data.difficulty=4"])
    with pytest.raises(ConfigError, match="'data.validation_fraction' must be >= 0 and < 1"):
        _data(["data.validation_fraction=1"])


def test_length_filter_drops_long_prompts_or_says_what_to_raise(tmp_path):
    cfg = _data(["data.tasks=[arithmetic:20]"])
    with pytest.raises(ConfigError, match="20 of 20 generated 'arithmetic' prompts are longer "
                                          "than data.max_prompt_tokens=256"):
        build_pool(cfg, keep=lambda record: False)
    records = build_pool(_data(["data.tasks=[arithmetic:10, crypto:10]"])).train
    write_jsonl(records["arithmetic"] + records["crypto"], tmp_path / "train.jsonl")
    short = build_pool(_data([f"data.train_file={tmp_path / 'train.jsonl'}"]),
                       keep=lambda record: record["task"] == "arithmetic")
    assert list(short.train) == ["arithmetic"]


def test_cedar_mixture_from_local_copies(tmp_path):
    """The CEDAR config: 400 per source (200 for list_functions and crypto), 80/20 per source,
    1,920 + 480, with loaded sources sampled evenly across their variants."""
    _write_cedar_copies(tmp_path)
    cfg = load_config("configs/cedar_mixture.yaml", [f"data.data_dir={tmp_path}"]).data
    assert (cfg.seed, cfg.validation_fraction) == (42, 0.2)
    pool = build_pool(cfg)
    sizes = {name: len(records) for name, records in pool.train.items()}
    assert sizes == {"uniadilr": 320, "balanced_copa": 320, "causelogics": 320,
                     "climate_fever": 320, "abductionrules": 320, "list_functions": 160,
                     "crypto": 160}
    assert sum(sizes.values()) == 1920 and len(pool.validation) == 480
    chosen = pool.train["abductionrules"] + [r for r in pool.validation
                                             if r["task"] == "abductionrules"]
    assert collections.Counter(r["metadata"]["group"] for r in chosen) == {"Animal": 200,
                                                                           "Person": 200}


def _write_cedar_copies(d):
    """Synthetic rows in each public format, enough of them for the CEDAR counts."""
    rows = {"uniadilr": [{"context": [f"s{i}", "t"], "hypothesis": f"h{i}", "answer": [1]}
                         for i in range(450)],
            "causelogics": [{"premises": [f"p{i}"], "rules": ["r"], "phenomenon": "x",
                             "cause": "c", "label": i % 2} for i in range(450)],
            "balanced_copa": [{"premise": f"p{i}", "choice1": "a", "choice2": "b",
                               "question": "cause", "label": 1 + i % 2} for i in range(450)],
            "climate_fever": [{"claim": f"c{i}", "claim_label": i % 4,
                               "evidences": [{"evidence": "e"}]} for i in range(450)]}
    for name, source_rows in rows.items():
        write = (d / name).mkdir() or (d / name / "train.jsonl")
        write.write_text("".join(json.dumps(r) + "\n" for r in source_rows))
    for variant, contexts in (("Animal", 150), ("Person", 60)):
        (d / "abductionrules" / variant).mkdir(parents=True)
        (d / "abductionrules" / variant / "train.jsonl").write_text("".join(
            json.dumps({"context": f"{variant} c{i}", "questions": [
                {"text": f"q{i}-{j}", "label": f"{variant} {i} is red."} for j in range(4)]})
            + "\n" for i in range(contexts)))
    for i in range(210):
        (d / "list_functions" / f"c{i:03d}").mkdir(parents=True)
        examples = [{"input": f"[{j}]", "target": f"[{j + i}]"} for j in range(8)]
        (d / "list_functions" / f"c{i:03d}" / "task.json").write_text(
            json.dumps({"examples": examples}))


def test_train_and_eval_files(tmp_path):
    small = build_pool(_data(["data.tasks=[arithmetic:10, crypto:5]"]))
    write_jsonl(small.train["arithmetic"] + small.train["crypto"], tmp_path / "train.jsonl")
    write_jsonl(small.validation, tmp_path / "eval.jsonl")
    cfg = _data([f"data.train_file={tmp_path / 'train.jsonl'}",
                 f"data.eval_file={tmp_path / 'eval.jsonl'}"])
    pool = build_pool(cfg)
    assert pool.train == small.train and pool.validation == small.validation
    assert pool.weights == {"arithmetic": 8.0, "crypto": 4.0}
    with pytest.raises(ConfigError, match="'data.weights' applies to 'data.tasks'"):
        build_pool(_data([f"data.train_file={tmp_path / 'train.jsonl'}", "data.weights=[1]",
                          "data.tasks=[arithmetic]"]))


def test_sample_records_is_seeded_and_even_across_groups():
    records = [{"id": str(i), "metadata": {"group": "ab"[i % 2]}} for i in range(10)] + \
              [{"id": f"c{i}", "metadata": {"group": "c"}} for i in range(2)]
    chosen = sample_records(records, 8, seed=1, name="t")
    assert chosen == sample_records(records, 8, seed=1, name="t")
    assert collections.Counter(r["metadata"]["group"] for r in chosen) == {"a": 3, "b": 3,
                                                                          "c": 2}
    with pytest.raises(ValueError, match="cannot sample 13 t records from 12"):
        sample_records(records, 13, seed=1, name="t")


def test_loaded_sources_in_a_mixture(tmp_path):
    _write_all(tmp_path)
    cfg = _data(["data.tasks=[balanced_copa:2, arithmetic:4]", f"data.data_dir={tmp_path}",
                 "data.validation_fraction=0.5"])
    pool = build_pool(cfg)
    assert len(pool.train["balanced_copa"]) == 1 and len(pool.train["arithmetic"]) == 2
    with pytest.raises(ConfigError, match="asks for 3 'balanced_copa' records but 2 are "
                                          "available"):
        build_pool(_data(["data.tasks=[balanced_copa:3]", f"data.data_dir={tmp_path}"]))
    row = {"question": "Is ice cold?", "answer": True}
    (tmp_path / "repeats").mkdir()
    (tmp_path / "repeats" / "strategyqa.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in (row, row, {**row, "question": "Is fire hot?"})))
    with pytest.raises(ConfigError, match="asks for 3 'strategyqa' records but 2 are available "
                                          r"\(distinct prompts"):
        build_pool(_data(["data.tasks=[strategyqa:3]", f"data.data_dir={tmp_path / 'repeats'}"]))


def test_data_config_defaults():
    cfg = DataConfig()
    assert cfg.tasks == ("arithmetic",) and cfg.samples_per_task == 1000 and cfg.weights == ()
    assert (cfg.validation_fraction, cfg.seed, cfg.difficulty) == (0.2, 42, 1)
    assert (cfg.data_dir, cfg.from_hub, cfg.train_file, cfg.eval_file) == ("data", False, "", "")
    assert parse_tasks(cfg)[0].count == 1000
