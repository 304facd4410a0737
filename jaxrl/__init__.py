"""jaxrl: GRPO post-training in JAX with LoRA adapters over NF4 base weights."""
import logging


class _NoTorchNotice(logging.Filter):
    """transformers announces on import that PyTorch is missing; jaxrl uses only its tokenizers
    and configs, so the notice would only mislead its users."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchNotice())

__version__ = "0.1.0"
