"""End to end: `pyk8sres sync` between a real local Slurm cluster and the real
Kubernetes control plane (kube-apiserver with RBAC, kube-scheduler,
kube-controller-manager, kwok as the kubelets; no mocks).  We check the state
of the world -- Slurm's counts, job states, the pods the API server has,
GenericNode objects -- never which calls were made.

The daemon runs as the ServiceAccount pyk8sres-sync of the Helm chart's RBAC
(a token, never admin), as the coordinator's own uid (hybrid.py: listed in
LedgerUsers=, the ledger socket in a directory of its own, StateSaveLocation
and the munge key out of its reach).  Nodes register as their kubelets do
(ControlPlane.register_nodes: system:node:<name>, NodeRestriction); pods are
placed by kube-scheduler unless the node a pod lands on is what a test is
about (then spec.nodeName).  kwok runs them, applies resizes and keeps a
deleted pod Terminating for its grace period.

Needs root and the built plugins (`pyk8sres cluster up` works; skips if not)
and the control plane (kube/build.sh, cached).  Ports: port(27300..27302)
Slurm; the control plane a free block in 31000-31990 (conftest_kube.pick_ports).
The control plane, the daemon and the helpers are in sync_world.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.client.exceptions import ApiException  # noqa: E402

from local_slurm import SLURM, port  # noqa: E402
from pyk8sres.coordinator import kube as kube_calls  # noqa: E402
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path  # noqa: E402
from pyk8sres.policy import departures  # noqa: E402
from pyk8sres.policy import quantities  # noqa: E402
from pyk8sres.testbed import cluster as slurm_cluster  # noqa: E402
from pyk8sres.testbed import hybrid  # noqa: E402
from ground_truth import over_capacity  # noqa: E402
from sync_world import (GROUP, NODE_CPUS, NODE_MEM, PLURAL, SLINKY, VERSION, Api, Daemon,  # noqa: E402
                        allocated, as_coordinator, bound_pod, clean, coordinator_kubeconfig,
                        delete_pod, done, ensure_namespace, exists, generic_node, held, job_state, k8s_node,
                        new_pod, node_ready, pending_while, running, sbatch, scheduled_pod,
                        slinky_worker, status_writes, used, wait_for, wait_used)

BASE_PORT = port(27300)     # slurmctld, then one per slurmd
KILL_WAIT = 8            # seconds a cancelled job's processes may outlive SIGTERM
NOWHERE = {"pyk8sres-test/nowhere": "true"}   # a nodeSelector no node matches
KUBELET_RESIZE = "pyk8sres.io/kubelet-resize"   # kube/kwok.yaml: leave a resize pending

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")


@pytest.fixture(scope="module")
def root():
    # Short paths (munge's socket path must stay under 108 bytes); kept
    # afterwards for the logs (slurm/log/sync.log is the daemon's).
    path = tempfile.mkdtemp(prefix="pyk8sres-sync-it-")
    os.chmod(path, 0o755)      # the coordinator's uid reaches its files
    return path


@pytest.fixture(scope="module")
def slurm(root):
    work = f"{root}/slurm"
    c = slurm_cluster.up(work, nodes=2, cpus=NODE_CPUS, memory=NODE_MEM, base_port=BASE_PORT,
                         synced=True, slurm=SLURM, k8s_conf=hybrid.ledger_conf(work),
                         extra_conf=f"KillWait={KILL_WAIT}\n")
    hybrid.confine(c)
    os.environ["SLURM_CONF"] = c.conf
    yield c
    subprocess.run(["scancel", "--full", "-u", "root"], env=c.env, capture_output=True)
    slurm_cluster.down(work)


@pytest.fixture(scope="module")
def api(kube_binaries, root):
    a = Api(kube_binaries, f"{root}/kube")
    yield a
    a.stop()


@pytest.fixture
def daemon(slurm, api, request):
    d = Daemon(slurm, api, getattr(request, "param", ""))
    d.start()
    yield d
    d.stop()
    clean(slurm, api)


# ----------------------------------------------------------------- tests

def test_reference_walkthrough(slurm, api, daemon):
    """The user-facing walkthrough of the reference product, end to end;
    kube-scheduler places the pods (n1 is the only node)."""
    k8s_node(api, "n1")
    pods = [scheduled_pod(api, "1735m", "2393Mi")]
    gn = wait_for(lambda: allocated(api, "n1").get("Kubernetes", {}).get("cpu") == "1735m"
                  and generic_node(api, "n1"), what="GenericNode n1")
    assert gn["spec"]["alias"] == "n1" and gn["spec"]["type"] == "Slurm"
    assert allocated(api, "n1") == {"Slurm": {"cpu": "0", "memory": "0"},
                                    "Kubernetes": {"cpu": "1735m", "memory": "2393Mi"}}
    wait_used(slurm, (2, 2393))          # the pods' share, rounded up once

    # kubectl shows both sides, like the reference's `kubectl get genericnode`.
    out = api.kube.kubectl("get", "genericnode").stdout
    assert "ALIAS" in out and "n1" in out and "1735m" in out

    job1 = sbatch(slurm, "-c", "3", "--mem=4000")
    wait_for(lambda: job_state(slurm, job1)[0] == "RUNNING", 20, "job 1 running")
    pods.append(scheduled_pod(api, "1", "1024Mi"))            # "scale up by one replica"
    wait_for(lambda: allocated(api, "n1") == {
        "Slurm": {"cpu": "3", "memory": "4000Mi"},
        "Kubernetes": {"cpu": "2735m", "memory": "3417Mi"}}, what="both sides in GenericNode")
    wait_used(slurm, (3 + 3, 4000 + 3417))     # job 1 + the pods, in Slurm's own accounting
    # Written by the sync daemon alone: no field owners tracked, whatever
    # its writes since the create.
    assert not generic_node(api, "n1")["metadata"].get("managedFields")

    # 8 CPUs - 3 (job 1) - 3 (pods, rounded up) = 2 left: a second -c 3 pends.
    job2 = sbatch(slurm, "-c", "3", "--mem=4000")
    wait_for(lambda: job_state(slurm, job2) == ("PENDING", "Resources"), 20, "job 2 pending")
    time.sleep(3)
    assert job_state(slurm, job2)[0] == "PENDING"

    for p in pods:
        delete_pod(api, p)
    wait_for(lambda: job_state(slurm, job2)[0] == "RUNNING", 30, "job 2 starts after pods go")
    wait_used(slurm, (6, 8000))                # two jobs, no share
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "0", "memory": "0"})


def test_generic_nodes_written_with_field_owners_lose_them(slurm, api, daemon):
    """A GenericNode as an earlier version left it (its managedFields: who
    created the spec, who patched the status) is kept, loses them at the
    sync daemon's first list, and its status then follows the pods
    without the API server tracking them again."""
    k8s_node(api, "n1")
    wait_for(lambda: allocated(api, "n1"), what="GenericNode n1")
    daemon.stop()
    old = generic_node(api, "n1")
    api.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, "n1")
    api.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, {
        "apiVersion": old["apiVersion"], "kind": old["kind"], "spec": old["spec"],
        "metadata": {"name": "n1", "labels": old["metadata"]["labels"]}})
    api.custom.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, "n1",
                                                  {"status": old["status"]})
    assert len(generic_node(api, "n1")["metadata"]["managedFields"]) == 2
    daemon.start()
    # Cleared after its first list, within the write budget: maybe after a
    # status write, which the API server then tracks until the clear.
    wait_for(lambda: not generic_node(api, "n1")["metadata"].get("managedFields"),
             what="GenericNode n1 without field owners")
    scheduled_pod(api, "1", "1024Mi")
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "1", "memory": "1024Mi"},
             what="the pod in GenericNode n1")
    gn = generic_node(api, "n1")
    assert not gn["metadata"].get("managedFields")
    assert gn["spec"] == old["spec"] and gn["metadata"]["uid"] != old["metadata"]["uid"]


def test_a_terminating_pod_holds_its_share_until_it_is_gone(slurm, api, daemon):
    """Deleted with a grace period, a pod runs on until its kubelet (kwok)
    ends it: its share stays in Slurm all that time, and goes with it."""
    k8s_node(api, "n1")
    p = scheduled_pod(api, "3", "1000Mi", grace=4)
    wait_used(slurm, (3, 1000))
    t0 = time.monotonic()
    delete_pod(api, p, grace=4)
    # deletionTimestamp = now + 4 s in whole seconds: the pod goes 3-4 s on.
    while time.monotonic() - t0 < 2.5:
        pod = exists(api, p)            # ground truth: the API server still has it
        assert pod is not None and pod.metadata.deletion_timestamp is not None
        assert used(slurm) == (3, 1000)
        time.sleep(0.2)
    wait_for(lambda: exists(api, p) is None, 15, "the pod gone after its grace period")
    wait_used(slurm, (0, 0))
    assert time.monotonic() - t0 >= 3.0


def test_what_slurm_allocated_beyond_the_jobs_gres_is_held_from_pods(slurm, api, daemon):
    """Belt and braces: a job that holds no k8scpu/k8smemory (submitted while
    job_submit was not loaded) and a COMPLETING job (Slurm freed its GRES,
    its processes run until KillWait) are held from pods all the same, judged
    by Slurm's own GresUsed and its job states; the first is said in an
    Event on the node's GenericNode."""
    k8s_node(api, "n1")
    scheduled_pod(api, "1", "1000Mi")
    wait_used(slurm, (1, 1000))
    with open(slurm.conf) as f:
        original = f.read()
    slurm.rewrite_conf(original.replace("JobSubmitPlugins=", "#JobSubmitPlugins="))
    subprocess.run(["scontrol", "reconfigure"], env=slurm.env, check=True)
    try:
        bare = sbatch(slurm, "-c", "3", "--mem=2000")
        wait_for(lambda: job_state(slurm, bare)[0] == "RUNNING", 20, "the bare job running")
    finally:
        slurm.rewrite_conf(original)
        subprocess.run(["scontrol", "reconfigure"], env=slurm.env, check=True)
    wait_used(slurm, (1 + 3, 1000 + 2000), timeout=20)   # the pod's share, what the job uses
    wait_for(lambda: any(e.reason == "SlurmAllocationUnheld" and "3 CPUs and 2000 MB" in e.message
                         for e in api.core.list_namespaced_event("default").items),
             what="an Event on GenericNode n1")
    subprocess.run(["scancel", bare], env=slurm.env, check=True)
    # Let go once the job is gone, COMPLETING included (a loaded machine may
    # keep it there, or a read of Slurm waiting, for several seconds).
    wait_used(slurm, (1, 1000), timeout=40)

    # A job that ignores SIGTERM: COMPLETING for KillWait after scancel.
    stubborn = subprocess.run(
        ["sbatch", "--parsable", "-w", "n1", "-c", "2", "--mem=3000", "--wrap",
         "trap '' TERM; sleep 300"], env=slurm.env, capture_output=True, text=True,
        check=True).stdout.strip()
    wait_for(lambda: job_state(slurm, stubborn)[0] == "RUNNING", 20, "the stubborn job running")
    wait_used(slurm, (1 + 2, 1000 + 3000))
    # The daemon learns of a job's end from the ledger's count of what jobs
    # hold: a job that starts and ends between two of its reads (resync 0.5
    # s) is seen only at its next full read of Slurm (slurm_read_seconds).
    time.sleep(1.5)
    subprocess.run(["scancel", stubborn], env=slurm.env, check=True)
    t0 = time.monotonic()
    seen_completing = 0
    while job_state(slurm, stubborn)[0] == "COMPLETING":
        if time.monotonic() - t0 > 3.0:     # the daemon has seen it by now
            assert used(slurm) == (1 + 2, 1000 + 3000)
            # Slurm's CPUAlloc dropped the job at once; its GenericNode side does not.
            assert allocated(api, "n1")["Slurm"] == {"cpu": "2", "memory": "3000Mi"}
            seen_completing += 1
        time.sleep(0.2)
    assert seen_completing, "the job was never seen COMPLETING"
    assert time.monotonic() - t0 >= KILL_WAIT - 1
    wait_used(slurm, (1, 1000), timeout=40)


