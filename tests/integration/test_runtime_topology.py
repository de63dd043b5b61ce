"""Completion follows the partitions and nodes slurmctld really has (root only).

slurm.conf gives partition `small` the 8-CPU node n1 only; at run time the
admin adds the 32-CPU node n2 (`scontrol update PartitionName=small
Nodes=n1,n2`), or brings up a dynamic node.  A job then sent to that bigger
node must hold k8scpu/k8smemory covering what Slurm allocates there: checked
from `scontrol -d show job` (CPU_IDs and Mem per node, and the GRES Slurm
allocated per node), never from what the plugin says it asked.
Ports: PYK8SRES_TEST_TOPO_PORT (default 17500) .. +4 (+4: the dynamic node's slurmd).
"""
import os
import re
import subprocess
import time

import pytest
from local_slurm import local_cluster, port, requires_slurm
from test_job_submit_differential import allocations, held_short

BASE_PORT = int(os.environ.get("PYK8SRES_TEST_TOPO_PORT", port(17500)))
SIZES = {"n1": (8, 8000), "n2": (32, 32000), "n3": (64, 64000)}  # n3: dynamic
PARTITIONS = ("PartitionName=small Nodes=n1 MaxTime=INFINITE State=UP\n"
              "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "topo", nodes=2, base_port=BASE_PORT,
                             node_features=False, def_mem_per_cpu=100,
                             node_sizes=[SIZES["n1"], SIZES["n2"]], partitions=PARTITIONS,
                             # a dynamic slurmd takes SlurmdPort (no Port= in --conf)
                             extra_conf=f"MaxNodeCount=8\nSlurmdPort={BASE_PORT + 4}\n")


def run(*args, check=True, timeout=60):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/tmp")
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(args)} failed: {proc.stderr}")
    return proc


def small_nodes(nodes: str) -> None:
    run("scontrol", "update", "PartitionName=small", f"Nodes={nodes}")
    shown = run("scontrol", "show", "partition", "small").stdout
    assert f"TotalNodes={len(nodes.split(','))} " in shown, shown


@pytest.fixture(autouse=True)
def clean(c):
    small_nodes("n1")
    yield
    run("scancel", "--user=root", check=False)
    deadline = time.monotonic() + 20
    while run("squeue", "-h", "-t", "R,PD,CG").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.3)
    small_nodes("n1")


def submit(*opts):
    """sbatch's result: (job id or None, stderr)."""
    proc = run("sbatch", "--parsable", "--output=/dev/null", *opts, "--wrap", "sleep 300",
               check=False)
    return (proc.stdout.strip().split(";")[0] or None) if proc.returncode == 0 else None, \
        proc.stderr.strip()


def running(job_id: str, timeout: float = 30) -> dict:
    """The job's `scontrol -d show job` record once it runs (allocations())."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = allocations(run("scontrol", "-d", "show", "job", job_id).stdout)
        if jobs and jobs[0]["state"] == "RUNNING" and jobs[0]["nodes"]:
            return jobs[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} did not start: {jobs}")
        time.sleep(0.3)


def covered(job_id: str) -> dict:
    """Ground truth: the running job holds on each node at least the CPUs and
    memory Slurm allocated it there; returns its allocation."""
    job = running(job_id)
    short = held_short([job], sizes=SIZES)
    assert not short, short
    return job


def memory_answer(partition: str = "small") -> str:
    """What `sbatch -p small -c 4 --mem=0` gets: its k8smemory, or "refused"."""
    job_id, err = submit("-H", "-p", partition, "-c", "4", "--mem=0")
    if job_id is None:
        return "refused" if "8000 to 32000 MB" in err else err
    out = run("scontrol", "show", "job", job_id).stdout
    run("scancel", job_id)
    return re.search(r"TresPerNode=\S*k8smemory:(\d+)", out).group(1)


# Jobs sent to n2 through `small` once n2 is in it.  Sized by slurm.conf's
# view of `small` (n1 alone) each holds less than Slurm gives it on n2:
# -n 20 --mincpus=4 was asked per node and capped at 8 CPUs; --mem=0 was
# k8smemory:8000 while Slurm allocates all 32000 MB of n2.
BIGGER_NODE = [
    ["-n", "20", "--mincpus=4"],
    ["-n", "12", "-N", "1-2", "--mincpus=3"],
    ["-c", "4", "--mem=0"],
]


@pytest.mark.parametrize("opts", BIGGER_NODE, ids=[" ".join(o) for o in BIGGER_NODE])
def test_partition_grown_at_run_time_holds_what_the_bigger_node_gives(c, opts):
    small_nodes("n1,n2")
    job_id, err = submit("-p", "small", "-w", "n2", *opts)
    if job_id is None:
        # Refused is safe, but only with the reason: nodes of 8000 and 32000 MB.
        assert "--mem=0" in opts and "8000 to 32000 MB" in err, err
        return
    job = covered(job_id)
    assert set(job["nodes"]) == {"n2"}, job


def test_partition_shrunk_back_caps_again(c):
    """The view follows every change (the memo of answers is flushed): the
    same shape asked again after each update gets that update's answer."""
    answers = []
    for nodes in ("n1,n2", "n1", "n1,n2", "n2"):
        small_nodes(nodes)
        answers.append(memory_answer())
    assert answers == ["refused", "8000", "refused", "32000"], answers


def test_runtime_partition_is_counted(c):
    """A partition created at run time holding n2 only."""
    run("scontrol", "create", "PartitionName=late", "Nodes=n2",
        "MaxTime=INFINITE", "State=UP")
    try:
        job_id, err = submit("-p", "late", "-c", "4", "--mem=0")
        assert job_id, err
        job = covered(job_id)
        assert job["nodes"]["n2"]["k8smemory"] == 32000, job
    finally:
        run("scancel", "--user=root", check=False)
        time.sleep(1)
        run("scontrol", "delete", "PartitionName=late", check=False)


def test_reconfigure_is_followed(c):
    """`scontrol reconfigure` reloads slurm.conf (small = n1), or keeps the
    partition as updated, depending on the release: whichever slurmctld
    then has, the answer follows it."""
    small_nodes("n1,n2")
    assert memory_answer() == "refused"
    run("scontrol", "reconfigure")
    deadline = time.monotonic() + 60
    while True:
        proc = run("scontrol", "show", "partition", "small", check=False)
        if proc.returncode == 0 and "TotalNodes=" in proc.stdout:
            break
        assert time.monotonic() < deadline, proc.stderr
        time.sleep(0.5)
    total = int(re.search(r"TotalNodes=(\d+)", proc.stdout).group(1))
    assert memory_answer() == ("8000" if total == 1 else "refused"), proc.stdout


def test_dynamic_node_in_a_nodes_all_partition(c):
    """`slurmd -Z` brings n3 (64 CPUs) into `debug` (Nodes=ALL), which
    slurm.conf sizes by n1 and n2 alone.  Last in the module: n3 stays."""
    cpus, memory = SIZES["n3"]
    os.makedirs(os.path.join(c.work, "spool", "n3"), exist_ok=True)
    c.start_slurmd("n3", dynamic_conf=f"CPUs={cpus} RealMemory={memory} "
                                      f"Gres=k8scpu:{cpus},k8smemory:{memory}")
    c.wait_nodes_idle(["n3"])
    job_id, err = submit("-p", "debug", "-w", "n3", "-n", "40", "--mincpus=2")
    assert job_id, err
    job = covered(job_id)
    assert job["nodes"]["n3"]["cpus"] == 40, job
