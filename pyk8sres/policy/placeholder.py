"""Pure rules for placeholder pods: how kube-scheduler sees what Slurm holds.

A stock kube-scheduler counts only pods.  So on each shared node the
coordinator keeps placeholder pods (``slurm-share-<node>-xxxxx`` in its own
namespace) whose requests add up to what Slurm's jobs hold there (the
ledger's show(): CPUs and MB), capped at the node's allocatable.

What kube-scheduler counts for a pod (Kubernetes 1.33-1.35,
k8s.io/component-helpers/resource/helpers.go, ``counted`` below): per
container max(spec, status resources, allocatedResources) -- but once the
kubelet marks a resize Infeasible, spec is dropped: only what the kubelet
applied counts.  A kubelet leaves a resize Infeasible on a node with swap
(memory), a static pod, a node without the feature, or above allocatable.
So a placeholder grown in place could be counted at its old size while
Slurm holds the new one.  Hence:

* growth never resizes: it CREATES a pod for the shortfall.  A new pod is
  counted at its requests from the moment it exists, whatever the kubelet
  later says;
* a shrink deletes whole pods that fit in the excess (gone at once,
  grace 0) and downsizes at most one pod in place for the rest: kube-
  scheduler counts the old, larger size until the kubelet applies it, so
  it never sees less.  A downsize the kubelet leaves pending (Deferred or
  Infeasible: over-counted, never under) is replaced by a new pod of the
  wanted size, created before the stuck one is deleted;
* at most ``max_pods`` per node (placeholders use the node's pod budget):
  beyond, the smallest are merged into the one new pod.

Every plan creates before it deletes, so at every instant kube-scheduler
counts at least what Slurm holds (once the coordinator has seen it).

A placeholder stays Burstable (requests and a CPU limit equal to the node's
allocatable; a resize may not change a pod's QoS class).  It has the top
priority class (system-node-critical) so nothing preempts it, tolerates
every taint, and the sync daemon and the webhook do not count it
(usage.exempt_reason: its namespace is the admin's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping

from . import quantities, usage

CONTAINER = "slurm-share"
PRIORITY_CLASS = "system-node-critical"
IMAGE = "registry.k8s.io/pause:3.10"
LABELS = {"app.kubernetes.io/managed-by": "pyk8sres",
          "app.kubernetes.io/component": "slurm-share"}
LABEL_SELECTOR = "app.kubernetes.io/component=slurm-share"
MAX_PODS = 8          # per node: placeholders take the node's pod budget (110 by default)
ZERO = (0, 0)


def name_prefix(k8s_node: str) -> str:
    """generateName of a node's placeholders (the API server adds 5 characters).
    Which node a placeholder is for is its spec.nodeName, never its name."""
    return f"{usage.PLACEHOLDER_PREFIX}{k8s_node}-"


def allocatable(node: Mapping) -> tuple[int, int]:
    """(millicores, bytes) a Kubernetes node offers pods (allocatable, else capacity)."""
    st = node.get("status") or {}
    a = st.get("allocatable") or st.get("capacity") or {}
    try:
        return (math.floor(quantities.parse_quantity(a.get("cpu", "0")) * 1000),
                math.floor(quantities.parse_quantity(a.get("memory", "0"))))
    except quantities.QuantityError:
        return 0, 0


def size(jobs: Mapping, alloc: tuple[int, int]) -> tuple[int, int]:
    """(millicores, bytes) the node's placeholders add up to: Slurm jobs'
    CPUs and MB, capped at the node's allocatable."""
    cpu_m = int(jobs.get("cpu") or 0) * 1000
    mem = int(jobs.get("mem") or 0) * quantities.MI
    return max(0, min(cpu_m, alloc[0])), max(0, min(mem, alloc[1]))


