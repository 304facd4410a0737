"""Filtration scores: equal to transformers on the same model, and they prefer a rationale that
states what the next sentence says over an unrelated one on the default model."""
import numpy as np
import pytest
import torch

from jaxrl.hf.pretrained import load_pretrained
from jaxrl.rationale.filter import FilterSettings, filter_records
from jaxrl.rationale.scoring import ScoreOptions

RECORDS = [
    {"preceding": "Natalia sold 48 clips in April.", "rationale": "Next, halve it for May.",
     "following": " In May she sold half as many clips, 24 in all.", "source": "gsm8k"},
    {"preceding": "The bridge was closed on Monday. Commuters left home early.",
     "rationale": "The ferry is the other way across the river.",
     "following": " By Wednesday the ferry company had added two extra crossings each morning,"
                  " and the queues at the pier grew shorter.", "source": "pile"},
    {"preceding": "x", "rationale": "y", "following": " z", "source": "pile"},
    {"preceding": "", "rationale": "y", "following": " z"},
]


def _torch_score(model, tok, record, with_rationale, decay=0.9, cap=128):
    pre = tok(record["preceding"])["input_ids"]
    mid = tok(" " + record["rationale"], add_special_tokens=False)["input_ids"] \
        if with_rationale else []
    fol = tok(record["following"], add_special_tokens=False)["input_ids"][:cap]
    ids = torch.tensor([pre + mid + fol])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    start = len(pre) + len(mid)
    return sum(decay ** i * float(logp[start + i - 1, t]) for i, t in enumerate(fol))


def test_scores_equal_transformers_and_thresholds_apply_per_source(tiny_chat):
    from transformers import AutoTokenizer

    path, torch_model = tiny_chat
    tok = AutoTokenizer.from_pretrained(path)
    model = load_pretrained(path)
    # a small batch budget: several buckets and batch sizes, padded last batches
    settings = FilterSettings(tau=-1e9, tau_by_source={"gsm8k": 1e9},
                              score=ScoreOptions(tokens_per_batch=64))
    out = filter_records(model, RECORDS, settings)
    for record, row in zip(RECORDS[:3], out[:3]):
        want_with = _torch_score(torch_model, tok, record, True)
        want_without = _torch_score(torch_model, tok, record, False)
        np.testing.assert_allclose(row["score_with"], want_with, atol=1e-4, rtol=0)
        np.testing.assert_allclose(row["score_without"], want_without, atol=1e-4, rtol=0)
        assert row["gain"] == pytest.approx(row["score_with"] - row["score_without"])
    assert [row["kept"] for row in out] == [False, True, True, False]
    assert "preceding" in out[3]["error"] and out[3]["score_with"] is None


def test_a_rationale_that_states_the_next_sentence_gains_more(default_model_dir):
    model = load_pretrained(default_model_dir)
    context = "Tom had 35 marbles after the game. Then his sister gave him 12 of hers."
    records = [{"preceding": context, "following": " Now he had 47 marbles in his bag.",
                "rationale": r} for r in ("Adding the 12 marbles to his 35 gives him 47 marbles.",
                                          "The weather in Paris is usually mild in spring.")]
    related, unrelated = filter_records(model, records)
    # measured: +2.21 against -0.63
    assert related["gain"] > 1.0 and unrelated["gain"] < 0, (related["gain"], unrelated["gain"])


def test_filter_and_sft_data_cli(tiny_chat, tmp_path, capsys):
    import json

    from jaxrl.cli import main
    from jaxrl.sft.data import read_chat_records

    path, _ = tiny_chat
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out, chats = tmp_path / "scored.jsonl", tmp_path / "chats.jsonl"
    assert main(["rationale", "filter", "--model", str(path), "--input",
                 str(tmp_path / "in.jsonl"), "--out", str(out), "--tau=-1e9",
                 "--tau-for", "gsm8k=1e9"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["kept"] for r in rows] == [False, True, True, False]
    assert "4 records, 2 kept, 1 unscorable" in capsys.readouterr().err
    assert main(["rationale", "sft-data", "--input", str(out), "--out", str(chats)]) == 0
    conversations = read_chat_records(str(chats), "data.train_file")
    assert [m["content"] for m in conversations[0][1:]] == [RECORDS[1]["preceding"],
                                                            RECORDS[1]["rationale"]]
    assert main(["rationale", "filter", "--model", str(path), "--input",
                 str(tmp_path / "in.jsonl"), "--out", str(out), "--tau-for", "gsm8k"]) == 2
    assert "--tau-for takes SOURCE=NUMBER" in capsys.readouterr().err
