"""The sync daemon's logic without any server: the cache fed with watch
events, the reconcile decision, and a reconcile cycle against an in-memory
Slurm whose ledger is the real one (pyk8sres.slurmctld.ledger, journal on
disk) -- we check what the 'cluster' ends up leaving to jobs, not the calls.
The real slurmctld is tested in tests/integration."""

import dataclasses
import time
from dataclasses import dataclass, field
from fractions import Fraction as F

import pytest

from pyk8sres.coordinator import slurm as S
from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import ConfigError, SyncConfig, exemptions_of, load_config
from pyk8sres.coordinator.threads import GenericNodeWriter
from pyk8sres.policy import ledger as L
from pyk8sres.slurmctld.ledger import Ledger
from pyk8sres.policy import usage as U

MI = 1024 * 1024


def N(*cores):
    """cores -> nanocores, the unit PodUsage/NodeUsage use."""
    return int(F(*cores) * 10**9)


@dataclass(frozen=True)
class SNode:
    name: str
    cpus: int = 4
    real_memory: int = 8000
    gres: dict = field(default_factory=lambda: {"k8scpu": 4, "k8smemory": 8000})
    gres_used: dict = field(default_factory=dict)
    alloc_cpus: int = 0
    alloc_memory: int = 0
    state: str = "IDLE"
    reported_gres: dict = field(default_factory=lambda: {"k8scpu": 4, "k8smemory": 8000})


class SlurmWorld:
    """An in-memory Slurm: nodes, and the real ledger code keeping their
    Kubernetes share on disk; 'restart' reloads it, like slurmctld does."""

    def __init__(self, directory, *names):
        self.nodes = {n: SNode(n) for n in names}
        self.directory = directory
        self.restart()
        world = self

        class WorldLedger(S.Ledger):   # the real client, talking in-process
            def __init__(self):
                pass

            def call(self, op, **fields):
                ticket, reply = world.core.prepare(0, L.encode(op, **fields))
                return reply if not ticket else world.core.apply(
                    ticket, world.facts, lambda *a: None, node_names=lambda: world.nodes)
        self.ledger = WorldLedger()

    def facts(self, name):
        n = self.nodes.get(name)
        return None if n is None else L.Facts(n.gres["k8scpu"], n.gres["k8smemory"],
                                              n.gres_used.get("k8scpu", 0),
                                              n.gres_used.get("k8smemory", 0))

    def list_nodes(self):
        return list(self.nodes.values())

    def cluster_name(self):
        return "c1"

    def restart(self):
        self.core = Ledger(self.directory)
        self.core.load()

    def counts(self, name):
        """What the node leaves to Slurm jobs: capacity minus Kubernetes' share."""
        facts = self.facts(name)
        share = L.applied(L.share_units(self.core.nodes.get(name, {})), facts)
        return facts.capacity_cpu - share[0], facts.capacity_mem - share[1]


def pod(name, node, cpu="1", mem="1Gi", phase="Running", labels=None, ns="ns"):
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {},
                         "resourceVersion": "1", "uid": f"uid-{name}"},
            "spec": {"nodeName": node,
                     "containers": [{"name": "c", "resources": {
                         "requests": {"cpu": cpu, "memory": mem}}}]},
            "status": {"phase": phase, **({"containerStatuses": [
                {"name": "c", "state": {"terminated": {"exitCode": 0}}}]}
                if phase in ("Succeeded", "Failed") else {})}}


def knode(name, **labels):
    return {"metadata": {"name": name, "annotations": {}, "labels": {"x": "y", **labels}}}


@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2", "n3")
    cfg = SyncConfig(ledger_socket="unused")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("k8s-b", **{cfg.node_key: "n2"})])
    cache.replace("pods", [])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    return slurm, cache, rec, cfg


# ----------------------------------------------------------------- cache

def test_cache_tracks_watch_events():
    c = Cache(U.exemptions(["slurm"]))
    c.replace("pods", [pod("a", "n1"), pod("u", None), pod("done", "n1", phase="Succeeded")])
    c.replace("nodes", [])
    assert set(c.pods) == {"ns/a"}
    c.changed.clear()
    c.event("pods", "MODIFIED", pod("a", "n1"))          # nothing we count changed
    assert not c.changed.is_set()
    c.event("pods", "ADDED", pod("b", "n1", cpu="2"))
    assert c.changed.is_set() and c.pods["ns/b"].cpu == 2 * 10**9
    c.event("pods", "MODIFIED", pod("b", "n1", phase="Failed"))
    c.event("pods", "ADDED", pod("w", "n1", ns="slurm"))
    c.event("pods", "ADDED", pod("l", "n1", labels={"pyk8sres.io/slurm-worker": "true"}))
    assert c.pods["ns/l"].cpu == 10**9       # a label exempts nothing
    c.event("pods", "DELETED", pod("l", "n1", phase="Succeeded"))
    c.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))
    usage, nodes, healthy = c.snapshot()
    assert usage == {} and c.pods == {} and healthy


