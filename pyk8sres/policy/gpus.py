"""Pure rules for GPUs on nodes shared with Slurm (docs/gpus.md): which
Slurm GPU index (the `IDX` of `scontrol -d show job`) each DRA device is,
what a ResourceClaim's allocation asks of the ledger, the holder claims
that show kube-scheduler the devices Slurm's jobs hold, and what the sync
daemon sets in the ledger for allocated claims.  No I/O: the webhook and
the sync daemon read the objects and call the ledger.

Identity is configured, never guessed: a device maps to an index by an
integer attribute (default `index`), by a name pattern (`gpu-(\\d+)`), or by
its UUID attribute looked up in the list of UUIDs the admin gives per Slurm
node (in IDX order).  A node whose devices do not map one to one onto
Slurm's 0..count-1 is fenced: every allocation there is refused and every
device there is held for Slurm, so neither side can be given a GPU whose
identity is unknown.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from . import ledger, usage
from .admission import Allow, Deny

API_VERSION = "resource.k8s.io/v1"
CLAIM_KEY_PREFIX = "claim:"
HOLDER_LABEL = "pyk8sres.io/slurm-gpu-holder"   # value: the Kubernetes node
HOLDER_REQUEST = "slurm"
MODES = ("attribute", "name", "uuid")
LEGACY_RESOURCES = ("nvidia.com/gpu",)
LEGACY_MODES = ("refuse", "whole-node")


@dataclass(frozen=True)
class Identity:
    """How a DRA device of `driver` names its Slurm index."""
    driver: str = "gpu.nvidia.com"
    device_class: str = "gpu.nvidia.com"   # the holder claims' class
    mode: str = "attribute"
    attribute: str = "index"
    pattern: str = r"gpu-(\d+)"
    uuid_attribute: str = "uuid"
    uuids: Mapping[str, Sequence[str]] = field(default_factory=dict)  # Slurm node -> by IDX


def check_identity(ident: Identity) -> None:
    """ValueError for settings that cannot map anything."""
    if ident.mode not in MODES:
        raise ValueError(f"gpu_identity must be one of {', '.join(MODES)}, not {ident.mode!r}")
    if ident.mode == "name":
        try:
            groups = re.compile(ident.pattern).groups
        except re.error as e:
            raise ValueError(f"gpu_name_pattern {ident.pattern!r}: {e}") from None
        if groups != 1:
            raise ValueError(f"gpu_name_pattern {ident.pattern!r} must have exactly one group "
                             "(the index)")
    if ident.mode == "uuid" and not all(
            isinstance(v, (list, tuple)) and all(isinstance(u, str) for u in v)
            for v in ident.uuids.values()):
        raise ValueError("gpu_uuids maps each Slurm node to the list of its GPUs' UUIDs "
                         "in IDX order")


def device_index(device: Mapping, ident: Identity, slurm_node: str) -> int | None:
    """The Slurm index of one ResourceSlice device, or None: it maps to none."""
    attrs = device.get("attributes") or {}
    if ident.mode == "attribute":
        v = (attrs.get(ident.attribute) or {}).get("int")
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    if ident.mode == "name":
        m = re.fullmatch(ident.pattern, str(device.get("name") or ""))
        return int(m.group(1)) if m and m.group(1).isdigit() else None
    u = (attrs.get(ident.uuid_attribute) or {}).get("string")
    known = list(ident.uuids.get(slurm_node) or ())
    return known.index(u) if u and known.count(u) == 1 else None


@dataclass(frozen=True)
class NodeGpus:
    """One Kubernetes node's devices of the driver: (pool, device) -> Slurm
    index, every device published there, and why the node is fenced (None:
    usable)."""
    index: Mapping[tuple[str, str], int]
    devices: tuple[tuple[str, str], ...]
    fence: str | None = None


def _current_slices(slices: Sequence[Mapping], driver: str, node: str) -> list[Mapping]:
    """The node's slices of driver, of each pool's newest generation only
    (older ones are being replaced)."""
    mine = [s for s in slices if (s.get("spec") or {}).get("driver") == driver
            and (s.get("spec") or {}).get("nodeName") == node]
    newest: dict[str, int] = {}
    for s in mine:
        pool = (s["spec"].get("pool") or {})
        newest[pool.get("name")] = max(newest.get(pool.get("name"), 0),
                                       int(pool.get("generation") or 0))
    return [s for s in mine if int((s["spec"].get("pool") or {}).get("generation") or 0)
            == newest[(s["spec"].get("pool") or {}).get("name")]]


def node_gpus(slices: Sequence[Mapping], k8s_node: str, slurm_node: str,
              slurm_count: int | None, ident: Identity,
              slurm_problem: str | None = None) -> NodeGpus:
    """Map a node's devices onto Slurm's indices and verify the mapping:
    every device maps, no index twice, every index below Slurm's gpu count
    and as many devices as Slurm has GPUs.  Anything else, or a problem
    Slurm's side reports (slurm_problem), fences the node."""
    index: dict[tuple[str, str], int] = {}
    devices: list[tuple[str, str]] = []
    problems: list[str] = []
    for s in _current_slices(slices, ident.driver, k8s_node):
        pool = ((s.get("spec") or {}).get("pool") or {}).get("name") or ""
        for d in (s.get("spec") or {}).get("devices") or []:
            key = (pool, str(d.get("name") or ""))
            devices.append(key)
            i = device_index(d, ident, slurm_node)
            if i is None:
                problems.append(f"device {key[1]} (pool {pool}) maps to no Slurm GPU index "
                                f"(gpu_identity {ident.mode})")
            elif i in index.values():
                problems.append(f"device {key[1]} (pool {pool}) maps to index {i}, as another "
                                "device does")
            else:
                index[key] = i
    if not devices:
        return NodeGpus({}, ())
    if slurm_problem:
        problems.append(f"Slurm node {slurm_node}: {slurm_problem}")
    if slurm_count is None:
        problems.append(f"Slurm's gpu count of node {slurm_node} is not known")
    else:
        if len(devices) != slurm_count:
            problems.append(f"{len(devices)} devices published for node {k8s_node}, Slurm node "
                            f"{slurm_node} has {slurm_count} GPUs")
        beyond = sorted(i for i in index.values() if i >= slurm_count)
        if beyond:
            problems.append(f"indices {beyond} are beyond Slurm's {slurm_count} GPUs")
    fence = "; ".join(problems[:3]) if problems else None
    return NodeGpus(index, tuple(devices), fence)


