"""Next-token selection with per-row settings: temperature, top-k, top-p, min-p, exact
categorical draws, log-probs.

Glossary: B batch (rows or decode slots), V vocab, G groups of V / G consecutive vocab
entries, N blocks of C consecutive entries of a group (three-level sampling).

Each row carries its own settings (`RowSettings`: arrays [B]), so a decode slot's settings are
data, not part of the compiled program. Filters follow Hugging Face `generate` in order and
meaning: the logits are divided by the temperature, then top-k, top-p and min-p run in that
order, each on the previous one's output; a removed token gets logit -inf.
  top-k  keeps logits >= the k-th largest (ties with it are kept, as in HF); 0 = off.
  top-p  keeps token i iff the probability mass of the tokens ranked above it is < p: the
         smallest set of most likely tokens whose mass reaches p. Tokens tied with the last
         kept one are kept too (HF's sort would split such a tie arbitrarily); 1 = off.
  min-p  keeps tokens with probability >= min_p * the largest probability; 0 = off.
Before all of them the raw logits are adjusted (`adjust_logits`) by what a row has seen
(`History`: its prompt's tokens and how often it generated each token), in this order:
  repetition_penalty r (as in HF / CTRL): a logit of a token in the prompt or the output so far
         is divided by r where positive, multiplied by r where negative; 1 = off.
  presence_penalty a, frequency_penalty f (as in the OpenAI API): a token generated c times so
         far loses a * (c > 0) + f * c; 0 = off. The prompt does not count.
  logit_bias: up to MAX_LOGIT_BIAS (token id, bias) pairs added to the logits.
Temperature 0 is greedy: the first index of the largest adjusted logit (filters do not apply).

Which of these a program computes is static (`Features`, from the rows' settings on the host):
an adjustment, filter, the draws or the greedy choice that no row uses is left out of the
program, and one that is in is applied to every row as a mask, so a row that does not use it
passes through unchanged. Nothing here branches on data at run time (no `lax.cond`, no loop
with a data-dependent trip count), so on an accelerator nothing waits on the host.

Log-probs (`next_token`): the log-probability of the chosen token under log_softmax(logits / T)
of the model's raw logits for T > 0, taken BEFORE the adjustments and top-k / top-p / min-p
filtering, which is the distribution the learner's `jaxrl.rl.logprobs` computes at the same
temperature; for T = 0 it is the untempered log_softmax(logits). Rows that ask for
`top_logprobs` also get the MAX_TOP_LOGPROBS most likely tokens of that distribution with their
log-probs (computed only when the features say some row asks).

Draws: row b draws its uniforms from its own key, so what a row samples does not depend on the
rows beside it. `categorical` inverts the CDF in three levels, group sums, then block sums of
one group, then one block, instead of V Gumbel numbers per row; top-k and top-p read the top
256 entries (`lax.top_k`) and fall back to an exact bisection for rows those do not decide, as
a full sort over V is far slower (docs/benchmarks.md): top-k's bisection is in the program only
when the features say some row's k exceeds those entries, top-p's whenever top-p is (whether
the 256 entries reach p is known only from the data), each applied as a mask per row.

Vocab split over a mesh (the decode step's logits, `jaxrl.sharding.head_rules`): the top-k
that the functions take runs per part and exchanges [B, parts * k] candidates
(`jaxrl.sharding.vocab_top_k`), the draws' groups lie whole inside each part, the chosen token's
log-prob is a masked sum (`logits_at`), and every other reduction over V is a max or a sum; so
nothing [B, V]-sized crosses between devices, and a mesh draws the tokens one device draws.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl.config import SamplingConfig
from jaxrl.model.transformer import logits_at

_GROUPS = 64  # G: the most vocab groups `categorical` draws among first
_BLOCK = 128  # C: vocab entries per block in `categorical`
_CANDIDATES = 256  # entries top-k and top-p read before they fall back to bisection
MAX_TOP_LOGPROBS = 20  # alternatives a row can ask for per token (the OpenAI API's limit)
MAX_LOGIT_BIAS = 300  # (token id, bias) pairs per row
_NO_TOKEN = 2 ** 30  # the token id of an unused logit_bias entry: past any vocab, so dropped
TopK = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]  # lax.top_k over the last axis


@dataclasses.dataclass(frozen=True)
class Decoding:
    """One request's decoding settings, checked; `RowSettings.of` turns rows of them into data."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    top_logprobs: int = 0  # alternatives returned per token, 0 = none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    def __post_init__(self):
        checks = (("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
                  ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)"),
                  ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                   f"in [0, {MAX_TOP_LOGPROBS}]"),
                  ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS
                   and all(0 <= int(t) < _NO_TOKEN for t, _ in self.logit_bias),
                   f"at most {MAX_LOGIT_BIAS} (token id >= 0, bias) pairs"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"decoding {name} must be {allowed}; got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: SamplingConfig) -> "Decoding":
        return cls(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p), float(cfg.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class Features:
    """Which parts of `next_token` a batch of rows needs: a hashable static value that the host
    computes from the rows' settings (`of`) and the programs take as a static argument. A part
    that is off is left out of the program; one that is on is applied to every row as a mask.
    For every row whose settings it covers (`covers`), a program built for a features value
    gives the tokens, log-probs and top log-probs that the program with every part on (`ALL`)
    gives; a row it does not cover gets some token, which the caller must not use."""

    greedy: bool = False  # some row has temperature 0 (neither: the greedy choice alone)
    sampled: bool = False  # some row draws (temperature > 0)
    top_k: bool = False  # some drawing row has top_k > 0
    wide_top_k: bool = False  # some drawing row's top_k exceeds the _CANDIDATES read
    top_p: bool = False  # some drawing row has top_p < 1
    min_p: bool = False  # some drawing row has min_p > 0
    penalties: bool = False  # some row has a repetition, presence or frequency penalty or a bias
    top_logprobs: bool = False  # some row asks for top log-probs

    @classmethod
    def of(cls, rows: Iterable[Decoding]) -> "Features":
        """The smallest features that cover every row (their settings as float32, as
        `RowSettings.of` holds them)."""
        f32 = np.float32
        rows = list(rows)
        drawn = [d for d in rows if f32(d.temperature) != 0]
        return cls(greedy=len(drawn) < len(rows), sampled=bool(drawn),
                   top_k=any(d.top_k > 0 for d in drawn),
                   wide_top_k=any(d.top_k > _CANDIDATES for d in drawn),
                   top_p=any(f32(d.top_p) < 1 for d in drawn),
                   min_p=any(f32(d.min_p) > 0 for d in drawn),
                   penalties=any(f32(d.repetition_penalty) != 1 or f32(d.presence_penalty) != 0
                                 or f32(d.frequency_penalty) != 0 or d.logit_bias
                                 for d in rows),
                   top_logprobs=any(d.top_logprobs > 0 for d in rows))

    def __or__(self, other: "Features") -> "Features":
        """The features that cover the rows either covers."""
        return Features.from_bits(self.bits() | other.bits())

    def covers(self, rows: Iterable[Decoding]) -> bool:
        """Every part these rows use is on."""
        need = Features.of(rows).bits()
        return need & self.bits() == need

    def bits(self) -> int:
        """The features as an int, one bit per field in order (`from_bits` inverts it)."""
        return sum(1 << i for i, f in enumerate(dataclasses.fields(self))
                   if getattr(self, f.name))

    @classmethod
    def from_bits(cls, bits: int) -> "Features":
        return cls(**{f.name: bool(bits >> i & 1) for i, f in enumerate(dataclasses.fields(cls))})


ALL = Features(**{f.name: True for f in dataclasses.fields(Features)})  # every part on


@struct.dataclass
class RowSettings:
    """Decoding settings per row, as arrays [B] (logit_bias as [B, MAX_LOGIT_BIAS] pairs)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1 = off
    min_p: jax.Array  # float32; 0 = off
    repetition_penalty: jax.Array  # float32; 1 = off
    presence_penalty: jax.Array  # float32; 0 = off
    frequency_penalty: jax.Array  # float32; 0 = off
    top_logprobs: jax.Array  # int32; 0 = none
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32; _NO_TOKEN where unused
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32

    @classmethod
    def of(cls, rows: Sequence[Decoding]) -> "RowSettings":
        """Host arrays of one `Decoding` per row."""
        column = lambda name, dtype: np.asarray([getattr(d, name) for d in rows], dtype)
        bias_ids = np.full((len(rows), MAX_LOGIT_BIAS), _NO_TOKEN, np.int32)
        bias = np.zeros((len(rows), MAX_LOGIT_BIAS), np.float32)
        for row, d in enumerate(rows):
            for i, (token, value) in enumerate(d.logit_bias):
                bias_ids[row, i], bias[row, i] = token, value
        return cls(temperature=column("temperature", np.float32),
                   top_k=column("top_k", np.int32), top_p=column("top_p", np.float32),
                   min_p=column("min_p", np.float32),
                   repetition_penalty=column("repetition_penalty", np.float32),
                   presence_penalty=column("presence_penalty", np.float32),
                   frequency_penalty=column("frequency_penalty", np.float32),
                   top_logprobs=column("top_logprobs", np.int32), bias_ids=bias_ids, bias=bias)


@struct.dataclass
class History:
    """What each row has seen, for the penalties: [B, V] each."""

    prompt: jax.Array  # bool: the token occurs in the row's prompt
    counts: jax.Array  # int32: times the row has generated the token

    @classmethod
    def empty(cls, rows: int, vocab: int) -> "History":
        return cls(prompt=jnp.zeros((rows, vocab), bool),
                   counts=jnp.zeros((rows, vocab), jnp.int32))

    @classmethod
    def of_prompts(cls, prompts: jax.Array, lengths: jax.Array, vocab: int) -> "History":
        """The history of prompts [B, P] (right-padded; lengths [B]) before any new token."""
        b, p = prompts.shape
        real = jnp.arange(p)[None, :] < lengths[:, None]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, p))
        empty = cls.empty(b, vocab)
        return empty.replace(prompt=empty.prompt.at[rows, jnp.where(real, prompts, vocab)].set(
            True, mode="drop"))

    def record(self, token: jax.Array, live: jax.Array) -> "History":
        """The history after each live row [B] generated token [B]."""
        rows = jnp.arange(token.shape[0])
        return self.replace(counts=self.counts.at[rows, token].add(live.astype(jnp.int32)))


def _per_row(x, logits: jax.Array) -> jax.Array:
    """A scalar or [B] setting as [B, 1] against logits [B, V]."""
    return jnp.broadcast_to(jnp.asarray(x), logits.shape[:1])[:, None]


def _ordered(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 values that order like the values (-inf lowest): negative values'
    bits inverted, non-negative values' sign bit set."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return bits ^ jnp.where(bits >> 31 == 1, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _bisect_kth(logits: jax.Array, k: jax.Array) -> jax.Array:
    """[B, 1] ordered key (`_ordered`) of each row's k-th largest logit (k [B, 1] >= 1): the
    largest key t with count(keys >= t) >= k, found exactly by bisection over uint32."""
    keys = _ordered(logits)

    def halve(_, bounds):
        lo, hi = bounds  # [B, 1]; the answer lies in [lo, hi]
        mid = lo + (hi - lo + 1) // 2
        enough = jnp.sum(keys >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)
    return jax.lax.fori_loop(0, 33, halve, (lo, hi))[0]


def top_k_mask(logits: jax.Array, k, top_k: TopK = jax.lax.top_k,
               wide: bool = True) -> jax.Array:
    """[B, V] True where a logit is among the k largest of its row (ties kept); k an int or
    [B] ints, 0 = keep all. wide: some row's k may exceed the _CANDIDATES entries read; when
    False, a row with _CANDIDATES < k <= V keeps its top _CANDIDATES instead."""
    k = _per_row(k, logits)
    v = logits.shape[-1]
    n = min(_CANDIDATES, v)
    top = top_k(logits, n)[0]  # [B, n], descending
    kth = _ordered(jnp.take_along_axis(top, jnp.clip(k - 1, 0, n - 1), axis=-1))
    if wide and n < v:  # rows whose k-th largest lies outside the candidates
        kth = jnp.where(k > n, _bisect_kth(logits, k), kth)
    return (k == 0) | (k > v) | (_ordered(logits) >= kth)


def _bisect_top_p(probs: jax.Array, p: jax.Array) -> jax.Array:
    """[B, 1] the smallest float t with mass(probs > t) < p (p [B, 1]), found exactly by
    bisecting over the bit patterns of non-negative float32 values (ordered like the integers
    they spell)."""
    as_float = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float32)

    def halve(_, bounds):
        lo, hi = bounds  # [B] bit patterns; the answer lies in [lo, hi]
        mid = lo + (hi - lo) // 2
        mass = jnp.sum(jnp.where(probs > as_float(mid)[:, None], probs, 0.0), axis=-1)
        below = mass < p[:, 0]
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1), jnp.int32)  # mass above max = 0
    _, hi = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))
    return as_float(hi)[:, None]


def top_p_mask(logits: jax.Array, p, top_k: TopK = jax.lax.top_k) -> jax.Array:
    """[B, V] True for the nucleus: tokens whose higher-ranked mass is < p (see module doc);
    p a float or [B] floats, 1 = keep all."""
    p = _per_row(p, logits)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, V]; removed (-inf) tokens get 0
    top = top_k(probs, min(_CANDIDATES, probs.shape[-1]))[0]  # [B, n], descending
    above = jnp.cumsum(top, axis=-1) - top  # mass ranked above each candidate
    last = jnp.sum(above < p, axis=-1, keepdims=True) - 1  # [B, 1] index of the last kept
    threshold = jnp.take_along_axis(top, last, axis=-1)  # [B, 1]
    reached = (jnp.sum(top, axis=-1, keepdims=True) >= p) | (p >= 1)  # decided by the top n
    threshold = jnp.where(reached, threshold, _bisect_top_p(probs, p))
    return (p >= 1) | (probs >= threshold)


def min_p_mask(logits: jax.Array, min_p) -> jax.Array:
    """[B, V] True where p_i >= min_p * max_j p_j, i.e. exp(logit_i - max logit) >= min_p;
    min_p a float or [B] floats, 0 = keep all."""
    return jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) >= _per_row(min_p, logits)


def filter_logits(scaled: jax.Array, settings: RowSettings, top_k: TopK = jax.lax.top_k,
                  features: Features = ALL) -> jax.Array:
    """Temperature-scaled logits [B, V] with each row's top-k, top-p, min-p applied in HF's
    order; a filter the features leave out is not applied (`Features`)."""
    if features.top_k:
        keep = top_k_mask(scaled, settings.top_k, top_k, features.wide_top_k)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    if features.top_p:
        scaled = jnp.where(top_p_mask(scaled, settings.top_p, top_k), scaled, -jnp.inf)
    if features.min_p:
        scaled = jnp.where(min_p_mask(scaled, settings.min_p), scaled, -jnp.inf)
    return scaled


def _inverse_cdf(w: jax.Array, u: jax.Array) -> jax.Array:
    """[B] the first entry of each row of w [B, N] (weights >= 0, a positive total) whose
    cumulative weight reaches u [B] (in (0, 1]) times the total. Never an entry of weight 0,
    even under float rounding: the cumulative sum only grows where a weight is positive, and
    the target lies in (0, total] (`tiny` keeps a product that underflows above zero)."""
    cum = jnp.cumsum(w, axis=-1)
    total = cum[:, -1:]
    target = jnp.clip(u[:, None] * total, jnp.finfo(jnp.float32).tiny, total)
    return jnp.minimum(jnp.sum(cum < target, axis=-1), w.shape[-1] - 1)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw [B] per row from softmax(logits), row b from keys[b]; -inf logits never drawn.

    Exact inverse-CDF sampling in three levels, each with a uniform of its own: a group of
    V / G consecutive entries (G the largest power of two up to 64 that divides V) by the
    groups' weights, a block of C entries of that group by the blocks' weights, an entry of
    that block by its weights. An entry is drawn with a uniform of its own, not with what is
    left of the previous level's past the blocks before: that leftover carries the rounding of
    the cumulative sum over every block before (~1e-6 of the total, while entries lie ~1 / V
    of it apart), so logits that differ only in their last bits (one device against a mesh,
    one layer loop against another) drew another token in ~0.2% of draws at V = 49152; the
    block's own cumulative sum carries the rounding of its C entries only. The groups lie
    whole inside each part of a vocab split over up to 64 devices, so on a mesh each device
    sums its own groups and only [B, G] group weights and the chosen group's [B, V / G]
    cross between devices."""
    b, v = logits.shape
    g = math.gcd(v, _GROUPS)
    n_in = v // g
    c = min(_BLOCK, n_in)
    n = -(-n_in // c)
    w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).reshape(b, g, n_in)
    u = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (3,)))(keys)  # [B, 3] in (0, 1]
    group = _inverse_cdf(jnp.sum(w, axis=-1), u[:, 0])  # [B]
    chosen = (jnp.arange(g) == group[:, None])[..., None]  # [B, G, 1]
    w = jnp.sum(jnp.where(chosen, w, 0.0), axis=1)  # [B, V / G]: the group's weights
    w = jnp.pad(w, ((0, 0), (0, n * c - n_in))).reshape(b, n, c)  # [B, N, C]
    block = _inverse_cdf(jnp.sum(w, axis=-1), u[:, 1])  # [B]
    entry = _inverse_cdf(jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0], u[:, 2])
    return (group * n_in + block * c + entry).astype(jnp.int32)


