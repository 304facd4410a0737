"""SFT data: assistant-only masks from the chat template, and the length-bucketed batch order."""
import numpy as np
import pytest

from jaxrl.config import ConfigError
from jaxrl.hf.tokenizer import load_tokenizer
from jaxrl.sft.data import BatchStream, encode_all, encode_chat, pad_rows, read_chat_records

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>2 and 2 make 4.</think> 4"},
        {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]


def test_mask_covers_exactly_the_assistant_turns(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    ids, mask = encode_chat(tok, CHAT)
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(ids) == text
    spans, run = [], []
    for token, on in zip(list(ids) + [0], list(mask) + [False]):
        if on:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    assert spans == ["<think>2 and 2 make 4.</think> 4<|im_end|>\n", "6<|im_end|>\n"]


def test_long_records_are_cut_and_records_without_targets_dropped(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    rows, counts = encode_all(tok, [CHAT, CHAT], max_length=20)
    assert counts == {"records": 2, "truncated": 2, "dropped": 2} and rows == []
    rows, counts = encode_all(tok, [CHAT], max_length=1000)
    assert counts["dropped"] == 0 and len(rows[0][0]) == len(encode_chat(tok, CHAT)[0])


def test_bad_records_name_file_line_and_rule(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ConfigError, match=r"line 1: a record needs an assistant message"):
        read_chat_records(str(path), "data.train_file")
    path.write_text('{"messages": [{"role": "bot", "content": "hi"}]}\n')
    with pytest.raises(ConfigError, match="role one of system, user, assistant"):
        read_chat_records(str(path), "data.train_file")
    with pytest.raises(ConfigError, match="'data.train_file' = 'nope.jsonl' is not a file"):
        read_chat_records("nope.jsonl", "data.train_file")


def test_batches_group_lengths_cover_epochs_and_resume():
    lengths = np.arange(1, 41)
    stream = BatchStream(lengths, batch_size=4, window=5, seed=3)
    first = [next(stream) for _ in range(10)]  # one epoch
    assert sorted(np.concatenate(first).tolist()) == list(range(40))
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in first])
    assert spread < 8, spread  # random batches of 4 from 1..40 spread ~24
    saved = stream.get_state()
    later = [next(stream) for _ in range(3)]
    again = BatchStream(lengths, batch_size=4, window=5, seed=3)
    again.set_state(saved)
    assert all((a == b).all() for a, b in zip(later, [next(again) for _ in range(3)]))
    with pytest.raises(ValueError, match="batch_size"):
        BatchStream(lengths, 8, 5, 3).set_state(saved)
    tokens, attn, loss = pad_rows([(np.arange(3), np.array([0, 1, 1], bool))])
    assert tokens.shape == (1, 16) and attn.sum() == 3 and loss.sum() == 2
