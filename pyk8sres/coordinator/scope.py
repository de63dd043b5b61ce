"""Which Kubernetes nodes are shared with Slurm, and as which Slurm node:
the one view the webhook (its matchCondition, each review) and the
placeholders share.  Fed by a nodes Informer, by the ledger's show(), and
with worker_pods by an Informer on the pods of worker_namespace (Slurm's
worker pods map the nodes they run on, as in the sync daemon)."""

from __future__ import annotations

import threading
import time

from . import mapping
from .config import SyncConfig, exemptions_of
from ..policy import ledger
from ..policy import usage
from ..policy import workers


class WorkersUnknown(RuntimeError):
    """Which Slurm node a Kubernetes node is cannot be told: a worker pod
    may map it, and the worker pods are not known now (not listed yet, or
    their watch is broken or silent)."""


class LedgerNotReady(RuntimeError):
    """The ledger answered "notready": keep the last known shared set."""


def slurm_names(shown: dict) -> list[str]:
    """Slurm nodes with k8scpu/k8smemory, from the ledger's show() (every node).
    Raises unless the answer says which nodes Slurm has: "notready"
    (LedgerNotReady), any other refusal, or every node unknown (slurmctld
    has not read its node table yet) is never taken for "no shared nodes":
    callers keep the last known set."""
    if ledger.not_ready(shown):
        raise LedgerNotReady(f"ledger show: {ledger.NOT_READY_TEXT}: {shown.get('error')}")
    if not shown.get("ok"):
        raise RuntimeError(f"ledger show: {shown.get('error')}")
    nodes = shown.get("nodes") or {}
    names = [n for n, v in nodes.items() if not v.get("unknown")]
    if nodes and not names:
        raise RuntimeError("ledger show: no node known yet (slurmctld is still starting)")
    return names