def _amounts(resources) -> tuple[int, int] | None:
    """(millicores, bytes) of a requests map; None when there is none."""
    if resources is None:
        return None
    try:
        return (math.ceil(quantities.parse_quantity(resources.get("cpu", "0")) * 1000),
                math.ceil(quantities.parse_quantity(resources.get("memory", "0"))))
    except quantities.QuantityError:
        return None


def _ours(pod: Mapping) -> Mapping | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == CONTAINER:
            return c
    return None


def current(pod: Mapping) -> tuple[int, int] | None:
    """The placeholder's requests in its spec, or None if it is not one we made."""
    c = _ours(pod)
    if c is None:
        return None
    return _amounts((c.get("resources") or {}).get("requests") or {})


def _status(pod: Mapping) -> Mapping:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            return cs
    return {}


def resize_pending(pod: Mapping) -> str | None:
    """The reason of the pod's PodResizePending condition (Deferred or
    Infeasible), or None."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodResizePending" and cond.get("status", "True") == "True":
            return cond.get("reason") or "Deferred"
    return None


def terminal(pod: Mapping) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def counted(pod: Mapping) -> tuple[int, int]:
    """What kube-scheduler counts for a placeholder, as component-helpers'
    PodRequests with UseStatusResources (InPlacePodVerticalScaling, on by
    default since 1.33): max(spec, status resources, allocatedResources),
    spec dropped while the resize is Infeasible; nothing for a terminal pod
    (the scheduler does not watch Succeeded/Failed pods)."""
    spec = current(pod) or ZERO
    if terminal(pod):
        return ZERO
    cs = _status(pod)
    if cs.get("resources") is None:        # no kubelet report yet: spec
        return spec
    actuated = _amounts(cs["resources"].get("requests") or {}) or ZERO
    allocated = _amounts(cs.get("allocatedResources") or {}) or ZERO
    parts = [actuated, allocated] if resize_pending(pod) == "Infeasible" else \
        [spec, actuated, allocated]
    return max(p[0] for p in parts), max(p[1] for p in parts)


def _applied(pod: Mapping) -> tuple[int, int] | None:
    cs = _status(pod)
    if cs.get("resources") is None:
        return None
    return _amounts(cs["resources"].get("requests") or {})


def resize_in_flight(pod: Mapping) -> bool:
    """The kubelet runs the pod with other requests than its spec and has
    not (yet) said it leaves the resize pending."""
    applied = _applied(pod)
    return applied is not None and applied != current(pod) and resize_pending(pod) is None


def resources(cpu_m: int, mem: int, alloc: tuple[int, int]) -> dict:
    return {"requests": {"cpu": quantities.format_cpu(Fraction(cpu_m, 1000)),
                         "memory": quantities.format_memory(Fraction(mem))},
            "limits": {"cpu": f"{max(alloc[0], 1)}m"}}


def pod(k8s_node: str, namespace: str, cpu_m: int, mem: int, alloc: tuple[int, int],
        priority_class: str = PRIORITY_CLASS, image: str = IMAGE) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": name_prefix(k8s_node), "namespace": namespace,
                     "labels": dict(LABELS)},
        "spec": {
            "nodeName": k8s_node,
            # The class's own preemptionPolicy: Priority admission refuses a
            # pod that names another (and a pod placed by nodeName never
            # preempts anything anyway).
            "priorityClassName": priority_class,
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "tolerations": [{"operator": "Exists"}],   # stays whatever the node's taints
            # Pod Security "restricted": its namespace enforces it.
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65535, "runAsGroup": 65535,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": CONTAINER, "image": image,
                            "securityContext": {"allowPrivilegeEscalation": False,
                                                "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}},
                            "resources": resources(cpu_m, mem, alloc),
                            "resizePolicy": [
                                {"resourceName": "cpu", "restartPolicy": "NotRequired"},
                                {"resourceName": "memory", "restartPolicy": "NotRequired"}]}],
        },
    }


# ---------------------------------------------------------------- planning

@dataclass
class NodePlan:
    """In this order: create (one pod of these (millicores, bytes)), then
    resize (downsizes, by pod name), then delete (pod names)."""
    create: tuple[int, int] | None = None
    resize: dict = field(default_factory=dict)
    delete: list = field(default_factory=list)
    alloc: tuple[int, int] = ZERO

    def __bool__(self) -> bool:
        return bool(self.create or self.resize or self.delete)


def _fits(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[0] and a[1] <= b[1]


def _sub(a, b):
    return a[0] - b[0], a[1] - b[1]


def _add(a, b):
    return a[0] + b[0], a[1] + b[1]


def plan_node(want: tuple[int, int], pods: Mapping[str, Mapping],
              max_pods: int = MAX_PODS) -> NodePlan:
    """What to do on one node so that its live placeholders add up to
    `want` (millicores, bytes), kube-scheduler counting at least `want`
    (or all it counted before, if more) at every step.  pods: this node's
    placeholders by name."""
    plan = NodePlan()
    live: dict[str, tuple[int, int]] = {}   # name -> the size it settles at
    stuck = []
    for name, p in pods.items():
        if terminal(p):                      # not counted any more: just clear it
            plan.delete.append(name)
        elif (p.get("metadata") or {}).get("deletionTimestamp"):
            continue                         # counted until gone: never relied upon
        elif resize_pending(p) and current(p) != counted(p):
            stuck.append(name)               # the kubelet left a resize pending
        else:
            live[name] = current(p) or ZERO
    # Keep the largest pods whose sum stays within want (nothing of size 0).
    kept, total = [], ZERO
    for name in sorted(live, key=lambda n: (live[n], n), reverse=True):
        if live[name] != ZERO and _fits(_add(total, live[name]), want):
            kept.append(name)
            total = _add(total, live[name])
    rest = _sub(want, total)
    if rest != ZERO and len(kept) >= max_pods:   # merge the smallest into the new pod
        while len(kept) >= max_pods:
            total = _sub(total, live[kept.pop()])
        rest = _sub(want, total)
    if rest != ZERO:
        # One pod left over that covers the rest: downsize it in place (the
        # scheduler counts its larger size until the kubelet applies it).
        over = sorted((n for n in live if n not in kept and live[n] != ZERO
                       and _fits(rest, live[n]) and len(kept) < max_pods),
                      key=lambda n: (live[n], n))
        if over:
            plan.resize[over[0]] = rest
            kept.append(over[0])
        else:
            plan.create = rest
    plan.delete += sorted(stuck) + sorted(n for n in live if n not in kept)
    return plan


def plan(shared: Mapping[str, str], k8s_nodes: Mapping[str, Mapping], shown: Mapping,
         existing: Mapping[str, Mapping], max_pods: int = MAX_PODS) -> dict[str, NodePlan]:
    """{k8s node: NodePlan} for the nodes where something is to be done.

    shared: k8s node -> Slurm node; shown: the ledger's show()["nodes"];
    existing: our placeholder pods by name (which node: spec.nodeName).  A
    shared node Slurm shows nothing for, or that is not listed, keeps its
    placeholders as they are (never shrink on missing data); placeholders
    on nodes no longer shared are deleted.
    """
    by_node: dict[str, dict[str, Mapping]] = {}
    for name, p in existing.items():
        by_node.setdefault((p.get("spec") or {}).get("nodeName") or "", {})[name] = p
    out: dict[str, NodePlan] = {}
    for k8s, slurm in shared.items():
        view = shown.get(slurm)
        if view is None or k8s not in k8s_nodes:
            continue
        alloc = allocatable(k8s_nodes[k8s])
        node_plan = plan_node(size(view.get("jobs") or {}, alloc), by_node.get(k8s, {}),
                              max_pods)
        node_plan.alloc = alloc
        if node_plan:
            out[k8s] = node_plan
    for k8s, pods in by_node.items():
        if k8s not in shared:
            out[k8s] = NodePlan(delete=sorted(pods))
    return out
