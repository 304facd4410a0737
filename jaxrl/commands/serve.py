"""`jaxrl serve --model PATH [--adapter DIR] [--lora NAME=DIR ...] [--host 127.0.0.1]
[--port 8000] ...`: an OpenAI-compatible server over the decode engine."""
from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys

from jaxrl.config import DTYPES, QUANT_MODES, UsageError

_DESCRIPTION = """\
Serve /v1/models, /v1/chat/completions and /v1/completions as the OpenAI API defines them, plus
GET /health and GET /metrics (Prometheus). Requests join the decoding batch as slots free up
(continuous batching). Supported: stream (server-sent events; include_usage in stream_options),
n, seed, max_tokens, stop, temperature, top_p, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty, logit_bias, logprobs and top_logprobs (up to 20), echo on
completions (the prompt first, with logprobs its tokens' log-probs by a teacher-forced forward;
max_tokens 0 with echo: the prompt alone, as lm-evaluation-harness's log-likelihood tasks ask),
and tools / tool_choice (auto, none, required, a named function) for chat templates with Qwen's
<tool_call> or Llama 3.1's JSON tool calling, and structured output: response_format
(json_object, json_schema) and vLLM's guided_json, guided_regex, guided_choice and
guided_grammar (llguidance token masks; one token a step while constrained). Unknown request
fields are ignored with one warning per name. Each --lora adapter is served under its own model
id beside the base; requests for every model decode together in one batch, each row with its own
model's adapter. /metrics gauges follow every admission and completion; /health and /metrics are
not counted as requests; a client that leaves before its reply is done is logged and counted
with status 499. Binds to 127.0.0.1 unless --host says otherwise. Ctrl-C or SIGTERM stops
accepting requests, lets in-flight ones finish and exits 0; a second Ctrl-C exits at once."""


def register(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model (and PEFT adapters) over the OpenAI API",
                           description=_DESCRIPTION)
    serve.add_argument("--model", required=True, metavar="PATH",
                       help="local HF directory, hub id, or `default`")
    serve.add_argument("--adapter", default=None, metavar="DIR",
                       help="PEFT LoRA adapter applied to the served base model itself")
    serve.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                       help="serve the PEFT adapter in DIR as model NAME beside the base "
                       "(repeatable)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the base model's id in requests (default: the model directory's "
                       "name)")
    serve.add_argument("--api-key-env", default=None, metavar="VAR",
                       help="require `Authorization: Bearer KEY`, KEY read from this environment "
                       "variable (default: no key)")
    serve.add_argument("--slots", type=int, metavar="N", default=16,
                       help="decode slots: completions decoded together (default 16)")
    serve.add_argument("--max-model-len", type=int, metavar="N", default=2048,
                       help="tokens per slot, prompt plus completion (default 2048, at most the "
                       "model's context); every decode step reads this many cache columns")
    serve.add_argument("--chunk", type=int, metavar="N", default=8,
                       help="decode steps between admissions of waiting requests (default 8)")
    serve.add_argument("--prefill-chunk", type=int, metavar="N", default=None,
                       help="prefill a longer prompt N tokens a step, between decode steps, so "
                       "running requests keep their pace (default: 512 on GPUs and TPUs, 128 "
                       "on the CPU, where a piece takes longer; 0: whole prompts)")
    serve.add_argument("--no-warmup", action="store_true",
                       help="skip compiling the programs at start (/health says warming until "
                       "they are compiled; without it the first requests compile them)")
    serve.add_argument("--max-queue", type=int, metavar="N", default=256,
                       help="requests that may wait while every slot is taken before 503 "
                       "(default 256); requests that free slots take at once never count")
    serve.add_argument("--default-max-tokens", type=int, metavar="N", default=512,
                       help="chat completions without max_tokens (default 512)")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request body must arrive within this (default 30; else 408)")
    serve.add_argument("--seed", type=int, default=0, help="seed of unseeded sampled requests")
    serve.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="dtype of the unquantized params (default float32)")
    serve.add_argument("--quant", choices=QUANT_MODES, default="none",
                       help="quantize linear kernels while loading (default none)")
    serve.set_defaults(func=_serve)


def _loras(specs: list[str]) -> dict[str, str]:
    loras = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--lora takes NAME=DIR (a model id and a PEFT adapter directory); "
                             f"got {spec!r}")
        if name in loras:
            raise UsageError(f"--lora {name} is given twice; each adapter needs its own name")
        loras[name] = path
    return loras


def _options(args) -> dict:
    """The ServeOptions fields of the flags; a bad value is a UsageError naming its flag."""
    for flag in ("slots", "chunk", "max_queue", "default_max_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        raise UsageError(f"--prefill-chunk must be >= 0; got {args.prefill_chunk}")
    if args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2; got {args.max_model_len}")
    if not args.body_timeout > 0:
        raise UsageError(f"--body-timeout must be > 0 seconds; got {args.body_timeout}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535]; got {args.port}")
    api_key = ""
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            raise UsageError(f"--api-key-env {args.api_key_env}: that environment variable is "
                             "not set or empty")
    return {"model_id": args.served_model_name, "slots": args.slots,
            "max_model_len": args.max_model_len, "chunk": args.chunk,
            "max_queue": args.max_queue, "default_max_tokens": args.default_max_tokens,
            "api_key": api_key, "seed": args.seed, "body_timeout_s": args.body_timeout,
            "prefill_chunk": args.prefill_chunk, "warmup": not args.no_warmup}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _log_to_stderr() -> None:
    """The access log and the server's own messages, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    for name in ("jaxrl.serve", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _stop_on_signals(handle) -> None:
    """First SIGINT or SIGTERM: drain (in-flight requests finish); a second SIGINT: exit now."""
    signals = []

    def stop(signum, frame):
        signals.append(signum)
        if len(signals) > 1:
            print("jaxrl serve: stopped at once", file=sys.stderr, flush=True)
            os._exit(130)
        print("jaxrl serve: finishing in-flight requests (Ctrl-C again stops at once)",
              file=sys.stderr, flush=True)
        handle.drain()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _serve(args) -> int:
    from jaxrl.hf.peft_io import load_peft_adapter
    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.serve import start_server

    options, loras = _options(args), _loras(args.lora)
    model = load_pretrained(args.model, args.adapter, dtype=args.dtype, quant=args.quant)
    adapters = {name: load_peft_adapter(path, model.spec) for name, path in loras.items()}
    _log_to_stderr()
    try:
        handle = start_server(model, args.host, args.port, adapters=adapters, **options)
    except OSError as error:
        raise UsageError(f"--host {args.host} --port {args.port}: cannot bind: "
                         f"{error.strerror or error}") from None
    except ValueError as error:
        raise UsageError(f"--lora: {error}") from None
    if not _is_loopback(args.host) and not options["api_key"]:
        print(f"jaxrl serve: warning: listening on {args.host} without an API key; anyone who "
              "can reach it can use the model (see --api-key-env)", file=sys.stderr)
    print(f"jaxrl serve: {', '.join(handle.models)} at {handle.url} (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    _stop_on_signals(handle)
    while not handle.wait(0.5):
        pass
    handle.close()
    print("jaxrl serve: stopped", file=sys.stderr, flush=True)
    return 0