def test_a_resize_counts_at_the_larger_of_spec_and_what_runs(slurm, api, daemon):
    """In-place resize with a real kubelet's timing (kwok): a downsize frees
    nothing until the kubelet applied it (Deferred: not at all), a growth
    counts at once, and so does one the kubelet calls Infeasible: 1.35's
    kube-scheduler drops the spec then, the ledger does not (the kubelet
    judges it again when the node or the pod changes)."""
    k8s_node(api, "n1")
    p = scheduled_pod(api, "2", "100Mi", annotations={KUBELET_RESIZE: "Deferred"})
    wait_used(slurm, (2, 100))

    def resize(cpu):
        api.core.patch_namespaced_pod_resize(p, "default", {"spec": {"containers": [
            {"name": "c", "resources": {"requests": {"cpu": cpu}}}]}})

    def pending():
        conds = api.core.read_namespaced_pod(p, "default").status.conditions or []
        return next((c.reason for c in conds if c.type == "PodResizePending"), None)

    def kubelet(annotation):
        api.core.patch_namespaced_pod(p, "default", {"metadata": {"annotations": {
            KUBELET_RESIZE: annotation}}})

    def counted():     # what kube-scheduler counts for the pod, from the API server's copy
        pod = api.core.api_client.sanitize_for_serialization(
            api.core.read_namespaced_pod(p, "default"))
        return quantities.pod_requests(pod)["cpu"]

    resize("1")
    wait_for(lambda: pending() == "Deferred", 10, "the downsize Deferred")
    assert counted() == 2
    held(slurm, (2, 100))
    kubelet(None)                                   # the kubelet applies it
    wait_for(lambda: pending() is None and counted() == 1, 10, "the downsize applied")
    wait_used(slurm, (1, 100))

    kubelet("Infeasible")
    resize("3")
    wait_for(lambda: pending() == "Infeasible", 10, "the growth Infeasible")
    assert counted() == 1                           # kube-scheduler drops the spec...
    wait_used(slurm, (3, 100))                      # ...the ledger holds it
    held(slurm, (3, 100))
    kubelet(None)
    wait_for(lambda: pending() is None and counted() == 3, 10, "the growth applied")
    wait_used(slurm, (3, 100))


