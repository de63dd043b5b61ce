"""Pure admission rules: what a request to bind or resize a pod asks of the
ledger, and what we answer.  No I/O: the webhook (coordinator/webhook.py)
fetches the pod and calls the ledger; everything it decides is here.

Requests we see (the Helm chart's templates/webhook.yaml):
  CREATE pods/binding, CREATE bindings   a scheduler binds a pod to a node
  CREATE pods with spec.nodeName         a pod placed directly on a node
  UPDATE pods/resize                     in-place resize: an increase needs room
  UPDATE resourceclaims/status           a claim allocated GPUs (policy/gpus.py)

A pod costs what the ledger holds for it (quantities.held_requests: the larger of
what its spec asks and what its kubelet may run, an Infeasible or Deferred
resize included), in millicores and bytes, rounded up.  The ledger key is
the pod's UID, so the API server retrying, or a binding after a nodeName
create, never reserves twice.

Resizes: a bound pod's resize is judged against what the ledger holds for
it now (the old pod's held size), so a shrink after an Infeasible growth
needs nothing (the ledger still holds the growth) and any growth beyond it
is reserved.  A pod not bound yet may shrink but not grow: its binding was
sized from a GET that may be older than the resize (a binding is admitted
before the API server stores it, and the store takes the pod as it is then),
and nothing names the node it goes to; refusing the growth makes the
binding's size an upper bound.  The resize's oldObject is the pod as the
API server replaces it (it re-runs admission when the pod changed
meanwhile), so a pod bound in between is judged as bound.

Creates with spec.nodeName are reserved before later admission plugins
(ResourceQuota) or the store (AlreadyExists) may still refuse them:
landed() says whether such a reservation (or a binding's, which the store
refuses when the pod is bound already) became a pod once it can be read
back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from . import ledger, quantities, usage


@dataclass(frozen=True)
class Allow:
    """Allow (the reason is logged; code labels the metric, see CODES)."""
    reason: str
    code: str = "reserved"


@dataclass(frozen=True)
class Deny:
    message: str
    code: str = "internal"


# Metric labels (pyk8sres_admission_requests_total{result, reason}): a few
# fixed words, never names, so the series stay few.
ALLOW_CODES = ("reserved", "not_shared", "exempt", "dry_run", "unbound", "not_checked",
               "no_growth", "static_over_capacity")
DENY_CODES = ("nofit", "ledger_unreachable", "ledger_not_ready", "ledger_refused",
              "pod_unreadable", "pod_not_found", "bad_request", "internal", "unauthenticated",
              "unbound_growth", "phantom_creates", "workers_unknown", "gpus_fenced",
              "legacy_gpu")


@dataclass(frozen=True)
class Target:
    """A request that places (or grows) a pod on a node."""
    op: str            # "bind", "create" or "resize"
    namespace: str
    pod_name: str
    node: str          # Kubernetes node ("" for the resize of a pod not bound yet)
    dry_run: bool
    pod: Mapping | None = None       # the pod, when the request carries it
    old_pod: Mapping | None = None   # resize: the pod before
    user: str = ""                   # who asks (request.userInfo.username)


@dataclass(frozen=True)
class Reserve:
    """Ask the ledger for this, then answer with verdict()."""
    slurm_node: str
    key: str
    cpu_m: int
    mem_bytes: int
    static: bool = False   # a static pod: allowed even when it does not fit


def classify(request: Mapping) -> Target | Allow | Deny:
    """What an AdmissionReview request is about (pure, from the request alone)."""
    op = request.get("operation")
    res = (request.get("resource") or {}).get("resource")
    sub = request.get("subResource") or ""
    ns = request.get("namespace") or ""
    obj = request.get("object") or {}
    dry = bool(request.get("dryRun"))
    if op == "CREATE" and ((res == "pods" and sub == "binding") or (res == "bindings" and not sub)):
        target = (obj.get("target") or {})
        if target.get("kind") not in (None, "", "Node") or not target.get("name"):
            return Deny("binding target must name a Node", "bad_request")
        name = request.get("name") or (obj.get("metadata") or {}).get("name") or ""
        return Target("bind", ns, name, target["name"], dry)
    if res == "pods" and op == "CREATE" and not sub:
        node = (obj.get("spec") or {}).get("nodeName")
        if not node:
            return Allow("pod has no spec.nodeName: it is checked when it is bound", "unbound")
        name = (obj.get("metadata") or {}).get("name") or request.get("name") or ""
        user = (request.get("userInfo") or {}).get("username") or ""
        return Target("create", ns, name, node, dry, pod=obj, user=user)
    if res == "pods" and op == "UPDATE" and sub == "resize":
        old = request.get("oldObject") or {}
        # The pod as stored is what the resize replaces: bound there, bound here.
        node = ((old.get("spec") or {}).get("nodeName")
                or (obj.get("spec") or {}).get("nodeName") or "")
        return Target("resize", ns, request.get("name") or "", node, dry, pod=obj, old_pod=old)
    return Allow(f"not a request we check ({op} {res}/{sub})", "not_checked")


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def is_static_pod(target: Target, pod: Mapping) -> bool:
    """The node's own kubelet creating the mirror of a static pod: the kubelet
    already runs it, whatever we answer, and retries the mirror until it is
    accepted.  Refusing would only hide it from both sides, so it is reserved
    if it fits and allowed (and counted, and the node flagged) if it does not.
    Only the kubelet's own identity (system:node:<node>, which NodeRestriction
    confines to mirror pods of that node) gets this; a user's annotation alone
    gets nothing."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return (target.op == "create" and MIRROR_ANNOTATION in annotations
            and target.user == f"system:node:{target.node}")


