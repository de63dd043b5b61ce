"""End to end: `pyk8sres sync` between a real local Slurm cluster and a real
Kubernetes API server (no mocks).  We check the state of the world --
Slurm's counts, job states, GenericNode objects -- never which calls were made.

Needs root, the built plugins (`pyk8sres cluster up` works; skips if not)
and the API server harness (tests/integration/conftest_kube.py; its first
run builds the server).  Ports 27300-27302 (Slurm), 27400-27402 (API, etcd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from pyk8sres.testbed import cluster as slurm_cluster  # noqa: E402
from pyk8sres.testbed.kubeapi_server import KubeAPIServer  # noqa: E402
from local_slurm import SLURM, port  # noqa: E402

from conftest_kube import CRD_MANIFEST  # noqa: E402

GROUP, VERSION, PLURAL = "pyk8sres.io", "v1alpha1", "genericnodes"
BASE_PORT = port(27300)     # slurmctld, then one per slurmd
KUBE_PORT = port(27400)
NODE_CPUS, NODE_MEM = 8, 16000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")


# ----------------------------------------------------------------- fixtures

class Api:
    """A real API server of our own (we stop and restart it, so not the
    session-wide one), plus clients for it."""

    def __init__(self, paths, work):
        self.paths, self.work = paths, work
        self.start()
        self.server.apply(CRD_MANIFEST)
        self.core = client.CoreV1Api(config.new_client_from_config(self.kubeconfig))
        self.custom = client.CustomObjectsApi(config.new_client_from_config(self.kubeconfig))

    def start(self):
        # Same workdir and ports: etcd keeps its data, like a real restart.
        self.server = KubeAPIServer(self.paths).start(self.work, KUBE_PORT)
        self.kubeconfig = self.server.kubeconfig

    def stop(self):
        self.server.stop()

    def compact(self) -> None:
        """Compact etcd's history up to now (etcd's own v3 HTTP gateway):
        old resourceVersions are gone for good."""
        import base64
        import urllib.error
        import urllib.request

        def post(path, body):
            req = urllib.request.Request(self.server.etcd_url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)
        rev = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})
                  ["header"]["revision"])
        try:
            post("/v3/kv/compaction", {"revision": rev, "physical": True})
        except urllib.error.HTTPError as e:
            if e.code != 400:   # 400: already compacted up to here
                raise


@pytest.fixture(scope="module")
def root():
    # Short paths (munge's socket path must stay under 108 bytes); kept
    # afterwards for the logs (slurm/log/sync.log is the daemon's).
    return tempfile.mkdtemp(prefix="pyk8sres-sync-it-")


@pytest.fixture(scope="module")
def slurm(root):
    work = f"{root}/slurm"
    c = slurm_cluster.up(work, nodes=2, cpus=NODE_CPUS, memory=NODE_MEM, base_port=BASE_PORT,
                         synced=True, slurm=SLURM)
    os.environ["SLURM_CONF"] = c.conf
    yield c
    subprocess.run(["scancel", "--full", "-u", "root"], env=c.env, capture_output=True)
    slurm_cluster.down(work)


@pytest.fixture(scope="module")
def api(kube_paths, root):
    a = Api(kube_paths, f"{root}/kube")
    yield a
    a.stop()


class Daemon:
    """`pyk8sres sync` as its own process (started and stopped by PID)."""

    def __init__(self, slurm, api, settings: str = ""):
        self.slurm, self.api, self.settings = slurm, api, settings
        self.proc = None
        self.log = f"{slurm.work}/log/sync.log"

    def start(self):
        # The admin's configuration: only namespace "slurm-workers" holds
        # Slurm's own worker pods (issue 8 item 9: nothing else exempts a pod).
        conf = f"{self.slurm.work}/sync.toml"
        with open(conf, "w") as f:
            f.write('slurm_workers = ["slurm-workers"]\n' + self.settings)
        cmd = [sys.executable, "-m", "pyk8sres.coordinator.sync", "--kubeconfig", self.api.kubeconfig,
               "--config", conf, "--resync", "0.5", "--log-level", "DEBUG",
               "--metrics-address", "127.0.0.1:0"]
        env = dict(self.slurm.env)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_text(self):
        with open(self.log, errors="replace") as f:
            return f.read()


@pytest.fixture
def daemon(slurm, api, request):
    d = Daemon(slurm, api, getattr(request, "param", ""))
    d.start()
    yield d
    d.stop()
    # Leave the next test a clean world: no pods, no jobs, no extra nodes.
    subprocess.run(["scancel", "-u", "root"], env=slurm.env, capture_output=True)
    for p in api.core.list_pod_for_all_namespaces().items:
        _delete_pod(api, p.metadata.name, p.metadata.namespace)
    for n in api.core.list_node().items:
        api.core.delete_node(n.metadata.name, _preload_content=False).release_conn()


# ----------------------------------------------------------------- helpers

def wait_for(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except ApiException as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def k8s_node(api, name, slurm_node=None, annotations=None):
    from pyk8sres.policy.usage import NODE_LABEL
    meta = {"name": name, "annotations": annotations or {}}
    if slurm_node:
        meta["labels"] = {NODE_LABEL: slurm_node}   # admin-only label
    api.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": meta,
                          "status": {"capacity": {"cpu": str(NODE_CPUS),
                                                  "memory": f"{NODE_MEM}Mi"}}},
                          _preload_content=False).release_conn()


def bound_pod(api, node, cpu, mem, name=None, labels=None, ns="default", annotations=None):
    name = name or f"p-{uuid.uuid4().hex[:8]}"
    api.core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"nodeName": node, "containers": [{
            "name": "c", "image": "busybox",
            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}},
        _preload_content=False).release_conn()
    return name


def ensure_namespace(api, name):
    try:
        api.core.create_namespace({"metadata": {"name": name}}, _preload_content=False).release_conn()
    except ApiException as e:
        if e.status != 409:
            raise


def _delete_pod(api, name, ns="default"):
    try:
        # Raw response: client v37 fails to deserialize delete's Status body.
        api.core.delete_namespaced_pod(name, ns, grace_period_seconds=0,
                                       _preload_content=False).release_conn()
    except ApiException as e:
        if e.status != 404:
            raise


def used(slurm, node="n1"):
    """Slurm's own word (scontrol -d show node): k8scpu/k8smemory allocated
    on the node = Slurm jobs + Kubernetes' share.  The totals never move."""
    from pyk8sres.coordinator import slurm as S
    os.environ["SLURM_CONF"] = slurm.conf
    n = S.get_node(node)
    assert (n.gres.get("k8scpu"), n.gres.get("k8smemory")) == (NODE_CPUS, NODE_MEM)
    return n.gres_used.get("k8scpu", 0), n.gres_used.get("k8smemory", 0)