@pytest.mark.parametrize("daemon", ["generic_node_qps = 1.0\ngeneric_node_burst = 1\n"],
                         indirect=True)
def test_generic_nodes_within_a_write_budget_still_end_true(slurm, api, daemon):
    """GenericNode updates keep a write budget (here 1/s): a burst of pods on
    both nodes is in Slurm's ledger at once, and both GenericNodes end equal
    to what the API server has bound there (checked against the pods, not
    against the daemon).  Placed by nodeName: the figures per node are the point."""
    for n in ("n1", "n2"):
        k8s_node(api, n)
    wait_for(lambda: all(allocated(api, n) for n in ("n1", "n2")), what="GenericNodes created")
    t0 = time.monotonic()
    for i in range(8):
        bound_pod(api, ("n1", "n2")[i % 2], f"{250 * (i + 1)}m", f"{100 * (i + 1)}Mi")
    # Slurm's side is never throttled: 250+750+1250+1750 m = 4 CPUs, 1600 MiB on n1.
    wait_used(slurm, (4, 1600), "n1", timeout=5)
    wait_used(slurm, (5, 2000), "n2", timeout=5)
    in_ledger = time.monotonic() - t0
    admin = kube_calls.Kube(api.kubeconfig)

    def truth(node):
        pods = kube_calls.list_pods(admin, field_selector=f"spec.nodeName={node}")
        cpu = sum(quantities.pod_requests(p)["cpu"] for p in pods)
        mem = sum(quantities.pod_requests(p)["memory"] for p in pods)
        return {"cpu": quantities.format_cpu(cpu), "memory": quantities.format_memory(mem)}
    wait_for(lambda: all(allocated(api, n)["Kubernetes"] == truth(n) for n in ("n1", "n2")),
             20, "GenericNodes equal to the pods bound")
    assert truth("n1") == {"cpu": "4", "memory": "1600Mi"}
    print(f"ledger current after {in_ledger:.2f} s, GenericNodes after "
          f"{time.monotonic() - t0:.2f} s (budget 1 write/s)")
    for p in api.core.list_pod_for_all_namespaces().items:   # leave n2's share empty too
        delete_pod(api, p.metadata.name, p.metadata.namespace)
    wait_used(slurm, (0, 0), "n1")
    wait_used(slurm, (0, 0), "n2")
    wait_for(lambda: all(allocated(api, n)["Kubernetes"] == {"cpu": "0", "memory": "0"}
                         for n in ("n1", "n2")), 20, "GenericNodes back to nothing")


