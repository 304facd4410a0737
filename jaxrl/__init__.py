"""jaxrl: GRPO post-training in JAX with LoRA adapters over NF4 base weights."""

__version__ = "0.1.0"
