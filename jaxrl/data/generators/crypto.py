"""Crypto: cipher rule induction. The prompt shows texts and their encryptions under one hidden
Caesar shift or Atbash substitution; the answer is a Python function `transform(text)` that
applies the rule, checked by running it on held-out texts (`python` verifier).

Difficulty lowers the number of shown examples and adds capitals and punctuation that the
function must handle (letters keep their case, everything else passes through).
"""
from __future__ import annotations

import json
import random

from jaxrl.data.generators.registry import register
from jaxrl.data.records import Problem

WORDS = (
    "apple river stone light green house music paper quick brown dog cat bird tree water fire "
    "cloud happy simple garden window yellow silver market winter summer bridge forest rocket "
    "planet number letter secret signal friend little morning evening valley orange purple "
    "travel bottle candle dragon island jungle kitten ladder meadow needle pencil rabbit salad "
    "ticket violin wizard zebra anchor basket castle desert engine feather guitar hammer jacket "
    "lemon mirror nest ocean pocket quiet rain sunset tiger umbrella voice whale young zero"
).split()
PUNCTUATION = (".", ",", "!", "?")
# difficulty -> (shown examples, capitals and punctuation)
LEVELS = {1: (6, False), 2: (4, True), 3: (3, True)}
HELD_OUT = 5

CAESAR_SOURCE = '''def transform(text):
    result = []
    for ch in text:
        if "a" <= ch <= "z":
            result.append(chr((ord(ch) - ord("a") + {shift}) % 26 + ord("a")))
        elif "A" <= ch <= "Z":
            result.append(chr((ord(ch) - ord("A") + {shift}) % 26 + ord("A")))
        else:
            result.append(ch)
    return "".join(result)
'''
ATBASH_SOURCE = '''def transform(text):
    result = []
    for ch in text:
        if "a" <= ch <= "z":
            result.append(chr(ord("z") - (ord(ch) - ord("a"))))
        elif "A" <= ch <= "Z":
            result.append(chr(ord("Z") - (ord(ch) - ord("A"))))
        else:
            result.append(ch)
    return "".join(result)
'''


def encrypt(text: str, shift: int | None) -> str:
    """Caesar by `shift`, or Atbash when shift is None; case kept, non-letters unchanged."""
    out = []
    for ch in text:
        for base in ("a", "A"):
            if ord(base) <= ord(ch) <= ord(base) + 25:
                offset = ord(ch) - ord(base)
                offset = 25 - offset if shift is None else (offset + shift) % 26
                out.append(chr(ord(base) + offset))
                break
        else:
            out.append(ch)
    return "".join(out)


def _plaintext(rng: random.Random, styled: bool) -> str:
    words = rng.sample(WORDS, rng.randint(2, 4))
    if styled:
        words[0] = words[0].capitalize()
        if rng.random() < 0.5:
            words[-1] += rng.choice(PUNCTUATION)
    return " ".join(words)


@register("crypto", "Caesar / Atbash rule induction; answer is a Python transform(text)",
          "python")
def make(rng: random.Random, difficulty: int) -> Problem:
    shown, styled = LEVELS[difficulty]
    shift = None if rng.random() < 0.25 else rng.randint(1, 25)
    texts: list[str] = []
    while len(texts) < shown + HELD_OUT:
        text = _plaintext(rng, styled)
        if text not in texts:
            texts.append(text)
    pairs = [(t, encrypt(t, shift)) for t in texts]
    examples = "\n".join(f"{json.dumps(a)} -> {json.dumps(b)}" for a, b in pairs[:shown])
    source = ATBASH_SOURCE if shift is None else CAESAR_SOURCE.format(shift=shift)
    tests = [{"input": a, "output": b} for a, b in pairs[shown:]]
    rule = "atbash" if shift is None else f"caesar+{shift}"
    return Problem(fields={"examples": examples}, answer=source,
                   verifier={"kind": "python", "entry_point": "transform", "tests": tests},
                   metadata={"rule": rule, "shown": shown})
