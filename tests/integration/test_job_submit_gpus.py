"""GPU jobs through job_submit/k8s_resource_completion in a real slurmctld.

cons_tres gives a GPU job DefCpuPerGPU CPUs and DefMemPerGPU MB per GPU
(cluster-wide, or a partition's own, also set at run time with `scontrol
update PartitionName=... JobDefaults=...`) when the job does not say: the
job must hold at least that, judged by what Slurm really allocated
(`scontrol -d show job`: CPU_IDs, Mem per node).  The nodes' GPUs are fake
(cluster.up gpus=2): character devices slurmd never opens.
Ports: port(17130) .. +2.
"""
import time

import pytest
from local_slurm import BUILD, local_cluster, port, requires_slurm, tres
from test_job_submit import ours, run, sbatch, wait_state
from test_job_submit_differential import allocations, held_short

pytestmark = requires_slurm

CPUS, MEMORY = 8, 16000
DEFAULTS = "DefCpuPerGPU=3\nDefMemPerGPU=3000\n"
PARTITIONS = ("PartitionName=a Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
              "PartitionName=b Nodes=ALL DefCpuPerGPU=2 DefMemPerGPU=1500 MaxTime=INFINITE "
              "State=UP")


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "gpus", nodes=2, cpus=CPUS, sockets=2,
                             memory=MEMORY, gpus=2, base_port=port(17130),
                             node_features=False, def_mem_per_cpu=100, extra_conf=DEFAULTS,
                             partitions=PARTITIONS)


@pytest.fixture(autouse=True)
def clean_queue(c):
    yield
    run("scancel", "--user=root", check=False)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and run("squeue", "-h").stdout.strip():
        time.sleep(0.2)


def started_holding_enough(job_id: str) -> str:
    """Wait for the job to run; assert it holds, on every node, at least the
    CPUs and memory Slurm allocated there; its TresPerNode."""
    info = wait_state(job_id, "RUNNING")
    allocated = allocations(run("scontrol", "-d", "show", "job", job_id).stdout)
    assert allocated and allocated[0]["nodes"], allocated
    assert not held_short(allocated)
    return ours(info.get("TresPerNode"))


# (sbatch options, TresPerNode): each figure is what Slurm 22.05 allocates
# (cons_tres _set_gpu_defaults), checked against `scontrol -d show job` too.
SHAPES = [
    (["--gpus-per-node=1"], "gres:gpu:1,gres:k8scpu:3,gres:k8smemory:3000"),
    (["--gpus-per-node=2", "-c", "1"], "gres:gpu:2,gres:k8scpu:1,gres:k8smemory:6000"),
    (["--gpus=1"], "gres:k8scpu:3,gres:k8smemory:3000"),
    (["-n", "2", "--gpus-per-task=1"], "gres:k8scpu:6,gres:k8smemory:6000"),
    (["--gpus-per-node=1", "--mem=500"], "gres:gpu:1,gres:k8scpu:3,gres:k8smemory:500"),
    (["--gpus-per-node=1", "--cpus-per-gpu=4"], "gres:gpu:1,gres:k8scpu:4,gres:k8smemory:3000"),
    (["-p", "b", "--gpus-per-node=2"], "gres:gpu:2,gres:k8scpu:4,gres:k8smemory:3000"),
    (["-c", "2"], "gres:k8scpu:2,gres:k8smemory:200"),  # no GPUs: no GPU defaults
]


@pytest.mark.parametrize("opts,per_node", SHAPES, ids=[" ".join(s[0]) for s in SHAPES])
def test_gpu_defaults_are_held(c, opts, per_node):
    assert started_holding_enough(sbatch(*opts, hold=False)) == tres(per_node)


