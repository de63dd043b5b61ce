"""The reference product's walkthrough on ONE shared node, as a user types it:
no -w, `srun` as in the reference, the stock `pyk8sres cluster up
--kubernetes` (real slurmctld/slurmd; the real control plane: kube-scheduler
places the pods, kwok runs them).  The Deployment is the ordinary user's
(identity "developer", namespace default); the cluster-wide views
(`kubectl get genericnode`, `pyk8sres status`) are the admin's.  Checked
from Slurm's own accounting and the API server, never from our state."""
import json
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest_kube import pick_ports, wait
from ground_truth import over_capacity
from local_slurm import SLURM, port, requires_slurm, tres
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.testbed import hybrid

pytestmark = requires_slurm
CPUS, MEMORY = 8, 16000
DEPLOYMENT = "nginx-deployment-basic"


@pytest.fixture(scope="module")
def world():
    work = tempfile.mkdtemp(prefix="pyk8sres-walk-")
    c, cp = hybrid.up(work, nodes=1, cpus=CPUS, memory=MEMORY, base_port=port(17400),
                      kube_port=pick_ports(27800, 27990), slurm=SLURM)
    env = dict(c.env, KUBECONFIG=cp.kubeconfig)
    sruns = []
    try:
        yield c, cp, env, sruns
    finally:
        subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
        for p in sruns:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


def sh(env, *argv, check=True, input=None):
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=check,
                          timeout=60, cwd="/tmp", input=input).stdout


def used(env) -> str:
    out = sh(env, "scontrol", "-d", "show", "node", "n1")
    assert "Gres=k8scpu:8,k8smemory:16000" in out, out     # the total never moves
    return out.split("GresUsed=")[1].split()[0]


def allocated(cp) -> dict:
    gn = json.loads(cp.kubectl("get", "genericnode", "n1", "-o", "json").stdout)
    return {a["type"]: a["allocated"] for a in gn["status"]["allocatedResources"]}


def srun(c, sruns) -> str:
    """`srun --cpus-per-task=3 --mem=4000 sleep inf` in the background, as in
    another terminal; returns its job id once Slurm has it."""
    name = f"walk-{len(sruns)}"
    sruns.append(subprocess.Popen(["srun", "-J", name, "--cpus-per-task=3", "--mem=4000",
                                   "sleep", "inf"], env=c.env, cwd="/tmp",
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return wait(lambda: sh(c.env, "squeue", "-h", "-n", name, "-o", "%i").strip(),
                f"{name} queued")


def state(env, job):
    return tuple(sh(env, "squeue", "-h", "-j", job, "-o", "%T %r").split()[:2])


def nginx_pods(kube):
    return [p for p in kube_calls.list_namespace_pods(kube, "default")
            if (p["metadata"].get("labels") or {}).get("app") == DEPLOYMENT]


def test_walkthrough(world):
    c, cp, env, sruns = world
    kube = kube_calls.Kube(cp.kubeconfig)
    # What already runs in the cluster (add-ons: 735m CPU, 1369Mi), the admin's.
    cp.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "addons", "namespace":
                                                        "kube-system"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {
            "requests": {"cpu": "735m", "memory": "1369Mi"}}}]}}))
    # The user's Deployment, one replica of 1 CPU / 1Gi.
    cp.kubectl("apply", "-f", "-", identity="developer", input=json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": DEPLOYMENT},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": DEPLOYMENT}},
                 "template": {"metadata": {"labels": {"app": DEPLOYMENT}}, "spec": {
                     "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "nginx", "image": "nginx", "resources": {
                         "requests": {"cpu": "1", "memory": "1Gi"}}}]}}}}))

    # 1. `kubectl get genericnode`: one object per shared node, both sides.
    wait(lambda: allocated(cp) == {"Slurm": {"cpu": "0", "memory": "0"},
                                   "Kubernetes": {"cpu": "1735m", "memory": "2393Mi"}},
         "the pods in GenericNode")
    out = cp.kubectl("get", "genericnode").stdout.splitlines()
    assert out[0].split() == ["NAME", "CLUSTERNAME", "ALIAS", "TYPE", "ALLOCATEDRESOURCES", "GPU"]
    assert out[1].split()[0] == "n1" and out[1].split()[-1] == (
        '[{"allocated":{"cpu":"0","memory":"0"},"type":"Slurm"},'
        '{"allocated":{"cpu":"1735m","memory":"2393Mi"},"type":"Kubernetes"}]')

    # 2. srun, and the Deployment scaled up by one replica (by the user).
    job1 = srun(c, sruns)
    assert tres("gres:k8scpu:3") in sh(env, "scontrol", "show", "job", job1)   # the plugin
    wait(lambda: state(env, job1)[0] == "RUNNING", "job 1 running")
    cp.kubectl("scale", "deployment", DEPLOYMENT, "--replicas", "2", identity="developer")
    wait(lambda: [p["status"].get("phase") for p in nginx_pods(kube)] == ["Running", "Running"],
         "two replicas running (kube-scheduler put the second next to the job)")
    wait(lambda: allocated(cp) == {"Slurm": {"cpu": "3", "memory": "4000Mi"},
                                   "Kubernetes": {"cpu": "2735m", "memory": "3417Mi"}},
         "both sides in GenericNode")
    wait(lambda: used(env) == "k8scpu:6,k8smemory:7417", "jobs + pods in GresUsed")
    assert over_capacity(env, kube, {"n1": (CPUS, MEMORY)}) == []

    # The admin's view: both sides, and whether they agree ...
    status = json.loads(sh(env, sys.executable, "-m", "pyk8sres", "status", "-o", "json"))
    row = status["nodes"][0]
    assert (row["node"], row["jobs"], row["kubernetes"], row["pods_bound"], row["agree"]) == \
        ("n1", {"cpu": 3, "mem": 4000}, {"cpu": 3, "mem": 3417}, {"cpu": 3, "mem": 3417}, "yes")
    # ... and Slurm's side while the API server is down, saying so.
    cp.stop_component("kube-apiserver")
    try:
        table = sh(env, sys.executable, "-m", "pyk8sres", "status")
        assert "API server down" in table and "unreachable" in table and "3/3417" in table
    finally:
        cp.start_apiserver()

    # 3. A second srun pends while the Deployment's pods hold the node.
    job2 = srun(c, sruns)
    wait(lambda: state(env, job2) == ("PENDING", "Resources"), "job 2 pends on Resources")
    time.sleep(3)
    assert state(env, job2)[0] == "PENDING"
    squeue = sh(env, "squeue")
    assert f"{job2} " in squeue and "(Resources)" in squeue

    # The user scales the Deployment down: its pods stay Terminating for
    # their grace period, and hold the node until they are gone.
    cp.kubectl("scale", "deployment", DEPLOYMENT, "--replicas", "0", identity="developer")
    while nginx_pods(kube):
        assert state(env, job2)[0] == "PENDING", "job 2 started while the pods were still there"
        time.sleep(0.2)
    wait(lambda: state(env, job2)[0] == "RUNNING", "job 2 starts once the pods are gone")
    wait(lambda: used(env) == "k8scpu:7,k8smemory:9369", "two jobs and the add-ons")
    assert over_capacity(env, kube, {"n1": (CPUS, MEMORY)}) == []
