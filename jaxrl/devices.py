"""What the devices offer: memory per device, and the peak memory bandwidth and compute that
`jaxrl bench` sets its figures beside.

Peaks are the vendors' published figures per chip (dense bf16 matmuls with float32
accumulation, no sparsity; HBM bandwidth), found by the device_kind XLA reports. A CPU has no
such entry: `measure_cpu_peaks` times a streaming read and a matmul on the spot.
"""
from __future__ import annotations

import dataclasses
import os
import time

from jaxrl.config import UsageError

GIB = 1 << 30
# HBM per chip a program may use, by the device_kind XLA reports: for v5e and v5p what XLA's TPU
# compiler names as available when it refuses a program; the chip's nominal HBM for the others.
DEVICE_MEMORY_GIB = {"TPU v4": 32, "TPU v5 lite": 15.75, "TPU v5": 95.74, "TPU v5p": 95.74,
                     "TPU v6 lite": 32, "TPU v6e": 32}


@dataclasses.dataclass(frozen=True)
class Peaks:
    """A device's limits: bytes/s read from its memory and matmul FLOP/s; `source` says where
    the figures come from."""

    name: str
    bandwidth: float
    flops: float
    source: str


# (what device_kind contains, name, bytes/s, FLOP/s), the more specific name of a family first
_PUBLISHED = (
    ("H200", "H200", 4.8e12, 989e12),
    ("H100 PCIe", "H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", "H100 NVL", 3.9e12, 835e12),
    ("H100", "H100 SXM", 3.35e12, 989e12),
    ("A100-SXM4-80GB", "A100 SXM 80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", "A100 PCIe 80GB", 1.935e12, 312e12),
    ("A100", "A100 40GB", 1.555e12, 312e12),
    ("L4", "L4", 300e9, 121e12),
    ("RTX 4090", "RTX 4090", 1.008e12, 165.2e12),
    ("TPU v4", "TPU v4", 1.2e12, 275e12),
    ("TPU v5 lite", "TPU v5e", 819e9, 197e12),
    ("TPU v5e", "TPU v5e", 819e9, 197e12),
    ("TPU v5p", "TPU v5p", 2.765e12, 459e12),
    ("TPU v5", "TPU v5p", 2.765e12, 459e12),
    ("TPU v6 lite", "TPU v6e", 1.638e12, 918e12),
    ("TPU v6e", "TPU v6e", 1.638e12, 918e12),
)


def published_peaks(device_kind: str) -> Peaks | None:
    """The published peaks of a device_kind (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    for needle, name, bandwidth, flops in _PUBLISHED:
        if needle.lower() in device_kind.lower():
            return Peaks(name, bandwidth, flops, "published")
    return None


def measure_cpu_peaks(mib: int = 256, repeats: int = 5) -> Peaks:
    """A CPU's limits as measured here: the best of `repeats` jitted sums over a float32 array
    of `mib` MiB (a streaming read, larger than the caches) and of a 1024^3 float32 matmul."""
    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    x = jnp.ones((mib << 18,), jnp.float32)
    read = best(jax.jit(jnp.sum), x)
    a = jnp.ones((1024, 1024), jnp.float32)
    matmul = best(jax.jit(jnp.matmul), a, a)
    return Peaks("CPU", x.nbytes / read, 2 * 1024 ** 3 / matmul, "measured")


def device_peaks(device) -> Peaks | None:
    """Published peaks of an accelerator, measured ones of a CPU, None for an unknown chip."""
    if device.platform == "cpu":
        return measure_cpu_peaks()
    return published_peaks(device.device_kind)


XLA_DEFAULT_FRACTION = 0.75  # XLA's GPU allocator takes this share when no variable says


def mem_fraction(override: float | None, env=os.environ) -> tuple[float, str]:
    """(share of a GPU's memory XLA's allocator takes, where that share comes from)."""
    if override is not None:
        if not 0 < override <= 1:
            raise UsageError(f"--mem-fraction {override} must be in (0, 1]")
        return override, "--mem-fraction"
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        if env.get(name):
            return float(env[name]), f"{name}={env[name]}"
    return XLA_DEFAULT_FRACTION, "XLA's default; XLA_CLIENT_MEM_FRACTION is unset"


def device_memory(devices, override_gib: float | None = None,
                  fraction: float | None = None) -> tuple[int | None, str]:
    """(bytes per device a run may use, how that figure was found): the override (a card's
    memory) times the allocator's fraction, the allocator's limit the device reports, the
    chip's known HBM, or for a CPU the memory available now (`host_memory`); None when none of
    these is known."""
    if override_gib is not None:
        share, source = mem_fraction(fraction)
        return int(override_gib * share * GIB), f"{share:.2f} x {override_gib:.2f} GiB, {source}"
    import jax

    try:
        stats = devices[0].memory_stats()
    except jax.errors.JaxRuntimeError:  # compile-only topology devices have no live statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "the allocator's limit the device reports"
    if devices[0].platform == "cpu":
        return host_memory(), "the host memory available now"
    gib = DEVICE_MEMORY_GIB.get(devices[0].device_kind)
    if gib is None:
        return None, "the device reports none; pass --device-memory"
    return int(gib * GIB), f"usable HBM of a {devices[0].device_kind} chip"


def host_memory() -> int:
    """Bytes of host memory available to a new allocation: Linux's MemAvailable (free memory
    plus what the kernel can reclaim), else the machine's physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compiled_peak(compiled) -> int:
    """Per-device peak bytes of a compiled program by XLA's memory analysis: arguments +
    outputs - aliased (donated) buffers + temporaries."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
