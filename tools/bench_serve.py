"""`jaxrl serve` under load: time to first token and tokens per second for 1 client, 16
concurrent clients and a mixed workload (short and long requests together), for this
checkout's continuous-batching server and for the round-based server it replaced (commit
9f667f7: a round takes every waiting request, runs them as `Pretrained.sample` batches, and
requests that arrive meanwhile wait for the next round).

Each server runs as `python -m jaxrl.cli serve --model default` in its own process; the old one
from a `git archive` of 9f667f7 in a temporary directory (on PYTHONPATH). Clients are threads
using the `openai` client. The continuous server is asked to stream and a request's first
token is its first content chunk; the round-based server cannot stream, so its first token
arrives with the whole reply. Greedy decoding (the same replies from both servers, EOS ends a
reply), chat prompts from the arithmetic generator:
  single   1 client, 8 requests one after another, max_tokens 64
  16x      16 clients at once, 2 requests each, max_tokens 64
  mixed    16 clients at once, 2 requests each: 12 short (max_tokens 16) and 4 long
           ("write a long story", max_tokens 256)
Tokens per second: completion tokens of all requests / wall time of the scenario. Every
scenario runs once untimed first (compiles), then timed.

    python tools/bench_serve.py                      # both servers, one after the other
    python tools/bench_serve.py --servers continuous
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OLD = "9f667f7"
SCENARIOS = {"single": (1, 8, 0), "16x": (16, 2, 0), "mixed": (16, 2, 4)}  # clients, each, long
LONG = "Write a long story about a dragon who learns to count, with many details."


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["rounds", "continuous"],
                        choices=["rounds", "continuous"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=8)
    return parser.parse_args()


def _start(kind: str, args, old_dir: Path | None):
    """(process, base URL) of a server started from this checkout or the old one."""
    flags = ["--model", "default", "--port", "0", "--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=str(old_dir if kind == "rounds" else ROOT))
    if kind == "continuous":
        flags += ["--slots", str(args.slots), "--max-model-len", str(args.max_model_len),
                  "--chunk", str(args.chunk)]
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", *flags],
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=old_dir if kind == "rounds" else ROOT)
    for line in proc.stderr:
        if match := re.search(r"at (http://\S+) ", line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError(f"the {kind} server did not start")


def _prompts():
    from jaxrl.data.generators import generate as generate_records

    return [r["messages"] for r in generate_records("arithmetic", 64, seed=0)]


def _request(client, model, messages, max_tokens, stream):
    """(seconds to the first token, completion tokens) of one chat request."""
    start = time.perf_counter()
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                               max_tokens=max_tokens)
        return time.perf_counter() - start, reply.usage.completion_tokens
    first, usage = None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        usage = chunk.usage or usage
    return (first if first is not None else time.perf_counter() - start), \
        usage.completion_tokens


def _scenario(client, model, name, prompts, stream):
    """(first-token seconds of each short and long request, tokens, wall seconds)."""
    clients, each, long_clients = SCENARIOS[name]
    results = {"short": [], "long": []}
    lock = threading.Lock()

    def run(c):
        for i in range(each):
            is_long = c < long_clients
            messages = ([{"role": "user", "content": LONG}] if is_long
                        else prompts[(c * each + i) % len(prompts)])
            out = _request(client, model, messages, 256 if is_long else (
                16 if long_clients else 64), stream)
            with lock:
                results["long" if is_long else "short"].append(out)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(n for kind in results.values() for _, n in kind)
    return results, tokens, wall


def _bench(kind, args, old_dir, prompts):
    import openai

    proc, url = _start(kind, args, old_dir)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        rows = []
        for name in SCENARIOS:
            _scenario(client, model, name, prompts, kind == "continuous")  # compiles
            results, tokens, wall = _scenario(client, model, name, prompts,
                                              kind == "continuous")
            for size, res in results.items():
                if res:
                    ttft = np.asarray([t for t, _ in res])
                    rows.append((kind, name, size, len(res), float(np.median(ttft)),
                                 float(np.percentile(ttft, 90)), tokens, wall))
        return rows
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def main():
    args = _args()
    prompts = _prompts()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_dir = Path(tmp) / "old"
        if "rounds" in args.servers:
            old_dir.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old_dir)], input=archive, check=True)
        for kind in args.servers:
            rows += _bench(kind, args, old_dir, prompts)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.dtype}; continuous: --slots "
          f"{args.slots} --max-model-len {args.max_model_len} --chunk {args.chunk}")
    print("| server | scenario | requests | n | TTFT median (s) | TTFT p90 (s) | tokens | "
          "wall (s) | tok/s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, name, size, n, med, p90, tokens, wall in rows:
        print(f"| {kind} | {name} | {size} | {n} | {med:.2f} | {p90:.2f} | {tokens} | "
              f"{wall:.1f} | {tokens / wall:.1f} |")


if __name__ == "__main__":
    main()
