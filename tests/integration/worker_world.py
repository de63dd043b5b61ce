"""What the tests of Slurm inside Kubernetes (test_containerized: ACK's
layout, test_slinky: Slinky's) read and make the same way: Slurm's nodes
and jobs as scontrol shows them, the worker pods, a pod put straight onto a
Kubernetes node, the GenericNode once it counts that pod, and ground truth
sampled all along a block while workers move.  A worker pod's Slurm node is
slurm_name(pod): its name in ACK's layout, its hostname label in Slinky's.

`kube` is the test cluster's control plane (its kubectl); `c` the Slurm
cluster (its env).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

from conftest_kube import wait
from ground_truth import Unreadable, pod_named_node, workers_over_capacity
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.testbed import containerized, hybrid


def containerized_world(prefix: str, **up):
    """A module's cluster laid out as an operator lays it out
    (containerized.up with `up`): yields (slurm cluster, control plane);
    after, its jobs cancelled and every daemon stopped, the container
    runtime among them (asserted: it plays the workers' containers)."""
    work = tempfile.mkdtemp(prefix=prefix)
    os.chmod(work, 0o755)
    try:
        c, kube = containerized.up(work, **up)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        yield c, kube
    finally:
        subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
        stopped = hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)
        assert "container-runtime" in stopped, stopped


def node(c, name) -> dict:
    out = subprocess.run(["scontrol", "-d", "-o", "show", "node", name], env=c.env,
                         capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def job_state(c, job) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=c.env, capture_output=True,
                           text=True).stdout
    return re.search(r"JobState=(\S+)", shown).group(1)


def pods(kube) -> dict:
    """The worker pods (namespace slurm) by name."""
    items = json.loads(kube.kubectl("get", "pods", "-n", "slurm", "-o", "json").stdout)["items"]
    return {p["metadata"]["name"]: p for p in items}


def put_pod(kube, name: str, host: str, cpu: str, memory: str, grace: int = 1) -> None:
    """A pod bound straight onto `host` (no scheduler), requesting cpu/memory."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": host, "terminationGracePeriodSeconds": grace, "containers": [
                {"name": "c", "image": "busybox",
                 "resources": {"requests": {"cpu": cpu, "memory": memory}}}]}}
    kube.kubectl("create", "-f", "-", input=json.dumps(body))


def generic_node_counting(kube, host: str, cpu: str, memory: str):
    """`host`'s GenericNode once its Kubernetes share is exactly cpu/memory,
    else None (to wait on)."""
    out = kube.kubectl("get", "genericnode", host, "-o", "json", check=False)
    g = json.loads(out.stdout) if out.returncode == 0 else {}
    shares = {a["type"]: a["allocated"] for a in g.get("status", {}).get("allocatedResources", [])}
    return g if shares.get("Kubernetes") == {"cpu": cpu, "memory": memory} else None


def k8scpu_held(c, job) -> list:
    """Per node of a running job, Slurm's own word (scontrol -d show job):
    (node, CPU_IDs, the k8scpu it holds there)."""
    shown = subprocess.run(["scontrol", "-d", "show", "job", job], env=c.env,
                           capture_output=True, text=True).stdout
    return [(n, ids, int(cnt)) for n, ids, cnt in
            re.findall(r"Nodes=(\S+) CPU_IDs=(\S+) Mem=\d+ GRES=\S*k8scpu\(CNT:(\d+)\)", shown)]


def pends_until_pod_gone(c, kube, job, pod: str, seconds: float = 6) -> None:
    """The job stays PENDING for `seconds` while the pod (namespace default)
    holds its node's share, then starts once the pod is deleted."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert job_state(c, job) == "PENDING"
        time.sleep(0.5)
    kube.kubectl("delete", "pod", "-n", "default", pod, "--wait=false")
    assert wait(lambda: job_state(c, job) in ("RUNNING", "COMPLETED") and "ran",
                "the job to start once the pod is gone", 60)


def sbatch(c, *args) -> str:
    """A batch job (output discarded): its id."""
    proc = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args], env=c.env,
                          capture_output=True, text=True, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


class Sampler(threading.Thread):
    """Ground truth all along (ground_truth.workers_over_capacity): jobs +
    the pods beside each worker within its Slurm node, at every sample."""

    def __init__(self, c, kube, capacity: dict, slurm_name=pod_named_node):
        super().__init__(daemon=True)
        self.c, self.kube, self.stop = c, kube, threading.Event()
        self.capacity, self.slurm_name = capacity, slurm_name
        self.violations, self.unreadable, self.samples = [], [], 0
        self.job, self.states = None, set()     # a job whose states are recorded meanwhile
        self.cancel: list[str] = []             # jobs to cancel after (sampled)

    def run(self):
        while not self.stop.is_set():
            try:
                self.violations += workers_over_capacity(self.c.env, self.kube, self.capacity,
                                                         "slurm", slurm_name=self.slurm_name)
                self.samples += 1
                if (job := self.job) is not None:
                    self.states.add(job_state(self.c, job))
            except Unreadable as e:
                self.unreadable.append(str(e))
            self.stop.wait(0.2)