def test_a_burst_on_one_node_is_one_generic_node_write_per_interval(slurm, api, daemon):
    """One node's GenericNode is updated at most once per
    generic_node_min_interval_seconds (2 s by default), with its newest
    state: 12 pods on n1 over a second or so are in Slurm's ledger at once,
    cost at most one status write per interval they last plus the last (the
    API server's own count; one a pod without the interval), and n1's
    GenericNode ends equal to the pods bound."""
    for n in ("n1", "n2"):
        k8s_node(api, n)
    wait_for(lambda: all(allocated(api, n) for n in ("n1", "n2")), what="GenericNodes created")
    admin = kube_calls.Kube(api.kubeconfig)
    before, t0 = status_writes(admin), time.monotonic()
    for _ in range(12):
        bound_pod(api, "n1", "250m", "100Mi")
        time.sleep(0.1)          # each its own decision, as pods arriving one by one
    burst = time.monotonic() - t0
    wait_used(slurm, (3, 1200), "n1", timeout=5)
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "3", "memory": "1200Mi"},
             10, "GenericNode n1 equal to the pods bound")
    time.sleep(2.5)              # a write still due would be made by now
    writes = status_writes(admin) - before
    print(f"12 pods in {burst:.2f} s: {writes:.0f} GenericNode status writes")
    assert 1 <= writes <= 2 + burst // 2.0, f"{writes} writes for a burst of {burst:.2f} s"
    assert allocated(api, "n1")["Kubernetes"] == {"cpu": "3", "memory": "1200Mi"}


