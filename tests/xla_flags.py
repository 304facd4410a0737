"""XLA_FLAGS for the suite's processes (imports no jax).

XLA:CPU's LLVM backend runs without its expensive optimizations: the suite compiles a few hundred
small programs and runs each a few times, so on a cold compilation cache (CI) compiling is most
of its time. The programs compute the same values either way (no fast-math in either)."""


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a process of `devices` fake CPU devices."""
    return (f"--xla_force_host_platform_device_count={devices} "
            "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
