"""Table-driven tests of the completion policy (pyk8sres.slurmctld.completion)."""
import pytest

from pyk8sres.slurmctld.completion import (Job, MemDefault, PolicyError, Site, complete,
                                 complete_modify, decode_memory, MEM_PER_CPU, NO_VAL64)

V2205 = 0x160508
V2411 = 0x180B05
SITE = Site(slurm_version=V2205, cluster_mem=MemDefault(per_cpu=100))

# (id, job, expected tres_per_node, expected tres_per_task) with DefMemPerCPU=100
CASES = [
    ("nothing given: 1 task, 1 CPU", Job(), "gres:k8scpu:1,gres:k8smemory:100", None),
    ("-c 3", Job(cpus_per_task=3), "gres:k8scpu:3,gres:k8smemory:300", None),
    ("-c 3 --mem=4000", Job(cpus_per_task=3, mem_per_node=4000),
     "gres:k8scpu:3,gres:k8smemory:4000", None),
    ("-c 2 --mem-per-cpu=500", Job(cpus_per_task=2, mem_per_cpu=500),
     "gres:k8scpu:2,gres:k8smemory:1000", None),
    ("-N 2 --ntasks-per-node=2 -c 2", Job(min_nodes=2, ntasks_per_node=2, cpus_per_task=2),
     "gres:k8scpu:4,gres:k8smemory:400", None),
    ("-n 5 -N 2: most tasks on a node is 3", Job(num_tasks=5, min_nodes=2),
     "gres:k8scpu:3,gres:k8smemory:300", None),
    ("-n 6 without -N: per task", Job(num_tasks=6),
     "", "gres:k8scpu:1,gres:k8smemory:100"),
    ("-n 4 -c 2 --mem=3000 without -N: cpu per task, memory per node",
     Job(num_tasks=4, cpus_per_task=2, mem_per_node=3000),
     "gres:k8smemory:3000", "gres:k8scpu:2"),
    ("-N 3 without -n: one task per node", Job(min_nodes=3, cpus_per_task=2),
     "gres:k8scpu:2,gres:k8smemory:200", None),
    ("--mincpus=6", Job(pn_min_cpus=6), "gres:k8scpu:6,gres:k8smemory:600", None),
    ("gpus: --gpus-per-node=2 --cpus-per-gpu=4 --mem-per-gpu=1000",
     Job(tres_per_node="gres:gpu:2", cpus_per_tres="gres:gpu:4", mem_per_tres="gres:gpu:1000"),
     "gres:gpu:2,gres:k8scpu:8,gres:k8smemory:2000", None),
    ("--mem=0 --exclusive: Slurm gives all k8smemory", Job(cpus_per_task=2, mem_per_node=0,
                                                            exclusive=True),
     "gres:k8scpu:2", None),
    ("user asked more: kept", Job(cpus_per_task=2, tres_per_node="gres:k8scpu:5"),
     "gres:k8scpu:5,gres:k8smemory:200", None),
    ("user asked less: corrected up", Job(cpus_per_task=8, tres_per_node="gres:k8scpu:0"),
     "gres:k8scpu:8,gres:k8smemory:800", None),
    ("duplicates merged into one entry",
     Job(cpus_per_task=1, tres_per_node="gres:k8scpu:1,gres:k8scpu:1"),
     "gres:k8scpu:2,gres:k8smemory:100", None),
    ("binary suffix like Slurm", Job(tres_per_node="gres:k8smemory:4k"),
     "gres:k8scpu:1,gres:k8smemory:4096", None),
    ("foreign GRES untouched", Job(tres_per_node="gres:gpu:tesla:1"),
     "gres:gpu:tesla:1,gres:k8scpu:1,gres:k8smemory:100", None),
]


@pytest.mark.parametrize("name,job,node,task", CASES, ids=[c[0] for c in CASES])
def test_complete(name, job, node, task):
    result = complete(job, SITE)
    assert (result.tres_per_node if result.tres_per_node is not None
            else job.tres_per_node or "") == node
    assert result.tres_per_task == task


def test_already_complete_is_unchanged():
    job = Job(cpus_per_task=3, tres_per_node="gres:k8scpu:3,gres:k8smemory:300")
    assert complete(job, SITE).tres_per_node is None


def test_slurm_2411_syntax():
    site = Site(slurm_version=V2411, cluster_mem=MemDefault(per_cpu=100))
    job = Job(cpus_per_task=3, tres_per_node="gres/gpu:1")
    assert complete(job, site).tres_per_node == "gres/gpu:1,gres/k8scpu:3,gres/k8smemory:300"


