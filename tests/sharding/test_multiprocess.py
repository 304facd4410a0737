"""Two processes on 127.0.0.1 with 4 CPU devices each, joined by jax.distributed, run two GRPO
steps equal to one process on one device."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.sharding.grpo_run import grpo_steps

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    port, out = _free_port(), tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.grpo_run", str(i), "2",
                               str(port), str(out)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    single = grpo_steps(None)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    multi = json.loads(out.read_text())
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for target, ab in single["lora"]["layers"].items():
        for name, value in ab.items():
            np.testing.assert_allclose(multi["lora"]["layers"][target][name], value,
                                       rtol=1e-5, atol=1e-5, err_msg=f"{target}.{name}")
