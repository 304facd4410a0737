"""Run untrusted Python in a separate, limited, disposable process; never raise.

Every run gets a private temporary directory (its working directory, HOME and TMPDIR, removed
afterwards), an empty environment (PATH, HOME, TMPDIR, LANG only: no API keys), a wall-clock
limit enforced by the parent, RLIMIT_CPU / AS / FSIZE / NOFILE / NPROC and no core files set by a
trusted first stage (`sandbox_child.py`) before the untrusted code runs, an output cap (the
parent reads at most `output_bytes` from the pipes, then kills the run), and an audit hook that
refuses sockets and ctypes.

Isolation `namespace` (chosen when `unshare`, `setpriv` and `mount` work here; probed once per
process) adds, through util-linux: new network (no interfaces but a downed loopback: no
network), PID (the run cannot see or signal anything outside; killing its first process kills
all of it, however it forked or re-parented), mount and IPC namespaces; inside, /tmp is the
private directory, /var/tmp and /dev/shm are small fresh tmpfs, every other mount is remounted
read-only, and /proc shows only the run's processes. The code then runs without capabilities
and without new privileges, and, when the trainer is root, as a fresh unprivileged uid (so
RLIMIT_NPROC binds: the kernel never enforces it on root; a Python install under a directory
that uid cannot enter, such as /root, is bind-mounted read-only at the same path). As non-root
the namespaces are made inside a user namespace and RLIMIT_NPROC counts the user's existing
tasks plus the limit.

Isolation `process` (the fallback, logged once) has no namespaces: the child runs in its own
session, which is killed; the audit hook then also refuses forking, exec, signals and /proc.
An audit hook lives inside the interpreter it guards, so this fallback stops accidents and
casual escapes, not a determined attacker. Neither mode limits disk bandwidth, and neither
defends against kernel exploits.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")
ISOLATIONS = ("auto", "namespace", "process")


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits: wall clock and CPU seconds, address space, processes (tasks), bytes per
    written file, bytes of stdout + stderr, open files."""
    wall_s: float = 5.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    file_size_mb: int = 16
    output_bytes: int = 1 << 16
    max_open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """What a run did. status: ok (ran to the end; per-input `outputs` are {"ok": JSON text} or
    {"error": text}), error (the source raised or defined no entry point), timeout, output_limit,
    crashed (died without a result: os._exit, a signal), sandbox_error (could not be run)."""
    status: str
    outputs: tuple[dict, ...] = ()
    error: str = ""
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    duration_s: float = 0.0
    isolation: str = ""
    uid: int | None = None  # the fresh uid the run had (namespace mode as root)


def run_python(source: str, entry_point: str | None = None, inputs: tuple = (),
               limits: SandboxLimits = SandboxLimits(), isolation: str = "auto") -> SandboxResult:
    """Run `source`; when `entry_point` is given, call it once per input (each a JSON value
    passed as the single argument) and return each output as JSON text. Never raises."""
    start = time.monotonic()
    try:
        mode = available_isolation() if isolation == "auto" else isolation
        if mode not in ISOLATIONS[1:]:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}; got {isolation!r}")
        job = {"source": source, "entry_point": entry_point,
               "inputs": [json.dumps(x) for x in inputs]}
        result = _run(job, limits, mode)
    except Exception as error:  # the trainer must never see a sandbox exception
        result = SandboxResult("sandbox_error", error=f"{type(error).__name__}: {error}")
    return replace(result, duration_s=time.monotonic() - start)


@functools.cache
def available_isolation() -> str:
    """`namespace` when this host can run the namespace sandbox (probed once), else `process`."""
    if sys.platform != "linux" or not all(map(shutil.which, ("unshare", "setpriv", "mount"))):
        log.warning("sandbox: util-linux unshare/setpriv/mount not found; untrusted code runs "
                    "without network or PID isolation (resource limits and an audit hook only)")
        return "process"
    probe = _run({"source": "pass", "entry_point": None, "inputs": []},
                 SandboxLimits(wall_s=20), "namespace")
    if probe.status == "ok":
        return "namespace"
    log.warning("sandbox: Linux namespaces are unavailable here (%s); untrusted code runs without "
                "network or PID isolation (resource limits and an audit hook only)",
                (probe.error or probe.stderr).strip()[-300:])
    return "process"


def _run(job: dict, limits: SandboxLimits, mode: str) -> SandboxResult:
    root = os.geteuid() == 0
    uid = _fresh_uid() if root and mode == "namespace" else None
    # RLIMIT_NPROC counts all tasks of the real uid: a fresh uid has none; root is exempt.
    nproc = limits.max_processes if root else _user_tasks(os.getuid()) + limits.max_processes
    job = {**job, "cpu_s": max(1, math.ceil(limits.cpu_s)), "memory_mb": limits.memory_mb,
           "file_size_mb": limits.file_size_mb, "max_open_files": limits.max_open_files,
           "nproc": nproc, "strict": mode == "process"}
    workdir = Path(tempfile.mkdtemp(prefix="jaxrl-sandbox-"))
    try:
        (workdir / ".job.json").write_text(json.dumps(job), encoding="utf-8")
        os.chmod(workdir / ".job.json", 0o644)
        if uid is not None:
            os.chown(workdir, uid, uid)
        proc = _launch(workdir, mode, uid)
        try:
            reason, out, err = _pump(proc, time.monotonic() + limits.wall_s, limits.output_bytes)
        finally:
            _kill(proc, mode)
        return _result(workdir, reason, out, err, proc.returncode, mode, uid)
    finally:
        _remove(workdir)


