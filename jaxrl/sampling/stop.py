"""Stop strings, applied on the host after decoding.

The jitted loop stops rows on EOS token ids only: a stop string may span several tokens and is
only visible in detokenized text. Afterwards each row is cut at the first token whose prefix text
contains a stop string; the completion keeps that token (the model did emit it, so its log-prob
belongs to the trajectory) and the text keeps the stop string itself, ending right after it
(rewards that parse a closing tag such as `</answer>` still see it). Rows that end on a stop
string report finish reason "stop". Between decode chunks `stopped` says whether a row's text
holds a stop string yet, so the sampler cancels it there and its slot is freed (its later
tokens are never used).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


def _first_stop_end(text: str, stop: Sequence[str]) -> int | None:
    """End index of the earliest stop string in text (None if there is none)."""
    ends = [(i, i + len(s)) for s in stop if (i := text.find(s)) >= 0]
    return min(ends)[1] if ends else None


def stopped(ids: Sequence[int], stop: Sequence[str],
            detokenize: Callable[[Sequence[int]], str]) -> bool:
    """Whether the text of ids holds a stop string."""
    return bool(stop) and _first_stop_end(detokenize(ids), stop) is not None


def cut_at_stop(ids: Sequence[int], stop: Sequence[str],
                detokenize: Callable[[Sequence[int]], str]) -> tuple[int, str, bool]:
    """(tokens kept, text, stopped) of one completion: the shortest prefix whose text holds a
    stop string (found by bisection: a longer prefix's text holds whatever a shorter one's does),
    and that text ended right after the stop string; or all of ids when none occurs."""
    text = detokenize(ids)
    if not stop or _first_stop_end(text, stop) is None:
        return len(ids), text, False
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop_end(detokenize(ids[:mid]), stop) is None:
            lo = mid + 1
        else:
            hi = mid
    text = detokenize(ids[:lo])
    return lo, text[:_first_stop_end(text, stop)], True
