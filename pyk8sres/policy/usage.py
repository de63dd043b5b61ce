"""Pure policy for the sync daemon: what each pod holds on its node, who is
exempt, node mapping, the Slurm counts we want, and the GenericNode status
we show.  Quantities and a pod's requests are quantities.py's.

Nothing here does I/O.  Pods and nodes are plain dicts in the Kubernetes JSON
shape (camelCase keys, as the API server sends them), Slurm nodes are any
object with the fields of ``pyk8sres.coordinator.slurm.SlurmNode``.  Keeping it pure makes
every rule testable with a table and keeps the daemon (sync.py) thin.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Mapping

from . import departures
from .backstop import BEYOND_KEY
from . import workers as worker_pods
from .quantities import (MI, NANO, QuantityError, format_cpu, format_memory, held_requests,
                         parse_quantity)

CPU_GRES = "k8scpu"
MEM_GRES = "k8smemory"


# --------------------------------------------------------------------------
# What a pod holds
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class PodUsage:
    """What one pod holds on its node, or why we cannot tell.

    cpu in nanocores, memory in bytes, both ints rounded up from the exact
    value (Kubernetes itself keeps quantities at nano precision); ints keep
    summing every pod each cycle cheap.  ``error`` set means the pod has
    data we could not read: its node must be treated as unknown.
    """
    node: str
    cpu: int = 0
    memory: int = 0
    error: str | None = None
    uid: str = ""          # the pod's UID: its key in the ledger
    # For when it leaves (policy/departures.py): its terminationGracePeriodSeconds,
    # and its deletionTimestamp (seconds since the epoch) once Terminating.
    grace: float = departures.DEFAULT_GRACE
    kill_by: float | None = None
    # It asks for a device plugin's GPUs (nvidia.com/gpu) where the admin
    # counts those whole-node (legacy_gpu = "whole-node"): it holds every
    # GPU of its node.
    whole_gpus: bool = False


# In a pod's entry, for every GPU index of its node: the sync daemon puts
# the node's indices in its place (policy/gpus.whole_node_entries) once
# it knows how many GPUs Slurm counts there.
WHOLE_NODE_GPUS = "whole-node"


def ledger_entry(pu: PodUsage) -> tuple[int, int]:
    """(millicores, bytes) of a pod as the ledger counts it (rounded up)."""
    return -(-pu.cpu // 1_000_000), pu.memory


def pod_entry(pu: PodUsage) -> tuple:
    """The pod's entry as the sync daemon gathers it: ledger_entry, and
    WHOLE_NODE_GPUS after it for a pod that holds every GPU of its node."""
    return ledger_entry(pu) + ((WHOLE_NODE_GPUS,) if pu.whole_gpus else ())


def extended_requests(pod: Mapping, names) -> list[str]:
    """Which of the resource `names` (e.g. nvidia.com/gpu) any container or
    init container of the pod requests or limits, sorted."""
    spec = pod.get("spec") or {}
    found = set()
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            found.update(n for n in (res.get(part) or {}) if n in names)
    return sorted(found)


# --------------------------------------------------------------------------
# Who is exempt: only what the admin names
# --------------------------------------------------------------------------

# Kubelets may not set labels under this prefix on their own Node (upstream's
# NodeRestriction admission plugin): only the admin can, so node mapping
# and opt-in labels must live under it.
ADMIN_LABEL_PREFIX = "node-restriction.kubernetes.io/"
NODE_LABEL = ADMIN_LABEL_PREFIX + "pyk8sres-slurm-node"
PLACEHOLDER_PREFIX = "slurm-share-"   # placeholder pod name: slurm-share-<k8s node>


def check_node_label(key: str) -> str:
    """key, if only an admin may set it on a Node; else ValueError.

    Annotations and ordinary labels are writable by the node's own kubelet,
    which could then point a node at another Slurm node.
    """
    prefix, _, name = key.partition("/")
    domain = ADMIN_LABEL_PREFIX.rstrip("/")
    if not name or not (prefix == domain or prefix.endswith("." + domain)):
        raise ValueError(f"node label {key!r} is not admin-only: use a key under "
                         f"{ADMIN_LABEL_PREFIX} (kubelets cannot set those), e.g. {NODE_LABEL}")
    return key


@dataclass(frozen=True)
class Exemptions:
    """Pods that hold nothing in the ledger: Slurm's own workers (containerized
    slurmd: they ARE Slurm's capacity) and our placeholder pods (they show
    Slurm's jobs to kube-scheduler).  Only the admin's configuration says who;
    nothing a pod creator writes (labels, annotations, names) counts, except a
    name inside a namespace the admin owns.

    worker_namespaces: every pod in these namespaces is a Slurm worker.
    worker_service_accounts: (namespace, service account) pairs.  Any pod
      creator in that namespace may name that service account, so this is as
      strong as who may create pods there.
    placeholder_namespace: where the coordinator keeps slurm-share-<node> pods.
    workers: the worker pods of a Slurm run inside Kubernetes (policy/workers.py:
      only in the namespace the admin names); None: none.
    """
    worker_namespaces: frozenset = frozenset()
    worker_service_accounts: frozenset = frozenset()
    placeholder_namespace: str | None = None
    workers: worker_pods.Selector | None = None


def exemptions(workers=(), placeholder_namespace: str | None = None,
               selector: worker_pods.Selector | None = None) -> Exemptions:
    """From config entries "namespace" or "namespace/serviceaccount", and
    the worker pods' selector (worker_pods.selector)."""
    ns, sas = set(), set()
    for w in workers:
        if not isinstance(w, str) or not w.strip("/") or w.count("/") > 1:
            raise ValueError(f"slurm worker entry {w!r}: want 'namespace' or 'namespace/serviceaccount'")
        if "/" in w:
            n, sa = w.split("/")
            if not n or not sa:
                raise ValueError(f"slurm worker entry {w!r}: empty namespace or service account")
            sas.add((n, sa))
        else:
            ns.add(w)
    return Exemptions(frozenset(ns), frozenset(sas), placeholder_namespace or None, selector)


