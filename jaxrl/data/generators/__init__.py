"""Procedural task generators (deterministic by seed). Importing this package registers the
built-in ones; `generate(name, n, seed)` makes records of any registered task."""
from jaxrl.data.generators import (  # noqa: F401
    abduction_rules,
    arithmetic,
    calculator,
    crypto,
    diagnosis,
    knk,
    list_fn,
    zebra,
)
from jaxrl.data.generators.registry import (
    DIFFICULTIES,
    GENERATORS,
    PLANNED,
    GeneratorError,
    generate,
    get_generator,
    register,
)

__all__ = ["DIFFICULTIES", "GENERATORS", "PLANNED", "GeneratorError", "generate",
           "get_generator", "register"]
