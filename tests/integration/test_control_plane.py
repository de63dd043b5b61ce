"""The test cluster's Kubernetes half is the real control plane, with real
identities: what each may do is enforced (RBAC, Node authorizer,
NodeRestriction), admission webhooks are called over TLS with the API
server's client certificate for bindings, pods with spec.nodeName and
pods/resize, and the GenericNode CRD serves its columns and status.

Test pods that a test binds itself name a scheduler nobody runs, so the
real kube-scheduler leaves them alone."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from conftest_kube import post_json
from pyk8sres.coordinator.certs import Certs
from pyk8sres.coordinator.webhook import WebhookServer
from pyk8sres.policy import admission
from pyk8sres.testbed import chart, kubernetes, pki

GN = dict(group="pyk8sres.io", version="v1alpha1", plural="genericnodes")
NOBODY_SCHEDULES = "test-binds-it-itself"


@pytest.fixture
def core(kube_api_client):
    return client.CoreV1Api(kube_api_client)


def api_as(kube, identity: str) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(kube.identity(identity)))


@pytest.fixture
def ns(core):
    name = "t-" + uuid.uuid4().hex[:8]
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    deadline = time.monotonic() + 20    # kube-controller-manager makes its default ServiceAccount
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_service_account("default", name)
            break
        except ApiException:
            time.sleep(0.1)
    yield name
    core.delete_namespace(name)


def make_pod(name, node="", cpu="500m", memory="256Mi", scheduler=NOBODY_SCHEDULES, **meta):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, **meta),
        spec=client.V1PodSpec(
            node_name=node or None, scheduler_name=scheduler,
            containers=[client.V1Container(
                name="c", image="busybox",
                resources=client.V1ResourceRequirements(requests={"cpu": cpu, "memory": memory}))],
        ),
    )


def denied(fn, *args, **kw) -> int:
    """The HTTP status of a call that must be refused."""
    with pytest.raises(ApiException) as e:
        fn(*args, **kw)
    return e.value.status


# ---------------------------------------------------------------- identities

def test_developer_is_confined_to_its_namespace(kube_server):
    dev = api_as(kube_server, "developer")
    name = "dev-" + uuid.uuid4().hex[:6]
    dev.create_namespaced_pod("default", make_pod(name))
    try:
        assert dev.read_namespaced_pod(name, "default").metadata.name == name
        assert denied(dev.list_node) == 403
        assert denied(dev.create_namespaced_pod, "kube-system", make_pod(name)) == 403
        assert denied(dev.list_namespaced_secret, "kube-system") == 403
        # binding is the scheduler's: `edit` does not grant pods/binding
        body = client.V1Binding(metadata=client.V1ObjectMeta(name=name),
                                target=client.V1ObjectReference(kind="Node", name="k1"))
        assert denied(dev.create_namespaced_pod_binding, name, "default", body) == 403
    finally:
        dev.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_kubelets_are_confined_to_their_node(kube_server, core):
    k1 = api_as(kube_server, "node-k1")
    # NodeRestriction: a kubelet may not set labels under node-restriction.kubernetes.io/
    # (the node mapping label), nor touch another node.
    assert denied(k1.patch_node, "k1", {"metadata": {"labels": {
        "node-restriction.kubernetes.io/pyk8sres-slurm-node": "n9"}}}) == 403
    assert denied(k1.patch_node, "k2", {"metadata": {"labels": {"x": "y"}}}) == 403
    k1.patch_node("k1", {"metadata": {"labels": {"pyk8sres-test": "ok"}}})
    # It may create mirror pods (static pods) of its own node only.
    node_uid = core.read_node("k1").metadata.uid

    def mirror(node, uid):
        return make_pod("mirror-" + uuid.uuid4().hex[:6], node=node,
                        annotations={"kubernetes.io/config.mirror": "x"},
                        owner_references=[client.V1OwnerReference(
                            api_version="v1", kind="Node", name=node, uid=uid, controller=True)])
    assert denied(k1.create_namespaced_pod, "default",
                  mirror("k2", core.read_node("k2").metadata.uid)) == 403
    pod = k1.create_namespaced_pod("default", mirror("k1", node_uid))
    core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
    # An ordinary pod is not a kubelet's to create.
    assert denied(k1.create_namespaced_pod, "default", make_pod("plain", node="k1")) == 403


def test_coordinator_accounts_have_exactly_their_grants(kube_server):
    sync = client.CoreV1Api(config.new_client_from_config(
        kube_server.service_account_kubeconfig("pyk8sres-sync", "pyk8sres-system")))
    sync.list_pod_for_all_namespaces(limit=1)
    sync.list_node(limit=1)
    assert denied(sync.create_namespaced_pod, "default", make_pod("x")) == 403
    assert denied(sync.list_namespaced_secret, "pyk8sres-system") == 403
    hook = client.CoreV1Api(config.new_client_from_config(
        kube_server.service_account_kubeconfig("pyk8sres-webhook", "pyk8sres-system")))
    assert denied(hook.list_pod_for_all_namespaces) == 403     # it reads single pods only
    assert denied(hook.create_namespaced_pod, "default", make_pod("x")) == 403


def test_anonymous_sees_health_only(kube_server):
    ctx = ssl.create_default_context(cafile=kube_server.ca_file)
    with urllib.request.urlopen(kube_server.url + "/readyz", context=ctx, timeout=5) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(kube_server.url + "/api/v1/pods", context=ctx, timeout=5)
    assert e.value.code in (401, 403)


def test_pods_run_and_leave_with_their_grace_period(kube_server, core, ns):
    """kwok plays the kubelet: a pod the real scheduler placed runs; deleted,
    it stays Terminating for its grace period, then is gone."""
    core.create_namespaced_pod(ns, make_pod("p", scheduler="default-scheduler"))
    deadline = time.monotonic() + 20
    while core.read_namespaced_pod("p", ns).status.phase != "Running":
        assert time.monotonic() < deadline, "the pod never ran"
        time.sleep(0.1)
    assert core.read_namespaced_pod("p", ns).spec.node_name in ("k1", "k2")
    t0 = time.monotonic()
    core.delete_namespaced_pod("p", ns, grace_period_seconds=3)
    assert core.read_namespaced_pod("p", ns).metadata.deletion_timestamp is not None
    while True:
        try:
            core.read_namespaced_pod("p", ns)
        except ApiException as e:
            assert e.status == 404
            break
        assert time.monotonic() - t0 < 15
        time.sleep(0.1)
    assert 2.0 <= time.monotonic() - t0


def test_gone_after_compaction_and_restart(core, ns, kube_server):
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    core.create_namespaced_pod(ns, make_pod("g1"))
    core.create_namespaced_pod(ns, make_pod("g2"))
    latest = core.list_namespaced_pod(ns).metadata.resource_version
    # Compact etcd through its JSON gateway, then restart the API server so its
    # watch cache starts after the compaction.
    req = urllib.request.Request(f"http://127.0.0.1:{kube_server.ports.etcd}/v3/kv/compaction",
                                 method="POST",
                                 data=json.dumps({"revision": latest, "physical": True}).encode())
    urllib.request.urlopen(req, timeout=10).read()
    kube_server.restart("kube-apiserver")
    assert sorted(p.metadata.name for p in core.list_namespaced_pod(ns).items) == ["g1", "g2"]
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_namespaced_pod, ns, resource_version=rv,
                                      timeout_seconds=5):
            pass
    assert e.value.status == 410


def test_genericnode_crd_columns_and_status(kube_api_client, kube_server):
    co = client.CustomObjectsApi(kube_api_client)
    co.create_cluster_custom_object(**GN, body={
        "apiVersion": "pyk8sres.io/v1alpha1", "kind": "GenericNode",
        "metadata": {"name": "node-a"},
        "spec": {"clusterName": "slurm1", "alias": "a1", "type": "Slurm"},
    })
    allocated = [
        {"type": "Slurm", "allocated": {"cpu": "3", "memory": "4000Mi"}},
        {"type": "Kubernetes", "allocated": {"cpu": "2735m", "memory": "3417Mi"}},
    ]
    co.patch_cluster_custom_object_status(**GN, name="node-a", body={
        "status": {"allocatedResources": allocated, "capacity": {"cpu": "8", "memory": "16Gi"}}})
    co.patch_cluster_custom_object_status(**GN, name="node-a", body={"spec": {"alias": "zzz"}})
    obj = co.get_cluster_custom_object(**GN, name="node-a")
    assert obj["spec"]["alias"] == "a1"          # spec does not change through /status
    assert obj["status"]["allocatedResources"] == allocated
    out = kube_server.kubectl("get", "genericnode", "node-a").stdout.splitlines()
    assert out[0].split() == ["NAME", "CLUSTERNAME", "ALIAS", "TYPE", "ALLOCATEDRESOURCES", "GPU"]
    assert out[1].split() == ["node-a", "slurm1", "a1", "Slurm",
                              '[{"allocated":{"cpu":"3","memory":"4000Mi"},"type":"Slurm"},'
                              '{"allocated":{"cpu":"2735m","memory":"3417Mi"},"type":"Kubernetes"}]']
    assert kube_server.kubectl("get", "gn", "-o", "name").stdout.split() == [
        "genericnode.pyk8sres.io/node-a"]
    co.delete_cluster_custom_object(**GN, name="node-a")


# ---------------------------------------------------------------- admission webhooks

class Recorder:
    """The test's own webhook logic: deny anything aimed at node "n-deny"."""

    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()

    def review(self, body):
        r = body["request"]
        with self.lock:
            self.requests.append(r)
        obj = r.get("object") or {}
        node = (obj.get("target") or {}).get("name") or (obj.get("spec") or {}).get("nodeName")
        resp = {"uid": r["uid"], "allowed": node != "n-deny"}
        if not resp["allowed"]:
            resp["status"] = {"code": 403, "message": f"test webhook: no pods on {node}"}
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}

    def seen(self):
        with self.lock:
            return [(r["operation"], r["resource"]["resource"], r.get("subResource") or "",
                     r.get("name") or "", bool(r.get("dryRun"))) for r in self.requests]


