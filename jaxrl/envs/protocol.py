"""The environment protocol of multi-turn training: an episode is the policy's replies and the
environment's answers, turn by turn.

    env = make_env(name, cfg.env, syntax)     one instance per episode
    messages = env.reset(record)              the opening chat messages
    turn = env.step(reply_text)               Turn(messages, done, info)
    env.episode()                             the episode as JSON, for the rewards

A reply that calls tools (in the chat template's tool-call markup, `jaxrl.hf.tool_calls`) gets
one message per call back (role "tool": the tool's output, or what was wrong with the call);
a reply whose markup does not parse gets a tool message saying so; a reply without calls is
the episode's conclusion and ends it. The environment ends the episode at `env.max_turns`
replies; the rollout (jaxrl/rl/episodes.py) counts tokens and cuts the trajectory at
`env.max_tokens`, which it records in the episode.

Tools are OpenAI function definitions (`tools`). A chat template with tool markup renders them
itself (`apply_chat_template(tools=...)`); for one without (SmolLM2's), `reset` describes them in
the system message, one line each, with the Hermes-style `<tool_call>` markup that replies must
then use and an example call of the environment's. `env.first_tool_choice` (required or a
tool's name) has the rollout open the first reply with the markup, as tool_choice does;
`env.demonstration` shows one worked episode (task, call, output, conclusion) before the task.

Host side; nothing here imports jax.
"""
from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from jaxrl.config import EnvConfig
from jaxrl.hf.tool_calls import ToolCall, ToolSyntax

HERMES = ToolSyntax("qwen")  # the markup described to models whose template renders no tools


class ToolError(ValueError):
    """A call the environment cannot run (unknown tool, missing or wrong arguments); its message
    goes back to the policy as the tool's answer."""


class EpisodeError(ValueError):
    """A record the environment cannot play; the message names what it needs."""


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """A worked episode an opening can show before the task (env.demonstration): a task, one
    call {"name", "arguments"}, its output and the concluding reply."""

    task: str
    call: dict
    output: str
    conclusion: str


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to one reply: messages to append (none once done), whether the
    episode is over, and what the reply did (calls made, valid calls, why it ended)."""

    messages: list[dict]
    done: bool
    info: dict


def function(name: str, description: str, parameters: Mapping[str, str],
             required: tuple[str, ...] | None = None) -> dict:
    """An OpenAI function tool whose parameters are strings described by `parameters`."""
    properties = {p: {"type": "string", "description": d} for p, d in parameters.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(parameters if required is None else required)}}}


def describe_tools(tools: list[dict], example: Mapping[str, Any]) -> str:
    """The tools, one line each, and the `<tool_call>` markup shown with `example` (a call
    {"name", "arguments"}), for a system message (templates that render no tools). Compact:
    a small model's prompt stays short."""
    lines = []
    for tool in tools:
        f = tool["function"]
        arguments = "; ".join(f"{name}: {p.get('description', p.get('type', ''))}"
                              for name, p in f["parameters"]["properties"].items())
        lines.append(f"- {f['name']}: {f['description']} (arguments: {arguments})")
    return ("Tools:\n" + "\n".join(lines) + "\nCall a tool with one JSON object inside "
            "<tool_call></tool_call>, for example:\n<tool_call>\n" + json.dumps(example)
            + "\n</tool_call>\nThe result comes back as the next message.")


