"""Per-token log-probs (and entropies) of a sequence under the policy, chunked over positions.

Glossary: B batch, T tokens, N scored positions (T - start), C chunk length, K = ceil(N / C)
chunks, E hidden size, V vocab.

The LM head runs on C positions at a time inside `lax.scan`, so at most one chunk's logits
[B, C, V] float32 (B * C * V * 4 bytes: 0.6 GB for Qwen3's V = 151,936 at B = 8, C = 128) exist
at once instead of [B, N, V]. The chunk function is rematerialized (`jax.checkpoint`) unless
remat is "none": the backward pass saves only each chunk's hidden states and recomputes its
logits, so it never holds all chunks' logits either (under "none" it keeps them and recomputes
nothing, for runs whose memory allows it: jaxrl/rl/remat.py). Chunks run along positions, not
over flattened B * N rows, so a batch axis sharded over the mesh stays sharded.

Alignment: `token_logprobs(..., start=s)` scores tokens[:, s:]: out[:, j] = log p(tokens[:, s + j]
| tokens[:, :s + j]), shape [B, T - s]. With s = 1 (the default) that is every next-token target
(targets = tokens shifted by one); with s = the padded prompt width it lines up with the
sampler's [B, max_new_tokens] completion log-probs and mask, and the head skips the prompt.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.backends.numerics import REFERENCE, Numerics
from jaxrl.lora.lora import Lora
from jaxrl.model.families import ModelSpec
from jaxrl.model.transformer import (Params, hidden_states, lm_logits, logits_at,
                                     prefix_hidden_states)
from jaxrl.sharding import MeshRules, head_logits


def _chunk_stats(logits: jax.Array, targets: jax.Array, with_entropy: bool):
    """log p(target) [B, C] and (optionally) the entropy [B, C] of logits [B, C, V]."""
    logz = jax.nn.logsumexp(logits, axis=-1)  # [B, C]
    logp = logits_at(logits, targets) - logz
    if not with_entropy:
        return logp, None
    log_probs = logits - logz[..., None]  # [B, C, V]
    # 0 log 0 = 0: a token of probability 0 (logit -inf) adds nothing, not NaN
    terms = jnp.exp(log_probs) * log_probs
    return logp, -jnp.sum(terms, axis=-1, where=log_probs > -jnp.inf)


def _check_chunking(chunk: int, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs (softmax(logits / T)); got "
                         f"{temperature}; greedy decoding (T = 0) has no log-probs to match")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions; got {chunk}")


def chunked_logprobs(h: jax.Array, targets: jax.Array, head_fn: Callable[[jax.Array], jax.Array],
                     *, chunk: int = 128, temperature: float = 1.0, with_entropy: bool = False,
                     remat: bool = True):
    """(logp [B, N], entropy [B, N] or None), float32, of targets [B, N] given h [B, N, E].

    head_fn maps hidden states [B, C, E] to logits [B, C, V]. Both outputs are of the tempered
    distribution softmax(logits / temperature), the one a sampler at that temperature draws
    from (before any top-p / top-k truncation). N need not be a multiple of chunk: the last
    chunk is padded and the padding dropped.
    """
    _check_chunking(chunk, temperature)
    b, n, e = h.shape
    c = min(chunk, n)
    pad = -n % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = h.reshape(b, -1, c, e).swapaxes(0, 1)  # [K, B, C, E]
    ts = targets.reshape(b, -1, c).swapaxes(0, 1)  # [K, B, C]

    def one_chunk(hc, tc):
        return _chunk_stats(head_fn(hc) / temperature, tc, with_entropy)

    body = jax.checkpoint(one_chunk, prevent_cse=False) if remat else one_chunk
    _, (logp, entropy) = jax.lax.scan(lambda _, x: (None, body(*x)), None, (hs, ts))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, -1)[:, :n]  # [K, B, C] -> [B, N]
    return unchunk(logp), (None if entropy is None else unchunk(entropy))


def token_logprobs(params: Params, spec: ModelSpec, tokens: jax.Array, positions: jax.Array,
                   attn_mask: jax.Array | None = None, lora: Lora | None = None, *,
                   start: int = 1, chunk: int = 128, temperature: float = 1.0,
                   with_entropy: bool = False, remat: str = "full", rng: jax.Array | None = None,
                   shardings: MeshRules | None = None, share: int = 1,
                   numerics: Numerics = REFERENCE):
    """(logp [B, T - start], entropy [B, T - start] or None) of tokens[:, start:], float32.

    tokens, positions, attn_mask [B, T] as for `hidden_states`; lora None scores the frozen base
    (the GRPO reference policy); rng is the LoRA dropout key. remat: what the transformer layers
    save for the backward pass (`jaxrl.model.transformer.REMAT_POLICIES`); the head chunks are
    rematerialized unless it is "none". See the module docstring for the alignment and
    `chunked_logprobs` for chunk and temperature. shardings: the mesh the arrays lie on; the
    layers gather their weights over its FSDP axes, and the head's logits keep the vocab split
    its table has (`jaxrl.sharding.head_rules`): the log-softmax and the target's logit reduce
    [B, C] across that split. share: blocks of that many consecutive rows hold the same first
    `start` columns (a GRPO group's prompt), which then run once per block
    (`jaxrl.model.transformer.prefix_hidden_states`; not with LoRA dropout); 1: every row alone.
    numerics: the backend forms (`jaxrl.backends.numerics`).
    """
    t = tokens.shape[1]
    if not 1 <= start < t:
        raise ValueError(f"start must be in [1, {t}) for tokens of length {t} (position 0 has "
                         f"no prediction); got {start}")
    _check_chunking(chunk, temperature)  # before the forward pass, not after it
    if share > 1:
        if rng is not None and lora is not None and lora.dropout > 0:
            raise ValueError("rows sharing their prompt (share > 1) take no LoRA dropout")
        prefix, rest = prefix_hidden_states(params, tokens, positions, spec, prefix=start,
                                            share=share, attn_mask=attn_mask, lora=lora,
                                            remat=remat, shardings=shardings,
                                            numerics=numerics)
        # the prefix's last position predicts each row's first scored token
        h = jnp.concatenate([jnp.repeat(prefix[:, -1:], share, axis=0), rest[:, :-1]], axis=1)
    else:
        h, _ = hidden_states(params, tokens, positions, spec, attn_mask=attn_mask, lora=lora,
                             rng=rng, remat=remat, shardings=shardings, numerics=numerics)
        h = h[:, start - 1:-1]
    return chunked_logprobs(h, tokens[:, start:],
                            lambda x: head_logits(shardings, lm_logits(params, x, spec, numerics)),
                            chunk=chunk, temperature=temperature, with_entropy=with_entropy,
                            remat=remat != "none")
