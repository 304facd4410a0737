"""Several LoRA adapters over one base, for a batch whose rows each pick one.

`AdapterSet(loras)` holds N adapters; a row's adapter index is 0 for the base alone and i for
loras[i - 1]. `for_rows(index)` turns the set and the rows' indices [B] into one `Lora` in its
rows form (`Lora.rows`): for each linear that any adapter targets, the adapters' A [L, in, r_i]
side by side as A [L, in, sum r_i] and their B likewise along the rank (an adapter that does
not target a linear gives zero blocks there), and per row a scale for every rank column, its
adapter's alpha / r in that adapter's columns and 0 in the others. The forward then computes
((x @ A) * rows) @ B: each row gets exactly its own adapter's scaled x @ A (the other columns
are exact zeros, so they add exactly nothing), and a base row gets an exact zero.

The indices are data: a new mix of adapters in a batch compiles nothing; the set's members
(their count, ranks, targets and scales) are the program's shape. It is a sampling form: the
programs that train differentiate one `Lora`.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl.lora.lora import Lora
from jaxrl.model.params import LINEAR_NAMES


@struct.dataclass
class AdapterSet:
    """N adapters for rows that each pick one (module docstring); index 0 is the base."""

    loras: tuple[Lora, ...]

    @classmethod
    def of(cls, loras: Sequence[Lora]) -> "AdapterSet":
        loras = tuple(loras)
        if not loras:
            raise ValueError("an adapter set holds at least one adapter")
        if any(not isinstance(lora, Lora) or lora.rows is not None for lora in loras):
            raise ValueError("an adapter set holds plain adapters (jaxrl.lora.lora.Lora)")
        return cls(loras=loras)

    def __len__(self) -> int:
        return len(self.loras)

    @property
    def targets(self) -> tuple[str, ...]:
        """The linears any member adapts, in the model's order."""
        named = {t for lora in self.loras for t in lora.targets}
        return tuple(t for t in LINEAR_NAMES if t in named)

    def column_scales(self) -> np.ndarray:
        """[N + 1, sum r_i] float32: row i the scale of each rank column for adapter index i
        (row 0, the base, all zeros)."""
        ranks = [lora.rank for lora in self.loras]
        table = np.zeros((len(self) + 1, sum(ranks)), np.float32)
        start = 0
        for i, (lora, r) in enumerate(zip(self.loras, ranks), 1):
            table[i, start:start + r] = lora.scale
            start += r
        return table

    def for_rows(self, index: jax.Array) -> Lora:
        """One `Lora` in its rows form for rows whose adapter indices are index [B] (int, 0:
        the base alone); an index outside [0, N] counts as the base."""
        layers = {}
        for target in self.targets:
            like = next(lora.weights["layers"][target] for lora in self.loras
                        if target in lora.targets)
            dtype = jnp.result_type(*(lora.weights["layers"][target]["a"].dtype
                                      for lora in self.loras if target in lora.targets))
            (n, fan_in, _), fan_out = like["a"].shape, like["b"].shape[-1]
            a_parts, b_parts = [], []
            for lora in self.loras:
                ab = lora.weights["layers"].get(target)
                if ab is None:
                    ab = {"a": jnp.zeros((n, fan_in, lora.rank), dtype),
                          "b": jnp.zeros((n, lora.rank, fan_out), dtype)}
                a_parts.append(ab["a"].astype(dtype))
                b_parts.append(ab["b"].astype(dtype))
            layers[target] = {"a": jnp.concatenate(a_parts, axis=-1),
                              "b": jnp.concatenate(b_parts, axis=-2)}
        table = jnp.asarray(self.column_scales())
        index = jnp.asarray(index, jnp.int32)
        known = (index >= 0) & (index <= len(self))
        rows = jnp.where(known[:, None], table[jnp.clip(index, 0, len(self))], 0.0)
        return Lora(weights={"layers": layers}, scale=1.0, rows=rows)
