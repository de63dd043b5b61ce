"""node_features policy: what a registering node's k8scpu/k8smemory become."""
import pytest

from pyk8sres.slurmctld.config import Config
from pyk8sres.slurmctld.nodefeatures import HOLD, capacity, node_counts

NONE = Config()
RESERVE = Config(reserve_cpus=1, reserve_memory_mb=1000)


def state(nodes=None, unmanaged=()):
    return {"version": 1, "nodes": nodes or {}, "unmanaged": list(unmanaged)}


@pytest.mark.parametrize("config, node, cpus, mem, st, expected", [
    # The sync daemon's count for a managed node.
    (NONE, "n1", 4, 8000, state({"n1": {"k8scpu": 3, "k8smemory": 5000}}), (3, 5000)),
    (NONE, "n1", 4, 8000, state({"n1": {"k8scpu": 0, "k8smemory": 0}}), (0, 0)),
    # Never above capacity (would overbook; reserve counts).
    (NONE, "n1", 4, 8000, state({"n1": {"k8scpu": 9, "k8smemory": 9000}}), (4, 8000)),
    (RESERVE, "n1", 4, 8000, state({"n1": {"k8scpu": 4, "k8smemory": 8000}}), (3, 7000)),
    (RESERVE, "n1", 4, 8000, state({"n1": {"k8scpu": 2, "k8smemory": 3000}}), (2, 3000)),
    # Declared unmanaged (no kubelet): full capacity minus reserve; patterns.
    (NONE, "n2", 4, 8000, state(unmanaged=["n2"]), (4, 8000)),
    (RESERVE, "login3", 4, 8000, state(unmanaged=["login*"]), (3, 7000)),
    (NONE, "n2", 4, 8000, state(unmanaged=["*"]), (4, 8000)),
    # An explicit entry wins over an unmanaged pattern.
    (NONE, "n1", 4, 8000, state({"n1": {"k8scpu": 1, "k8smemory": 1}}, ["*"]), (1, 1)),
    # Listed nowhere: the daemon has not counted it yet -> hold everything.
    (NONE, "n7", 4, 8000, state({"n1": {"k8scpu": 3, "k8smemory": 5000}}), HOLD),
    (NONE, "n7", 4, 8000, state(unmanaged=["login*"]), HOLD),
    # No state file at all: nobody said what Kubernetes holds -> hold.
    (NONE, "n1", 4, 8000, None, HOLD),
    # Reserve above the node's size: zero, never negative.
    (Config(reserve_cpus=8, reserve_memory_mb=9000), "n2", 4, 8000, state(unmanaged=["*"]), (0, 0)),
])
def test_node_counts(config, node, cpus, mem, st, expected):
    assert node_counts(config, node, cpus, mem, st) == expected


@pytest.mark.parametrize("config, cpus, mem, expected", [
    (NONE, 4, 8000, (4, 8000)),
    (RESERVE, 4, 8000, (3, 7000)),
    (RESERVE, 0, 0, (0, 0)),
])
def test_capacity(config, cpus, mem, expected):
    assert capacity(config, cpus, mem) == expected


def test_state_file_round_trip_feeds_policy(tmp_path):
    from pyk8sres.slurmctld.nodestate import read_state, write_state
    path = str(tmp_path / "s")
    write_state(path, {"n1": {"k8scpu": 2, "k8smemory": 100}}, unmanaged=["n2"])
    st = read_state(path)
    assert node_counts(NONE, "n1", 4, 8000, st) == (2, 100)
    assert node_counts(NONE, "n2", 4, 8000, st) == (4, 8000)
    assert node_counts(NONE, "n3", 4, 8000, st) == HOLD
