"""pyk8sres.coordinator.slurm (the one module that calls Slurm) against a real slurmctld."""

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
