"""The Slinky layout of the test cluster (`cluster up --kubernetes
--containerized slinky`): Slurm's workers as SchedMD's slurm-operator (v1.2,
NodeSet in StatefulSet mode) makes them.

The operator's NodeSet controller creates the worker pods itself, each with
labels of its own (the Slurm node name is per pod), which a StatefulSet
cannot give; so the test cluster plays that controller too (ensure_pods,
from the container runtime's loop): pods `slurm-worker-<nodeset>-<i>`,
hostname and label nodeset.slinky.slurm.net/pod-hostname `<nodeset>-<i>`
(the Slurm node name), one per node by required anti-affinity, placed by
kube-scheduler, and recreated when deleted.

Each pod's slurmd starts as the operator's entrypoint starts it: a dynamic
node that is the whole host, with what lies outside the pod's limits held
back from Slurm, `slurmd -Z --conf 'Features=<nodeset> CPUs=<host CPUs>
RealMemory=<host MB> CoreSpecCount=<host CPUs - CPU limit> MemSpecLimit=<host
MB - memory limit>'` (every release from 22.05 takes these keys in --conf:
it is a NodeName line, only NodeName= and, through 23.02, Port= refused).
"""
from __future__ import annotations

import math

from ..policy.quantities import parse_quantity

SLINKY = "slinky"
NAMESPACE = "slurm"
CLUSTER_NAME = "slurm"              # the Slurm cluster's name (slinky.slurm.net/cluster)
NODESET_KEY = "slinky"              # the chart's nodeset key: Feature and hostname prefix
NODESET = f"{CLUSTER_NAME}-worker-{NODESET_KEY}"    # the NodeSet object
HOSTNAME_LABEL = "nodeset.slinky.slurm.net/pod-hostname"
GRACE_SECONDS = 3
# The slurmd container's limits leave this much of the host outside the pod,
# which the entrypoint holds back (CoreSpecCount, MemSpecLimit); its
# requests stay small, so that other pods still fit beside it.
SPARE_CPUS, SPARE_MB = 1, 512
REQUESTS = {"cpu": "100m", "memory": "256Mi"}


def selector_labels() -> dict:
    return {"app.kubernetes.io/name": "slurmd", "app.kubernetes.io/component": "worker",
            "app.kubernetes.io/instance": NODESET, "slinky.slurm.net/cluster": CLUSTER_NAME}


def pod_name(index: int) -> str:
    return f"{NODESET}-{index}"


def slurm_node_name(index: int) -> str:
    return f"{NODESET_KEY}-{index}"


def limits(cpus: int, memory: int) -> tuple[int, int]:
    """(CPUs, MB) of a worker pod's limits on a host of cpus/memory."""
    return max(1, cpus - SPARE_CPUS), max(256, memory - SPARE_MB)


def pod(index: int, cpus: int, memory: int) -> dict:
    """Worker pod `index`, labelled as the NodeSet controller labels it."""
    labels = dict(selector_labels(), **{
        HOSTNAME_LABEL: slurm_node_name(index),
        "nodeset.slinky.slurm.net/pod-name": pod_name(index),
        "nodeset.slinky.slurm.net/pod-index": str(index),
        "nodeset.slinky.slurm.net/scaling-mode": "StatefulSet"})
    cpu, mem = limits(cpus, memory)
    container = {"name": "slurmd", "image": "slurmd:test",
                 "resources": {"requests": dict(REQUESTS),
                               "limits": {"cpu": str(cpu), "memory": f"{mem}Mi"}}}
    spread = {"labelSelector": {"matchLabels": selector_labels()},
              "topologyKey": "kubernetes.io/hostname"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(index), "namespace": NAMESPACE, "labels": labels},
            "spec": {"hostname": slurm_node_name(index), "subdomain": f"{CLUSTER_NAME}-nodes",
                     "terminationGracePeriodSeconds": GRACE_SECONDS,
                     "affinity": {"podAntiAffinity": {
                         "requiredDuringSchedulingIgnoredDuringExecution": [spread]}},
                     "containers": [container]}}


def slurm_node(p: dict) -> str:
    """The worker's Slurm node name: its pod-hostname label."""
    name = (p["metadata"].get("labels") or {}).get(HOSTNAME_LABEL)
    if not name:
        raise ValueError(f"pod {p['metadata']['name']}: no {HOSTNAME_LABEL} label")
    return name


def dynamic_conf(p: dict, node: dict) -> str:
    """slurmd's --conf for worker pod p on Node `node` (API objects), as
    the operator's entrypoint writes it: the whole host (its capacity), less
    what lies outside the pod's limits (whole cores, MB)."""
    total: dict = {}
    for c in p["spec"]["containers"]:
        for k, v in (c.get("resources", {}).get("limits") or {}).items():
            total[k] = total.get(k, 0) + parse_quantity(v)
    capacity = node.get("status", {}).get("capacity") or {}
    if not capacity.get("cpu") or not capacity.get("memory"):
        raise ValueError(f"node {node['metadata']['name']}: no cpu and memory capacity")
    host_cpus = int(parse_quantity(capacity["cpu"]))
    host_mb = int(parse_quantity(capacity["memory"]) // (1 << 20))
    # no limit: the pod may use the whole host, nothing is held back
    cpus = min(host_cpus, math.ceil(total["cpu"])) if total.get("cpu") else host_cpus
    mb = min(host_mb, int(total["memory"] // (1 << 20))) if total.get("memory") else host_mb
    return (f"Features={NODESET_KEY} CPUs={host_cpus} RealMemory={host_mb} "
            f"CoreSpecCount={host_cpus - cpus} MemSpecLimit={host_mb - mb}")


def ensure_pods(core, workers: int, cpus: int, memory: int) -> list[str]:
    """The NodeSet controller's part: create each of the `workers` pods
    missing from the API server (core: a CoreV1Api); the names created."""
    present = {p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items}
    created = []
    for i in range(workers):
        if pod_name(i) not in present:
            core.create_namespaced_pod(NAMESPACE, pod(i, cpus, memory))
            created.append(pod_name(i))
    return created


# The coordinator as a site running the slurm-operator configures it.
COORDINATOR_SETTINGS = f'worker_pods = "{SLINKY}"\nworker_namespace = "{NAMESPACE}"\n'