# ----------------------------------------------------------------- claims

def allocation_node(allocation: Mapping) -> str | None:
    """The one node an allocation's nodeSelector names (kube-scheduler
    writes matchFields metadata.name In [node] for a node-local device),
    or None: no node, or more than one."""
    names = set()
    for t in ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []):
        for f in t.get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("operator") == "In":
                names.update(f.get("values") or [])
    return names.pop() if len(names) == 1 else None


def allocated_devices(claim: Mapping, driver: str) -> list[tuple[str, str]]:
    """(pool, device) of each result of driver in the claim's allocation."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    return [(str(r.get("pool") or ""), str(r.get("device") or ""))
            for r in (alloc.get("devices") or {}).get("results") or []
            if r.get("driver") == driver]


def is_holder(claim: Mapping, holder_namespace: str) -> bool:
    meta = claim.get("metadata") or {}
    return meta.get("namespace") == holder_namespace and HOLDER_LABEL in (meta.get("labels") or {})


@dataclass(frozen=True)
class ClaimTarget:
    """A status update that allocates a claim devices of our driver."""
    namespace: str
    name: str
    uid: str
    node: str                 # Kubernetes node ("" when the allocation names none)
    devices: tuple[tuple[str, str], ...]
    dry_run: bool


@dataclass(frozen=True)
class GpuReserve:
    slurm_node: str
    key: str
    gpus: tuple[int, ...]


def classify_claim(request: Mapping, ident: Identity,
                   holder_namespace: str) -> ClaimTarget | Allow | Deny:
    """What a resourceclaims/status UPDATE asks: a new allocation of our
    driver's devices is a ClaimTarget; anything else is allowed."""
    obj, old = request.get("object") or {}, request.get("oldObject") or {}
    alloc = (obj.get("status") or {}).get("allocation")
    if not alloc:
        return Allow("no allocation: nothing to reserve", "not_checked")
    if (old.get("status") or {}).get("allocation"):
        return Allow("allocation unchanged (the API server keeps it immutable)", "not_checked")
    if is_holder(obj, holder_namespace):
        return Allow("the coordinator's holder claim of Slurm's GPUs", "exempt")
    devices = allocated_devices(obj, ident.driver)
    if not devices:
        return Allow(f"no device of driver {ident.driver}", "not_checked")
    meta = obj.get("metadata") or {}
    return ClaimTarget(meta.get("namespace") or request.get("namespace") or "",
                       meta.get("name") or request.get("name") or "", meta.get("uid") or "",
                       allocation_node(alloc) or "", tuple(devices), bool(request.get("dryRun")))


