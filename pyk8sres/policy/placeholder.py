"""Pure rules for placeholder pods: how kube-scheduler sees what Slurm holds.

A stock kube-scheduler counts only pods.  So each shared node carries one pod,
``slurm-share-<node>`` in the coordinator's namespace, whose requests are what
Slurm's jobs hold there (the ledger's show(): CPUs and MB), capped at the
node's allocatable (an Infeasible resize would not be counted).  It is resized
in place (pods/resize), never recreated, so kube-scheduler's view moves with
job starts and ends.

It stays Burstable whatever its size (a CPU limit equal to the node's
allocatable, no memory limit): a resize may not change a pod's QoS class, and
requests of 0 alone would make it BestEffort.  It has the top priority class
(system-node-critical) so nothing preempts it, and the sync daemon and the
webhook do not count it (usage.exempt_reason: its namespace is the admin's).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Mapping

from . import usage as U

CONTAINER = "slurm-share"
PRIORITY_CLASS = "system-node-critical"
IMAGE = "registry.k8s.io/pause:3.10"


def name_for(k8s_node: str) -> str:
    return U.PLACEHOLDER_PREFIX + k8s_node


def allocatable(node: Mapping) -> tuple[int, int]:
    """(millicores, bytes) a Kubernetes node offers pods (allocatable, else capacity)."""
    st = node.get("status") or {}
    a = st.get("allocatable") or st.get("capacity") or {}
    try:
        return (math.floor(U.parse_quantity(a.get("cpu", "0")) * 1000),
                math.floor(U.parse_quantity(a.get("memory", "0"))))
    except U.QuantityError:
        return 0, 0


def size(jobs: Mapping, alloc: tuple[int, int]) -> tuple[int, int]:
    """(millicores, bytes) for the placeholder: Slurm jobs' CPUs and MB,
    capped at the node's allocatable."""
    cpu_m = int(jobs.get("cpu") or 0) * 1000
    mem = int(jobs.get("mem") or 0) * U.MI
    return max(0, min(cpu_m, alloc[0])), max(0, min(mem, alloc[1]))


def current(pod: Mapping) -> tuple[int, int] | None:
    """The placeholder's requests now, or None if it is not one we made."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == CONTAINER:
            req = (c.get("resources") or {}).get("requests") or {}
            try:
                return (math.ceil(U.parse_quantity(req.get("cpu", "0")) * 1000),
                        math.ceil(U.parse_quantity(req.get("memory", "0"))))
            except U.QuantityError:
                return None
    return None


def resources(cpu_m: int, mem: int, alloc: tuple[int, int]) -> dict:
    return {"requests": {"cpu": U.format_cpu(Fraction(cpu_m, 1000)),
                         "memory": U.format_memory(Fraction(mem))},
            "limits": {"cpu": f"{max(alloc[0], 1)}m"}}


def pod(k8s_node: str, namespace: str, cpu_m: int, mem: int, alloc: tuple[int, int],
        priority_class: str = PRIORITY_CLASS, image: str = IMAGE) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name_for(k8s_node), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "pyk8sres",
                                "app.kubernetes.io/component": "slurm-share"}},
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


def plan(shared: Mapping[str, str], k8s_nodes: Mapping[str, Mapping], shown: Mapping,
         existing: Mapping[str, Mapping]) -> tuple[dict, dict, list]:
    """What to do: ({k8s node: (cpu_m, mem, alloc)} to create,
    {k8s node: (cpu_m, mem, alloc)} to resize, [pod names] to delete).

    shared: k8s node -> Slurm node; shown: the ledger's show()["nodes"];
    existing: our placeholder pods by name.  A shared node Slurm shows
    nothing for keeps its placeholder as is (never shrink on missing data).
    """
    create, resize, delete = {}, {}, []
    for k8s, slurm in shared.items():
        view = shown.get(slurm)
        if view is None or k8s not in k8s_nodes:
            continue
        alloc = allocatable(k8s_nodes[k8s])
        want = size(view.get("jobs") or {}, alloc)
        have = existing.get(name_for(k8s))
        if have is None:
            create[k8s] = (*want, alloc)
        elif current(have) != want:
            resize[k8s] = (*want, alloc)
    wanted = {name_for(k) for k in shared}
    for name in existing:
        if name not in wanted:
            delete.append(name)
    return create, resize, sorted(delete)
