"""CPU kernels for the sampler's decode loop, called from XLA as FFI custom calls (source:
cpu_kernels.cc). The sampler's unrolled CPU loop uses both for bf16 weights, and the attention
alone for fp32 weights when asked (`jaxrl.sampling.sampler`, kernels="cpu"); measurements in
docs/benchmarks.md.

`matmul`: x (bf16) @ a kernel packed by `pack_kernel`, on Intel AMX tiles, products accumulated
in float32 as `jaxrl.model.transformer.linear` asks of XLA (only the summation order differs).
XLA:CPU multiplies a few bf16 rows by a bf16 kernel far below memory speed: a decode step of the
default model's matmuls takes ~31 / 32 / 39 ms at batch 1 / 8 / 32, against ~16 / 18 / 26 ms
here (`python tools/bench_decode_floor.py` times both). The sampler packs the kernels once per
params (`jaxrl.sampling.sampler.pack_params`).

`decode_attention`: one new token per row: writes its key and value into the cache layer in
place and attends over the slots filled so far (keys stored [B, K, D, S]), where XLA's batched
dots read every slot of the cache. The cache may be bf16 (the sampler's, for bf16 weights: keys
and values are computed in bf16, so it is lossless and half the bytes to read), which XLA:CPU
cannot update without converting the whole cache each step; scores and softmax are float32.

The C++ source is compiled on first use with the system's C++ compiler against jaxlib's FFI
headers, into $JAXRL_CACHE/kernels (one build per source, jaxlib version and CPU), then loaded
and registered with XLA. `available()` is False, and callers keep XLA's ops, where the CPU lacks
AMX-BF16, Linux refuses the tile state, no compiler is found, the build fails, or
JAXRL_CPU_KERNELS=0 is set; the reason is logged once.
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

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
TARGETS = {"jaxrl_bf16_matmul": "JaxrlBf16Matmul",
           "jaxrl_decode_attention_f32": "JaxrlDecodeAttentionF32",
           "jaxrl_decode_attention_bf16": "JaxrlDecodeAttentionBF16"}
ATTENTION_HEAD_DIMS = (64, 128)  # head dims decode_attention takes
PANEL = 64  # output columns per packed panel
K_MULTIPLE = 32  # the kernel consumes K in steps of 32
COMPILE_FLAGS = ("-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-std=c++17", "-shared",
                 "-fPIC", "-w")


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
    return jax.ffi.ffi_call("jaxrl_bf16_matmul", out)(x, w.packed)


def attention_supported(kt: jax.Array) -> bool:
    """Whether `decode_attention` takes a cache layer with keys kt [B, K, D, S]."""
    return (kt.dtype in (jnp.float32, jnp.bfloat16) and kt.shape[2] in ATTENTION_HEAD_DIMS
            and kt.shape[3] % 16 == 0)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_kt: jax.Array,
                     cache_v: jax.Array, mask: jax.Array, pos: jax.Array):
    """One decode step of attention: the new token's k, v [B, K, D] are written at slot pos of
    the cache layer (keys cache_kt [B, K, D, S], values cache_v [B, K, S, D], float32 or bf16;
    updated in place), then q [B, H, D] attends over slots [0, pos] where mask [B, S] allows
    (True = may attend; each row must be allowed slot pos). Returns (out [B, H, D] float32,
    cache_kt, cache_v). D in ATTENTION_HEAD_DIMS, S a multiple of 16."""
    dtype = cache_kt.dtype
    target = "jaxrl_decode_attention_" + ("bf16" if dtype == jnp.bfloat16 else "f32")
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
              jax.ShapeDtypeStruct(cache_kt.shape, dtype),
              jax.ShapeDtypeStruct(cache_v.shape, dtype))
    call = jax.ffi.ffi_call(target, shapes, input_output_aliases={3: 1, 4: 2})
    return call(q.astype(jnp.float32), k.astype(dtype), v.astype(dtype), cache_kt, cache_v,
                mask, pos.astype(jnp.int32))


def _build_dir() -> Path:
    from jaxrl.hf.default_model import cache_root
    return cache_root() / "kernels"


def _library_path(compiler: str) -> Path:
    import jaxlib
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (jaxlib.__version__, compiler, *COMPILE_FLAGS, _cpu_flags()):  # native: per CPU
        digest.update(part.encode())
    return _build_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


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
        cmd = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
               str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, out)  # atomic: concurrent processes never load half a library


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the kernels are built, loaded and registered for this process (see module)."""
    reason = _unavailable_reason()
    if reason:
        log.info("jaxrl's CPU kernels not used: %s", reason)
    return not reason


def _unavailable_reason() -> str:
    if os.environ.get("JAXRL_CPU_KERNELS", "1") == "0":
        return "JAXRL_CPU_KERNELS=0"
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
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return ""
