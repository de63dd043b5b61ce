"""Placeholder pods against the real kube-scheduler (default profile) and
kwok as the kubelets: kube-scheduler sees what Slurm's jobs hold, so it
does not pick a node Slurm fills, and the webhook stays a safety net.

What kube-scheduler counts is read two ways: from its own cache (the dump
it logs on SIGUSR2, ground_truth.scheduler_cache) and by its decisions
(where pods land, FailedScheduling, the webhook's refusals).  Slurm's side
from `scontrol -d show job` (CPU_IDs, Mem).

The kubelet's answers to an in-place resize are injected per pod with the
annotation pyk8sres.io/kubelet-resize=Deferred|Infeasible (kube/kwok.yaml);
without it kwok applies a resize 100-400 ms later.

Nodes n1, n2: 8 CPUs, 16000 MB.  Ports: port(28200...) Slurm; the control
plane pick_ports(27700, 27790).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid

import pytest
from conftest_kube import pick_ports, wait_for
from ground_truth import (PLACEHOLDERS, over_capacity, scheduler_cache, scheduler_view,
                          slurm_jobs)
from local_slurm import SLURM, port, requires_slurm, slurm_conf
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.policy import placeholder
from pyk8sres.testbed import hybrid

CPUS, MEMORY = 8, 16000
MI = 1 << 20
CAPACITY = {"n1": (CPUS, MEMORY), "n2": (CPUS, MEMORY)}
KUBELET_RESIZE = "pyk8sres.io/kubelet-resize"
pytestmark = requires_slurm


@pytest.fixture(scope="module")
def world():
    work = tempfile.mkdtemp(prefix="pyk8sres-ph-it-")
    c, cp = hybrid.up(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=port(28200),
                      kube_port=pick_ports(27700, 27790), slurm=SLURM)
    try:
        with slurm_conf(c.conf):
            yield c, cp, kube_calls.Kube(cp.kubeconfig)
    finally:
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def ns(world):
    c, cp, kube = world
    name = "ph-" + uuid.uuid4().hex[:8]
    kube.core.create_namespace({"metadata": {"name": name}})
    yield name
    cp.kubectl("uncordon", "n1", "n2")
    subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
    cp.kubectl("delete", "namespace", name, "--wait=false")
    for p in kube_calls.list_pods(kube, name):
        kube_calls.delete_pod(kube, name, p["metadata"]["name"])
    # Slurm's jobs gone: no placeholder left anywhere.
    wait_for(lambda: not placeholders(kube), 30, "placeholders gone")
    # The pods' shares released too (a pod deleted outright is held for its
    # grace period, 0 here, plus the test cluster's margin).
    wait_for(lambda: not any(slurm_calls.get_node(n).gres_used.get("k8scpu") for n in CAPACITY), 60,
             "the pods' shares released")


# ----------------------------------------------------------------- helpers

def placeholders(kube, node=None) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube_calls.list_namespace_pods(kube, PLACEHOLDERS)
            if placeholder.current(p) is not None
            and (node is None or p["spec"]["nodeName"] == node)}


def sbatch(c, node, cpus, mem=1000):
    out = subprocess.run(["sbatch", "--parsable", "-w", node, "-c", str(cpus), f"--mem={mem}",
                          "-o", "/dev/null", "--wrap", "sleep 600"], env=c.env,
                         capture_output=True, text=True, check=True, cwd="/tmp").stdout
    return out.strip().split(";")[0]


def running(c, job) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=c.env,
                         capture_output=True, text=True).stdout.strip()
    return out == "RUNNING"


def gone(c, job) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=c.env,
                         capture_output=True, text=True).stdout.strip()
    return out in ("", "COMPLETED", "CANCELLED")


def held(c, node) -> tuple[int, int]:
    """(millicores, bytes) Slurm's running jobs hold on node (CPU_IDs, Mem)."""
    cpus, mb = slurm_jobs(c.env, [node])[node]
    return cpus * 1000, mb * MI


