"""pyk8sres.coordinator.slurm (the one module that calls Slurm) against a real slurmctld."""
import os

import pytest
from local_slurm import local_cluster, requires_slurm, port

from pyk8sres.coordinator import slurm

BASE_PORT = port(17160)

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "sc", nodes=3, cpus=4, memory=8000,
                             base_port=BASE_PORT, node_features=False)


def test_list_nodes(c):
    nodes = {n.name: n for n in slurm.list_nodes()}
    assert sorted(nodes) == ["n1", "n2", "n3"]
    assert (nodes["n1"].cpus, nodes["n1"].real_memory) == (4, 8000)
    assert nodes["n1"].gres == {"k8scpu": 4, "k8smemory": 8000}
    assert nodes["n1"].gres_used == {"k8scpu": 0, "k8smemory": 0}
    assert not nodes["n1"].drained


def test_batch_update_groups_equal_counts_and_isolates_failures(c):
    result = slurm.set_nodes_gres({
        "n1": {"k8scpu": 2, "k8smemory": 4096},     # 4096 prints as 4K: parsed back exactly
        "n2": {"k8scpu": 2, "k8smemory": 4096},
        "n3": {"k8scpu": 3, "k8smemory": 5000},
        "nosuch": {"k8scpu": 1, "k8smemory": 1},
    })
    assert result["n1"] is None and result["n2"] is None and result["n3"] is None
    assert isinstance(result["nosuch"], slurm.SlurmError)
    nodes = {n.name: n for n in slurm.list_nodes()}
    assert nodes["n1"].gres == nodes["n2"].gres == {"k8scpu": 2, "k8smemory": 4096}
    assert nodes["n3"].gres == {"k8scpu": 3, "k8smemory": 5000}
    assert not any(n.drained for n in nodes.values())
    slurm.set_nodes_gres({n: {"k8scpu": 4, "k8smemory": 8000} for n in ("n1", "n2", "n3")})
    assert all(n.gres == {"k8scpu": 4, "k8smemory": 8000} for n in slurm.list_nodes())