def exempt_reason(pod: Mapping, ex: Exemptions) -> str | None:
    """Why the pod holds nothing in the ledger, or None (it counts)."""
    meta = pod.get("metadata") or {}
    ns = meta.get("namespace") or ""
    if ns and ns in ex.worker_namespaces:
        return f"Slurm worker pod (namespace {ns} is configured as Slurm's)"
    sa = (pod.get("spec") or {}).get("serviceAccountName") or "default"
    if (ns, sa) in ex.worker_service_accounts:
        return f"Slurm worker pod (service account {ns}/{sa} is configured as Slurm's)"
    if worker_pods.is_worker(pod, ex.workers):
        return f"Slurm worker pod ({ex.workers.kind}, namespace {ns}): it is a Slurm node"
    if ex.placeholder_namespace and ns == ex.placeholder_namespace and (
            meta.get("name") or "").startswith(PLACEHOLDER_PREFIX):
        return "placeholder pod showing Slurm's jobs to kube-scheduler"
    return None


def pod_usage(pod: Mapping, exempt: Exemptions = Exemptions(),
              whole_gpus: Iterable[str] = ()) -> PodUsage | None:
    """The usage a pod adds to its node, or None if it holds nothing.

    Unbound, terminal (Succeeded/Failed) and exempt pods (exempt_reason: only
    what the admin configured) hold nothing; any other pod holds
    held_requests (its spec, or more while its kubelet runs it larger),
    and every GPU of its node if it asks for one of the resources
    `whole_gpus` (the legacy device plugin's, counted whole-node).
    """
    spec = pod.get("spec") or {}
    node = spec.get("nodeName")
    if not node:
        return None
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    if exempt_reason(pod, exempt):
        return None
    meta = pod.get("metadata") or {}
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    leaving = {"grace": departures.grace_of(pod), "kill_by": departures.kill_by(pod)}
    try:
        req = held_requests(pod)
    except (QuantityError, AttributeError, TypeError, ValueError) as e:
        return PodUsage(node=node, uid=uid, error=(
            f"pod {meta.get('namespace')}/{meta.get('name')}: {e}"), **leaving)
    return PodUsage(node=node, cpu=math.ceil(req["cpu"] * NANO), memory=math.ceil(req["memory"]),
                    uid=uid, whole_gpus=bool(whole_gpus and extended_requests(pod, whole_gpus)),
                    **leaving)


# --------------------------------------------------------------------------
# Node mapping
# --------------------------------------------------------------------------

def slurm_node_for(k8s_node: Mapping, key: str, slurm_names: set[str] | frozenset,
                   map_by_name: bool = True, node_map: Mapping[str, str] | None = None) -> str | None:
    """Slurm node a Kubernetes node is, or None.

    In order: the admin's node_map (configuration), the admin-only label
    ``key`` (see check_node_label; annotations are never read: the node's
    kubelet can write them), then the same name if that Slurm node exists.
    An explicit name Slurm does not know maps to nothing.
    """
    meta = k8s_node.get("metadata") or {}
    name = meta.get("name")
    explicit = (node_map or {}).get(name) or (meta.get("labels") or {}).get(key)
    if explicit:
        return explicit if explicit in slurm_names else None
    if map_by_name and name in slurm_names:
        return name
    return None