def wait_used(slurm, want, node="n1", timeout=10.0):
    return wait_for(lambda: used(slurm, node) == want, timeout,
                    f"{node} GresUsed {want} (now {used(slurm, node)})")


def generic_node(api, name):
    return api.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)


def allocated(api, name):
    gn = generic_node(api, name)
    return {a["type"]: a["allocated"] for a in gn.get("status", {}).get("allocatedResources", [])}


def sbatch(slurm, *args):
    out = subprocess.run(["sbatch", "--parsable", "-w", "n1", *args, "--wrap", "sleep 300"],
                         env=slurm.env, capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


def job_state(slurm, job):
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=slurm.env,
                         capture_output=True, text=True).stdout.split()
    return tuple(out[:2]) if out else ("GONE", "")


# ----------------------------------------------------------------- tests

def test_reference_walkthrough(slurm, api, daemon):
    """The user-facing walkthrough of the reference product, end to end."""
    k8s_node(api, "n1")
    pods = [bound_pod(api, "n1", "1735m", "2393Mi")]
    gn = wait_for(lambda: allocated(api, "n1").get("Kubernetes", {}).get("cpu") == "1735m"
                  and generic_node(api, "n1"), what="GenericNode n1")
    assert gn["spec"]["alias"] == "n1" and gn["spec"]["type"] == "Slurm"
    assert allocated(api, "n1") == {"Slurm": {"cpu": "0", "memory": "0"},
                                    "Kubernetes": {"cpu": "1735m", "memory": "2393Mi"}}
    wait_used(slurm, (2, 2393))          # the pods' share, rounded up once

    # kubectl shows both sides, like the reference's `kubectl get genericnode`.
    out = subprocess.run(["kubectl", "--kubeconfig", api.kubeconfig, "get", "genericnode"],
                         capture_output=True, text=True, check=True).stdout
    assert "ALIAS" in out and "n1" in out and "1735m" in out

    job1 = sbatch(slurm, "-c", "3", "--mem=4000")
    wait_for(lambda: job_state(slurm, job1)[0] == "RUNNING", 20, "job 1 running")
    pods.append(bound_pod(api, "n1", "1", "1024Mi"))         # "scale up by one replica"
    wait_for(lambda: allocated(api, "n1") == {
        "Slurm": {"cpu": "3", "memory": "4000Mi"},
        "Kubernetes": {"cpu": "2735m", "memory": "3417Mi"}}, what="both sides in GenericNode")
    wait_used(slurm, (3 + 3, 4000 + 3417))     # job 1 + the pods, in Slurm's own accounting

    # 8 CPUs - 3 (job 1) - 3 (pods, rounded up) = 2 left: a second -c 3 pends.
    job2 = sbatch(slurm, "-c", "3", "--mem=4000")
    wait_for(lambda: job_state(slurm, job2) == ("PENDING", "Resources"), 20, "job 2 pending")
    time.sleep(3)
    assert job_state(slurm, job2)[0] == "PENDING"

    for p in pods:
        _delete_pod(api, p)
    wait_for(lambda: job_state(slurm, job2)[0] == "RUNNING", 30, "job 2 starts after pods go")
    wait_used(slurm, (6, 8000))                # two jobs, no share
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "0", "memory": "0"})


