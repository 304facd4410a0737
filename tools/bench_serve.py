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

`--cases hangup,stop,prefill` times instead how soon a short request is served after slots
should have been freed, for this checkout's server (`continuous`) and for the continuous server
of an older commit (`base`, `--base`, default 23854b7: before cancelling and chunked prefill),
each with `--slots 16 --max-model-len 2048` (and `--prefill-chunk N` where given and the
server knows the flag; else its own default); non-streaming greedy chats, latency = the whole request:
  idle     a 4-token chat (and a 2-token chat) alone, median of --repeats
  hangup   16 streaming chats (a story, max_tokens 512) whose clients close after 3 events,
           then the 4-token chat
  stop     16 chats (the story, max_tokens 512) with a stop string the model emits after a few
           tokens (taken from its unconstrained reply), then the 4-token chat
  prefill  a ~1,990-token prompt (max_tokens 1), and 0.2 s later the 2-token chat
Each case repeats --repeats times (median and max reported); before each repeat the server is
idle again (/health: nothing running or waiting). A server that warms up (it knows
--no-warmup) is timed once /health says ok; one that does not runs each case once untimed first.

    python tools/bench_serve.py --cases hangup,stop,prefill --dtype float32 --base-repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OLD = "9f667f7"
BASE = "23854b7"  # continuous batching before cancelling, chunked prefill and warm-up
CASES = ("hangup", "stop", "prefill")
SCENARIOS = {"single": (1, 8, 0), "16x": (16, 2, 0), "mixed": (16, 2, 4)}  # clients, each, long
LONG = "Write a long story about a dragon who learns to count, with many details."


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=None,
                        choices=["rounds", "base", "continuous"],
                        help="default: rounds continuous; with --cases: continuous base")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default 512; with --cases 2048")
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--cases", default=None, metavar="LIST",
                        help="comma-separated of hangup, stop, prefill (module docstring)")
    parser.add_argument("--base", default=BASE, metavar="COMMIT",
                        help=f"the `base` server's commit (default {BASE})")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="passed to servers that know the flag (default: the server's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base-repeats", type=int, default=None,
                        help="repeats for the base server (default --repeats): its hang-up and "
                        "stop cases each wait for 16 replies of 512 tokens")
    args = parser.parse_args()
    if args.cases is not None:
        args.cases = [c for c in args.cases.split(",") if c]
        if unknown := set(args.cases) - set(CASES):
            parser.error(f"unknown cases {sorted(unknown)}; choose from {list(CASES)}")
    args.servers = args.servers or (["continuous", "base"] if args.cases else
                                     ["rounds", "continuous"])
    args.max_model_len = args.max_model_len or (2048 if args.cases else 512)
    return args


def _tree(kind: str, old_dir: Path | None) -> Path:
    return ROOT if kind == "continuous" else old_dir / kind


def _knows(tree: Path, flag: str) -> bool:
    """Whether `jaxrl serve --help` of the checkout at `tree` lists `flag`."""
    out = subprocess.run([sys.executable, "-m", "jaxrl.cli", "serve", "--help"], cwd=tree,
                         env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True,
                         text=True, check=True).stdout
    return flag in out


def _start(kind: str, args, old_dir: Path | None, extra=()):
    """(process, base URL) of a server started from this checkout or an old one."""
    flags = ["--model", "default", "--port", "0", "--dtype", args.dtype, *extra]
    tree = _tree(kind, old_dir)
    env = dict(os.environ, PYTHONPATH=str(tree))
    if kind != "rounds":
        flags += ["--slots", str(args.slots), "--max-model-len", str(args.max_model_len),
                  "--chunk", str(args.chunk)]
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", *flags],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tree)
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
            _scenario(client, model, name, prompts, kind != "rounds")  # compiles
            results, tokens, wall = _scenario(client, model, name, prompts, kind != "rounds")
            for size, res in results.items():
                if res:
                    ttft = np.asarray([t for t, _ in res])
                    rows.append((kind, name, size, len(res), float(np.median(ttft)),
                                 float(np.percentile(ttft, 90)), tokens, wall))
        return rows
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def _health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.load(r)


