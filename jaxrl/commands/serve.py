"""`jaxrl serve --model PATH [--adapter DIR] [--host 127.0.0.1] [--port 8000] ...`: an
OpenAI-compatible server over the jitted sampler."""
from __future__ import annotations

import ipaddress
import os
import sys

from jaxrl.config import DTYPES, QUANT_MODES


def register(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model (and a PEFT adapter) over the OpenAI API",
        description="Serve /v1/models, /v1/chat/completions and /v1/completions as the OpenAI "
        "API defines them (temperature, top_p, max_tokens, stop, n, seed, logprobs; usage "
        "counts), plus GET /health. Concurrent requests are batched into the sampler; malformed "
        "requests get 400, and 503 when more than --max-queue requests wait. Binds to "
        "127.0.0.1 unless --host says otherwise. Stop with Ctrl-C.")
    serve.add_argument("--model", required=True, metavar="PATH",
                       help="local HF directory, hub id, or `default`")
    serve.add_argument("--adapter", default=None, metavar="DIR",
                       help="PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name requests give (default: the model directory's name)")
    serve.add_argument("--api-key-env", default=None, metavar="VAR",
                       help="require `Authorization: Bearer KEY`, KEY read from this environment "
                       "variable (default: no key)")
    serve.add_argument("--max-batch-rows", type=int, default=64,
                       help="rows (prompts x n) per sampler call, also the largest n (default 64)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests that may wait for the next batch before 503 (default 64)")
    serve.add_argument("--default-max-tokens", type=int, default=512,
                       help="chat completions without max_tokens (default 512)")
    serve.add_argument("--seed", type=int, default=0, help="seed of unseeded sampled requests")
    serve.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="dtype of the unquantized params (default float32)")
    serve.add_argument("--quant", choices=QUANT_MODES, default="none",
                       help="quantize linear kernels while loading (default none)")
    serve.set_defaults(func=_serve)


def _options(args) -> dict:
    """The ServeOptions fields of the flags; a bad value is a UsageError naming its flag."""
    from jaxrl.commands import UsageError

    for flag in ("max_batch_rows", "max_queue", "default_max_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535]; got {args.port}")
    api_key = ""
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            raise UsageError(f"--api-key-env {args.api_key_env}: that environment variable is "
                             "not set or empty")
    return {"model_id": args.served_model_name, "max_batch_rows": args.max_batch_rows,
            "max_queue": args.max_queue, "default_max_tokens": args.default_max_tokens,
            "api_key": api_key, "seed": args.seed}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _serve(args) -> int:
    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.serve import start_server

    options = _options(args)
    model = load_pretrained(args.model, args.adapter, dtype=args.dtype, quant=args.quant)
    try:
        handle = start_server(model, args.host, args.port, **options)
    except OSError as error:
        from jaxrl.commands import UsageError
        raise UsageError(f"--host {args.host} --port {args.port}: cannot bind: "
                         f"{error.strerror or error}") from None
    if not _is_loopback(args.host) and not options["api_key"]:
        print(f"jaxrl serve: warning: listening on {args.host} without an API key; anyone who "
              "can reach it can use the model (see --api-key-env)", file=sys.stderr)
    print(f"jaxrl serve: {handle.model_id} at {handle.url} (Ctrl-C stops)", file=sys.stderr)
    try:
        handle.wait()
    except KeyboardInterrupt:
        print("jaxrl serve: stopping", file=sys.stderr)
    finally:
        handle.close()
    return 0
