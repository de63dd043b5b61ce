"""Slurm inside Kubernetes as ACK runs it (`cluster up --kubernetes
--containerized ack`): worker pods are the Slurm nodes (root only).

Three kwok nodes named like a cloud's and a StatefulSet of two worker pods,
placed by the real kube-scheduler; for each bound pod the test cluster's
container runtime starts a real `slurmd -Z` named as the pod.  Checked from
the ground truth: the API server's pods and bindings, slurmctld's nodes
(`scontrol show node`), the slurmd processes themselves, and a job's output.
Then a worker moves onto the free node where a pod runs (also while the
sync daemon's watch is cut, through a relay), the pods it left behind stop
counting on it once no job of then is left, a careless operator
force-deletes a worker under a job and deletes the Node under another,
test_webhook_e2e's and test_sync's double-allocation checks run on the
workers' nodes, and a churn slice runs while workers move, all sampled: Slurm's jobs
(`scontrol -d show job`) + the pods bound beside each worker within its
Slurm node (ground_truth.workers_over_capacity).

Ports: port(29600) slurmctld, +1 SlurmdPort (22.05: every worker's, each at
its own loopback address), +2, +3 the workers' own (23.02 on); the control
plane pick_ports(29700, 29790).
"""
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes import client as kclient
from kubernetes.client.exceptions import ApiException

from churn_world import DEPLOYMENTS, NAMESPACE as CHURN_NAMESPACE, QUOTA_NAMESPACE, Churn, \
    deployment
from conftest_kube import pick_ports, wait
from ground_truth import workers_over_capacity
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.policy.ledger import REGISTERED_KEY
from pyk8sres.testbed import containerized, daemons, hybrid
from webhook_world import active, node_of, pod as webhook_pod, refused_every_way
from worker_world import containerized_world, force_delete_under_a_job, generic_node_counting, \
    job_state, layout, node, pends_until_pod_gone, pods, put_pod, replaced, sampled, Sampler, \
    sbatch, states_while

pytestmark = requires_slurm
# The churn slice (test_churn_with_worker_moves_never_double_books); a soak by hand:
# PYK8SRES_CHURN_SECONDS=1800 python3 -m pytest -s integration/test_containerized.py -k churn
CHURN_SECONDS = float(os.environ.get("PYK8SRES_CHURN_SECONDS", "60"))
NODES, CPUS, MEMORY = 3, 4, 8000
WORKER_CPUS, WORKER_MB = containerized.worker_limits(CPUS, MEMORY)
W0, W1 = "slurm-test-worker-cpu-0", "slurm-test-worker-cpu-1"
CAPACITY = {w: (WORKER_CPUS, WORKER_MB) for w in (W0, W1)}


@pytest.fixture(scope="module")
def world():
    yield from containerized_world("pyk8sres-ack-", nodes=NODES, cpus=CPUS, memory=MEMORY,
                                   base_port=port(29600), kube_port=pick_ports(29700, 29790),
                                   slurm=SLURM)


def slurmd_pid(c, name):
    return c.pid(f"slurmd-{name}")


def run_hostname(c, name) -> str:
    """A batch job on Slurm node `name`: what `hostname` printed there."""
    out = os.path.join(c.work, f"job-{time.monotonic_ns()}.out")
    proc = subprocess.run(["sbatch", "--parsable", "-w", name, "-o", out, "--wrap", "hostname"],
                          env=c.env, capture_output=True, text=True, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]

    def done():
        shown = subprocess.run(["scontrol", "show", "job", job], env=c.env, capture_output=True,
                               text=True).stdout
        state = re.search(r"JobState=(\S+)", shown).group(1)
        return state if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") else None
    assert wait(done, f"job {job} on {name} to end", 60) == "COMPLETED"
    with open(out) as f:
        return f.read().strip()


def test_workers_are_statefulset_pods_one_per_cloud_named_node(world):
    _, kube = world
    nodes = kube.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(nodes) == [f"node/cn-hongkong.10.1.0.{i}" for i in (19, 20, 21)]
    sts = json.loads(kube.kubectl("get", "statefulset", "-n", "slurm", "slurm-test-worker-cpu",
                                  "-o", "json").stdout)
    assert sts["spec"]["replicas"] == NODES - 1
    workers = pods(kube)
    assert sorted(workers) == [W0, "slurm-test-worker-cpu-1"]
    bound = [p["spec"].get("nodeName") for p in workers.values()]
    assert len(set(bound)) == 2 and set(bound) <= {n[5:] for n in nodes}, bound
    assert all(p["status"]["phase"] == "Running" for p in workers.values())


