"""Table-driven tests of the completion policy (pyk8sres.slurmctld.completion):
what complete() and complete_modify() write into a job (TresPerNode,
TresPerTask), memory defaults, what is refused.  The rules one row each,
the steps of plans._plan and an independent model of Slurm's allocation:
test_completion_rules.py."""
import dataclasses

import pytest

from completion_sites import MIXED, SITE, THREE, THREE_2411, TWO, V2411
from pyk8sres import GRES_CPU as CPU, GRES_MEMORY as MEM
from pyk8sres.slurmctld.completion import complete, complete_modify
from pyk8sres.slurmctld.jobspec import (CR_CORE, CR_MEMORY, Job, MemDefault, Nodes, Partition,
                                        PolicyError, Site, decode_memory, MEM_PER_CPU, NO_VAL64)
from pyk8sres.slurmctld.plans import required

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
    ("-n 5 -N 2: tasks per node decided by Slurm: per task", Job(num_tasks=5, min_nodes=2,
                                                                  max_nodes=2),
     "", "gres:k8scpu:1,gres:k8smemory:100"),
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
     Site(cluster_mem=MemDefault(per_cpu=100),
          partitions={"big": Partition(mem=MemDefault(per_cpu=1000))}),
     Job(cpus_per_task=2, partition="big"), "gres:k8scpu:2,gres:k8smemory:2000"),
    ("default partition's default",
     Site(cluster_mem=MemDefault(per_cpu=100),
          partitions={"big": Partition(mem=MemDefault(per_node=7000))}, default_partition="big"),
     Job(cpus_per_task=2), "gres:k8scpu:2,gres:k8smemory:7000"),
    ("no default at all, memory not consumable (CR_Core): CPUs only", Site(),
     Job(cpus_per_task=2), "gres:k8scpu:2"),
]

# All of a node's memory (cons_tres job_test.c "Allocate all node memory"):
# --mem=0, --mem-per-cpu=0 (Slurm maps it to --mem=0) or no default anywhere,
# with memory consumable (CR_Core_Memory).
HOMOGENEOUS = Nodes(cpus=8, memory=16000, count=3, least_cpus=8, least_memory=16000)
MIXED_MEMORY = Nodes(cpus=8, memory=16000, count=3, least_cpus=8, least_memory=8000)
CORE_MEMORY = CR_CORE | CR_MEMORY
WHOLE_NODE_MEMORY = [
    ("--mem=0: the node's whole k8smemory",
     Site(select_type_param=CORE_MEMORY, all_nodes=HOMOGENEOUS), Job(mem_per_node=0),
     {CPU: 1, MEM: 16000}, {}),
    ("--mem=0 with ReserveMemory: what the node offers",
     Site(select_type_param=CORE_MEMORY, all_nodes=HOMOGENEOUS, reserve_memory=1000),
     Job(mem_per_node=0), {CPU: 1, MEM: 15000}, {}),
    ("no default anywhere (DefMemPerNode=UNLIMITED): the whole node's",
     Site(select_type_param=CORE_MEMORY, all_nodes=HOMOGENEOUS,
          cluster_mem=MemDefault(per_node=0)), Job(cpus_per_task=2),
     {CPU: 2, MEM: 16000}, {}),
    ("DefMemPerCPU=0 (0 per CPU): no memory allocated, CPUs only",
     Site(select_type_param=CORE_MEMORY, all_nodes=HOMOGENEOUS,
          cluster_mem=MemDefault(per_cpu=0)), Job(cpus_per_task=2), {CPU: 2}, {}),
    ("-n 4 --mem=0: per task CPUs, all the memory per node",
     Site(select_type_param=CORE_MEMORY, all_nodes=HOMOGENEOUS, cluster_mem=MemDefault(per_cpu=100)),
     Job(num_tasks=4, mem_per_node=0), {MEM: 16000}, {CPU: 1}),
    ("--mem=0 in the partition's nodes",
     Site(select_type_param=CORE_MEMORY, all_nodes=MIXED_MEMORY, default_partition="p",
          partitions={"p": Partition(nodes=HOMOGENEOUS)}), Job(mem_per_node=0),
     {CPU: 1, MEM: 16000}, {}),
    ("--mem=0, memory not consumable (CR_Core): CPUs only",
     Site(select_type_param=CR_CORE, all_nodes=HOMOGENEOUS), Job(mem_per_node=0), {CPU: 1}, {}),
    ("--mem=0 --exclusive: CPUs only (Slurm gives all)",
     Site(select_type_param=CORE_MEMORY, all_nodes=MIXED_MEMORY),
     Job(mem_per_node=0, exclusive=True), {CPU: 1}, {}),
    ("RealMemory unset everywhere: Slurm's 1 MB",
     Site(select_type_param=CORE_MEMORY, all_nodes=Nodes(cpus=8, least_memory=1)),
     Job(mem_per_node=0), {CPU: 1, MEM: 1}, {}),
]


