"""The CPU's allocator setting: keep the memory a program call frees for the next call.

XLA:CPU allocates each call's temporary buffer with malloc and frees it when the call ends.
glibc serves a large allocation (above its mmap threshold, or one that a worker thread's arena
cannot hold) with a fresh `mmap` and hands it back with `munmap` on free, so every call faults
its pages in again, one zeroed 4 KiB page at a time. `keep_freed_memory()` tells glibc's malloc
(`mallopt`) to serve every thread from the main arena, never to use mmap for an allocation, and
never to trim the heap: a freed buffer stays in the process and the next call of the same
program reuses its pages without a fault. The price is that the process keeps the most it ever
held at once. What this gains and costs is measured in docs/benchmarks.md, "Host memory kept
between calls".

The `jaxrl` command calls it at start when JAX will run on the CPU (no accelerator plugin
installed, or JAX_PLATFORMS naming cpu first) and glibc is the C library, before JAX starts its
threads, unless JAXRL_KEEP_FREED_MEMORY=0 (which leaves glibc's default). Code that drives jaxrl
from Python can call it itself, before its first JAX computation. This module imports no JAX,
so the command can call it before anything starts JAX; the CPU's numeric forms are
`jaxrl.backends.cpu`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil

ENV = "JAXRL_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def _glibc():
    """The process's C library when it is glibc, else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def accelerator_plugins() -> list[str]:
    """The JAX accelerator plugins installed (CUDA, ROCm, TPU), found without starting JAX."""
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    if importlib.util.find_spec("libtpu") is not None:
        names.append("libtpu")
    return sorted(set(names))


def runs_on_cpu(platforms: str | None = None, plugins: list[str] | None = None) -> bool:
    """Whether JAX's default backend will be the CPU: JAX_PLATFORMS (`platforms`) names cpu
    first, or it is unset and no accelerator plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "") if platforms is None else platforms
    first = platforms.split(",")[0].strip().lower()
    if first:
        return first == "cpu"
    return not (accelerator_plugins() if plugins is None else plugins)


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory in the process (module docstring); True when it
    did, False where the C library is not glibc or refused a setting."""
    libc = _glibc()
    if libc is None:
        return False
    # one arena for all threads, no mmap'd chunks, no trimming (-1: never)
    return all(libc.mallopt(param, value) == 1
               for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))


def keep_freed_memory_on_cpu() -> bool:
    """`keep_freed_memory()` when JAX will run on the CPU, unless JAXRL_KEEP_FREED_MEMORY is 0;
    True when it applied."""
    if os.environ.get(ENV, "1").strip() == "0" or not runs_on_cpu():
        return False
    return keep_freed_memory()