def test_each_worker_is_a_dynamic_slurm_node_sized_to_its_limits(world):
    """ACK's entrypoint: `slurmd -Z --conf "CPUs=<limit> RealMemory=<limit>"`;
    the node_features plugin gives the dynamic node its k8scpu/k8smemory at
    registration (-Z registers no GRES)."""
    c, _ = world
    for i, name in enumerate((W0, "slurm-test-worker-cpu-1")):
        n = node(c, name)
        assert "DYNAMIC_NORM" in n["State"] and n["State"].startswith("IDLE"), n
        assert (n["CPUTot"], n["RealMemory"]) == (str(WORKER_CPUS), str(WORKER_MB)), n
        assert n["Gres"] == f"k8scpu:{WORKER_CPUS},k8smemory:{WORKER_MB}", n
        assert n["AvailableFeatures"] == "cpu" and n["Partitions"] == "debug", n
        assert n["NodeHostName"] == name, n
        with open(f"/proc/{slurmd_pid(c, name)}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        assert "-Z" in argv and argv[argv.index("-N") + 1] == name, argv
        # reached at a port (23.02 on) or an address (22.05) of its own
        if containerized.slurmd_version(c) >= containerized.OWN_PORT_SINCE:
            assert argv[argv.index("--conf") + 1].endswith(f" Port={port(29600) + 2 + i}"), argv
        else:
            assert n["NodeAddr"] == f"127.0.1.{i + 1}", n


def test_each_worker_was_held_until_the_coordinator_counted_its_pods(world):
    """HoldNewNodes=yes, as a site with worker pods sets it: each worker's
    node was held whole from its slurmd's registration (slurmctld's log),
    and the sync daemon's first `set` there replaced the hold."""
    c, _ = world
    with open(os.path.join(c.work, "log", "slurmctld.log"), errors="replace") as f:
        text = f.read()
    ledger = Ledger(ledger_socket_path(c.conf))
    for name in (W0, "slurm-test-worker-cpu-1"):
        assert f"node {name} registered for the first time: held whole" in text, name
        wait(lambda: REGISTERED_KEY not in ledger.show(name)["nodes"][name]["entries"],
             f"the coordinator's set on {name}", 30)


def test_a_job_runs_on_a_worker(world):
    c, _ = world
    assert run_hostname(c, W0) == W0      # slurmd's hostname is its pod's, as in a pod


def test_generic_node_is_the_kubernetes_node_aliased_to_its_worker_and_jobs_pend_behind_pods(
        world):
    """The reference's own output: NAME the Kubernetes node, ALIAS the worker
    pod on it; a pod beside the worker holds its share of that Slurm node (the
    worker itself holds nothing), so a job that needs it pends until it goes."""
    c, kube = world
    host = pods(kube)[W0]["spec"]["nodeName"]
    put_pod(kube, "beside", host, "1735m", "2393Mi")
    g = wait(lambda: generic_node_counting(kube, host, "1735m", "2393Mi"),
             f"GenericNode {host} to count the pod beside the worker", 30)
    assert g["spec"]["alias"] == W0 and g["spec"]["type"] == "Slurm", g
    assert g["status"]["capacity"] == {"cpu": str(WORKER_CPUS), "memory": f"{WORKER_MB}Mi"}, g
    # WORKER_CPUS - 2 CPUs are left beside the pod (1735m counts as 2): a job
    # asking for all of them plus one pends, on that node only.
    proc = subprocess.run(["sbatch", "--parsable", "-w", W0, "-c", str(WORKER_CPUS - 1),
                           "-o", "/dev/null", "--wrap", "sleep 1"],
                          env=c.env, capture_output=True, text=True, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    pends_until_pod_gone(c, kube, proc.stdout.strip().split(";")[0], "beside")


def test_deleting_a_worker_pod_stops_its_slurmd_and_the_replacement_registers(world):
    c, kube = world
    old_pid, old_uid = slurmd_pid(c, W0), pods(kube)[W0]["metadata"]["uid"]
    old_start = node(c, W0)["SlurmdStartTime"]
    assert old_pid
    kube.kubectl("delete", "pod", "-n", "slurm", W0, "--wait=false")
    wait(lambda: not daemons.alive(old_pid), "the deleted pod's slurmd to stop", 20)
    new = wait(lambda: (p := pods(kube).get(W0)) and p["metadata"]["uid"] != old_uid and
               p["spec"].get("nodeName") and p, "the StatefulSet's replacement pod to be bound",
               60)
    new_pid = wait(lambda: slurmd_pid(c, W0), "the replacement's slurmd", 30)
    assert new_pid != old_pid
    n = wait(lambda: (n := node(c, W0)).get("SlurmdStartTime", old_start) > old_start and
             n["State"].startswith("IDLE") and n, "the replacement slurmd to register", 60)
    assert n["Gres"] == f"k8scpu:{WORKER_CPUS},k8smemory:{WORKER_MB}", n
    assert new["spec"]["nodeName"].startswith("cn-hongkong.10.1.0.")
    assert run_hostname(c, W0) == W0


def test_a_worker_moved_to_the_free_node_takes_no_job_before_its_pods_are_counted(world):
    """W0's pod is deleted while a job runs on W1 and a pod runs on the free
    node; kube-scheduler places the replacement there (W0's old node is
    cordoned) and its slurmd registers as W0 again.  A job submitted for W0
    meanwhile, needing all of it, pends until the pod beside the new worker
    is gone; at no sample do jobs + pods exceed a Slurm node."""
    c, cp = world
    hosts, free = layout(cp)
    old = hosts[W0]
    running = sbatch(c, "-w", W1, "-c", "1", "--wrap", "sleep 300")
    put_pod(cp, "on-the-free-node", free, "2", "2000Mi")
    wait(lambda: job_state(c, running) == "RUNNING", "the job on W1", 30)
    cp.kubectl("cordon", old)
    try:
        with sampled(c, cp, CAPACITY) as sampler:
            sampler.cancel.append(running)
            start, uid = node(c, W0)["SlurmdStartTime"], pods(cp)[W0]["metadata"]["uid"]
            cp.kubectl("delete", "pod", "-n", "slurm", W0, "--wait=false")
            time.sleep(1)            # the sync daemon's reaction to the deletion
            whole = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS), "--wrap", "sleep 300")
            sampler.cancel.append(whole)
            # the new slurmd registered, the pod still beside it
            states = states_while(sampler, whole, lambda: replaced(cp, c, W0, uid, start, free),
                                  "the replacement bound on the free node, registered")
            cp.kubectl("delete", "pod", "-n", "default", "on-the-free-node", "--wait=false")
            if states == {"PENDING"}:
                wait(lambda: job_state(c, whole) == "RUNNING",
                     "the job to start once the pod is gone", 60)
            time.sleep(2)            # samples of the job running on the moved worker
    finally:
        cp.kubectl("uncordon", old)
    assert states == {"PENDING"}, (f"the job for all of W0 did not pend beside the pod: "
                                   f"{states}; W0: {node(c, W0)}")


