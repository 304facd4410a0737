"""`jaxrl generate --model PATH [--adapter DIR] --prompt TEXT [--n N] [--temperature T]
[--max-new-tokens K] ...`: chat completions from the jitted sampler."""
from __future__ import annotations

import sys
import time

from jaxrl.config import DTYPES, QUANT_MODES, UsageError


def register(sub) -> None:
    gen = sub.add_parser(
        "generate", help="sample chat completions from a model (and a PEFT adapter)",
        description="Render --prompt (and --system) with the model's chat template, sample --n "
        "completions with the jitted sampler and print them to stdout (with a header per "
        "completion when --n > 1); a summary with tokens per second goes to stderr. Rows end on "
        "the model's EOS ids, a --stop string or --max-new-tokens.")
    gen.add_argument("--model", required=True, metavar="PATH",
                     help="local HF directory, hub id, or `default`")
    gen.add_argument("--adapter", default=None, metavar="DIR",
                     help="PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)")
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the user message")
    gen.add_argument("--system", default=None, metavar="TEXT", help="a system message")
    gen.add_argument("--n", type=int, default=1, help="completions to sample (default 1)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0 = off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="min-p ratio (default 0 = off)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable); the text ends right after it")
    gen.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    gen.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="dtype of the unquantized params (default float32)")
    gen.add_argument("--quant", choices=QUANT_MODES, default="none",
                     help="quantize linear kernels while loading (default none); on CPU they are then "
                     "dequantized once (faster there), on accelerators kept 4-bit")
    gen.set_defaults(func=_generate)


def _sampling_config(args):
    """The SamplingConfig of the flags; a bad value is a UsageError naming its flag."""
    from jaxrl.config import Config, ConfigError, SamplingConfig, validate

    if args.n < 1:
        raise UsageError(f"--n must be >= 1; got {args.n}")
    values = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))
    try:
        return validate(Config(sampling=SamplingConfig(**values))).sampling
    except ConfigError as e:
        message = str(e)
        for key in values:
            message = message.replace(f"config key 'sampling.{key}'",
                                      f"--{key.replace('_', '-')}")
        raise UsageError(message) from None


def _print(out, elapsed: float) -> None:
    n = len(out.finish_reasons)
    for i, (text, reason) in enumerate(zip(out.texts, out.finish_reasons)):
        if n > 1:
            print(f"=== completion {i + 1}/{n} ({reason}, {int(out.mask[i].sum())} tokens) ===")
        print(text)
    tokens = int(out.mask.sum())
    reasons = ", ".join(f"{r} {out.finish_reasons.count(r)}" for r in ("stop", "length")
                        if r in out.finish_reasons)
    print(f"jaxrl generate: {n} completion(s), {tokens} tokens in {elapsed:.1f} s "
          f"(compilation included); finish: {reasons}", file=sys.stderr)


def _generate(args) -> int:
    import jax

    from jaxrl.hf.pretrained import load_pretrained

    cfg = _sampling_config(args)
    model = load_pretrained(args.model, args.adapter, dtype=args.dtype, quant=args.quant)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    prompt = model.chat_ids(messages + [{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    out = model.sample([prompt] * args.n, jax.random.PRNGKey(args.seed), cfg)
    _print(out, time.perf_counter() - start)
    return 0