def test_terminal_unbound_and_worker_pods_do_not_count(slurm, api, daemon):
    k8s_node(api, "n1")
    ensure_namespace(api, "slurm-workers")
    scheduled_pod(api, "1", "1000Mi", ns="slurm-workers")    # the admin named it
    new_pod(api, "4", "0", name="unbound", node_selector=NOWHERE)   # no node fits: pends
    finished = scheduled_pod(api, "2", "0")
    # Its kubelet reports it Succeeded (the Node authorizer lets n1's kubelet
    # write the status of pods on n1).
    done(api.as_node("n1").patch_namespaced_pod_status(
        finished, "default", {"status": {"phase": "Succeeded"}},
        _content_type="application/merge-patch+json", _preload_content=False))
    counted = scheduled_pod(api, "500m", "100Mi")
    wait_used(slurm, (1, 100))
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "500m", "memory": "100Mi"})
    unbound = api.core.read_namespaced_pod("unbound", "default")
    assert unbound.spec.node_name is None and unbound.status.phase == "Pending"
    assert api.core.read_namespaced_pod(finished, "default").status.phase == "Succeeded"
    delete_pod(api, counted)
    wait_used(slurm, (0, 0))


def test_no_self_service_exemption(slurm, api, daemon):
    """What a user would try to exempt a pod: labels, annotations and names a
    pod creator writes exempt nothing; an annotation on a Node (written by
    its own kubelet, which may) redirects nothing."""
    k8s_node(api, "n1", annotations={"pyk8sres.io/slurm-node": "n2"})
    scheduled_pod(api, "1", "100Mi", labels={"pyk8sres.io/slurm-worker": "true"})
    scheduled_pod(api, "1", "100Mi", annotations={"pyk8sres.io/slurm-worker": "true"})
    scheduled_pod(api, "1", "100Mi", name="slurm-share-n1")       # a placeholder's name
    scheduled_pod(api, "1", "100Mi", ns="kube-system")
    wait_used(slurm, (4, 400), node="n1")
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "4", "memory": "400Mi"})
    assert generic_node(api, "n1")["spec"]["alias"] == "n1"    # not redirected to n2
    assert used(slurm, "n2") == (0, 0)                          # n2 untouched
    for p in api.core.list_pod_for_all_namespaces().items:
        delete_pod(api, p.metadata.name, p.metadata.namespace)
    wait_used(slurm, (0, 0), node="n1")      # the next test starts from an empty node


def test_mapping_and_unmapped_nodes(slurm, api, daemon):
    k8s_node(api, "k8s-worker-a", slurm_node="n2")     # mapped by the admin-only label
    k8s_node(api, "kx")                                 # no Slurm node: ignored
    bound_pod(api, "k8s-worker-a", "2", "2000Mi")
    bound_pod(api, "kx", "6", "6000Mi")
    wait_used(slurm, (2, 2000), node="n2")
    gn = wait_for(lambda: generic_node(api, "k8s-worker-a"), what="GenericNode k8s-worker-a")
    assert gn["spec"]["alias"] == "n2"
    with pytest.raises(ApiException) as e:
        generic_node(api, "kx")
    assert e.value.status == 404
    # n1 has no Kubernetes node and no pods: full capacity (kx's pods count nowhere).
    wait_used(slurm, (0, 0), node="n1")


def test_slurmctld_restart_reapplies(slurm, api, daemon):
    k8s_node(api, "n1")
    scheduled_pod(api, "3", "3000Mi")
    wait_used(slurm, (3, 3000))
    slurm.restart_slurmctld()
    # The ledger is replayed inside slurmctld at startup: the share is back
    # before any job is scheduled, without the daemon's help.
    wait_used(slurm, (3, 3000), timeout=10)
    subprocess.run(["scontrol", "reconfigure"], env=slurm.env, check=True)
    wait_used(slurm, (3, 3000), timeout=10)


def test_daemon_restart_keeps_and_recovers(slurm, api, daemon):
    """A pod deleted while no sync ran may still run (nobody saw its
    containers stop): a restarted sync holds its share for the default
    grace period and margin, then lets it go."""
    k8s_node(api, "n1")
    p = scheduled_pod(api, "2", "1000Mi")
    wait_used(slurm, (2, 1000))
    daemon.stop()
    delete_pod(api, p)
    q = scheduled_pod(api, "1", "0")
    time.sleep(1.5)
    assert used(slurm) == (2, 1000)   # nobody raced ahead
    t0 = time.monotonic()
    daemon.start()
    wait_used(slurm, (3, 1000))       # q counted, p held
    wait_used(slurm, (1, 0), timeout=departures.DEFAULT_GRACE + 15)
    assert time.monotonic() - t0 >= departures.DEFAULT_GRACE
    delete_pod(api, q)
    wait_used(slurm, (0, 0))


