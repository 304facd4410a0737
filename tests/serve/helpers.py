"""Helpers for the server tests: the options every test server uses and plain HTTP calls."""
import json
import urllib.error
import urllib.request

import openai

# every test server decodes with these, so the engine's programs compile once per process
SERVE = dict(slots=4, max_model_len=256, chunk=4)
HELLO = [{"role": "user", "content": "Hello there"}]


def client(handle, key="unused"):
    return openai.OpenAI(base_url=handle.url, api_key=key, max_retries=0, timeout=120)


def post(handle, path, payload=None, raw=None, headers=None):
    """(status, JSON reply) of a POST with `payload` (or raw bytes) as the body."""
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(handle.url + path, data=data,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(handle, path):
    """The text of GET `path` (relative to the server's root, not /v1)."""
    with urllib.request.urlopen(handle.url[:-3] + path, timeout=60) as reply:
        return reply.read().decode()
