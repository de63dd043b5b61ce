"""The world of test_sync.py: its control plane (Api), the sync daemon as
its own process (Daemon), what resets both between tests (clean), and the
helpers the tests read and write it with -- nodes and pods as their
kubelets and users create them, and Slurm's own counts."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from conftest_kube import CRD_MANIFEST, done, pick_ports, rbac_manifest  # noqa: F401 (done: test_sync)
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.policy.usage import NODE_LABEL
from pyk8sres.testbed import hybrid
from pyk8sres.testbed import kubernetes as controlplane

GROUP, VERSION, PLURAL = "pyk8sres.io", "v1alpha1", "genericnodes"
KUBE_PORTS = (31000, 31990)
NODE_CPUS, NODE_MEM = 8, 16000


class Api:
    """The control plane of test_sync.py alone (its API server is stopped
    and restarted, its etcd compacted), plus clients: admin's, and the sync
    daemon's ServiceAccount kubeconfig (coordinator_kubeconfig)."""

    def __init__(self, binaries, work):
        self.kube = controlplane.ControlPlane(work, pick_ports(*KUBE_PORTS), binaries).start()
        try:
            self.kube.apply(CRD_MANIFEST)
            self.kube.apply(rbac_manifest(self.kube))
            self.kubeconfig = self.kube.kubeconfig          # the admin's, for the test itself
            admin = config.new_client_from_config(self.kubeconfig)
            self.core = client.CoreV1Api(admin)
            self.custom = client.CustomObjectsApi(admin)
        except BaseException:
            self.kube.stop()
            raise

    def as_node(self, node) -> client.CoreV1Api:
        """The node's kubelet (system:node:<node>)."""
        return client.CoreV1Api(config.new_client_from_config(self.kube.node_identity(node)))

    def stop_apiserver(self):
        self.kube.stop_component("kube-apiserver")

    def start_apiserver(self):
        # Same etcd: the same contents, like a real restart.
        self.kube.start_apiserver()
        # A restarted kube-apiserver answers 403 until its RBAC cache is
        # filled; the clients that came back in that window (kwok, the
        # controllers) back off for up to a minute (client-go), and pods would
        # neither be placed nor run.  Restart them rather than make the next
        # tests wait that out: sync's own recovery is what is tested here.
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            self.kube.restart(name)

    def restart_apiserver(self):
        self.stop_apiserver()
        self.start_apiserver()

    def stop(self):
        self.kube.stop()

    def compact(self) -> None:
        """Compact etcd's history up to now (etcd's own v3 HTTP gateway):
        old resourceVersions are gone for good."""
        url = f"http://127.0.0.1:{self.kube.ports.etcd}"

        def post(path, body):
            req = urllib.request.Request(url + path, json.dumps(body).encode(),
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


def coordinator_kubeconfig(slurm, api) -> str:
    """pyk8sres-sync's token in a kubeconfig only the coordinator's uid reads."""
    return hybrid.coordinator_kubeconfig(slurm, api.kube, hybrid.SYNC_ACCOUNT)


def as_coordinator(slurm) -> dict:
    """Popen arguments: the coordinator's uid, groups, environment."""
    uid, gid, groups = hybrid.run_as_coordinator(slurm)
    return {"user": uid, "group": gid, "extra_groups": groups,
            "env": hybrid.coordinator_env(slurm), "cwd": "/"}


class Daemon:
    """`pyk8sres sync` as its own process (started and stopped by PID), with
    the pyk8sres-sync ServiceAccount's token."""

    def __init__(self, slurm, api, settings: str = ""):
        self.slurm, self.api, self.settings = slurm, api, settings
        self.proc = None
        self.log = f"{slurm.work}/log/sync.log"

    def start(self):
        # The admin's configuration: only namespace "slurm-workers" holds
        # Slurm's own worker pods (nothing else exempts a pod).
        conf = f"{hybrid.coordinator_dir(self.slurm)}/sync-test.toml"
        with open(conf, "w") as f:
            # kwok kills a pod's "containers" the moment it is told to: the
            # margin for a kubelet's own delay (departed_margin_seconds) is short.
            f.write('slurm_workers = ["slurm-workers"]\n'
                    f'departed_margin_seconds = {hybrid.KWOK_MARGIN}\n' + self.settings)
        hybrid.own(conf)
        cmd = [hybrid.coordinator_python(), "-m", "pyk8sres.coordinator.sync",
               "--kubeconfig", coordinator_kubeconfig(self.slurm, self.api),
               "--config", conf, "--resync", "0.5", "--log-level", "DEBUG",
               "--metrics-address", "127.0.0.1:0"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, **as_coordinator(self.slurm))

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


def clean(slurm, api):
    """No pods, no jobs, no nodes, an empty ledger: what the next test starts
    from.  The pods go while no sync runs, so the ledger is emptied by hand
    (as root); a sync started next would hold what they held for a grace
    period, not knowing whether their containers stopped."""
    subprocess.run(["scancel", "-u", "root"], env=slurm.env, capture_output=True)
    for p in api.core.list_pod_for_all_namespaces().items:
        delete_pod(api, p.metadata.name, p.metadata.namespace)
    for n in api.core.list_node().items:
        done(api.core.delete_node(n.metadata.name, _preload_content=False))
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(slurm.conf))
    try:
        for node in ("n1", "n2"):
            view = ledger.show(node)["nodes"][node]
            for key in view.get("entries") or {}:
                assert ledger.release(node, key)["ok"]
    finally:
        ledger.close()


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
    """Node `name` (8 CPUs, 16000 MB) as its kubelet registers it, Ready
    (kwok); slurm_node: the admin maps it by the admin-only label;
    annotations: written by the node's own kubelet (it may)."""
    api.kube.register_nodes({name: (NODE_CPUS, NODE_MEM)})
    if slurm_node:
        api.kube.kubectl("label", "node", name, f"{NODE_LABEL}={slurm_node}")
    if annotations:
        api.as_node(name).patch_node(name, {"metadata": {"annotations": annotations}})


