"""Slurm's worker pods (containerized slurmd): which pods they are, which
Slurm node each one is, and the Kubernetes node -> Slurm node mapping they
give, with the conflicts that map nothing.

Sites that run Slurm inside Kubernetes (SchedMD's Slinky slurm-operator,
ACK's SlurmCluster) have a Slurm node per worker pod: the Kubernetes node
is the pod's spec.nodeName, the Slurm node its name as the operator sets it.
Only pods in the namespace the admin names are workers: labels and pod
names are written by whoever creates the pod, so outside a namespace the
admin owns they would let anyone exempt a pod or move a mapping.

Pure: pods are dicts in the API server's JSON shape; nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

SLINKY, ACK, CUSTOM = "slinky", "ack", "custom"
KINDS = (SLINKY, ACK, CUSTOM)
POD_NAME, HOSTNAME, LABEL = "pod-name", "hostname", "label:"
SLINKY_HOSTNAME_LABEL = "nodeset.slinky.slurm.net/pod-hostname"
SLINKY_LABELS = (("app.kubernetes.io/name", "slurmd"), ("app.kubernetes.io/component", "worker"))
# ACK's StatefulSet pods: <cluster>-worker-<group>-<index>, the pod name is
# the Slurm node name.
ACK_NAME = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?-worker-[a-z0-9]([-a-z0-9.]*[a-z0-9])?-[0-9]+"


@dataclass(frozen=True)
class Selector:
    """Which pods are Slurm workers, and where each one's Slurm node name is.

    namespace: the only namespace workers are taken from.
    labels: (key, value) pairs a worker carries, all of them.
    name_pattern: a regular expression the whole pod name matches (None: any).
    name_from: where the Slurm node name is, first usable one wins:
      "label:<key>", "hostname" (spec.hostname) or "pod-name".
    """
    kind: str
    namespace: str
    labels: tuple = ()
    name_pattern: str | None = None
    name_from: tuple = (POD_NAME,)


def _source(s) -> str:
    if not isinstance(s, str) or not (s in (POD_NAME, HOSTNAME) or
                                      (s.startswith(LABEL) and s[len(LABEL):])):
        raise ValueError(f"worker_node_name {s!r}: want 'pod-name', 'hostname' or "
                         "'label:<label key>'")
    return s


def selector(kind: str, namespace: str = "", labels: Mapping | None = None,
             node_name: str = "") -> Selector | None:
    """The Selector the settings describe (None: worker_pods is off), or
    ValueError naming the setting refused.  Presets: slinky (the operator's
    labels; the pod-hostname label, else spec.hostname, else the pod name),
    ack (pods named <cluster>-worker-<group>-<index>; the pod name).  Extra
    labels narrow a preset (e.g. slinky.slurm.net/cluster); node_name
    replaces its name source."""
    labels = dict(labels or {})
    if not kind:
        if namespace or labels or node_name:
            raise ValueError("worker_namespace, worker_labels and worker_node_name need "
                             f"worker_pods ({', '.join(KINDS)})")
        return None
    if kind not in KINDS:
        raise ValueError(f"worker_pods {kind!r}: want one of {', '.join(KINDS)}, or '' (off)")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"worker_pods = {kind!r} needs worker_namespace: labels and pod names "
                         "are set by whoever creates a pod, so workers are only taken from "
                         "the namespace the admin runs Slurm in")
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()):
        raise ValueError("worker_labels maps label keys to values (strings)")
    src = (_source(node_name),) if node_name else None
    if kind == SLINKY:
        return Selector(kind, namespace, SLINKY_LABELS + tuple(sorted(labels.items())), None,
                        src or (LABEL + SLINKY_HOSTNAME_LABEL, HOSTNAME, POD_NAME))
    if kind == ACK:
        return Selector(kind, namespace, tuple(sorted(labels.items())), ACK_NAME,
                        src or (POD_NAME,))
    if not labels or not src:
        raise ValueError("worker_pods = 'custom' needs worker_labels (the workers' labels) and "
                         "worker_node_name ('pod-name', 'hostname' or 'label:<key>')")
    return Selector(kind, namespace, tuple(sorted(labels.items())), None, src)


def is_worker(pod: Mapping, sel: Selector | None) -> bool:
    """Whether the pod is one of Slurm's workers (whatever its phase)."""
    if sel is None:
        return False
    meta = pod.get("metadata") or {}
    if meta.get("namespace") != sel.namespace:
        return False
    have = meta.get("labels") or {}
    if any(have.get(k) != v for k, v in sel.labels):
        return False
    name = meta.get("name") or ""
    return sel.name_pattern is None or re.fullmatch(sel.name_pattern, name) is not None


