"""`jaxrl model info`: what a model is, read from its config and safetensors headers only."""
from __future__ import annotations

import math
from collections import Counter

import jax.numpy as jnp
import numpy as np

from jaxrl.config import QuantConfig
from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.keymap import check_keys
from jaxrl.hf.load import checkpoint_keys, shard_files
from jaxrl.hf.safetensors_io import DTYPES, read_header
from jaxrl.model.families import load_spec
from jaxrl.model.params import count_params, declare, flatten
from jaxrl.quant.nf4 import nbytes
from jaxrl.quant.qparams import abstract_quantized_params, quantized_paths, resident_bytes


def checkpoint_dtypes(model_dir) -> Counter:
    """Parameter count per stored dtype, e.g. Counter({'bfloat16': 4022468096})."""
    counts: Counter = Counter()
    for shard in shard_files(model_dir):
        for info in read_header(shard).values():
            n = 1
            for d in info["shape"]:
                n *= d
            counts[np.dtype(DTYPES[info["dtype"]]).name] += n
    return counts


def memory_rows(spec, quant: QuantConfig, dtype: str) -> list[tuple[str, str]]:
    """Resident bytes with linear kernels quantized by `quant`, from shapes alone."""
    abstract = abstract_quantized_params(spec, quant, jnp.dtype(dtype))
    flat = flatten(abstract)
    qpaths = quantized_paths(spec, quant)
    decls = declare(spec)
    n_quant = sum(math.prod(decls[p].shape) for p in qpaths)
    q_bytes = sum(nbytes(flat[p]) for p in qpaths)
    total = resident_bytes(abstract)
    label = f"{quant.mode}, block {quant.block_size}" + (", double quant" if quant.double_quant else "")
    rows = [("resident bytes", f"{total:,} ({total / 2**30:.2f} GiB; {label}, rest {dtype})")]
    if n_quant:
        rows.append(("quantized", f"{n_quant:,} params in {len(qpaths)} kernels, "
                                  f"{q_bytes / n_quant:.4f} bytes/param"))
    return rows


def describe(path: str, quant: QuantConfig | None = None, dtype: str = "bfloat16") -> str:
    model_dir = resolve_model_path(path)
    spec = load_spec(model_dir)
    check_keys(spec, checkpoint_keys(model_dir))  # refuse what loading the model would refuse
    dtypes = checkpoint_dtypes(model_dir)
    rope = "default" if spec.rope_scaling is None else f"llama3 x{spec.rope_scaling.factor:g}"
    rows = [
        ("path", str(model_dir)),
        ("family", spec.family),
        ("layers", spec.num_layers),
        ("hidden size", spec.hidden_size),
        ("mlp size", spec.intermediate_size),
        ("heads (q / kv)", f"{spec.num_heads} / {spec.num_kv_heads}, head dim {spec.head_dim}"),
        ("vocabulary", spec.vocab_size),
        ("tied embeddings", spec.tie_word_embeddings),
        ("rope", f"theta {spec.rope_theta:g}, {rope}"),
        ("parameters", f"{count_params(spec):,}"),
        ("dtype", ", ".join(f"{k} ({v:,})" for k, v in dtypes.most_common())),
    ]
    if quant is not None:
        rows += memory_rows(spec, quant, dtype)
    return "\n".join(f"{k:<16} {v}" for k, v in rows)