class Environment(ABC):
    """One episode of an environment (module docstring). Subclasses give the tools, the opening
    messages, how a call runs and how a conclusion reads; this class keeps the turn count, the
    calls and the conclusion, and ends the episode."""

    name: ClassVar[str]
    outcome: ClassVar[str]  # the score component that is an episode's accuracy (jaxrl eval)
    example: ClassVar[dict]  # a call {"name", "arguments"} shown with the markup

    def __init__(self, cfg: EnvConfig, syntax: ToolSyntax | None):
        """syntax: the chat template's tool-call markup, None when it renders no tools."""
        self.cfg = cfg
        self.syntax = syntax or HERMES
        self.template_tools = syntax is not None
        self.turns = 0
        self.calls: list[dict] = []
        self.conclusion: dict | None = None
        self.finish: str | None = None

    @property
    @abstractmethod
    def tools(self) -> list[dict]:
        """OpenAI function definitions of this episode's tools."""

    @abstractmethod
    def opening(self, record: Mapping[str, Any]) -> tuple[str, list[dict]]:
        """(system instructions, task messages) of a record; EpisodeError if it cannot play it."""

    @abstractmethod
    def demonstration(self) -> Demonstration:
        """The worked episode env.demonstration shows (call after `opening`)."""

    @abstractmethod
    def run(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The output of a call; ToolError when it cannot run."""

    @abstractmethod
    def conclude(self, text: str) -> dict:
        """The conclusion a reply without calls states (JSON), for the rewards."""

    def reset(self, record: Mapping[str, Any]) -> list[dict]:
        """The opening messages: system (instructions, and the tools when the template renders
        none), the demonstration when env.demonstration, then the task."""
        system, task = self.opening(record)
        if not self.template_tools:
            system = system + "\n\n" + describe_tools(self.tools, self.example)
        shown = self._demonstrated() if self.cfg.demonstration else []
        return [{"role": "system", "content": system}, *shown, *task]

    def _demonstrated(self) -> list[dict]:
        """The demonstration as chat messages; its call as the template writes tool calls, or
        in the described markup when the template renders none."""
        demo = self.demonstration()
        if self.template_tools:
            call = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": demo.call}]}
        else:
            call = {"role": "assistant",
                    "content": f"<tool_call>\n{json.dumps(demo.call)}\n</tool_call>"}
        return [{"role": "user", "content": demo.task}, call,
                {"role": "tool", "content": demo.output},
                {"role": "assistant", "content": demo.conclusion}]

    def first_tool_choice(self) -> str | dict:
        """env.first_tool_choice as `ToolSyntax.forced_prefix` takes it; a name must be one of
        the tools (call after `reset`)."""
        choice = self.cfg.first_tool_choice
        if choice in ("auto", "required"):
            return choice
        names = [tool["function"]["name"] for tool in self.tools]
        if choice not in names:
            raise EpisodeError(f"env.first_tool_choice must be auto, required or one of the "
                               f"{self.name} tools ({', '.join(names)}); got {choice!r}")
        return {"function": {"name": choice}}

    def step(self, text: str) -> Turn:
        """The environment's answer to one reply (module docstring)."""
        self.turns += 1
        parsed = self.syntax.parse(text)
        if parsed is None and self.syntax.markup_start(text, 0) is not None:
            messages = [self._unreadable()]
        elif parsed is None:
            self.conclusion, self.finish = self.conclude(text), "answer"
            return Turn([], True, {"calls": 0, "valid_calls": 0, "finish": "answer"})
        else:
            messages = [self._call(call) for call in parsed[1]]
        made = len(messages)
        info = {"calls": made, "valid_calls": sum(c["valid"] for c in self.calls[-made:])}
        if self.turns >= self.cfg.max_turns:
            self.finish = "turn_limit"
            return Turn([], True, {**info, "finish": "turn_limit"})
        return Turn(messages, False, info)

    def _unreadable(self) -> dict:
        error = ("the tool call could not be read: write one JSON object "
                 '{"name": ..., "arguments": {...}} inside <tool_call></tool_call>'
                 if self.syntax.name == "qwen" else
                 'the tool call could not be read: write {"name": ..., "parameters": {...}}')
        self.calls.append({"name": None, "arguments": None, "valid": False, "output": error})
        return {"role": "tool", "content": error}

    def _call(self, call: ToolCall) -> dict:
        arguments = json.loads(call.arguments)
        try:
            output, valid = self.run(call.name, arguments), True
        except ToolError as error:
            output, valid = f"error: {error}", False
        self.calls.append({"name": call.name, "arguments": arguments, "valid": valid,
                           "output": output})
        return {"role": "tool", "content": output}

    def episode(self) -> dict:
        """The episode so far as JSON: turns, calls, conclusion and how it ended."""
        return {"env": self.name, "turns": self.turns, "calls": list(self.calls),
                "conclusion": self.conclusion, "finish": self.finish}