def greedy(logits: jax.Array, top_k: TopK = jax.lax.top_k) -> jax.Array:
    """[B] the first index of each row's largest logit."""
    return top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def adjust_logits(logits: jax.Array, settings: RowSettings, history: History,
                  features: Features = ALL) -> jax.Array:
    """Raw logits [B, V] after each row's repetition, presence and frequency penalties and
    logit_bias (module docstring); left as they are when the features have no penalties."""
    if not features.penalties:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    r = settings.repetition_penalty[:, None]
    seen = history.prompt | (history.counts > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    counts = history.counts.astype(logits.dtype)
    logits = (logits - settings.presence_penalty[:, None] * (counts > 0)
              - settings.frequency_penalty[:, None] * counts)
    return logits.at[rows, settings.bias_ids].add(settings.bias, mode="drop")


@struct.dataclass
class Picked:
    """`next_token`'s output for B rows."""

    token: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32 (module docstring)
    top_ids: jax.Array  # [B, MAX_TOP_LOGPROBS] int32: the most likely tokens, best first
    top_logprobs: jax.Array  # [B, MAX_TOP_LOGPROBS] float32; 0 when no row asked for them


def next_token(keys: jax.Array, logits: jax.Array, settings: RowSettings,
               history: History, top_k: TopK = jax.lax.top_k,
               features: Features = ALL, allowed: jax.Array | None = None) -> Picked:
    """The next token of each row from float32 logits [B, V], row b drawn with keys[b] under
    its own settings and history; log-probs of the tempered raw distribution (module
    docstring). top_k: `lax.top_k` over V, or where a mesh splits V the top-k that exchanges
    candidates (`jaxrl.sharding.vocab_top_k`). features: the parts the program holds; rows
    they do not cover (`Features.covers`) get tokens that mean nothing. allowed [B, V] bool:
    the tokens each row may take (a grammar's mask; None: all), applied before the choice; the
    log-probs stay those of the raw distribution."""
    is_greedy = settings.temperature == 0
    temperature = jnp.where(is_greedy, 1.0, settings.temperature)[:, None]
    adjusted = adjust_logits(logits, settings, history, features)
    if allowed is not None:
        adjusted = jnp.where(allowed, adjusted, -jnp.inf)
    if features.sampled:
        token = categorical(keys, filter_logits(adjusted / temperature, settings, top_k,
                                                features))
        if features.greedy:
            token = jnp.where(is_greedy, greedy(adjusted, top_k), token)
    else:
        token = greedy(adjusted, top_k)
    scaled = logits / temperature
    lse = jax.nn.logsumexp(scaled, axis=-1)  # [B]
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    if features.top_logprobs:
        top_scaled, top_ids = top_k(scaled, k)
    else:
        top_scaled = lse[:, None] + jnp.zeros((1, k), scaled.dtype)
        top_ids = jnp.zeros(scaled.shape[:1] + (k,), jnp.int32)
    chosen = logits_at(scaled, token)
    return Picked(token=token, logprob=chosen - lse, top_ids=top_ids.astype(jnp.int32),
                  top_logprobs=top_scaled - lse[:, None])
