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


# (CPUs, effective CPUs, RealMemory, MemSpecLimit) as slurmctld's node record
# holds them: effective = CPUs - CoreSpecCount x threads used per core, or
# less CpuSpecList's CPUs.
@pytest.mark.parametrize("config, cpus, effective, mem, spec_mem, expected", [
    # No specialization: the whole node.
    (NONE, 4, 4, 8000, 0, (4, 8000)),
    # Slinky's worker on a 4-CPU host whose pod is limited to 3 CPUs and
    # 7488 MB: CoreSpecCount=1, MemSpecLimit=512.
    (NONE, 4, 3, 8000, 512, (3, 7488)),
    # CoreSpecCount=1 on 2 threads per core: two CPUs held back.
    (NONE, 8, 6, 16000, 0, (6, 16000)),
    # CpuSpecList=0,4 (one CPU on each of two cores, ThreadsPerCore=1).
    (NONE, 8, 6, 16000, 0, (6, 16000)),
    # Specialization, then the admin's reserve.
    (RESERVE, 4, 3, 8000, 512, (2, 6488)),
    # Everything specialized, or more than there is: zero, never negative.
    (NONE, 4, 0, 8000, 8000, (0, 0)),
    (RESERVE, 4, 0, 8000, 9000, (0, 0)),
    # A record whose effective count exceeds its CPUs offers its CPUs only.
    (NONE, 4, 6, 8000, 0, (4, 8000)),
])
def test_capacity_is_what_slurm_schedules(config, cpus, effective, mem, spec_mem, expected):
    assert capacity(config, cpus, mem, effective, spec_mem) == expected
