"""`jaxrl model info`: what a model is, read from its config and safetensors headers only."""
from __future__ import annotations

from collections import Counter

import numpy as np

from jaxrl.hf.default_model import resolve_model_path
from jaxrl.hf.load import shard_files
from jaxrl.hf.safetensors_io import DTYPES, read_header
from jaxrl.model.families import load_spec
from jaxrl.model.params import count_params


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


def describe(path: str) -> str:
    model_dir = resolve_model_path(path)
    spec = load_spec(model_dir)
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
    return "\n".join(f"{k:<16} {v}" for k, v in rows)
