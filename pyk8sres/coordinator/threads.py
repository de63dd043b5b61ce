"""The sync daemon's threads beside its reconcile loop: the GenericNode
writer (a slow API server never delays the ledger) and the Slurm poller
(reading Slurm never delays the reaction to a pod)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from . import metrics
from . import slurm
from ..policy import gpus

if TYPE_CHECKING:
    from .sync import Reconciler

log = logging.getLogger("pyk8sres.coordinator.threads")


class GenericNodeWriter(threading.Thread):
    """Writes GenericNodes off the Slurm path: a slow or unreachable API
    server must never delay lowering Slurm's counts.  Only the newest
    decision matters (level-triggered), so it keeps one slot, not a queue."""

    def __init__(self, rec: Reconciler, stop: threading.Event):
        super().__init__(name="genericnodes", daemon=True)
        self.rec, self.stop_event = rec, stop
        self.lock = threading.Lock()
        self.pending = None
        self.wake = threading.Event()

    def offer(self, d, view, only: set[str] | None = None) -> None:
        """The newest decision; only: the Kubernetes nodes it changed (None:
        any).  Decisions not yet written fold into one: the newest, for
        the nodes any of them changed."""
        with self.lock:
            if self.pending is not None:
                before = self.pending[2]
                only = None if only is None or before is None else only | before
            self.pending = (d, view, only)
        self.wake.set()

    def due_in(self) -> float | None:
        """Seconds until a node left waiting by the last pass may be written
        (None: none waits).  Out of write budget: when a token is back."""
        rec = self.rec
        if rec.gn_behind:
            return rec.gn_refill_seconds()
        return None if rec.gn_next is None else max(0.0, rec.gn_next - time.monotonic())

    def run(self) -> None:
        last = None
        while not self.stop_event.is_set():
            # Nodes left waiting (their interval, the write budget): the same
            # decision again once they are due, a pass that looks only at
            # them, so that their newest state is written.  Out of budget, a
            # new decision waits too; within an interval it does not: other
            # nodes' changes are written at once.
            due = self.due_in() if last is not None else None
            if due is not None and self.rec.gn_behind:
                self.stop_event.wait(min(1.0, due))
            elif not self.wake.wait(0.5 if due is None else min(1.0, due)) and due is None:
                continue
            self.wake.clear()
            with self.lock:
                job, self.pending = self.pending, None
            if job is not None:
                last = job
                self.rec.sync_generic_nodes_safe(*job)
            elif due is not None:
                self.rec.sync_generic_nodes_safe(last[0], last[1], set())


class SlurmPoller(threading.Thread):
    """Re-reads every Slurm node when the ledger saw one change, and at
    least every `read_period`, then wakes the loop.

    Each resync period it asks the ledger which nodes changed (a `show`
    since its last token: a job started or ended, a capacity moved, the
    node table changed, slurmctld restarted).  Only then, or once
    `read_period` has passed (for what the ledger does not follow), does it
    read every node: scontrol plus parsing grows with the cluster and is
    the costliest thing an idle daemon does, too much for every period.
    Done here, it never delays the reaction to a pod.  A view that differs from the last one
    triggers a full cycle: that is what re-applies counts after a slurmctld
    restart or reconfigure, and refreshes the Slurm side of the
    GenericNodes.  An unchanged view triggers one only when the repair is
    due (repair_seconds): a full cycle costs O(cluster).
    """

    def __init__(self, rec: Reconciler, period: float, stop: threading.Event,
                 ledger=None, metrics_period: float = 5.0, alive: float = 60.0,
                 read_period: float = 10.0, gpus_moved: threading.Event | None = None):
        super().__init__(name="slurm-poller", daemon=True)
        self.rec, self.period, self.stop_event = rec, period, stop
        # Set when the GPUs Slurm's jobs hold moved: the holder claims follow
        # at once, not a period later (a pod waits for the device meanwhile).
        self.gpus_moved = gpus_moved
        self.metrics_period, self.alive, self.read_period = metrics_period, alive, read_period
        self.follower = slurm.ShowFollower(ledger) if ledger is not None else None
        self.shown: dict | None = None
        self.changed: set | None = None   # the nodes the last show said changed

    def ledger_moved(self) -> bool:
        """Did Slurm's side of a node change (its jobs, its capacity, the
        node itself) since the last call, as far as the ledger saw?  Pods'
        shares moving are not Slurm's.  True when the ledger cannot say (no
        ledger, no answer, every node listed)."""
        if self.follower is None:
            return True
        before = self.follower.nodes or {}
        self.changed = None
        try:
            self.shown, changed = self.follower.refresh()
        except Exception as e:  # counted (ledger errors); /readyz says so
            self.shown = {"ok": False, "error": str(e)}
        ok = bool(self.shown.get("ok"))
        self.rec.ledger_nodes = self.shown["nodes"] if ok else None
        if not ok or changed is None:
            return True
        self.changed = changed
        if self.gpus_moved is not None and any(
                _gpu_jobs(before.get(n)) != _gpu_jobs(self.shown["nodes"].get(n))
                for n in changed):
            self.gpus_moved.set()
        return any(_slurm_side(before.get(n)) != _slurm_side(self.shown["nodes"].get(n))
                   for n in changed)

    def _period(self) -> float:
        """Shorter while a pod waits for GPUs Slurm's jobs hold (policy/gpus.py)."""
        state = getattr(self.rec, "gpus", None)
        if state is None or self.follower is None:
            return self.period
        return gpus.poll_period(self.period, state.claims(), state.holder_namespace,
                                self.follower.nodes)

    def run(self) -> None:
        shown_at = marked_at = read_at = -1e9
        while True:
            metrics.HEALTH.beat("slurm-poller", self.alive)
            moved = self.ledger_moved()
            if self.shown is not None and time.monotonic() - shown_at >= self.metrics_period:
                shown_at = time.monotonic()
                try:
                    self.rec.observe_ledger(self.shown)
                except Exception as e:
                    log.warning("ledger show failed: %s", e)
            if self.stop_event.wait(self._period()):
                return
            # While the backstop holds something, every resync period (not
            # at the faster pace of a waiting GPU pod): so that it lets go as
            # soon as Slurm's processes are gone.
            since = time.monotonic() - read_at
            if not moved and (since < 0.9 * self.period or (
                    not self.rec.backstop.holding() and since < self.read_period)):
                continue
            read_at = time.monotonic()
            try:
                nodes = self.rec.slurm.list_nodes()
            except Exception as e:  # slurmctld down: keep the old view, retry
                log.warning("cannot read Slurm nodes: %s", e)
                metrics.RECONCILE_ERRORS.labels("slurm_read").inc()
                continue
            view = {n.name: n for n in nodes}
            self.rec.backstop.read_completing(self.rec.slurm, view)
            unchanged = view == self.rec.slurm_view
            self.rec.slurm_view = view
            self.rec.slurm_view_at = read_at     # after the view: never newer than it
            if unchanged and time.monotonic() - marked_at < self.rec.cfg.repair_seconds:
                # What jobs hold moved without Slurm's nodes changing (the
                # ledger's count read before the nodes): those nodes' backstop
                # entries are recomputed.
                if moved and self.changed:
                    self.rec.cache.mark(self.rec.k8s_name(n) for n in self.changed)
                continue
            marked_at = time.monotonic()
            self.rec.cache.mark_all()


def _gpu_jobs(view: dict | None):
    """The GPU indices Slurm's jobs hold in a node's ledger view."""
    return ((view or {}).get("gpus") or {}).get("jobs")


def _slurm_side(view: dict | None) -> tuple:
    """What a node's ledger view says of Slurm (not of the pods' share):
    its GPU count too, which whole-node pods' holds follow."""
    view = view or {}
    gpus_view = view.get("gpus") or {}
    return (view.get("unknown"), view.get("capacity"), view.get("jobs"), gpus_view.get("jobs"),
            gpus_view.get("count"), gpus_view.get("problem"))
