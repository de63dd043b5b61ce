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

Threads: one informer per kind (pods, nodes) fills the cache; a poller
re-reads Slurm's nodes every resync period; the main thread reconciles and
sets the shares; one writer thread updates GenericNodes.  So neither a
slow `scontrol show node` nor a slow API server delays the reaction to a
pod.  All Kubernetes calls live in kube.py, all Slurm calls in slurm.py.

Safety rules: while the Kubernetes data is not trusted (no list yet, a
watch broken, an unparsable pod on the node) a node's share only grows;
the ledger is journaled inside slurmctld, so neither a restarting slurmctld
nor a restarting daemon hands pods' capacity to jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import tomllib
from typing import Mapping

from . import metrics
from .backstop import Backstop
from .holds import Holds
from .permissions import error_text
from ..policy import backstop
from ..policy import departures as D
from ..policy import events as E
from ..policy import ledger as L
from ..policy import usage as U

log = logging.getLogger("pyk8sres.coordinator.sync")
# GenericNodes edited or deleted by someone else are put back within this
# long (sooner for one deleted whose node changes: that write gets 404 and
# the next pass creates it).  One list costs 0.2 s of CPU at 3,000 nodes
# (2 MB of JSON), ~7 MB at 10,000: too much for every minute.
# 5 minutes is also how often a kubelet reports an unchanged node.
GN_RELIST_SECONDS = 300.0


# ----------------------------------------------------------------- config

@dataclasses.dataclass
class SyncConfig:
    kubeconfig: str | None = None          # None: in-cluster, else ~/.kube/config
    context: str | None = None
    # None: as k8s_resources.conf next to slurm.conf says, so the daemon
    # and the slurmctld plugin agree.
    ledger_socket: str | None = None
    # Node mapping, admin-owned only: node_map (here), else the node label
    # node_key (must be under node-restriction.kubernetes.io/: kubelets cannot
    # set it), else the same name (map_by_name).  Annotations are never read.
    node_key: str = U.NODE_LABEL
    node_map: dict = dataclasses.field(default_factory=dict)   # k8s node -> Slurm node
    map_by_name: bool = True
    # Pods that hold nothing (Slurm's own workers): "namespace" or
    # "namespace/serviceaccount" entries.  Nothing a pod creator sets counts.
    slurm_workers: list = dataclasses.field(default_factory=list)
    placeholder_namespace: str = "pyk8sres-placeholders"  # slurm-share-<node> pods (the chart's)
    cluster_name: str | None = None             # GenericNode spec.clusterName; None: Slurm's
    resync_seconds: float = 1.0     # check health and retry failures even without events
    # Recompute every node at least this often even when nothing changed
    # (events, Slurm's view and the watches' health recompute at once).
    idle_full_seconds: float = 30.0
    # Read every Slurm node at least this often; each resync period in
    # between only if the ledger saw a node change (a job, a capacity).
    slurm_read_seconds: float = 10.0
    # Re-send unchanged shares this often where the ledger's show says it
    # may hold something else (reservations not seen bound, another share).
    repair_seconds: float = 30.0
    reservation_grace: float = 30.0  # keep an admitted pod's reservation this long before it
                                     # shows up bound (the webhook reserves before binding)
    # A pod that left the API server before its containers were seen gone (a
    # forced delete, pod GC after its Node went) keeps its share for what is
    # left of its grace period plus this long: the kubelet's own delay in
    # noticing and killing (policy/departures.py).  At least
    # kube-controller-manager's node-monitor-grace-period, so that a node
    # partitioned as the pod went is seen NotReady (and waited for) before
    # the hold ends.
    departed_margin_seconds: float = 60.0
    debounce_seconds: float = 0.005  # let a burst of pod events land in one cycle
    request_timeout: float = 10.0   # client-side timeout of every API call
    watch_timeout: int = 15         # server-side watch duration: a watch silent for this
                                    # plus request_timeout is stale (nothing released)
    backoff_max: float = 30.0
    generic_nodes: bool = True      # write GenericNode objects
    # GenericNode writes per second, sustained and at once (kube-controller-
    # manager's client defaults) for updates: under a burst of pods each
    # node's object lags, updated oldest change first with its newest state,
    # instead of one API write per pod.  Creating a node's object (once) is
    # not budgeted; the ledger and the placeholders are never throttled.
    generic_node_qps: float = 20.0
    generic_node_burst: int = 30
    create_crd: bool = True         # create the GenericNode CRD if missing
    metrics_address: str = "127.0.0.1:9710"   # /metrics, /healthz, /readyz over HTTP ("": none)
    metrics_seconds: float = 5.0    # how often the ledger's show() refreshes the node gauges
    events: bool = True             # post Kubernetes Events (oversubscribed, ledger unreachable)
    event_update_seconds: float = 60.0   # a repeated node Event's count is written this often
    log_level: str = "INFO"


