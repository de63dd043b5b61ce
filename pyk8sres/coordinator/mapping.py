"""Kubernetes node <-> Slurm node, as the admin's settings say (SyncConfig:
node_map, else the node_key label, else the same name with map_by_name;
then, with worker_pods, the node each Slurm worker pod runs on).

The rules themselves are pure (policy/usage.py); this module applies them
with the coordinator's settings, so that the sync daemon, the webhook's
scope and `pyk8sres status` map every node the same way.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from .config import SyncConfig, exemptions_of
from ..policy import usage
from ..policy import workers


def slurm_node(cfg: SyncConfig, k8s_node: Mapping, slurm_names) -> str | None:
    """The Slurm node a (slim) Kubernetes node object is shared as; None:
    not shared (no mapping, or a name Slurm does not have)."""
    return usage.slurm_node_for(k8s_node, cfg.node_key, slurm_names, cfg.map_by_name,
                                cfg.node_map)


def slurm_nodes(cfg: SyncConfig, k8s_nodes: Mapping[str, Mapping],
                slurm_names) -> dict[str, str | None]:
    """Kubernetes node name -> the Slurm node it is shared as (None: not
    shared), for every node in `k8s_nodes` (name -> node object)."""
    return {k: slurm_node(cfg, n, slurm_names) for k, n in k8s_nodes.items()}


def with_workers(cfg: SyncConfig, mapped: Mapping[str, str | None], k8s_nodes,
                 slurm_names, pods: Iterable[Mapping]) -> dict[str, str | None]:
    """`mapped` (slurm_nodes') with the worker pods among `pods` (whole pod
    objects) mapping the nodes it leaves unmapped (policy/workers.py);
    unchanged when worker_pods is off."""
    sel = exemptions_of(cfg).workers
    if sel is None:
        return dict(mapped)
    found = [w for p in pods if (w := workers.worker_pod(p, sel)) is not None]
    return with_worker_pods(cfg, mapped, k8s_nodes, slurm_names, found)


def with_worker_pods(cfg: SyncConfig, mapped: Mapping[str, str | None], k8s_nodes,
                     slurm_names, found: Iterable[workers.WorkerPod],
                     before: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """with_workers' from the WorkerPods already found (what the sync
    daemon's decision does: usage.desired_state); before: the last mapping,
    what a node whose workers conflict keeps."""
    return workers.merge(mapped, found, k8s_nodes, slurm_names,
                         usage.named_by_admin(k8s_nodes, cfg.node_key, cfg.node_map), before)[0]


def settled(cfg: SyncConfig, k8s_name: str, k8s_node: Mapping) -> bool:
    """node_map or the node label names a Slurm node for this Kubernetes
    node: no worker pod maps it (policy/workers.merge)."""
    return k8s_name in usage.named_by_admin({k8s_name: k8s_node}, cfg.node_key, cfg.node_map)


def possible_slurm_names(cfg: SyncConfig, k8s_name: str, k8s_node: Mapping) -> frozenset:
    """Every Slurm node name this Kubernetes node could be shared as: what
    stands for Slurm's node list while Slurm has not said it yet."""
    label = (k8s_node["metadata"].get("labels") or {}).get(cfg.node_key, "")
    return frozenset([k8s_name, *cfg.node_map.values(), label])


def counted_on(cfg: SyncConfig, k8s_name: str, mappings: Iterable[Mapping[str, str | None]],
               slurm_view) -> set[str]:
    """The Slurm nodes the pods of Kubernetes node `k8s_name` count on under
    any of these mappings (a cycle's, and the one before it)."""
    return {s for m in mappings
            if (s := usage.slurm_node_of(k8s_name, m, slurm_view, cfg.map_by_name))}


def by_slurm_node(k8s_to_slurm: Mapping[str, str]) -> dict[str, str]:
    """Slurm node -> the Kubernetes node shared as it."""
    return {s: k for k, s in k8s_to_slurm.items()}


def k8s_name(shared: Mapping[str, str] | None, slurm_name: str) -> str:
    """The Kubernetes node (and GenericNode) Slurm node `slurm_name` is
    shared as (`shared`: by_slurm_node's); its own name when not known."""
    return (shared or {}).get(slurm_name, slurm_name)