def deployment(cp, ns, name, replicas, cpu, memory="1Gi"):
    doc = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                    "template": {"metadata": {"labels": {"app": name}},
                                 "spec": {"terminationGracePeriodSeconds": 0, "containers": [
                                     {"name": "web", "image": "nginx", "resources": {
                                         "requests": {"cpu": cpu, "memory": memory}}}]}}}}
    cp.kubectl("apply", "-f", "-", input=json.dumps(doc))


def app_pods(kube, ns, app) -> list[dict]:
    return [p for p in kube_calls.list_namespace_pods(kube, ns)
            if (p["metadata"].get("labels") or {}).get("app") == app
            and not p["metadata"].get("deletionTimestamp")]


def refusals(kube, ns) -> int:
    """How many times the webhook refused a pod of ns (its Events' counts)."""
    return sum(e.get("count") or 1 for e in kube_calls.list_events(
        kube, ns, field_selector="reason=InsufficientSharedCapacity"))


def insufficient(kube, ns, pod_name) -> bool:
    """kube-scheduler itself found no node with room (FailedScheduling, Insufficient cpu)."""
    return any("Insufficient cpu" in (e.get("message") or "") for e in kube_calls.list_events(
        kube, ns, field_selector=f"reason=FailedScheduling,involvedObject.name={pod_name}"))


def annotate(kube, name, answer):
    kube.core.patch_namespaced_pod(name, PLACEHOLDERS, {"metadata": {"annotations": {
        KUBELET_RESIZE: answer}}})


class Watch(threading.Thread):
    """While Slurm's jobs on `node` only end: at every sample, kube-scheduler
    counts at least what they hold, by its own cache and by the placeholders'
    rules (read before the jobs: jobs only shrink meanwhile)."""

    def __init__(self, c, cp, kube, node):
        super().__init__(daemon=True)
        self.c, self.cp, self.kube, self.node = c, cp, kube, node
        self.stop = threading.Event()
        self.samples, self.violations = 0, []

    def run(self):
        while not self.stop.is_set():
            cache = scheduler_cache(self.cp).get(self.node, (0, 0))
            model = scheduler_view(self.kube).get(self.node, (0, 0))
            jobs = held(self.c, self.node)
            self.samples += 1
            for what, seen in (("kube-scheduler's cache", cache), ("placeholders", model)):
                if seen[0] < jobs[0] or seen[1] < jobs[1]:
                    self.violations.append(f"{time.strftime('%T')} {what} {seen} < jobs {jobs}")
            time.sleep(0.05)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join(30)


# ----------------------------------------------------------------- tests

def test_deployment_goes_around_what_slurm_holds_and_comes_when_the_job_ends(world, ns):
    """(a) Slurm holds 6 of n1's 8 CPUs: no 4-CPU pod of a Deployment is
    put there; they land on n2 or pend, and kube-scheduler never even tries
    n1 (the webhook refuses nothing).  (b) The job ends: the pending pod
    comes to n1."""
    c, cp, kube = world
    job = sbatch(c, "n1", 6)
    wait_for(lambda: running(c, job), 20, "job running")
    t_run = time.monotonic()
    wait_for(lambda: scheduler_view(kube).get("n1", (0, 0)) == (6000, 1000 * MI), 5,
             "placeholder sized to the job")
    grew = time.monotonic() - t_run
    assert scheduler_cache(cp)["n1"][0] == 6000          # kube-scheduler's own count
    gres = slurm_calls.get_node("n1").gres_used          # the placeholder reserves nothing
    assert (gres.get("k8scpu"), gres.get("k8smemory")) == (6, 1000)
    deployment(cp, ns, "web", 3, "4")
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == 3 and sum(
        1 for p in ps if p["spec"].get("nodeName")) == 2 else None)(app_pods(kube, ns, "web")),
        30, "two replicas bound")
    assert sorted(p["spec"].get("nodeName") or "" for p in pods) == ["", "n2", "n2"]
    waiting = next(p["metadata"]["name"] for p in pods if not p["spec"].get("nodeName"))
    wait_for(lambda: insufficient(kube, ns, waiting), 20, "FailedScheduling: Insufficient cpu")
    time.sleep(3)                 # a few of kube-scheduler's retries
    assert refusals(kube, ns) == 0, "kube-scheduler tried n1 and the webhook had to refuse"
    assert all(p["spec"].get("nodeName") != "n1" for p in app_pods(kube, ns, "web"))
    assert over_capacity(c.env, kube, CAPACITY) == []

    # (b) The job ends: its placeholder goes at once, the pod comes.
    subprocess.run(["scancel", job], env=c.env, check=True)
    t0 = time.monotonic()
    wait_for(lambda: gone(c, job), 20, "job gone", every=0.02)
    t_gone = time.monotonic()
    wait_for(lambda: not placeholders(kube, "n1"), 5, "placeholder deleted", every=0.02)
    t_ph = time.monotonic()
    wait_for(lambda: kube_calls.get_pod(kube, ns, waiting)["spec"].get("nodeName") == "n1", 30,
             "the pending pod lands on n1", every=0.1)
    t_pod = time.monotonic()
    print(f"placeholder: sized {grew:.2f} s after the job showed RUNNING; deleted "
          f"{t_ph - t0:.2f} s after scancel ({t_ph - t_gone:+.2f} s after the job left "
          f"squeue); the pending pod bound {t_pod - t_ph:.2f} s later")
    assert grew < 1.0 and t_ph - t_gone < 1.0
    assert refusals(kube, ns) == 0
    assert over_capacity(c.env, kube, CAPACITY) == []


