"""Two processes on 127.0.0.1 with 4 CPU devices each, joined by jax.distributed, run two GRPO
steps equal to one process: on a data-parallel mesh, where each process holds its own rows,
and on meshes whose tensor axis spans both processes' devices, where they hold the same rows."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.sharding.grpo_run import grpo_steps, mesh_rules

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(tmp_path: Path, *meshes: str) -> dict:
    """{mesh: result} of `tests.sharding.grpo_run` run by two processes of 4 CPU devices."""
    port, out = _free_port(), tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.grpo_run", str(i), "2",
                               str(port), str(out), *meshes], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


def assert_same_run(multi: dict, single: dict) -> None:
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for target, ab in single["lora"]["layers"].items():
        for name, value in ab.items():
            np.testing.assert_allclose(multi["lora"]["layers"][target][name], value,
                                       rtol=1e-5, atol=1e-5, err_msg=f"{target}.{name}")


@pytest.mark.slow
def test_processes_match_one_process(tmp_path):
    """(data 8): each process holds its own rows, against one process on one device; (data 1,
    tensor 8): both processes hold all rows; (data 2, tensor 4): one block each. The last two
    against one process over the same mesh of 8 devices. One pair of processes runs all three."""
    meshes = ("-1,1,1", "1,1,8", "2,1,4")
    multi = two_processes(tmp_path, *meshes)
    assert_same_run(multi["-1,1,1"], grpo_steps(None))
    for mesh in meshes[1:]:
        assert_same_run(multi[mesh], grpo_steps(mesh_rules(mesh)))
