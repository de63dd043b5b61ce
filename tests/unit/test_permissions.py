"""coordinator/permissions.py: a request's RBAC rule from its method and
URL (the API server's request rules), and what a refusal leaves in
readiness until the same is granted."""
import json

import pytest
from kubernetes.client.exceptions import ApiException

from pyk8sres.coordinator import metrics
from pyk8sres.coordinator import permissions

S = "https://127.0.0.1:6443"


@pytest.mark.parametrize("method,url,rule", [
    ("GET", f"{S}/api/v1/pods?fieldSelector=spec.nodeName%21%3D&limit=500",
     ("list", "", "pods", "")),
    ("GET", f"{S}/api/v1/nodes?watch=True&resourceVersion=5", ("watch", "", "nodes", "")),
    ("GET", f"{S}/api/v1/namespaces/default/pods/p", ("get", "", "pods", "default")),
    ("GET", f"{S}/api/v1/namespaces/x/pods", ("list", "", "pods", "x")),
    ("PATCH", f"{S}/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status",
     ("patch", "pyk8sres.io", "genericnodes/status", "")),
    ("PATCH", f"{S}/api/v1/namespaces/s/pods/p/resize", ("patch", "", "pods/resize", "s")),
    ("POST", f"{S}/api/v1/namespaces/d/pods/p/binding", ("create", "", "pods/binding", "d")),
    ("POST", f"{S}/api/v1/namespaces/d/events", ("create", "", "events", "d")),
    ("PUT", f"{S}/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/a",
     ("update", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "")),
    ("DELETE", f"{S}/apis/pyk8sres.io/v1alpha1/genericnodes/g",
     ("delete", "pyk8sres.io", "genericnodes", "")),
    ("DELETE", f"{S}/api/v1/namespaces/d/pods", ("deletecollection", "", "pods", "d")),
    ("GET", f"{S}/api/v1/namespaces/d", ("get", "", "namespaces", "")),
    ("GET", f"{S}/version", None),
    ("GET", f"{S}/apis", None),
    ("GET", f"{S}/api/v1", None),
])
def test_request_rule(method, url, rule):
    assert permissions.request_rule(method, url) == rule


def status(message):
    return json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden",
                       "message": message, "code": 403}).encode()


def test_refused_until_granted_and_said_in_readiness():
    r = permissions.Refusals()
    nodes = f"{S}/api/v1/nodes?limit=500"
    assert r.not_ready() is None
    r.answered("GET", f"{S}/api/v1/pods", 200)
    assert r.not_ready() is None
    r.answered("GET", nodes, 403, status('nodes is forbidden: User "sa" cannot list resource '
                                         '"nodes" in API group "" at the cluster scope'))
    r.answered("PATCH", f"{S}/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status", 403,
               status('genericnodes.pyk8sres.io "n1" is forbidden: User "sa" cannot patch '
                      'resource "genericnodes/status" in API group "pyk8sres.io" at the '
                      'cluster scope'))
    why = r.not_ready()
    assert why.startswith("forbidden by RBAC: list nodes; ")
    assert "patch genericnodes/status (API group pyk8sres.io)" in why
    r.answered("GET", f"{S}/api/v1/nodes?watch=True", 200)     # another verb: still refused
    assert "list nodes" in r.not_ready()
    r.answered("GET", nodes, 200)                                 # granted again
    assert r.not_ready() == ("forbidden by RBAC: patch genericnodes/status (API group "
                             "pyk8sres.io) (grant them: the Helm chart's RBAC)")
    r.answered("PATCH", f"{S}/apis/pyk8sres.io/v1alpha1/genericnodes/n2/status", 200)
    assert r.not_ready() is None


def test_the_crd_check_refused_on_purpose_is_not_a_deficit():
    r = permissions.Refusals()
    r.answered("GET", f"{S}/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                      "genericnodes.pyk8sres.io", 403, status("forbidden"))
    assert r.not_ready() is None


def test_a_refusal_makes_the_daemon_not_ready(monkeypatch):
    health = metrics.Health()
    health.check("own", lambda: None)
    monkeypatch.setattr(metrics, "HEALTH", health)
    r = permissions.Refusals()
    assert health.ready() == []
    r.answered("GET", f"{S}/api/v1/namespaces/d/pods/x", 403,
               status('pods "x" is forbidden: User "sa" cannot get resource "pods" in API '
                      'group "" in the namespace "d"'))
    assert health.ready() == ["permissions: forbidden by RBAC: get pods in namespace d "
                              "(grant them: the Helm chart's RBAC)"]


@pytest.mark.parametrize("message", [
    'admission webhook "admission.pyk8sres.io" denied the request: pod d/p (1000m CPU, 1Gi) '
    'does not fit on node n1',
    'pods "p" is forbidden: exceeded quota: q, requested: cpu=2, used: cpu=4, limited: cpu=4',
    'pods "p" is forbidden: violates PodSecurity "restricted:latest": privileged',
])
def test_an_admission_refusal_is_not_a_missing_grant(message):
    """A 403 that admission gives one object: the daemon still has its
    permissions (our own webhook refusing a pod must not make it not ready)."""
    r = permissions.Refusals()
    r.answered("POST", f"{S}/api/v1/namespaces/d/pods", 403, status(message))
    assert r.not_ready() is None
    e = ApiException(status=403, reason="Forbidden")
    e.body = status(message).decode()
    assert permissions.error_text(e) == "403 Forbidden: " + message


def test_error_text_is_one_line_naming_what_rbac_refused():
    e = ApiException(status=403, reason="Forbidden")
    e.body = status('pods "p" is forbidden: User "system:serviceaccount:pyk8sres-system:'
                    'pyk8sres-webhook" cannot get resource "pods" in API group "" in the '
                    'namespace "default"').decode()
    text = permissions.error_text(e)
    assert "\n" not in text and text.startswith("forbidden by RBAC: pods \"p\" is forbidden")
    assert 'cannot get resource "pods"' in text
    e = ApiException(status=500, reason="Internal Server Error")
    e.body = "not json"
    assert permissions.error_text(e) == "500 Internal Server Error: not json"
    assert permissions.error_text(TimeoutError("read timed out")) == "TimeoutError: read timed out"


def test_answers_are_not_classified_while_nothing_is_refused(monkeypatch):
    """request_rule (URL parsing) runs on every request's answer only while
    something is refused, or for a 403."""
    parsed = []
    real = permissions.request_rule
    monkeypatch.setattr(permissions, "request_rule", lambda m, u: parsed.append(u) or real(m, u))
    r = permissions.Refusals()
    for code in (200, 201, 404, 409, 500):
        r.answered("PATCH", f"{S}/apis/pyk8sres.io/v1alpha1/genericnodes/n1/status", code)
    assert parsed == [] and r.not_ready() is None
    r.answered("GET", f"{S}/api/v1/nodes", 403, status('nodes is forbidden: User "sa" cannot '
                                                       'list resource "nodes"'))
    assert len(parsed) == 1 and r.not_ready()
    r.answered("GET", f"{S}/api/v1/nodes", 200)                   # granted again: cleared
    assert len(parsed) == 2 and r.not_ready() is None
