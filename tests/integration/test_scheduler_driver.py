"""The test scheduler (pyk8sres/testbed/scheduler.py) against the real API
server.  No kube-scheduler binary can be had here (Debian, PyPI and npm ship
none), so this driver does what kube-scheduler does for us: fit by requests
against allocatable minus the pods already bound, POST pods/binding, back off
on error.  These tests check it does, from the API server's ground truth."""

from __future__ import annotations

import base64
import threading
import time
import uuid

import pytest
import yaml

import local_slurm
from pyk8sres.coordinator import kube as K
from pyk8sres.coordinator import webhook as W
from pyk8sres.policy import admission as A
from pyk8sres.testbed.scheduler import Scheduler


@pytest.fixture
def kube(kube_server):
    return K.Kube(kube_server.kubeconfig)


@pytest.fixture
def ns(kube):
    name = "s-" + uuid.uuid4().hex[:8]
    kube.core.create_namespace({"metadata": {"name": name}}, _preload_content=False).release_conn()
    yield name
    kube.core.delete_namespace(name, _preload_content=False).release_conn()


@pytest.fixture
def nodes(kube):
    names = [f"sch-{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
    for n in names:
        kube.core.create_node({"metadata": {"name": n},
                               "status": {"allocatable": {"cpu": "4", "memory": "8Gi"},
                                          "capacity": {"cpu": "4", "memory": "8Gi"}}},
                              _preload_content=False).release_conn()
    yield names
    for n in names:
        kube.core.delete_node(n, _preload_content=False).release_conn()


def pod(name, cpu, node=None, ns_name=None):
    spec = {"containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def node_of(kube, ns, name):
    return (K.get_pod(kube, ns, name) or {}).get("spec", {}).get("nodeName")


def test_fit_counts_bound_pods(kube, ns, nodes):
    a, b = nodes
    # A 3-CPU pod already bound on a (like a placeholder showing Slurm's jobs).
    K.create_pod(kube, ns, pod("held", "3", node=a))
    for i in range(3):
        K.create_pod(kube, ns, pod(f"p{i}", "2"))
    sched = Scheduler(kube, namespace=ns, node_names=nodes)
    sched.run_once()
    placed = [node_of(kube, ns, f"p{i}") for i in range(3)]
    # b takes two 2-CPU pods; a has 1 CPU left: the third does not fit anywhere.
    assert sorted(p for p in placed if p) == [b, b] and placed.count(None) == 1
    assert sched.stats.unschedulable == 1
    K.delete_pod(kube, ns, "held")
    time.sleep(1.1)                               # past the 1 s backoff
    sched.run_once()
    assert None not in [node_of(kube, ns, f"p{i}") for i in range(3)]


class DenyNode:
    def __init__(self, node):
        self.node, self.calls, self.log = node, 0, []

    def review(self, body):
        r = body["request"]
        self.calls += 1
        self.log.append((time.monotonic(), r.get("name"), r.get("dryRun")))
        target = ((r.get("object") or {}).get("target") or {}).get("name")
        ok = target != self.node
        resp = {"uid": r["uid"], "allowed": ok}
        if not ok:
            resp["status"] = {"code": 403, "message": f"node {target} is full"}
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


def test_backs_off_on_denied_binding(kube, kube_server, ns, nodes, tmp_path):
    (a,) = nodes[:1]
    certs = W.Certs(str(tmp_path / "tls"), ["localhost"], ["127.0.0.1"], 1, 10, 60)
    certs.ensure()
    deny = DenyNode(a)
    port = local_slurm.port(27483)
    srv = W.WebhookServer(("127.0.0.1", port), deny, certs.cert_file, certs.key_file)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    doc = W.webhook_template()
    doc["metadata"] = {"name": "sched-" + ns}
    hook = doc["webhooks"][0]
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate",
                            "caBundle": base64.b64encode(certs.bundle()).decode()}
    hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    hook["matchConditions"] = [{"name": "shared-node", "expression": A.shared_nodes_condition([a])}]
    path = tmp_path / "vwc.yaml"
    path.write_text(yaml.safe_dump(doc))
    kube_server.apply(path)
    try:
        K.create_pod(kube, ns, pod("w", "1"))
        sched = Scheduler(kube, namespace=ns, node_names=[a])
        deadline = time.monotonic() + 20
        while deny.calls == 0 and time.monotonic() < deadline:   # informer delay
            sched.backoff.clear()
            sched.run_once()
            time.sleep(0.2)
        assert deny.calls >= 1 and sched.stats.denied >= 1
        assert "node %s is full" % a in sched.stats.errors[-1]
        calls = deny.calls
        t0 = deny.log[-1][0]                         # when the binding was refused
        while time.monotonic() - t0 < 0.85:         # inside the 1 s backoff: no retry
            sched.run_once()
            time.sleep(0.1)
        assert deny.calls == calls, (deny.log, sched.stats)
        time.sleep(max(0.0, t0 + 1.05 - time.monotonic()))
        sched.run_once()                             # backoff over: it retries the same node
        assert deny.calls == calls + 1
        assert sched.backoff[K.get_pod(kube, ns, "w")["metadata"]["uid"]][1] == 2.0   # doubled
        assert node_of(kube, ns, "w") is None
    finally:
        kube_server.kubectl("delete", "validatingwebhookconfiguration", doc["metadata"]["name"],
                            check=False)
        srv.close()