@pytest.mark.parametrize("daemon", ["generic_node_qps = 1.0\ngeneric_node_burst = 1\n"],
                         indirect=True)
def test_generic_nodes_within_a_write_budget_still_end_true(slurm, api, daemon):
    """GenericNode updates keep a write budget (here 1/s): a burst of pods on
    both nodes is in Slurm's ledger at once, and both GenericNodes end equal
    to what the API server has bound there (checked against the pods, not
    against the daemon)."""
    from pyk8sres.policy import usage as U
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

    def truth(node):
        pods = [p for p in api.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}").items]
        cpu = sum(U.parse_quantity(p.spec.containers[0].resources.requests["cpu"]) for p in pods)
        mem = sum(U.parse_quantity(p.spec.containers[0].resources.requests["memory"]) for p in pods)
        return {"cpu": U.format_cpu(cpu), "memory": U.format_memory(mem)}
    wait_for(lambda: all(allocated(api, n)["Kubernetes"] == truth(n) for n in ("n1", "n2")),
             20, "GenericNodes equal to the pods bound")
    assert truth("n1") == {"cpu": "4", "memory": "1600Mi"}
    print(f"ledger current after {in_ledger:.2f} s, GenericNodes after "
          f"{time.monotonic() - t0:.2f} s (budget 1 write/s)")
    for p in api.core.list_pod_for_all_namespaces().items:   # leave n2's share empty too
        _delete_pod(api, p.metadata.name, p.metadata.namespace)
    wait_used(slurm, (0, 0), "n1")
    wait_used(slurm, (0, 0), "n2")
    wait_for(lambda: all(allocated(api, n)["Kubernetes"] == {"cpu": "0", "memory": "0"}
                         for n in ("n1", "n2")), 20, "GenericNodes back to nothing")


def test_terminal_unbound_and_worker_pods_do_not_count(slurm, api, daemon):
    k8s_node(api, "n1")
    ensure_namespace(api, "slurm-workers")
    bound_pod(api, "n1", "1", "1000Mi", ns="slurm-workers")    # the admin named it
    api.core.create_namespaced_pod("default", {
        "metadata": {"name": "unbound"},
        "spec": {"containers": [{"name": "c", "image": "x",
                                 "resources": {"requests": {"cpu": "4"}}}]}},
        _preload_content=False).release_conn()
    done = bound_pod(api, "n1", "2", "0")
    api.core.patch_namespaced_pod_status(
        done, "default", {"status": {"phase": "Succeeded"}},
        _content_type="application/merge-patch+json", _preload_content=False).release_conn()
    counted = bound_pod(api, "n1", "500m", "100Mi")
    wait_used(slurm, (1, 100))
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "500m", "memory": "100Mi"})
    _delete_pod(api, counted)
    wait_used(slurm, (0, 0))


def test_no_self_service_exemption(slurm, api, daemon):
    """Issue 8 item 9, as a user would try it: labels, annotations and names a
    pod creator writes exempt nothing; an annotation on a Node (its kubelet
    can write one) redirects nothing."""
    k8s_node(api, "n1", annotations={"pyk8sres.io/slurm-node": "n2"})
    bound_pod(api, "n1", "1", "100Mi", labels={"pyk8sres.io/slurm-worker": "true"})
    bound_pod(api, "n1", "1", "100Mi", annotations={"pyk8sres.io/slurm-worker": "true"})
    bound_pod(api, "n1", "1", "100Mi", name="slurm-share-n1")       # a placeholder's name
    bound_pod(api, "n1", "1", "100Mi", ns="kube-system")
    wait_used(slurm, (4, 400), node="n1")
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "4", "memory": "400Mi"})
    assert generic_node(api, "n1")["spec"]["alias"] == "n1"    # not redirected to n2
    assert used(slurm, "n2") == (0, 0)                          # n2 untouched
    for p in api.core.list_pod_for_all_namespaces().items:
        _delete_pod(api, p.metadata.name, p.metadata.namespace)
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
    bound_pod(api, "n1", "3", "3000Mi")
    wait_used(slurm, (3, 3000))
    slurm.restart_slurmctld()
    # The ledger is replayed inside slurmctld at startup: the share is back
    # before any job is scheduled, without the daemon's help.
    wait_used(slurm, (3, 3000), timeout=10)
    subprocess.run(["scontrol", "reconfigure"], env=slurm.env, check=True)
    wait_used(slurm, (3, 3000), timeout=10)


