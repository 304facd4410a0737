"""The one place that knows the backend.

`jaxrl.backends.numerics` holds the numerics value (`Numerics`): chosen once from the platform
the programs run on (`numerics_of` a mesh, or the TPU topology `jaxrl plan` compiles for) and
passed into every jitted program as a static argument, as `ModelSpec` is. The model, sampler,
trainer and adapters ask it for each backend form and never read the backend themselves.
`cpu` holds the CPU's own forms, `cpu_memory` the CPU allocator setting (importable before
JAX, for the `jaxrl` command's start). Importing this package imports nothing heavy.
"""
