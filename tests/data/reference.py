"""Minimal reference checks of each verifier kind, independent of jaxrl.rewards: what a gold
answer must pass and a perturbed one fail. Python answers run in one subprocess per batch."""
from __future__ import annotations

import json
import re
import subprocess
import sys

_RUNNER = r"""
import json, sys
results = []
for source, entry_point, tests in json.load(sys.stdin):
    namespace = {}
    try:
        exec(source, namespace)
        fn = namespace[entry_point]
        ok = all(json.loads(json.dumps(fn(case["input"]))) == case["output"] for case in tests)
    except Exception:
        ok = False
    results.append(ok)
print(json.dumps(results))
"""


def normalize(text: str) -> str:
    text = re.sub(r"\s+", " ", text.strip().lower())
    return text.strip("\"'").rstrip(".").strip()


def _items(text: str) -> set[str]:
    return {t for t in re.split(r"[,\s]+", text.strip().lower()) if t}


def score(record: dict, answer: str) -> float:
    """1.0 if `answer` (the <answer> span) is right for record, else 0.0 (not python)."""
    verifier, gold = record["verifier"], record["answer"]
    kind = verifier["kind"]
    if kind in ("exact", "label", "mcq"):
        ok = normalize(answer) == normalize(gold)
        if kind == "label":
            ok = ok and normalize(answer) in {normalize(x) for x in verifier["labels"]}
    elif kind == "set":
        ok = _items(answer) == _items(gold)
    elif kind == "zebra":  # the grid as JSON {"House 1": {attribute: value}, ...}
        try:
            ok = json.loads(answer) == json.loads(gold)
        except ValueError:
            return 0.0
    elif kind == "numeric":
        try:
            value, target = float(answer), float(gold)
        except ValueError:
            return 0.0
        ok = abs(value - target) <= verifier.get("tolerance", 1e-6) * max(1.0, abs(target))
    else:
        raise ValueError(f"no reference check for verifier kind {kind!r}")
    return float(ok)


def score_python(pairs: list[tuple[dict, str]], timeout: float = 60.0) -> list[float]:
    """Scores of (record, source) pairs: the source's entry point must pass every test."""
    payload = [(source, r["verifier"]["entry_point"], r["verifier"]["tests"])
               for r, source in pairs]
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=timeout, check=True)
    return [float(ok) for ok in json.loads(proc.stdout)]


def perturb(record: dict) -> str:
    """A wrong answer of the right form."""
    verifier, gold = record["verifier"], record["answer"]
    kind = verifier["kind"]
    if kind == "numeric":
        return str(int(gold) + 1)
    if kind == "exact":
        if " is not " in gold:
            return gold.replace(" is not ", " is ", 1)
        return gold.replace(" is ", " is not ", 1) if " is " in gold else f"not {gold}"
    if kind == "python":
        return (gold + "\n_gold = " + verifier["entry_point"] + "\n"
                f"def {verifier['entry_point']}(x):\n    return [_gold(x)]\n")
    if kind == "set":
        return gold + ", 99"
    if kind == "zebra":  # houses 1 and 2 swap their first attribute's values
        grid = json.loads(gold)
        attr = next(iter(grid["House 1"]))
        grid["House 1"][attr], grid["House 2"][attr] = grid["House 2"][attr], grid["House 1"][attr]
        return json.dumps(grid)
    options = verifier["labels"] if kind == "label" else verifier["choices"]
    return next(o for o in options if normalize(o) != normalize(gold))
