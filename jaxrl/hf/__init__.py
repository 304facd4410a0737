"""Hugging Face interop: checkpoints, GGUF conversion, the embedded default model."""
