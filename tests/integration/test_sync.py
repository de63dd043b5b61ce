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

    def __init__(self, slurm, api, state_file):
        self.slurm, self.api, self.state_file = slurm, api, state_file
        self.proc = None
        self.log = f"{slurm.work}/log/sync.log"

    def start(self):
        cmd = [sys.executable, "-m", "pyk8sres.coordinator.sync", "--kubeconfig", self.api.kubeconfig,
               "--state-file", self.state_file, "--resync", "0.5", "--log-level", "DEBUG"]
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
def daemon(slurm, api):
    # The cluster's own state file: the node_features plugin reads it too.
    state = f"{slurm.work}/state/k8s_resources.state"
    d = Daemon(slurm, api, state)
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


def k8s_node(api, name, slurm_node=None):
    meta = {"name": name}
    if slurm_node:
        meta["annotations"] = {"pyk8sres.io/slurm-node": slurm_node}
    api.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": meta,
                          "status": {"capacity": {"cpu": str(NODE_CPUS),
                                                  "memory": f"{NODE_MEM}Mi"}}},
                          _preload_content=False).release_conn()


def bound_pod(api, node, cpu, mem, name=None, labels=None, ns="default"):
    name = name or f"p-{uuid.uuid4().hex[:8]}"
    api.core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"nodeName": node, "containers": [{
            "name": "c", "image": "busybox",
            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}},
        _preload_content=False).release_conn()
    return name


def _delete_pod(api, name, ns="default"):
    try:
        # Raw response: client v37 fails to deserialize delete's Status body.
        api.core.delete_namespaced_pod(name, ns, grace_period_seconds=0,
                                       _preload_content=False).release_conn()
    except ApiException as e:
        if e.status != 404:
            raise


def counts(slurm, node="n1"):
    from pyk8sres.coordinator import slurm as S
    os.environ["SLURM_CONF"] = slurm.conf
    n = S.get_node(node)
    return n.gres.get("k8scpu"), n.gres.get("k8smemory")


def wait_counts(slurm, want, node="n1", timeout=10.0):
    return wait_for(lambda: counts(slurm, node) == want, timeout,
                    f"{node} counts {want} (now {counts(slurm, node)})")


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
    wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 2393))

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
    wait_counts(slurm, (NODE_CPUS - 3, NODE_MEM - 3417))

    # 8 CPUs - 3 (pods, rounded up) = 5 for Slurm; job 1 holds 3: a second -c 3 pends.
    job2 = sbatch(slurm, "-c", "3", "--mem=4000")
    wait_for(lambda: job_state(slurm, job2) == ("PENDING", "Resources"), 20, "job 2 pending")
    time.sleep(3)
    assert job_state(slurm, job2)[0] == "PENDING"

    for p in pods:
        _delete_pod(api, p)
    wait_counts(slurm, (NODE_CPUS, NODE_MEM))
    wait_for(lambda: job_state(slurm, job2)[0] == "RUNNING", 30, "job 2 starts after pods go")
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "0", "memory": "0"})


def test_terminal_unbound_and_worker_pods_do_not_count(slurm, api, daemon):
    k8s_node(api, "n1")
    bound_pod(api, "n1", "1", "1000Mi", labels={"pyk8sres.io/slurm-worker": "true"})
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
    wait_counts(slurm, (NODE_CPUS - 1, NODE_MEM - 100))
    wait_for(lambda: allocated(api, "n1")["Kubernetes"] == {"cpu": "500m", "memory": "100Mi"})
    _delete_pod(api, counted)
    wait_counts(slurm, (NODE_CPUS, NODE_MEM))


def test_mapping_and_unmapped_nodes(slurm, api, daemon):
    k8s_node(api, "k8s-worker-a", slurm_node="n2")     # mapped by annotation
    k8s_node(api, "kx")                                 # no Slurm node: ignored
    bound_pod(api, "k8s-worker-a", "2", "2000Mi")
    bound_pod(api, "kx", "6", "6000Mi")
    wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 2000), node="n2")
    gn = wait_for(lambda: generic_node(api, "k8s-worker-a"), what="GenericNode k8s-worker-a")
    assert gn["spec"]["alias"] == "n2"
    with pytest.raises(ApiException) as e:
        generic_node(api, "kx")
    assert e.value.status == 404
    # n1 has no Kubernetes node and no pods: full capacity (kx's pods count nowhere).
    wait_counts(slurm, (NODE_CPUS, NODE_MEM), node="n1")


