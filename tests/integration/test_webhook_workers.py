"""Admission on a node mapped by a Slurm worker pod (worker_pods = slinky):
the webhook follows the worker pods as the sync daemon does, so a pod
created straight onto that Kubernetes node is reserved in Slurm's ledger
or refused, and kube-scheduler sees placeholders there.

Real components: slurmctld/slurmd (Slurm nodes n1, n2), the Kubernetes
control plane with kwok, the coordinator's two daemons as their
ServiceAccounts, the webhook's worker-namespace Role as the chart renders
it (sync.workerPods).  The Kubernetes node cn-hongkong.10.1.0.19 has no
node_map entry, no label and no Slurm name; map_by_name is off, so only
the worker pod on it names its Slurm node (n2).  Ground truth: Slurm's
GresUsed (`scontrol -d show node`), the ledger's own entries, what the API
server has bound.

Ports: port(29400...) Slurm; the control plane pick_ports(27700, 27790).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time

import pytest
from kubernetes.client.exceptions import ApiException

from conftest_kube import pick_ports
from ground_truth import PLACEHOLDERS
from local_slurm import SLURM, port, requires_slurm, slurm_conf
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.policy import placeholder
from pyk8sres.testbed import chart, hybrid
from webhook_world import job_state, pod, sbatch, used, wait_for

pytestmark = requires_slurm

CPUS, MEMORY = 8, 16000
K19 = "cn-hongkong.10.1.0.19"
WORKERS = "slurm"
SETTINGS = f'map_by_name = false\nworker_pods = "slinky"\nworker_namespace = "{WORKERS}"\n'


def worker_rbac(cp) -> str:
    """The chart's Role and RoleBinding for the workers' namespace, as
    rendered with sync.workerPods (applied with kubectl)."""
    values = chart.host_values(cp.webhook_client_ca, hybrid.webhook_url(cp)) + [
        "--set", "sync.workerPods=slinky", "--set", f"sync.workerNamespace={WORKERS}"]
    docs = [d for d in chart.render(cp.bin.helm, values, "rbac.yaml")
            if d["metadata"].get("namespace") == WORKERS]
    assert sorted(d["kind"] for d in docs) == ["Role", "RoleBinding"], docs
    return "\n---\n".join(json.dumps(d) for d in docs)


@pytest.fixture(scope="module")
def world():
    work = tempfile.mkdtemp(prefix="pyk8sres-wk-it-")
    c, cp = hybrid.up(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=port(29400),
                      kube_port=pick_ports(27700, 27790), slurm=SLURM, coordinator=False)
    try:
        cp.register_nodes({K19: (CPUS, MEMORY)})
        cp.kubectl("create", "namespace", WORKERS)
        cp.kubectl("apply", "-f", "-", input=worker_rbac(cp))
        hybrid.start_sync(c, cp, SETTINGS)
        hybrid.start_webhook(c, cp, settings=SETTINGS)
        hybrid.wait_webhook(cp, c)
        with slurm_conf(c.conf):
            yield c, cp, kube_calls.Kube(cp.kubeconfig)
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=c.env, capture_output=True)
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


def slinky_worker(name, node, slurm_node):
    """A worker pod as Slinky's slurm-operator labels it, on `node`."""
    body = pod(name, "500m", "512Mi", node=node)
    body["metadata"]["labels"] = {
        "app.kubernetes.io/name": "slurmd", "app.kubernetes.io/component": "worker",
        "nodeset.slinky.slurm.net/pod-hostname": slurm_node}
    return body


def retire_worker(c, kube):
    """The worker pod deleted with nothing else left on n2: no slurmd runs
    n2 now and no worker maps it, so the sync daemon holds it whole
    (slurm:fence) until a worker maps it again, never released to jobs
    while it has no Kubernetes node whose pods are counted."""
    kube_calls.delete_pod(kube, WORKERS, "slinky-0")
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    wait_for(lambda: used(c, "n2") == (CPUS, MEMORY) and
             "slurm:fence" in (ledger.show("n2")["nodes"]["n2"].get("entries") or {}),
             60, "n2 held whole while no worker runs it")


def unshared(kube) -> str:
    """The published matchCondition (the nodes the API server does not ask about)."""
    w = kube_calls.get_webhook_config(kube, "pyk8sres-admission")["webhooks"][0]
    return next(m["expression"] for m in w.get("matchConditions") or []
                if m["name"] == "shared-node")


def placeholder_cpus(kube, node) -> float:
    """CPUs the placeholders bound to `node` request (what kube-scheduler counts)."""
    total = 0.0
    for p in kube_calls.list_namespace_pods(kube, PLACEHOLDERS):
        if (p.get("spec") or {}).get("nodeName") == node and placeholder.current(p) is not None:
            for ctr in p["spec"]["containers"]:
                cpu = ctr["resources"]["requests"]["cpu"]
                total += int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return total