def pod_cost(pod: Mapping) -> tuple[int, int]:
    """(millicores, bytes) the ledger holds for the pod, rounded up
    (quantities.held_requests: the larger of its spec and what its kubelet may
    run, Infeasible or not).  Raises QuantityError."""
    req = quantities.held_requests(pod)
    return math.ceil(req["cpu"] * 1000), math.ceil(req["memory"])


def _unbound_resize(target: Target) -> Allow | Deny:
    """A resize of a pod no node holds yet: a shrink is allowed (its binding,
    sized before or after, holds at least the new size), a growth refused
    (a binding admitted a moment ago was sized from the smaller pod and is
    stored with the larger one)."""
    what = f"pod {target.namespace}/{target.pod_name}"
    try:
        cpu_m, mem = pod_cost(target.pod or {})
        old_cpu, old_mem = pod_cost(target.old_pod or {})
    except (quantities.QuantityError, AttributeError, TypeError, ValueError) as e:
        return Deny(f"{what}: unreadable requests: {e}", "bad_request")
    if cpu_m <= old_cpu and mem <= old_mem:
        return Allow("resize of a pod not bound yet does not grow it: its binding is "
                     "checked at its new size", "unbound")
    return Deny(f"{what} is not bound to a node yet: growing it in place "
                f"({old_cpu}m CPU, {old_mem // quantities.MI}Mi -> {cpu_m}m CPU, "
                f"{mem // quantities.MI}Mi) is "
                "refused, as a binding to a node shared with Slurm may already be sized from "
                "its old requests; resize it once it is bound, or recreate it with the new size",
                "unbound_growth")


