"""What the sync daemon's watches told it, reduced to what the policy needs
(the Informer handler interface: slim/replace/event/health/contact), and
which of it may be trusted."""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping

from ..policy import departures
from ..policy import usage
from ..policy import workers

log = logging.getLogger("pyk8sres.coordinator.cache")


class Cache:
    """What the watches told us, reduced to what the policy needs.

    Pods are stored as PodUsage (node + requests as ints), nodes as the few
    metadata fields the mapping reads, so that memory grows with what is
    counted, not with the objects' size.  Per-node sums are kept as events
    arrive, so a reconcile costs O(nodes), not O(pods).  Slurm's worker pods
    (when the settings name them) hold nothing: they are kept apart as
    WorkerPods, what the mapping reads.
    Implements the Informer handler interface (replace/event/health).
    """

    KINDS = ("pods", "nodes")

    def __init__(self, exempt: usage.Exemptions = usage.Exemptions(),
                 node_key: str = usage.NODE_LABEL, whole_gpus: tuple = ()):
        self.exempt = exempt
        self.whole_gpus = tuple(whole_gpus)   # resources whose pods hold every GPU of their node
        self.node_key = node_key
        self.lock = threading.Lock()
        self.pods: dict[str, usage.PodUsage] = {}
        self.workers: dict[str, workers.WorkerPod] = {}
        self.nodes: dict[str, dict] = {}
        # k8s node -> [cpu, memory, {pod key: error}, {pod uid: ledger entry}]
        self.sums: dict[str, list] = {}
        self.listed: set[str] = set()
        self.ok = {k: False for k in self.KINDS}
        self.contacted = {k: -1e9 for k in self.KINDS}   # monotonic time the server last spoke
        self.stale_after: float | None = None             # None: never stale (no informers)
        self.changed = threading.Event()
        # Kubernetes nodes whose pods changed since take_dirty(); None: anything
        # may have changed (a list, a node, the watches' health, Slurm's view).
        self.dirty: set[str] | None = None
        # Pods that left without their containers seen gone, (PodUsage, wall
        # time), for the reconcile loop to hold (take_departures).
        self.departed: list[tuple[usage.PodUsage, float]] = []

    # -- reducing objects
    @staticmethod
    def _key(obj: Mapping) -> str:
        m = obj.get("metadata") or {}
        return f"{m.get('namespace', '')}/{m.get('name', '')}"

    def _pod(self, obj: Mapping) -> usage.PodUsage | workers.WorkerPod | None:
        if self.exempt.workers is not None and workers.is_worker(obj, self.exempt.workers):
            return workers.worker_pod(obj, self.exempt.workers)
        pu = usage.pod_usage(obj, self.exempt, self.whole_gpus)
        if pu is not None and pu.error:
            old = self.pods.get(self._key(obj))
            if old is None or old.error != pu.error:
                log.warning("%s; its node keeps its last applied counts", pu.error)
        return pu

    def _account(self, key: str, pu: usage.PodUsage, sign: int) -> None:
        if self.dirty is not None:
            self.dirty.add(pu.node)
        s = self.sums.setdefault(pu.node, [0, 0, {}, {}])
        s[0] += sign * pu.cpu
        s[1] += sign * pu.memory
        if pu.error:
            if sign > 0:
                s[2][key] = pu.error
            else:
                s[2].pop(key, None)
        elif sign > 0:
            s[3][pu.uid] = usage.pod_entry(pu)
        else:
            s[3].pop(pu.uid, None)
        if s[0] == 0 and s[1] == 0 and not s[2] and not s[3] and sign < 0:
            del self.sums[pu.node]

    # -- Informer handler interface
    def slim(self, kind: str, obj: dict):
        """Reduce one listed object to what we keep: (key, value or None)."""
        if kind == "pods":
            return self._key(obj), self._pod(obj)
        return (obj.get("metadata") or {}).get("name"), usage.slim_node(obj, self.node_key, offered=True, state=True)

    def replace(self, kind: str, items: list[dict]) -> None:
        self.replace_slim(kind, [self.slim(kind, o) for o in items])

    def replace_slim(self, kind: str, items: list[tuple]) -> None:
        new = {k: v for k, v in items if v is not None}
        with self.lock:
            if kind == "pods":
                self.workers = {k: v for k, v in new.items() if isinstance(v, workers.WorkerPod)}
                new = {k: v for k, v in new.items() if k not in self.workers}
                # Gone while we were not watching: nobody saw their containers stop.
                uids = {pu.uid for pu in new.values()}
                self.departed += [(pu, time.time()) for pu in self.pods.values()
                                  if pu.uid not in uids and not pu.error]
                self.pods, self.sums = new, {}
                for k, pu in new.items():
                    self._account(k, pu, +1)
            else:
                self.nodes = new
            self.listed.add(kind)
            self.ok[kind] = True
            self.dirty = None
        self.changed.set()

    def event(self, kind: str, typ: str, obj: dict) -> None:
        key = self._key(obj) if kind == "pods" else (obj.get("metadata") or {}).get("name")
        table = self.pods if kind == "pods" else self.nodes
        if typ == "DELETED":
            new = None
        elif kind == "pods":
            new = self._pod(obj)
        else:
            new = usage.slim_node(obj, self.node_key, offered=True, state=True)
        with self.lock:
            if kind == "pods" and (isinstance(new, workers.WorkerPod) or key in self.workers):
                self._worker_event(key, new)
                if isinstance(new, workers.WorkerPod):
                    # A worker holds nothing (a pod that counted may just have become one).
                    new = None
            old = table.get(key)
            if old == new:      # status-only pod updates change nothing we count
                return
            if new is None:
                del table[key]
            else:
                table[key] = new
            if kind == "pods":
                if old is not None:
                    self._account(key, old, -1)
                    # Gone from what counts (deleted, or a terminal phase) with
                    # no word that its containers stopped: held a while.
                    if new is None and not old.error and not departures.containers_gone(obj):
                        self.departed.append((old, time.time()))
                if new is not None:
                    self._account(key, new, +1)
            else:
                self.dirty = None
        self.changed.set()

    def _worker_event(self, key: str, new) -> None:   # lock held
        """Keep a worker pod's change.  A worker that comes, goes or moves
        may change the mapping: every node is recomputed."""
        old = self.workers.get(key)
        if isinstance(new, workers.WorkerPod):
            self.workers[key] = new
        else:
            self.workers.pop(key, None)
        if old != new:
            self.dirty = None
            self.changed.set()

    def worker_pods(self) -> list[workers.WorkerPod]:
        """The bound, running worker pods (what the mapping reads)."""
        with self.lock:
            return list(self.workers.values())

    def health(self, kind: str, ok: bool) -> None:
        with self.lock:
            was = self.ok[kind]
            self.ok[kind] = ok
            if was != ok:
                self.dirty = None
        if was != ok:
            log.log(logging.INFO if ok else logging.WARNING, "%s watch %s", kind,
                    "in sync again" if ok else "lost: the pods' shares only grow until it is back")
            self.changed.set()

    def contact(self, kind: str) -> None:
        with self.lock:
            self.contacted[kind] = time.monotonic()

    def _untrusted(self) -> list[str]:   # lock held
        """The kinds whose cache may have missed changes: not listed, the
        watch broken, or silent longer than a live watch ever is."""
        now = time.monotonic()
        return [k for k in self.KINDS if k not in self.listed or not self.ok[k]
                or (self.stale_after is not None and now - self.contacted[k] > self.stale_after)]

    def not_ready(self) -> str | None:
        """A readiness check: None once both kinds are listed and watched."""
        with self.lock:
            missing = self._untrusted()
        return f"{', '.join(missing)} not listed/watched (or silent)" if missing else None

    def _healthy(self) -> bool:   # lock held
        return not self._untrusted()

    @staticmethod
    def _node_usage(s: list) -> usage.NodeUsage:
        return usage.NodeUsage(s[0], s[1], tuple(s[2].values()))

    def snapshot(self) -> tuple[dict[str, usage.NodeUsage], dict[str, dict], bool]:
        """(usage per Kubernetes node, slim nodes, healthy)."""
        with self.lock:
            per_node = {n: self._node_usage(s) for n, s in self.sums.items()}
            return per_node, dict(self.nodes), self._healthy()

    def mark_all(self) -> None:
        """The next cycle recomputes every node (Slurm's view changed)."""
        with self.lock:
            self.dirty = None
        self.changed.set()

    def mark(self, k8s_nodes) -> None:
        """The next cycle recomputes these Kubernetes nodes' Slurm nodes."""
        with self.lock:
            if self.dirty is not None:
                self.dirty.update(k8s_nodes)
        self.changed.set()

    def take_dirty(self) -> set[str] | None:
        """The Kubernetes nodes whose pods changed since the last call (None:
        anything may have), and start recording anew."""
        with self.lock:
            dirty, self.dirty = self.dirty, set()
            return dirty

    def usage_of(self, k8s_nodes) -> tuple[dict[str, usage.NodeUsage], bool]:
        """(usage of these Kubernetes nodes, healthy): snapshot() for a few."""
        with self.lock:
            per_node = {n: self._node_usage(s) for n in k8s_nodes if (s := self.sums.get(n))}
            return per_node, self._healthy()

    def entries(self, k8s_node: str) -> dict[str, tuple]:
        """Pod UID -> (millicores, bytes) of the pods bound to `k8s_node`
        (usage.pod_entry: a third item, WHOLE_NODE_GPUS, for a pod that
        holds every GPU of its node)."""
        with self.lock:
            s = self.sums.get(k8s_node)
            return dict(s[3]) if s else {}

    def has_pods(self, k8s_node: str) -> bool:
        with self.lock:
            return k8s_node in self.sums

    def take_departures(self) -> list[tuple[usage.PodUsage, float]]:
        """The pods that left without their containers seen gone since the
        last call, each with the wall time it was seen leaving."""
        with self.lock:
            out, self.departed = self.departed, []
            return out

    def node_states(self, names) -> dict[str, str]:
        """Kubernetes node -> its departures state (Ready, unreachable,
        fenced), for these nodes; one without an object is left out (ABSENT)."""
        with self.lock:
            return {k: n.get("state", departures.READY) for k in names if (n := self.nodes.get(k))}
