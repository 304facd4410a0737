"""Hostile code in the sandbox: contained, scores 0, leaves nothing behind, the next run works."""
import socket
import tempfile
from pathlib import Path

import pytest

from jaxrl.rewards.correctness import PYTHON, VerifySettings, passed_tests
from jaxrl.rewards.sandbox import SandboxLimits, available_isolation, run_python

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1.0, memory_mb=256, max_processes=8,
                       output_bytes=4096, file_size_mb=1)
GOOD = "def transform(xs):\n    return [x * 2 for x in xs]\n"
RECORD = {"id": "sbx", "task": "list_fn", "answer": GOOD,
          "verifier": {"kind": "python", "entry_point": "transform",
                       "tests": [{"input": [1, 2], "output": [2, 4]},
                                 {"input": [], "output": []}]}}
SECRET = "jaxrl-sandbox-secret-5e1f"

ATTACKS = {
    "infinite_loop": "def transform(xs):\n    while True:\n        pass\n",
    "memory_bomb": "def transform(xs):\n    hog = []\n    while True:\n"
                   "        hog.append(bytearray(50 << 20))\n",
    "fork_storm": "import os\ndef transform(xs):\n    while True:\n        try:\n"
                  "            os.fork()\n        except OSError:\n            pass\n",
    "write_outside": "def transform(xs):\n    for path in {targets!r}:\n"
                     "        open(path, 'w').write('escaped')\n    return [x * 2 for x in xs]\n",
    "read_secret": "import os\ndef transform(xs):\n"
                   "    found = [os.environ.get('JAXRL_SECRET', '')]\n"
                   "    for pid in ('self', '1', str(os.getppid())):\n        try:\n"
                   "            found.append(open(f'/proc/{{pid}}/environ').read())\n"
                   "        except OSError:\n            pass\n"
                   "    print(found)\n    return found\n",
    "socket": "import socket\ndef transform(xs):\n"
              "    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
              "    return [x * 2 for x in xs]\n",
    "socket_in_new_python": "import subprocess, sys\ndef transform(xs):\n    code = 'import socket;"
                            " socket.create_connection((\"127.0.0.1\", {port}), timeout=1)'\n"
                            "    subprocess.run([sys.executable, '-c', code], check=True)\n"
                            "    return [x * 2 for x in xs]\n",
    "flood_stdout": "def transform(xs):\n    while True:\n        print('x' * 10000)\n",
    "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 8)\ndef transform(xs):\n"
                      "    def down(n):\n        return down(n + 1) + 1\n    return down(0)\n",
    "os_exit": "import os\ndef transform(xs):\n    os._exit(0)\n",
    "kill_parent": "import os, signal\ndef transform(xs):\n"
                   "    os.kill(os.getppid(), signal.SIGKILL)\n    return [x * 2 for x in xs]\n",
}
MODES = ["process"] + (["namespace"] if available_isolation() == "namespace" else [])


def _processes_of(uid):
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in lines):
            found.append(status.parent.name)
    return found


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        yield server


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_code_is_contained(attack, mode, tmp_path, monkeypatch, listener):
    monkeypatch.setenv("JAXRL_SECRET", SECRET)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    targets = [str(tmp_path / "escaped.txt"), "../escaped.txt", str(Path.cwd() / "escaped.txt")]
    source = ATTACKS[attack].format(targets=targets, port=listener.getsockname()[1])
    settings = VerifySettings(LIMITS, mode)

    tests = RECORD["verifier"]["tests"]
    run = run_python(source, "transform", tuple(t["input"] for t in tests), LIMITS, mode)

    assert not all(passed_tests(run, tests)), run  # scores 0
    assert run.status != "sandbox_error" and run.duration_s < LIMITS.wall_s + 3, run
    assert SECRET not in repr(run)
    assert not any(Path(t).exists() for t in targets[:1] + targets[2:])
    assert not (scratch.parent / "escaped.txt").exists()
    assert list(scratch.iterdir()) == []  # the private directory was removed
    if run.uid is not None:
        assert _processes_of(run.uid) == []
    with pytest.raises(socket.timeout):
        listener.accept()
    assert PYTHON.verify(GOOD, RECORD, settings).value == 1.0  # the next run works


@pytest.mark.parametrize("mode", MODES)
def test_runs_get_a_clean_private_environment(mode, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    source = ("import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(),"
              " 'files': sorted(os.listdir('.'))}))\nopen('scratch.txt', 'w').write('ok')\n")
    run = run_python(source, limits=LIMITS, isolation=mode)
    assert run.status == "ok", run
    assert SECRET not in run.stdout
    assert '"HOME": "' in run.stdout and "OPENAI_API_KEY" not in run.stdout
    assert run.isolation == mode


def test_outputs_errors_and_non_json_results_are_reported():
    source = ("def f(x):\n    if x == 0:\n        raise ValueError('zero')\n"
              "    return {1, 2} if x == 1 else x\n")
    run = run_python(source, "f", (0, 1, [3]), LIMITS)
    assert run.status == "ok"
    assert run.outputs[0] == {"error": "ValueError: zero"}
    assert "not JSON serializable" in run.outputs[1]["error"]
    assert run.outputs[2] == {"ok": "[3]"}
    assert run_python("def g(x): return x", "f", (1,), LIMITS).status == "error"
    assert run_python("syntax error here", "f", (1,), LIMITS).error.startswith("SyntaxError")


def test_a_file_over_the_size_limit_fails():
    source = "def f(x):\n    open('big', 'wb').write(b'0' * (2 << 20))\n    return x\n"
    run = run_python(source, "f", (1,), LIMITS)
    assert run.status == "ok" and "File too large" in run.outputs[0]["error"]


def test_bad_isolation_is_a_structured_error():
    run = run_python("pass", isolation="chroot")
    assert run.status == "sandbox_error" and "isolation must be one of" in run.error
