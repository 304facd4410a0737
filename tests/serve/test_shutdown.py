"""`jaxrl serve` in its own process: SIGTERM (like a first Ctrl-C) lets a stream in flight
finish and exits 0; a second Ctrl-C exits at once, without a traceback."""
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

FLAGS = ["--slots", "4", "--max-model-len", "256", "--chunk", "4"]
NO_EOS = {"0": -100, "2": -100}  # the default tokenizer's EOS ids: replies run to max_tokens


def _start(model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", "--model",
                             str(model_dir), "--port", "0", *FLAGS],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if match := re.search(r"at (http://\S+) ", line):
            return proc, match.group(1), lines
    raise AssertionError("the server did not start:\n" + "".join(lines))


def _stream(url, model, max_tokens, n=1):
    """The lines of a streamed completion, as they arrive."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": max_tokens, "n": n,
                       "stream": True, "temperature": 1.0, "logit_bias": NO_EOS}).encode()
    request = urllib.request.Request(url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            if line.strip():
                yield line.decode().strip()


@pytest.mark.slow
def test_sigterm_drains_and_a_second_ctrl_c_exits_at_once(tiny_chat):
    model_dir, model = tiny_chat[0], tiny_chat[0].name
    proc, url, _ = _start(model_dir)
    lines = _stream(url, model, 200)
    first = next(lines)
    proc.send_signal(signal.SIGTERM)
    rest = list(lines)
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    tokens = [json.loads(x[6:])["choices"][0] for x in [first, *rest[:-1]]]
    assert tokens[-1]["finish_reason"] == "length"
    assert proc.wait(60) == 0
    err = proc.stderr.read()
    assert "Traceback" not in err and "finishing in-flight requests" in err

    proc, url, _ = _start(model_dir)
    started = threading.Event()

    def ask():
        try:
            for _ in _stream(url, model, 240, n=64):  # 16 rounds of the 4 slots
                started.set()
        except OSError:
            pass  # the server went away mid-stream, as it was told to

    threading.Thread(target=ask, daemon=True).start()
    assert started.wait(60)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:  # signals sent at once would arrive as one
        if "finishing in-flight requests" in line:
            break
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 130
    err = proc.stderr.read()
    assert "Traceback" not in err and "stopped at once" in err