@pytest.mark.parametrize("name,site,job,node,task", WHOLE_NODE_MEMORY,
                         ids=[c[0] for c in WHOLE_NODE_MEMORY])
def test_whole_node_memory(name, site, job, node, task):
    assert required(job, site) == (node, task)


def test_whole_node_memory_on_nodes_that_differ_is_a_clear_error():
    site = Site(select_type_param=CORE_MEMORY, all_nodes=MIXED_MEMORY,
                cluster_mem=MemDefault(per_node=0))
    for job in (Job(mem_per_node=0), Job()):
        with pytest.raises(PolicyError, match="8000 to 16000 MB: no single k8smemory count"):
            complete(job, site)


@pytest.mark.parametrize("name,site,job,node", MEMORY_DEFAULTS, ids=[c[0] for c in MEMORY_DEFAULTS])
def test_memory_defaults(name, site, job, node):
    assert complete(job, site).tres_per_node == node


REJECTED = [
    ("malformed count", Job(tres_per_node="gres:k8scpu:abc"), "k8scpu takes a plain count"),
    ("typed k8s gres", Job(tres_per_node="gres:k8scpu:fast:2"), "plain count"),
    ("huge count", Job(tres_per_node="gres:k8scpu:99999999999999999999"), "too large"),
    ("negative count", Job(tres_per_node="gres:k8smemory:-5"), "plain count"),
    ("per job", Job(tres_per_job="gres:k8scpu:4"), "only be requested per node"),
    ("absurd shape", Job(num_tasks=2**31, min_nodes=1, max_nodes=1, cpus_per_task=2**15),
     "larger than any node"),
    ("--ntasks-per-gpu: Slurm applies it to our GRES too",
     Job(ntasks_per_tres=2, tres_per_job="gres:gpu:2", num_tasks=4), "--ntasks-per-gpu cannot run"),
]


@pytest.mark.parametrize("name,job,message", REJECTED, ids=[c[0] for c in REJECTED])
def test_rejected(name, job, message):
    with pytest.raises(ValueError, match=message):
        complete(job, SITE)


# Nodes of 8, 4 and 12 CPUs; shapes of the differential test's mixed topology
# (plain Slurm refuses too once they hold the count: "Requested node
# configuration is not available", or pending with BadConstraints).
MIXED_SHAPES = [
    # (name, job, refused with the clear message?, k8scpu per node)
    ("-n 8 -N 3 --mincpus=3: 6 a node fits 2 of 3", Job(num_tasks=8, min_nodes=3, max_nodes=3,
                                                        pn_min_cpus=3), True, 6),
    ("-n 5 -N 2-3 -c 3 --threads-per-core=1: 12 fits 1 of 2",
     Job(num_tasks=5, min_nodes=2, max_nodes=3, cpus_per_task=3, threads_per_core=1), True, 12),
    ("-n 12 -N 1-3 -c 2 --mincpus=3: 12 fits 1, it needs 1: Slurm's to refuse",
     Job(num_tasks=12, min_nodes=1, max_nodes=3, cpus_per_task=2, pn_min_cpus=3), False, 12),
    ("-n 8 -N 2 --mincpus=3: 7 fits 2 of 2", Job(num_tasks=8, min_nodes=2, max_nodes=2,
                                                  pn_min_cpus=3), False, 7),
    ("-N 3 -c 6: the same on each node, exact: Slurm's to refuse",
     Job(min_nodes=3, max_nodes=3, cpus_per_task=6), False, 6),
    ("-n 9 -N 3: per task", Job(num_tasks=9, min_nodes=3, max_nodes=3), False, None),
]


@pytest.mark.parametrize("name,job,refused,cpus", MIXED_SHAPES, ids=[m[0] for m in MIXED_SHAPES])
def test_mixed_node_sizes(name, job, refused, cpus):
    if refused:
        with pytest.raises(PolicyError, match=f"it must hold k8scpu:{cpus} on each; it needs"):
            required(job, MIXED)
    else:
        assert required(job, MIXED)[0].get(CPU) == cpus


@pytest.mark.parametrize("job", [Job(spread_job=True, num_tasks=3, tres_per_job="gres/gpu:1"),
                                 Job(spread_job=True, num_tasks=3, tres_per_task="gres/gpu=1")])