def test_ntasks_per_gpu_is_refused_with_the_way_out(c):
    """Slurm applies --ntasks-per-gpu to every GRES of a job, so it cannot run
    with k8smemory (the differential test checks that against plain Slurm)."""
    proc = run("sbatch", "--ntasks-per-gpu=2", "--gpus=2", "--wrap", "true", check=False)
    assert proc.returncode != 0
    assert "--ntasks-per-gpu cannot run" in proc.stderr and "--gpus-per-node" in proc.stderr


def test_spread_job_with_per_job_gpus_never_reaches_a_slurmctld_it_crashes(c):
    """`sbatch -n3 --spread-job --gpus=1` segfaults slurmctld 24.11.5 even
    without a job_submit plugin: there (SPREAD_PER_TASK_CRASHES) the plugin
    refuses it, and slurmctld lives on; 22.05 and 25.05 on run it."""
    proc = run("sbatch", "--parsable", "--output=/dev/null", "-n3", "--spread-job", "--gpus=1",
               "--wrap", "sleep 60", check=False)
    if BUILD.get("SPREAD_PER_TASK_CRASHES") == "1":
        assert proc.returncode != 0 and "--spread-job with a per-job" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        started_holding_enough(proc.stdout.strip().split(";")[0])
    assert "UP" in run("scontrol", "ping").stdout


def test_partition_job_defaults_changed_at_run_time(c):
    """`scontrol update PartitionName=b JobDefaults=...` reaches the next job."""
    try:
        run("scontrol", "update", "PartitionName=b",
            "JobDefaults=DefCpuPerGPU=4,DefMemPerGPU=2000")
        assert started_holding_enough(sbatch("-p", "b", "--gpus-per-node=2", hold=False)) == \
            tres("gres:gpu:2,gres:k8scpu:8,gres:k8smemory:4000")
    finally:
        run("scancel", "--user=root", check=False)
        run("scontrol", "update", "PartitionName=b", "JobDefaults=DefCpuPerGPU=2,DefMemPerGPU=1500")


def test_reconfigure_within_the_same_second_is_seen(c):
    """slurm.conf changed and reconfigured twice within one second: the
    second change is seen too (slurm_conf.last_update has whole seconds)."""
    with open(c.conf) as f:
        original = f.read()
    same_second = 0
    try:
        for attempt in range(10):
            start = time.time()
            for cpus_per_gpu in (2, 1):
                c.rewrite_conf(original.replace("DefCpuPerGPU=3\n", f"DefCpuPerGPU={cpus_per_gpu}\n"))
                run("scontrol", "reconfigure")
                job_id = sbatch("--gpus-per-node=1")
            same_second += int(start) == int(time.time())
            assert ours(wait_state(job_id, "PENDING")["TresPerNode"]) == \
                tres("gres:gpu:1,gres:k8scpu:1,gres:k8smemory:3000")
            if same_second:
                break
        assert same_second, "no attempt fit in one second: the case was not exercised"
    finally:
        c.rewrite_conf(original)
        run("scontrol", "reconfigure")
    time.sleep(1)
    assert c.pid("slurmd-n1") and c.pid("slurmd-n2"), "a slurmd stopped on a reread slurm.conf"


def test_updates_recompute_the_gpu_defaults(c):
    """`scontrol update job` of the GPUs, the partition and the memory: each
    recomputed as at submission, and the job then holds what it gets."""
    job_id = sbatch("--gpus-per-node=1")
    for update, per_node in (("Gres=gpu:2", "gres:gpu:2,gres:k8scpu:6,gres:k8smemory:6000"),
                             ("Partition=b", "gres:gpu:2,gres:k8scpu:4,gres:k8smemory:3000"),
                             ("MinMemoryNode=500", "gres:gpu:2,gres:k8scpu:4,gres:k8smemory:500")):
        run("scontrol", "update", f"JobId={job_id}", update)
        assert ours(wait_state(job_id, "PENDING")["TresPerNode"]) == tres(per_node), update
    run("scontrol", "release", job_id)
    assert started_holding_enough(job_id) == tres("gres:gpu:2,gres:k8scpu:4,gres:k8smemory:500")
