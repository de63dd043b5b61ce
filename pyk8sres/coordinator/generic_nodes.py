"""The sync daemon's GenericNodes: one per shared node, showing what Slurm
and Kubernetes each hold there (policy/usage.generic_node_body), written
only when what it shows changed, within a write budget and at most once
per node and generic_node_min_interval_seconds; relisted now and then to
put back what someone else edited or deleted.

A mixin of sync.Reconciler: it reads the reconcile's decision (usage.Desired),
the Slurm view and what the ledger holds beyond both (held departures,
jobs completing), and the GPU indices each side holds; every call goes
through kube.py.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from kubernetes.client.exceptions import ApiException

from . import metrics
from .config import SyncConfig
from .gpus import slurm_gpus
from .kube import MANAGED_BY
from .permissions import error_text
from ..policy import events
from ..policy import gpus as gpu_rules
from ..policy import status_writes
from ..policy import usage

log = logging.getLogger("pyk8sres.coordinator.sync")

# GenericNodes edited or deleted by someone else are put back within this
# long (sooner for one deleted whose node changes: that write gets 404 and
# the next pass creates it).  A list of every GenericNode grows with the
# cluster, too costly for every minute; 5 minutes is also how often a
# kubelet reports an unchanged node.
GN_RELIST_SECONDS = 300.0


class GenericNodes:
    """The GenericNode half of the reconcile (state prefixed gn_)."""

    def gn_init(self, cfg: SyncConfig) -> None:
        self.gn_written: dict[str, tuple[dict, dict]] | None = None
        self.gn_exists: set[str] = set()
        self.gn_inputs: dict[str, tuple] = {}   # what each written body was built from
        self.gn_listed = 0.0
        self.gn_waiting: dict[str, float] = {}  # node -> when its object fell behind
        self.gn_bucket = events.Bucket(float(cfg.generic_node_burst), time.monotonic())
        self.gn_behind = False   # the last pass ran out of write budget
        self.gn_patched: dict[str, float] = {}   # node -> its last update, within the interval
        self.gn_next: float | None = None   # when the first node held back by it may be written
        self.gn_beyond: dict[str, tuple] = {}   # gn_note_beyond's snapshot
        self.gn_claimed: dict[str, tuple] = {}  # Slurm node -> GPU indices of the claims set there
        self.gn_gpus: dict[str, tuple | None] = {}   # Slurm node -> its last _gn_gpu_key
        self.gn_owners: list[str] = []   # ours listed with managedFields, not yet cleared

    def sync_generic_nodes_safe(self, d, view, only=None) -> None:
        try:
            self.sync_generic_nodes(d, view, only)
        except Exception as e:  # API down, conflicts: retried on the next cycle
            log.warning("GenericNode update failed: %s", error_text(e))
            metrics.RECONCILE_ERRORS.labels("generic_nodes").inc()
            self.failed = True

    def gn_refill_seconds(self) -> float:
        """How long until the GenericNode write budget has a token again."""
        return events.until_token(self.gn_bucket, time.monotonic(), self.gn_limits())

    def gn_limits(self) -> events.Limits:
        return events.Limits(rate=self.cfg.generic_node_qps, burst=self.cfg.generic_node_burst)

    def sync_generic_nodes(self, d: usage.Desired, view: dict,
                           only: set[str] | None = None) -> None:
        """Make GenericNodes match (write only what changed).  view: Slurm
        node name -> node.  only: look at just these Kubernetes nodes, the
        ones still waiting for the write budget, and those whose
        oversubscription flag flipped (a pod event: O(its node), not
        O(cluster)); None: every node, and delete what is no longer shared."""
        self._gn_know_cluster()
        if self._gn_relist_if_due():
            only = None     # after a (re-)list, look at every node
        inputs = self._gn_inputs(d, view, self._gn_names(d, only))
        self._gn_write_changed(d, view, inputs)
        self._gn_clear_field_owners()
        if only is None:
            self._gn_delete_unshared(inputs)

    def _gn_know_cluster(self) -> None:
        """spec.clusterName: the setting, else Slurm's name, asked once."""
        if self.cluster is None:
            try:
                self.cluster = self.slurm.cluster_name()
            except Exception:
                self.cluster = ""

    def _gn_relist_if_due(self) -> bool:
        """Read what exists (first, then every GN_RELIST_SECONDS: heals
        edits and deletes by others); True if it did."""
        if self.gn_written is not None and time.monotonic() - self.gn_listed > GN_RELIST_SECONDS:
            self.gn_written = None
        if self.gn_written is not None:
            return False
        if self.cfg.create_crd and not self.gn_listed:
            self.kube.ensure_crd()
        existing = self.kube.list_generic_nodes()
        self.gn_listed = time.monotonic()
        self.gn_inputs = {}
        self.gn_exists = set(existing)
        ours = {n: o for n, o in existing.items()
                if all((o["metadata"].get("labels") or {}).get(k) == v
                       for k, v in MANAGED_BY.items())}
        self.gn_written = {n: (o.get("spec") or {}, o.get("status") or {})
                           for n, o in ours.items()}
        self.gn_owners = sorted(n for n, o in ours.items() if o["metadata"].get("managedFields"))
        return True

    def _gn_clear_field_owners(self) -> None:
        """Ours that carry managedFields (written by an earlier version, or
        applied server-side by someone) lose them (kube.py says why), after
        the pass's status writes and within the same write budget: an
        upgrade does not write every object at once.  What the budget
        leaves waits for the next pass (gn_behind); one that fails keeps
        them until the next relist."""
        limits = self.gn_limits()
        while self.gn_owners and not self.gn_behind:
            may, self.gn_bucket = events.take(self.gn_bucket, time.monotonic(), limits)
            if not may:
                self.gn_behind = True
                break
            name = self.gn_owners.pop(0)
            try:
                self.kube.clear_generic_node_field_owners(name)
            except ApiException as e:
                if e.status != 404:     # 404: deleted meanwhile
                    log.warning("GenericNode %s: managedFields kept: %s", name, error_text(e))

    def _gn_names(self, d: usage.Desired, only: set[str] | None):
        """The Kubernetes nodes this pass looks at (see sync_generic_nodes)."""
        with self.over_lock:
            flipped, self.over_flipped = self.over_flipped, set()
        if only is None:
            return d.k8s_to_slurm
        return set(only) | set(self.gn_waiting) | {
            k for s in flipped for k in d.here.get(s, ())}

    def _gn_inputs(self, d: usage.Desired, view: dict, names) -> dict[str, tuple]:
        """Kubernetes node -> what its body is built from.  Building every
        node's body each cycle is the costly part: a node whose inputs are
        the same as when it was last written is skipped."""
        inputs = {}
        for k in names:
            s = d.k8s_to_slurm.get(k)
            n = view.get(s)
            if n is not None:
                u = d.usage.get(s) or usage.NodeUsage()
                inputs[k] = (s, n.cpus, n.real_memory, n.alloc_cpus, n.alloc_memory,
                             u.cpu, u.memory, *self._gn_beyond(s),
                             self.allocatable.held_on(s), self.cluster,
                             self._gn_gpu_key(s), self.oversubscribed.get(s, False))
        return inputs

    def gn_note_beyond(self, held: Mapping[str, Mapping[str, tuple[int, int]]],
                       completing: Mapping[str, tuple[int, int]]) -> None:
        """What each side holds beyond what the API server and CPUAlloc
        show, per Slurm node: held (departed pods' shares: uid ->
        millicores, bytes) and completing (jobs still completing: CPUs, MB).
        Called by the reconcile's thread with each decision; the writer
        thread reads the snapshot, never the holds themselves."""
        beyond = {}
        for s in set(held) | set(completing):
            shares = (held.get(s) or {}).values()
            beyond[s] = ((sum(e[0] for e in shares), sum(e[1] for e in shares)),
                         completing.get(s, (0, 0)))
        self.gn_beyond = beyond

    def gn_note_set(self, slurm_name: str, entries: Mapping[str, tuple]) -> None:
        """The entries the reconcile just set in the ledger on a node: the
        GPU indices of its claims' entries, and of its pods counted
        whole-node, are the Kubernetes side of the GenericNode's GPUs (what
        the ledger holds for them)."""
        self.gn_claimed[slurm_name] = gpu_rules.kubernetes_indices(entries)

    def _gn_gpu_key(self, slurm_name: str) -> tuple | None:
        """(count, indices Slurm's jobs hold, indices the claims hold) of a
        node with GPUs, None without: Slurm's side from the ledger's last
        `show` (the poller's), the claims' from what was set.  While the
        ledger does not answer, the last known: a GenericNode does not drop
        its GPUs for a failed read."""
        if self.ledger_nodes is None:
            return self.gn_gpus.get(slurm_name)
        count, jobs, _ = slurm_gpus(self.ledger_nodes.get(slurm_name))
        key = None if count is None else (count, tuple(sorted(jobs)),
                                          self.gn_claimed.get(slurm_name, ()))
        self.gn_gpus[slurm_name] = key
        return key

    @staticmethod
    def _gn_gpu_status(key: tuple | None) -> dict | None:
        return None if key is None else gpu_rules.generic_node_gpus(*key)

    def _gn_beyond(self, slurm_name: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(held: millicores, bytes), (completing: CPUs, MB) on a node."""
        return self.gn_beyond.get(slurm_name, ((0, 0), (0, 0)))

    def _gn_write_changed(self, d: usage.Desired, view: dict, inputs: dict) -> None:
        """Write the objects whose inputs changed, oldest change first, at
        most once per node and generic_node_min_interval_seconds, while the
        write budget lasts (creating, once per node, is neither); the rest
        waits for the next pass (gn_next, gn_behind: when it is due)."""
        now, interval = time.monotonic(), self.cfg.generic_node_min_interval_seconds
        stale = [n for n, key in inputs.items()
                 if self.gn_inputs.get(n) != key or n not in self.gn_written]
        self.gn_waiting = {n: self.gn_waiting.get(n, now) for n in stale}
        self.gn_patched = status_writes.recent(self.gn_patched, now, interval)
        ready, self.gn_next = status_writes.split(self.gn_waiting, self.gn_patched, now, interval)
        limits = self.gn_limits()
        self.gn_behind = False
        for name in ready:
            key = inputs[name]
            held, completing = self._gn_beyond(key[0])
            spec, status = usage.generic_node_body(name, view[key[0]], d.usage.get(key[0]),
                                                   self.cluster, oversubscribed=key[-1],
                                                   held=held, completing=completing,
                                                   beyond=self.allocatable.held_on(key[0]),
                                                   gpus=self._gn_gpu_status(key[-2]))
            old = self.gn_written.get(name)
            if old != (spec, status):
                if name in self.gn_exists:    # an update: budgeted and paced (creating is not)
                    may, self.gn_bucket = events.take(self.gn_bucket, time.monotonic(), limits)
                    if not may:
                        self.gn_behind = True
                        break
                    self.gn_patched[name] = time.monotonic()
                if not self._gn_write(name, spec, status, old):
                    continue
                self.gn_written[name] = (spec, status)
            self.gn_inputs[name] = key
            del self.gn_waiting[name]
        metrics.GENERIC_NODES_BEHIND.set(len(self.gn_waiting))
        metrics.GENERIC_NODES_LAG.set(now - min(self.gn_waiting.values(), default=now))

    def _gn_write(self, name: str, spec: dict, status: dict, old: tuple | None) -> bool:
        """Create or patch one GenericNode.  False: someone else created or
        deleted it meanwhile (written on the next pass)."""
        try:
            if name not in self.gn_exists:
                self.kube.create_generic_node(name, spec, status)
                self.gn_exists.add(name)
            else:
                old_spec, old_status = old or (None, {})
                patch = dict(status)
                patch.update({k: None for k in old_status if k not in status})
                self.kube.patch_generic_node(
                    name, spec=spec if spec != old_spec else None, status=patch)
        except ApiException as e:
            if e.status == 409:    # created by someone else meanwhile: patch next time
                self.gn_exists.add(name)
            elif e.status == 404:  # deleted meanwhile: create next time
                self.gn_exists.discard(name)
                self.gn_written.pop(name, None)
                self.gn_inputs.pop(name, None)
            else:
                raise
            return False
        return True

    def _gn_delete_unshared(self, inputs: dict) -> None:
        """Delete ours whose node is no longer shared."""
        for name in sorted(set(self.gn_written) - set(inputs)):
            self.kube.delete_generic_node(name)
            self.gn_written.pop(name)
            self.gn_inputs.pop(name, None)
            self.gn_exists.discard(name)