@dataclass(frozen=True)
class WorkerPod:
    """A bound, running worker pod, kept compact: its key (namespace/name),
    its Kubernetes node, its Slurm node name (None: none usable), and
    whether it is being deleted (its slurmd is going: leaving)."""
    key: str
    k8s_node: str
    slurm_node: str | None
    leaving: bool = False


def slurm_name(pod: Mapping, sel: Selector) -> str | None:
    """The worker's Slurm node name from sel.name_from, first usable one."""
    meta = pod.get("metadata") or {}
    for src in sel.name_from:
        if src == POD_NAME:
            v = meta.get("name")
        elif src == HOSTNAME:
            v = (pod.get("spec") or {}).get("hostname")
        else:
            v = (meta.get("labels") or {}).get(src[len(LABEL):])
        if isinstance(v, str) and v.strip():
            return v.strip()
    return None


def worker_pod(pod: Mapping, sel: Selector | None) -> WorkerPod | None:
    """The WorkerPod of a worker bound to a node and not terminal; None for
    any other pod."""
    node = (pod.get("spec") or {}).get("nodeName")
    if not node or not is_worker(pod, sel):
        return None
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    meta = pod.get("metadata") or {}
    return WorkerPod(f"{meta.get('namespace')}/{meta.get('name')}", node, slurm_name(pod, sel),
                     bool(meta.get("deletionTimestamp")))


def unplaced(known: Iterable[str], pods: Iterable[WorkerPod], mapping: Mapping[str, str | None],
             slurm_names, trusted: bool = True) -> tuple[frozenset, frozenset]:
    """(the Slurm nodes known as workers', those of them no running worker
    holds now).  A worker's Slurm node is known once a worker pod maps its
    Kubernetes node to it (mapping: this cycle's), and forgotten when Slurm
    no longer has it.  Such a node with no worker mapped there, or only one
    being deleted, is between pods: its slurmd is gone or going, and the
    next one may register on a Kubernetes node whose pods are not counted
    yet (a worker rescheduled).  The sync daemon holds it whole until a
    running worker maps it again and that node's pods are counted.

    A worker that maps nothing (refused: two workers on one node, one name
    on two nodes) makes its Slurm node known too, unless something else
    maps that node: its slurmd runs beside pods no one counts there.

    Level-triggered: a worker's pod absent from a list is between pods
    whether or not its deletion was seen.  While the pods are not trusted
    (trusted False: not listed, a watch broken or silent) any worker may be
    between pods unseen, so every known node is; a trusted list showing a
    running worker mapped there places it again."""
    pods = list(pods)
    mapped = [p for p in pods if p.slurm_node and mapping.get(p.k8s_node) == p.slurm_node]
    names = frozenset(slurm_names)
    elsewhere = set(mapping.values())
    refused = {p.slurm_node for p in pods if p.slurm_node and p.slurm_node not in elsewhere}
    now = (frozenset(known) | {p.slurm_node for p in mapped} | refused) & names
    held = {p.slurm_node for p in mapped if not p.leaving} if trusted else set()
    return now, frozenset(now - held)


