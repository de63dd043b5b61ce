"""The shares sync keeps in the ledger after their pods left the API server,
and the node mappings it keeps after a Kubernetes node lost its own.

policy/departures.py says how long a departed pod's share is held; this is
the bookkeeping around it, owned by the reconcile loop (one thread):

* Holds: Slurm node -> {pod UID: departures.Held}.  The loop adds a hold for
  each pod the cache saw vanish without its containers seen gone, puts the
  held entries into each `set` next to the pods still bound, and drops them
  when departures.next_hold says so.
* Sticky mappings: a Kubernetes node whose Node object was deleted, or
  whose mapping label or node_map entry went away or changed, keeps
  counting its pods on the Slurm node it was mapped to for as long as it
  has pods (then their departures are held there as above).  The mapping
  may change; the pods' containers did not move.  A worker's Slurm node
  lets them go earlier, once no job that ran beside them is left there
  (policy/moves.py: `moves` keeps each such node's state).
* After a restart this process knows no departures: the first `set` of a
  node replaces what the ledger holds there, so each ledger entry with no
  bound pod behind it is held as a forced delete would be (the default
  grace period plus the margin) before it goes.

No I/O here: the loop passes in node states and clocks.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from ..policy import departures
from ..policy import usage
from ..policy import moves

log = logging.getLogger("pyk8sres.coordinator.holds")


class Holds:
    def __init__(self, margin: float):
        self.margin = margin
        self.by_node: dict[str, dict[str, departures.Held]] = {}
        self.sticky: dict[str, set[str]] = {}     # Kubernetes node -> Slurm nodes kept
        # (Kubernetes node, Slurm node) kept -> what its release waits for
        self.moves: dict[tuple[str, str], moves.Left] = {}

    # -- departures
    def add(self, slurm_nodes: Iterable[str], uid: str, held: departures.Held | None) -> None:
        for s in slurm_nodes:
            if held is None:
                self.by_node.get(s, {}).pop(uid, None)
                continue
            old = self.by_node.setdefault(s, {}).get(uid)
            if old is None or old.until is not None and (held.until is None or
                                                         held.until > old.until):
                self.by_node[s][uid] = held
                log.info("node %s: pod %s left %s before its containers were seen gone; its "
                         "share (%dm CPU, %d bytes) is held %s", s, uid, held.k8s_node,
                         held.cpu_m, held.mem_bytes,
                         "until the node is Ready again" if held.until is None else
                         "for what is left of its grace period plus a margin")

    def entries(self, slurm_node: str) -> dict[str, tuple]:
        """uid -> (millicores, bytes), and usage.WHOLE_NODE_GPUS after them
        for a pod that held every GPU of its node (as usage.pod_entry)."""
        return {uid: (h.cpu_m, h.mem_bytes) + ((usage.WHOLE_NODE_GPUS,) if h.whole_gpus else ())
                for uid, h in self.by_node.get(slurm_node, {}).items()}

    def nodes(self) -> set[str]:
        return set(self.by_node)

    def k8s_nodes_on(self, slurm_node: str) -> set[str]:
        """The Kubernetes nodes the pods held on `slurm_node` left."""
        return {h.k8s_node for h in self.by_node.get(slurm_node, {}).values()}

    def k8s_nodes(self) -> set[str]:
        """The Kubernetes nodes the held pods left."""
        return {h.k8s_node for held in self.by_node.values() for h in held.values()}

    def forget_unknown(self, slurm_nodes) -> None:
        """Drop what is kept for Slurm nodes Slurm no longer has (removed
        from its configuration): nothing can be held there."""
        for s in set(self.by_node) - set(slurm_nodes):
            log.info("node %s: no longer a Slurm node; its held shares are dropped", s)
            del self.by_node[s]
        for k in list(self.sticky):
            self.sticky[k] &= set(slurm_nodes)
            if not self.sticky[k]:
                del self.sticky[k]
        self._forget_moves()

    def advance(self, states: Mapping[str, str], now: float) -> set[str]:
        """Move every hold on as its Kubernetes node stands (states: node ->
        departures state; a node not in it is ABSENT); returns the Slurm
        nodes whose held entries changed."""
        changed = set()
        for s, held in list(self.by_node.items()):
            for uid, h in list(held.items()):
                new = departures.next_hold(h, states.get(h.k8s_node, departures.ABSENT), now=now, margin=self.margin)
                if new == h:
                    continue
                changed.add(s)
                if new is None:
                    del held[uid]
                    log.info("node %s: the held share of pod %s is released", s, uid)
                else:
                    held[uid] = new
            if not held:
                del self.by_node[s]
        return changed

    def next_due(self) -> float | None:
        """The earliest time a hold runs out (None: none is counting down)."""
        times = [h.until for held in self.by_node.values() for h in held.values()
                 if h.until is not None]
        return min(times, default=None)

    # -- sticky mappings
    def keep_mappings(self, before: Mapping[str, str | None], after: Mapping[str, str | None],
                      has_pods, now: float = 0.0, slurmd_start=lambda s: "") -> set[str]:
        """Note the Kubernetes nodes that lost or changed their mapping
        (before/after: Kubernetes node -> Slurm node or None; a node
        missing from `after` was deleted; now: the monotonic time) and
        forget those that no longer have pods (has_pods(k8s node) -> bool;
        slurmd_start(Slurm node): its SlurmdStartTime now, noted with a move).
        Returns the Slurm nodes whose kept mappings changed."""
        changed = set()
        for k, s in before.items():
            if s is not None and after.get(k) != s and has_pods(k):
                if s not in self.sticky.setdefault(k, set()):
                    log.info("kubernetes node %s is no longer mapped to Slurm node %s: its pods "
                             "keep counting there until they are gone", k, s)
                    self.sticky[k].add(s)
                    self.moves[(k, s)] = moves.Left(k, s, now, slurmd=slurmd_start(s))
                    changed.add(s)
        for k in list(self.sticky):
            kept = {s for s in self.sticky[k] if after.get(k) != s}
            if not has_pods(k) or not kept:
                changed |= self.sticky.pop(k)
            else:
                changed |= self.sticky[k] - kept
                self.sticky[k] = kept
        self._forget_moves()
        return changed

    def _forget_moves(self) -> None:
        for k, s in list(self.moves):
            if s not in self.sticky.get(k, ()):
                del self.moves[(k, s)]

    def release(self, k8s_node: str, slurm_node: str) -> None:
        """Kubernetes node `k8s_node`'s pods stop counting on `slurm_node`
        (policy/moves.step said so)."""
        kept = self.sticky.get(k8s_node, set())
        kept.discard(slurm_node)
        if not kept:
            self.sticky.pop(k8s_node, None)
        self.moves.pop((k8s_node, slurm_node), None)
        log.info("kubernetes node %s: no job that ran beside its pods is left on Slurm node "
                 "%s, placed again elsewhere: its pods no longer count there", k8s_node,
                 slurm_node)

    def kept_for(self, k8s_node: str) -> set[str]:
        return self.sticky.get(k8s_node, set())

    def kept_on(self, slurm_nodes: Iterable[str]) -> set[str]:
        """The Kubernetes nodes kept counting on any of these Slurm nodes."""
        wanted = set(slurm_nodes)
        return {k for k, ss in self.sticky.items() if ss & wanted}
