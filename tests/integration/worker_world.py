"""What the tests of Slurm inside Kubernetes (test_containerized: ACK's
layout, test_slinky: Slinky's) read and make the same way: Slurm's nodes
and jobs as scontrol shows them, the worker pods, a pod put straight onto a
Kubernetes node, and the GenericNode once it counts that pod.

`kube` is the test cluster's control plane (its kubectl); `c` the Slurm
cluster (its env).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from conftest_kube import wait
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
