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
    assert rules[("",), ("pods", "nodes")] == {"get", "list", "watch"}
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