def test_cache_health_needs_both_lists_and_live_watches():
    c = Cache()
    assert not c.snapshot()[2]
    c.replace("pods", [])
    assert not c.snapshot()[2]                 # nodes never listed
    c.replace("nodes", [])
    assert c.snapshot()[2]
    c.health("pods", False)
    assert not c.snapshot()[2]
    c.health("pods", True)
    assert c.snapshot()[2]


def test_cache_keeps_only_mapping_fields_of_nodes():
    c = Cache(node_key="k")
    c.replace("nodes", [{"metadata": {"name": "a", "labels": {"k": "n1", "big": "x" * 1000},
                                      "annotations": {"other": "y"}}, "status": {"x": 1}}])
    assert c.nodes == {"a": {"metadata": {"name": "a", "labels": {"k": "n1"}}}}


# ----------------------------------------------------------------- desired_state

def test_desired_state_table():
    nodes = [SNode("n1"), SNode("n2"), SNode("n3"), SNode("n4", gres={}, reported_gres={})]
    knodes = {"n1": knode("n1"), "k8s-b": knode("k8s-b", **{U.NODE_LABEL: "n2"}),
              "kx": knode("kx"), "n4": knode("n4"),
              "k8s-z": knode("k8s-z", **{U.NODE_LABEL: "nowhere"})}
    pods = [U.PodUsage("n1", N(1735, 1000), 2393 * MI),
            U.PodUsage("k8s-b", N(1), 1000 * MI),
            U.PodUsage("k8s-b", 0, 0, error="pod x/y: malformed quantity 'lots'"),
            U.PodUsage("n3", N(2), 0),                  # no node object: counts by name
            U.PodUsage("kx", N(3), 0)]                  # unmapped node: ignored
    d = U.desired_state(U.usage_by_k8s_node(pods), knodes, nodes)
    assert d.usage == {"n1": U.NodeUsage(N(1735, 1000), 2393 * MI),
                       "n2": U.NodeUsage(N(1), 1000 * MI, ("pod x/y: malformed quantity 'lots'",)),
                       "n3": U.NodeUsage(N(2), 0)}
    assert d.k8s_to_slurm == {"n1": "n1", "k8s-b": "n2", "n4": "n4"}
    assert d.mapping == {"n1": "n1", "k8s-b": "n2", "kx": None, "n4": "n4", "k8s-z": None}
    assert len(d.warnings) == 3
    assert any("n2" in w and "lots" in w for w in d.warnings)        # its share only grows
    assert any(w.startswith("node n4: no k8scpu") for w in d.warnings)
    assert any("k8s-z" in w for w in d.warnings)                    # label names no node
    d = U.desired_state(U.usage_by_k8s_node(pods), knodes, nodes, map_by_name=False)
    assert d.k8s_to_slurm == {"k8s-b": "n2"} and set(d.usage) == {"n2"}


# ----------------------------------------------------------------- reconcile cycles

