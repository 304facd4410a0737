"""Names of the quantized formats, importable without jax (the config validates against them)."""

SCALE_DTYPES = ("float32", "bfloat16")  # dtypes of NF4 / int4 block scales