def named_by_admin(k8s_nodes: Mapping[str, Mapping], key: str,
                   node_map: Mapping[str, str] | None) -> set[str]:
    """The Kubernetes nodes node_map or the label `key` name a Slurm node for."""
    return {k for k, n in k8s_nodes.items() if k in (node_map or {})
            or key in ((n.get("metadata") or {}).get("labels") or {})}


def slim_node(obj: Mapping, key: str, offered: bool = False, state: bool = False) -> dict:
    """What a node cache keeps of a Kubernetes Node: its name and the mapping
    label ``key`` (what slurm_node_for reads); with offered, also its
    allocatable (else capacity) cpu and memory, what placeholders cap at;
    with state, whether it is Ready (departures.node_state: how long the
    shares of pods that left it are held)."""
    m = obj.get("metadata") or {}
    slim: dict = {"metadata": {"name": m.get("name")}}
    if state and (st := departures.node_state(obj)) != departures.READY:
        slim["state"] = st
    label = (m.get("labels") or {}).get(key)
    if label is not None:
        slim["metadata"]["labels"] = {key: label}
    st = obj.get("status") or {}
    resources = (st.get("allocatable") or st.get("capacity")) if offered else None
    if resources:
        slim["status"] = {"allocatable": {k: resources[k] for k in ("cpu", "memory")
                                          if k in resources}}
    return slim


# --------------------------------------------------------------------------
# Desired Slurm counts
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeUsage:
    """Sum of Kubernetes requests on one Slurm node (nanocores, bytes)."""
    cpu: int = 0
    memory: int = 0
    errors: tuple[str, ...] = ()


def usage_by_k8s_node(pods: Iterable[PodUsage]) -> dict[str, NodeUsage]:
    """Sum pod usage per Kubernetes node (the daemon's cache keeps these
    sums incrementally; this is the same rule for a whole list)."""
    cpu: dict[str, int] = {}
    mem: dict[str, int] = {}
    errs: dict[str, list[str]] = {}
    for p in pods:
        cpu[p.node] = cpu.get(p.node, 0) + p.cpu
        mem[p.node] = mem.get(p.node, 0) + p.memory
        if p.error:
            errs.setdefault(p.node, []).append(p.error)
    return {n: NodeUsage(cpu[n], mem[n], tuple(errs.get(n, ()))) for n in cpu}


def usage_by_slurm_node(k8s_usage: Mapping[str, NodeUsage],
                        k8s_to_slurm: Mapping[str, str | None],
                        slurm_names, map_by_name: bool = True) -> dict[str, NodeUsage]:
    """Kubernetes usage per Slurm node.

    Pods on a Kubernetes node we have no object for fall back to the
    same-name rule: better to count them than to forget them.  Two
    Kubernetes nodes naming the same Slurm node add up (conservative).
    """
    out: dict[str, NodeUsage] = {}
    for k, u in k8s_usage.items():
        if k in k8s_to_slurm:
            s = k8s_to_slurm[k]
        else:
            s = k if (map_by_name and k in slurm_names) else None
        if s is None:
            continue
        prev = out.get(s)
        out[s] = u if prev is None else NodeUsage(
            prev.cpu + u.cpu, prev.memory + u.memory, prev.errors + u.errors)
    return out


def slurm_node_of(k8s_name: str, mapping: Mapping[str, str | None], slurm_names,
                  map_by_name: bool = True) -> str | None:
    """Where the pods of one Kubernetes node count (usage_by_slurm_node's rule)."""
    if k8s_name in mapping:
        return mapping[k8s_name]
    return k8s_name if (map_by_name and k8s_name in slurm_names) else None


def mapped_here(mapping: Mapping[str, str | None]) -> dict[str, tuple[str, ...]]:
    """Slurm node -> the Kubernetes nodes mapped to it (mapping reversed)."""
    out: dict[str, list[str]] = {}
    for k, s in mapping.items():
        if s is not None:
            out.setdefault(s, []).append(k)
    return {s: tuple(ks) for s, ks in out.items()}


def counting_on(slurm_nodes: Iterable[str], mapping: Mapping[str, str | None],
                here: Mapping[str, tuple[str, ...]]) -> set[str]:
    """The Kubernetes nodes whose pods count on these Slurm nodes: those
    mapped there (here: mapped_here(mapping)), and a node we have no object
    for of the same name.  O(these nodes), not O(cluster)."""
    wanted = set(slurm_nodes)
    return {k for s in wanted for k in here.get(s, ())} | {s for s in wanted if s not in mapping}