def claim_plan(t: ClaimTarget, slurm_node: str | None, gpus: NodeGpus | None,
               unknown: str | None = None) -> GpuReserve | Allow | Deny:
    """Decide for one allocation.  slurm_node: the Slurm node its Kubernetes
    node is (None: not shared); gpus: that node's mapped devices (None:
    they could not be read); unknown: why sharing cannot be told now."""
    what = f"claim {t.namespace}/{t.name}"
    if not t.node:
        return Deny(f"{what}: its allocation names no single node; GPUs that may be on nodes "
                    "shared with Slurm are only given node by node", "bad_request")
    if slurm_node is None and unknown is None:
        return Allow(f"node {t.node} is not shared with Slurm", "not_shared")
    if slurm_node is None:
        return Deny(f"{what}: {unknown}; failing closed: retry shortly", "workers_unknown")
    if gpus is None:
        return Deny(f"{what}: the GPUs of node {t.node} could not be read; failing closed",
                    "internal")
    if gpus.fence:
        return Deny(f"{what}: the GPUs of node {t.node} are fenced ({gpus.fence}); no GPU "
                    "there is given to a pod until the devices map one to one onto Slurm's",
                    "gpus_fenced")
    missing = [d for d in t.devices if d not in gpus.index]
    if missing:
        return Deny(f"{what}: device {missing[0][1]} of pool {missing[0][0]} is not a GPU "
                    f"published for node {t.node}", "bad_request")
    if not t.uid:
        return Deny(f"{what} has no UID", "bad_request")
    if t.dry_run:
        return Allow("dry run: nothing reserved", "dry_run")
    return GpuReserve(slurm_node, CLAIM_KEY_PREFIX + t.uid,
                      tuple(sorted(gpus.index[d] for d in t.devices)))


def claim_verdict(t: ClaimTarget, r: GpuReserve, reply: Mapping) -> Allow | Deny:
    what = (f"claim {t.namespace}/{t.name} (GPU {','.join(map(str, r.gpus))} of Slurm node "
            f"{r.slurm_node})")
    if reply.get("ok") is True:
        return Allow(f"{what} reserved", "reserved")
    code, err = reply.get("code") or "internal", reply.get("error") or "no reason given"
    if code == "nofit":
        return Deny(f"{what} refused on node {t.node}: {err}; kube-scheduler retries with "
                    "other devices once it sees Slurm's", "nofit")
    if ledger.not_ready(reply):
        return Deny(f"{what} refused on node {t.node}: {ledger.NOT_READY_TEXT} ({err}); "
                    "retry shortly", "ledger_not_ready")
    return Deny(f"{what} refused on node {t.node} ({code}): {err}",
                "ledger_refused" if code in ("unknown_node", "denied", "badrequest")
                else "internal")


# ----------------------------------------------------------------- legacy

def check_legacy_mode(mode: str) -> None:
    if mode not in LEGACY_MODES:
        raise ValueError(f"legacy_gpu must be one of {', '.join(LEGACY_MODES)}, not {mode!r}")


def legacy_requests(pod: Mapping, names: Sequence[str] = LEGACY_RESOURCES) -> list[str]:
    """The legacy device-plugin resources (nvidia.com/gpu) the pod asks for."""
    return usage.extended_requests(pod, names)


def legacy_refusal(namespace: str, pod_name: str, node: str, found: list[str]) -> Deny:
    return Deny(f"pod {namespace}/{pod_name} asks for {', '.join(found)} on node {node}, shared "
                "with Slurm: a device plugin's GPUs are counted, not named, so Slurm's jobs "
                "could be given the same GPU; ask for the GPU with a ResourceClaim (or a "
                "ResourceClaimTemplate) of the GPU DeviceClass instead", "legacy_gpu")


def whole_node_gpus(namespace: str, pod_name: str, node: str, found: list[str],
                    count: int | None) -> tuple[int, ...] | Deny:
    """legacy_gpu = "whole-node": the indices a pod asking for a device
    plugin's GPUs reserves, every GPU of the node (the kubelet may give it
    any of them); count: Slurm's gpu count there (None: Slurm counts none,
    or it is not known)."""
    if not count:
        return Deny(f"pod {namespace}/{pod_name} asks for {', '.join(found)} on node {node}, "
                    "shared with Slurm: such pods are counted as holding every GPU of the "
                    "node, and Slurm counts no GPU there (no gpu GRES, or not known yet); "
                    "ask for the GPU with a ResourceClaim of the GPU DeviceClass instead",
                    "legacy_gpu")
    return tuple(range(count))


