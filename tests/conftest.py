"""Test-wide JAX set-up: 8 fake CPU devices and a persistent compilation cache."""
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_cache = Path(os.environ.get("JAXRL_CACHE", Path.home() / ".cache" / "jaxrl")) / "jax-compile"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_cache))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