def test_a_worker_pod_force_deleted_under_a_job_leaves_no_window(world):
    """A careless operator force-deletes W1's pod under a running job, with
    pods beside it and on the free node where its replacement lands
    (worker_world.force_delete_under_a_job): a job that fits beside the
    first one only if no pod counted pends while the pods run; no sample
    shows jobs + pods over a Slurm node; W1 takes the job once they are gone."""
    c, cp = world
    first, states = force_delete_under_a_job(c, cp, W1, WORKER_CPUS, CAPACITY)
    assert first == "RUNNING", f"the first job did not outlive its worker pod: {first}"
    assert states == {"PENDING"}, f"the job beside the first one did not pend: {states}"


def test_a_deleted_node_object_under_a_worker_releases_nothing(world):
    """A careless operator deletes the Node object under W0 (`kubectl delete
    node`) while a job runs there and a pod runs beside it; the machine goes
    on, as its kubelet does, and the Node is registered again (as kwok's
    would be).  Meanwhile nothing is released: a job that fits only if the
    pod's share were handed back pends throughout, and starts once the pod
    is gone; no sample shows jobs + pods over a Slurm node."""
    c, cp = world
    host = pods(cp)[W0]["spec"]["nodeName"]
    body = json.loads(cp.kubectl("get", "node", host, "-o", "json").stdout)
    body["metadata"] = {k: v for k, v in body["metadata"].items()
                        if k in ("name", "labels", "annotations")}
    running = sbatch(c, "-w", W0, "-c", "1", "--wrap", "sleep 300")
    put_pod(cp, "beside-w0", host, "1", "1000Mi")
    wait(lambda: job_state(c, running) == "RUNNING", "the job on W0", 30)
    wait(lambda: generic_node_counting(cp, host, "1", "1000Mi"), f"{host} counting its pod", 30)
    try:
        with sampled(c, cp, CAPACITY) as sampler:
            sampler.cancel.append(running)
            cp.kubectl("delete", "node", host)
            rest = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS - 1), "--wrap", "sleep 300")
            sampler.cancel.append(rest)
            deadline = time.monotonic() + 10      # well within pod GC's wait for orphans
            states = states_while(sampler, rest, lambda: time.monotonic() > deadline,
                                  "the Node gone a while", 20)
            cp.kubectl("create", "-f", "-", input=json.dumps(body))
            states |= states_while(sampler, rest, lambda: generic_node_counting(
                cp, host, "1", "1000Mi"), f"{host} back and counting its pod", 30)
            assert pods(cp)[W0]["spec"]["nodeName"] == host, "the worker was not kept"
            cp.kubectl("delete", "pod", "-n", "default", "beside-w0", "--wait=false")
            wait(lambda: job_state(c, rest) == "RUNNING", "W0 to take the job once the pod is "
                 "gone", 60)
            time.sleep(2)
    finally:
        cp.kubectl("delete", "pod", "-n", "default", "beside-w0", "--wait=false",
                   "--ignore-not-found")
    assert states == {"PENDING"}, f"the job beside the pod did not pend: {states}"