def configure(kube, doc, unshared, path) -> None:
    doc["webhooks"][0]["matchConditions"] = [
        {"name": "shared-node", "expression": admission.unshared_nodes_condition(unshared)}]
    path.write_text(yaml.safe_dump(doc))
    kube.apply(path)


@pytest.fixture
def webhook(tmp_path, ns, kube_server):
    """Our WebhookServer (TLS, the API server's client certificate required)
    on the port the API server presents its certificate to, with the test's
    Recorder as its admission logic; a configuration scoped to `ns` that
    skips nodes known unshared (n-other, elsewhere)."""
    certs = Certs(str(tmp_path / "tls"), ["localhost"], ["127.0.0.1"], 1, 10, 60)
    certs.ensure()
    rec = Recorder()
    port = kube_server.ports.webhook
    srv = WebhookServer(("127.0.0.1", port), rec, certs.cert_file, certs.key_file,
                        kube_server.webhook_client_ca, [kubernetes.WEBHOOK_CLIENT])
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    doc = chart.webhook_configuration(kube_server.bin.helm, kube_server.webhook_client_ca,
                                      f"https://127.0.0.1:{port}/validate")
    hook = doc["webhooks"][0]
    doc["metadata"] = {"name": "test-" + ns}
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate",
                            "caBundle": base64.b64encode(certs.bundle()).decode()}
    hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    configure(kube_server, doc, ["n-other", "elsewhere"], tmp_path / "vwc.yaml")
    try:
        yield rec, srv, doc, certs
    finally:
        kube_server.kubectl("delete", "validatingwebhookconfiguration", doc["metadata"]["name"],
                            check=False)
        srv.close()