def test_apiserver_down_never_hands_back_capacity(slurm, api, daemon):
    k8s_node(api, "n1")
    p = scheduled_pod(api, "2", "1000Mi")
    wait_used(slurm, (2, 1000))
    api.stop_apiserver()
    try:
        time.sleep(2)
        slurm.restart_slurmctld()           # counts reset while Kubernetes is away
        wait_used(slurm, (2, 1000), timeout=10)
        time.sleep(2)
        assert used(slurm) == (2, 1000)
    finally:
        api.start_apiserver()               # same etcd: same contents
    assert daemon.proc.poll() is None, "daemon must survive the API server going away"
    delete_pod(api, p)
    wait_used(slurm, (0, 0), timeout=40)   # backs off, then recovers
    assert "watch lost" in daemon.log_text()


def test_410_relist(slurm, api, daemon):
    """The daemon falls far behind: frozen while the API server restarts
    (its watch cache then starts at the current revision), pods churn and
    etcd compacts.  Its old resourceVersion is gone for good (410); it must
    relist and end up with the right counts."""
    k8s_node(api, "n1")
    p = scheduled_pod(api, "1", "0")
    wait_used(slurm, (1, 0))
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        api.restart_apiserver()
        delete_pod(api, p)
        for i in range(50):    # on a node that does not exist: they never run
            delete_pod(api, bound_pod(api, "kx", "1", "0", name=f"churn-{i}"))
        q = bound_pod(api, "n1", "3", "0")    # while the daemon sleeps
        api.compact()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # p went while the daemon was not looking, and n1 may have gone Unknown
    # while the API server was away: p's share is held until n1 is Ready
    # again, then its grace period (0) and the margin.
    wait_for(lambda: node_ready(api, "n1"), 60, "n1 Ready again")
    wait_used(slurm, (3, 0), timeout=30)
    delete_pod(api, q)
    wait_used(slurm, (0, 0))
    # Either the resumed watch was answered 410, or the broken connection
    # made it relist straight away; both log "relisting".
    assert "relisting" in daemon.log_text()


def test_malformed_quantity(slurm, api, daemon):
    """A real API server rejects malformed quantities; if one ever gets
    through, the node is held at its last counts (never raised)."""
    k8s_node(api, "n1")
    good = scheduled_pod(api, "1", "0")
    wait_used(slurm, (1, 0))
    try:
        bound_pod(api, "n1", "lots", "12 GB", name="bad")
        accepted = True
    except (ApiException, ValueError):
        accepted = False
    delete_pod(api, good)
    if accepted:
        time.sleep(2)
        assert used(slurm) == (1, 0)     # held
        assert "malformed quantity" in daemon.log_text()
        delete_pod(api, "bad")
    assert exists(api, "bad") is None
    wait_used(slurm, (0, 0))


def test_share_is_in_the_ledger_and_survives_the_daemon(slurm, api, daemon):
    """The ledger (inside slurmctld) holds each pod by UID; the daemon keeps
    no state of its own, so stopping it changes nothing in Slurm."""
    k8s_node(api, "n1")
    name = scheduled_pod(api, "2", "1000Mi")
    uid = api.core.read_namespaced_pod(name, "default").metadata.uid
    wait_used(slurm, (2, 1000))
    shown = Ledger(ledger_socket_path(slurm.conf)).show("n1")["nodes"]["n1"]
    assert shown["entries"] == {uid: [2000, 1000 << 20]}
    assert shown["share"] == {"cpu": 2, "mem": 1000} and shown["jobs"] == {"cpu": 0, "mem": 0}
    daemon.stop()
    time.sleep(1.5)
    assert used(slurm) == (2, 1000)


@pytest.mark.parametrize("daemon", ["reservation_grace = 6.0\nwatch_timeout = 2\n"
                                    "request_timeout = 3.0\nrepair_seconds = 1.0\n"
                                    "idle_full_seconds = 1.0\n"], indirect=True)
def test_a_reservation_never_bound_expires_and_bound_pods_stay(slurm, api, daemon):
    """A pod admitted (reserved in the ledger) but never bound, e.g. its
    create failed after the webhook: the repair drops it once its grace
    period is over, also on a node whose pods did not change; what bound
    pods hold stays, and so does a fresh reservation."""
    k8s_node(api, "n1")
    k8s_node(api, "n2")
    bound_pod(api, "n1", "1", "1000Mi")
    wait_used(slurm, (1, 1000))
    ledger = Ledger(ledger_socket_path(slurm.conf))
    assert ledger.reserve("n1", "admitted-never-bound", 2000, 500 << 20)["ok"]
    assert ledger.reserve("n2", "admitted-never-bound-2", 3000, 0)["ok"]
    assert used(slurm) == (3, 1500) and used(slurm, "n2") == (3, 0)
    held(slurm, (3, 1500), seconds=3.0)             # within its grace period: kept
    wait_used(slurm, (1, 1000), timeout=15.0)       # then dropped, the bound pod kept
    wait_used(slurm, (0, 0), node="n2", timeout=5.0)
    assert ledger.show("n1")["nodes"]["n1"]["reserved"] == 0