MEMORY_DEFAULTS = [
    ("cluster DefMemPerNode", Site(cluster_mem=MemDefault(per_node=2048)), Job(cpus_per_task=2),
     "gres:k8scpu:2,gres:k8smemory:2048"),
    ("partition DefMemPerCPU beats cluster",
     Site(cluster_mem=MemDefault(per_cpu=100), partition_mem={"big": MemDefault(per_cpu=1000)}),
     Job(cpus_per_task=2, partition="big"), "gres:k8scpu:2,gres:k8smemory:2000"),
    ("default partition's default",
     Site(cluster_mem=MemDefault(per_cpu=100), partition_mem={"big": MemDefault(per_node=7000)},
          default_partition="big"),
     Job(cpus_per_task=2), "gres:k8scpu:2,gres:k8smemory:7000"),
    ("no default at all: whole node memory, CPUs only", Site(), Job(cpus_per_task=2),
     "gres:k8scpu:2"),
]


@pytest.mark.parametrize("name,site,job,node", MEMORY_DEFAULTS, ids=[c[0] for c in MEMORY_DEFAULTS])
def test_memory_defaults(name, site, job, node):
    assert complete(job, site).tres_per_node == node


REJECTED = [
    ("malformed count", Job(tres_per_node="gres:k8scpu:abc"), "k8scpu takes a plain count"),
    ("typed k8s gres", Job(tres_per_node="gres:k8scpu:fast:2"), "plain count"),
    ("huge count", Job(tres_per_node="gres:k8scpu:99999999999999999999"), "too large"),
    ("negative count", Job(tres_per_node="gres:k8smemory:-5"), "plain count"),
    ("per job", Job(tres_per_job="gres:k8scpu:4"), "only be requested per node"),
    ("--mem=0 on a shared node", Job(mem_per_node=0), "cannot share the node"),
    ("absurd shape", Job(num_tasks=2**31, min_nodes=1, cpus_per_task=2**15), "larger than any node"),
]


@pytest.mark.parametrize("name,job,message", REJECTED, ids=[c[0] for c in REJECTED])
def test_rejected(name, job, message):
    with pytest.raises(ValueError, match=message):
        complete(job, SITE)


def test_under_request_reject_mode():
    site = Site(cluster_mem=MemDefault(per_cpu=100), under_request="reject")
    with pytest.raises(PolicyError, match="less than the job uses"):
        complete(Job(cpus_per_task=8, tres_per_node="gres:k8scpu:0"), site)
    assert complete(Job(cpus_per_task=8, tres_per_node="gres:k8scpu:9"), site).tres_per_node \
        == "gres:k8scpu:9,gres:k8smemory:800"


@pytest.mark.parametrize("raw,expected", [
    (NO_VAL64, (None, None)), (4000, (4000, None)), (MEM_PER_CPU | 500, (None, 500)),
    (0, (0, None)), (None, (None, None)),
])
def test_decode_memory(raw, expected):
    assert decode_memory(raw) == expected


CURRENT = Job(cpus_per_task=2, num_tasks=1, min_nodes=1, mem_per_cpu=100,
              tres_per_node="gres:k8scpu:2,gres:k8smemory:200")
MODIFY = [
    ("unrelated update: untouched", Job(), None),
    ("more tasks", Job(num_tasks=3), "gres:k8scpu:6,gres:k8smemory:600"),
    ("fewer CPUs recomputed down", Job(cpus_per_task=1), "gres:k8scpu:1,gres:k8smemory:100"),
    ("memory per cpu", Job(mem_per_cpu=300), "gres:k8scpu:2,gres:k8smemory:600"),
    ("user lowers gres: corrected", Job(tres_per_node="gres:k8scpu:0"),
     "gres:k8scpu:2,gres:k8smemory:200"),
]


@pytest.mark.parametrize("name,change,node", MODIFY, ids=[c[0] for c in MODIFY])
def test_modify(name, change, node):
    assert complete_modify(change, CURRENT, SITE).tres_per_node == node


def test_modify_without_current_job_is_refused_not_guessed():
    with pytest.raises(PolicyError, match="cannot see a submitted job"):
        complete_modify(Job(num_tasks=3), None, SITE)
    assert complete_modify(Job(), None, SITE).tres_per_node is None