@contextlib.contextmanager
def sampled(c, cp, capacity: dict, slurm_name=pod_named_node):
    """A Sampler all along the block; after it, the jobs the block put in
    sampler.cancel cancelled, and ground truth asserted: no sample over a
    Slurm node, enough samples, none unreadable."""
    sampler = Sampler(c, kube_calls.Kube(cp.kubeconfig), capacity, slurm_name)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop.set()
        sampler.join(30)
        subprocess.run(["scancel", *sampler.cancel], env=c.env, capture_output=True)
    assert sampler.violations == [], sampler.violations
    assert not sampler.unreadable and sampler.samples >= 10, (sampler.samples,
                                                              sampler.unreadable)


def states_while(sampler, job, until, what: str, timeout: float = 60) -> set:
    """The states the sampler saw `job` in until `until()` holds, and for a
    few samples more."""
    sampler.job = job
    try:
        wait(until, what, timeout)
        time.sleep(5)
    finally:
        sampler.job = None
    return set(sampler.states)


def worker_pods(cp, slurm_name=pod_named_node) -> dict:
    """The worker pods by Slurm node."""
    return {slurm_name(p): p for p in pods(cp).values()}


def layout(cp, slurm_name=pod_named_node) -> tuple[dict, str]:
    """({Slurm node: the Kubernetes node its worker runs on}, the free node)."""
    hosts = {name: p["spec"]["nodeName"] for name, p in worker_pods(cp, slurm_name).items()}
    nodes = {n[5:] for n in cp.kubectl("get", "nodes", "-o", "name").stdout.split()}
    (free,) = nodes - set(hosts.values())
    return hosts, free


def replaced(cp, c, name, uid, start, host, slurm_name=pod_named_node) -> bool:
    """Slurm node `name`'s worker pod is a new one (not `uid`), bound on
    `host`, and its slurmd registered after `start` (SlurmdStartTime)."""
    p = worker_pods(cp, slurm_name).get(name)
    return bool(p and p["metadata"]["uid"] != uid and not p["metadata"].get("deletionTimestamp")
                and p["spec"].get("nodeName") == host and
                node(c, name).get("SlurmdStartTime", start) > start)


def force_delete_under_a_job(c, cp, name: str, cpus: int, capacity: dict,
                             slurm_name=pod_named_node) -> tuple[str, set]:
    """A careless operator force-deletes Slurm node `name`'s worker pod
    (--grace-period=0 --force: gone at once, never seen Terminating) while
    a 1-CPU job runs there and a pod runs beside it; that node is cordoned,
    so the replacement is bound on the free node, where a pod runs too.  A
    job of cpus - 1 CPUs, fitting beside the first only if no pod counted,
    is submitted meanwhile; once the replacement registered the pods go,
    and the node must take it.  Sampled throughout (ground truth asserted
    by `sampled`).  Returns (the first job's state once the replacement
    registered, the second job's states until then)."""
    hosts, free = layout(cp, slurm_name)
    old = hosts[name]
    running = sbatch(c, "-w", name, "-c", "1", "--wrap", "sleep 300")
    put_pod(cp, "beside-the-worker", old, "1", "1000Mi")
    put_pod(cp, "on-the-free-node", free, "1", "1000Mi")
    wait(lambda: job_state(c, running) == "RUNNING", f"the job on {name}", 30)
    wait(lambda: generic_node_counting(cp, old, "1", "1000Mi"), f"{old} counting its pod", 30)
    cp.kubectl("cordon", old)
    try:
        with sampled(c, cp, capacity, slurm_name) as sampler:
            sampler.cancel.append(running)
            pod = worker_pods(cp, slurm_name)[name]
            start, uid = node(c, name)["SlurmdStartTime"], pod["metadata"]["uid"]
            cp.kubectl("delete", "pod", "-n", "slurm", pod["metadata"]["name"],
                       "--grace-period=0", "--force")
            rest = sbatch(c, "-w", name, "-c", str(cpus - 1), "--wrap", "sleep 300")
            sampler.cancel.append(rest)
            states = states_while(sampler, rest,
                                  lambda: replaced(cp, c, name, uid, start, free, slurm_name),
                                  "the replacement bound on the free node, registered")
            first = job_state(c, running)
            # The old node's pod counts on it too, until it is gone (docs/ledger.md).
            cp.kubectl("delete", "pod", "-n", "default", "on-the-free-node",
                       "beside-the-worker", "--wait=false")
            wait(lambda: job_state(c, rest) == "RUNNING",
                 f"{name} to take the job once the pods are gone", 60)
            time.sleep(2)            # samples of the job running on the replacement
    finally:
        cp.kubectl("uncordon", old)
        cp.kubectl("delete", "pod", "-n", "default", "beside-the-worker", "on-the-free-node",
                   "--wait=false", "--ignore-not-found")
    return first, states