def _wait_health(url: str, idle: bool, limit: float = 1800.0) -> float:
    """Seconds until /health says ok (and, with `idle`, nothing running or waiting)."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        h = _health(url)
        if h["status"] == "ok" and (not idle or (h["running"] == 0 and h["waiting"] == 0)):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} was not {'idle' if idle else 'ok'} in {limit} s")


SHORT = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": LONG}]


def _chat(client, model, messages, max_tokens, **kw):
    """(seconds, completion tokens, text) of one greedy non-streaming chat."""
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=max_tokens, **kw)
    return (time.perf_counter() - start, reply.usage.completion_tokens,
            reply.choices[0].message.content, reply.usage.prompt_tokens)


def _long_prompt(target: int = 1990):
    """Chat messages whose rendered prompt is at most `target` tokens, as close as lines go."""
    from jaxrl.hf.default_model import default_model_dir
    from jaxrl.hf.tokenizer import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(default_model_dir())

    def messages(n, pad=0):
        body = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in
                        range(n))
        return [{"role": "user", "content": body + " dog" * pad + "\nHow many lines?"}]

    def size(n, pad=0):
        return len(chat_prompt_ids(tok, messages(n, pad)))

    lo, hi = 1, 400
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid - 1)
    pad = 0
    while size(lo, pad + 1) <= target:  # then words
        pad += 1
    return messages(lo, pad), size(lo, pad)


def _stop_string(client, model):
    """A stop string the story's greedy reply reaches after a few tokens: the text of its
    third streamed token (where that is its first occurrence), and the reply's start."""
    deltas = []
    for chunk in client.chat.completions.create(model=model, messages=STORY, temperature=0,
                                                max_tokens=12, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    text = "".join(deltas)
    for i in range(2, len(deltas)):
        stop = deltas[i].strip()
        if stop and text.find(stop) >= len("".join(deltas[:i])):
            return stop, text
    raise RuntimeError(f"no stop string found in the reply start {text!r}")


def _hangup(client, model, n=16, events=3):
    """16 streams that close after 3 events each."""
    def run():
        stream = client.chat.completions.create(model=model, messages=STORY, temperature=0,
                                                max_tokens=512, stream=True)
        for i, _ in enumerate(stream, 1):
            if i >= events:
                break
        stream.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _stops(client, model, stop, n=16):
    """16 chats ended by `stop`; their completion tokens."""
    out = []

    def run():
        out.append(_chat(client, model, STORY, 512, stop=[stop])[1])

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _prefill(client, model, long_messages):
    """(the 2-token chat's seconds, the long request's seconds and prompt tokens) when the
    2-token chat comes 0.2 s after the long prompt."""
    long_out = []
    thread = threading.Thread(
        target=lambda: long_out.append(_chat(client, model, long_messages, 1)))
    thread.start()
    time.sleep(0.2)
    short = _chat(client, model, SHORT, 2)[0]
    thread.join()
    return short, long_out[0][0], long_out[0][3]


def _cases(kind, args, old_dir, long_messages):
    """{case: [seconds of each timed repeat]} and notes, for one server."""
    import openai

    tree = _tree(kind, old_dir)
    extra = ["--prefill-chunk", str(args.prefill_chunk)] if (
        args.prefill_chunk is not None and _knows(tree, "--prefill-chunk")) \
        else []
    warms = _knows(tree, "--no-warmup")
    started = time.perf_counter()
    proc, url = _start(kind, args, old_dir, extra)
    notes = {"flags": " ".join(extra), "warmup": warms}
    try:
        _wait_health(url, idle=True)
        notes["ready_s"] = time.perf_counter() - started
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        stop, reply_start = _stop_string(client, model)
        notes["stop"], notes["reply_start"] = stop, reply_start
        _wait_health(url, idle=True)
        times = {"idle4": [], "idle2": [], **{c: [] for c in args.cases}}
        stop_tokens, long_info = [], []

        def once(timed):
            for case, seconds in times.items():
                _wait_health(url, idle=True)
                if case == "idle4":
                    t = _chat(client, model, SHORT, 4)[0]
                elif case == "idle2":
                    t = _chat(client, model, SHORT, 2)[0]
                elif case == "hangup":
                    _hangup(client, model)
                    t = _chat(client, model, SHORT, 4)[0]
                elif case == "stop":
                    tokens = _stops(client, model, stop)
                    t = _chat(client, model, SHORT, 4)[0]
                    if timed:
                        stop_tokens.extend(tokens)
                else:
                    t, long_s, long_tokens = _prefill(client, model, long_messages)
                    if timed:
                        long_info.append((long_s, long_tokens))
                if timed:
                    seconds.append(t)
                print(f"  {kind} {case}{'' if timed else ' (untimed)'}: {t:.2f} s",
                      file=sys.stderr, flush=True)

        if not warms:
            once(timed=False)  # compiles
        for _ in range(args.base_repeats if kind == "base" and args.base_repeats is not None
                       else args.repeats):
            once(timed=True)
        _wait_health(url, idle=True)
        notes["stop_tokens"] = sorted(set(stop_tokens))
        notes["long"] = long_info
        return times, notes
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _report_cases(args, results):
    print(f"load average {os.getloadavg()[0]:.1f}; --dtype {args.dtype} --slots {args.slots} "
          f"--max-model-len {args.max_model_len} --chunk {args.chunk}")
    for kind, (_, notes) in results.items():
        long_s = [s for s, _ in notes["long"]]
        print(f"{kind}: extra flags '{notes['flags']}', warms up: {notes['warmup']}, ready "
              f"after {notes['ready_s']:.0f} s; stop string {notes['stop']!r} (reply starts "
              f"{notes['reply_start']!r}); stop replies' completion tokens "
              f"{notes['stop_tokens']}; long prompt {sorted({n for _, n in notes['long']})} "
              f"tokens, its request {np.median(long_s) if long_s else float('nan'):.2f} s "
              f"(median)")
    print("| server | case | probe | n | median (s) | max (s) | idle median (s) | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, (times, _) in results.items():
        label = "this checkout" if kind == "continuous" else f"{kind} ({args.base})"
        for case, probe, idle in (("idle4", "4 tokens", "idle4"), ("hangup", "4 tokens", "idle4"),
                                  ("stop", "4 tokens", "idle4"), ("idle2", "2 tokens", "idle2"),
                                  ("prefill", "2 tokens", "idle2")):
            if case not in times:
                continue
            t, ref = np.asarray(times[case]), float(np.median(times[idle]))
            name = {"idle4": "idle", "idle2": "idle", "hangup": "after hang-up",
                    "stop": "after stop", "prefill": "during long prefill"}[case]
            print(f"| {label} | {name} | {probe} | {len(t)} | {np.median(t):.2f} | "
                  f"{t.max():.2f} | {ref:.2f} | {np.median(t) / ref:.2f}x |")


def main():
    args = _args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_dir = Path(tmp)
        for kind, commit in (("rounds", OLD), ("base", args.base)):
            if kind in args.servers:
                (old_dir / kind).mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit],
                                         capture_output=True, check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(old_dir / kind)], input=archive,
                               check=True)
        if args.cases:
            long_messages, _ = _long_prompt()
            results = {}
            for kind in args.servers:
                results[kind] = _cases(kind, args, old_dir, long_messages)
                _report_cases(args, results)  # so far
            return
        prompts = _prompts()
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