def view_gpu_count(view: Mapping | None) -> int | None:
    """Slurm's gpu count of a node from its `show` view: 0 for a node
    slurmctld knows without GPUs, None when the view cannot say."""
    if not isinstance(view, Mapping) or view.get("unknown"):
        return None
    g = view.get("gpus")
    if g is None:
        return 0
    c = g.get("count") if isinstance(g, Mapping) else None
    return c if isinstance(c, int) and not isinstance(c, bool) and c >= 0 else None


def whole_node_entries(entries: Mapping[str, Sequence], view: Mapping | None,
                       previous: Mapping[str, Sequence] | None) -> tuple[dict, bool]:
    """(the entries of one node, every WHOLE_NODE_GPUS put as the node's
    indices; False when one could not be): the sync daemon's `set` holds
    the GPUs of a pod counted whole-node as its reserve did.  view: the
    node's last `show` view; previous: what the last `set` there listed,
    whose indices stand in while the view cannot say the count."""
    whole = [k for k, e in entries.items() if len(e) > 2 and e[2] == usage.WHOLE_NODE_GPUS]
    if not whole:
        return dict(entries), True
    out = dict(entries)
    told = True
    count = view_gpu_count(view)
    for key in whole:
        e = entries[key]
        if count is not None:
            out[key] = (e[0], e[1], list(range(count))) if count else (e[0], e[1])
            continue
        prev = (previous or {}).get(key)
        if prev is not None and len(prev) > 2 and prev[2]:
            out[key] = (e[0], e[1], list(prev[2]))
        else:
            out[key], told = (e[0], e[1]), False
    return out, told


def whole_node_wanted(wanted: Mapping[str, Mapping], views: Mapping[str, Mapping],
                      previous: Mapping[str, Mapping]) -> tuple[dict[str, dict], set[str]]:
    """whole_node_entries of every node (Slurm node -> entries; views: the
    last `show`; previous: the last `set` of each), and the nodes where
    they could not be told."""
    out, blind = {}, set()
    for name, entries in wanted.items():
        out[name], told = whole_node_entries(entries, views.get(name), previous.get(name))
        if not told:
            blind.add(name)
    return out, blind


def pod_indices(entries: Mapping[str, Sequence]) -> tuple[int, ...]:
    """The GPU indices pods' own entries (keyed by pod UID: no claim, no
    slurm: key) hold among one node's ledger entries."""
    return tuple(sorted({i for k, e in entries.items() if ":" not in k and len(e) > 2
                         and isinstance(e[2], (list, tuple)) for i in e[2]}))


# ----------------------------------------------------------------- holders

def holder_name(k8s_node: str, device: str) -> str:
    """slurm-gpu-<node>-<device>, within a name's 253 characters."""
    name = f"slurm-gpu-{k8s_node}-{device}".lower()
    if len(name) <= 253:
        return name
    return name[:236] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def holder_claim(namespace: str, k8s_node: str, pool: str, device: str,
                 ident: Identity) -> tuple[dict, dict]:
    """(the claim to create, the status to write on it): one device,
    allocated on k8s_node, reserved for nobody; kube-scheduler counts it as
    taken like any allocated device."""
    claim = {"apiVersion": API_VERSION, "kind": "ResourceClaim",
             "metadata": {"name": holder_name(k8s_node, device), "namespace": namespace,
                          "labels": {HOLDER_LABEL: k8s_node}},
             "spec": {"devices": {"requests": [
                 {"name": HOLDER_REQUEST,
                  "exactly": {"deviceClassName": ident.device_class, "count": 1}}]}}}
    status = {"allocation": {
        "devices": {"results": [{"request": HOLDER_REQUEST, "driver": ident.driver,
                                 "pool": pool, "device": device}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [k8s_node]}]}]}}}
    return claim, status


def wanted_holders(jobs: Mapping[str, Sequence[int]], shared: Mapping[str, str],
                   nodes: Mapping[str, NodeGpus]) -> dict[str, tuple[str, str, str]]:
    """holder name -> (Kubernetes node, pool, device) for each device Slurm's
    jobs hold on a shared node (jobs: Slurm node -> indices; shared: Slurm
    node -> Kubernetes node) and every device of a fenced node."""
    out = {}
    for snode, knode in shared.items():
        g = nodes.get(knode)
        if g is None:
            continue
        held = set(jobs.get(snode) or ())
        for key in g.devices:
            if g.fence or g.index.get(key) in held:
                out[holder_name(knode, key[1])] = (knode, key[0], key[1])
    return out