def bind(core, ns, name, node, legacy=False, dry=False):
    body = client.V1Binding(metadata=client.V1ObjectMeta(name=name),
                            target=client.V1ObjectReference(kind="Node", name=node))
    kw = {"_preload_content": False}
    if dry:
        kw["dry_run"] = "All"
    if legacy:
        return core.create_namespaced_binding(ns, body, **kw)
    return core.create_namespaced_pod_binding(name, ns, body, **kw)


def wait_active(core, ns):
    """Configurations reach the plugin through an informer: wait for it."""
    core.create_namespaced_pod(ns, make_pod("probe"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            bind(core, ns, "probe", "n-deny", dry=True)
        except ApiException as e:
            if e.status == 403:
                return
            raise
        time.sleep(0.2)
    raise AssertionError("webhook never took effect")


def post_review(url, certs, client_cert=None):
    """POST a forged AdmissionReview directly: (HTTP status or 'tls', body)."""
    ctx = ssl.create_default_context(cafile=None)
    ctx.load_verify_locations(cadata=certs.bundle().decode())
    if client_cert:
        ctx.load_cert_chain(*client_cert)
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "forged", "operation": "CREATE",
                                   "resource": {"resource": "pods"}, "namespace": "default",
                                   "object": {"metadata": {"name": "f", "uid": "victim"},
                                              "spec": {"nodeName": "n1"}}}}).encode()
    return post_json(url, body, ctx, 5)


def test_only_the_api_server_reaches_the_webhook(core, ns, webhook, kube_server):
    rec, _, doc, certs = webhook
    wait_active(core, ns)                   # the API server's calls got through
    url = doc["webhooks"][0]["clientConfig"]["url"]
    before = len(rec.requests)
    status, body = post_review(url, certs)
    assert status == 401 and "only the API server" in body
    # A certificate of the cluster's own CA (a user's) is not the API server's.
    dev = pki.Authority(kube_server.pki_dir, "ca", "x").issue("developer", "developer")
    assert post_review(url, certs, dev)[0] == "tls"
    # The right CA, another name: refused by name.
    other = pki.Authority(kube_server.pki_dir, "webhook-client-ca", "x").issue(
        "not-apiserver", "someone-else")
    status, body = post_review(url, certs, other)
    assert status == 403 and "someone-else" in body
    assert len(rec.requests) == before      # none of them reached the admission logic