def test_daemon_restart_keeps_and_recovers(slurm, api, daemon):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "2", "1000Mi")
    wait_used(slurm, (2, 1000))
    daemon.stop()
    _delete_pod(api, p)
    q = bound_pod(api, "n1", "1", "0")
    time.sleep(1.5)
    assert used(slurm) == (2, 1000)   # nobody raced ahead
    daemon.start()
    wait_used(slurm, (1, 0))
    _delete_pod(api, q)
    wait_used(slurm, (0, 0))


def test_apiserver_down_never_hands_back_capacity(slurm, api, daemon):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "2", "1000Mi")
    wait_used(slurm, (2, 1000))
    api.stop()
    try:
        time.sleep(2)
        slurm.restart_slurmctld()           # counts reset while Kubernetes is away
        wait_used(slurm, (2, 1000), timeout=10)
        time.sleep(2)
        assert used(slurm) == (2, 1000)
    finally:
        api.start()                         # same data dir: same etcd contents
    assert daemon.proc.poll() is None, "daemon must survive the API server going away"
    _delete_pod(api, p)
    wait_used(slurm, (0, 0), timeout=40)   # backs off, then recovers
    assert "watch lost" in daemon.log_text()


def test_410_relist(slurm, api, daemon):
    """The daemon falls far behind: frozen while the API server restarts
    (its watch cache then starts at the current revision), pods churn and
    etcd compacts.  Its old resourceVersion is gone for good (410); it must
    relist and end up with the right counts."""
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "1", "0")
    wait_used(slurm, (1, 0))
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        api.stop()
        api.start()
        _delete_pod(api, p)
        for i in range(50):
            _delete_pod(api, bound_pod(api, "kx", "1", "0", name=f"churn-{i}"))
        q = bound_pod(api, "n1", "3", "0")
        api.compact()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    wait_used(slurm, (3, 0), timeout=30)
    _delete_pod(api, q)
    wait_used(slurm, (0, 0))
    # Either the resumed watch was answered 410, or the broken connection
    # made it relist straight away; both log "relisting".
    assert "relisting" in daemon.log_text()


def test_malformed_quantity(slurm, api, daemon):
    """A real API server rejects malformed quantities; if one ever gets
    through, the node is held at its last counts (never raised)."""
    k8s_node(api, "n1")
    good = bound_pod(api, "n1", "1", "0")
    wait_used(slurm, (1, 0))
    try:
        bound_pod(api, "n1", "lots", "12 GB", name="bad")
        accepted = True
    except (ApiException, ValueError):
        accepted = False
    _delete_pod(api, good)
    if accepted:
        time.sleep(2)
        assert used(slurm) == (1, 0)     # held
        assert "malformed quantity" in daemon.log_text()
        _delete_pod(api, "bad")
    wait_used(slurm, (0, 0))


def test_share_is_in_the_ledger_and_survives_the_daemon(slurm, api, daemon):
    """The ledger (inside slurmctld) holds each pod by UID; the daemon keeps
    no state of its own, so stopping it changes nothing in Slurm."""
    from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
    k8s_node(api, "n1")
    name = bound_pod(api, "n1", "2", "1000Mi")
    uid = api.core.read_namespaced_pod(name, "default").metadata.uid
    wait_used(slurm, (2, 1000))
    shown = Ledger(ledger_socket_path(slurm.conf)).show("n1")["nodes"]["n1"]
    assert shown["entries"] == {uid: [2000, 1000 << 20]}
    assert shown["share"] == {"cpu": 2, "mem": 1000} and shown["jobs"] == {"cpu": 0, "mem": 0}
    daemon.stop()
    time.sleep(1.5)
    assert used(slurm) == (2, 1000)


def test_once(slurm, api, tmp_path):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "1", "500Mi")
    try:
        env = dict(slurm.env)
        r = subprocess.run([sys.executable, "-m", "pyk8sres.coordinator.sync", "--once",
                            "--kubeconfig", api.kubeconfig],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert used(slurm) == (1, 500)
        assert allocated(api, "n1")["Kubernetes"] == {"cpu": "1", "memory": "500Mi"}
    finally:
        _delete_pod(api, p)
        api.core.delete_node("n1", _preload_content=False).release_conn()


def test_pods_beyond_what_jobs_leave_are_clamped_and_reported(slurm, api, daemon):
    """A pod bound without admission onto a node Slurm jobs fill: Slurm's
    accounting stays within the total (allocated <= total), no new job
    starts there, and GenericNode and the log say so loudly."""
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
    _delete_pod(api, pod)
    wait_for(lambda: condition() == "False", what="condition cleared")
    wait_for(lambda: job_state(slurm, small)[0] == "RUNNING", 30, "the job starts")