def test_reconcile_walkthrough(world):
    slurm, cache, rec, cfg = world
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000) and slurm.counts("n2") == (4, 8000)

    cache.event("pods", "ADDED", pod("a", "n1", "1735m", "2393Mi"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 5607)
    cache.event("pods", "ADDED", pod("b", "n1", "1", "1024Mi"))
    rec.cycle()
    assert slurm.counts("n1") == (1, 4583)
    assert set(slurm.core.nodes["n1"]) == {"uid-a", "uid-b"}   # keyed by pod UID

    # slurmctld restart: the ledger comes back from its journal by itself.
    slurm.restart()
    assert slurm.counts("n1") == (1, 4583)
    rec.cycle()
    assert slurm.counts("n1") == (1, 4583)

    cache.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))
    cache.event("pods", "DELETED", pod("b", "n1", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_api_loss_never_hands_capacity_back(world, monkeypatch):
    slurm, cache, rec, _ = world
    cache.event("pods", "ADDED", pod("a", "n1", "2", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    cache.health("pods", False)
    cache.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))   # e.g. stale data before the loss
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    slurm.restart()                                   # and slurmctld restarts meanwhile
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    cache.event("pods", "ADDED", pod("c", "n1", "3", "0"))  # adding is always fine
    rec.cycle()
    assert slurm.counts("n1") == (0, 8000)   # a (unconfirmed gone) + c: clamped at 4
    cache.replace("pods", [])                          # relist: in sync again
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)   # c left unseen: held for its grace period
    later = time.monotonic() + 30 + rec.cfg.departed_margin_seconds
    monkeypatch.setattr(sync.time, "monotonic", lambda: later)
    assert rec.idle_cycle_due()
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_repair_resends_only_the_shares_the_ledger_may_hold_otherwise(world):
    slurm, cache, rec, cfg = world
    clock = [1000.0]
    slurm.core.clock = lambda: clock[0]
    cache.event("pods", "ADDED", pod("a", "n1", "1", "0"))
    rec.cycle()
    sent = []
    real_set = slurm.ledger.set
    slurm.ledger.set = lambda node, *a: sent.append(node) or real_set(node, *a)

    def repair(shown=True):
        sent.clear()
        rec.ledger_nodes = slurm.ledger.show()["nodes"] if shown else None
        rec.last_repair = -1e9
        rec.cycle()
        return sorted(sent)

    assert repair() == []                        # the ledger holds what we set
    assert repair(shown=False) == ["n1", "n2"]   # no show to tell: every node
    slurm.ledger.reserve("n2", "admitted-never-bound", 1000, 0)
    clock[0] += cfg.reservation_grace + 1
    assert slurm.counts("n2") == (3, 8000)
    assert repair() == ["n2"] and slurm.counts("n2") == (4, 8000)   # expired
    slurm.ledger.release("n1", "uid-a")          # by hand, or a journal lost
    assert repair() == ["n1"] and slurm.counts("n1") == (3, 8000)   # put back
    assert repair() == []


def test_malformed_pod_holds_its_node_only(world):
    slurm, cache, rec, _ = world
    cache.event("pods", "ADDED", pod("a", "n1", "1", "0"))
    cache.event("pods", "ADDED", pod("x", "k8s-b", "1", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (3, 8000) and slurm.counts("n2") == (3, 8000)
    cache.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))
    cache.event("pods", "ADDED", pod("bad", "n1", "lots", "0"))
    cache.event("pods", "DELETED", pod("x", "k8s-b", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("n1") == (3, 8000)     # held at last applied
    assert slurm.counts("n2") == (4, 8000)     # other nodes unaffected
    cache.event("pods", "DELETED", pod("bad", "n1", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_daemon_restart_remembers_state(world):
    slurm, cache, rec, cfg = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    slurm.restart()
    # New daemon process: nothing listed yet; the ledger keeps the share.
    cache2 = Cache()
    rec2 = sync.Reconciler(cfg, cache2, slurm, ledger=slurm.ledger)
    rec2.cycle()
    assert slurm.counts("n1") == (1, 8000)


def test_pods_beyond_what_jobs_leave_are_clamped_and_reported(world):
    slurm, cache, rec, _ = world
    slurm.nodes["n1"] = dataclasses.replace(slurm.nodes["n1"],
                                            gres_used={"k8scpu": 3, "k8smemory": 0})
    cache.event("pods", "ADDED", pod("a", "n1", "2", "0"))   # bound without admission
    rec.cycle()
    assert slurm.counts("n1") == (3, 8000)      # share clamped to the 1 CPU jobs leave
    assert rec.oversubscribed["n1"] is True
    shown = slurm.ledger.show("n1")["nodes"]["n1"]
    assert shown["oversubscribed"] and shown["free"] == {"cpu": 0, "mem": 8000}


def test_slurm_down_is_survivable(world):
    slurm, cache, rec, _ = world

    def boom():
        raise RuntimeError("slurmctld unreachable")
    slurm.list_nodes = boom
    assert rec.cycle() is None


# ----------------------------------------------------------------- config

def test_config_file(tmp_path):
    p = tmp_path / "sync.toml"
    p.write_text('resync_seconds = 2\nnode-key = "example.node-restriction.kubernetes.io/slurm"\n'
                 'slurm_workers = ["slurm", "hpc/slurmd"]\n'
                 '[node_map]\nk8s-a = "n1"\n')
    cfg = load_config(str(p))
    assert (cfg.resync_seconds, cfg.node_key) == (
        2.0, "example.node-restriction.kubernetes.io/slurm")
    assert cfg.node_map == {"k8s-a": "n1"}
    assert exemptions_of(cfg).worker_service_accounts == {("hpc", "slurmd")}
    p.write_text('[sync]\nmap_by_name = false\n')
    assert load_config(str(p)).map_by_name is False


@pytest.mark.parametrize("text", ['resync_secs = 1\n', 'map_by_name = "yes"\n',
                                  'reserve_cpus = 1\n', 'resync_seconds = true\n', 'x = \n',
                                  'node_key = "pyk8sres.io/slurm-node"\n',   # kubelet-writable
                                  'slurm_workers = "slurm"\n', 'slurm_workers = ["a/b/c"]\n',
                                  'slurm_worker_selector = "a=b"\n',
                                  'generic_node_qps = 0\n', 'generic_node_burst = 0\n'])
def test_config_rejects(tmp_path, text):
    p = tmp_path / "sync.toml"
    p.write_text(text)
    with pytest.raises(ConfigError):
        load_config(str(p))


def test_cli_flags_override(tmp_path, monkeypatch):
    a = sync.parse_args(["--once", "--ledger-socket", "/x", "--resync", "3", "--no-generic-nodes"])
    assert a.once and a.ledger_socket == "/x" and a.resync_seconds == 3 and a.generic_nodes is False


def test_cache_sums_match_a_full_recount():
    """Incremental per-node sums == summing the pods from scratch, after
    random adds, modifies, moves, terminal phases, bad data and deletes."""
    import random
    rnd = random.Random(7)
    c = Cache(U.exemptions(["slurm"]))
    c.replace("pods", [])
    c.replace("nodes", [])
    for _ in range(2000):
        name = f"p{rnd.randrange(40)}"
        if rnd.random() < 0.25:
            c.event("pods", "DELETED", pod(name, "n1", phase="Succeeded"))
            continue
        cpu = rnd.choice(["100m", "1", "1.5", "bad", "250m"])
        phase = rnd.choice(["Running", "Running", "Pending", "Succeeded"])
        c.event("pods", "MODIFIED", pod(name, rnd.choice(["n1", "n2", None]), cpu, "1Mi", phase))
    usage, _, _ = c.snapshot()
    assert usage == U.usage_by_k8s_node(c.pods.values())


def test_event_cycles_reuse_the_slurm_view(world):
    slurm, cache, rec, _ = world
    rec.cycle()                                   # refresh
    calls = []
    real = slurm.list_nodes
    slurm.list_nodes = lambda: calls.append(1) or real()
    cache.event("pods", "ADDED", pod("a", "n1", "1", "0"))
    rec.cycle(refresh=False)
    assert slurm.counts("n1") == (3, 8000) and calls == []
    slurm.restart()
    rec.cycle(refresh=False)
    rec.cycle(refresh=True)
    assert slurm.counts("n1") == (3, 8000)


def test_pod_cycles_touch_only_their_nodes_and_equal_a_full_cycle(world):
    """A cycle for pod changes recomputes only the Slurm nodes those pods
    count on (k8s-b maps to n2 by label; n3 has no Kubernetes node object,
    so its pods count by name; 'elsewhere' is no Slurm node), and leaves
    exactly what a full cycle would: same usage, nothing left for the full
    cycle to apply."""
    import random
    slurm, cache, rec, _ = world
    rec.cycle()
    cache.take_dirty()                             # what the daemon's loop does
    rnd = random.Random(11)
    sets, partial_sets = [], []
    real_set = slurm.ledger.set
    slurm.ledger.set = lambda node, *a, **k: sets.append(node) or real_set(node, *a, **k)
    for step in range(300):
        for _ in range(rnd.randrange(1, 4)):
            name = f"p{rnd.randrange(12)}"
            if rnd.random() < 0.3:
                cache.event("pods", "DELETED", pod(name, "n1", phase="Succeeded"))
            else:
                node = rnd.choice(["n1", "k8s-b", "n3", "elsewhere", None])
                cache.event("pods", "MODIFIED", pod(name, node, rnd.choice(["100m", "1", "2"]),
                                                    "100Mi"))
        dirty = cache.take_dirty()
        sets.clear()
        partial = rec.cycle(refresh=False, dirty=dirty)
        where = {U.slurm_node_of(k, partial.mapping, {"n1", "n2", "n3"}) for k in dirty}
        assert set(sets) <= where - {None}, (step, dirty, sets)
        partial_sets.append(len(sets))
        entries = {n: dict(slurm.core.nodes.get(n, {})) for n in ("n1", "n2", "n3")}
        applied = rec.applied_total
        full = rec.cycle(refresh=False, dirty=None)
        assert partial.usage == full.usage, step
        assert rec.applied_total == applied, step       # the full cycle had nothing to do
        assert {n: dict(slurm.core.nodes.get(n, {})) for n in ("n1", "n2", "n3")} == entries
    assert sum(partial_sets) > 100 and partial_sets.count(1) > 50   # one node, not all three


def test_cache_dirty_tracks_pod_nodes_and_anything_else_means_all():
    c = Cache()
    assert c.take_dirty() is None                  # nothing listed yet: everything
    c.replace("pods", [])
    c.replace("nodes", [])
    assert c.take_dirty() is None
    assert c.take_dirty() == set()
    c.event("pods", "ADDED", pod("a", "n1"))
    c.event("pods", "MODIFIED", pod("a", "n2"))    # moved: both nodes
    assert c.take_dirty() == {"n1", "n2"}
    c.event("pods", "MODIFIED", pod("a", "n2"))    # nothing counted changed
    assert c.take_dirty() == set()
    c.event("nodes", "ADDED", knode("n4"))
    assert c.take_dirty() is None
    c.health("pods", False)
    assert c.take_dirty() is None
    c.mark_all()
    assert c.take_dirty() is None


class GenericNodeStore:
    """Stands in for kube.Kube's GenericNode calls: the objects, and the
    writes in order."""

    def __init__(self):
        self.objects, self.writes = {}, []

    def ensure_crd(self):
        pass

    def list_generic_nodes(self):
        from pyk8sres.coordinator.kube import MANAGED_BY
        return {n: {"metadata": {"name": n, "labels": dict(MANAGED_BY)}, **o}
                for n, o in self.objects.items()}

    def create_generic_node(self, name, spec, status):
        self.writes.append(name)
        self.objects[name] = {"spec": spec, "status": status}

    def patch_generic_node(self, name, spec=None, status=None):
        self.writes.append(name)
        o = self.objects[name]
        o["spec"] = spec or o["spec"]
        o["status"] = {**o["status"], **{k: v for k, v in (status or {}).items() if v is not None}}


def publishing(tmp_path, count, **settings):
    """A Reconciler over `count` nodes without pods that writes GenericNodes
    to a GenericNodeStore: (slurm, cache, store, rec), after its first cycle."""
    names = [f"n{i}" for i in range(1, count + 1)]
    slurm = SlurmWorld(str(tmp_path), *names)
    cfg = SyncConfig(ledger_socket="unused", **settings)
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode(n) for n in names])
    cache.replace("pods", [])
    store = GenericNodeStore()
    rec = sync.Reconciler(cfg, cache, slurm, kube=store, ledger=slurm.ledger)
    rec.cluster = "c1"
    rec.cycle()
    return slurm, cache, store, rec


def test_generic_node_writes_keep_a_budget_oldest_change_first(tmp_path, monkeypatch):
    """A burst of pod changes on many nodes costs at most generic_node_burst
    writes at once and generic_node_qps after; the nodes left behind are
    written oldest change first, each with its newest state, and once the
    budget refills every object equals what Slurm and the pods hold."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    names = [f"n{i}" for i in range(1, 11)]
    slurm, cache, store, rec = publishing(tmp_path, 10, generic_node_qps=2.0,
                                          generic_node_burst=3)   # creating is not budgeted
    assert len(store.writes) == 10 and not rec.gn_behind
    for i, n in enumerate(reversed(names)):           # a burst: every node changes, n1 last
        now[0] += 0.001
        cache.event("pods", "ADDED", pod(f"p{i}", n, "1", "1Gi"))
        rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert len(store.writes) == 13 and rec.gn_behind  # three tokens
    assert "n1" not in store.writes[10:], "n1 changed last: the older ones go first"
    now[0] += 1.0                                     # two more tokens
    cache.event("pods", "ADDED", pod("late", "n2", "2", "1Gi"))   # n2 again: keeps its turn
    rec.cycle()
    assert len(store.writes) == 15
    for _ in range(10):
        now[0] += 1.0
        rec.cycle()
    assert not rec.gn_behind and len(store.writes) == 10 + 10     # each node once, newest state
    want = {n: U.generic_node_body(n, slurm.nodes[n], rec.last.usage.get(n), "c1") for n in names}
    assert {n: (o["spec"], o["status"]) for n, o in store.objects.items()} == want
    assert want["n2"][1]["allocatedResources"][1]["allocated"]["cpu"] == "3"
    writes = len(store.writes)
    now[0] += 100.0
    rec.cycle()
    assert len(store.writes) == writes                # nothing changed: nothing written


def test_generic_nodes_edited_or_deleted_by_hand_are_put_back_by_the_relist(tmp_path, monkeypatch):
    """sync owns its GenericNodes: one deleted or edited by someone else is
    put back once GN_RELIST_SECONDS have passed since the last list (not
    before: listing 10,000 of them is the costly part), and nothing else
    is written."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    slurm, cache, store, rec = publishing(tmp_path, 3)
    want = {n: dict(o) for n, o in store.objects.items()}
    del store.objects["n1"]
    store.objects["n2"] = {"spec": {"edited": True}, "status": {}}
    writes = len(store.writes)
    now[0] += sync.GN_RELIST_SECONDS - 1
    rec.cycle()
    assert len(store.writes) == writes and "n1" not in store.objects
    now[0] += 2
    rec.cycle()
    assert sorted(store.writes[writes:]) == ["n1", "n2"]
    assert store.objects == want


class LookedUp(dict):
    """A Slurm view that records which nodes a GenericNode pass looked at."""

    def __init__(self, *a):
        super().__init__(*a)
        self.looked = set()

    def get(self, name, default=None):
        self.looked.add(name)
        return super().get(name, default)


def test_pod_cycles_write_the_generic_nodes_of_their_nodes_only(tmp_path):
    """After a pod event the GenericNode pass looks at the node the pod is
    on, not at every node (O(its node) at 10,000 nodes), plus any node
    whose oversubscription flag flipped meanwhile without a pod event; and
    a full pass afterwards finds nothing left to write."""
    names = [f"n{i}" for i in range(1, 7)]
    slurm, cache, store, rec = publishing(tmp_path, 6)
    assert sorted(store.writes) == names
    cache.take_dirty()                                      # what the daemon's loop does
    rec.slurm_view = LookedUp(rec.slurm_view)

    cache.event("pods", "ADDED", pod("a", "n2", "1", "1Gi"))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert rec.slurm_view.looked == {"n2"} and store.writes[6:] == ["n2"]

    rec.slurm_view.looked.clear()
    rec.note_oversubscribed("n5", True, "a static pod")     # from the ledger's poller
    cache.event("pods", "ADDED", pod("b", "n2", "1", "1Gi"))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert rec.slurm_view.looked == {"n2", "n5"} and sorted(store.writes[7:]) == ["n2", "n5"]
    assert (store.objects["n5"]["spec"], store.objects["n5"]["status"]) == U.generic_node_body(
        "n5", slurm.nodes["n5"], None, "c1", oversubscribed=True)

    writes = len(store.writes)
    rec.cycle(refresh=False)                                # a full pass over every node
    assert rec.slurm_view.looked >= set(names) and len(store.writes) == writes


@pytest.mark.parametrize("offers, want", [
    ([{"a"}], {"a"}),
    ([{"a"}, {"b"}], {"a", "b"}),       # not yet written: the nodes of both
    ([{"a"}, None], None),              # a full pass covers any node
    ([None, {"b"}], None),
])
def test_generic_node_writer_folds_waiting_decisions(offers, want):
    import threading
    w = GenericNodeWriter(None, threading.Event())
    for i, only in enumerate(offers):
        w.offer(f"decision {i}", {}, only)
    assert w.pending == (f"decision {len(offers) - 1}", {}, want)


class ScriptedServer:
    """Stands in for kube.Kube at the informer's seam: each watch() call plays
    the next scripted stream; we check the cache the informer leaves behind."""

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)
        self.watch_rvs = []

    def list(self, kind, reduce=None):
        items, rv = self.lists.pop(0)
        return ([reduce(o) for o in items] if reduce else items), rv

    def watch(self, kind, rv, timeout):
        self.watch_rvs.append(rv)
        if not self.watches:
            raise ConnectionError("no more script")
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step

        def gen():
            for item in step:
                if isinstance(item, Exception):
                    raise item
                yield item
        return gen()


def test_informer_rewatch_relist_and_health():
    import threading
    from pyk8sres.coordinator.kube import Gone, Informer

    def ev(typ, name, rv, cpu="1"):
        p = pod(name, "n1", cpu)
        p["metadata"]["resourceVersion"] = rv
        return typ, p

    server = ScriptedServer(
        lists=[([pod("a", "n1")], "10"), ([pod("a", "n1"), pod("b", "n1")], "30"),
               ([pod("z", "n1", "3")], "50")],
        watches=[
            [ev("ADDED", "b", "11"), ("BOOKMARK", {"metadata": {"resourceVersion": "20"}})],
            [ConnectionResetError("api server went away")],
            [ev("DELETED", "a", "31"), Gone("too old")],
            [ev("ADDED", "y", "51")],
        ])
    c = Cache()
    c.replace("nodes", [])
    stop = threading.Event()
    inf = Informer(server, "pods", c, watch_timeout=1, backoff_max=0.01, stop=stop)
    inf.start()
    deadline = __import__("time").monotonic() + 5
    while server.watches and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    __import__("time").sleep(0.05)
    stop.set()
    inf.join(2)
    # A normal end resumes from the bookmark's rv; an error or 410 relists.
    assert server.watch_rvs[:4] == ["10", "20", "30", "50"]
    assert set(c.pods) == {"ns/z", "ns/y"}
    assert c.snapshot()[0]["n1"].cpu == 4 * 10**9
    assert inf.relists == 3


def test_informer_marks_the_cache_unhealthy_on_410_until_relisted():
    import threading
    from pyk8sres.coordinator.kube import Gone, Informer

    class Recorder(Cache):
        def __init__(self):
            super().__init__()
            self.calls = []

        def health(self, kind, ok):
            self.calls.append(("health", ok))
            super().health(kind, ok)

        def replace_slim(self, kind, items):
            self.calls.append(("replace", len(items)))
            super().replace_slim(kind, items)

    server = ScriptedServer(lists=[([pod("a", "n1")], "10"), ([], "30")],
                            watches=[[Gone("too old")], []])
    c = Recorder()
    stop = threading.Event()
    inf = Informer(server, "pods", c, watch_timeout=1, backoff_max=0.01, stop=stop)
    inf.start()
    deadline = __import__("time").monotonic() + 5
    while server.watches and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    stop.set()
    inf.join(2)
    # open (True), 410 (False), relist, open again (True): never "in sync"
    # between the 410 and the relist.
    assert c.calls[:4] == [("replace", 1), ("health", True), ("health", False), ("replace", 0)]


def test_a_silent_watch_is_not_trusted_and_releases_nothing(world):
    slurm, cache, rec, _ = world
    now = __import__("time").monotonic()
    cache.stale_after = 25.0
    cache.health("pods", True)
    cache.health("nodes", True)
    for kind in cache.KINDS:
        cache.contacted[kind] = now
    cache.event("pods", "ADDED", pod("a", "n1", "2", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    cache.contacted["pods"] = now - 26.0      # no event, bookmark or reopen for 26 s
    assert cache.not_ready() and "pods" in cache.not_ready()
    cache.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)    # held: the data may be stale
    cache.contact("pods")                     # the watch speaks again
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_a_new_daemon_lowers_nothing_before_its_pods_are_listed(world):
    slurm, cache, rec, cfg = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    # A new process: nodes listed, pods not yet (or their watch broke).
    cache2 = Cache(exemptions_of(cfg), cfg.node_key)
    cache2.replace("nodes", [knode("n1")])
    rec2 = sync.Reconciler(cfg, cache2, slurm, ledger=slurm.ledger)
    rec2.cycle()
    assert slurm.counts("n1") == (1, 8000)
    assert rec2.wanted_shares(rec2.last, False) == {}
    cache2.replace("pods", [pod("a", "n1", "3", "0")])
    rec2.cycle()
    assert slurm.counts("n1") == (1, 8000)
    assert rec2.wanted_shares(rec2.last, True)["n1"][1] == cfg.reservation_grace


def test_config_reservation_grace_must_outlast_a_silent_watch(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text("reservation_grace = 20.0\nwatch_timeout = 15\n")
    with pytest.raises(ConfigError, match="reservation_grace"):
        load_config(str(p))
