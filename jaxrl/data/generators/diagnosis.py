"""Diagnosis records: the offline incident cases of jaxrl/envs/diagnosis.py as task records, for
the diagnosis environment. The prompt shows the system's layout and the alerts; the case itself
(tool outputs and the gold root cause) rides in metadata["case"], and the answer is the gold
fine-grained cause. Difficulty does not change the cases. Scored by the `episode` reward (the
`diagnosis` verifier kind names that no single-turn verifier reads these records)."""
from __future__ import annotations

import random

from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem, register_verifier_kind
from jaxrl.envs.diagnosis import generate_case, task_text

register_verifier_kind("diagnosis", {})


@register("diagnosis", "incident cases with evidence on request (the diagnosis environment)",
          "diagnosis")
def make(rng: random.Random, difficulty: int) -> Problem:
    case = generate_case(seed=rng.randrange(2 ** 31), index=0)
    return Problem(fields={"messages": [{"role": "user", "content": task_text(case)}]},
                   answer=case.gold.fine, verifier={"kind": "diagnosis"},
                   metadata={"case": case.to_json()})
