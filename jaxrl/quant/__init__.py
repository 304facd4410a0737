"""4-bit blockwise weight quantization (NF4 / int4) for the frozen base model."""
