"""Slurm inside Kubernetes as SchedMD's slurm-operator runs it (`cluster up
--kubernetes --containerized slinky`), the coordinator with worker_pods =
"slinky" (root only).

Three kwok nodes of 4 CPUs and 8000 MB and two worker pods labelled as the
operator's NodeSet labels them, placed by the real kube-scheduler; each
pod's slurmd is a real dynamic node that is the whole host with what lies
outside the pod's limits held back (CoreSpecCount, MemSpecLimit).  Checked
from the ground truth: the API server's pods and GenericNodes, slurmctld's
nodes (`scontrol show node`) and what it accepts or runs.

Ports: port(29500) slurmctld, +1 SlurmdPort (22.05: every worker's, each at
its own loopback address), +2, +3 the workers' own (23.11 on); the control
plane pick_ports(29900, 29990).
"""
import re
import subprocess

import pytest

from conftest_kube import pick_ports, wait
from ground_truth import count_ids
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.testbed import slinky
from worker_world import containerized_world, force_delete_under_a_job, generic_node_counting, \
    job_state, k8scpu_held, node, pends_until_pod_gone, pods, put_pod

pytestmark = requires_slurm
NODES, CPUS, MEMORY = 3, 4, 8000
LIMIT_CPUS, LIMIT_MB = slinky.limits(CPUS, MEMORY)
S0, S1 = slinky.slurm_node_name(0), slinky.slurm_node_name(1)
CAPACITY = {s: (LIMIT_CPUS, LIMIT_MB) for s in (S0, S1)}


@pytest.fixture(scope="module")
def world():
    yield from containerized_world("pyk8sres-slinky-", layout="slinky", nodes=NODES, cpus=CPUS,
                                   memory=MEMORY, base_port=port(29500),
                                   kube_port=pick_ports(29900, 29990), slurm=SLURM)


def slurm_name(p: dict) -> str | None:
    """A worker pod's Slurm node: the operator's hostname label."""
    return (p["metadata"].get("labels") or {}).get(slinky.HOSTNAME_LABEL)


def sbatch(c, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args],
                          env=c.env, capture_output=True, text=True, cwd="/tmp")