def test_webhook_called_for_binding_nodename_and_resize(core, ns, webhook, kube_server):
    rec, _, _, _ = webhook
    wait_active(core, ns)
    for name in ("a", "b", "c", "r"):
        core.create_namespaced_pod(ns, make_pod(name))

    assert denied(bind, core, ns, "a", "n-deny") == 403
    assert denied(bind, core, ns, "b", "n-deny", legacy=True) == 403      # POST .../bindings
    assert denied(core.create_namespaced_pod, ns, make_pod("direct", node="n-deny")) == 403
    # Ground truth: nothing was bound, no pod exists on n-deny.
    assert core.list_namespaced_pod(ns, field_selector="spec.nodeName=n-deny").items == []

    bind(core, ns, "c", "n-ok")                             # allowed: bound
    assert core.read_namespaced_pod("c", ns).spec.node_name == "n-ok"
    bind(core, ns, "a", "n-other")                          # known unshared: not called
    assert core.read_namespaced_pod("a", ns).spec.node_name == "n-other"
    bind(core, ns, "b", "brand-new-node")                   # never heard of: checked
    kube_server.kubectl("-n", ns, "patch", "pod", "c", "--subresource", "resize", "--patch",
                        '{"spec":{"containers":[{"name":"c","resources":{"requests":{"cpu":"700m"}}}]}}')
    assert core.read_namespaced_pod("c", ns).spec.containers[0].resources.requests["cpu"] == "700m"
    core.create_namespaced_pod(ns, make_pod("onnode", node="n-ok"))
    seen = rec.seen()
    assert ("UPDATE", "pods", "resize", "c", False) in seen
    assert ("CREATE", "pods", "binding", "a", False) in seen
    assert ("CREATE", "bindings", "", "b", False) in seen
    assert ("CREATE", "pods", "binding", "probe", True) in seen       # dry runs are sent, flagged
    binds = [(s[3]) for s in seen if s[2] == "binding" and not s[4]]
    assert binds.count("a") == 1                            # n-other: matchCondition false
    assert binds.count("b") == 1                            # brand-new-node: true
    assert ("CREATE", "pods", "", "onnode", False) in seen
    created = [r for r in rec.requests if r["operation"] == "CREATE" and not r.get("subResource")
               and r["resource"]["resource"] == "pods"]
    assert created and all(r["object"]["metadata"].get("uid") for r in created)
    assert "r" not in [s[3] for s in seen if s[:3] == ("CREATE", "pods", "")]   # no nodeName


def test_resize_denied_and_failure_policy_fail(core, ns, webhook, kube_server):
    rec, srv, doc, _ = webhook
    wait_active(core, ns)
    core.create_namespaced_pod(ns, make_pod("big", node="n-ok"))
    core.create_namespaced_pod(ns, make_pod("x"))

    class DenyAll:
        def review(self, body):
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "response": {"uid": body["request"]["uid"], "allowed": False,
                                 "status": {"code": 403, "message": "resize refused"}}}
    srv.admission = DenyAll()
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod_resize("big", ns, {"spec": {"containers": [
            {"name": "c", "resources": {"requests": {"cpu": "2"}}}]}})
    assert e.value.status == 403 and "resize refused" in e.value.body
    assert core.read_namespaced_pod("big", ns).spec.containers[0].resources.requests["cpu"] == "500m"

    # failurePolicy Fail (the Helm chart's, always): webhook down,
    # bindings to nodes not known unshared fail; the known-unshared are unaffected.
    srv.close()
    with pytest.raises(ApiException) as e:
        bind(core, ns, "x", "n-ok")
    assert e.value.status >= 500 and "failed calling webhook" in e.value.body
    assert core.read_namespaced_pod("x", ns).spec.node_name is None
    bind(core, ns, "x", "elsewhere")
    assert core.read_namespaced_pod("x", ns).spec.node_name == "elsewhere"


def test_match_condition_with_1000_unshared_nodes(core, ns, webhook, kube_server, tmp_path):
    """The coordinator's condition at 1000 known-unshared nodes compiles and
    selects exactly (CEL map membership)."""
    rec, _, doc, _ = webhook
    names = [f"node-{i:04d}" for i in range(999)] + ["n-ok"]
    configure(kube_server, doc, names, tmp_path / "vwc1000.yaml")
    core.create_namespaced_pod(ns, make_pod("probe"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:       # the new condition reaches the plugin
        before = len(rec.requests)
        bind(core, ns, "probe", "n-ok", dry=True)  # now known unshared: must not be sent
        if len(rec.requests) == before:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("new condition never took effect")
    assert denied(bind, core, ns, "probe", "n-deny") == 403
    bind(core, ns, "probe", "node-2000", dry=True)
    assert rec.requests[-1]["object"]["target"]["name"] == "node-2000"
    before = len(rec.requests)
    bind(core, ns, "probe", "node-0500", dry=True)
    assert len(rec.requests) == before
