"""The trusted first stage of a sandboxed run; `sandbox.py` passes this file's text to
`python -I -S -c` inside the sandbox. Standard library only: the child sees no site-packages.

It reads `.job.json` from its working directory, lowers its resource limits, installs an audit
hook, runs the untrusted source, calls the entry point (if any) on each JSON input and writes
`.result.json`. Expected outputs never enter the sandbox (the parent compares), so untrusted
code that tampers with this harness can only lose points, never fake a pass.
"""
import json
import os
import resource
import sys

# Refused always: sockets (a second guard behind the network namespace) and ctypes (the easy way
# around an audit hook).
_ALWAYS = frozenset({"socket.__new__", "socket.connect", "socket.bind", "ctypes.dlopen",
                     "ctypes.dlsym", "ctypes.call_function"})
# Refused when no namespace isolates the child (strict mode): new processes, signals, /proc and
# changes to files outside the working directory. Bypassable in principle; see sandbox.py.
_STRICT = frozenset({"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                     "os.system", "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"})
_FS_CHANGES = frozenset({"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink",
                         "os.link", "os.chmod", "os.chown", "os.truncate", "os.utime",
                         "shutil.rmtree", "shutil.move", "shutil.copyfile"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_MODULES = frozenset({"ctypes", "_ctypes"})


def _limits(job: dict) -> None:
    mb = 1 << 20
    limits = [(resource.RLIMIT_AS, job["memory_mb"] * mb),
              (resource.RLIMIT_FSIZE, job["file_size_mb"] * mb),
              (resource.RLIMIT_NOFILE, job["max_open_files"]),
              (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NPROC, job["nproc"])]
    for res, value in limits:
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))


def _paths(args) -> list[str]:
    return [os.path.abspath(os.fsdecode(a)) for a in args
            if isinstance(a, (str, bytes, os.PathLike))]


def _outside(args, workdir: str) -> bool:
    return any(p != workdir and not p.startswith(workdir + os.sep) for p in _paths(args))


def _strict_refuses(event: str, args, workdir: str) -> bool:
    if event in _STRICT:
        return True
    if event == "open":
        writes = isinstance(args[2], int) and args[2] & _WRITE_FLAGS or "w" in str(args[1] or "")
        proc = any(p.startswith("/proc") for p in _paths(args[:1]))
        return proc or bool(writes) and _outside(args[:1], workdir)
    return event in _FS_CHANGES and _outside(args, workdir)


def _hook(strict: bool, workdir: str):
    def hook(event, args):
        if (event in _ALWAYS or (event == "import" and args[0] in _MODULES)
                or (strict and _strict_refuses(event, args, workdir))):
            raise PermissionError(f"sandbox: {event} is not allowed")
    return hook


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}"
    except BaseException:  # a hostile __str__
        text = "an exception that cannot be printed"
    return text[:500]


def _call(fn, text: str) -> dict:
    try:
        return {"ok": json.dumps(fn(json.loads(text)))}
    except BaseException as error:
        return {"error": _describe(error)}


def _run(job: dict) -> dict:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(job["source"], "<answer>", "exec"), namespace)
    except BaseException as error:
        return {"status": "error", "error": _describe(error)}
    entry = job["entry_point"]
    if entry is None:
        return {"status": "ok", "outputs": []}
    fn = namespace.get(entry)
    if not callable(fn):
        return {"status": "error", "error": f"the answer defines no function {entry!r}"}
    return {"status": "ok", "outputs": [_call(fn, text) for text in job["inputs"]]}


def main() -> None:
    with open(".job.json", encoding="utf-8") as f:
        job = json.load(f)
    out = open(".result.json", "w", encoding="utf-8")
    _limits(job)
    sys.addaudithook(_hook(job["strict"], os.getcwd()))
    result = _run(job)
    json.dump(result, out)
    out.close()


if __name__ == "__main__":
    main()
