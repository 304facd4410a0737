"""Hand-written CPU kernels that XLA calls as FFI custom calls (jaxrl/kernels/amx.py)."""