@pytest.mark.parametrize("kubelet", [None, "Deferred", "Infeasible"])
def test_resize_answers_never_let_kube_scheduler_count_less(world, ns, kubelet):
    """One placeholder covers two jobs (6 CPUs); one job ends: it is
    downsized in place, and the kubelet applies it 100-400 ms later (None),
    or leaves it Deferred or Infeasible.  At every sample kube-scheduler
    counts at least what the jobs hold; a pending downsize is replaced, so
    it ends at exactly what they hold.  A job start under the same kubelet
    adds a pod (never a resize: an Infeasible growth would not be counted).
    n2 is cordoned: n1 is kube-scheduler's only choice."""
    c, cp, kube = world
    cp.kubectl("cordon", "n2")
    # Both jobs start while the placeholders pause: one pod covers them.
    pid = int(open(f"{c.work}/run/proc-webhook.pid").read())
    os.kill(pid, signal.SIGSTOP)
    try:
        big, small = sbatch(c, "n1", 4, 1000), sbatch(c, "n1", 2, 1000)
        wait_for(lambda: running(c, big) and running(c, small), 20, "both jobs running")
    finally:
        os.kill(pid, signal.SIGCONT)
    pods = wait_for(lambda: (lambda ps: ps if [placeholder.counted(p) for p in ps.values()] ==
                             [(6000, 2000 * MI)] else None)(placeholders(kube, "n1")),
                    10, "one placeholder for both jobs")
    (name, first), = pods.items()
    if kubelet:
        annotate(kube, name, kubelet)

    with Watch(c, cp, kube, "n1") as watch:
        subprocess.run(["scancel", big], env=c.env, check=True)
        wait_for(lambda: gone(c, big), 20, "job gone")
        settled = wait_for(lambda: (lambda ps: ps if [placeholder.counted(p) for p in ps.values()]
                                    == [(2000, 1000 * MI)] else None)(placeholders(kube, "n1")),
                           20, "placeholders settle at what the remaining job holds")
        wait_for(lambda: scheduler_cache(cp)["n1"] == (2000, 1000 * MI), 10,
                 "kube-scheduler's cache follows")
        time.sleep(1)
    print(f"kubelet {kubelet or 'applies'}: {watch.samples} samples, "
          f"{len(watch.violations)} below Slurm's jobs")
    assert watch.samples >= 10 and watch.violations == []
    (now_name, now), = settled.items()
    if kubelet:   # left pending: replaced by a new pod
        assert now_name != name and kube_calls.get_pod(kube, PLACEHOLDERS, name) is None
    else:         # applied in place
        assert now_name == name and now["metadata"]["uid"] == first["metadata"]["uid"]

    # A job starts under the same kubelet: a new pod for it, the other untouched.
    if kubelet:
        annotate(kube, now_name, kubelet)
    third = sbatch(c, "n1", 3, 500)
    wait_for(lambda: running(c, third), 20, "third job running")
    grown = wait_for(lambda: (lambda ps: ps if sum(placeholder.counted(p)[0]
                                                   for p in ps.values()) == 5000
                              else None)(placeholders(kube, "n1")), 5, "placeholders grow")
    assert placeholder.current(grown[now_name]) == (2000, 1000 * MI)      # never resized up
    assert sorted(placeholder.counted(p) for p in grown.values()) == [(2000, 1000 * MI),
                                                                      (3000, 500 * MI)]
    wait_for(lambda: scheduler_cache(cp)["n1"] == (5000, 1500 * MI), 10,
             "kube-scheduler counts both")
    # What is left (3 CPUs) takes a 3-CPU pod, not a 4-CPU one.
    deployment(cp, ns, "fits", 1, "3")
    deployment(cp, ns, "big", 1, "4")
    wait_for(lambda: [p["spec"].get("nodeName") for p in app_pods(kube, ns, "fits")] == ["n1"],
             30, "the 3-CPU pod bound to n1")
    big_pod = wait_for(lambda: app_pods(kube, ns, "big"), 10, "the 4-CPU pod")[0]
    wait_for(lambda: insufficient(kube, ns, big_pod["metadata"]["name"]), 20,
             "FailedScheduling for the 4-CPU pod")
    assert kube_calls.get_pod(kube, ns, big_pod["metadata"]["name"])["spec"].get("nodeName") is None
    assert refusals(kube, ns) == 0
    assert over_capacity(c.env, kube, CAPACITY) == []


