"""The judge against a real local HTTP server speaking the chat-completions protocol."""
import json
import logging
import time

import pytest

from jaxrl.config import Config, RewardEntry, apply_overrides, dump_yaml
from jaxrl.rewards.base import RewardConfigError, Sample
from jaxrl.rewards.cedar import CoverageJudge
from jaxrl.rewards.judge import CACHE_FILE, Judge, retry_after_s
from jaxrl.rewards.pool import RewardPool
from tests.rewards.openai_stub import StubServer

JUDGES = [RewardEntry("cedar_coverage"), RewardEntry("cedar_directionality")]
FAKE_KEY = "sk-jaxrl-FAKE-7f3a9c1e5d"


def _cfg(server, tmp_path, *extra):
    return apply_overrides(Config(), [
        f"judge.base_url={server.base_url}", "judge.model=stub-judge", "judge.timeout_s=0.5",
        "judge.max_retries=1", "judge.backoff_s=0.05", "judge.max_backoff_s=2",
        f"run.output_dir={tmp_path}", *extra])


def _sample(scenario, salt=""):
    completion = (f"<think>The lawn is wet but the street is dry {salt}. SCENARIO={scenario}"
                  "</think><answer>the sprinkler</answer>")
    return Sample("Observations: the lawn is wet; the street is dry. Why?", completion,
                  {"id": scenario, "task": "abduction"})


def test_each_server_behaviour_scores_and_counts_within_bounded_time(tmp_path):
    scenarios = ["good", "http500", "http429", "slow", "malformed", "wrongshape", "badbody"]
    with StubServer(slow_s=1.5) as server, RewardPool(_cfg(server, tmp_path), JUDGES) as pool:
        start = time.monotonic()
        batch = pool.score([_sample(s) for s in scenarios])
        elapsed = time.monotonic() - start
    coverage = dict(zip(scenarios, batch.results["cedar_coverage"]))
    direction = dict(zip(scenarios, batch.results["cedar_directionality"]))
    assert coverage["good"].value == pytest.approx(2 / 3) and direction["good"].value == 1.0
    assert coverage["good"].components == {"cedar_coverage": pytest.approx(2 / 3),
                                           "details": 3, "addressed": 2}
    assert coverage["http429"].value == pytest.approx(2 / 3), coverage["http429"]
    assert direction["http429"].value == 1.0
    assert coverage["http429"].info["attempts"] == 2 and server.count("http429") == 4
    expected = {"http500": "judge_http_error", "slow": "judge_timeout",
                "malformed": "judge_invalid_reply", "wrongshape": "judge_invalid_reply",
                "badbody": "judge_bad_response"}
    for scenario, kind in expected.items():
        for result in (coverage[scenario], direction[scenario]):
            assert result.value == 0.0 and result.info["failure"] == kind, (scenario, result)
    assert server.count("http500") == 4 and server.count("slow") == 4  # 1 retry each
    metrics = batch.metrics
    assert metrics["rewards/failures/judge_http_error"] == 2
    assert metrics["rewards/failures/judge_timeout"] == 2
    assert metrics["rewards/failures/judge_invalid_reply"] == 4
    assert metrics["rewards/failures/judge_bad_response"] == 2
    assert metrics["rewards/failures"] == 10 and "rewards/failures/judge_rate_limited" not in metrics
    assert 1.0 <= elapsed < 6.0  # Retry-After: 1 was honoured; every failure ended in time


def test_retry_after_is_honoured(tmp_path):
    with StubServer() as server:
        reward = CoverageJudge(_cfg(server, tmp_path, "judge.max_retries=2", "judge.cache=false"))
        [scored] = reward.score([_sample("http429")])
    assert scored.value == pytest.approx(2 / 3) and scored.info == {"cached": False, "attempts": 2}
    first, second = server.requests
    assert second.time - first.time >= 0.95  # Retry-After: 1, not the 0.05 s backoff


def test_retry_after_header_forms():
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert 9 < retry_after_s({"retry-after": time.strftime(
        "%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 10))}) <= 10
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({}) is None and retry_after_s(None) is None


def test_a_repeated_request_is_served_from_the_sqlite_cache(tmp_path):
    with StubServer() as server:
        with RewardPool(_cfg(server, tmp_path), JUDGES[:1]) as pool:
            first = pool.score([_sample("good"), _sample("good")])  # the same request twice
            again = pool.score([_sample("good")])
        assert len(server.requests) == 1  # identical requests in flight share one call
        with RewardPool(_cfg(server, tmp_path), JUDGES[:1]) as pool:  # a resumed run
            resumed = pool.score([_sample("good")])
        assert len(server.requests) == 1
        with RewardPool(_cfg(server, tmp_path, "judge.model=other"), JUDGES[:1]) as pool:
            pool.score([_sample("good")])
        assert len(server.requests) == 2  # keyed by model
    assert [r.value for r in first.results["cedar_coverage"]] == [pytest.approx(2 / 3)] * 2
    assert again.results["cedar_coverage"][0].info == {"cached": True, "attempts": 0}
    assert resumed.results["cedar_coverage"][0].info["cached"] is True
    assert (tmp_path / CACHE_FILE).is_file()


def test_judge_response_format_is_sent_and_keys_the_cache(tmp_path):
    with StubServer() as server:
        with RewardPool(_cfg(server, tmp_path), JUDGES[:1]) as pool:
            pool.score([_sample("good")])
        with RewardPool(_cfg(server, tmp_path, "judge.response_format=json_object"),
                        JUDGES[:1]) as pool:
            [scored] = pool.score([_sample("good")]).results["cedar_coverage"]
        assert len(server.requests) == 2  # not the cached reply to the request without it
    assert "response_format" not in server.requests[0].body
    assert server.requests[1].body["response_format"] == {"type": "json_object"}
    assert scored.value == pytest.approx(2 / 3)


def test_the_api_key_reaches_the_server_and_nothing_else(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXRL_TEST_JUDGE_KEY", FAKE_KEY)
    caplog.set_level(logging.DEBUG)
    with StubServer() as server:
        cfg = _cfg(server, tmp_path, "judge.api_key_env=JAXRL_TEST_JUDGE_KEY")
        with RewardPool(cfg, JUDGES) as pool:
            batch = pool.score([_sample(s) for s in ("good", "http500", "echo_key")])
    assert {r.headers["authorization"] for r in server.requests} == {f"Bearer {FAKE_KEY}"}
    echoed = batch.results["cedar_coverage"][2]
    assert echoed.info["failure"] == "judge_http_error" and "[redacted]" in echoed.info["detail"]
    dump_yaml(cfg, tmp_path / "config.yaml")
    places = {"results": json.dumps({k: [r.__dict__ for r in v] for k, v in batch.results.items()},
                                    default=str),
              "logs": caplog.text, "config": (tmp_path / "config.yaml").read_text()}
    places.update({p.name: p.read_bytes().decode("latin-1") for p in tmp_path.iterdir()
                   if p.name.startswith(CACHE_FILE)})
    assert CACHE_FILE in places and caplog.text
    for name, text in places.items():
        assert FAKE_KEY not in text, f"the API key leaked into {name}"


def test_a_judge_needs_a_server_and_a_model(tmp_path):
    with pytest.raises(RewardConfigError, match="judge.base_url.*judge.model"):
        Judge(Config().judge, tmp_path)