def plan(target: Target, pod: Mapping | None, slurm_node: str | None,
         exempt: usage.Exemptions, unknown: str | None = None) -> Reserve | Allow | Deny:
    """Decide for one Target; pod is the stored pod for bindings (None: not found).

    slurm_node: the Slurm node the Kubernetes node is (None: not a shared node).
    unknown: why whether the node is shared cannot be told now (the worker
    pods that would map it are not known): refused unless the pod is exempt.
    """
    if target.op == "resize" and not target.node:
        why = usage.exempt_reason(target.pod or {}, exempt)
        return Allow(why, "exempt") if why else _unbound_resize(target)
    if slurm_node is None and unknown is None:
        return Allow(f"node {target.node} is not shared with Slurm", "not_shared")
    pod = target.pod if target.pod is not None else pod
    if pod is None:
        return Deny(f"pod {target.namespace}/{target.pod_name} not found", "pod_not_found")
    why = usage.exempt_reason(pod, exempt)
    if why:
        return Allow(why, "exempt")
    if slurm_node is None:
        return Deny(f"pod {target.namespace}/{target.pod_name}: {unknown}; failing closed: "
                    "retry shortly", "workers_unknown")
    uid = (pod.get("metadata") or {}).get("uid")
    if not uid:
        return Deny(f"pod {target.namespace}/{target.pod_name} has no UID yet", "bad_request")
    try:
        cpu_m, mem = pod_cost(pod)
        if target.op == "resize":
            # Against what the ledger holds for the pod now (its old held
            # size, an Infeasible growth included), not its old spec alone.
            old_cpu, old_mem = pod_cost(target.old_pod or {})
            if cpu_m <= old_cpu and mem <= old_mem:
                return Allow("resize does not grow what the ledger holds for the pod (the "
                             "repair shrinks its share once the kubelet runs it smaller)",
                             "no_growth")
            # The kubelet runs the old size until it has resized: hold the larger of each.
            cpu_m, mem = max(cpu_m, old_cpu), max(mem, old_mem)
    except (quantities.QuantityError, AttributeError, TypeError, ValueError) as e:
        return Deny(f"pod {target.namespace}/{target.pod_name}: unreadable requests: {e}",
                    "bad_request")
    if target.dry_run:
        return Allow("dry run: nothing reserved", "dry_run")
    return Reserve(slurm_node, uid, cpu_m, mem, static=is_static_pod(target, pod))


def verdict(target: Target, r: Reserve, reply: Mapping) -> Allow | Deny:
    """The answer, from the ledger's reply to reserve()."""
    what = (f"pod {target.namespace}/{target.pod_name} ({r.cpu_m}m CPU, "
            f"{r.mem_bytes // quantities.MI}Mi)")
    if reply.get("ok") is True:
        return Allow(f"{what} reserved on Slurm node {r.slurm_node}", "reserved")
    code = reply.get("code") or "internal"
    err = reply.get("error") or "no reason given"
    if code == "nofit" and r.static:
        return Allow(f"static {what} runs on node {target.node} whatever we answer: allowed "
                     f"over capacity ({err}); the sync daemon counts it and reports the node "
                     "Oversubscribed until jobs leave room", "static_over_capacity")
    if code == "nofit":
        return Deny(f"{what} does not fit on node {target.node}: {err}", "nofit")
    if ledger.not_ready(reply):
        # Never allowed unreserved, not even a static pod: nothing was
        # reserved, and the ledger says nothing about the node yet.
        return Deny(f"{what} refused on node {target.node}: {ledger.NOT_READY_TEXT} ({err}); "
                    "no pod is placed on a shared node until it answers: retry shortly",
                    "ledger_not_ready")
    return Deny(f"{what} refused on node {target.node} ({code}): {err}",
                "ledger_refused" if code in ("unknown_node", "denied", "badrequest") else "internal")


# ------------------------------------------------- creates refused after us

def landed(uid: str, node: str, stored: Mapping | None) -> bool:
    """Did the create (or binding) admitted for this UID on this Kubernetes
    node become a pod there?  `stored` is the pod of that namespace/name as
    the API server has it now (None: none).  A pod of another UID under the
    name means ours lost (AlreadyExists, or replaced since); one bound to
    another node means the binding lost (already bound): either way the
    reservation under our UID on that node is no pod's."""
    return bool(stored) and ((stored.get("metadata") or {}).get("uid") == uid
                             and (stored.get("spec") or {}).get("nodeName") == node)


def phantom_refusal(target: Target, seconds_left: float) -> Deny:
    """A namespace whose reserved create failed after admission a moment
    ago: its next creates on shared nodes wait, so a loop of creates that
    will fail (a ResourceQuota of pods: 0, a taken name) cannot keep
    Slurm's CPUs held."""
    return Deny(f"pod {target.namespace}/{target.pod_name}: creates with spec.nodeName on nodes "
                f"shared with Slurm are refused in namespace {target.namespace} for "
                f"{max(1, math.ceil(seconds_left))} s more: a pod created there a moment ago "
                "was reserved on its node and then refused after admission (ResourceQuota, "
                "name already taken), so each such create held Slurm's CPUs for nothing; "
                "fix what refuses it, then retry", "phantom_creates")


