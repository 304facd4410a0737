"""jaxrl.backends.cpu_memory: when the jaxrl command keeps freed host memory (on the CPU unless
turned off), and that a program's second call then faults in no fresh pages for its temporaries."""
import subprocess
import sys

import pytest

from jaxrl.backends import cpu_memory

# A program with a 64 MiB temporary (above glibc's largest mmap threshold, 32 MiB), called
# six times; prints the fewest minor page faults of a call after the first two (the fewest, so
# that another process busy beside this one, as under pytest-xdist, does not decide it).
SCRIPT = """
import resource, sys
if sys.argv[1] == "keep":
    from jaxrl.backends.cpu_memory import keep_freed_memory
    assert keep_freed_memory()
import jax, jax.numpy as jnp
x, w = jnp.ones((256, 64)), jnp.ones((64, 65536))
f = jax.jit(lambda x, w: jnp.sum(jnp.exp(x @ w), axis=0))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[2:]))
"""


@pytest.mark.parametrize("platforms, plugins, cpu", [
    ("", [], True), ("cpu", ["xla_cuda12"], True), (" CPU,cuda", [], True),
    ("", ["xla_cuda12"], False), ("", ["libtpu"], False), ("cuda,cpu", [], False),
    ("tpu", [], False)])
def test_the_cpu_is_the_platform_jax_will_take(platforms, plugins, cpu):
    assert cpu_memory.runs_on_cpu(platforms, plugins) is cpu


def test_it_is_on_for_the_cpu_unless_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.delenv(cpu_memory.ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cpu_memory.keep_freed_memory_on_cpu() and calls == [1]
    monkeypatch.setenv(cpu_memory.ENV, "1")
    assert cpu_memory.keep_freed_memory_on_cpu() and calls == [1, 1]
    monkeypatch.setenv(cpu_memory.ENV, "0")
    assert not cpu_memory.keep_freed_memory_on_cpu()
    monkeypatch.delenv(cpu_memory.ENV)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not cpu_memory.keep_freed_memory_on_cpu()
    assert calls == [1, 1]


@pytest.mark.skipif(cpu_memory._glibc() is None, reason="glibc's malloc only")
def test_a_second_call_reuses_the_freed_temporaries():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                             text=True, check=True, env={"JAX_PLATFORMS": "cpu",
                                                         "PATH": "/usr/bin:/bin"})
        return int(out.stdout.split()[-1])
    default, kept = faults("default"), faults("keep")
    assert default > 64 * 2**20 // 4096 // 2  # at least half the temporary faulted in again
    assert kept < default // 10
