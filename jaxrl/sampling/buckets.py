"""Shape buckets: prompt widths and new-token counts rounded up to powers of two.

A program is compiled per distinct (batch size, prompt bucket, new-token bucket, decoding
settings, EOS ids, layer loop); bucketing bounds the lengths to log2(max / minimum) + 1 values
each, so a run over prompts of every length up to 1024 compiles at most 7 prompt widths.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum)."""
    if n < 1:
        raise ValueError(f"a bucketed length must be >= 1; got {n}")
    return 1 << (max(n, minimum) - 1).bit_length()


def quarter_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """n rounded up to four widths per octave (multiples of bucket(n) / 8): padding wastes at
    most a fifth of a row instead of half (640 for 600 tokens, where bucket gives 1024), for
    programs whose every row is computed in full, such as SFT steps."""
    step = max(bucket(n, minimum) // 8, 1)
    return -(-max(n, minimum) // step) * step


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0):
    """(tokens [B, W] int32, mask [B, W] bool): each prompt right-aligned in `width` columns, so
    every row's last prompt token sits in the last column and decoding appends after it."""
    if not prompts:
        raise ValueError("no prompts to sample from; pass at least one prompt of token ids")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for row, ids in enumerate(prompts):
        if not 1 <= len(ids) <= width:
            raise ValueError(f"prompt {row} has {len(ids)} tokens; each prompt needs between 1 "
                             f"and {width} token ids")
        tokens[row, width - len(ids):] = ids
        mask[row, width - len(ids):] = True
    return tokens, mask