class ConfigError(ValueError):
    pass


def load_config(path: str | None, base: SyncConfig | None = None) -> SyncConfig:
    """SyncConfig from a TOML file (keys as the field names; '-' may be '_').

    Unknown keys and wrong types are errors: a typo must not change policy.
    """
    cfg = base or SyncConfig()
    if not path:
        return cfg
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from e
    doc = doc.get("sync", doc)  # allow an optional [sync] table
    fields = {f.name: f for f in dataclasses.fields(SyncConfig)}
    values = {}
    for k, v in doc.items():
        name = k.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{path}: unknown setting {k!r} (known: {', '.join(fields)})")
        default = getattr(SyncConfig(), name)
        want = type(default) if default is not None else str
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{path}: {k} must be {want.__name__}, not {v!r}")
        values[name] = v
    out = dataclasses.replace(cfg, **values)
    try:
        U.check_node_label(out.node_key)
        exemptions_of(out)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    if out.reservation_grace <= out.watch_timeout + out.request_timeout:
        raise ConfigError(f"{path}: reservation_grace ({out.reservation_grace} s) must exceed "
                          f"watch_timeout + request_timeout ({out.watch_timeout} + "
                          f"{out.request_timeout} s): a silent watch must be caught before an "
                          "admitted pod's reservation may expire")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out.node_map.items()):
        raise ConfigError(f"{path}: node_map maps Kubernetes node names to Slurm node names (strings)")
    if not (out.generic_node_qps > 0 and out.generic_node_burst >= 1):
        raise ConfigError(f"{path}: generic_node_qps must be > 0 and generic_node_burst >= 1 "
                          "(generic_nodes = false writes none)")
    return out


def exemptions_of(cfg: SyncConfig) -> U.Exemptions:
    return U.exemptions(cfg.slurm_workers, cfg.placeholder_namespace)


def fill_from_slurm_conf(cfg: SyncConfig) -> SyncConfig:
    """Take the ledger socket from slurm.conf/k8s_resources.conf where not set."""
    slurm_conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    return dataclasses.replace(
        cfg, ledger_socket=cfg.ledger_socket or _slurm().ledger_socket_path(slurm_conf))


def _slurm():
    from . import slurm
    return slurm


# ----------------------------------------------------------------- cache