def test_once(slurm, api, tmp_path):
    k8s_node(api, "n1")
    p = scheduled_pod(api, "1", "500Mi")
    try:
        r = subprocess.run([hybrid.coordinator_python(), "-m", "pyk8sres.coordinator.sync",
                            "--once", "--kubeconfig", coordinator_kubeconfig(slurm, api)],
                           capture_output=True, text=True, timeout=60, **as_coordinator(slurm))
        assert r.returncode == 0, r.stderr
        assert used(slurm) == (1, 500)
        assert allocated(api, "n1")["Kubernetes"] == {"cpu": "1", "memory": "500Mi"}
    finally:
        delete_pod(api, p)
        clean(slurm, api)


def test_pods_beyond_what_jobs_leave_are_clamped_and_reported(slurm, api, daemon):
    """A pod bound without admission onto a node Slurm jobs fill (spec.nodeName:
    no scheduler asked): Slurm's accounting stays within the total
    (allocated <= total), no new job starts there, and GenericNode and the
    log say so loudly."""
    k8s_node(api, "n1")
    job = sbatch(slurm, "-c", "6", "--mem=1000")
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")
    pod = bound_pod(api, "n1", "4", "1000Mi")          # 6 + 4 > 8

    def condition():
        conds = generic_node(api, "n1").get("status", {}).get("conditions", [])
        return {c["type"]: c["status"] for c in conds}.get("Oversubscribed")
    wait_for(lambda: condition() == "True", what="Oversubscribed condition")
    wait_used(slurm, (8, 2000))                        # clamped: 6 (job) + 2 of the pod's 4
    small = sbatch(slurm, "-c", "1", "--mem=100")
    wait_for(lambda: job_state(slurm, small) == ("PENDING", "Resources"), 20, "new job pends")
    assert "oversubscribed" in daemon.log_text()
    delete_pod(api, pod)
    wait_for(lambda: condition() == "False", what="condition cleared")
    wait_for(lambda: job_state(slurm, small)[0] == "RUNNING", 30, "the job starts")


def test_a_forced_delete_holds_the_share_for_the_pods_grace_period(slurm, api, daemon):
    """`kubectl delete --grace-period=0 --force`: the object goes at once, the
    kubelet kills the containers only afterwards, within the pod's grace
    period.  No job starts on those CPUs until it has run out."""
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "6", "100Mi", grace=8)
    running(api, p)
    wait_used(slurm, (6, 100))
    delete_pod(api, p, grace=0)
    t0 = time.monotonic()
    wait_for(lambda: exists(api, p) is None, 10, "the forced delete")
    job = sbatch(slurm, "-c", "8")
    pending_while(slurm, api, job, None, 7.0 - (time.monotonic() - t0))
    # What keeps the job pending shows on the GenericNode (it is past the interval).
    assert allocated(api, "n1")["Kubernetes"] == {"cpu": "6", "memory": "100Mi"}
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "the job, once the grace ran out")
    assert time.monotonic() - t0 >= 8.0
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "0", "memory": "0"}, 10,
             "GenericNode n1 without the pod once its hold ended")


@pytest.mark.parametrize("how", ["Node deleted", "mapping label removed"])
def test_a_node_that_loses_its_mapping_keeps_its_pods_share(slurm, api, daemon, how):
    """The Node object deleted (an admin, an autoscaler, a re-registering
    node) or its mapping label removed under a running pod: the pod is still
    bound and runs, so its share stays until it is gone and its grace is up."""
    k8s_node(api, "k8s-b", slurm_node="n2")
    p = bound_pod(api, "k8s-b", "6", "100Mi")
    running(api, p)
    wait_used(slurm, (6, 100), node="n2")
    if how == "Node deleted":
        done(api.core.delete_node("k8s-b", _preload_content=False))
    else:
        api.core.patch_node("k8s-b", {"metadata": {"labels": {
            "node-restriction.kubernetes.io/pyk8sres-slurm-node": None}}})
    job = sbatch(slurm, "-c", "8", node="n2")
    pending_while(slurm, api, job, p, 6.0, node="k8s-b")
    delete_pod(api, p)        # grace 0: gone once its kubelet is told
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "the job, once the pod is gone")


