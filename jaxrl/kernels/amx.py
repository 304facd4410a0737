"""bf16 matmuls on Intel AMX tiles for the CPU decode loop (kernel: bf16_matmul.cc).

XLA:CPU multiplies a few rows of bf16 activations by a bf16 kernel far below memory speed: one
decode step of the default model's matmuls takes ~31 ms at batch 1 and ~35 ms at batch 8,
against ~18 and ~20 ms for this kernel (`python tools/bench_decode_floor.py`, which times both;
figures in docs/benchmarks.md). The sampler uses it for bf16 weights in its unrolled CPU loop.

The kernel reads weights in a packed layout (`pack_kernel`, done once per `generate` call before
the decode loop) and accumulates bf16 products in float32, as `jaxrl.model.transformer.linear`
asks of XLA; only the summation order differs.

The C++ source is compiled on first use with the system's C++ compiler against jaxlib's FFI
headers, into $JAXRL_CACHE/kernels (one build per source, jaxlib version and CPU), then loaded
and registered with XLA. `available()` is False, and callers keep XLA's dot, where the CPU lacks
AMX-BF16, Linux refuses the tile state, no compiler is found, the build fails, or
JAXRL_AMX=0 is set; the reason is logged once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import struct

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_matmul.cc")
TARGET = "jaxrl_bf16_matmul"
PANEL = 64  # output columns per packed panel
K_MULTIPLE = 32  # the kernel consumes K in steps of 32


@struct.dataclass
class PackedKernel:
    """A [K, N] bf16 kernel in the kernel's layout: [N/64, K/2, 64, 2], K and N zero-padded."""

    packed: jax.Array
    n: int = struct.field(pytree_node=False)  # output columns before padding


def pack_kernel(w: jax.Array) -> PackedKernel:
    """PackedKernel of w [K, N] (any float dtype; stored as bf16)."""
    k, n = w.shape
    w = jnp.pad(w.astype(jnp.bfloat16), ((0, -k % K_MULTIPLE), (0, -n % PANEL)))
    pairs, panels = w.shape[0] // 2, w.shape[1] // PANEL
    return PackedKernel(packed=w.reshape(pairs, 2, panels, PANEL).transpose(2, 0, 3, 1), n=n)


def matmul(x: jax.Array, w: PackedKernel) -> jax.Array:
    """x [..., K] @ the packed kernel, in float32 [..., N]; x is cast to bf16."""
    x = x.astype(jnp.bfloat16)
    k = 2 * w.packed.shape[1]
    if x.shape[-1] != k:  # K was padded to a multiple of 32
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - x.shape[-1])])
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.n,), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, w.packed)


def _build_dir() -> Path:
    from jaxrl.hf.default_model import cache_root
    return cache_root() / "kernels"


def _library_path(compiler: str) -> Path:
    import jaxlib
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (jaxlib.__version__, compiler, _cpu_flags()):  # -march=native: per CPU
        digest.update(part.encode())
    return _build_dir() / f"bf16_matmul-{digest.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """The first "flags" line of /proc/cpuinfo ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _compile(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-std=c++17",
               "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
               str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, out)  # atomic: concurrent processes never load half a library


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the AMX kernel is built, loaded and registered for this process (see module)."""
    reason = _unavailable_reason()
    if reason:
        log.info("AMX bf16 matmul kernel not used: %s", reason)
    return not reason


def _unavailable_reason() -> str:
    if os.environ.get("JAXRL_AMX", "1") == "0":
        return "JAXRL_AMX=0"
    if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "include_dir"):
        return "this jax has no jax.ffi (0.4.38 or later has)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    flags = _cpu_flags().split()
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        return "the CPU lacks AMX-BF16"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        return "no C++ compiler (g++ or clang++, or $CXX)"
    path = _library_path(compiler)
    try:
        if not path.exists():
            _compile(compiler, path)
        lib = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, RuntimeError) as err:
        return f"could not build or load the kernel: {err}"
    if lib.jaxrl_amx_ready() != 1:
        return "Linux did not grant this process the AMX tile state"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxrlBf16Matmul), platform="cpu")
    return ""
