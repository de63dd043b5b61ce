"""`pyk8sres sync`: keep Slurm and Kubernetes honest on shared nodes.

Kubernetes -> Slurm: each shared node's Kubernetes share in the ledger
(inside slurmctld, next to its jobs) = the requests of the pods bound there,
keyed by pod UID.  Slurm -> Kubernetes: one GenericNode per shared node
shows both sides' allocations.

Level-triggered: watches keep an in-memory cache current and wake the loop;
every cycle recomputes which node is which and what pods hold there from
the cache and Slurm's current view (pure: usage.desired_state), then sets
only the shares that differ (every repair_seconds also those the ledger may
hold otherwise, which expires reservations that never became bound pods).
A pod event recomputes only the Slurm nodes its pods count on.

Threads: one informer per kind (pods, nodes) fills the cache (cache.py); a
poller re-reads Slurm's nodes every resync period; the main thread
reconciles and sets the shares; one writer thread updates GenericNodes
(both in threads.py).  So neither a slow `scontrol show node` nor a slow
API server delays the reaction to a pod.  The settings are config.py's,
which node is which mapping.py's; all Kubernetes calls live in kube.py,
all Slurm calls in slurm.py.

Safety rules: while the Kubernetes data is not trusted (no list yet, a
watch broken, an unparsable pod on the node) a node's share only grows;
the ledger is journaled inside slurmctld, so neither a restarting slurmctld
nor a restarting daemon hands pods' capacity to jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import time

from . import mapping
from . import metrics
from . import slurm
from .allocatable import BeyondAllocatable
from .backstop import Backstop, add_fences
from .cache import Cache
from .config import (ConfigError, SyncConfig, exemptions_of, fill_from_slurm_conf, gpu_identity,
                     whole_node_gpu_resources,
                     load_config)
from .events import Recorder
from .generic_nodes import GenericNodes
from .worker_moves import WorkerMoves
from .gpus import GpuState, Holders
from .holds import Holds
from .kube import Informer, Kube, get_generic_node
from .threads import GenericNodeWriter, SlurmPoller
from ..policy import backstop
from ..policy import departures
from ..policy import events
from ..policy import gpus
from ..policy import ledger
from ..policy import usage
from ..policy import workers as worker_pods

log = logging.getLogger("pyk8sres.coordinator.sync")


# ----------------------------------------------------------------- reconcile

class Reconciler(GenericNodes, WorkerMoves):
    """One cycle: desired = f(cache, Slurm); set each node's Kubernetes share
    in the ledger (slurmctld holds it next to its jobs); update GenericNodes.

    The ledger is the memory: it survives our restarts, so a restarted
    daemon starts from what slurmctld already holds and never hands
    capacity back on missing data."""

    def __init__(self, cfg: SyncConfig, cache: Cache, slurm, kube=None, ledger=None):
        self.cfg, self.cache, self.slurm, self.kube = cfg, cache, slurm, kube
        self.ledger = ledger
        self.last_set: dict[str, dict[str, tuple[int, int]]] = {}
        self.last_repair = 0.0
        self.oversubscribed: dict[str, bool] = {}
        self.warned: set[str] = set()
        # What Slurm offers beyond each Kubernetes node's allocatable, held.
        self.allocatable = BeyondAllocatable()
        self.gn_init(cfg)
        self.cluster = cfg.cluster_name
        self.applied_total = 0
        self.slurm_view = None   # name -> SlurmNode as of the last refresh
        self.slurm_view_at = -1e9   # monotonic time that read began (set after slurm_view)
        # (Kubernetes node, Slurm node) a worker left -> (its Slurm node as last
        # read, when that read began, when its jobs were): moves.step's inputs
        self.move_checks: dict[tuple[str, str], tuple] = {}
        self.ledger_nodes = None  # name -> the ledger's view of it (the poller's last show)
        self.gn_thread: GenericNodeWriter | None = None  # None: write inline
        self.events = None       # a Recorder (None: no Events)
        self.shared: dict[str, str] | None = None   # Slurm node -> Kubernetes node, last cycle
        self.over_lock = threading.Lock()
        self.over_flipped: set[str] = set()   # Slurm nodes whose flag changed since a GN pass
        self.last: usage.Desired | None = None   # the last cycle's decision
        self.last_full = -1e9      # monotonic time of the last cycle over every node
        self.last_healthy: bool | None = None
        self.failed = False        # the last cycle left a ledger or GenericNode write undone
        self.holds = Holds(cfg.departed_margin_seconds)
        self.seeded: set[str] = set()   # Slurm nodes whose ledger entries this process has read
        self.departure_ctx: tuple | None = None   # (mappings, Slurm view) of this cycle's departures
        self.backstop = Backstop(self._backstop_event)
        # Slurm nodes newly mapped while the pods' data is not trusted: held
        # whole (backstop.FENCE_KEY) until their pods are counted.
        self.fenced: set[str] = set()
        self.gpus = None   # a gpus.GpuState: claims' devices held in the ledger (None: off)
        # Slurm nodes of worker pods (worker_pods.unplaced), and those between
        # pods (a worker deleted, its successor not yet mapped): held whole.
        self.worker_nodes: frozenset = frozenset()
        self.unplaced: frozenset = frozenset()

    def _warn_new(self, warnings: list[str]) -> None:
        now = set(warnings)
        for w in sorted(now - self.warned):
            log.warning("%s", w)
        self.warned = now

    def cycle(self, refresh: bool = True, dirty: set[str] | None = None) -> usage.Desired | None:
        """One reconcile.  refresh=False reuses the Slurm view of the last
        read (the poller replaces it when Slurm's side changed): pod events
        then cost no `scontrol show node`; the periodic refresh still catches
        anything Slurm changed on its own (restart, reconfigure, jobs).
        dirty: when only pods changed, the Kubernetes nodes they are on
        (Cache.take_dirty): only their Slurm nodes are recomputed, so a pod
        costs O(its node), not O(cluster); None recomputes everything."""
        with metrics.RECONCILE_SECONDS.time():
            return self._cycle(refresh, dirty)

    def _cycle(self, refresh: bool, dirty: set[str] | None) -> usage.Desired | None:
        if refresh or self.slurm_view is None:
            try:
                read_at = time.monotonic()
                self.slurm_view = {n.name: n for n in self.slurm.list_nodes()}
                self.slurm_view_at = read_at
                self.backstop.read_completing(self.slurm, self.slurm_view)
            except Exception as e:  # slurmctld down: nothing we can do this cycle
                log.warning("cannot read Slurm nodes: %s", e)
                metrics.RECONCILE_ERRORS.labels("slurm_read").inc()
                return None
        view_at = self.slurm_view_at   # first: set after the view, never newer than it
        view = self.slurm_view   # replaced, never changed in place: safe to share
        if dirty is not None and self.last is not None and not refresh:
            return self._cycle_pods(dirty, view)
        k8s_usage, knodes, healthy = self.cache.snapshot()
        before = self.last.mapping if self.last else {}
        # What the last cycle counted where, for moves (_release_moves).
        counted = (self.shared or {}) if self.last_healthy and not self.failed else {}
        self.last_full, self.last_healthy, self.failed = time.monotonic(), healthy, False
        found = self.cache.worker_pods() if self.cfg.worker_pods else None
        d = usage.desired_state(
            k8s_usage, knodes, list(view.values()),
            key=self.cfg.node_key, map_by_name=self.cfg.map_by_name, node_map=self.cfg.node_map,
            workers=found, before=before)
        self._warn_new(d.warnings)
        self.allocatable.note_nodes(knodes)
        self.allocatable.note_over(d.over_allocatable, self.events.generic_node
                                   if self.events is not None else None)
        if found is not None:
            self.worker_nodes, self.unplaced = worker_pods.unplaced(
                self.worker_nodes, found, d.mapping, view, healthy)
        self.shared = mapping.by_slurm_node(d.k8s_to_slurm)
        if self.last is not None:
            self.fenced |= {s for k, s in d.k8s_to_slurm.items() if before.get(k) != s}
        self._hold_departures((before, d.mapping), view)
        self.holds.keep_mappings(before, d.mapping, self.cache.has_pods, time.monotonic(),
                                 lambda s: getattr(view.get(s), "slurmd_start", ""))
        self.holds.forget_unknown(view)
        self._forget_unknown(view)
        self._release_moves(view, view_at, counted)
        self.set_shares(d, healthy)
        if healthy and not self.failed and any(
                counted.get(s) != self.shared.get(s) for _, s in self.holds.moves):
            self.cache.mark_all()    # placed again: a moved worker's old pods may go next
        self._publish(d, view, healthy)
        self.last = d
        return d

    def _counted_here(self, d: usage.Desired) -> dict[str, tuple[str, ...]]:
        """Slurm node -> the Kubernetes nodes whose pods count on it: those
        mapped to it, those that lost their mapping while their pods count
        where they were, and those whose departed pods are held there (their
        allocatable bounds it as before).  d.here itself unless something
        is kept: a pod event's cycle costs O(holds) here, not O(nodes)."""
        extra: dict[str, set[str]] = {}
        for k, kept in self.holds.sticky.items():
            for s in kept:
                extra.setdefault(s, set()).add(k)
        for s in self.holds.nodes():
            extra.setdefault(s, set()).update(self.holds.k8s_nodes_on(s))
        if not extra:
            return d.here
        out = dict(d.here)
        for s, ks in extra.items():
            out[s] = tuple(sorted(ks.union(out.get(s, ()))))
        return out

    def idle_cycle_due(self) -> bool:
        """With no event since the last cycle: is a cycle over every node
        due anyway?  Only if something changed that raises no event (a
        watch went silent), a write failed, a held share's time is up, or
        idle_full_seconds passed; O(holds), so an idle daemon costs nothing
        per node each second."""
        now = time.monotonic()
        due = self.holds.next_due()
        return (self.last is None or self.failed
                or (self.cache.not_ready() is None) != self.last_healthy
                or (due is not None and now >= due)
                or now - self.last_full >= self.cfg.idle_full_seconds)

    def _hold_departures(self, mappings: tuple, view: dict,
                         advance: bool | None = True) -> set[str]:
        """Hold the shares of the pods that left since the last call
        (policy/departures.py) on every Slurm node their Kubernetes node
        counted on (under any of `mappings`, or kept), and move the holds on
        as their nodes stand: advance True (a full cycle) always, None (a
        pod event's cycle) only when one is due, False never.  Returns the
        Slurm nodes whose held entries changed.  O(departures), plus
        O(holds) when advancing."""
        self.departure_ctx = (mappings, view)
        now = time.monotonic()
        departed = self.cache.take_departures()
        if advance is None:
            due = self.holds.next_due()
            advance = due is not None and now >= due
        names = {pu.node for pu, _ in departed} | (self.holds.k8s_nodes() if advance else set())
        states = self.cache.node_states(names)
        changed = set()
        for pu, wall in departed:
            where = mapping.counted_on(self.cfg, pu.node, mappings, view)
            where |= self.holds.kept_for(pu.node)
            cpu_m, mem = usage.ledger_entry(pu)
            held = departures.first_hold(cpu_m, mem, pu.node, pu.grace, pu.kill_by,
                                states.get(pu.node, departures.ABSENT), now=now, wall=wall,
                                margin=self.cfg.departed_margin_seconds,
                                whole_gpus=pu.whole_gpus)
            self.holds.add(where, pu.uid, held)
            changed |= where
        return changed | (self.holds.advance(states, now) if advance else set())

    def _cycle_pods(self, dirty: set[str], view: dict) -> usage.Desired:
        """The cycle for pod changes only: the Slurm nodes those pods count
        on are recomputed from the cache, the rest is the last decision
        (nodes and mapping change only through a full cycle).  Costs
        O(the nodes touched), whatever the size of the cluster."""
        last = self.last
        touched = {s for k in dirty
                   for s in mapping.counted_on(self.cfg, k, (last.mapping,), view)}
        touched |= {s for k in dirty for s in self.holds.kept_for(k)}
        touched |= self._hold_departures((last.mapping,), view, advance=None)
        if not touched:
            return last
        part, healthy = self.cache.usage_of(usage.counting_on(touched, last.mapping, last.here))
        d = dataclasses.replace(last, usage=usage.refreshed_usage(
            last.usage, part, touched, last.mapping, view, self.cfg.map_by_name))
        self.set_shares(d, healthy, only=touched)
        self._publish(d, view, healthy, only={k for s in touched for k in d.here.get(s, ())})
        self.last = d
        return d

    def _publish(self, d: usage.Desired, view: dict, healthy: bool,
                 only: set[str] | None = None) -> None:
        """GenericNodes: of every node, or only of these Kubernetes nodes."""
        if self.kube is not None and self.cfg.generic_nodes and healthy:
            self.gn_note_beyond({s: self.holds.entries(s) for s in self.holds.nodes()},
                                self.backstop.completing_now())
            if self.gn_thread is None:
                self.sync_generic_nodes_safe(d, view, only)
            else:
                self.gn_thread.offer(d, view, only)

    def wanted_shares(self, d: usage.Desired, healthy: bool,
                      only: set[str] | None = None) -> dict[str, dict]:
        """Slurm node -> (the entries (pod UID -> millicores, bytes) it should
        carry: the pods bound there, how long the ledger keeps reservations
        not seen bound).  While a node's data is not trusted (no list yet, a
        broken or silent watch, an unparsable pod there) it only gains
        entries: fail closed, never hand capacity back on missing data.
        only: just these Slurm nodes."""
        if only is None:
            wanted: dict[str, dict] = {name: {} for name in self.last_set}
            pairs = list(d.k8s_to_slurm.items())
        else:
            wanted = {name: {} for name in only if name in self.last_set}
            pairs = [(k, s) for s in only for k in d.here.get(s, ())]
        # A node that lost its mapping keeps counting its pods where it was.
        pairs += [(k, s) for k, kept in self.holds.sticky.items() for s in kept
                  if only is None or s in only]
        for k8s_name, slurm_name in pairs:
            wanted.setdefault(slurm_name, {}).update(self.cache.entries(k8s_name))
        # A pod that left while the entries were read is in neither: its
        # departure is taken only now, after them.
        if self.departure_ctx is not None:
            self._hold_departures(*self.departure_ctx, advance=False)
        for name in self.holds.nodes():
            if only is None or name in only:
                wanted[name] = {**self.holds.entries(name), **wanted.get(name, {})}
        for name in self.unplaced:
            if only is None or name in only:
                wanted.setdefault(name, {})
        if only is not None:
            for name in only:
                wanted.setdefault(name, {})
        self._add_claims(wanted, d, only)
        # A node whose whole-node pods' GPUs cannot be told is left as it is.
        wanted, blind = gpus.whole_node_wanted(wanted, self.ledger_nodes or {}, self.last_set)
        # Slurm's own beyond its jobs' GRES, its capacity beyond allocatable,
        # then a worker's node between pods held whole (backstop.py).
        view = self.slurm_view or {}
        self.backstop.add(wanted, view, self.ledger_nodes or {})
        self.allocatable.add(wanted, self._counted_here(d), view)
        add_fences(wanted, self.unplaced, view)
        out = {}
        for name, entries in wanted.items():
            if name in blind:
                continue
            if healthy and not (d.usage.get(name) or usage.NodeUsage()).errors:
                out[name] = (entries, self.cfg.reservation_grace)
            elif name in self.last_set:
                # What this process set there plus what it sees, and every
                # reservation kept: the share cannot go down.
                out[name] = ({**self.last_set[name], **entries}, ledger.MAX_KEEP_SECONDS)
            elif (name in self.fenced or name in self.unplaced) and (
                    fence := backstop.fence(self.slurm_view.get(name))):
                # Newly mapped, its pods not yet counted, or a worker's node
                # possibly between pods: no job starts there.
                out[name] = ({backstop.FENCE_KEY: fence}, ledger.MAX_KEEP_SECONDS)
            # else: never set by this process (it just started, or the ledger
            # failed): the ledger keeps what it holds until the data is trusted.
        return out

    def _add_claims(self, wanted: dict[str, dict], d: usage.Desired,
                    only: set[str] | None) -> None:
        """The GPUs of the claims allocated on each node (claim:<uid> ->
        (0, 0, [indices])).  While the claims or slices are not trusted,
        what this process set there is kept: never hand a GPU back on
        missing data."""
        if self.gpus is None:
            return
        trusted = self.gpus.trusted()
        pairs = {k: s for k, s in d.k8s_to_slurm.items() if only is None or s in only}
        got = self.gpus.entries(pairs, self.ledger_nodes or {}) if trusted else {}
        for name in set(wanted) | set(got):
            if only is not None and name not in only:
                continue
            if trusted:
                e = got.get(name) or {}
            else:
                e = {k: v for k, v in (self.last_set.get(name) or {}).items()
                     if k.startswith(gpus.CLAIM_KEY_PREFIX)}
            if e:
                wanted.setdefault(name, {}).update(e)

    def _backstop_event(self, name: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.generic_node(self.k8s_name(name), reason, message)

    def set_shares(self, d: usage.Desired, healthy: bool, only: set[str] | None = None) -> None:
        """Apply the differences to the ledger; only: just these Slurm nodes.
        Every repair_seconds a full cycle also re-sends the unchanged
        shares the ledger may hold otherwise (ledger.repair_needed: reservations
        never seen bound expire that way), or all of them when the poller
        has no `show` of the ledger."""
        if self.ledger is None:
            return
        now = time.monotonic()
        repair = only is None and now - self.last_repair >= self.cfg.repair_seconds
        shown = self.ledger_nodes or {}
        for name, (entries, keep) in sorted(self.wanted_shares(d, healthy, only).items()):
            if name not in self.seeded and keep != ledger.MAX_KEEP_SECONDS:
                if not self._seed(name, entries, now):
                    self.failed = True
                    continue
                entries, told = gpus.whole_node_entries({**self.holds.entries(name), **entries},
                                                        shown.get(name), self.last_set.get(name))
                if not told:
                    continue
            if self.last_set.get(name) == entries and not (
                    repair and ledger.repair_needed(shown.get(name), entries)):
                continue
            try:
                reply = self.ledger.set(name, entries, keep)
            except Exception as e:  # slurmctld down: retried next cycle, nothing handed back
                log.warning("cannot set the Kubernetes share of %s: %s", name, e)
                metrics.RECONCILE_ERRORS.labels("ledger_set").inc()
                self.last_set.pop(name, None)
                self.failed = True
                if self.events is not None:
                    self.events.generic_node(
                        self.k8s_name(name), events.LEDGER_UNREACHABLE,
                        f"cannot hold the pods' share of Slurm node {name} in Slurm's ledger "
                        f"({e}); the node keeps what the ledger last held, and no pod is "
                        "admitted on it until the ledger answers")
                continue
            if ledger.not_ready(reply):
                # Nothing read or changed: the ledger replays what it acknowledged,
                # so last_set stays true; any difference is sent again next cycle
                # (every resync_seconds at the latest).
                log.warning("cannot set the Kubernetes share of %s yet: %s (%s); kept, retried",
                            name, ledger.NOT_READY_TEXT, reply.get("error"))
                metrics.RECONCILE_ERRORS.labels("ledger_not_ready").inc()
                self.failed = True
                continue
            if not reply.get("ok"):
                log.warning("ledger refused the share of %s: %s", name, reply.get("error"))
                metrics.RECONCILE_ERRORS.labels("ledger_refused").inc()
                self.failed = True
                continue
            share = reply.get("share") or {}
            if self.last_set.get(name) != entries:
                self.applied_total += 1
                log.info("node %s: Kubernetes share set (%d pods): k8scpu=%s k8smemory=%s", name,
                         len(entries), share.get("cpu"), share.get("mem"))
            self.note_oversubscribed(name, bool(reply.get("oversubscribed")),
                                     f"pods bound there hold {share.get('cpu')} CPUs and "
                                     f"{share.get('mem')} MB")
            self.last_set[name] = entries
            self.gn_note_set(name, entries)
            if keep != ledger.MAX_KEEP_SECONDS:
                self.fenced.discard(name)     # its pods are counted
        if repair:
            self.last_repair = now

    def _forget_unknown(self, view) -> None:
        """Slurm nodes slurmctld no longer has (scontrol delete node, a
        worker scaled in) are no longer sent: the ledger would refuse each
        `set` every cycle.  Should the name come back, it is read and set
        afresh, and what the ledger still holds under it stands until then."""
        for name in [n for n in self.last_set if n not in view]:
            del self.last_set[name]
            self.fenced.discard(name)
            self.seeded.discard(name)

    def _seed(self, name: str, entries: dict, now: float) -> bool:
        """Before this process first replaces what the ledger holds on a node:
        hold every entry there with no bound pod behind it (a pod that left
        while no sync ran) as a forced delete would be.  False: the ledger
        could not say, so nothing is set there this cycle."""
        try:
            reply = self.ledger.show(name)
        except Exception as e:
            log.warning("cannot read the ledger's entries on %s: %s", name, e)
            return False
        if not reply.get("ok"):
            return False
        view = (reply.get("nodes") or {}).get(name) or {}
        k8s = self.k8s_name(name)
        held = (view.get("entries") or {}).get(backstop.KEY)
        if held and backstop.KEY not in entries:
            entries.update(self.backstop.inherit(name, tuple(held[:2])))
        beyond = (view.get("entries") or {}).get(backstop.BEYOND_KEY)
        entries.update(self.allocatable.inherit(name, beyond and tuple(beyond[:2]), entries))
        for uid, e in (view.get("entries") or {}).items():
            # A claim's devices come from the claims watch (allocated or not).
            if uid.startswith(gpus.CLAIM_KEY_PREFIX):
                continue
            cpu_m, mem = e[0], e[1]
            if uid not in entries and uid not in backstop.KEYS:
                # Its grace period and node unknown: the default, counted from now.
                self.holds.add([name], uid, departures.first_hold(
                    cpu_m, mem, k8s, departures.DEFAULT_GRACE, None, departures.READY, now=now,
                    wall=time.time(), margin=self.cfg.departed_margin_seconds,
                    whole_gpus=len(e) > 2 and bool(e[2])))
        self.seeded.add(name)
        return True

    def k8s_name(self, slurm_name: str) -> str:
        """The Kubernetes node (and GenericNode) a Slurm node is shared as."""
        return mapping.k8s_name(self.shared, slurm_name)

    def note_oversubscribed(self, name: str, over: bool, detail: str) -> None:
        """Record what the ledger said of Slurm node `name` (from set or show):
        log, gauge, counter and Event when it becomes oversubscribed, an Event
        again (its count bumped) while it stays so."""
        over = over and name not in self.unplaced   # held whole on purpose, jobs or not
        with self.over_lock:
            was = self.oversubscribed.get(name, False)
            self.oversubscribed[name] = over
            if over != was:
                self.over_flipped.add(name)
        metrics.NODE_OVERSUBSCRIBED.labels(name).set(1 if over else 0)
        if not over:
            return
        if not was:
            metrics.OVERSUBSCRIPTION_DETECTED.labels(name).inc()
            log.error("node %s is oversubscribed: pods bound there hold more than Slurm's "
                      "jobs leave (a pod bound without admission, or a static pod); "
                      "no new job starts there until they leave", name)
        detail += self.allocatable.detail(name)
        if self.events is not None:
            self.events.generic_node(
                self.k8s_name(name), events.OVERSUBSCRIBED,
                f"Slurm node {name} is oversubscribed: {detail}, more than Slurm's jobs leave "
                "(a pod bound without admission, or a static pod); no new job starts there "
                "until they leave")

    def observe_ledger(self, shown: dict) -> None:
        """Node gauges and oversubscription from the ledger's show() of
        every node (the poller's, kept by a slurm.ShowFollower)."""
        if ledger.not_ready(shown):   # says nothing of any node: gauges and flags kept
            raise RuntimeError(f"ledger show: {ledger.NOT_READY_TEXT}: {shown.get('error')}")
        if not shown.get("ok"):
            raise RuntimeError(f"ledger show: {shown.get('error')}")
        shared = self.shared
        metrics.NODES.update(shown, only=set(shared) if shared is not None else None)
        for name, v in (shown.get("nodes") or {}).items():
            if v.get("unknown") or (shared is not None and name not in shared):
                continue
            over = bool(v.get("oversubscribed"))
            if not over and not self.oversubscribed.get(name, False):
                continue     # nothing to record, the common case: no message built
            share, jobs, cap = v["share"], v["jobs"], v["capacity"]
            self.note_oversubscribed(
                name, over,
                f"pods hold {share['cpu']} CPUs and {share['mem']} MB, Slurm jobs "
                f"{jobs['cpu']} CPUs and {jobs['mem']} MB, of {cap['cpu']} CPUs and "
                f"{cap['mem']} MB")

# ----------------------------------------------------------------- daemon

def run(cfg: SyncConfig, slurm, kube, stop: threading.Event, once: bool = False) -> int:
    cache = Cache(exemptions_of(cfg), cfg.node_key, whole_node_gpu_resources(cfg))
    rec = Reconciler(cfg, cache, slurm, kube,
                     ledger=slurm.Ledger(cfg.ledger_socket, timeout=cfg.request_timeout))
    rec.gpus = GpuState(gpu_identity(cfg), cfg.placeholder_namespace, cache.changed)
    if once:
        ok = True
        for handler, kinds in ((cache, Cache.KINDS), (rec.gpus, GpuState.KINDS)):
            for kind in kinds:
                try:
                    items, _ = kube.list(kind)
                    handler.replace(kind, items)
                except Exception as e:
                    log.error("cannot list %s: %s", kind, e)
                    ok = False
        return 0 if rec.cycle() is not None and ok else 1

    metrics.HEALTH.check("watches", cache.not_ready)
    metrics.HEALTH.check("ledger", metrics.ledger_check(
        3 * cfg.metrics_seconds + 2 * cfg.request_timeout))
    informers = [Informer(kube, k, cache, cfg.watch_timeout, cfg.backoff_max, stop)
                 for k in ("nodes", "pods")]
    informers += [Informer(kube, k, rec.gpus, cfg.watch_timeout, cfg.backoff_max, stop)
                  for k in GpuState.KINDS]
    holders = Holders(kube, rec.gpus)
    rec.gpus.on_fence = lambda knode, why: rec.events and rec.events.generic_node(
        knode, events.GPUS_FENCED,
        f"GPUs of node {knode} fenced: {why}; every allocation of them is refused and every "
        "one is held for Slurm until the published devices map one to one onto Slurm's")
    cache.stale_after = informers[0].stale_after()
    for i in informers:
        i.start()
    if cfg.events:
        def uid_of(name):
            return ((get_generic_node(kube, name) or {}).get("metadata") or {}).get("uid")
        # Node conditions last: one write a minute per node at most.
        rec.events = Recorder(kube, "pyk8sres-sync",
                              events.Limits(update_interval=cfg.event_update_seconds),
                              uid_of=uid_of).start()
    rec.gn_thread = GenericNodeWriter(rec, stop)
    rec.gn_thread.start()
    alive = max(60.0, 20 * cfg.resync_seconds)
    # Its own thread: a slow API server never delays the ledger.
    holders_wake = threading.Event()
    threading.Thread(target=keep_holders, args=(rec, holders, holders_wake, cfg.resync_seconds,
                                                stop), name="gpu-holders", daemon=True).start()
    SlurmPoller(rec, cfg.resync_seconds, stop,
                slurm.Ledger(cfg.ledger_socket, timeout=cfg.request_timeout),
                cfg.metrics_seconds, alive, cfg.slurm_read_seconds, holders_wake).start()
    while not stop.is_set():
        metrics.HEALTH.beat("reconcile", alive)
        woke = cache.changed.wait(timeout=cfg.resync_seconds)
        if stop.is_set():
            break
        if woke and cfg.debounce_seconds:
            time.sleep(cfg.debounce_seconds)
        cache.changed.clear()
        # The poller keeps rec.slurm_view fresh (and marks everything dirty);
        # a cycle only reads Slurm itself when it has no view yet.  Any
        # change but pods' recomputes everything, and so does a wake by
        # timeout when a full cycle is due (rec.idle_cycle_due).
        gpu_changed = rec.gpus.take_changed()
        if gpu_changed:
            holders_wake.set()
        if not woke and not rec.idle_cycle_due():
            continue
        dirty = cache.take_dirty()
        # A claim allocated or released: every node (claims carry no pod's node).
        rec.cycle(refresh=False, dirty=None if gpu_changed or not woke else dirty)
    if rec.events is not None:
        rec.events.stop()
    return 0


def keep_holders(rec: Reconciler, holders: Holders, wake: threading.Event, period: float,
                 stop: threading.Event) -> None:
    """The holder claims of Slurm's GPUs, from the ledger's last show, each
    period and when a claim or slice changes; not while Slurm's side is
    unknown (nothing deleted on missing data)."""
    while not stop.is_set():
        wake.wait(period)
        wake.clear()
        if rec.ledger_nodes is None or rec.last is None:
            continue
        try:
            holders.sync(rec.last.k8s_to_slurm, rec.ledger_nodes,
                         rec.backstop.gpus_completing(),
                         {s: gpus.pod_indices(e) for s, e in dict(rec.last_set).items()})
        except Exception:
            log.exception("holder claims not synced")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="pyk8sres sync",
        description="Hold the requests of the pods bound to each node in Slurm's ledger "
                    "and publish Slurm allocations as GenericNode objects.")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, "
                                        "then $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument("--config", help="TOML file with SyncConfig settings")
    p.add_argument("--once", action="store_true", help="one reconcile, then exit")
    p.add_argument("--ledger-socket", help="the ledger's socket (default: from slurm.conf: "
                                           "StateSaveLocation/k8s_resources.socket)")
    p.add_argument("--cluster-name", help="GenericNode spec.clusterName (default: Slurm's)")
    p.add_argument("--resync", type=float, dest="resync_seconds",
                   help="seconds between checks of the watches and retries of failed writes")
    p.add_argument("--no-generic-nodes", action="store_false", dest="generic_nodes",
                   default=None, help="do not write GenericNode objects")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="plain HTTP /metrics, /healthz, /readyz (default 127.0.0.1:9710; "
                        "'' for none)")
    p.add_argument("--no-events", action="store_false", dest="events", default=None,
                   help="post no Kubernetes Events")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(a.config)
    except (OSError, ConfigError) as e:
        print(f"pyk8sres sync: {e}", file=sys.stderr)
        return 2
    overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(SyncConfig)
                 if getattr(a, f.name, None) is not None}
    try:
        cfg = fill_from_slurm_conf(dataclasses.replace(cfg, **overrides))
    except (OSError, ValueError) as e:  # a bad k8s_resources.conf
        print(f"pyk8sres sync: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s pyk8sres sync: %(levelname)s %(message)s")

    if cfg.metrics_address and not a.once:
        try:
            metrics.serve(cfg.metrics_address)
        except (OSError, ValueError) as e:
            print(f"pyk8sres sync: metrics address {cfg.metrics_address}: {e}", file=sys.stderr)
            return 2
    kube = Kube(cfg.kubeconfig, cfg.context, cfg.request_timeout)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("starting: ledger %s, resync %.1fs", cfg.ledger_socket, cfg.resync_seconds)
    return run(cfg, slurm, kube, stop, once=a.once)


if __name__ == "__main__":
    raise SystemExit(main())