class Scope:
    """Which Kubernetes nodes are shared, and as which Slurm node (admin
    configuration: sync's node_map / node_key label / map_by_name).

    Fed by a nodes Informer (the handler interface: slim/replace_slim/event/
    health), so neither the webhook nor the placeholders list every node
    again and again: a list's cost to the API server and to this process's
    GIL grows with the cluster.  Nodes are kept slim: the mapping label and
    what the placeholders cap at (allocatable, else capacity).

    With worker_pods, a second Informer (kind "pods", worker_namespace only)
    feeds the worker pods, kept as WorkerPods, and nodes map as the sync
    daemon maps them (mapping.with_worker_pods).  While those pods are not
    known (not listed, watch broken or silent) nothing is taken as not
    shared: unshared() is [] and slurm_node() raises WorkersUnknown for a
    node only a worker could map and no worker was last seen on."""

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg
        self.exempt = exemptions_of(cfg)
        self.lock = threading.Lock()
        self.nodes: dict[str, dict] = {}
        self.nodes_listed = False
        self.nodes_watched = False
        self.version = 0          # bumped whenever a node we keep changes
        self.changed = threading.Event()   # set with each bump: publish the scope now
        self.slurm_names: frozenset | None = None   # None: not known yet
        self.contacted = -1e9         # monotonic time the nodes watch last spoke
        self.stale_after: float | None = None   # Informer.stale_after(); None: never stale
        self._mapped_at: tuple[int, dict] = (-1, {})   # (version, _mapped() at that version)
        self.workers_sel = self.exempt.workers         # None: worker_pods is off
        self.workers: dict[str, workers.WorkerPod] = {}   # namespace/name -> bound worker
        self.workers_listed = False
        self.workers_watched = False
        self.workers_contacted = -1e9

    def _bump(self) -> None:
        """Under self.lock: what the scope says changed."""
        self.version += 1
        self.changed.set()

    # -- Informer handler interface
    def slim(self, kind: str, obj: dict):
        meta = obj.get("metadata") or {}
        if kind == "pods":   # None: not a bound, running worker
            return (f"{meta.get('namespace')}/{meta.get('name')}",
                    workers.worker_pod(obj, self.workers_sel))
        return meta.get("name"), usage.slim_node(obj, self.cfg.node_key, offered=True)

    def replace_slim(self, kind: str, items: list[tuple], watched: bool = True) -> None:
        with self.lock:
            if kind == "pods":
                self.workers = {k: w for k, w in items if w is not None}
                self.workers_listed = True
                self.workers_watched = watched
                self._bump()
                return
            self.nodes = {k: v for k, v in items if k is not None}
            self.nodes_listed = True
            self.nodes_watched = watched
            self._bump()

    def event(self, kind: str, typ: str, obj: dict) -> None:
        name, slim = self.slim(kind, obj)
        with self.lock:
            if kind == "pods":
                if typ == "DELETED" or slim is None:
                    if self.workers.pop(name, None) is not None:
                        self._bump()
                elif self.workers.get(name) != slim:
                    self.workers[name] = slim
                    self._bump()
            elif typ == "DELETED":
                if self.nodes.pop(name, None) is not None:
                    self._bump()
            elif self.nodes.get(name) != slim:   # heartbeats change nothing we keep
                self.nodes[name] = slim
                self._bump()

    def health(self, kind: str, ok: bool) -> None:
        attr = "workers_watched" if kind == "pods" else "nodes_watched"
        with self.lock:
            if getattr(self, attr) != ok:
                setattr(self, attr, ok)
                self._bump()

    def contact(self, kind: str) -> None:
        """The server spoke (an event, a bookmark, a watch (re)opened)."""
        with self.lock:
            if kind == "pods":
                self.workers_contacted = time.monotonic()
            else:
                self.contacted = time.monotonic()

    def _silent(self, contacted: float | None = None) -> bool:   # lock held
        """The nodes watch (or the one contacted at `contacted`) has been
        quiet longer than a live one ever is: it may be stuck while the API
        server moved on (a node joined or was relabelled shared, a worker
        pod was bound), so it is not trusted."""
        contacted = self.contacted if contacted is None else contacted
        return self.stale_after is not None and \
            time.monotonic() - contacted > self.stale_after

    def _workers_trusted(self) -> bool:   # lock held
        """The worker pods are known now (always, with worker_pods off)."""
        return self.workers_sel is None or (
            self.workers_listed and self.workers_watched
            and not self._silent(self.workers_contacted))

    def workers_known(self) -> bool:
        with self.lock:
            return self._workers_trusted()

    def update(self, k8s_nodes: list[dict] | None = None, slurm_names=None) -> None:
        if k8s_nodes is not None:
            self.replace_slim("nodes", [self.slim("nodes", n) for n in k8s_nodes],
                              watched=False)
        if slurm_names is not None:
            with self.lock:
                if self.slurm_names != frozenset(slurm_names):
                    self.slurm_names = frozenset(slurm_names)
                    self._bump()

    def snapshot(self) -> tuple[dict[str, dict], int]:
        """(the slim nodes, their version)."""
        with self.lock:
            return dict(self.nodes), self.version

    def slurm_node(self, k8s_node: str) -> str | None:
        """The Slurm node `k8s_node` is shared as (None: not shared).
        Raises WorkersUnknown when a worker pod may map it and the worker
        pods are not known (the caller refuses: fail closed)."""
        with self.lock:
            node = self.nodes.get(k8s_node) or {"metadata": {"name": k8s_node}}
            names = self.slurm_names
            trusted = self._workers_trusted()
        if names is None:
            # Slurm's nodes unknown (the ledger has not answered show yet):
            # treat the node as shared and let the ledger decide (fail closed:
            # it refuses unless it answers, and knows the node).
            names = mapping.possible_slurm_names(self.cfg, k8s_node, node) | \
                self._claims(k8s_node)
        base = mapping.slurm_node(self.cfg, node, names)
        if self.workers_sel is None:
            return base
        if trusted and (mapped := self._mapped()) is not None:
            return mapped.get(k8s_node, base)
        return self._unknown_worker_node(k8s_node, node, base, trusted)

    def _claims(self, k8s_node: str) -> set[str]:
        """The Slurm nodes the workers last seen on k8s_node name."""
        with self.lock:
            return {w.slurm_node for w in self.workers.values()
                    if w.k8s_node == k8s_node and w.slurm_node}

    def _unknown_worker_node(self, k8s_node: str, node: dict, base: str | None,
                             trusted: bool) -> str | None:
        """slurm_node() while the full mapping is not known: the admin's
        mapping first (it wins over any worker), then what the last full
        view mapped, then the worker last seen there (the ledger decides
        whether Slurm has that node: it refuses one it does not know)."""
        if base is not None or mapping.settled(self.cfg, k8s_node, node):
            return base
        with self.lock:
            last = self._mapped_at[1].get(k8s_node)
        if last:
            return last
        claims = self._claims(k8s_node)
        if len(claims) == 1:
            return next(iter(claims))
        if trusted:
            return None
        sel = self.workers_sel
        raise WorkersUnknown(
            f"cannot tell whether node {k8s_node} is shared with Slurm: the Slurm worker pods "
            f"({sel.kind}, namespace {sel.namespace}) are not known now (their watch is not "
            "listed yet, broken or silent), and one may run there")

    def _mapped(self) -> dict[str, str | None] | None:
        """Every Kubernetes node -> its Slurm node (None: not shared), or
        None while either side is not known.  Kept until the version moves:
        the placeholders ask every period, and mapping every node each time
        would cost an idle webhook CPU in proportion to the cluster.  Callers
        must not change it."""
        with self.lock:
            if not self.nodes_listed or self.slurm_names is None or (
                    self.workers_sel is not None and not self.workers_listed):
                return None
            if self._mapped_at[0] == self.version:
                return self._mapped_at[1]
            version, nodes, names = self.version, dict(self.nodes), self.slurm_names
            found, before = list(self.workers.values()), self._mapped_at[1]
        mapped = mapping.slurm_nodes(self.cfg, nodes, names)
        if self.workers_sel is not None:
            # As the sync daemon maps (usage.desired_state): base first, the
            # workers where it maps nothing, a conflicted node keeping `before`.
            mapped = mapping.with_worker_pods(self.cfg, mapped, nodes, names, found, before)
        with self.lock:
            self._mapped_at = (version, mapped)
        return mapped

    def shared(self) -> dict[str, str]:
        """Kubernetes node -> Slurm node, for the nodes known to be shared."""
        return {k: s for k, s in (self._mapped() or {}).items() if s}

    def unshared(self) -> list[str] | None:
        """The Kubernetes nodes known NOT to be shared (the only ones the
        webhook is not called for); [] (every node checked) while the nodes
        watch is broken or silent, since a node may have been relabelled
        meanwhile, and (with worker_pods) while the worker pods are not
        known, since a worker may have been bound to any node meanwhile;
        None (keep what is published) before anything is known."""
        with self.lock:
            if not self._workers_trusted():
                return []
        mapped = self._mapped()
        if mapped is None:
            return None
        with self.lock:
            trusted = self.nodes_watched and not self._silent()
        if not trusted:
            return []
        return sorted(k for k, s in mapped.items() if not s)
