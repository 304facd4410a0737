"""Scripted models for the agent tests: a chat client over a reply function, an investigator that
knows the case's fault (so the plumbing can be checked on a run that should succeed), and an
OpenAI-compatible HTTP server over any reply function."""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jaxrl.agents.chat import ChatReply


class ScriptedChat:
    """A ChatClient whose reply is `respond(messages)`; records every chat."""
    name = "scripted"

    def __init__(self, respond):
        self.respond, self.chats = respond, []

    def chat(self, messages, max_tokens):
        self.chats.append(list(messages))
        text = self.respond(messages)
        return ChatReply(text, sum(len(m["content"].split()) for m in messages),
                         min(max_tokens, len(text.split())))


def _ids(section: str) -> list[str]:
    return re.findall(r"^(H\d+) \(confidence", section, flags=re.MULTILINE)


class Investigator:
    """Replies as an operator who knows the fault: the true category and cause lead, the right
    tools are asked, findings quote the first line of each output. `fabricate` makes findings
    quote text that no output holds."""

    def __init__(self, case, tools: list[tuple[str, str]], fabricate: bool = False):
        self.case, self.tools, self.fabricate = case, tools, fabricate
        self.component = case.gold.component

    def _true(self, label: str) -> bool:
        return self.case.gold.coarse in label or self.case.gold.fine in label

    def __call__(self, messages) -> str:
        prompt = messages[1]["content"]
        if "candidate fault categories" in prompt:
            return json.dumps({"hypotheses": [
                {"label": f"{self.case.gold.coarse} on {self.component}", "confidence": 0.5,
                 "rationale": "alerts", "explains": ["S1"]},
                {"label": f"network on {self.component}", "confidence": 0.4}]})
        if "Choose up to" in prompt:
            return json.dumps({"calls": [{"expert": "LinuxOperator", "task": "check the host",
                                          "hypothesis": _ids(prompt.split("Candidates")[1])[0]}]})
        if "Choose the next tool" in prompt:
            done = prompt.split("Already seen:")[1].count(":\n")
            if done >= len(self.tools):
                return '{"done": true}'
            tool, target = self.tools[done]
            return f'Checking.\n```json\n{{"tool": "{tool}", "target": "{target}"}}\n```'
        if "For each output" in prompt:
            return self._findings(prompt)
        if "Revise the confidence" in prompt:
            labels = dict(re.findall(r"^(H\d+) \[hypothesis.*?\] (.*)$", prompt, flags=re.MULTILINE))
            return json.dumps({"confidence": {h: 0.9 if self._true(label) else 0.2
                                              for h, label in labels.items()},
                               "decision": "report"})
        if "specific root causes" in prompt:
            return json.dumps({"hypotheses": [
                {"label": f"{self.case.gold.fine} on {self.component}", "confidence": 0.6},
                {"label": f"something else on {self.component}", "confidence": 0.3}]})
        raise AssertionError(f"unscripted prompt: {prompt[:200]}")

    def _findings(self, prompt: str) -> str:
        hypotheses, outputs = prompt.split("Tool outputs you retrieved:")
        labels = dict(re.findall(r"^(H\d+) \(confidence .*?\): (.*)$", hypotheses, flags=re.MULTILINE))
        target = max((h for h, label in labels.items() if self._true(label)),
                     key=lambda h: int(h[1:]))
        firsts = re.findall(r"^O\d+ \(.*?\):\n(.*)$", outputs, flags=re.MULTILINE)
        return json.dumps({"findings": [
            {"hypothesis": target, "relation": "support", "claim": "shows the fault",
             "quote": "Connection refused by upstream" if self.fabricate else line}
            for line in firsts]})


class ChatServer:
    """An OpenAI-compatible /v1/chat/completions (and /v1/models) on 127.0.0.1 over
    `respond(messages)`; use as a context manager."""

    def __init__(self, respond):
        self.respond, self.requests = respond, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": "scripted", "object": "model",
                                                        "created": 0, "owned_by": "tests"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                        "body": body})
                text = server.respond(body["messages"])
                self._send({"id": "c", "object": "chat.completion", "created": 0,
                            "model": body["model"], "choices": [{
                                "index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": text}}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                      "total_tokens": 15}})

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