class Cache:
    """What the watches told us, reduced to what the policy needs.

    Pods are stored as PodUsage (node + requests as ints), nodes as the few
    metadata fields the mapping reads: 30,000 pods fit in a few MB.  Per-node
    sums are kept as events arrive, so a reconcile costs O(nodes), not O(pods).
    Implements the Informer handler interface (replace/event/health).
    """

    KINDS = ("pods", "nodes")

    def __init__(self, exempt: U.Exemptions = U.Exemptions(), node_key: str = U.NODE_LABEL):
        self.exempt = exempt
        self.node_key = node_key
        self.lock = threading.Lock()
        self.pods: dict[str, U.PodUsage] = {}
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
        self.departed: list[tuple[U.PodUsage, float]] = []

    # -- reducing objects
    @staticmethod
    def _key(obj: Mapping) -> str:
        m = obj.get("metadata") or {}
        return f"{m.get('namespace', '')}/{m.get('name', '')}"

    def _pod(self, obj: Mapping) -> U.PodUsage | None:
        pu = U.pod_usage(obj, self.exempt)
        if pu is not None and pu.error:
            old = self.pods.get(self._key(obj))
            if old is None or old.error != pu.error:
                log.warning("%s; its node keeps its last applied counts", pu.error)
        return pu

    def _account(self, key: str, pu: U.PodUsage, sign: int) -> None:
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
            s[3][pu.uid] = U.ledger_entry(pu)
        else:
            s[3].pop(pu.uid, None)
        if s[0] == 0 and s[1] == 0 and not s[2] and not s[3] and sign < 0:
            del self.sums[pu.node]

    # -- Informer handler interface
    def slim(self, kind: str, obj: dict):
        """Reduce one listed object to what we keep: (key, value or None)."""
        if kind == "pods":
            return self._key(obj), self._pod(obj)
        return (obj.get("metadata") or {}).get("name"), U.slim_node(obj, self.node_key, state=True)

    def replace(self, kind: str, items: list[dict]) -> None:
        self.replace_slim(kind, [self.slim(kind, o) for o in items])

    def replace_slim(self, kind: str, items: list[tuple]) -> None:
        new = {k: v for k, v in items if v is not None}
        with self.lock:
            if kind == "pods":
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
            new = U.slim_node(obj, self.node_key, state=True)
        with self.lock:
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
                    if new is None and not old.error and not D.containers_gone(obj):
                        self.departed.append((old, time.time()))
                if new is not None:
                    self._account(key, new, +1)
            else:
                self.dirty = None
        self.changed.set()

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
    def _node_usage(s: list) -> U.NodeUsage:
        return U.NodeUsage(s[0], s[1], tuple(s[2].values()))

    def snapshot(self) -> tuple[dict[str, U.NodeUsage], dict[str, dict], bool]:
        """(usage per Kubernetes node, slim nodes, healthy)."""
        with self.lock:
            usage = {n: self._node_usage(s) for n, s in self.sums.items()}
            return usage, dict(self.nodes), self._healthy()

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

    def usage_of(self, k8s_nodes) -> tuple[dict[str, U.NodeUsage], bool]:
        """(usage of these Kubernetes nodes, healthy): snapshot() for a few."""
        with self.lock:
            usage = {n: self._node_usage(s) for n in k8s_nodes if (s := self.sums.get(n))}
            return usage, self._healthy()

    def entries(self, k8s_node: str) -> dict[str, tuple[int, int]]:
        """Pod UID -> (millicores, bytes) of the pods bound to `k8s_node`."""
        with self.lock:
            s = self.sums.get(k8s_node)
            return dict(s[3]) if s else {}

    def has_pods(self, k8s_node: str) -> bool:
        with self.lock:
            return k8s_node in self.sums

    def take_departures(self) -> list[tuple[U.PodUsage, float]]:
        """The pods that left without their containers seen gone since the
        last call, each with the wall time it was seen leaving."""
        with self.lock:
            out, self.departed = self.departed, []
            return out

    def node_states(self, names) -> dict[str, str]:
        """Kubernetes node -> its departures state (Ready, unreachable,
        fenced), for these nodes; one without an object is left out (ABSENT)."""
        with self.lock:
            return {k: n.get("state", D.READY) for k in names if (n := self.nodes.get(k))}


# ----------------------------------------------------------------- reconcile