@pytest.fixture
def admission_ns(world):
    """A namespace of the test's pods, once the webhook is in force for it
    (webhook_world.active, on W0's node), and that client."""
    _, cp = world
    kube = kube_calls.Kube(cp.kubeconfig)
    name = "adm-" + uuid.uuid4().hex[:8]
    kube.core.create_namespace({"metadata": {"name": name}})
    active(kube, name, pods(cp)[W0]["spec"]["nodeName"])
    yield kube, name
    kube.core.delete_namespace(name)


def test_every_way_onto_a_worker_held_by_jobs_is_refused(world, admission_ns):
    """test_webhook_e2e's refusals on a worker's node: a job holds all of W0
    but one CPU; a pod wanting two is refused created there, dressed as a
    worker, and bound there; kube-scheduler places it elsewhere; one that
    fits is admitted and the next job pends behind it."""
    c, cp = world
    kube, ns = admission_ns
    host = pods(cp)[W0]["spec"]["nodeName"]
    with sampled(c, cp, CAPACITY) as sampler:
        job = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS - 1), "--wrap", "sleep 300")
        sampler.cancel.append(job)
        wait(lambda: job_state(c, job) == "RUNNING", "the job on W0", 30)
        body = refused_every_way(kube, ns, host, "2")
        assert f"Slurm jobs hold {WORKER_CPUS - 1} of {WORKER_CPUS} CPUs" in body, body
        kube_calls.create_pod(kube, ns, webhook_pod("placed", "2"))
        assert wait(lambda: node_of(kube, ns, "placed"), "the pod placed", 30) != host
        kube_calls.create_pod(kube, ns, webhook_pod("fits", "1", "512Mi", node=host))
        behind = sbatch(c, "-w", W0, "-c", "1", "--wrap", "sleep 300")
        sampler.cancel.append(behind)
        time.sleep(3)
        assert job_state(c, behind) == "PENDING"


def test_concurrent_admissions_and_jobs_on_a_worker_never_double_book(world, admission_ns):
    """Pods created onto W1's node all at once while jobs for W1 are
    submitted: whatever wins, jobs + admitted pods stay within W1 at every
    sample, and what does not fit is refused or pends."""
    c, cp = world
    kube, ns = admission_ns
    host = pods(cp)[W1]["spec"]["nodeName"]

    def create(i):
        try:
            kube_calls.create_pod(kube, ns, webhook_pod(f"burst-{i}", "1", "512Mi", node=host))
            return "admitted"
        except ApiException as e:
            assert e.status == 403 and f"does not fit on node {host}" in e.body, e.body
            return "refused"
    with sampled(c, cp, CAPACITY) as sampler, ThreadPoolExecutor(8) as pool:
        answers = pool.map(create, range(2 * WORKER_CPUS))
        for _ in range(WORKER_CPUS):
            sampler.cancel.append(sbatch(c, "-w", W1, "-c", "1", "--wrap", "sleep 300"))
        answers = list(answers)
        time.sleep(5)            # samples of whatever runs there now
        running = [j for j in sampler.cancel if job_state(c, j) == "RUNNING"]
    assert answers.count("admitted") + len(running) <= WORKER_CPUS, (answers, running)
    assert answers.count("refused") >= WORKER_CPUS, answers