def holder_changes(wanted: Mapping[str, tuple[str, str, str]],
                   existing: Mapping[str, Mapping], ident: Identity) -> tuple[list[str], list[str]]:
    """(names to create, names to delete): an existing holder naming
    another device than wanted is deleted and made again."""
    stale = [n for n, c in existing.items()
             if n not in wanted or allocated_devices(c, ident.driver) != [wanted[n][1:]]]
    create = [n for n in wanted if n not in existing or n in stale]
    return sorted(create), sorted(stale)


# ----------------------------------------------------------------- sync

def claim_entries(claims: Sequence[Mapping], nodes: Mapping[str, NodeGpus],
                  shared: Mapping[str, str], ident: Identity,
                  holder_namespace: str) -> tuple[dict[str, dict], list[str]]:
    """(Slurm node -> {claim:<uid>: (0, 0, [indices])}, warnings): each
    allocated claim of our driver's devices on a shared node (shared:
    Kubernetes node -> Slurm node), holders left out.  An allocated claim
    holds its devices for kube-scheduler whatever its pod does, until it is
    deallocated or deleted: so does the ledger."""
    out: dict[str, dict] = {}
    warnings = []
    for c in claims:
        if is_holder(c, holder_namespace):
            continue
        devices = allocated_devices(c, ident.driver)
        alloc = (c.get("status") or {}).get("allocation") or {}
        knode = allocation_node(alloc) if devices else None
        if knode is None or knode not in shared:
            continue
        meta = c.get("metadata") or {}
        g = nodes.get(knode)
        idx = [g.index.get(d) for d in devices] if g is not None else [None]
        if None in idx or not meta.get("uid"):
            warnings.append(f"claim {meta.get('namespace')}/{meta.get('name')} on node {knode} "
                            "holds a device that maps to no Slurm GPU index: not counted")
            continue
        out.setdefault(shared[knode], {})[CLAIM_KEY_PREFIX + meta["uid"]] = (0, 0, sorted(idx))
    return out, warnings


def claim_indices(entries: Mapping[str, Sequence]) -> tuple[int, ...]:
    """The GPU indices the claims' entries of one node's ledger set hold."""
    return tuple(sorted({i for k, e in entries.items() if k.startswith(CLAIM_KEY_PREFIX)
                         and len(e) > 2 for i in e[2]}))


def kubernetes_indices(entries: Mapping[str, Sequence]) -> tuple[int, ...]:
    """The GPU indices the Kubernetes side holds in one node's ledger set:
    the claims' and those of pods counted whole-node."""
    return tuple(sorted({*claim_indices(entries), *pod_indices(entries)}))


def index_ranges(indices: Sequence[int]) -> str:
    """[0, 1, 3] -> "0-1,3" (the notation of Slurm's IDX); none -> "-"."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "-"


def generic_node_gpus(count: int, slurm: Sequence[int],
                      kubernetes: Sequence[int]) -> dict:
    """A GenericNode's status.gpus: the node's GPU count, the indices
    Slurm's jobs hold and those the pods' claims hold, and the one line
    `kubectl get genericnode` prints (its GPU column), e.g.
    "slurm:0-1 k8s:2 free:3"."""
    s, k = sorted(set(slurm)), sorted(set(kubernetes))
    free = sorted(set(range(count)) - set(s) - set(k))
    return {"count": count, "slurm": s, "kubernetes": k,
            "summary": f"slurm:{index_ranges(s)} k8s:{index_ranges(k)} "
                       f"free:{index_ranges(free)}"}


# How often Slurm's side is read while a pod waits for devices Slurm's jobs
# hold: a job's end then reaches the holder claims within this, not within
# a whole resync period (kube-scheduler retries the pod when they go).
WAITING_POLL_SECONDS = 0.2


def poll_period(period: float, claims: Iterable[Mapping], holder_namespace: str,
                ledger_nodes: Mapping[str, Mapping] | None) -> float:
    """The Slurm poller's next wait: WAITING_POLL_SECONDS while a claim
    (not a holder) waits unallocated and Slurm's jobs hold GPUs on some
    node (the ledger's view), else `period`."""
    if not any(_waiting(c, holder_namespace) for c in claims):
        return period
    if not any(((v or {}).get("gpus") or {}).get("jobs") for v in (ledger_nodes or {}).values()):
        return period
    return min(period, WAITING_POLL_SECONDS)


def _waiting(claim: Mapping, holder_namespace: str) -> bool:
    return not (claim.get("status") or {}).get("allocation") and \
        not is_holder(claim, holder_namespace)