def _fresh_uid() -> int:
    """An unused uid above the range distributions hand out, unique to this run."""
    return (1 << 20) + secrets.randbelow(1 << 29)


def _user_tasks(uid: int) -> int:
    """How many tasks (threads count: RLIMIT_NPROC counts them) `uid` runs now."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines()
                          if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


# Runs as root of the new namespaces: private /tmp, fresh /var/tmp and /dev/shm, the Python
# install exposed when its path crosses a directory the sandbox uid cannot enter ($4: that
# directory, $5: the prefix), everything else read-only, then the harness without privileges.
_PREAMBLE = r"""set -e
mount --bind "$1" /tmp
for d in /var/tmp /dev/shm; do
  if [ -d "$d" ]; then mount -t tmpfs -o size=1m,mode=1777 tmpfs "$d"; fi
done
if [ -n "$4" ]; then
  mkdir /tmp/.prefix
  mount --bind -o ro "$5" /tmp/.prefix
  mount -t tmpfs -o size=64k,mode=755 tmpfs "$4"
  mkdir -p "$5"
  mount --move /tmp/.prefix "$5"
  rmdir /tmp/.prefix
fi
while read -r _ _ _ _ m _; do
  case "$m" in
    /tmp|/var/tmp|/dev/shm|/proc|/proc/*|/dev|/dev/*|/sys|/sys/*) ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null || true ;;
  esac
done < /proc/self/mountinfo
cd /tmp
set +e
setpriv $6 -- "$2" -I -S -c "$3"
exit $?
"""


def _blocked_ancestor(prefix: str, uid: int | None) -> str:
    """The first directory above `prefix` that others cannot enter ('' when none or no uid)."""
    if uid is None:
        return ""
    path = Path(prefix)
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
            return str(parent)
    return ""


def _launch(workdir: Path, mode: str, uid: int | None) -> subprocess.Popen:
    python = os.path.realpath(sys.executable)
    home = "/tmp" if mode == "namespace" else str(workdir)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
           "LANG": "C.UTF-8"}
    # The run dies with the thread that started it (a killed reward worker leaves nothing).
    argv = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
    if mode == "namespace":
        prefix = os.path.realpath(sys.base_prefix)
        drop = "--bounding-set=-all --inh-caps=-all --no-new-privs"
        if uid is not None:
            drop = f"--reuid={uid} --regid={uid} --clear-groups {drop}"
        argv += ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
                 "--mount-proc"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
        argv += ["--", "/bin/sh", "-c", _PREAMBLE, "sh", str(workdir), python, _CHILD,
                 _blocked_ancestor(prefix, uid), prefix, drop]
    else:
        argv += [python, "-I", "-S", "-c", _CHILD]
    return subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True)


def _pump(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[str | None, bytes, bytes]:
    """Read stdout and stderr until both close, the run ends, the deadline passes ("timeout")
    or more than `cap` bytes arrive ("output_limit")."""
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    total, reason = 0, None
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "timeout"
                break
            events = sel.select(min(remaining, 0.1))
            for key, _ in events:
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                    total += len(data)
                else:
                    sel.unregister(key.fd)
            if total > cap:
                reason = "output_limit"
                break
            if not events and proc.poll() is not None:
                break  # the run ended; whatever still holds a pipe is killed next
    out, err = (b"".join(chunks[fd])[:cap] for fd in chunks)
    return reason, out, err


def _kill(proc: subprocess.Popen, mode: str) -> None:
    """Kill the run and reap it. In namespace mode the namespace's first process goes first and
    `unshare` reaps it, which the kernel completes only once every process of the namespace is
    gone; then the session is killed (all of the run, in process mode)."""
    if mode == "namespace":
        for pid in _children(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # already gone
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # killed with the session below
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass  # already gone
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _result(workdir: Path, reason: str | None, out: bytes, err: bytes, returncode: int,
            mode: str, uid: int | None) -> SandboxResult:
    common = {"stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
              "returncode": returncode, "isolation": mode, "uid": uid}
    if reason == "timeout":
        return SandboxResult("timeout", error="wall-clock limit reached", **common)
    if reason == "output_limit":
        return SandboxResult("output_limit", error="output limit reached", **common)
    result = _read_result(workdir / ".result.json")
    if result is None:
        return SandboxResult("crashed", error=_exit_reason(returncode), **common)
    outputs = tuple(o for o in result.get("outputs", ()) if isinstance(o, dict))
    return SandboxResult(result["status"], outputs, str(result.get("error", "")), **common)


def _read_result(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            result = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return None
    ok = isinstance(result, dict) and result.get("status") in ("ok", "error")
    return result if ok else None


def _exit_reason(returncode: int) -> str:
    """How a run that left no result ended (shells report a signal N as 128 + N)."""
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if number:
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            pass
    return f"exited with code {returncode} before finishing"


def _remove(path: Path) -> None:
    def writable_then_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=writable_then_retry)
    if path.exists():
        log.warning("sandbox: could not remove %s", path)
