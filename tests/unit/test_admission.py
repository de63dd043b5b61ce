"""Table-driven tests of the pure admission rules (pyk8sres.policy.admission)."""

import pytest

from pyk8sres.coordinator import scope
from pyk8sres.coordinator.config import SyncConfig
from pyk8sres.coordinator.scope import Scope
from pyk8sres.policy import admission
from pyk8sres.policy import usage

MI = 1024 * 1024
EX = usage.exemptions(["slurm"], "pyk8sres-system")


def pod(name="p", ns="default", node=None, cpu="500m", mem="256Mi", uid="u-1", labels=None,
        annotations=None):
    spec = {"containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
    if node:
        spec["nodeName"] = node
    meta = {"name": name, "namespace": ns, "labels": labels or {}}
    if annotations:
        meta["annotations"] = annotations
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def req(op, resource, sub="", obj=None, old=None, name="p", ns="default", dry=False, user="alice"):
    return {"uid": "r-1", "operation": op, "resource": {"group": "", "version": "v1",
                                                       "resource": resource},
            "subResource": sub, "name": name, "namespace": ns, "object": obj,
            "oldObject": old, "dryRun": dry, "userInfo": {"username": user}}


def binding(node="n1", name="p"):
    return {"kind": "Binding", "metadata": {"name": name}, "target": {"kind": "Node", "name": node}}


@pytest.mark.parametrize("case,r,expect", [
    ("pods/binding", req("CREATE", "pods", "binding", binding()), ("bind", "p", "n1")),
    ("bindings", req("CREATE", "bindings", "", binding(name="q"), name=""), ("bind", "q", "n1")),
    ("pod with nodeName", req("CREATE", "pods", "", pod(node="n2")), ("create", "p", "n2")),
    ("pod without nodeName", req("CREATE", "pods", "", pod()), admission.Allow),
    ("resize bound", req("UPDATE", "pods", "resize", pod(node="n1"), pod(node="n1")),
     ("resize", "p", "n1")),
    ("resize unbound: judged by plan", req("UPDATE", "pods", "resize", pod(), pod()),
     ("resize", "p", "")),
    ("resize: the stored pod's node decides",
     req("UPDATE", "pods", "resize", pod(), pod(node="n2")), ("resize", "p", "n2")),
    ("pod update", req("UPDATE", "pods", "", pod(node="n1"), pod(node="n1")), admission.Allow),
    ("pods/status", req("UPDATE", "pods", "status", pod(node="n1")), admission.Allow),
    ("binding to a non-node", req("CREATE", "pods", "binding",
                                  {"target": {"kind": "Pod", "name": "x"}}), admission.Deny),
    ("binding without target", req("CREATE", "pods", "binding", {"target": {}}), admission.Deny),
])
def test_classify(case, r, expect):
    got = admission.classify(r)
    if isinstance(got, admission.Target) and got.op == "create":
        assert got.user == "alice"
    if isinstance(expect, tuple):
        assert isinstance(got, admission.Target), case
        assert (got.op, got.pod_name, got.node) == expect, case
    else:
        assert isinstance(got, expect), (case, got)


def target(op="bind", node="n1", dry=False, p=None, old=None, user="alice"):
    return admission.Target(op, "default", "p", node, dry, pod=p, old_pod=old, user=user)


MIRROR = {admission.MIRROR_ANNOTATION: "abc"}


def ran(p, cpu, pending=None):
    """p as its kubelet reports it: running with `cpu` (and its memory),
    a resize left pending with that reason."""
    mem = p["spec"]["containers"][0]["resources"]["requests"]["memory"]
    p["status"] = {"containerStatuses": [{"name": "c", "resources": {"requests": {
        "cpu": cpu, "memory": mem}}, "allocatedResources": {"cpu": cpu, "memory": mem}}]}
    if pending:
        p["status"]["conditions"] = [{"type": "PodResizePending", "status": "True",
                                      "reason": pending}]
    return p


@pytest.mark.parametrize("case,t,stored,snode,expect", [
    ("bind reserves the pod's requests", target(), pod(), "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("mapped slurm node", target(node="k8s-a"), pod(), "s7",
     admission.Reserve("s7", "u-1", 500, 256 * MI)),
    ("not shared", target(), pod(), None, admission.Allow),
    ("pod gone", target(), None, "n1", admission.Deny),
    ("no uid", target(), pod(uid=None), "n1", admission.Deny),
    ("dry run reserves nothing", target(dry=True), pod(), "n1", admission.Allow),
    ("create uses the request's pod", target("create", p=pod(cpu="2")), None, "n1",
     admission.Reserve("n1", "u-1", 2000, 256 * MI)),
    ("rounded up", target(), pod(cpu="1001u", mem="1001"), "n1",
     admission.Reserve("n1", "u-1", 2, 1001)),
    ("worker namespace exempt", target(), pod(ns="slurm"), "n1", admission.Allow),
    ("placeholder exempt", target(), pod(ns="pyk8sres-system", name="slurm-share-n1"), "n1",
     admission.Allow),
    # Nothing the pod creator writes exempts it.
    ("self-service label", target(), pod(labels={"pyk8sres.io/slurm-worker": "true"}), "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("placeholder name elsewhere", target(), pod(name="slurm-share-n1"), "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("malformed requests", target(), pod(cpu="lots"), "n1", admission.Deny),
    ("resize growth holds the larger of each",
     target("resize", p=pod(node="n1", cpu="2", mem="100Mi"), old=pod(node="n1", cpu="1")), None,
     "n1", admission.Reserve("n1", "u-1", 2000, 256 * MI)),
    # A static pod's mirror, from its own node's kubelet: reserved, and
    # allowed over capacity (verdict); from anyone else it is a plain pod.
    ("static pod from its kubelet", target("create", p=pod(annotations=MIRROR),
                                           user="system:node:n1"), None, "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI, static=True)),
    ("mirror annotation from a user", target("create", p=pod(annotations=MIRROR)), None, "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("mirror from another node's kubelet", target("create", p=pod(annotations=MIRROR),
                                                  user="system:node:n2"), None, "n1",
     admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("kubelet without the mirror annotation", target("create", p=pod(), user="system:node:n1"),
     None, "n1", admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("mirror binding is not a create", target("bind", user="system:node:n1"),
     pod(annotations=MIRROR), "n1", admission.Reserve("n1", "u-1", 500, 256 * MI)),
    ("resize shrink needs nothing",
     target("resize", p=pod(node="n1", cpu="100m"), old=pod(node="n1")), None, "n1",
     admission.Allow),
    # The pod as its kubelet reported it (usage.pod_requests counts status too).
    ("resize after an Infeasible one reserves its new size",
     target("resize", p=ran(pod(node="n1", cpu="4"), "1", "Infeasible"),
            old=ran(pod(node="n1", cpu="3"), "1", "Infeasible")), None, "n1",
     admission.Reserve("n1", "u-1", 4000, 256 * MI)),
    ("resize below what still runs needs nothing",
     target("resize", p=ran(pod(node="n1", cpu="2"), "3"), old=ran(pod(node="n1", cpu="1"), "3")),
     None, "n1", admission.Allow),
    ("resize above what still runs reserves the new size",
     target("resize", p=ran(pod(node="n1", cpu="4"), "3"), old=ran(pod(node="n1", cpu="1"), "3")),
     None, "n1", admission.Reserve("n1", "u-1", 4000, 256 * MI)),
])
def test_plan(case, t, stored, snode, expect):
    got = admission.plan(t, stored, snode, EX)
    if isinstance(expect, admission.Reserve):
        assert got == expect, case
    else:
        assert isinstance(got, expect), (case, got)


@pytest.mark.parametrize("reply,allowed,words", [
    ({"ok": True}, True, ["reserved", "Slurm node n1"]),
    ({"ok": False, "code": "nofit", "error": "Slurm jobs hold 6 of 8 CPUs on n1"}, False,
     ["does not fit on node n1", "Slurm jobs hold 6 of 8 CPUs", "default/p"]),
    ({"ok": False, "code": "unknown_node", "error": "no node n1"}, False, ["unknown_node"]),
    ({}, False, ["internal"]),
    ({"ok": "yes"}, False, ["internal"]),   # only a real true allows
])
def test_verdict(reply, allowed, words):
    d = admission.verdict(target(), admission.Reserve("n1", "u-1", 500, 256 * MI), reply)
    assert isinstance(d, admission.Allow) is allowed
    text = d.reason if allowed else d.message
    for w in words:
        assert w in text


@pytest.mark.parametrize("reply,allowed", [
    ({"ok": True}, True),
    ({"ok": False, "code": "nofit", "error": "Slurm jobs hold 8 of 8 CPUs on n1"}, True),
    ({"ok": False, "code": "unknown_node", "error": "no node n1"}, False),
    ({"ok": False, "code": "denied", "error": "uid 5 may not"}, False),
])
def test_verdict_static_pod(reply, allowed):
    """Only "does not fit" is overridden for a static pod: it runs anyway."""
    d = admission.verdict(target("create"),
                          admission.Reserve("n1", "u-1", 500, 256 * MI, static=True), reply)
    assert isinstance(d, admission.Allow) is allowed
    if allowed and not reply["ok"]:
        assert "Oversubscribed" in d.reason and "8 of 8 CPUs" in d.reason


def test_review_response():
    r = admission.review_response({"uid": "abc"}, admission.Deny("no room"))
    assert r["response"] == {"uid": "abc", "allowed": False,
                             "status": {"code": 403, "reason": "Forbidden", "message": "no room"}}
    allowed = admission.review_response({"uid": "abc"}, admission.Allow("ok"))["response"]
    assert allowed == {"uid": "abc", "allowed": True}


def test_unshared_nodes_condition_quotes_and_fails_closed():
    c = admission.unshared_nodes_condition(["n2", "n1", "it's"])
    assert "!(object.target.name in {'it\\'s': true, 'n1': true, 'n2': true})" in c
    assert "!(object.spec.nodeName in {" in c
    # a pod with no node: only its resize is sent (a growth is refused)
    assert "has(object.spec.nodeName) ? !(object.spec.nodeName in {" in c
    assert c.endswith(": (has(request.subResource) && request.subResource == 'resize')))")
    # a claim's status: only a new allocation, unless it names only unshared nodes
    assert c.startswith("request.resource.resource == 'resourceclaims' ? (has(object.status) "
                        "&& has(object.status.allocation) && !(has(oldObject.status) "
                        "&& has(oldObject.status.allocation))")
    assert "f.values.all(v, v in {'it\\'s': true, 'n1': true, 'n2': true})" in c


VWC = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
       "metadata": {"name": "pyk8sres-admission"},
       "webhooks": [{"name": "other"},
                    {"name": "admission.pyk8sres.io", "failurePolicy": "Fail",
                     "clientConfig": {"service": {"name": "s", "namespace": "x"}},
                     "matchConditions": [{"name": "admin", "expression": "true"},
                                         {"name": "shared-node", "expression": "true"}]}]}


def test_updated_webhook_config_owns_only_its_fields():
    new = admission.updated_webhook_config(VWC, "admission.pyk8sres.io", ["n1"], "Q0E=", None)
    w = new["webhooks"][1]
    assert w["clientConfig"] == {"service": {"name": "s", "namespace": "x"}, "caBundle": "Q0E="}
    assert [c["name"] for c in w["matchConditions"]] == ["admin", "shared-node"]
    assert "!(object.target.name in {'n1': true})" in w["matchConditions"][1]["expression"]
    assert new["webhooks"][0] == {"name": "other"} and w["failurePolicy"] == "Fail"
    assert admission.updated_webhook_config(new, "admission.pyk8sres.io", ["n1"], "Q0E=", None) \
        is None
    # cert-manager: caBundle is left alone
    cm = admission.updated_webhook_config(VWC, "admission.pyk8sres.io", [], None, None)
    assert "caBundle" not in cm["webhooks"][1]["clientConfig"]
    with pytest.raises(ValueError):
        admission.updated_webhook_config(VWC, "nope", [], None, None)
    # Which nodes are shared is not known now: the published condition stays
    keep = admission.updated_webhook_config(new, "admission.pyk8sres.io", None, "TkVX", None)
    assert keep["webhooks"][1]["matchConditions"] == w["matchConditions"]


# The metric's reason label (pyk8sres_admission_requests_total{result, reason}).
@pytest.mark.parametrize("case,decision,code", [
    ("unbound pod", admission.classify(req("CREATE", "pods", "", pod())), "unbound"),
    ("other request", admission.classify(req("UPDATE", "pods", "", pod(node="n1"))), "not_checked"),
    ("binding to a non-node", admission.classify(req("CREATE", "pods", "binding",
                                                     {"target": {"kind": "Pod", "name": "x"}})),
     "bad_request"),
    ("not shared", admission.plan(target(), pod(), None, EX), "not_shared"),
    ("pod gone", admission.plan(target(), None, "n1", EX), "pod_not_found"),
    ("no uid", admission.plan(target(), pod(uid=None), "n1", EX), "bad_request"),
    ("exempt", admission.plan(target(), pod(ns="slurm"), "n1", EX), "exempt"),
    ("dry run", admission.plan(target(dry=True), pod(), "n1", EX), "dry_run"),
    ("malformed", admission.plan(target(), pod(cpu="lots"), "n1", EX), "bad_request"),
    ("shrink",
     admission.plan(target("resize", p=pod(node="n1", cpu="100m"), old=pod(node="n1")), None,
                    "n1", EX), "no_growth"),
    ("reserved", admission.verdict(target(), admission.Reserve("n1", "u", 1, 1), {"ok": True}),
     "reserved"),
    ("no fit", admission.verdict(target(), admission.Reserve("n1", "u", 1, 1),
                                 {"ok": False, "code": "nofit", "error": "full"}), "nofit"),
    ("unknown node", admission.verdict(target(), admission.Reserve("n1", "u", 1, 1),
                                       {"ok": False, "code": "unknown_node", "error": "?"}),
     "ledger_refused"),
    ("malformed reply", admission.verdict(target(), admission.Reserve("n1", "u", 1, 1), {}),
     "internal"),
    ("static pod over capacity",
     admission.verdict(target(), admission.Reserve("n1", "u", 1, 1, static=True),
                       {"ok": False, "code": "nofit", "error": "full"}),
     "static_over_capacity"),
])
def test_decision_codes(case, decision, code):
    assert decision.code == code, case
    codes = admission.ALLOW_CODES if isinstance(decision, admission.Allow) else admission.DENY_CODES
    assert code in codes, case


def test_scope_fed_by_the_nodes_informer_keeps_mapping_and_capacity_only():
    """The webhook's Scope as an Informer handler: a node keeps its name, the
    admin's mapping label and what it offers pods; heartbeats (anything
    else) do not bump the version the placeholders plan on."""
    s = Scope(SyncConfig())

    def node(name, label=None, cpu="8", beat="t0"):
        labels = {"team": "x", **({usage.NODE_LABEL: label} if label else {})}
        return {"metadata": {"name": name, "labels": labels, "annotations": {"a": "b"},
                             "resourceVersion": beat},
                "status": {"allocatable": {"cpu": cpu, "memory": "1Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "lastHeartbeatTime": beat}]}}
    s.replace_slim("nodes", [s.slim("nodes", node("k1", label="n1")), s.slim("nodes", node("n2"))])
    s.update(slurm_names=["n1", "n2"])
    nodes, v0 = s.snapshot()
    assert nodes["k1"] == {"metadata": {"name": "k1", "labels": {usage.NODE_LABEL: "n1"}},
                           "status": {"allocatable": {"cpu": "8", "memory": "1Gi"}}}
    assert s.shared() == {"k1": "n1", "n2": "n2"} and s.nodes_watched
    s.event("nodes", "MODIFIED", node("n2", beat="t1"))          # a heartbeat
    assert s.snapshot()[1] == v0
    s.event("nodes", "MODIFIED", node("n2", cpu="4", beat="t2"))
    assert s.snapshot() == ({**nodes, "n2": {"metadata": {"name": "n2"}, "status": {
        "allocatable": {"cpu": "4", "memory": "1Gi"}}}}, v0 + 1)
    s.event("nodes", "DELETED", node("k1"))
    assert s.shared() == {"n2": "n2"} and s.snapshot()[1] == v0 + 2
    s.health("nodes", False)
    assert not s.nodes_watched and s.shared() == {"n2": "n2"}     # kept while reconnecting
    s.update(k8s_nodes=[node("n3")])                             # a list of our own
    assert s.shared() == {} and not s.nodes_watched              # n3 is no Slurm node


def test_scope_maps_the_nodes_again_only_when_its_version_moves(monkeypatch):
    """The placeholders ask for the scope every period: an unchanged scope
    is not mapped again, and any change (a node, Slurm's names) is."""
    calls = []
    real = scope.mapping.usage.slurm_node_for
    monkeypatch.setattr(scope.mapping.usage, "slurm_node_for",
                        lambda n, *a: calls.append(1) or real(n, *a))
    s = scope.Scope(SyncConfig())
    s.replace_slim("nodes", [(n, {"metadata": {"name": n}}) for n in ("n1", "n2", "k8s-only")])
    s.update(slurm_names=["n1", "n2"])
    assert s.unshared() == ["k8s-only"] and s.shared() == {"n1": "n1", "n2": "n2"}
    assert len(calls) == 3
    s.event("nodes", "MODIFIED", {"metadata": {"name": "n3"}})
    assert s.unshared() == ["k8s-only", "n3"] and len(calls) == 7
    s.update(slurm_names=["n1", "n2", "n3"])
    assert s.shared() == {"n1": "n1", "n2": "n2", "n3": "n3"} and len(calls) == 11
    s.update(slurm_names=["n1", "n2", "n3"])          # the same names: nothing moved
    assert s.unshared() == ["k8s-only"] and len(calls) == 11


def resize(new, old, node="n1", dry=False):
    return admission.classify(req("UPDATE", "pods", "resize", new, old, dry=dry))


# Every resize path: the ledger always holds the larger of what the kubelet
# may run (status resources, allocatedResources) and what the spec asks, so
# a resize is judged against what the ledger holds for the pod now (the old
# pod's held size), never its old spec alone.
@pytest.mark.parametrize("case,new,old,expect", [
    ("bound growth reserves the new size",
     ran(pod(node="n1", cpu="4"), "1"), ran(pod(node="n1", cpu="1"), "1"),
     admission.Reserve("n1", "u-1", 4000, 256 * MI)),
    ("bound shrink, kubelet not there yet: nothing", ran(pod(node="n1", cpu="1"), "2"),
     ran(pod(node="n1", cpu="2"), "2"), "no_growth"),
    ("growth over an Infeasible growth: the larger",
     ran(pod(node="n1", cpu="6"), "1", "Infeasible"), ran(pod(node="n1", cpu="4"), "1",
                                                         "Infeasible"),
     admission.Reserve("n1", "u-1", 6000, 256 * MI)),
    # 1 -> 4 left Infeasible (the ledger holds 4: held_requests), then 3:
    # nothing to reserve, the ledger already holds more; the sync daemon
    # then holds 3 (the spec), never 1.
    ("shrink after an Infeasible growth: held already", ran(pod(node="n1", cpu="3"), "1",
                                                         "Infeasible"),
     ran(pod(node="n1", cpu="4"), "1", "Infeasible"), "no_growth"),
    ("growth over a Deferred growth", ran(pod(node="n1", cpu="5"), "1", "Deferred"),
     ran(pod(node="n1", cpu="4"), "1", "Deferred"), admission.Reserve("n1", "u-1", 5000, 256 * MI)),
    ("shrink below a Deferred growth", ran(pod(node="n1", cpu="2"), "1", "Deferred"),
     ran(pod(node="n1", cpu="4"), "1", "Deferred"), "no_growth"),
    ("growth of memory only reserves both, each the larger",
     ran(pod(node="n1", cpu="1", mem="1Gi"), "2"), ran(pod(node="n1", cpu="2"), "2"),
     admission.Reserve("n1", "u-1", 2000, 1024 * MI)),
    ("unbound shrink: allowed", pod(cpu="100m"), pod(), "unbound"),
    ("unbound, same size: allowed", pod(), pod(), "unbound"),
    ("unbound growth: refused", pod(cpu="2"), pod(), "unbound_growth"),
    ("unbound memory growth: refused", pod(mem="1Gi"), pod(), "unbound_growth"),
    ("unbound growth, dry run: refused too", pod(cpu="2"), pod(), "unbound_growth"),
    ("unbound growth to an unshared node's size: refused all the same", pod(cpu="64"), pod(),
     "unbound_growth"),
    ("unbound, unreadable: refused", pod(cpu="lots"), pod(), "bad_request"),
    ("unbound Slurm worker (exempt: holds nothing) may grow", pod(cpu="2", ns="slurm"),
     pod(ns="slurm"), "exempt"),
    # oldObject is the pod as stored when the resize is stored (the API
    # server re-runs admission if it changed): bound meanwhile -> bound rules
    ("bound between the binding and the resize",
     pod(cpu="2"), pod(node="n1"), admission.Reserve("n1", "u-1", 2000, 256 * MI)),
])
def test_resize_paths(case, new, old, expect):
    t = resize(new, old)
    assert isinstance(t, admission.Target), case
    got = admission.plan(t, None, "n1" if t.node else None, EX)
    if isinstance(expect, admission.Reserve):
        assert got == expect, case
    else:
        assert got.code == expect, (case, got)
        assert isinstance(got, admission.Deny) == (expect in admission.DENY_CODES), case
    if isinstance(got, admission.Deny):
        assert "p" in got.message and ("not bound" in got.message or "unreadable" in
                                       got.message), case


def test_shrink_after_infeasible_growth_never_leaves_the_kubelet_unheld():
    """1 CPU -> 4 (Infeasible) -> 3: at every step what the ledger holds
    (the reservation, then held_requests as the sync daemon counts it) is at
    least what the kubelet may run then."""
    one = ran(pod(node="n1", cpu="1"), "1")
    four = ran(pod(node="n1", cpu="4"), "1", "Infeasible")
    three = ran(pod(node="n1", cpu="3"), "1", "Infeasible")   # condition still the old one's
    assert admission.plan(resize(four, one), None, "n1", EX) == admission.Reserve("n1", "u-1",
                                                                                  4000, 256 * MI)
    assert admission.pod_cost(four)[0] == 4000            # the sync daemon keeps holding it
    assert admission.plan(resize(three, four), None, "n1", EX).code == "no_growth"
    assert admission.pod_cost(three)[0] == 3000           # the kubelet may apply 3 at any time
    applied = ran(pod(node="n1", cpu="3"), "3")
    assert admission.pod_cost(applied)[0] == 3000