def merge(base: Mapping[str, str | None], pods: Iterable[WorkerPod], k8s_nodes,
          slurm_names, settled=(), before: Mapping[str, str | None] | None = None
          ) -> tuple[dict[str, str | None], list[str]]:
    """(Kubernetes node -> Slurm node, warnings): `base` (node_map, the
    admin's label, the same name) with the workers' mappings added where
    base maps nothing.  base wins where both say something, and on the
    `settled` nodes (node_map or the label name a Slurm node for them) even
    where that name maps nothing: the admin said which node it is.

    A worker maps nothing new, with a warning, when it has no usable name,
    names a Slurm node Slurm does not have, runs on a node with no Node
    object (k8s_nodes), shares its node with a worker naming another Slurm
    node, names the same Slurm node as a worker on another node (all of
    them refused), or names a Slurm node base maps to another node.  A node
    whose workers conflict keeps what it had (`before`: the last mapping),
    so its pods, those still to come included, go on counting there."""
    claims, bad, warnings = _claims(pods)
    out = dict(base)
    owners: dict[str, list[str]] = {}
    for k, s in base.items():
        if s is not None:
            owners.setdefault(s, []).append(k)
    for k, named in sorted(claims.items()):
        if k in bad:
            continue
        (s, keys), = named.items()
        where = f"worker pod {', '.join(keys)} on kubernetes node {k} names Slurm node {s}"
        others = sorted(o for o in owners.get(s, ()) if o != k)
        if k not in k8s_nodes:
            warnings.append(f"{where}, but there is no Node {k}: not mapped")
        elif s not in slurm_names:
            warnings.append(f"{where}, which Slurm does not have: not mapped")
        elif others:
            warnings.append(f"{where}, already mapped to kubernetes node {', '.join(others)} "
                            "(node_map, node label or same name): not mapped")
        elif base.get(k) not in (None, s) or (k in settled and base.get(k) is None):
            warnings.append(f"{where}, but node_map, its node label or its name maps it to "
                            + (f"Slurm node {base[k]}" if base.get(k) else
                               "a Slurm node Slurm does not have") + ": that is kept")
        else:
            out[k] = s
    _keep_conflicted(out, bad, before or {}, slurm_names, settled)
    return out, warnings


def _claims(pods: Iterable[WorkerPod]) -> tuple[dict, set[str], list[str]]:
    """(Kubernetes node -> Slurm node -> the pods naming it, the nodes whose
    workers conflict, warnings)."""
    warnings: list[str] = []
    claims: dict[str, dict[str, list[str]]] = {}
    bad: set[str] = set()
    for p in sorted(pods, key=lambda p: p.key):
        if p.slurm_node is None:
            warnings.append(f"worker pod {p.key} on kubernetes node {p.k8s_node}: no Slurm "
                            "node name (worker_node_name); the node maps nothing new")
            bad.add(p.k8s_node)
        else:
            claims.setdefault(p.k8s_node, {}).setdefault(p.slurm_node, []).append(p.key)
    holders: dict[str, list[str]] = {}
    for k, named in sorted(claims.items()):
        if len(named) > 1:
            warnings.append(f"kubernetes node {k}: worker pods name different Slurm nodes ("
                            + "; ".join(f"{s}: {', '.join(ps)}" for s, ps in sorted(named.items()))
                            + "); the node maps nothing new")
            bad.add(k)
        for s in named:
            holders.setdefault(s, []).append(k)
    for s, ks in sorted(holders.items()):
        if len(ks) > 1:
            warnings.append(f"Slurm node {s} is named by worker pods on several kubernetes nodes "
                            f"({', '.join(sorted(ks))}); none of them newly maps to it")
            bad.update(ks)
    return claims, bad, warnings


def _keep_conflicted(out: dict, bad: set[str], before: Mapping[str, str | None],
                     slurm_names, settled) -> None:
    """A node whose workers conflict keeps the Slurm node it was mapped to,
    where nothing else maps it (the admin's settings first) and no other
    node has that Slurm node now."""
    taken = {s for s in out.values() if s}
    for k in sorted(bad):
        s = before.get(k)
        if (s and s in slurm_names and s not in taken and k in out and out[k] is None
                and k not in settled):
            out[k] = s
            taken.add(s)