def test_a_pod_force_deleted_beside_a_worker_holds_its_share_for_its_grace_period(world):
    """test_sync's forced delete, beside a worker: the object goes at once,
    its containers only within its grace period; no job takes those CPUs
    of the worker's Slurm node until that has run out."""
    c, cp = world
    host = pods(cp)[W0]["spec"]["nodeName"]
    put_pod(cp, "forced", host, "2", "1000Mi", grace=8)
    wait(lambda: generic_node_counting(cp, host, "2", "1000Mi"), f"{host} counting its pod", 30)
    cp.kubectl("delete", "pod", "-n", "default", "forced", "--grace-period=0", "--force")
    t0 = time.monotonic()
    job = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS - 1), "--wrap", "sleep 300")
    try:
        while time.monotonic() - t0 < 7:
            assert job_state(c, job) == "PENDING", "a job took the CPUs of a pod that may run"
            time.sleep(0.3)
        wait(lambda: job_state(c, job) == "RUNNING", "the job, once the grace ran out", 30)
        assert time.monotonic() - t0 >= 8
    finally:
        subprocess.run(["scancel", job], env=c.env, capture_output=True)


def k8scpu_used(c, name) -> int:
    """Slurm's own count of k8scpu allocated on a node: its jobs' + the
    ledger's share (scontrol -d show node: GresUsed)."""
    m = re.search(r"k8scpu:(\d+)", node(c, name).get("GresUsed", ""))
    return int(m.group(1)) if m else -1


def move_w0(c, cp) -> tuple[str, str]:
    """Cordon W0's node, delete its pod; the replacement binds on the free
    node and its slurmd registers.  Returns (old node, new node)."""
    hosts = {name: p["spec"]["nodeName"] for name, p in pods(cp).items()}
    nodes = {n[5:] for n in cp.kubectl("get", "nodes", "-o", "name").stdout.split()}
    old, (free,) = hosts[W0], nodes - set(hosts.values())
    start = node(c, W0)["SlurmdStartTime"]
    cp.kubectl("cordon", old)
    cp.kubectl("delete", "pod", "-n", "slurm", W0, "--wait=false")
    wait(lambda: (p := pods(cp).get(W0)) and p["spec"].get("nodeName") == free and
         not p["metadata"].get("deletionTimestamp"), "the replacement bound on the free node",
         60)
    wait(lambda: node(c, W0).get("SlurmdStartTime", start) > start,
         "W0's slurmd registered again", 60)
    return old, free


def long_lived_pod_beside_w0(c, cp, name: str, job: str | None = None) -> str:
    """A pod that outlives any move (a DaemonSet's) on W0's node, counted on
    W0 (1 CPU, plus `job`'s); returns that node."""
    old = pods(cp)[W0]["spec"]["nodeName"]
    wait(lambda: not cp.kubectl("get", "pods", "-n", "default", "-o", "name").stdout.strip(),
         "the pods of earlier tests gone", 30)
    put_pod(cp, name, old, "1", "1000Mi")
    wait(lambda: k8scpu_used(c, W0) == 1 + bool(job), f"{name} counted on W0", 30)
    return old


def test_a_moved_workers_old_long_lived_pod_stops_counting_on_it(world):
    """No job on W0 when it moves: once the replacement maps W0 from the free
    node, the pod left on the old node (it never leaves) no longer counts on
    W0, and a job needing all of W0 runs."""
    c, cp = world
    old = long_lived_pod_beside_w0(c, cp, "daemon-a")
    sampler = Sampler(c, kube_calls.Kube(cp.kubeconfig), CAPACITY)
    sampler.start()
    job = None
    try:
        move_w0(c, cp)
        wait(lambda: k8scpu_used(c, W0) == 0, "W0's share to let the old node's pod go", 15)
        job = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS), "--wrap", "sleep 1")
        wait(lambda: job_state(c, job) in ("RUNNING", "COMPLETING", "COMPLETED"),
             "the job needing all of W0 to start", 20)
        assert cp.kubectl("get", "pod", "daemon-a", "-o",
                          "jsonpath={.spec.nodeName}").stdout == old     # still there
    finally:
        sampler.stop.set()
        sampler.join(30)
        cp.kubectl("uncordon", old)
        cp.kubectl("delete", "pod", "daemon-a", "--wait=false")
        subprocess.run(["scancel", *filter(None, (job,))], env=c.env, capture_output=True)
    assert sampler.violations == [], sampler.violations
    assert not sampler.unreadable and sampler.samples >= 5, (sampler.samples,
                                                             sampler.unreadable)


