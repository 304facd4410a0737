"""lm-evaluation-harness against `jaxrl serve`: a multiple-choice log-likelihood task of its
own (a task YAML over a local JSONL file, nothing downloaded) run with lm_eval's
`local-completions` model, which asks /v1/completions for echo + logprobs; every choice's
log-likelihood equals jaxrl's own teacher-forced log-probs of the continuation."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.logprobs import token_logprobs
from jaxrl.serve import start_server
from tests.serve.helpers import SERVE

ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "gold": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "twenty-two"], "gold": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue"], "gold": 1},
    {"question": "Cats like to chase", "choices": ["mice", "cars", "clouds", "taxes"],
     "gold": 0},
]

TASK = """\
task: jaxrl_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
"""


def _loglikelihood(model, context: str, continuation: str) -> float:
    """log p(continuation | context) by a teacher-forced forward, tokenized as lm_eval does
    (the whole text's tokens after the context's)."""
    whole, ctx = model.ids(context + continuation), model.ids(context)
    tokens = jnp.asarray([whole], jnp.int32)
    logp, _ = token_logprobs(model.params, model.spec, tokens, jnp.arange(len(whole))[None],
                             start=len(ctx))
    return float(np.sum(logp))


@pytest.mark.slow
def test_lm_eval_loglikelihoods_equal_teacher_forced_logprobs(tiny_chat, tiny_chat_model,
                                                              tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "jaxrl_tiny_mc.yaml").write_text(TASK.format(data=data))
    with start_server(tiny_chat_model, port=0, **SERVE) as handle:
        args = (f"model={handle.model_id},base_url={handle.url}/completions,"
                f"tokenizer={tiny_chat[0]},tokenizer_backend=huggingface,"
                f"tokenized_requests=True,max_length={SERVE['max_model_len']},max_retries=1")
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=args, tasks=["jaxrl_tiny_mc"],
            task_manager=TaskManager(include_path=str(tmp_path / "tasks")), log_samples=True)
    samples = sorted(results["samples"]["jaxrl_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    for sample, item in zip(samples, ITEMS):
        got = [resp[0][0] for resp in sample["resps"]]  # (log-likelihood, is_greedy) per choice
        want = [_loglikelihood(tiny_chat_model, item["question"], " " + choice)
                for choice in item["choices"]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert 0 <= results["results"]["jaxrl_tiny_mc"]["acc,none"] <= 1