def refreshed_usage(usage: Mapping[str, NodeUsage], part: Mapping[str, NodeUsage],
                    touched: Iterable[str], mapping: Mapping[str, str | None], slurm_names,
                    map_by_name: bool = True) -> dict[str, NodeUsage]:
    """usage_by_slurm_node with only the `touched` Slurm nodes recomputed,
    from `part`: the usage of the Kubernetes nodes counting_on() them.
    Equal to the full computation when nothing else changed (tested so)."""
    touched = set(touched)
    out = dict(usage)       # a copy: the last decision may still be read elsewhere
    for s in touched:
        out.pop(s, None)
    fresh = usage_by_slurm_node(part, {k: mapping[k] for k in part if k in mapping},
                                slurm_names, map_by_name)
    out.update((s, u) for s, u in fresh.items() if s in touched)
    return out


def generic_node_body(k8s_name: str, slurm_node, usage: NodeUsage | None,
                      cluster_name: str, oversubscribed: bool = False,
                      held: tuple[int, int] = (0, 0),
                      completing: tuple[int, int] = (0, 0),
                      gpus: Mapping | None = None,
                      beyond: tuple[int, int] = (0, 0)) -> tuple[dict, dict]:
    """(spec, status) of the GenericNode for one shared node.

    Slurm side: CPUs and memory Slurm jobs hold, with those of jobs still
    completing (completing: CPUs, MB; Slurm's own CPUAlloc drops them while
    their processes may run); Kubernetes side: exact pod requests, with the
    shares held for pods gone from the API server whose containers may
    still run (held: millicores, bytes), formatted like the reference
    ("2735m", "3417Mi").  The Oversubscribed condition says when pods hold
    more than Slurm's jobs leave (the ledger then carries only what fits;
    no new job starts there).  gpus: the status.gpus of a node with GPUs
    (policy/gpus.generic_node_gpus; None: none).  Capacity: what both
    share, the k8scpu/k8smemory totals less what is held beyond the
    Kubernetes node's allocatable (beyond: millicores, bytes), which is
    neither side's: no job or pod uses it.
    """
    usage = usage or NodeUsage()
    cpus, mb = shared_capacity(slurm_node)
    spec = {"clusterName": cluster_name, "alias": slurm_node.name, "type": "Slurm"}
    status = {
        "allocatedResources": [
            {"type": "Slurm", "allocated": {
                "cpu": format_cpu(Fraction(slurm_node.alloc_cpus + completing[0])),
                "memory": format_memory(Fraction(slurm_node.alloc_memory + completing[1]) * MI)}},
            {"type": "Kubernetes", "allocated": {
                "cpu": format_cpu(Fraction(usage.cpu, NANO) + Fraction(held[0], 1000)),
                "memory": format_memory(Fraction(usage.memory + held[1]))}},
        ],
        "capacity": {"cpu": format_cpu(Fraction(cpus) - Fraction(beyond[0], 1000)),
                     "memory": format_memory(Fraction(mb) * MI - beyond[1])},
        "conditions": [{
            "type": "Oversubscribed", "status": "True" if oversubscribed else "False",
            "reason": "PodsBeyondWhatSlurmLeaves" if oversubscribed else "WithinCapacity",
            "message": ("pods bound here hold more than Slurm's jobs leave (bound without "
                        "admission, or static pods): no new Slurm job starts here until "
                        "they leave" if oversubscribed else
                        "Slurm jobs and pods fit the node")}],
    }
    if gpus is not None:
        status["gpus"] = dict(gpus)
    return spec, status


def shared_capacity(slurm_node) -> tuple[int, int]:
    """(CPUs, MB) the node offers to both schedulers: its k8scpu/k8smemory
    totals, which node_features set to what Slurm schedules there (CPUs less
    specialized ones, RealMemory less MemSpecLimit, less the admin's
    reserve); a node without them yet, its CPUs and RealMemory."""
    gres = slurm_node.gres or {}
    if CPU_GRES in gres and MEM_GRES in gres:
        return int(gres[CPU_GRES]), int(gres[MEM_GRES])
    return slurm_node.cpus, slurm_node.real_memory


