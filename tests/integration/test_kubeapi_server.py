"""The local Kubernetes API server behaves like a real one for what pyk8sres
uses: field selectors, list+watch from a resourceVersion, 410 Gone, 409
conflicts, the GenericNode CRD with its printer columns and status."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException



GN = dict(group="pyk8sres.io", version="v1alpha1", plural="genericnodes")


@pytest.fixture
def core(kube_api_client):
    return client.CoreV1Api(kube_api_client)


@pytest.fixture
def ns(core):
    name = "t-" + uuid.uuid4().hex[:8]
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def make_pod(name, node="", cpu="500m", memory="256Mi"):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_name=node or None,
            containers=[client.V1Container(
                name="c", image="busybox",
                resources=client.V1ResourceRequirements(requests={"cpu": cpu, "memory": memory}))],
        ),
    )


def set_phase(core, ns, name, phase):
    core.patch_namespaced_pod_status(name, ns, {"status": {"phase": phase}})


def names(pod_list):
    return sorted(p.metadata.name for p in pod_list.items)


def test_field_selectors(core, ns):
    core.create_namespaced_pod(ns, make_pod("a", node="n1"))
    core.create_namespaced_pod(ns, make_pod("b", node="n2"))
    core.create_namespaced_pod(ns, make_pod("c"))
    set_phase(core, ns, "b", "Running")

    assert core.read_namespaced_pod("a", ns).status.phase == "Pending"  # server sets it
    assert names(core.list_namespaced_pod(ns, field_selector="spec.nodeName=n1")) == ["a"]
    assert names(core.list_namespaced_pod(ns, field_selector="spec.nodeName=")) == ["c"]
    assert names(core.list_namespaced_pod(ns, field_selector="status.phase=Running")) == ["b"]
    assert names(core.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=n2,status.phase!=Succeeded")) == ["b"]
    assert names(core.list_namespaced_pod(ns, field_selector="metadata.name=c")) == ["c"]
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod(ns, field_selector="spec.bogus=x")
    assert e.value.status == 400


def test_binding_sets_node(core, ns):
    core.create_namespaced_pod(ns, make_pod("unbound"))
    body = client.V1Binding(metadata=client.V1ObjectMeta(name="unbound"),
                            target=client.V1ObjectReference(kind="Node", name="n7"))
    core.create_namespaced_binding(ns, body, _preload_content=False)
    assert core.read_namespaced_pod("unbound", ns).spec.node_name == "n7"
    with pytest.raises(ApiException) as e:  # already bound
        core.create_namespaced_binding(ns, body, _preload_content=False)
    assert e.value.status == 409


def test_watch_from_list_resource_version(core, ns):
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    core.create_namespaced_pod(ns, make_pod("w1", node="n1"))
    set_phase(core, ns, "w1", "Running")
    core.delete_namespaced_pod("w1", ns)
    seen = []
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, ns, resource_version=rv, timeout_seconds=5,
                       allow_watch_bookmarks=True):
        if ev["type"] != "BOOKMARK":
            seen.append((ev["type"], ev["object"].metadata.name, ev["object"].status.phase))
        if len(seen) == 3:
            w.stop()
    assert seen == [("ADDED", "w1", "Pending"), ("MODIFIED", "w1", "Running"), ("DELETED", "w1", "Running")]


def test_conflict_on_stale_update(core, ns):
    core.create_namespaced_pod(ns, make_pod("stale"))
    old = core.read_namespaced_pod("stale", ns)
    core.patch_namespaced_pod("stale", ns, {"metadata": {"labels": {"x": "1"}}})
    old.metadata.labels = {"x": "2"}
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_pod("stale", ns, old)
    assert e.value.status == 409


def test_patch_types(core, ns, kube_api_client):
    core.create_namespaced_pod(ns, make_pod("p"))
    # strategic merge (the client's default for dicts): containers merge by name
    core.patch_namespaced_pod("p", ns, {"spec": {"containers": [{"name": "c", "image": "busybox:2"}]}})
    pod = core.read_namespaced_pod("p", ns)
    assert [c.image for c in pod.spec.containers] == ["busybox:2"]
    assert pod.spec.containers[0].resources.requests["cpu"] == "500m"
    # JSON patch
    core.patch_namespaced_pod("p", ns, [{"op": "add", "path": "/metadata/labels", "value": {"j": "1"}}],
                              _content_type="application/json-patch+json")
    # JSON merge patch: null deletes
    core.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"m": "1", "j": None}}},
                              _content_type="application/merge-patch+json")
    # server-side apply (JSON is valid YAML)
    core.patch_namespaced_pod("p", ns, {"apiVersion": "v1", "kind": "Pod",
                                        "metadata": {"name": "p", "labels": {"s": "1"}}},
                              field_manager="test", force=True, _content_type="application/apply-patch+yaml")
    pod = core.read_namespaced_pod("p", ns)
    assert pod.metadata.labels == {"m": "1", "s": "1"}
    assert "test" in {f.manager for f in pod.metadata.managed_fields}


def test_gone_after_compaction_and_restart(core, ns, kube_server):
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    core.create_namespaced_pod(ns, make_pod("g1"))
    core.create_namespaced_pod(ns, make_pod("g2"))
    latest = core.list_namespaced_pod(ns).metadata.resource_version
    # Compact etcd through its JSON gateway, then restart the API server so its
    # watch cache starts after the compaction.
    req = urllib.request.Request(kube_server.etcd_url + "/v3/kv/compaction", method="POST",
                                 data=json.dumps({"revision": latest, "physical": True}).encode())
    urllib.request.urlopen(req, timeout=10).read()
    kube_server.stop()
    kube_server.start(kube_server.workdir, kube_server.port, kube_server.etcd_port)

    # Data survived the restart.
    assert names(core.list_namespaced_pod(ns)) == ["g1", "g2"]
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_namespaced_pod, ns, resource_version=rv, timeout_seconds=5):
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
    # spec is not changed through /status
    co.patch_cluster_custom_object_status(**GN, name="node-a", body={"spec": {"alias": "zzz"}})
    obj = co.get_cluster_custom_object(**GN, name="node-a")
    assert obj["spec"]["alias"] == "a1"
    assert obj["status"]["allocatedResources"] == allocated

    out = kube_server.kubectl("get", "genericnode", "node-a").stdout.splitlines()
    assert out[0].split() == ["NAME", "CLUSTERNAME", "ALIAS", "TYPE", "ALLOCATEDRESOURCES"]
    assert out[1].split() == ["node-a", "slurm1", "a1", "Slurm",
                              '[{"allocated":{"cpu":"3","memory":"4000Mi"},"type":"Slurm"},'
                              '{"allocated":{"cpu":"2735m","memory":"3417Mi"},"type":"Kubernetes"}]']
    # short name
    assert kube_server.kubectl("get", "gn", "-o", "name").stdout.split() == ["genericnode.pyk8sres.io/node-a"]
    co.delete_cluster_custom_object(**GN, name="node-a")


def test_rbac_manifest_applied(kube_api_client):
    rbac = client.RbacAuthorizationV1Api(kube_api_client)
    role = rbac.read_cluster_role("pyk8sres-sync")
    rules = {(tuple(r.api_groups), tuple(r.resources)): set(r.verbs) for r in role.rules}
    assert rules[("",), ("pods", "nodes")] == {"list", "watch"}
    binding = rbac.read_cluster_role_binding("pyk8sres-sync")
    assert binding.subjects[0].name == "pyk8sres-sync"
    assert binding.subjects[0].namespace == "pyk8sres-system"
    client.CoreV1Api(kube_api_client).read_namespaced_service_account("pyk8sres-sync", "pyk8sres-system")


def test_standard_namespaces(core):
    have = {n.metadata.name for n in core.list_namespace().items}
    assert {"default", "kube-system", "kube-public", "kube-node-lease"} <= have
    assert core.read_namespace("default").status.phase == "Active"


def test_nodes_and_status(core):
    name = "node-" + uuid.uuid4().hex[:6]
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    core.patch_node_status(name, {"status": {"capacity": {"cpu": "8", "memory": "16Gi"},
                                             "allocatable": {"cpu": "7", "memory": "15Gi"}}})
    node = core.read_node(name)
    assert node.status.allocatable["cpu"] == "7"
    assert [n.metadata.name for n in core.list_node(field_selector=f"metadata.name={name}").items] == [name]
    core.delete_node(name)
    t0 = time.monotonic()
    with pytest.raises(ApiException) as e:
        core.read_node(name)
    assert e.value.status == 404 and time.monotonic() - t0 < 5


# ---------------------------------------------------------------- admission webhooks
# The API server calls validating webhooks (upstream's ValidatingAdmissionWebhook
# plugin) over TLS with the configuration's caBundle, for pods/binding,
# bindings, pods with spec.nodeName and pods/resize; namespaceSelector,
# matchConditions and failurePolicy behave as upstream.

import base64
import threading

import yaml

import local_slurm
from pyk8sres.coordinator import webhook as W


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


@pytest.fixture
def webhook(tmp_path, ns, kube_server):
    certs = W.Certs(str(tmp_path / "tls"), ["localhost"], ["127.0.0.1"], 1, 10, 60)
    certs.ensure()
    rec = Recorder()
    p = local_slurm.port(27480)
    srv = W.WebhookServer(("127.0.0.1", p), rec, certs.cert_file, certs.key_file)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    doc = W.webhook_template()
    hook = doc["webhooks"][0]
    doc["metadata"] = {"name": "test-" + ns}
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{p}/validate",
                            "caBundle": base64.b64encode(certs.bundle()).decode()}
    hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    from pyk8sres.policy import admission as A
    hook["matchConditions"] = [{"name": "shared-node",
                                "expression": A.shared_nodes_condition(["n-deny", "n-ok"])}]
    path = tmp_path / "vwc.yaml"
    path.write_text(yaml.safe_dump(doc))
    kube_server.apply(path)           # with the real kubectl
    try:
        yield rec, srv, doc
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


def test_webhook_called_for_binding_nodename_and_resize(core, ns, webhook, kube_server):
    rec, _, _ = webhook
    wait_active(core, ns)
    for name in ("a", "b", "c", "r"):
        core.create_namespaced_pod(ns, make_pod(name))

    with pytest.raises(ApiException) as e:
        bind(core, ns, "a", "n-deny")
    assert e.value.status == 403 and "test webhook: no pods on n-deny" in e.value.body
    with pytest.raises(ApiException) as e:
        bind(core, ns, "b", "n-deny", legacy=True)          # POST .../bindings
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(ns, make_pod("direct", node="n-deny"))
    assert e.value.status == 403
    # Ground truth: nothing was bound, no pod exists on n-deny.
    assert core.list_namespaced_pod(ns, field_selector="spec.nodeName=n-deny").items == []

    bind(core, ns, "c", "n-ok")                             # allowed: bound
    assert core.read_namespaced_pod("c", ns).spec.node_name == "n-ok"
    bind(core, ns, "a", "n-other")                          # not matched: webhook not called
    assert core.read_namespaced_pod("a", ns).spec.node_name == "n-other"

    # pods/resize (kubectl's --subresource resize, as for in-place resize)
    kube_server.kubectl("-n", ns, "patch", "pod", "c", "--subresource", "resize", "--patch",
                        '{"spec":{"containers":[{"name":"c","resources":{"requests":{"cpu":"700m"}}}]}}')
    assert core.read_namespaced_pod("c", ns).spec.containers[0].resources.requests["cpu"] == "700m"
    core.create_namespaced_pod(ns, make_pod("onnode", node="n-ok"))
    seen = rec.seen()
    assert ("UPDATE", "pods", "resize", "c", False) in seen
    assert ("CREATE", "pods", "binding", "a", False) in seen
    assert ("CREATE", "bindings", "", "b", False) in seen
    assert ("CREATE", "pods", "binding", "probe", True) in seen       # dry runs are sent, flagged
    binds = [s[3] for s in seen if s[2] == "binding" and not s[4]]
    assert binds.count("a") == 1                            # n-other: matchCondition false
    assert ("CREATE", "pods", "", "onnode", False) in seen
    # A validating webhook sees the new pod's UID (the ledger's key) on CREATE.
    created = [r for r in rec.requests if r["operation"] == "CREATE" and not r.get("subResource")
               and r["resource"]["resource"] == "pods"]
    assert created and all(r["object"]["metadata"].get("uid") for r in created)
    creates = [s[3] for s in seen if s[:3] == ("CREATE", "pods", "")]
    assert "r" not in creates                               # no spec.nodeName: not sent


def test_resize_denied_and_failure_policy_fail(core, ns, webhook, kube_server):
    rec, srv, doc = webhook
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

    # failurePolicy Fail (the default in deploy/webhook.yaml): webhook down,
    # bindings to matched nodes fail; other nodes are unaffected.
    srv.close()
    with pytest.raises(ApiException) as e:
        bind(core, ns, "x", "n-ok")
    assert e.value.status >= 500 and "failed calling webhook" in e.value.body
    assert core.read_namespaced_pod("x", ns).spec.node_name is None
    bind(core, ns, "x", "elsewhere")
    assert core.read_namespaced_pod("x", ns).spec.node_name == "elsewhere"


def test_webhook_configuration_defaults_and_validation(kube_server, tmp_path):
    doc = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
           "metadata": {"name": "bad-" + uuid.uuid4().hex[:6]},
           "webhooks": [{"name": "a.example.com", "admissionReviewVersions": ["v1"],
                         "clientConfig": {"url": "https://127.0.0.1:1/x"}}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = kube_server.kubectl("apply", "-f", str(path), check=False)
    assert out.returncode != 0 and "sideEffects" in out.stderr
    doc["webhooks"][0]["sideEffects"] = "None"
    path.write_text(yaml.safe_dump(doc))
    kube_server.apply(path)
    got = json.loads(kube_server.kubectl("get", "validatingwebhookconfiguration",
                                         doc["metadata"]["name"], "-o", "json").stdout)
    w = got["webhooks"][0]
    assert (w["failurePolicy"], w["matchPolicy"], w["timeoutSeconds"], w["namespaceSelector"],
            w["objectSelector"]) == ("Fail", "Equivalent", 10, {}, {})
    kube_server.kubectl("delete", "validatingwebhookconfiguration", doc["metadata"]["name"])


def test_match_condition_with_1000_nodes(core, ns, webhook, kube_server, tmp_path):
    """The coordinator's shared-node condition at 1000 nodes compiles and
    selects exactly (CEL map membership)."""
    from pyk8sres.policy import admission as A
    rec, _, doc = webhook
    names = [f"node-{i:04d}" for i in range(999)] + ["n-deny"]
    doc["webhooks"][0]["matchConditions"] = [
        {"name": "shared-node", "expression": A.shared_nodes_condition(names)}]
    path = tmp_path / "vwc1000.yaml"
    path.write_text(yaml.safe_dump(doc))
    kube_server.apply(path)
    core.create_namespaced_pod(ns, make_pod("probe"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:       # the new condition reaches the plugin
        before = len(rec.requests)
        bind(core, ns, "probe", "n-ok", dry=True)  # no longer listed: must not be sent
        if len(rec.requests) == before:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("new condition never took effect")
    with pytest.raises(ApiException) as e:
        bind(core, ns, "probe", "n-deny")
    assert e.value.status == 403
    bind(core, ns, "probe", "node-0500", dry=True)
    assert rec.seen()[-1][3] == "probe"
    assert rec.requests[-1]["object"]["target"]["name"] == "node-0500"
