"""The sync daemon's side of the backstop (policy/backstop.py): hold, in
each shared node's ledger, what Slurm allocated there that no job's
k8scpu/k8smemory covers, and say so (a gauge per node, an Event on its
GenericNode when jobs hold less than Slurm allocated them).

Fed by the Slurm view the daemon reads anyway (CPUAlloc/AllocMem per node)
and the ledger's count of what jobs hold (its `show`); the COMPLETING jobs'
allocations cost one more `scontrol` read, and only while some node is
completing.  Without the ledger's count a node keeps what it held: never
hand capacity back on missing data.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Mapping

from . import metrics
from .gpus import slurm_gpus
from ..policy import backstop

log = logging.getLogger("pyk8sres.coordinator.backstop")
UNHELD_EVENT = "SlurmAllocationUnheld"


class Backstop:
    def __init__(self, emit: Callable[[str, str, str], None] | None = None):
        self.lock = threading.Lock()
        self.completing: dict[str, tuple[int, int]] = {}
        self.completing_gpus: dict[str, frozenset] = {}
        self.gaps: dict[str, backstop.Gap] = {}
        # What the ledger held under backstop.KEY when this process first
        # read a node: kept until Slurm's side can be computed there (a
        # restarted daemon before its first read of the ledger's counts).
        self.inherited: dict[str, tuple[int, int]] = {}
        self.emit = emit     # (Slurm node, reason, message): an Event on its GenericNode

    def read_completing(self, slurm, view: Mapping) -> None:
        """After a read of Slurm's nodes: the COMPLETING jobs' allocations,
        read only while a node is completing.  A failed read keeps the last
        (fail closed)."""
        if not any("COMPLETING" in n.state for n in view.values()):
            completing, gpus = {}, {}
        else:
            try:
                completing, gpus = slurm.completing_allocations()
            except Exception as e:
                log.warning("cannot read the completing jobs: %s; their last counts kept", e)
                metrics.RECONCILE_ERRORS.labels("slurm_read").inc()
                return
        with self.lock:
            if completing != self.completing:
                log.debug("jobs completing (CPUs, MB per node): %s", completing)
            self.completing = completing
            self.completing_gpus = gpus

    def gpus_completing(self) -> dict[str, frozenset]:
        """Slurm node -> GPU indices of the jobs completing there."""
        with self.lock:
            return dict(self.completing_gpus)

    def completing_now(self) -> dict[str, tuple[int, int]]:
        """Slurm node -> (CPUs, MB) of the jobs completing there."""
        with self.lock:
            return dict(self.completing)

    def holding(self) -> bool:
        """Does any node carry something of Slurm's?"""
        with self.lock:
            return bool(self.gaps or self.completing or self.completing_gpus)

    def entry(self, name: str, node, jobs: Mapping | None) -> tuple[int, int] | None:
        """The ledger entry (millicores, bytes) Slurm node `name` should carry
        under backstop.KEY; node: its SlurmNode (None: not in Slurm's view),
        jobs: what the ledger counts its jobs holding."""
        with self.lock:
            completing = self.completing.get(name, (0, 0))
            gap = (backstop.gap(node.alloc_cpus, node.alloc_memory, jobs, completing)
                   if node is not None else None)
            if gap is None:
                gap = self.gaps.get(name)
                if gap is None:
                    return self.inherited.get(name)
            else:
                self.inherited.pop(name, None)
                self._note(name, gap)
            return backstop.entry(gap)

    def add(self, wanted: dict[str, dict], view: Mapping, shown: Mapping) -> None:
        """What Slurm allocated on each node of `wanted` (Slurm node ->
        entries) beyond what its jobs hold as k8scpu/k8smemory, as one more
        entry there, with the GPUs of its completing jobs (their processes
        may still use them); view: Slurm node -> SlurmNode, shown: the
        ledger's last show of each node."""
        gpus_completing = self.gpus_completing()
        for name, entries in wanted.items():
            held = self.entry(name, view.get(name), (shown.get(name) or {}).get("jobs"))
            held = backstop.with_gpus(held, gpus_completing.get(name, ()),
                                      slurm_gpus(shown.get(name))[1])
            if held is not None:
                entries[backstop.KEY] = held

    def inherit(self, name: str, held: tuple[int, int]) -> dict:
        """The ledger held `held` under backstop.KEY on node `name` before this
        process set it: the entry to keep there while nothing newer is
        known ({} once something is)."""
        with self.lock:
            if name in self.gaps:
                return {}
            self.inherited[name] = held
            return {backstop.KEY: held}

    def _note(self, name: str, gap: backstop.Gap) -> None:   # lock held
        old = self.gaps.get(name, backstop.Gap())
        if gap == old:
            return
        if gap == backstop.Gap():
            self.gaps.pop(name, None)
        else:
            self.gaps[name] = gap
        for resource, kind, value in (("cpu", "unheld", gap.unheld_cpus),
                                      ("cpu", "completing", gap.completing_cpus),
                                      ("memory", "unheld", gap.unheld_mb << 20),
                                      ("memory", "completing", gap.completing_mb << 20)):
            metrics.NODE_SLURM_UNHELD.labels(name, resource, kind).set(value)
        if (gap.unheld_cpus, gap.unheld_mb) != (old.unheld_cpus, old.unheld_mb):
            if gap.unheld_cpus or gap.unheld_mb:
                log.error("%s", backstop.message(name, gap))
                if self.emit is not None:
                    self.emit(name, UNHELD_EVENT, backstop.message(name, gap))
            else:
                log.info("node %s: every CPU and MB Slurm allocated is held by its jobs again",
                         name)


def add_fences(wanted: dict[str, dict], unplaced, view: Mapping) -> None:
    """A worker's Slurm node between pods (in `unplaced`) is held whole: its
    next slurmd may register on a Kubernetes node whose pods are not counted
    yet, and no job may start there before they are (workers.unplaced)."""
    for name in unplaced & wanted.keys():
        rest = backstop.fence_rest(view.get(name), wanted[name])
        if rest is not None:
            wanted[name][backstop.FENCE_KEY] = rest
