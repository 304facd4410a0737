"""Hand-written CPU kernels that XLA calls as FFI custom calls (jaxrl/kernels/cpu.py)."""
