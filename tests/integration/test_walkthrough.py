"""The reference product's walkthrough on ONE shared node, as a user types it:
no -w, the stock `pyk8sres cluster up --kubernetes` (real slurmctld/slurmd,
real API server, pyk8sres sync).  Checked from Slurm's own accounting and
the API server, never from our state."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from conftest_kube import pick_ports
from local_slurm import SLURM, port, requires_slurm, tres
from pyk8sres.testbed import hybrid

pytestmark = requires_slurm
CPUS, MEMORY = 8, 16000


@pytest.fixture(scope="module")
def world(kube_paths):
    work = tempfile.mkdtemp(prefix="pyk8sres-walk-")
    c, kas = hybrid.up(work, nodes=1, cpus=CPUS, memory=MEMORY, base_port=port(17400),
                       kube_port=pick_ports(27800, 27990), slurm=SLURM)
    env = dict(c.env, KUBECONFIG=kas.kubeconfig)
    try:
        yield c, kas, env
    finally:
        hybrid.down(work)


def sh(env, *argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=check,
                          timeout=60, cwd="/tmp").stdout


def wait(pred, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := pred()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


def used(env) -> str:
    out = sh(env, "scontrol", "-d", "show", "node", "n1")
    assert "Gres=k8scpu:8,k8smemory:16000" in out, out     # the total never moves
    return out.split("GresUsed=")[1].split()[0]


def allocated(kas, env) -> dict:
    gn = json.loads(sh(env, kas.paths.kubectl, "get", "genericnode", "n1", "-o", "json"))
    return {a["type"]: a["allocated"] for a in gn["status"]["allocatedResources"]}


def pod(env, kas, name, cpu, mem):
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x",
                         "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}}
    subprocess.run([kas.paths.kubectl, "apply", "-f", "-"], input=json.dumps(manifest),
                   text=True, env=env, check=True, capture_output=True)


def state(env, job):
    return tuple(sh(env, "squeue", "-h", "-j", job, "-o", "%T %r").split()[:2])


def test_walkthrough_without_w(world):
    c, kas, env = world
    pod(env, kas, "web-0", "1735m", "2393Mi")
    wait(lambda: allocated(kas, env)["Kubernetes"] == {"cpu": "1735m", "memory": "2393Mi"},
         "Kubernetes side in GenericNode")
    job1 = sh(env, "sbatch", "--parsable", "-o", "/dev/null", "--cpus-per-task=3", "--mem=4000",
              "--wrap", "sleep 600").strip()
    assert tres("gres:k8scpu:3") in sh(env, "scontrol", "show", "job", job1)   # added by the plugin
    wait(lambda: state(env, job1)[0] == "RUNNING", "job 1 running")
    pod(env, kas, "web-1", "1", "1024Mi")                                # scale up by one
    wait(lambda: allocated(kas, env) == {"Slurm": {"cpu": "3", "memory": "4000Mi"},
                                         "Kubernetes": {"cpu": "2735m", "memory": "3417Mi"}},
         "both sides in GenericNode")
    wait(lambda: used(env) == "k8scpu:6,k8smemory:7417", "jobs + pods in GresUsed")
    out = sh(env, kas.paths.kubectl, "get", "genericnode")
    assert "n1" in out and "2735m" in out and "3417Mi" in out

    # The admin's view: both sides, and whether they agree ...
    status = json.loads(sh(env, sys.executable, "-m", "pyk8sres", "status", "-o", "json"))
    row = status["nodes"][0]
    assert (row["node"], row["jobs"], row["kubernetes"], row["pods_bound"], row["agree"]) == \
        ("n1", {"cpu": 3, "mem": 4000}, {"cpu": 3, "mem": 3417}, {"cpu": 3, "mem": 3417}, "yes")
    # ... and Slurm's side while the API server is down, saying so.
    workdir, kport = kas.workdir, kas.port
    kas.stop()
    try:
        table = sh(env, sys.executable, "-m", "pyk8sres", "status")
        assert "API server down" in table and "unreachable" in table and "3/3417" in table
    finally:
        kas.start(workdir, kport)

    job2 = sh(env, "sbatch", "--parsable", "-o", "/dev/null", "--cpus-per-task=3", "--mem=4000",
              "--wrap", "sleep 600").strip()                      # accepted, not refused
    wait(lambda: state(env, job2) == ("PENDING", "Resources"), "job 2 pends on Resources")
    time.sleep(3)
    assert state(env, job2)[0] == "PENDING"

    sh(env, kas.paths.kubectl, "delete", "pod", "web-0", "web-1", "--wait=false")
    wait(lambda: state(env, job2)[0] == "RUNNING", "job 2 starts once the pods go")
    wait(lambda: used(env) == "k8scpu:6,k8smemory:8000", "two jobs, no share")
    sh(env, "scancel", job1, job2)
