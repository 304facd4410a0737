"""Next-token selection: temperature, top-k, top-p, min-p, exact categorical draws, log-probs.

Glossary: B batch, V vocab, N blocks of C consecutive vocab entries (two-level sampling).

Filters follow Hugging Face `generate` in order and meaning: the logits are divided by the
temperature, then top-k, top-p and min-p run in that order, each on the previous one's output;
a removed token gets logit -inf.
  top-k  keeps logits >= the k-th largest (ties with it are kept, as in HF).
  top-p  keeps token i iff the probability mass of the tokens ranked above it is < p: the
         smallest set of most likely tokens whose mass reaches p. Tokens tied with the last
         kept one are kept too (HF's sort would split such a tie arbitrarily).
  min-p  keeps tokens with probability >= min_p * the largest probability.
Temperature 0 is greedy: the first index of the largest raw logit (filters do not apply).

Log-probs (`next_token`): the log-probability of the chosen token under log_softmax(logits / T)
for T > 0, taken BEFORE top-k / top-p / min-p filtering, which is the distribution the learner's
`jaxrl.rl.logprobs` computes at the same temperature; for T = 0 it is the untempered
log_softmax(logits).

Speed on XLA's CPU backend decides two choices here (B = 32, V = 49152, measured):
`jax.random.categorical` draws V Gumbel numbers per row (50-60 ms a step, as much as the whole
forward), and a cumulative sum over V costs 15 ms, so `categorical` inverts the CDF in two
levels, block sums then one block, with one uniform per level and row (1.8 ms, timed with one
uniform per row; the second, which keeps draws stable under rounding, adds B numbers). A full
sort for top-p costs ~400 ms, so `top_p_mask` reads the top 256 probabilities (`lax.top_k`,
9 ms) and falls back to an exact bisection (30 ms more) only when those do not reach p. Greedy
uses `lax.top_k(x, 1)` (~2 ms against 4.7 ms for `argmax`; both return the first index of the
max).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.config import SamplingConfig

_BLOCK = 128  # C: vocab entries per block in `categorical`
_TOP_P_CANDIDATES = 256  # probabilities `top_p_mask` sorts before it falls back to bisection


@dataclasses.dataclass(frozen=True)
class Decoding:
    """Static decoding settings; each distinct value is a separately compiled program."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self):
        checks = (("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
                  ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("min_p", 0 <= self.min_p < 1, "in [0, 1)"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"decoding {name} must be {allowed}; got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: SamplingConfig) -> "Decoding":
        return cls(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p), float(cfg.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """[B, V] True where a logit is among the k largest of its row (ties kept)."""
    if k >= logits.shape[-1]:
        return jnp.ones(logits.shape, bool)
    # min, not [:, -1:]: XLA rewrites a sliced top_k into a full sort (350 ms against 3 ms)
    kth = jnp.min(jax.lax.top_k(logits, k)[0], axis=-1, keepdims=True)  # [B, 1]
    return logits >= kth


def _bisect_top_p(probs: jax.Array, p: float) -> jax.Array:
    """[B, 1] the smallest float t with mass(probs > t) < p, found exactly by bisecting over the
    bit patterns of non-negative float32 values (ordered like the integers they spell)."""
    as_float = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float32)

    def halve(_, bounds):
        lo, hi = bounds  # [B] bit patterns; the answer lies in [lo, hi]
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(probs > as_float(mid)[:, None], probs, 0.0), axis=-1)
        below = mass < p
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1), jnp.int32)  # mass above max = 0
    _, hi = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))
    return as_float(hi)[:, None]


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """[B, V] True for the nucleus: tokens whose higher-ranked mass is < p (see module doc)."""
    probs = jax.nn.softmax(logits, axis=-1)  # [B, V]; removed (-inf) tokens get 0
    top = jax.lax.top_k(probs, min(_TOP_P_CANDIDATES, probs.shape[-1]))[0]  # [B, n], descending
    above = jnp.cumsum(top, axis=-1) - top  # mass ranked above each candidate
    last = jnp.sum(above < p, axis=-1, keepdims=True) - 1  # [B, 1] index of the last kept
    threshold = jnp.take_along_axis(top, last, axis=-1)  # [B, 1]
    reached = jnp.sum(top, axis=-1, keepdims=True) >= p  # the nucleus lies within the top n
    threshold = jax.lax.cond(
        jnp.all(reached), lambda: threshold,
        lambda: jnp.where(reached, threshold, _bisect_top_p(probs, p)))
    return probs >= threshold


def min_p_mask(logits: jax.Array, min_p: float) -> jax.Array:
    """[B, V] True where p_i >= min_p * max_j p_j, i.e. exp(logit_i - max logit) >= min_p."""
    return jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) >= min_p


def filter_logits(scaled: jax.Array, decoding: Decoding) -> jax.Array:
    """Temperature-scaled logits [B, V] with top-k, top-p, min-p applied in HF's order."""
    steps = ((decoding.top_k > 0, lambda x: top_k_mask(x, decoding.top_k)),
             (decoding.top_p < 1, lambda x: top_p_mask(x, decoding.top_p)),
             (decoding.min_p > 0, lambda x: min_p_mask(x, decoding.min_p)))
    for enabled, keep in steps:
        if enabled:
            scaled = jnp.where(keep(scaled), scaled, -jnp.inf)
    return scaled


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw [B] per row from softmax(logits), -inf logits never drawn.

    Exact inverse-CDF sampling in two levels with two uniforms per row: the first block whose
    cumulative weight reaches u1 * total, then the first entry of that block whose cumulative
    weight reaches u2 * the block's total. The entry gets a uniform of its own because what is
    left of u1 past the blocks before it carries the rounding of the cumulative weight of all
    of them (~1e-6 of the total, while entries lie ~1 / V of it apart): with it, logits that
    differ only in their last bits (one device against a mesh, one layer loop against another)
    drew another token in ~0.2% of draws at V = 49152. The block's own cumulative weight carries
    the rounding of its C entries only. Each chosen index has a positive weight even under float
    rounding: cumulative sums only grow where a weight is positive, and each uniform is scaled
    into (0, total] of its level."""
    b, v = logits.shape
    c = min(_BLOCK, v)
    n = -(-v // c)
    w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [B, V]
    w = jnp.pad(w, ((0, 0), (0, n * c - v))).reshape(b, n, c)  # [B, N, C]
    block_cum = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, N]
    u = 1.0 - jax.random.uniform(key, (b, 2))  # [B, 2] in (0, 1]
    block = jnp.minimum(jnp.sum(block_cum < u[:, :1] * block_cum[:, -1:], axis=-1), n - 1)  # [B]
    inner = jnp.cumsum(jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0], axis=-1)
    # [B, 1] in (0, block total]; `tiny` keeps a product that underflows above zero
    rest = jnp.clip(u[:, 1:] * inner[:, -1:], jnp.finfo(jnp.float32).tiny, inner[:, -1:])
    return (block * c + jnp.sum(inner < rest, axis=-1)).astype(jnp.int32)


def greedy(logits: jax.Array) -> jax.Array:
    """[B] the first index of each row's largest logit."""
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def next_token(key: jax.Array, logits: jax.Array, decoding: Decoding):
    """(token [B] int32, log-prob [B] float32) from float32 logits [B, V]; the log-prob is of
    the tempered, unfiltered distribution (module docstring)."""
    if decoding.greedy:
        scaled = logits
        token = greedy(logits)
    else:
        scaled = logits / decoding.temperature
        token = categorical(key, filter_logits(scaled, decoding))
    chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return token, chosen - jax.nn.logsumexp(scaled, axis=-1)
