"""Which Kubernetes nodes are shared with Slurm, and as which Slurm node:
the one view the webhook (its matchCondition, each review) and the
placeholders share.  Fed by a nodes Informer and by the ledger's show()."""

from __future__ import annotations

import threading
import time

from . import mapping
from .config import SyncConfig, exemptions_of
from ..policy import ledger
from ..policy import usage


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
    what the placeholders cap at (allocatable, else capacity)."""

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

    def _bump(self) -> None:
        """Under self.lock: what the scope says changed."""
        self.version += 1
        self.changed.set()

    # -- Informer handler interface
    def slim(self, kind: str, obj: dict):
        return (obj.get("metadata") or {}).get("name"), usage.slim_node(obj, self.cfg.node_key,
                                                                     offered=True)

    def replace_slim(self, kind: str, items: list[tuple], watched: bool = True) -> None:
        with self.lock:
            self.nodes = {k: v for k, v in items if k is not None}
            self.nodes_listed = True
            self.nodes_watched = watched
            self._bump()

    def event(self, kind: str, typ: str, obj: dict) -> None:
        name, slim = self.slim(kind, obj)
        with self.lock:
            if typ == "DELETED":
                if self.nodes.pop(name, None) is not None:
                    self._bump()
            elif self.nodes.get(name) != slim:   # heartbeats change nothing we keep
                self.nodes[name] = slim
                self._bump()

    def health(self, kind: str, ok: bool) -> None:
        with self.lock:
            if self.nodes_watched != ok:
                self.nodes_watched = ok
                self._bump()

    def contact(self, kind: str) -> None:
        """The server spoke (an event, a bookmark, a watch (re)opened)."""
        with self.lock:
            self.contacted = time.monotonic()

    def _silent(self) -> bool:   # lock held
        """The nodes watch has been quiet longer than a live one ever is:
        it may be stuck while the API server moved on (a node joined or
        was relabelled shared), so it is not trusted."""
        return self.stale_after is not None and \
            time.monotonic() - self.contacted > self.stale_after

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
        with self.lock:
            node = self.nodes.get(k8s_node) or {"metadata": {"name": k8s_node}}
            names = self.slurm_names
        if names is None:
            # Slurm's nodes unknown (the ledger has not answered show yet):
            # treat the node as shared and let the ledger decide (fail closed:
            # it refuses unless it answers, and knows the node).
            names = mapping.possible_slurm_names(self.cfg, k8s_node, node)
        return mapping.slurm_node(self.cfg, node, names)

    def _mapped(self) -> dict[str, str | None] | None:
        """Every Kubernetes node -> its Slurm node (None: not shared), or
        None while either side is not known.  Kept until the version moves:
        the placeholders ask every period, and mapping every node each time
        would cost an idle webhook CPU in proportion to the cluster.  Callers
        must not change it."""
        with self.lock:
            if not self.nodes_listed or self.slurm_names is None:
                return None
            if self._mapped_at[0] == self.version:
                return self._mapped_at[1]
            version, nodes, names = self.version, dict(self.nodes), self.slurm_names
        mapped = mapping.slurm_nodes(self.cfg, nodes, names)
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
        meanwhile; None (keep what is published) before anything is known."""
        mapped = self._mapped()
        if mapped is None:
            return None
        with self.lock:
            trusted = self.nodes_watched and not self._silent()
        if not trusted:
            return []
        return sorted(k for k, s in mapped.items() if not s)
