"""The offline diagnosis cases: determinism, on-request evidence, gold labels, case files."""
import json
import re

import pytest

from jaxrl.envs.base import CaseError, load_cases
from jaxrl.envs.diagnosis import catalog, generate_case, generate_cases


def test_generation_is_deterministic_by_seed():
    assert generate_cases(3, seed=5) == generate_cases(3, seed=5)
    assert generate_cases(3, seed=5) != generate_cases(3, seed=6)


def test_ten_consecutive_cases_cover_ten_faults():
    faults = {c.gold.fine for c in generate_cases(10, seed=1)}
    assert len(faults) == 10 and faults <= {f["fine"] for f in catalog()["faults"]}


def _healthy(tool: str, text: str) -> bool:
    """Whether text fits the healthy template of tool (placeholders match anything) with no
    percentage above the healthy ranges (metrics show a fault by their values only)."""
    parts = re.split(r"\{\w+\}", catalog()["healthy"][tool]["text"])
    fits = re.fullmatch(".*?".join(map(re.escape, parts)), text, flags=re.DOTALL) is not None
    return fits and max(map(int, re.findall(r"(\d+)%", text)), default=0) <= 70


@pytest.mark.parametrize("index", range(len(catalog()["faults"])))
def test_every_fault_reveals_its_evidence_only_on_request(index):
    fault = catalog()["faults"][index]
    case = generate_case(seed=3, index=index, fault_index=index)
    assert case.gold.fine == fault["fine"] and case.gold.coarse == fault["coarse"]
    assert case.gold.component in case.targets and set(case.gold.components) <= set(case.targets)
    for key in fault["evidence"]:
        tool = key.split("@")[0]
        unhealthy = [t for t, text in case.outputs[tool].items() if not _healthy(tool, text)]
        assert len(unhealthy) == 1, (key, unhealthy)
    assert fault["fine"] not in " ".join(case.signals).lower()


def test_requests_name_unknown_tools_and_unsuitable_targets():
    case = generate_case(seed=0, index=0)
    host = next(t for t, kind in case.targets.items() if kind == "host")
    with pytest.raises(CaseError, match="unknown tool 'strace'; tools: cgroup"):
        case.request("strace", host)
    assert "no such target" in case.request("dmesg", "node-00")
    service = next(t for t, kind in case.targets.items() if kind == "service")
    assert "not applicable to a service" in case.request("dmesg", service)
    assert case.request("dmesg", host) == case.outputs["dmesg"][host]


def test_cases_round_trip_through_json_and_jsonl(tmp_path):
    cases = generate_cases(2, seed=0)
    (tmp_path / "one.json").write_text(json.dumps(cases[0].to_json()))
    (tmp_path / "many.jsonl").write_text("".join(json.dumps(c.to_json()) + "\n" for c in cases))
    assert load_cases(tmp_path / "one.json") == cases[:1]
    assert load_cases(tmp_path / "many.jsonl") == cases
    broken = cases[0].to_json()
    del broken["gold"]
    (tmp_path / "bad.json").write_text(json.dumps(broken))
    with pytest.raises(CaseError, match=r"lacks \['gold'\]"):
        load_cases(tmp_path / "bad.json")
