"""Which batch rows each host holds, for meshes over devices that name their host, and the
layouts refused at start and by `jaxrl plan`."""
import dataclasses

import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl.planner import host_layout
from jaxrl.config import ConfigError, from_dict
from jaxrl.devices import device_memory, mem_fraction
from jaxrl.distributed import batch_shards, check_layout
from jaxrl.sharding import MESH_AXES, MeshRules


@dataclasses.dataclass(frozen=True)
class Chip:
    """Stands in for a device of another host: all the layout reads is its process index."""

    id: int
    process_index: int
    platform: str = "tpu"


def rules(shape, hosts_of_ids) -> MeshRules:
    """Rules over a mesh of `shape` whose device k (row-major) sits on host hosts_of_ids[k]."""
    chips = [Chip(k, host) for k, host in enumerate(hosts_of_ids)]
    return MeshRules(Mesh(np.array(chips, dtype=object).reshape(shape), MESH_AXES))


def cfg(prompts: int, group: int):
    return from_dict({"data": {"prompts_per_step": prompts}, "grpo": {"num_generations": group}})


def test_tensor_axis_over_two_hosts_shares_rows():
    two_hosts = [k // 4 for k in range(8)]
    assert batch_shards(rules((1, 1, 8), two_hosts)) == {0: (0,), 1: (0,)}
    assert batch_shards(rules((2, 1, 4), two_hosts)) == {0: (0,), 1: (1,)}
    assert batch_shards(rules((4, 1, 2), two_hosts)) == {0: (0, 1), 1: (2, 3)}
    assert batch_shards(rules((2, 2, 2), two_hosts)) == {0: (0, 1), 1: (2, 3)}
    # 4 hosts of 4 chips, tensor 8: hosts 0, 1 hold rows [0, R/2) and hosts 2, 3 the rest
    assert batch_shards(rules((2, 1, 8), [k // 4 for k in range(16)])) == {
        0: (0,), 1: (0,), 2: (1,), 3: (1,)}


def test_plan_reports_the_row_blocks_and_refuses_groups_split():
    layout = rules((2, 1, 8), [k // 4 for k in range(16)])
    assert host_layout(cfg(4, 8), layout) == (
        "4 hosts x 4 chips: 2 row blocks of 16 rows, each held by 2 hosts, which sample and "
        "score it alike")
    assert host_layout(cfg(2, 8), rules((2, 1, 4), [k // 4 for k in range(8)])) == (
        "2 hosts x 4 chips: 2 row blocks of 8 rows, each held by 1 host")
    with pytest.raises(ConfigError, match="'data.prompts_per_step' = 1 must be a multiple of "
                                          "the 2 row blocks"):
        host_layout(cfg(1, 8), layout)


def test_layouts_no_host_can_feed_are_refused():
    # hosts alternate along the data axis: host 0 holds batch shards 0 and 2, not contiguous
    alternating = rules((4, 1, 2), [0, 0, 1, 1, 0, 0, 1, 1])
    with pytest.raises(ConfigError, match=r"process 0 would hold batch shards \[0, 2\], which "
                                          "are not contiguous rows"):
        check_layout(alternating)
    # hosts of 3 chips under tensor 2: host 1 holds half of shard 1 and all of shard 2
    overlap = rules((3, 1, 2), [0, 0, 0, 1, 1, 1])
    with pytest.raises(ConfigError, match=r"mesh.tensor=2 lay rows out that no process can feed"
                                          r".*processes 0 and 1 would hold batch shards \[0, 1\]"
                                          r" and \[1, 2\]"):
        check_layout(overlap)
    check_layout(rules((2, 1, 4), [k % 2 for k in range(8)]))  # both hosts hold both shards


def test_gpu_memory_is_what_the_allocator_hands_out():
    assert mem_fraction(None, {}) == (0.75, "XLA's default; XLA_CLIENT_MEM_FRACTION is unset")
    assert mem_fraction(None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == (
        0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9")
    assert mem_fraction(0.5, {"XLA_CLIENT_MEM_FRACTION": "0.9"}) == (0.5, "--mem-fraction")
    capacity, source = device_memory([], 32, 0.9)
    assert capacity == int(28.8 * (1 << 30)) and source == "0.90 x 32.00 GiB, --mem-fraction"