def test_a_moved_workers_old_pod_counts_until_the_job_of_then_ends(world):
    """A job runs on W0 when it moves: the pod on the old node ran beside it,
    so the ledger holds it on W0 (or all of W0, fenced) at every sample
    while Slurm lists that job there, and lets it go once the job is gone."""
    c, cp = world
    wait(lambda: k8scpu_used(c, W0) == 0, "W0 free of the last test's pods", 30)
    job = sbatch(c, "-w", W0, "-c", "1", "--wrap", "sleep 300")
    wait(lambda: job_state(c, job) == "RUNNING", "the job on W0", 30)
    old = long_lived_pod_beside_w0(c, cp, "daemon-b", job)
    uid = json.loads(cp.kubectl("get", "pod", "daemon-b", "-o", "json").stdout)["metadata"]["uid"]
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    seen, stop, moved = [], threading.Event(), threading.Event()

    def watch():      # (job state, what holds the pod's CPU on W0, W0 moved) while it is listed
        while not stop.is_set():
            state = job_state(c, job)
            entries = ledger.show(W0)["nodes"][W0].get("entries") or {}
            if state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"):
                seen.append((state, "pod" if uid in entries else "fence"
                             if "slurm:fence" in entries else "nothing", moved.is_set()))
            stop.wait(0.2)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        move_w0(c, cp)
        moved.set()
        time.sleep(3)             # the replacement placed, the job of then still listed
        subprocess.run(["scancel", job], env=c.env, capture_output=True)
        wait(lambda: job_state(c, job) not in ("RUNNING", "COMPLETING", "CONFIGURING"),
             "the job of then to end", 60)
        wait(lambda: k8scpu_used(c, W0) == 0, "W0's share to let the old node's pod go", 20)
    finally:
        stop.set()
        t.join(10)
        ledger.close()
        cp.kubectl("uncordon", old)
        cp.kubectl("delete", "pod", "daemon-b", "--wait=false")
        subprocess.run(["scancel", job], env=c.env, capture_output=True)
    assert any(after for *_, after in seen), seen     # sampled once the replacement took W0
    assert all(held != "nothing" for _, held, _ in seen), [
        (i, x) for i, x in enumerate(seen) if x[1] == "nothing"] + [len(seen)]


