"""Starting and stopping the server: uvicorn serving the ASGI app (app.py) on its own thread,
beside the engine thread (scheduler.py) and the prompt workers (prepare.py).

`start_server` binds the socket first (a taken port raises OSError before any thread starts)
and returns once uvicorn accepts connections. `ServerHandle.drain()` is uvicorn's graceful
shutdown: no new connections, in-flight requests (streams included) run to their end, then the
server thread ends; `close()` drains, then stops the engine thread. Signals are the caller's
to handle (`jaxrl serve` drains on the first SIGINT or SIGTERM), as uvicorn handles them only
on the main thread.
"""
from __future__ import annotations

import copy
import dataclasses
import socket
import threading
import time
from collections.abc import Mapping

import uvicorn

from jaxrl.backends.numerics import numerics_of
from jaxrl.hf.pretrained import Pretrained
from jaxrl.lora.lora import Lora
from jaxrl.sampling.engine import Engine
from jaxrl.serve.app import Api, build_app
from jaxrl.serve.observe import Metrics
from jaxrl.serve.prepare import Preparer
from jaxrl.serve.scheduler import Counts, Scheduler
from jaxrl.serve.scoring import PromptScorer


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    model_id: str
    slots: int = 16  # decode slots: completions decoded together
    max_model_len: int = 2048  # cache columns per slot: prompt + completion, within the model's
    chunk: int = 8  # decode steps between admissions of waiting requests
    max_queue: int = 256  # requests left waiting for a slot (none free) before 503
    default_max_tokens: int = 512  # chat completions without max_tokens (within the context)
    api_key: str = dataclasses.field(default="", repr=False)  # "": no key required
    seed: int = 0  # of the keys unseeded sampled requests draw from
    body_timeout_s: float = 30.0  # a request body must arrive within this
    workers: int = 2  # threads that parse, render and tokenize prompts
    # a longer prompt is prefilled this many tokens a step, between decode steps (0: whole)
    prefill_chunk: int | None = None  # None: the backend's (`Numerics.prefill_piece`)
    warmup: bool = False  # compile the programs before /health says ok (module docstring)


class ServerHandle:
    """A running server: `url` is its OpenAI base URL (ending in /v1), `model_id` the base
    model's name and `models` every served model id; `close()` (or leaving a `with` block)
    stops it after in-flight requests finish."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, scheduler: Scheduler,
                 api: Api, model_id: str):
        self._server, self._scheduler, self._api = server, scheduler, api
        self.model_id, self.models = model_id, scheduler.models
        self.host, self.port = sock.getsockname()[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}/v1"
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name="jaxrl-serve-http", daemon=True)
        self._thread.start()
        while not server.started and self._thread.is_alive():
            time.sleep(0.01)
        if not server.started:
            scheduler.close()
            raise RuntimeError("the HTTP server did not start; see the log above")

    @property
    def counts(self) -> Counts:
        return self._scheduler.counts

    def drain(self) -> None:
        """Stop accepting connections; in-flight requests finish (module docstring)."""
        self._server.should_exit = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the HTTP server to end (after `drain`); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self.drain()
        self.wait()
        self._scheduler.close()
        self._api.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=256)
    sock.setblocking(False)
    return sock


def warm(engine: Engine) -> None:
    """Compile what requests will run: a prefill of every power-of-two prompt width up to the
    engine's prefill piece (or its context), greedy and sampled, the decode chunk of each, and
    the `extend` pass of every piece width of a prompt in pieces, by decoding such requests
    (two tokens each). A request's n needs nothing more: the engine fills its slots in one
    shape however many arrive together."""
    from jaxrl.sampling.buckets import bucket
    from jaxrl.sampling.requests import Request
    from jaxrl.sampling.sampling_fns import Decoding

    context = engine.capacity - 1
    longest = min(engine.prefill_chunk or context, context - 1)
    widths = sorted({min(1 << i, longest) for i in range(bucket(longest).bit_length())})
    rounds = [(w, d) for w in widths for d in (Decoding(0.0), Decoding(1.0))]
    if engine.prefill_chunk and engine.prefill_chunk < context - 1:
        rounds += [(engine.prefill_chunk + w, Decoding(0.0)) for w in widths
                   if engine.prefill_chunk + w < context]
    for width, decoding in rounds:
        engine.submit(Request([1] * width, decoding, 2))
        engine.run()


def start_server(model: Pretrained, host: str = "127.0.0.1", port: int = 8000, *,
                 model_id: str | None = None, adapters: Mapping[str, Lora] | None = None,
                 **options) -> ServerHandle:
    """Serve `model` (from `jaxrl.hf.pretrained.load_pretrained`, with its adapter if it has
    one) as `model_id` (default: the model directory's name) and each of `adapters` (served
    model id -> LoRA over the same base) on host:port (port 0: any free port); requests for
    all of them decode in one batch (jaxrl/serve/scheduler.py). The other keywords are
    `ServeOptions` fields."""
    opts = ServeOptions(model_id=model_id or model.path.name, **options)
    models = {opts.model_id: model.lora, **(adapters or {})}
    if len(models) != 1 + len(adapters or {}):
        raise ValueError(f"an adapter is named {opts.model_id!r}, like the base model; give "
                         "it another name")
    sock = _bind(host, port)
    context = min(opts.max_model_len, model.spec.max_position_embeddings)
    metrics = Metrics()
    scheduler = Scheduler(
        lambda: Engine(model.params, model.spec, eos_ids=model.eos_ids, slots=opts.slots,
                       capacity=context, chunk=opts.chunk,
                       prefill_chunk=min(numerics_of(None).prefill_piece
                                         if opts.prefill_chunk is None else opts.prefill_chunk,
                                         context - 1)),
        models, opts.max_queue, on_change=metrics.engine,
        scorer=PromptScorer(model.params, model.spec, numerics_of(None)),
        warmup=warm if opts.warmup else None)
    preparer = Preparer(model.tokenizer, list(models), model.spec.vocab_size, context,
                        opts.default_max_tokens, opts.seed, eos_ids=model.eos_ids)
    api = Api(scheduler, preparer, copy.deepcopy(model.tokenizer), metrics, opts.api_key,
              opts.body_timeout_s, opts.workers)
    config = uvicorn.Config(build_app(api, metrics), log_config=None, access_log=False,
                            lifespan="off", server_header=False)
    return ServerHandle(uvicorn.Server(config), sock, scheduler, api, opts.model_id)