def test_workers_are_labelled_as_the_operator_labels_them_one_per_node(world):
    _, kube = world
    # The cluster is up once the slurmds registered; kwok reports the pods
    # Running on its own time (later under load).
    wait(lambda: len(pods(kube)) == 2 and all(
        p["status"].get("phase") == "Running" for p in pods(kube).values()),
        "both worker pods Running", 30)
    workers = pods(kube)
    assert sorted(workers) == ["slurm-worker-slinky-0", "slurm-worker-slinky-1"]
    for i, (name, p) in enumerate(sorted(workers.items())):
        labels = p["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "slurmd", labels
        assert labels["app.kubernetes.io/component"] == "worker", labels
        assert labels["app.kubernetes.io/instance"] == "slurm-worker-slinky", labels
        assert labels["slinky.slurm.net/cluster"] == "slurm", labels
        assert labels["nodeset.slinky.slurm.net/pod-hostname"] == f"slinky-{i}", labels
        assert p["spec"]["hostname"] == f"slinky-{i}"
    bound = {p["spec"]["nodeName"] for p in workers.values()}
    assert len(bound) == 2 and all(b.startswith("cn-hongkong.10.1.0.") for b in bound), bound


def test_each_worker_is_the_whole_host_less_what_lies_outside_its_limits(world):
    """The entrypoint's `slurmd -Z --conf 'Features=<nodeset> CPUs=<host>
    RealMemory=<host> CoreSpecCount=.. MemSpecLimit=..'`; node_features gives
    the node k8scpu/k8smemory as Slurm schedules it: CPUs less the
    specialized ones, RealMemory less MemSpecLimit."""
    c, _ = world
    for name in (S0, "slinky-1"):
        n = node(c, name)
        assert "DYNAMIC_NORM" in n["State"] and n["State"].startswith("IDLE"), n
        assert (n["CPUTot"], n["RealMemory"]) == (str(CPUS), str(MEMORY)), n
        assert (n["CoreSpecCount"], n["MemSpecLimit"]) == (
            str(CPUS - LIMIT_CPUS), str(MEMORY - LIMIT_MB)), n
        assert n["AvailableFeatures"] == "slinky" and n["Partitions"] == "debug", n
        threads = int(n["ThreadsPerCore"])
        schedulable = int(n["CPUTot"]) - int(n["CoreSpecCount"]) * threads
        if "CPUEfctv" in n:                 # 23.02 on print Slurm's own figure
            assert int(n["CPUEfctv"]) == schedulable, n
        assert n["Gres"] == (f"k8scpu:{schedulable},"
                             f"k8smemory:{int(n['RealMemory']) - int(n['MemSpecLimit'])}"), n
        assert schedulable == LIMIT_CPUS
        with open(f"/proc/{c.pid(f'slurmd-{name}')}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        assert argv[argv.index("--conf") + 1].startswith(
            f"Features=slinky CPUs={CPUS} RealMemory={MEMORY} "
            f"CoreSpecCount={CPUS - LIMIT_CPUS} MemSpecLimit={MEMORY - LIMIT_MB}"), argv


def test_slurm_itself_schedules_no_more_than_that(world):
    """Ground truth for the capacity: slurmctld refuses a job asking for the
    host's CPUs on one worker and runs one asking for the schedulable ones."""
    c, _ = world
    too_big = sbatch(c, "-w", S0, "-c", str(CPUS), "--wrap", "true")
    assert too_big.returncode != 0, too_big.stdout
    fits = sbatch(c, "-w", S0, "-c", str(LIMIT_CPUS), "--wrap", "true")
    assert fits.returncode == 0, fits.stderr
    job = fits.stdout.strip().split(";")[0]
    assert wait(lambda: job_state(c, job) == "COMPLETED", f"job {job} to run", 60)


def test_a_job_asking_for_all_of_a_workers_memory_runs(world):
    """--mem=0: Slurm gives the job RealMemory less MemSpecLimit, and
    job_submit asks that much k8smemory (not RealMemory, which the node
    never has)."""
    c, _ = world
    proc = sbatch(c, "-w", S0, "-c", "1", "--mem=0", "--wrap", "true")
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    shown = subprocess.run(["scontrol", "show", "job", job], env=c.env, capture_output=True,
                           text=True).stdout
    assert f"k8smemory:{LIMIT_MB}" in shown, shown
    assert wait(lambda: job_state(c, job) == "COMPLETED", f"job {job} to run", 60)


def test_an_exclusive_job_runs_asking_the_cpus_slurm_allocates_it(world):
    """--exclusive: Slurm gives the job every CPU of the node but the
    specialized ones (cons_tres _clear_spec_cores), and job_submit asks that
    much k8scpu (not CPUTot, which the node never has)."""
    c, _ = world
    proc = sbatch(c, "-w", S0, "--exclusive", "-n1", "--wrap", "sleep 5")
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    assert wait(lambda: job_state(c, job) == "RUNNING", f"job {job} to start", 60)
    held = k8scpu_held(c, job)
    assert [n for n, _, _ in held] == [S0], held
    assert held[0][2] == count_ids(held[0][1]) == LIMIT_CPUS, held
    assert wait(lambda: job_state(c, job) == "COMPLETED", f"job {job} to end", 60)


@pytest.mark.parametrize("shape", [["--threads-per-core=1"], ["--mincpus=2"]])
def test_a_job_sized_by_the_most_a_worker_can_get_runs(world, shape):
    """-n 5 on the two workers, a shape whose k8scpu is the most tasks a node
    can get (4 here) capped at the biggest node's CPUs: that cap is the
    node's effective CPUs (CPUTot less the specialized cores, all Slurm can
    allocate there), so each node asks what Slurm may give it and no more
    than its k8scpu, and the job runs (on CPUTot it asked 4 > 3 and was
    refused)."""
    c, _ = world
    proc = sbatch(c, "-N2", "-n5", *shape, "--wrap", "sleep 5")
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    assert wait(lambda: job_state(c, job) == "RUNNING", f"job {job} to start", 60)
    held = k8scpu_held(c, job)
    assert sorted(n for n, _, _ in held) == [S0, "slinky-1"], held
    assert sum(count_ids(ids) for _, ids, _ in held) >= 5, held
    for _, ids, k8scpu in held:
        assert count_ids(ids) <= k8scpu <= LIMIT_CPUS, held
    assert wait(lambda: job_state(c, job) == "COMPLETED", f"job {job} to end", 60)
    assert wait(lambda: all(re.search(r"k8scpu:0\b", node(c, n).get("GresUsed", ""))
                            for n in (S0, "slinky-1")), "the workers' k8scpu to be free", 30)


def test_generic_node_aliases_the_slurm_node_and_jobs_pend_behind_pods(world):
    """NAME the Kubernetes node, ALIAS the Slurm node (the pod-hostname, not
    the pod's name); capacity what Slurm schedules there; the Kubernetes
    share is the pod beside the worker, never the worker itself; a job that
    needs what that pod holds pends until it goes."""
    c, kube = world
    host = pods(kube)["slurm-worker-slinky-0"]["spec"]["nodeName"]
    put_pod(kube, "beside", host, "1500m", "2000Mi")
    g = wait(lambda: generic_node_counting(kube, host, "1500m", "2000Mi"),
             f"GenericNode {host} to count the pod beside the worker", 30)
    assert g["spec"]["alias"] == S0 and g["spec"]["type"] == "Slurm", g
    assert g["status"]["capacity"] == {"cpu": str(LIMIT_CPUS), "memory": f"{LIMIT_MB}Mi"}, g
    # the ledger holds the pod's share, rounded up to whole CPUs and MB, and
    # nothing else once the earlier tests' last jobs are done completing
    wait(lambda: re.search(r"k8scpu:2\b", u := node(c, S0).get("GresUsed", "")) and
         re.search(r"k8smemory:2000\b", u), f"GresUsed of {S0}: the pod's share alone", 30)
    # LIMIT_CPUS - 2 CPUs are left beside the pod: a job asking for one more pends.
    proc = sbatch(c, "-w", S0, "-c", str(LIMIT_CPUS - 1), "--wrap", "sleep 1")
    assert proc.returncode == 0, proc.stderr
    pends_until_pod_gone(c, kube, proc.stdout.strip().split(";")[0], "beside")


def test_a_worker_pod_force_deleted_under_a_job_leaves_no_window(world):
    """As in ACK's layout (worker_world.force_delete_under_a_job): S1's pod
    force-deleted under a running job; the operator's replacement (the same
    hostname label: the same Slurm node) is bound on the free node.  A job
    that fits beside the first one only if no pod counted pends while the
    pods run; no sample shows jobs + pods over a Slurm node (the Slurm node
    read from the hostname label); S1 takes the job once they are gone."""
    c, cp = world
    first, states = force_delete_under_a_job(c, cp, S1, LIMIT_CPUS, CAPACITY, slurm_name)
    assert first == "RUNNING", f"the first job did not outlive its worker pod: {first}"
    assert states == {"PENDING"}, f"the job beside the first one did not pend: {states}"