def test_a_pod_on_a_worker_mapped_node_is_reserved_or_refused(world):
    """The worker pod of Slurm node n2 is bound to K19.  The webhook then
    checks K19 (it no longer publishes it as not shared), places
    placeholders there for Slurm's job on n2, refuses a pod created
    straight onto K19 that does not fit beside that job, and reserves one
    that does under its UID on n2."""
    c, cp, kube = world
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    assert f"'{K19}': true" in unshared(kube)          # nothing maps K19 yet
    kube_calls.create_pod(kube, WORKERS, slinky_worker("slinky-0", K19, "n2"))
    wait_for(lambda: f"'{K19}': true" not in unshared(kube), 20,
             f"the webhook to check {K19} once a worker maps it")

    job = sbatch(c, "n2", 6)
    wait_for(lambda: job_state(c, job)[0] == "RUNNING", 30, "the job on n2")
    assert used(c, "n2") == (6, 1000)
    wait_for(lambda: placeholder_cpus(kube, K19) == 6, 20,
             f"placeholders on {K19} for the job's 6 CPUs")

    ns = "default"
    with pytest.raises(ApiException) as refused:
        kube_calls.create_pod(kube, ns, pod("big", "4", "1Gi", node=K19))
    assert refused.value.status == 403 and "does not fit" in refused.value.body, \
        refused.value.body
    assert kube_calls.get_pod(kube, ns, "big") is None

    kube_calls.create_pod(kube, ns, pod("small", "1", "1Gi", node=K19))
    uid = kube_calls.get_pod(kube, ns, "small")["metadata"]["uid"]
    entries = ledger.show("n2")["nodes"]["n2"].get("entries") or {}
    assert uid in entries, entries                       # reserved at admission
    wait_for(lambda: used(c, "n2") == (7, 1000 + 1024), 20, "the job and the pod on n2")
    # The sync daemon counts it there too, and keeps it: no release while it runs.
    time.sleep(2.0)
    assert used(c, "n2") == (7, 1000 + 1024)
    assert used(c, "n1") == (0, 0)

    subprocess.run(["scancel", job], env=c.env, check=True)
    kube_calls.delete_pod(kube, ns, "small")
    retire_worker(c, kube)


def test_a_pod_bound_before_the_worker_was_seen_counts_once_it_maps(world):
    """The race: a worker pod is bound to K19 and an ordinary pod is bound
    there before the webhook's view has the worker, so the pod was admitted
    as on a node not shared (not even asked about: K19 was published as not
    shared) and nothing was reserved.  Made deterministic by binding the pod
    first.  The sync daemon counts every pod on K19 on n2 in the cycle that
    maps it, so no job starts on those CPUs while the pod runs."""
    c, cp, kube = world
    ns = "default"
    kube_calls.create_pod(kube, ns, pod("early", "3", "1Gi", node=K19))    # K19 maps nothing yet
    early = kube_calls.get_pod(kube, ns, "early")["metadata"]["uid"]
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    assert early not in (ledger.show("n2")["nodes"]["n2"].get("entries") or {})
    kube_calls.create_pod(kube, WORKERS, slinky_worker("slinky-0", K19, "n2"))
    wait_for(lambda: used(c, "n2") == (3, 1024), 20, "the early pod counted on n2")
    job = sbatch(c, "n2", 6)
    time.sleep(4.0)
    assert job_state(c, job)[0] == "PENDING", job_state(c, job)
    assert used(c, "n2") == (3, 1024)
    kube_calls.delete_pod(kube, ns, "early")
    wait_for(lambda: job_state(c, job)[0] == "RUNNING", 60, "the job, once the pod is gone")
    subprocess.run(["scancel", job], env=c.env, check=True)
    retire_worker(c, kube)


def test_while_the_worker_pods_cannot_be_read_every_node_is_checked(world):
    """The webhook's grant on the workers' namespace taken away: its worker
    watch fails, so it no longer publishes any node as not shared, refuses
    a pod on a node only a worker could map (it cannot tell), and still
    reserves on the node it last saw a worker on.  Granted again, it
    recovers."""
    c, cp, kube = world
    ns = "default"
    kube_calls.create_pod(kube, WORKERS, slinky_worker("slinky-0", K19, "n2"))
    wait_for(lambda: f"'{K19}': true" not in unshared(kube) and "'n1': true" in unshared(kube),
             20, f"{K19} checked, n1 not")
    cp.kubectl("delete", "rolebinding", "-n", WORKERS, "pyk8sres-webhook-workers")
    # An open watch outlives the grant: the next one (within the watch
    # timeout) is refused.
    wait_for(lambda: "'n1': true" not in unshared(kube), 45, "every node checked")
    with pytest.raises(ApiException) as refused:
        kube_calls.create_pod(kube, ns, pod("on-n1", "1", "1Gi", node="n1"))
    assert refused.value.status == 403 and \
        "Slurm worker pods (slinky, namespace slurm) are not known" in refused.value.body, \
        refused.value.body
    kube_calls.create_pod(kube, ns, pod("small", "1", "1Gi", node=K19))
    uid = kube_calls.get_pod(kube, ns, "small")["metadata"]["uid"]
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    assert uid in (ledger.show("n2")["nodes"]["n2"].get("entries") or {})

    cp.kubectl("apply", "-f", "-", input=worker_rbac(cp))
    wait_for(lambda: "'n1': true" in unshared(kube), 60, "n1 known not shared again")
    kube_calls.create_pod(kube, ns, pod("on-n1", "1", "1Gi", node="n1"))
    for name in ("small", "on-n1"):
        kube_calls.delete_pod(kube, ns, name)
    retire_worker(c, kube)
