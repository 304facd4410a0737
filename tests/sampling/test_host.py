"""Host-side pieces of the sampler: buckets, left padding, stop strings."""
import numpy as np
import pytest

from jaxrl.sampling.buckets import bucket, left_pad, quarter_bucket
from jaxrl.sampling.stop import cut_at_stop


def test_buckets_are_powers_of_two_from_16():
    assert [bucket(n) for n in (1, 16, 17, 32, 33, 100, 1000)] == [16, 16, 32, 32, 64, 128, 1024]
    assert bucket(3, minimum=1) == 4
    assert len({bucket(n) for n in range(1, 1025)}) == 7
    with pytest.raises(ValueError, match=">= 1"):
        bucket(0)


def test_quarter_buckets_are_four_per_octave():
    # 600 lies in (512, 1024]: steps of 1024 / 8 = 128, so 640; 17 lies in (16, 32]: steps of 4
    assert [quarter_bucket(n) for n in (1, 16, 17, 100, 513, 600, 1000, 1025)] == [
        16, 16, 20, 112, 640, 640, 1024, 1280]
    widths = {quarter_bucket(n) for n in range(1, 1025)}
    assert len(widths) == 1 + 6 * 4 and all(w >= 16 for w in widths)
    assert all(quarter_bucket(n) < 1.25 * n for n in range(17, 1025))


def test_left_pad_right_aligns_each_prompt():
    tokens, mask = left_pad([[5, 6, 7], [8]], 4, pad_id=1)
    np.testing.assert_array_equal(tokens, [[1, 5, 6, 7], [1, 1, 1, 8]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    with pytest.raises(ValueError, match="prompt 1 has 0 tokens"):
        left_pad([[5], []], 4)
    with pytest.raises(ValueError, match="prompt 0 has 5 tokens"):
        left_pad([[1, 2, 3, 4, 5]], 4)
    with pytest.raises(ValueError, match="no prompts"):
        left_pad([], 4)


WORDS = {1: "The", 2: " answer", 3: " is", 4: " <", 5: "/ans", 6: "wer>", 7: " done", 8: "!"}


def detok(ids):
    return "".join(WORDS[i] for i in ids)


def test_stop_string_spanning_tokens_keeps_the_token_that_completes_it():
    kept, text, stopped = cut_at_stop([1, 2, 3, 4, 5, 6, 7, 8], ["</answer>"], detok)
    assert (kept, text, stopped) == (6, "The answer is </answer>", True)


def test_earliest_of_several_stop_strings_wins_and_text_ends_after_it():
    kept, text, stopped = cut_at_stop([1, 2, 3, 4, 5, 6, 7], [" done", "answer i"], detok)
    assert (kept, text, stopped) == (3, "The answer i", True)


def test_no_stop_string_keeps_everything():
    assert cut_at_stop([1, 2, 3], ["xyz"], detok) == (3, "The answer is", False)
    assert cut_at_stop([1, 2, 3], [], detok) == (3, "The answer is", False)