@pytest.mark.parametrize("daemon", [SLINKY], indirect=True)
def test_worker_pods_map_their_node_without_a_map(slurm, api, daemon):
    """Slurm run by Slinky: the Kubernetes node running the worker pod of
    Slurm node n2 is shared as n2 with no node_map or label; the worker
    itself holds nothing, the other pods there do.  A second worker naming
    n2 from another node maps nothing new: the first node keeps n2, and
    its pods (one that comes meanwhile too) count there all the while."""
    k19, k20 = "cn-hongkong.10.1.0.19", "cn-hongkong.10.1.0.20"
    k8s_node(api, k19)
    k8s_node(api, k20)
    running(api, slinky_worker(api, "slinky-0", k19, "n2"), ns="slurm")
    p = bound_pod(api, k19, "2", "2000Mi")
    running(api, p)
    wait_used(slurm, (2, 2000), node="n2")         # the pod, not the worker's 4 CPUs
    gn = wait_for(lambda: generic_node(api, k19), what=f"GenericNode {k19}")
    assert gn["spec"]["alias"] == "n2"
    # Created, then its status written: a moment without allocatedResources.
    wait_for(lambda: allocated(api, k19).get("Kubernetes") == {"cpu": "2", "memory": "2000Mi"})
    assert used(slurm, "n1") == (0, 0)

    running(api, slinky_worker(api, "slinky-dup", k20, "n2"), ns="slurm")
    bound_pod(api, k20, "3", "0")
    wait_for(lambda: "Slurm node n2 is named by worker pods on several kubernetes nodes"
             in daemon.log_text(), what="the conflict logged")
    # k19 keeps what it had: its pods, and one that comes meanwhile, count on n2;
    # k20's do not, and k20 gets no GenericNode.
    q = bound_pod(api, k19, "1", "0")
    running(api, q)
    wait_used(slurm, (3, 2000), node="n2")
    held(slurm, (3, 2000), node="n2", seconds=2.0)
    assert generic_node(api, k19)["spec"]["alias"] == "n2"
    names = {g["metadata"]["name"] for g in
             api.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]}
    assert k20 not in names
    delete_pod(api, "slinky-dup", "slurm")
    delete_pod(api, q)
    delete_pod(api, p)
    wait_used(slurm, (0, 0), node="n2")


def test_slurm_capacity_beyond_allocatable_is_held(slurm, api, daemon):
    """n1's kubelet keeps 2 CPUs and 4000 MB for the system: its allocatable
    (6, 12000Mi) is less than Slurm shares (8, 16000).  The difference is
    held in the ledger: pods fill the allocatable, a job asking for one CPU
    more or for the whole Slurm node pends, and jobs + pods (ground truth)
    never exceed it; the entry goes when allocatable rises."""
    k8s_node(api, "n1")
    kube = kube_calls.Kube(api.kubeconfig, None, 10)

    def offer(cpu, mem):
        api.core.patch_node_status("n1", {"status": {"allocatable": {"cpu": cpu,
                                                                     "memory": mem}}})
    offer("6", "12000Mi")
    wait_used(slurm, (2, 4000))
    pods = [scheduled_pod(api, "4", "8000Mi"), scheduled_pod(api, "2", "4000Mi")]
    wait_used(slurm, (8, 16000))
    small = sbatch(slurm, "-c", "1", "--mem=1000")
    whole = sbatch(slurm, "-c", str(NODE_CPUS), f"--mem={NODE_MEM}")
    wait_for(lambda: job_state(slurm, small) == ("PENDING", "Resources"), 20, "one CPU more")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert over_capacity(slurm.env, kube, {"n1": (6, 12000)}) == []
        assert job_state(slurm, whole)[0] == job_state(slurm, small)[0] == "PENDING"
        time.sleep(0.3)
    assert allocated(api, "n1")["Kubernetes"] == {"cpu": "6", "memory": "12000Mi"}
    wait_for(lambda: generic_node(api, "n1")["status"]["capacity"] == {
        "cpu": "6", "memory": "12000Mi"}, what="the capacity both share")
    assert any(e.reason == "SlurmCapacityOverAllocatable" and "held" in e.message
               for e in api.core.list_namespaced_event("default").items)

    # Without pods the whole Slurm node is still more than n1 offers.
    subprocess.run(["scancel", small], env=slurm.env, check=True)
    for p in pods:
        delete_pod(api, p)
    wait_used(slurm, (2, 4000))
    pending_while(slurm, api, whole, None, 1.5)
    offer("8", "16000Mi")
    wait_for(lambda: job_state(slurm, whole)[0] == "RUNNING", 20, "the whole once allocatable rose")
    assert over_capacity(slurm.env, kube, {"n1": (8, 16000)}) == []
    ledger = Ledger(ledger_socket_path(slurm.conf))
    try:
        assert "k8s:beyond-allocatable" not in ledger.show("n1")["nodes"]["n1"]["entries"]
    finally:
        ledger.close()
