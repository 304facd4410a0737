"""What a prefill and a decode step must move and compute, per device, so that their times can
be set beside the device's peak memory bandwidth and compute (`jaxrl.devices.Peaks`).

A decode step reads every weight as it is stored (NF4 codes and scales, or dense kernels), the
adapter, and the KV cache of every slot over its whole capacity: attention scores every cache
column and masks the unused ones, so that is what the program reads, not only the filled
columns. The embedding table counts when it is also the LM head (tied), else only the rows of
the fed tokens, which are left out. FLOPs count multiply-adds twice: the linears and LoRA
products of every layer, attention over the capacity, and the LM head, for every slot.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrl.model.families import ModelSpec
from jaxrl.model.params import LINEAR_NAMES, linear_shape


@dataclasses.dataclass(frozen=True)
class Cost:
    """Bytes read and FLOPs of one program call, per device."""

    bytes: float
    flops: float

    def shares(self, seconds: float, peaks) -> dict[str, float | None]:
        """Achieved bandwidth and FLOP/s, and their shares of `peaks` (None without peaks)."""
        bandwidth, flops = self.bytes / seconds, self.flops / seconds
        return {"bytes": self.bytes, "flops": self.flops, "bandwidth": bandwidth,
                "flop_rate": flops,
                "bandwidth_share": None if peaks is None else bandwidth / peaks.bandwidth,
                "flops_share": None if peaks is None else flops / peaks.flops}


def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of arrays (its first shard of each)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def _per_token_flops(spec: ModelSpec, lora) -> int:
    """FLOPs of one token through one layer's linears and adapter (no attention)."""
    flops = 0
    for name in LINEAR_NAMES:
        fan_in, fan_out = linear_shape(spec, name)
        flops += 2 * fan_in * fan_out
        if lora is not None and name in lora.targets:
            flops += 2 * lora.rank * (fan_in + fan_out)
    return flops


def decode_cost(spec: ModelSpec, params, lora, cache, slots: int, devices: int,
                prefix=None) -> Cost:
    """One decode step of `slots` slots over `cache` (a KVCache of capacity C), per device;
    prefix: the prompt cache that blocks of slots share (read once per block)."""
    stored = device_bytes(params)
    if not spec.tie_word_embeddings:
        stored -= device_bytes(params["embed_tokens"])
    read = stored + (0 if lora is None else device_bytes(lora.weights)) + device_bytes(
        (cache.k, cache.v) if prefix is None else (cache.k, cache.v, prefix.k, prefix.v))
    columns = cache.max_len + (0 if prefix is None else prefix.max_len)
    attention = 2 * 2 * spec.num_heads * spec.head_dim * columns
    per_slot = spec.num_layers * (_per_token_flops(spec, lora) + attention)
    per_slot += 2 * spec.hidden_size * spec.vocab_size
    return Cost(bytes=read, flops=slots * per_slot / devices)


def prefill_cost(spec: ModelSpec, lora, prompts: int, width: int, devices: int) -> Cost:
    """Prefilling `prompts` prompts of `width` columns (the LM head at each one's last token
    only), per device; bytes are left at 0: a prefill is bound by compute."""
    attention = 2 * 2 * spec.num_heads * spec.head_dim * width * width
    flops = prompts * (spec.num_layers * (width * _per_token_flops(spec, lora) + attention)
                       + 2 * spec.hidden_size * spec.vocab_size)
    return Cost(bytes=0, flops=flops / devices)
