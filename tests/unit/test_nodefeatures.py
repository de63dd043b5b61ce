"""node_features policy: a registering node's k8scpu/k8smemory totals."""
import pytest

from pyk8sres.slurmctld.config import Config
from pyk8sres.slurmctld.nodefeatures import capacity

NONE = Config()
RESERVE = Config(reserve_cpus=1, reserve_memory_mb=1000)


@pytest.mark.parametrize("config, cpus, mem, expected", [
    (NONE, 4, 8000, (4, 8000)),
    (RESERVE, 4, 8000, (3, 7000)),
    (RESERVE, 0, 0, (0, 0)),
    # Reserve above the node's size: zero, never negative.
    (Config(reserve_cpus=8, reserve_memory_mb=9000), 4, 8000, (0, 0)),
])
def test_capacity(config, cpus, mem, expected):
    assert capacity(config, cpus, mem) == expected
