"""The sync daemon's hold of what a shared node's Slurm capacity offers
beyond its Kubernetes node's allocatable (policy/backstop.beyond), and the
Event that says so.

Kubernetes keeps the pods of a node within its allocatable; Slurm's jobs
may use all of the Slurm node's k8scpu/k8smemory.  Where the second is
larger, the difference is one more entry in that node's ledger
(backstop.BEYOND_KEY), next to the pods': jobs + pods never exceed
allocatable.  It follows the Kubernetes nodes whose pods count on the
Slurm node: the mapped ones, and one that lost its mapping (or its Node
object) while its pods count where they were, with its last allocatable
known; and their status (allocatable rising shrinks it).  A status whose
allocatable is missing or unparsable keeps the last one known (fail
closed: nothing handed back on missing data).
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

from ..policy import backstop
from ..policy import events

log = logging.getLogger("pyk8sres.coordinator.allocatable")


class BeyondAllocatable:
    def __init__(self):
        # Kubernetes node -> what it offers pods as last known (Offer).
        self.known: dict[str, backstop.Offer] = {}
        # Slurm node -> the entry last added there.  Replaced, never changed
        # in place: the GenericNode writer's thread reads it.
        self.held: dict[str, tuple[int, int]] = {}
        # Slurm node -> what the ledger held under BEYOND_KEY when this
        # process first read it, kept while nothing is known of the offer.
        self.inherited: dict[str, tuple[int, int]] = {}
        self.here: Mapping[str, tuple[str, ...]] = {}   # Slurm node -> its Kubernetes nodes
        self.over: set[str] = set()   # Kubernetes nodes whose Event is posted
        self.unreadable: set[str] = set()   # Kubernetes nodes warned of

    def note_nodes(self, k8s_nodes: Mapping[str, Mapping]) -> None:
        """A full cycle's Kubernetes nodes (slim, with their allocatable):
        what each offers, as far as is known.  A node gone forgets it, once
        no Slurm node counts its pods any more."""
        counted = {k for ks in self.here.values() for k in ks}
        known = {k: o for k, o in self.known.items() if k in counted and k not in k8s_nodes}
        unreadable = set()
        for k, n in k8s_nodes.items():
            offer = backstop.offered(n)
            known[k] = backstop.known_offer(offer, self.known.get(k))
            if None in offer:
                unreadable.add(k)
                if k not in self.unreadable:
                    log.warning("kubernetes node %s: no readable allocatable %s; what was "
                                "last known is kept", k, "cpu" if offer[0] is None else "memory")
        self.known, self.unreadable = known, unreadable

    def _offer(self, slurm_name: str) -> backstop.Offer:
        return backstop.smallest(self.known[k] for k in self.here.get(slurm_name, ())
                                 if k in self.known)

    def add(self, wanted: dict[str, dict], here: Mapping[str, tuple[str, ...]],
            view: Mapping) -> None:
        """Add the entry to each node of `wanted` (Slurm node -> entries)
        whose Kubernetes nodes offer less than its Slurm capacity; here:
        Slurm node -> the Kubernetes nodes whose pods count on it, view:
        Slurm node -> SlurmNode."""
        self.here = here
        held = dict(self.held)
        for name, entries in wanted.items():
            offer = self._offer(name)
            entry = backstop.beyond(view.get(name), offer)
            if name in here and None in offer and name in self.inherited:
                entry = backstop.keep_unknown(entry, offer, self.inherited[name])
            else:
                self.inherited.pop(name, None)
            if entry is None:
                held.pop(name, None)
                continue
            entries[backstop.BEYOND_KEY] = entry
            if held.get(name) != entry:
                log.info("node %s: %d millicores and %d bytes beyond its Kubernetes node's "
                         "allocatable held", name, *entry)
            held[name] = entry
        self.held = held

    def inherit(self, name: str, held: tuple[int, int] | None, entries: Mapping) -> dict:
        """The ledger held `held` under BEYOND_KEY on Slurm node `name` before
        this process set it: for each resource its Kubernetes nodes' offer
        of is not known yet, what to keep of it ({} when all is known)."""
        offer = self._offer(name)
        if not held or name not in self.here or None not in offer:
            return {}
        self.inherited[name] = held
        kept = backstop.keep_unknown(entries.get(backstop.BEYOND_KEY), offer, held)
        return {backstop.BEYOND_KEY: kept} if kept else {}

    def held_on(self, slurm_name: str) -> tuple[int, int]:
        """(millicores, bytes) held on a node beyond its allocatable."""
        return self.held.get(slurm_name, (0, 0))

    def detail(self, slurm_name: str) -> str:
        """For an oversubscribed node's Event: the part of its share held
        beyond allocatable ("" when none), which a shrinking allocatable
        may have put above what running jobs leave."""
        cpu_m, mem = self.held_on(slurm_name)
        if not cpu_m and not mem:
            return ""
        return (f" (with {cpu_m}m CPU and {mem >> 20} MB held beyond the Kubernetes node's "
                "allocatable)")

    def note_over(self, over: Mapping[str, str],
                  emit: Callable[[str, str, str], None] | None) -> None:
        """An Event on the GenericNode of each Kubernetes node whose Slurm
        node newly offers more than its allocatable (the log line is among
        the cycle's warnings); emit: (Kubernetes node, reason, message)."""
        if emit is not None:
            for k in sorted(over.keys() - self.over):
                emit(k, events.OVER_ALLOCATABLE, over[k])
        self.over = set(over)