def over_allocatable(k8s_name: str, k8s_node: Mapping, slurm_node) -> str | None:
    """What is wrong when the Slurm node shares more than its Kubernetes
    node's allocatable (None: nothing, or no allocatable known).  Kubernetes
    never places pods beyond allocatable, but Slurm's jobs may use all the
    Slurm node offers: the sync daemon holds the difference in the ledger
    (backstop.beyond), so that jobs and pods together stay within it."""
    alloc = ((k8s_node.get("status") or {}).get("allocatable")) or {}
    if slurm_node is None or not (alloc.get("cpu") or alloc.get("memory")):
        return None
    cpus, mb = shared_capacity(slurm_node)
    over = []
    try:
        if alloc.get("cpu") and cpus > parse_quantity(alloc["cpu"]):
            over.append(f"{cpus} CPUs > allocatable cpu {alloc['cpu']}")
        if alloc.get("memory") and mb * MI > parse_quantity(alloc["memory"]):
            over.append(f"{mb} MB > allocatable memory {alloc['memory']}")
    except QuantityError:
        return None
    if not over:
        return None
    return (f"Slurm node {slurm_node.name} shares more than kubernetes node {k8s_name} offers "
            f"pods ({'; '.join(over)}): the difference is held in the ledger (entry "
            f"{BEYOND_KEY}), so that Slurm's jobs and the pods together stay within "
            "allocatable; to give Slurm's own view the same size, lower the worker pod's "
            "limits (Slinky holds the rest back as CoreSpecCount/MemSpecLimit) or set "
            "ReserveCPUs/ReserveMemory in k8s_resources.conf")


@dataclass
class Desired:
    """Everything one reconcile decides, computed from a snapshot (pure)."""
    usage: dict[str, NodeUsage]             # Slurm node -> Kubernetes requests
    k8s_to_slurm: dict[str, str]            # mapped Kubernetes node -> Slurm node
    warnings: list[str]
    mapping: dict = dataclasses.field(default_factory=dict)  # every Kubernetes node -> Slurm node or None
    here: dict = dataclasses.field(default_factory=dict)     # mapped_here(mapping)
    # mapped Kubernetes node -> why its Slurm node shares more than its allocatable
    over_allocatable: dict = dataclasses.field(default_factory=dict)


def desired_state(k8s_usage: Mapping[str, NodeUsage], k8s_nodes: Mapping[str, Mapping], slurm_nodes,
                  *, key: str = NODE_LABEL, map_by_name: bool = True,
                  node_map: Mapping[str, str] | None = None,
                  workers: Iterable[worker_pods.WorkerPod] | None = None,
                  before: Mapping[str, str | None] | None = None) -> Desired:
    """desired = f(cache, slurm_nodes, config): which Kubernetes node is
    which Slurm node, and what Kubernetes holds on each Slurm node (the
    ledger entries themselves come from the cache's per-node pods).
    workers: the worker pods seen (None: worker_pods is off); they map the
    nodes the settings leave unmapped (worker_pods.merge; before: the last
    decision's mapping, what a node whose workers conflict keeps)."""
    slurm_names = frozenset(n.name for n in slurm_nodes)
    mapping = {k: slurm_node_for(n, key, slurm_names, map_by_name, node_map)
               for k, n in k8s_nodes.items()}
    warnings: list[str] = []
    if workers is not None:
        mapping, warnings = worker_pods.merge(mapping, workers, k8s_nodes, slurm_names,
                                              named_by_admin(k8s_nodes, key, node_map), before)
    usage = usage_by_slurm_node(k8s_usage, mapping, slurm_names, map_by_name)
    by_name = {n.name: n for n in slurm_nodes}
    for name in sorted({s for s in mapping.values() if s} | set(usage)):
        node = by_name.get(name)
        if node is None:
            continue
        has = set(node.gres or {}) | set(node.reported_gres or {})
        if CPU_GRES not in has or MEM_GRES not in has:
            warnings.append(f"node {name}: no {CPU_GRES}/{MEM_GRES} GRES, not shared")
        elif usage.get(name) and usage[name].errors:
            warnings.append(f"node {name}: its share only grows until these pods can be read: "
                            + "; ".join(usage[name].errors))
    over = {k: m for k, s in mapping.items()
            if s and (m := over_allocatable(k, k8s_nodes[k], by_name.get(s)))}
    warnings.extend(over[k] for k in sorted(over))
    for k, s in mapping.items():
        if s is None and (k in (node_map or {})
                          or key in ((k8s_nodes[k].get("metadata") or {}).get("labels") or {})):
            warnings.append(f"kubernetes node {k}: {key} (or node_map) names no Slurm node")
    return Desired(usage, {k: s for k, s in mapping.items() if s}, warnings, mapping,
                   mapped_here(mapping), over)