def test_slurmctld_restart_reapplies(slurm, api, daemon):
    k8s_node(api, "n1")
    bound_pod(api, "n1", "3", "3000Mi")
    wait_counts(slurm, (NODE_CPUS - 3, NODE_MEM - 3000))
    slurm.restart_slurmctld()
    # Back within the resync period (and the node_features plugin reads the
    # state file at startup, so there is no window with full capacity).
    wait_counts(slurm, (NODE_CPUS - 3, NODE_MEM - 3000), timeout=10)
    subprocess.run(["scontrol", "reconfigure"], env=slurm.env, check=True)
    wait_counts(slurm, (NODE_CPUS - 3, NODE_MEM - 3000), timeout=10)


def test_daemon_restart_keeps_and_recovers(slurm, api, daemon):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "2", "1000Mi")
    wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 1000))
    daemon.stop()
    _delete_pod(api, p)
    q = bound_pod(api, "n1", "1", "0")
    time.sleep(1.5)
    assert counts(slurm) == (NODE_CPUS - 2, NODE_MEM - 1000)   # nobody raced ahead
    daemon.start()
    wait_counts(slurm, (NODE_CPUS - 1, NODE_MEM))
    _delete_pod(api, q)
    wait_counts(slurm, (NODE_CPUS, NODE_MEM))


def test_apiserver_down_never_hands_back_capacity(slurm, api, daemon):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "2", "1000Mi")
    wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 1000))
    api.stop()
    try:
        time.sleep(2)
        slurm.restart_slurmctld()           # counts reset while Kubernetes is away
        wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 1000), timeout=10)
        time.sleep(2)
        assert counts(slurm) == (NODE_CPUS - 2, NODE_MEM - 1000)
    finally:
        api.start()                         # same data dir: same etcd contents
    assert daemon.proc.poll() is None, "daemon must survive the API server going away"
    _delete_pod(api, p)
    wait_counts(slurm, (NODE_CPUS, NODE_MEM), timeout=40)   # backs off, then recovers
    assert "watch lost" in daemon.log_text()


def test_410_relist(slurm, api, daemon):
    """The daemon falls far behind: frozen while the API server restarts
    (its watch cache then starts at the current revision), pods churn and
    etcd compacts.  Its old resourceVersion is gone for good (410); it must
    relist and end up with the right counts."""
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "1", "0")
    wait_counts(slurm, (NODE_CPUS - 1, NODE_MEM))
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
    wait_counts(slurm, (NODE_CPUS - 3, NODE_MEM), timeout=30)
    _delete_pod(api, q)
    wait_counts(slurm, (NODE_CPUS, NODE_MEM))
    # Either the resumed watch was answered 410, or the broken connection
    # made it relist straight away; both log "relisting".
    assert "relisting" in daemon.log_text()


def test_malformed_quantity(slurm, api, daemon):
    """A real API server rejects malformed quantities; if one ever gets
    through, the node is held at its last counts (never raised)."""
    k8s_node(api, "n1")
    good = bound_pod(api, "n1", "1", "0")
    wait_counts(slurm, (NODE_CPUS - 1, NODE_MEM))
    try:
        bound_pod(api, "n1", "lots", "12 GB", name="bad")
        accepted = True
    except (ApiException, ValueError):
        accepted = False
    _delete_pod(api, good)
    if accepted:
        time.sleep(2)
        assert counts(slurm) == (NODE_CPUS - 1, NODE_MEM)     # held
        assert "malformed quantity" in daemon.log_text()
        _delete_pod(api, "bad")
    wait_counts(slurm, (NODE_CPUS, NODE_MEM))


def test_state_file_written_before_slurm(slurm, api, daemon):
    from pyk8sres.slurmctld import nodestate
    k8s_node(api, "n1")
    bound_pod(api, "n1", "2", "1000Mi")
    wait_counts(slurm, (NODE_CPUS - 2, NODE_MEM - 1000))
    st = nodestate.read_state(daemon.state_file)
    assert st["nodes"]["n1"] == {"k8scpu": NODE_CPUS - 2, "k8smemory": NODE_MEM - 1000}
    # Every Slurm node is accounted for, so the node_features plugin never
    # has to guess (a node in neither list is held at 0 after a restart).
    assert {"n1", "n2"} <= set(st["nodes"]) | set(st["unmanaged"])


def test_once(slurm, api, tmp_path):
    k8s_node(api, "n1")
    p = bound_pod(api, "n1", "1", "500Mi")
    try:
        env = dict(slurm.env)
        r = subprocess.run([sys.executable, "-m", "pyk8sres.coordinator.sync", "--once", "--kubeconfig",
                            api.kubeconfig, "--state-file",
                            f"{slurm.work}/state/k8s_resources.state"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert counts(slurm) == (NODE_CPUS - 1, NODE_MEM - 500)
        assert allocated(api, "n1")["Kubernetes"] == {"cpu": "1", "memory": "500Mi"}
    finally:
        _delete_pod(api, p)
        api.core.delete_node("n1", _preload_content=False).release_conn()