def review_response(request: Mapping, decision: Allow | Deny) -> dict:
    """The AdmissionReview (v1) answering request."""
    allowed = isinstance(decision, Allow)
    resp: dict = {"uid": request.get("uid", ""), "allowed": allowed}
    if not allowed:
        resp["status"] = {"code": 403, "reason": "Forbidden", "message": decision.message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


# ----------------------------------------------------------------- scoping

def unshared_nodes_condition(unshared: list[str]) -> str:
    """CEL matchCondition: the request targets a node NOT known to be unshared.

    Fail closed: every node is checked unless the coordinator has seen it
    and knows Slurm does not share it (and every resize of a pod not bound
    yet), so a node that joins, or a node the
    coordinator has not heard of (it is down, restarting, the ledger has
    not answered), is checked; a down coordinator blocks those and the
    shared nodes (failurePolicy Fail), never the nodes known unshared.
    Binding objects carry the node in target.name; pods in spec.nodeName.
    The set is a map literal: membership costs O(1) in CEL's cost model,
    where `in` on a list of 1000 names would be estimated per unbounded
    string compare.
    """
    names = "{" + ", ".join("'" + n.replace("\\", "\\\\").replace("'", "\\'") + "': true"
                            for n in sorted(set(unshared))) + "}"
    # request.subResource is absent (not "") on plain pod requests: guard with has().
    # The resize of a pod no node holds yet is checked too (a growth is refused).
    # A ResourceClaim's status update is checked when it brings an
    # allocation (the API server keeps one immutable until it is cleared)
    # unless it names only nodes known unshared.
    claim = (f"has(object.status) && has(object.status.allocation)"
             f" && !(has(oldObject.status) && has(oldObject.status.allocation))"
             f" && !(has(object.status.allocation.nodeSelector)"
             f" && object.status.allocation.nodeSelector.nodeSelectorTerms.all(t,"
             f" has(t.matchFields) && t.matchFields.exists(f, f.key == 'metadata.name'"
             f" && f.operator == 'In' && has(f.values) && f.values.all(v, v in {names}))))")
    return (f"request.resource.resource == 'resourceclaims' ? ({claim}) : "
            f"((request.resource.resource == 'bindings' ||"
            f" (has(request.subResource) && request.subResource == 'binding'))"
            f" ? !(object.target.name in {names})"
            f" : (has(object.spec.nodeName) ? !(object.spec.nodeName in {names})"
            f" : (has(request.subResource) && request.subResource == 'resize')))")


SHARED_CONDITION = "shared-node"


def updated_webhook_config(current: Mapping, webhook_name: str, unshared: list[str] | None,
                           ca_bundle: str | None, client_config: Mapping | None) -> dict | None:
    """The ValidatingWebhookConfiguration with what the coordinator owns set,
    or None when nothing changes.

    Owned: the "shared-node" matchCondition (every node but `unshared`),
    caBundle (ca_bundle None: left alone, cert-manager's cainjector owns it)
    and clientConfig's url/service when the object has neither.  Everything
    else (scope, failurePolicy) is the admin's and kept.  unshared None
    (which nodes Slurm shares is not known now): the condition is left as
    it is.
    """
    import copy
    doc = copy.deepcopy(dict(current))
    hooks = [w for w in doc.get("webhooks") or [] if w.get("name") == webhook_name]
    if not hooks:
        raise ValueError(f"{(doc.get('metadata') or {}).get('name')}: no webhook named {webhook_name!r}")
    w = hooks[0]
    cc = w.setdefault("clientConfig", {})
    if client_config and not cc.get("url") and not cc.get("service"):
        cc.update(client_config)
    if client_config and client_config.get("url") and cc.get("url") != client_config["url"] \
            and not cc.get("service"):
        cc["url"] = client_config["url"]
    if ca_bundle is not None:
        cc["caBundle"] = ca_bundle
    if unshared is not None:
        conds = [c for c in w.get("matchConditions") or [] if c.get("name") != SHARED_CONDITION]
        conds.append({"name": SHARED_CONDITION, "expression": unshared_nodes_condition(unshared)})
        w["matchConditions"] = conds
    return None if doc == current else doc