def new_pod(api, cpu, mem, node=None, name=None, labels=None, ns="default", annotations=None,
            node_selector=None, grace=None):
    """A pod; node: bound there at creation (spec.nodeName), else kube-scheduler
    places it (or not: node_selector)."""
    name = name or f"p-{uuid.uuid4().hex[:8]}"
    spec = {"containers": [{"name": "c", "image": "busybox",
                            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
    if node:
        spec["nodeName"] = node
    if node_selector:
        spec["nodeSelector"] = node_selector
    # Containers that stop at once unless a test says otherwise: a pod deleted
    # with grace 0 is then really gone once its kubelet is told.
    spec["terminationGracePeriodSeconds"] = 0 if grace is None else grace
    done(api.core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": spec}, _preload_content=False))
    return name


def bound_pod(api, node, cpu, mem, **kw):
    """A pod created on `node` (spec.nodeName): for tests about which node."""
    return new_pod(api, cpu, mem, node=node, **kw)


def running(api, name, ns="default", timeout=30.0):
    """Wait until kube-scheduler bound the pod and its kubelet (kwok) runs it; its node."""
    def run():
        p = api.core.read_namespaced_pod(name, ns)
        return p.status.phase == "Running" and p.spec.node_name
    return wait_for(run, timeout, f"pod {ns}/{name} running")


def scheduled_pod(api, cpu, mem, **kw):
    """A pod kube-scheduler places; returns once it runs."""
    name = new_pod(api, cpu, mem, **kw)
    running(api, name, kw.get("ns", "default"))
    return name


def ensure_namespace(api, name):
    try:
        done(api.core.create_namespace({"metadata": {"name": name}}, _preload_content=False))
    except ApiException as e:
        if e.status != 409:
            raise


def delete_pod(api, name, ns="default", grace=0):
    try:
        # Raw response: client v37 fails to deserialize delete's Status body.
        done(api.core.delete_namespaced_pod(name, ns, grace_period_seconds=grace,
                                            _preload_content=False))
    except ApiException as e:
        if e.status != 404:
            raise


def exists(api, name, ns="default"):
    try:
        return api.core.read_namespaced_pod(name, ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def node_ready(api, name):
    conds = api.core.read_node(name).status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conds)


def used(slurm, node="n1"):
    """Slurm's own word (scontrol -d show node): k8scpu/k8smemory allocated
    on the node = Slurm jobs + Kubernetes' share.  The totals never move."""
    os.environ["SLURM_CONF"] = slurm.conf
    n = slurm_calls.get_node(node)
    assert (n.gres.get("k8scpu"), n.gres.get("k8smemory")) == (NODE_CPUS, NODE_MEM)
    return n.gres_used.get("k8scpu", 0), n.gres_used.get("k8smemory", 0)


def wait_used(slurm, want, node="n1", timeout=10.0):
    return wait_for(lambda: used(slurm, node) == want, timeout,
                    f"{node} GresUsed {want} (now {used(slurm, node)})")


def held(slurm, want, node="n1", seconds=2.0):
    """Slurm's counts stay `want` for `seconds` (sampled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert used(slurm, node) == want
        time.sleep(0.1)


def generic_node(api, name):
    return api.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)


def allocated(api, name):
    gn = generic_node(api, name)
    return {a["type"]: a["allocated"] for a in gn.get("status", {}).get("allocatedResources", [])}


def sbatch(slurm, *args, node="n1"):
    out = subprocess.run(["sbatch", "--parsable", "-w", node, *args, "--wrap", "sleep 300"],
                         env=slurm.env, capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


def job_state(slurm, job):
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=slurm.env,
                         capture_output=True, text=True).stdout.split()
    return tuple(out[:2]) if out else ("GONE", "")


def pending_while(slurm, api, job, pod, seconds, node="n1"):
    """For `seconds`: job stays PENDING (Resources) and the pod, if named, is
    what the API server says (gone, or still bound to its node)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = job_state(slurm, job)
        assert state[0] == "PENDING", f"job {job} {state} while the pod's containers may run"
        if pod is not None:
            p = exists(api, pod)
            assert p is not None and p.spec.node_name == node
        time.sleep(0.3)


def status_writes(admin) -> float:
    """The API server's own count of the GenericNode status writes it served
    (apiserver_request_total), whoever made them."""
    client = admin.core.api_client
    resp = client.call_api(*client.param_serialize("GET", "/metrics",
                                                   auth_settings=["BearerToken"]))
    resp.read()
    return sum(float(v) for labels, v in re.findall(
        r'^apiserver_request_total\{([^}]*)\} (\S+)$', resp.data.decode(), re.M)
        if all(f in labels for f in ('resource="genericnodes"', 'subresource="status"',
                                     'verb="PATCH"')))


SLINKY = ('worker_pods = "slinky"\nworker_namespace = "slurm"\n')


def slinky_worker(api, name, node, slurm_node, cpu="4"):
    """A worker pod as Slinky's slurm-operator labels it, bound to `node`
    (as its StatefulSet's pod would be once placed)."""
    ensure_namespace(api, "slurm")
    return bound_pod(api, node, cpu, "1000Mi", name=name, ns="slurm", labels={
        "app.kubernetes.io/name": "slurmd", "app.kubernetes.io/component": "worker",
        "nodeset.slinky.slurm.net/pod-hostname": slurm_node})