class Cuttable(threading.Thread):
    """A TCP relay from 127.0.0.1 to kube-apiserver for the sync daemon
    alone: cut() drops its connections and refuses new ones (its watches
    break, its relists fail) while everyone else reaches the API server."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.upstream, self.cut_off, self.conns = port, False, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]

    def run(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off:
                down.close()
                continue
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.cut_off = True
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns = []

    def close(self):
        self.cut()
        self.listener.close()


def sync_through(c, cp, relay: Cuttable) -> None:
    """The sync daemon restarted, reaching the API server through `relay`."""
    c.stop("sync")
    own = hybrid.coordinator_kubeconfig(c, cp, hybrid.SYNC_ACCOUNT)
    with open(own) as f:
        doc = json.load(f)
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    path = own.replace(".kubeconfig", "-relayed.kubeconfig")
    with open(path, "w") as f:
        json.dump(doc, f)
    hybrid.own(path)
    hybrid.start_coordinator(c, "sync", hybrid.coordinator_argv(
        c, cp, "sync", path,
        hybrid.coordinator_config(c, cp, "sync", containerized.coordinator_settings(
            containerized.ACK)),
        "--metrics-address", f"127.0.0.1:{cp.ports.sync_metrics}"))

    def ready():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{cp.ports.sync_metrics}/readyz",
                                        timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    wait(ready, "the relayed sync daemon listed and watching", 30)


def test_a_worker_moved_while_the_sync_daemons_watch_is_broken_takes_no_job(world):
    """The sync daemon's connection to the API server is cut (its watch
    broken, every relist refused) before W0's pod is deleted: it never sees
    the deletion.  W0's replacement registers on the free node, where a pod
    runs; a job needing all of W0 pends all along (W0 is held whole while
    the pods are not trusted), and starts once the daemon lists again and
    that pod is gone.  Ground truth at every sample."""
    c, cp = world
    wait(lambda: k8scpu_used(c, W0) == 0, "W0 free of the last test's pods", 30)
    hosts = {name: p["spec"]["nodeName"] for name, p in pods(cp).items()}
    nodes = {n[5:] for n in cp.kubectl("get", "nodes", "-o", "name").stdout.split()}
    old, (free,) = hosts[W0], nodes - set(hosts.values())
    relay = Cuttable(int(cp.url.rsplit(":", 1)[1]))
    relay.start()
    sync_through(c, cp, relay)
    put_pod(cp, "on-the-free-node", free, "2", "2000Mi")
    time.sleep(2)                # a cycle or two: W0 known as a worker's
    sampler = Sampler(c, kube_calls.Kube(cp.kubeconfig), CAPACITY)
    sampler.start()
    whole, states = None, set()
    try:
        relay.cut()
        time.sleep(1)            # the daemon saw its watch break
        move_w0(c, cp)
        whole = sbatch(c, "-w", W0, "-c", str(WORKER_CPUS), "--wrap", "sleep 300")
        sampler.job = whole
        time.sleep(5)            # the new slurmd registered, the daemon still cut off
        relay.cut_off = False
        time.sleep(5)            # relisted: the pod beside W0 counted
        sampler.job, states = None, set(sampler.states)
        cp.kubectl("delete", "pod", "-n", "default", "on-the-free-node", "--wait=false")
        wait(lambda: job_state(c, whole) == "RUNNING", "the job to start once the pod is gone",
             60)
    finally:
        sampler.stop.set()
        sampler.join(30)
        cp.kubectl("uncordon", old)
        subprocess.run(["scancel", *filter(None, (whole,))], env=c.env, capture_output=True)
        c.stop("sync")
        relay.close()
        hybrid.start_sync(c, cp, settings=containerized.coordinator_settings(containerized.ACK))
    assert sampler.violations == [], sampler.violations
    assert states == {"PENDING"}, states
    assert not sampler.unreadable and sampler.samples >= 10, (sampler.samples,
                                                              sampler.unreadable)


def move_workers(churn, c, cp, moved: list, errors: list):
    """As an operator moves a worker off a node: drain its Slurm node
    (Slinky's does before a scale-in) until its jobs are done, cordon the
    Kubernetes node, delete the pod; kube-scheduler binds the StatefulSet's
    replacement on the free node (preempting churn pods there if need be),
    its slurmd registers, the node is resumed.  A job still on a deleted worker dies with its pod
    while Slurm lists it until the node registers again: ground truth from
    Slurm could not tell, hence the drain."""
    while not churn.stop.wait(churn.rnd.uniform(2, 4)):
        name = churn.rnd.choice((W0, W1))
        subprocess.run(["scontrol", "update", f"NodeName={name}", "State=DRAIN",
                        "Reason=moving"], env=c.env, capture_output=True)
        try:
            host = pods(cp)[name]["spec"].get("nodeName")
            wait(lambda: node(c, name).get("CPUAlloc") == "0" and
                 "COMPLETING" not in node(c, name).get("State", ""), f"{name} drained", 60)
            start = node(c, name)["SlurmdStartTime"]
            cp.kubectl("cordon", host)
            try:
                cp.kubectl("delete", "pod", "-n", "slurm", name, "--wait=false")
                new = wait(lambda: (p := pods(cp).get(name)) and p["spec"].get("nodeName") and
                           not p["metadata"].get("deletionTimestamp") and p["spec"]["nodeName"],
                           f"{name}'s replacement bound", 90)
            finally:
                cp.kubectl("uncordon", host)
            wait(lambda: node(c, name).get("SlurmdStartTime", start) > start,
                 f"{name}'s slurmd registered again", 60)
            moved.append(f"{name}: {host} -> {new}")
        except Exception as e:     # noqa: BLE001 - reported by the test
            errors.append(f"{time.strftime('%T')} {name}: {type(e).__name__}: {e}")
            return
        finally:
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                           env=c.env, capture_output=True)


def roll_workers(c, cp):
    """Replace both worker pods at once, so both carry the StatefulSet's new
    priority: a replacement with it would otherwise preempt the other worker
    (lower priority, in its way by the required anti-affinity)."""
    starts = {w: node(c, w)["SlurmdStartTime"] for w in (W0, W1)}
    cp.kubectl("delete", "pod", "-n", "slurm", W0, W1, "--wait=false")
    for w in (W0, W1):
        wait(lambda: (p := pods(cp).get(w)) and p["spec"].get("nodeName") and
             p["spec"].get("priorityClassName") == "slurm-worker" and
             not p["metadata"].get("deletionTimestamp"), f"{w}'s replacement bound", 90)
        wait(lambda: node(c, w).get("SlurmdStartTime", starts[w]) > starts[w],
             f"{w}'s slurmd registered again", 60)
        subprocess.run(["scontrol", "update", f"NodeName={w}", "State=RESUME"],
                       env=c.env, capture_output=True)


def test_churn_with_worker_moves_never_double_books(world):
    """A slice of the churn (churn_world.Churn: jobs and sruns, pods put on
    nodes directly and placed by kube-scheduler, Deployments scaled, pods
    deleted, force-deleted and resized, creates a quota refuses) in this
    layout, with worker pods replaced meanwhile (move_workers) in place of
    the hybrid churn's faults; ground truth (workers_over_capacity) at every sample."""
    c, cp = world
    kube = kube_calls.Kube(cp.kubeconfig, None, 10)
    for ns in (CHURN_NAMESPACE, QUOTA_NAMESPACE):
        kube.core.create_namespace({"metadata": {"name": ns}})
    kube.core.create_namespaced_resource_quota(QUOTA_NAMESPACE, {
        "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    apps = kclient.AppsV1Api(kube.api)
    for name, (cpu, memory) in DEPLOYMENTS.items():
        apps.create_namespaced_deployment(CHURN_NAMESPACE, deployment(name, cpu, memory))
    # Workers preempt ordinary pods, as a site runs them: else the churn's
    # pods take the room a deleted worker left and its replacement pends.
    # OnDelete: the running workers stay until move_workers deletes them.
    cp.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": "slurm-worker"}, "value": 1000000}))
    cp.kubectl("patch", "statefulset", "-n", "slurm", containerized.statefulset_name(),
               "--type=merge", "-p",
               json.dumps({"spec": {"updateStrategy": {"type": "OnDelete", "rollingUpdate": None},
                                    "template": {"spec": {"priorityClassName": "slurm-worker"}}}}))
    roll_workers(c, cp)
    nodes = [n[5:] for n in cp.kubectl("get", "nodes", "-o", "name").stdout.split()]
    churn = Churn(c, cp, kube, seed=int(os.environ.get("PYK8SRES_CHURN_SEED", "8")), nodes=nodes,
                  over=lambda ch: workers_over_capacity(c.env, ch.kube, CAPACITY, "slurm",
                                                        ch.still_running(), crowded))
    moved: list[str] = []
    errors: list[str] = []
    crowded: list[str] = []      # pods alone over a worker (workers_over_capacity)
    loops = [threading.Thread(target=f, daemon=True) for f in
             (churn.submit_jobs, churn.create_pods, churn.scale_deployments, churn.delete_pods,
              churn.resize_pods, churn.quota_refused_creates, churn.check,
              lambda: move_workers(churn, c, cp, moved, errors))]
    for t in loops:
        t.start()
    try:
        time.sleep(CHURN_SECONDS)
    finally:
        churn.stop.set()
        for t in loops:
            t.join(120)
        for name in DEPLOYMENTS:
            apps.patch_namespaced_deployment_scale(name, CHURN_NAMESPACE,
                                                   {"spec": {"replicas": 0}})
        subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
    counts = churn.counts
    print(f"\ncontainerized churn: {counts}; moves: {moved}; samples of pods alone over a "
          f"worker (bound while none ran there; no job beside them): {len(crowded)} "
          f"{crowded[:2]}")
    assert not churn.violations, (f"{len(churn.violations)} violations: "
                                  f"{churn.violations[:5]}\n{churn.first_violation}")
    assert not churn.check_errors, churn.check_errors[:5]
    assert not churn.unexplained(), churn.unexplained()[:5]     # no fault explains any
    assert not errors, errors
    assert counts["samples"] > 50 and len(moved) >= 2, (counts, moved)
    assert all(m.split(" -> ")[0].split()[-1] != m.split(" -> ")[1] for m in moved), moved
    assert counts["pods admitted"] > 0 and counts["pods refused"] > 0
    assert counts["jobs submitted"] > 10 and counts["deployment scalings"] >= 10