def test_spread_job_with_a_per_job_gres_is_refused_where_it_crashes_slurmctld(job):
    """It segfaults slurmctld 24.11 (plugin or not); 22.05 and 25.05 on run it."""
    with pytest.raises(PolicyError, match="--spread-job with a per-job or per-task GRES"):
        complete(job, THREE_2411)
    assert complete(job._replace(tres_per_job=None, tres_per_task=None, tres_per_node="gres/gpu:1"),
                    THREE_2411)
    assert complete(job, THREE)
    assert complete(Job(spread_job=True, num_tasks=3, tres_per_task="cpu:2"), THREE_2411)
    assert complete(job, dataclasses.replace(THREE_2411, slurm_version=0x190B07,
                                             spread_per_task_crashes=False))


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
SPREAD = Job(num_tasks=4, min_nodes=1, tres_per_task="gres:k8scpu:1,gres:k8smemory:100")
# (id, current job, update, resulting TresPerNode, TresPerTask; None = unchanged)
MODIFY = [
    ("unrelated update: untouched", CURRENT, Job(), None, None),
    ("more tasks: Slurm places them, so per task", CURRENT, Job(num_tasks=3),
     "", "gres:k8scpu:2,gres:k8smemory:200"),
    ("more tasks on one fixed node", CURRENT, Job(num_tasks=3, max_nodes=1),
     "gres:k8scpu:6,gres:k8smemory:600", None),
    ("fewer CPUs recomputed down", CURRENT, Job(cpus_per_task=1),
     "gres:k8scpu:1,gres:k8smemory:100", None),
    ("memory per cpu", CURRENT, Job(mem_per_cpu=300), "gres:k8scpu:2,gres:k8smemory:600", None),
    ("memory per node replaces per cpu", CURRENT, Job(mem_per_node=1500),
     "gres:k8scpu:2,gres:k8smemory:1500", None),
    ("user lowers gres: corrected", CURRENT, Job(tres_per_node="gres:k8scpu:0"),
     "gres:k8scpu:2,gres:k8smemory:200", None),
    ("Gres= clears: no empty entry, ours back", CURRENT, Job(tres_per_node="gres:"),
     "gres:k8scpu:2,gres:k8smemory:200", None),
    ("NumTasks of a per-task job: per task, resent so Slurm recounts", SPREAD, Job(num_tasks=6),
     None, "gres:k8scpu:1,gres:k8smemory:100"),
    ("NumNodes pins a per-task job to one node: per node", SPREAD, Job(min_nodes=1, max_nodes=1),
     "gres:k8scpu:4,gres:k8smemory:400", ""),
    ("NumCPUs (cpus per task) of a per-task job", SPREAD, Job(cpus_per_task=2),
     None, "gres:k8scpu:2,gres:k8smemory:200"),
    ("partition with another default", SPREAD, Job(partition="b"),
     None, "gres:k8scpu:1,gres:k8smemory:500"),
]


@pytest.mark.parametrize("name,current,change,node,task", MODIFY, ids=[c[0] for c in MODIFY])
def test_modify(name, current, change, node, task):
    result = complete_modify(change, current, TWO)
    assert (result.tres_per_node, result.tres_per_task) == (node, task)


def test_modify_of_a_per_task_job_clears_the_stale_per_job_count():
    assert complete_modify(Job(min_nodes=1, max_nodes=1), SPREAD, TWO).clear_tres_per_job
    assert complete_modify(Job(num_tasks=6), SPREAD, TWO).clear_tres_per_job
    assert not complete_modify(Job(num_tasks=6), CURRENT, TWO).clear_tres_per_job
    assert not complete_modify(Job(), SPREAD, TWO).clear_tres_per_job
    with_gpus = SPREAD._replace(tres_per_job="gres:gpu:2")  # the user's own: left alone
    assert not complete_modify(Job(min_nodes=1, max_nodes=1), with_gpus, TWO).clear_tres_per_job


def test_modify_equals_submit():
    """An update recomputes exactly what submitting the updated job would ask."""
    for change in (Job(num_tasks=6), Job(min_nodes=2, max_nodes=2), Job(cpus_per_task=3),
                   Job(mem_per_cpu=700), Job(partition="b"), Job(num_tasks=1)):
        merged = SPREAD._replace(tres_per_task=None,
                                 **{k: v for k, v in change._asdict().items() if v})
        submitted = complete(merged, TWO)
        updated = complete_modify(change, SPREAD, TWO)
        assert (updated.per_node, updated.per_task) == (submitted.per_node, submitted.per_task)


def test_modify_without_current_job_is_refused_not_guessed():
    with pytest.raises(PolicyError, match="cannot see a submitted job"):
        complete_modify(Job(num_tasks=3), None, SITE)
    assert complete_modify(Job(), None, SITE).tres_per_node is None
