"""Architectures of popular checkpoints, as their public config.json files give them, so that
`jaxrl plan` can compile for a model without its weights or hub access.

A preset is found by the last part of a model path, case-insensitively: `Qwen/Qwen3-8B`,
`/models/Qwen3-8B` (when it holds no config.json) and `qwen3-8b` all name `qwen3-8b.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
PRESETS = tuple(sorted(p.stem for p in HERE.glob("*.json")))


def preset_config(path: str) -> dict | None:
    """The config.json of the preset `path` names, or None."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    file = HERE / f"{name}.json"
    return json.loads(file.read_text()) if name in PRESETS else None
