"""The training loop's timings: each phase is timed until its results are ready, and a step's
phases are parts of its wall time."""
import json
import time
import types

from jaxrl.config import from_dict
from jaxrl.rl.loop import _Phases, _reference, train
from tests.checkpoint import helpers

PHASES = ("time/rollout", "time/reference", "time/reward_wait", "time/update")


def test_reference_phase_waits_for_its_result():
    class Unfinished:
        """Stands for an array the device is still computing."""

        def block_until_ready(self):
            time.sleep(0.05)
            return self

    session = types.SimpleNamespace(cfg=from_dict({"grpo": {"beta": 0.04}}),
                                    reference_logprobs=lambda *args: Unfinished(),
                                    share=lambda rollout: 1)
    rollout = helpers.rollout(0)
    rollout.ref_logp = None
    phases = _Phases()
    _reference(session, phases)(rollout)
    assert isinstance(rollout.ref_logp, Unfinished)
    assert phases.lap()["time/reference"] >= 0.05  # a sleep only ever lasts longer


def test_phases_are_positive_and_add_up_to_the_step(tiny_chat, tmp_path):
    cfg = from_dict({
        "run": {"steps": 3, "output_dir": str(tmp_path / "run")},
        "model": {"path": str(tiny_chat[0]), "dtype": "float32"}, "quant": {"mode": "none"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "data": {"tasks": ["arithmetic:20"], "prompts_per_step": 2},
        "sampling": {"max_new_tokens": 8}, "grpo": {"num_generations": 2, "beta": 0.04},
        "rewards": {"workers": 1, "max_staleness": 1},
        "checkpoint": {"every": 0}, "logging": {"samples_every": 0}})
    run = train(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["time/update"] > 0 and row["time/reward_wait"] >= 0
        # the phases run one after another within the step, timed on one clock
        assert sum(row[k] for k in PHASES) <= row["time/step"] + 1e-6
    for row in rows[:-1]:  # each samples the next step's rollout and its reference pass
        assert row["time/rollout"] > 0 and row["time/reference"] > 0
    assert rows[-1]["time/rollout"] == rows[-1]["time/reference"] == 0  # nothing left to sample
    # what is left is host work (data, prompts, logging): a small part of the run (here 1-12 %
    # of a step); summed over the run, so that a stall in one step's host work cannot fail it
    timed = sum(row[k] for row in rows for k in PHASES)
    assert timed >= 0.5 * sum(row["time/step"] for row in rows)