class Reconciler:
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
        self.gn_written: dict[str, tuple[dict, dict]] | None = None
        self.gn_exists: set[str] = set()
        self.gn_inputs: dict[str, tuple] = {}   # what each written body was built from
        self.gn_listed = 0.0
        self.gn_waiting: dict[str, float] = {}  # node -> when its object fell behind
        self.gn_bucket = E.Bucket(float(cfg.generic_node_burst), time.monotonic())
        self.gn_behind = False   # the last pass ran out of write budget
        self.cluster = cfg.cluster_name
        self.applied_total = 0
        self.slurm_view = None   # name -> SlurmNode as of the last refresh
        self.ledger_nodes = None  # name -> the ledger's view of it (the poller's last show)
        self.gn_thread: GenericNodeWriter | None = None  # None: write inline
        self.events = None       # events.Recorder (None: no Events)
        self.shared: dict[str, str] | None = None   # Slurm node -> Kubernetes node, last cycle
        self.over_lock = threading.Lock()
        self.over_flipped: set[str] = set()   # Slurm nodes whose flag changed since a GN pass
        self.last: U.Desired | None = None   # the last cycle's decision
        self.last_full = -1e9      # monotonic time of the last cycle over every node
        self.last_healthy: bool | None = None
        self.failed = False        # the last cycle left a ledger or GenericNode write undone
        self.holds = Holds(cfg.departed_margin_seconds)
        self.seeded: set[str] = set()   # Slurm nodes whose ledger entries this process has read
        self.departure_ctx: tuple | None = None   # (mappings, Slurm view) of this cycle's departures
        self.backstop = Backstop(self._backstop_event)

    def _warn_new(self, warnings: list[str]) -> None:
        now = set(warnings)
        for w in sorted(now - self.warned):
            log.warning("%s", w)
        self.warned = now

    def cycle(self, refresh: bool = True, dirty: set[str] | None = None) -> U.Desired | None:
        """One reconcile.  refresh=False reuses the Slurm view of the last
        read (the poller replaces it when Slurm's side changed): pod events
        then cost no `scontrol show node`; the periodic refresh still catches
        anything Slurm changed on its own (restart, reconfigure, jobs).
        dirty: when only pods changed, the Kubernetes nodes they are on
        (Cache.take_dirty): only their Slurm nodes are recomputed, so a pod
        costs O(its node), not O(cluster); None recomputes everything."""
        with metrics.RECONCILE_SECONDS.time():
            return self._cycle(refresh, dirty)

    def _cycle(self, refresh: bool, dirty: set[str] | None) -> U.Desired | None:
        if refresh or self.slurm_view is None:
            try:
                self.slurm_view = {n.name: n for n in self.slurm.list_nodes()}
                self.backstop.read_completing(self.slurm, self.slurm_view)
            except Exception as e:  # slurmctld down: nothing we can do this cycle
                log.warning("cannot read Slurm nodes: %s", e)
                metrics.RECONCILE_ERRORS.labels("slurm_read").inc()
                return None
        view = self.slurm_view   # replaced, never changed in place: safe to share
        if dirty is not None and self.last is not None and not refresh:
            return self._cycle_pods(dirty, view)
        k8s_usage, knodes, healthy = self.cache.snapshot()
        self.last_full, self.last_healthy, self.failed = time.monotonic(), healthy, False
        d = U.desired_state(
            k8s_usage, knodes, list(view.values()),
            key=self.cfg.node_key, map_by_name=self.cfg.map_by_name, node_map=self.cfg.node_map)
        self._warn_new(d.warnings)
        self.shared = {s: k for k, s in d.k8s_to_slurm.items()}
        before = self.last.mapping if self.last else {}
        self._hold_departures((before, d.mapping), view)
        self.holds.keep_mappings(before, d.mapping, self.cache.has_pods)
        self.holds.forget_unknown(view)
        self.set_shares(d, healthy)
        self._publish(d, view, healthy)
        self.last = d
        return d

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
            where = {s for m in mappings
                     if (s := U.slurm_node_of(pu.node, m, view, self.cfg.map_by_name))}
            where |= self.holds.kept_for(pu.node)
            cpu_m, mem = U.ledger_entry(pu)
            held = D.first_hold(cpu_m, mem, pu.node, pu.grace, pu.kill_by,
                                states.get(pu.node, D.ABSENT), now=now, wall=wall,
                                margin=self.cfg.departed_margin_seconds)
            self.holds.add(where, pu.uid, held)
            changed |= where
        return changed | (self.holds.advance(states, now) if advance else set())

    def _cycle_pods(self, dirty: set[str], view: dict) -> U.Desired:
        """The cycle for pod changes only: the Slurm nodes those pods count
        on are recomputed from the cache, the rest is the last decision
        (nodes and mapping change only through a full cycle).  Costs
        O(the nodes touched), whatever the size of the cluster."""
        last = self.last
        touched = {s for k in dirty
                   if (s := U.slurm_node_of(k, last.mapping, view, self.cfg.map_by_name))}
        touched |= {s for k in dirty for s in self.holds.kept_for(k)}
        touched |= self._hold_departures((last.mapping,), view, advance=None)
        if not touched:
            return last
        part, healthy = self.cache.usage_of(U.counting_on(touched, last.mapping, last.here))
        d = dataclasses.replace(last, usage=U.refreshed_usage(
            last.usage, part, touched, last.mapping, view, self.cfg.map_by_name))
        self.set_shares(d, healthy, only=touched)
        self._publish(d, view, healthy, only={k for s in touched for k in d.here.get(s, ())})
        self.last = d
        return d

    def _publish(self, d: U.Desired, view: dict, healthy: bool,
                 only: set[str] | None = None) -> None:
        """GenericNodes: of every node, or only of these Kubernetes nodes."""
        if self.kube is not None and self.cfg.generic_nodes and healthy:
            if self.gn_thread is None:
                self.sync_generic_nodes_safe(d, view, only)
            else:
                self.gn_thread.offer(d, view, only)

    def wanted_shares(self, d: U.Desired, healthy: bool,
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
        if only is not None:
            for name in only:
                wanted.setdefault(name, {})
        self._add_backstop(wanted)
        out = {}
        for name, entries in wanted.items():
            if healthy and not (d.usage.get(name) or U.NodeUsage()).errors:
                out[name] = (entries, self.cfg.reservation_grace)
            elif name in self.last_set:
                # What this process set there plus what it sees, and every
                # reservation kept: the share cannot go down.
                out[name] = ({**self.last_set[name], **entries}, L.MAX_KEEP_SECONDS)
            # else: never set by this process (it just started, or the ledger
            # failed): the ledger keeps what it holds until the data is trusted.
        return out

    def _add_backstop(self, wanted: dict[str, dict]) -> None:
        """What Slurm allocated on each node beyond what its jobs hold as
        k8scpu/k8smemory (policy/backstop.py), as one more entry there."""
        view, shown = self.slurm_view or {}, self.ledger_nodes or {}
        for name, entries in wanted.items():
            held = self.backstop.entry(name, view.get(name), (shown.get(name) or {}).get("jobs"))
            if held is not None:
                entries[backstop.KEY] = held

    def _backstop_event(self, name: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.generic_node(self.k8s_name(name), reason, message)

    def set_shares(self, d: U.Desired, healthy: bool, only: set[str] | None = None) -> None:
        """Apply the differences to the ledger; only: just these Slurm nodes.
        Every repair_seconds a full cycle also re-sends the unchanged
        shares the ledger may hold otherwise (L.repair_needed: reservations
        never seen bound expire that way), or all of them when the poller
        has no `show` of the ledger."""
        if self.ledger is None:
            return
        now = time.monotonic()
        repair = only is None and now - self.last_repair >= self.cfg.repair_seconds
        shown = self.ledger_nodes or {}
        for name, (entries, keep) in sorted(self.wanted_shares(d, healthy, only).items()):
            if name not in self.seeded and keep != L.MAX_KEEP_SECONDS:
                if not self._seed(name, entries, now):
                    self.failed = True
                    continue
                entries = {**self.holds.entries(name), **entries}
            if self.last_set.get(name) == entries and not (
                    repair and L.repair_needed(shown.get(name), entries)):
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
                        self.k8s_name(name), E.LEDGER_UNREACHABLE,
                        f"cannot hold the pods' share of Slurm node {name} in Slurm's ledger "
                        f"({e}); the node keeps what the ledger last held, and no pod is "
                        "admitted on it until the ledger answers")
                continue
            if L.not_ready(reply):
                # Nothing read or changed: the ledger replays what it acknowledged,
                # so last_set stays true; any difference is sent again next cycle
                # (every resync_seconds at the latest).
                log.warning("cannot set the Kubernetes share of %s yet: %s (%s); kept, retried",
                            name, L.NOT_READY_TEXT, reply.get("error"))
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
        if repair:
            self.last_repair = now

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
        for uid, (cpu_m, mem) in (view.get("entries") or {}).items():
            if uid not in entries and uid != backstop.KEY:
                # Its grace period and node unknown: the default, counted from now.
                self.holds.add([name], uid, D.first_hold(
                    cpu_m, mem, k8s, D.DEFAULT_GRACE, None, D.READY, now=now,
                    wall=time.time(), margin=self.cfg.departed_margin_seconds))
        self.seeded.add(name)
        return True

    def k8s_name(self, slurm_name: str) -> str:
        """The Kubernetes node (and GenericNode) a Slurm node is shared as."""
        return (self.shared or {}).get(slurm_name, slurm_name)

    def note_oversubscribed(self, name: str, over: bool, detail: str) -> None:
        """Record what the ledger said of Slurm node `name` (from set or show):
        log, gauge, counter and Event when it becomes oversubscribed, an Event
        again (its count bumped) while it stays so."""
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
        if self.events is not None:
            self.events.generic_node(
                self.k8s_name(name), E.OVERSUBSCRIBED,
                f"Slurm node {name} is oversubscribed: {detail}, more than Slurm's jobs leave "
                "(a pod bound without admission, or a static pod); no new job starts there "
                "until they leave")

    def observe_ledger(self, shown: dict) -> None:
        """Node gauges and oversubscription from the ledger's show() of
        every node (the poller's, kept by a slurm.ShowFollower)."""
        if L.not_ready(shown):   # says nothing of any node: gauges and flags kept
            raise RuntimeError(f"ledger show: {L.NOT_READY_TEXT}: {shown.get('error')}")
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

    def sync_generic_nodes_safe(self, d, view, only=None) -> None:
        try:
            self.sync_generic_nodes(d, view, only)
        except Exception as e:  # API down, conflicts: retried on the next cycle
            log.warning("GenericNode update failed: %s", error_text(e))
            metrics.RECONCILE_ERRORS.labels("generic_nodes").inc()
            self.failed = True

    def gn_refill_seconds(self) -> float:
        """How long until the GenericNode write budget has a token again."""
        return E.until_token(self.gn_bucket, time.monotonic(), self.gn_limits())

    def gn_limits(self) -> E.Limits:
        return E.Limits(rate=self.cfg.generic_node_qps, burst=self.cfg.generic_node_burst)

    def sync_generic_nodes(self, d: U.Desired, view: dict, only: set[str] | None = None) -> None:
        """Make GenericNodes match (write only what changed).  view: Slurm
        node name -> node.  only: look at just these Kubernetes nodes, the
        ones still waiting for the write budget, and those whose
        oversubscription flag flipped (a pod event: O(its node), not
        O(cluster)); None: every node, and delete what is no longer shared."""
        from .kube import MANAGED_BY
        from kubernetes.client.exceptions import ApiException
        if self.cluster is None:
            try:
                self.cluster = self.slurm.cluster_name()
            except Exception:
                self.cluster = ""
        if self.gn_written is not None and time.monotonic() - self.gn_listed > GN_RELIST_SECONDS:
            self.gn_written = None   # re-read now and then: heals edits/deletes by others
        if self.gn_written is None:
            only = None     # after a (re-)list, look at every node
            if self.cfg.create_crd and not self.gn_listed:
                self.kube.ensure_crd()
            existing = self.kube.list_generic_nodes()
            self.gn_listed = time.monotonic()
            self.gn_inputs = {}
            self.gn_exists = set(existing)
            self.gn_written = {
                n: (o.get("spec") or {}, o.get("status") or {}) for n, o in existing.items()
                if all((o["metadata"].get("labels") or {}).get(k) == v
                       for k, v in MANAGED_BY.items())}
        with self.over_lock:
            flipped, self.over_flipped = self.over_flipped, set()
        if only is None:
            names = d.k8s_to_slurm
        else:
            names = set(only) | set(self.gn_waiting) | {
                k for s in flipped for k in d.here.get(s, ())}
        # Building 1000 bodies every cycle is the costly part: skip nodes
        # whose inputs are the same as when we last wrote them.
        inputs = {}
        for k in names:
            s = d.k8s_to_slurm.get(k)
            n = view.get(s)
            if n is not None:
                u = d.usage.get(s) or U.NodeUsage()
                inputs[k] = (s, n.cpus, n.real_memory, n.alloc_cpus, n.alloc_memory,
                             u.cpu, u.memory, self.cluster, self.oversubscribed.get(s, False))
        now = time.monotonic()
        stale = [n for n, key in inputs.items()
                 if self.gn_inputs.get(n) != key or n not in self.gn_written]
        self.gn_waiting = {n: self.gn_waiting.get(n, now) for n in stale}
        limits = self.gn_limits()
        self.gn_behind = False
        for name in sorted(stale, key=lambda n: (self.gn_waiting[n], n)):
            key = inputs[name]
            spec, status = U.generic_node_body(name, view[key[0]], d.usage.get(key[0]),
                                               self.cluster, oversubscribed=key[-1])
            old = self.gn_written.get(name)
            if old == (spec, status):
                self.gn_inputs[name] = key
                del self.gn_waiting[name]
                continue
            if name in self.gn_exists:   # creating (once per node) is not budgeted
                may, self.gn_bucket = E.take(self.gn_bucket, time.monotonic(), limits)
                if not may:     # the rest waits for the next pass, oldest first
                    self.gn_behind = True
                    break
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
                continue
            self.gn_written[name] = (spec, status)
            self.gn_inputs[name] = key
            del self.gn_waiting[name]
        metrics.GENERIC_NODES_BEHIND.set(len(self.gn_waiting))
        metrics.GENERIC_NODES_LAG.set(now - min(self.gn_waiting.values(), default=now))
        for name in sorted(set(self.gn_written) - set(inputs) if only is None else ()):
            self.kube.delete_generic_node(name)
            self.gn_written.pop(name)
            self.gn_inputs.pop(name, None)
            self.gn_exists.discard(name)


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

    def run(self) -> None:
        last = None
        while not self.stop_event.is_set():
            # Out of write budget: the same decision again once a token is
            # back, and not before; that pass looks only at the nodes still
            # waiting.
            behind = self.rec.gn_behind and last is not None
            if behind:
                self.stop_event.wait(min(1.0, self.rec.gn_refill_seconds()))
            elif not self.wake.wait(0.5):
                continue
            self.wake.clear()
            with self.lock:
                job, self.pending = self.pending, None
            if job is not None:
                last = job
                self.rec.sync_generic_nodes_safe(*job)
            elif behind:
                self.rec.sync_generic_nodes_safe(last[0], last[1], set())


# ----------------------------------------------------------------- daemon

def run(cfg: SyncConfig, slurm, kube, stop: threading.Event, once: bool = False) -> int:
    from .kube import Informer
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    rec = Reconciler(cfg, cache, slurm, kube,
                     ledger=slurm.Ledger(cfg.ledger_socket, timeout=cfg.request_timeout))
    if once:
        ok = True
        for kind in Cache.KINDS:
            try:
                items, _ = kube.list(kind)
                cache.replace(kind, items)
            except Exception as e:
                log.error("cannot list %s: %s", kind, e)
                ok = False
        return 0 if rec.cycle() is not None and ok else 1

    metrics.HEALTH.check("watches", cache.not_ready)
    metrics.HEALTH.check("ledger", metrics.ledger_check(
        3 * cfg.metrics_seconds + 2 * cfg.request_timeout))
    informers = [Informer(kube, k, cache, cfg.watch_timeout, cfg.backoff_max, stop)
                 for k in ("nodes", "pods")]
    cache.stale_after = informers[0].stale_after()
    for i in informers:
        i.start()
    if cfg.events:
        from . import kube as K
        from .events import Recorder

        def uid_of(name):
            return ((K.get_generic_node(kube, name) or {}).get("metadata") or {}).get("uid")
        # Node conditions last: one write a minute per node at most.
        rec.events = Recorder(kube, "pyk8sres-sync",
                              E.Limits(update_interval=cfg.event_update_seconds),
                              uid_of=uid_of).start()
    rec.gn_thread = GenericNodeWriter(rec, stop)
    rec.gn_thread.start()
    alive = max(60.0, 20 * cfg.resync_seconds)
    SlurmPoller(rec, cfg.resync_seconds, stop,
                slurm.Ledger(cfg.ledger_socket, timeout=cfg.request_timeout),
                cfg.metrics_seconds, alive, cfg.slurm_read_seconds).start()
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
        if not woke and not rec.idle_cycle_due():
            continue
        dirty = cache.take_dirty()
        rec.cycle(refresh=False, dirty=dirty if woke else None)
    if rec.events is not None:
        rec.events.stop()
    return 0


class SlurmPoller(threading.Thread):
    """Re-reads every Slurm node when the ledger saw one change, and at
    least every `read_period`, then wakes the loop.

    Each resync period it asks the ledger which nodes changed (a `show`
    since its last token: a job started or ended, a capacity moved, the
    node table changed, slurmctld restarted).  Only then, or once
    `read_period` has passed (for what the ledger does not follow), does it
    read every node: ~150 ms at 1000 nodes (scontrol plus parsing), which
    every second was most of this daemon's idle CPU.  Done here, it never
    delays the reaction to a pod.  A view that differs from the last one
    triggers a full cycle: that is what re-applies counts after a slurmctld
    restart or reconfigure, and refreshes the Slurm side of the
    GenericNodes.  An unchanged view triggers one only when the repair is
    due (repair_seconds): a full cycle costs O(cluster).
    """

    def __init__(self, rec: Reconciler, period: float, stop: threading.Event,
                 ledger=None, metrics_period: float = 5.0, alive: float = 60.0,
                 read_period: float = 10.0):
        super().__init__(name="slurm-poller", daemon=True)
        self.rec, self.period, self.stop_event = rec, period, stop
        self.metrics_period, self.alive, self.read_period = metrics_period, alive, read_period
        self.follower = _slurm().ShowFollower(ledger) if ledger is not None else None
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
        return any(_slurm_side(before.get(n)) != _slurm_side(self.shown["nodes"].get(n))
                   for n in changed)

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
            if self.stop_event.wait(self.period):
                return
            # While the backstop holds something, every period: so that it
            # lets go as soon as Slurm's processes are gone.
            if (not moved and not self.rec.backstop.holding()
                    and time.monotonic() - read_at < self.read_period):
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
            if unchanged and time.monotonic() - marked_at < self.rec.cfg.repair_seconds:
                # What jobs hold moved without Slurm's nodes changing (the
                # ledger's count read before the nodes): those nodes' backstop
                # entries are recomputed.
                if moved and self.changed:
                    self.rec.cache.mark(self.rec.k8s_name(n) for n in self.changed)
                continue
            marked_at = time.monotonic()
            self.rec.cache.mark_all()


def _slurm_side(view: dict | None) -> tuple:
    """What a node's ledger view says of Slurm (not of the pods' share)."""
    view = view or {}
    return view.get("unknown"), view.get("capacity"), view.get("jobs")


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

    from . import slurm
    from .kube import Kube
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