def test_kube_scheduler_drops_an_infeasible_growth_the_ledger_does_not(world, ns):
    """Why placeholders never grow in place: a pod the kubelet leaves
    Infeasible after a resize up is counted by kube-scheduler at what it
    runs with, not at its spec (k8s.io/component-helpers resource
    helpers).  A placeholder grown that way would show kube-scheduler less
    than Slurm holds.  For an ordinary pod the ledger keeps holding the
    spec (the kubelet judges it again when the node or the pod changes, and
    a later smaller resize is applied at once): kube-scheduler's binding
    into the room it sees is refused, and nothing is booked twice."""
    c, cp, kube = world
    cp.kubectl("cordon", "n2")
    grown = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "grown", "annotations": {KUBELET_RESIZE: "Infeasible"}},
             "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 0, "containers": [
                 {"name": "c", "image": "x",
                  "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}
    kube_calls.create_pod(kube, ns, grown)
    wait_for(lambda: ((kube_calls.get_pod(kube, ns, "grown") or {}).get("status") or {}).get(
        "phase") == "Running", 10, "running")
    kube_calls.resize_pod(kube, ns, "grown", [{"name": "c", "resources": {"requests": {
        "cpu": "6", "memory": "1Gi"}}}])
    wait_for(lambda: placeholder.resize_pending(kube_calls.get_pod(kube, ns, "grown"))
             == "Infeasible", 10, "the kubelet leaves it Infeasible")
    assert wait_for(lambda: scheduler_cache(cp)["n1"][0] == 1000, 10,
                    "kube-scheduler counts what runs")
    time.sleep(2)
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    share = ledger.show("n1")["nodes"]["n1"]["share"]
    assert share["cpu"] == 6                          # the ledger holds the spec
    deployment(cp, ns, "web", 1, "4")
    web = wait_for(lambda: app_pods(kube, ns, "web"), 10, "the 4-CPU pod")[0]
    wait_for(lambda: refusals(kube, ns) > 0, 30, "its binding to n1 refused")
    assert kube_calls.get_pod(kube, ns, web["metadata"]["name"])["spec"].get("nodeName") is None
    assert over_capacity(c.env, kube, CAPACITY) == []
