"""The sync daemon's logic without any server: the reconcile decision, and
reconcile cycles against an in-memory Slurm whose ledger is the real one
(memory_slurm.py) -- we check what the 'cluster' ends up leaving to jobs,
not the calls -- and its settings.  The cache and the informer feeding it:
test_sync_cache.py; GenericNode objects: test_generic_nodes.py.  The real
slurmctld is tested in tests/integration."""

import dataclasses
import random
import time

import pytest

from memory_slurm import MI, N, SNode, SlurmWorld, knode, pod
from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import ConfigError, SyncConfig, exemptions_of, load_config
from pyk8sres.policy import usage


@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2", "n3")
    cfg = SyncConfig(ledger_socket="unused")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("k8s-b", **{cfg.node_key: "n2"})])
    cache.replace("pods", [])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    return slurm, cache, rec, cfg


# ----------------------------------------------------------------- desired_state

def test_desired_state_table():
    nodes = [SNode("n1"), SNode("n2"), SNode("n3"), SNode("n4", gres={}, reported_gres={})]
    knodes = {"n1": knode("n1"), "k8s-b": knode("k8s-b", **{usage.NODE_LABEL: "n2"}),
              "kx": knode("kx"), "n4": knode("n4"),
              "k8s-z": knode("k8s-z", **{usage.NODE_LABEL: "nowhere"})}
    pods = [usage.PodUsage("n1", N(1735, 1000), 2393 * MI),
            usage.PodUsage("k8s-b", N(1), 1000 * MI),
            usage.PodUsage("k8s-b", 0, 0, error="pod x/y: malformed quantity 'lots'"),
            usage.PodUsage("n3", N(2), 0),                  # no node object: counts by name
            usage.PodUsage("kx", N(3), 0)]                  # unmapped node: ignored
    d = usage.desired_state(usage.usage_by_k8s_node(pods), knodes, nodes)
    assert d.usage == {"n1": usage.NodeUsage(N(1735, 1000), 2393 * MI),
                       "n2": usage.NodeUsage(N(1), 1000 * MI,
                                             ("pod x/y: malformed quantity 'lots'",)),
                       "n3": usage.NodeUsage(N(2), 0)}
    assert d.k8s_to_slurm == {"n1": "n1", "k8s-b": "n2", "n4": "n4"}
    assert d.mapping == {"n1": "n1", "k8s-b": "n2", "kx": None, "n4": "n4", "k8s-z": None}
    assert len(d.warnings) == 3
    assert any("n2" in w and "lots" in w for w in d.warnings)        # its share only grows
    assert any(w.startswith("node n4: no k8scpu") for w in d.warnings)
    assert any("k8s-z" in w for w in d.warnings)                    # label names no node
    d = usage.desired_state(usage.usage_by_k8s_node(pods), knodes, nodes, map_by_name=False)
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
        where = {usage.slurm_node_of(k, partial.mapping, {"n1", "n2", "n3"}) for k in dirty}
        assert set(sets) <= where - {None}, (step, dirty, sets)
        partial_sets.append(len(sets))
        entries = {n: dict(slurm.core.nodes.get(n, {})) for n in ("n1", "n2", "n3")}
        applied = rec.applied_total
        full = rec.cycle(refresh=False, dirty=None)
        assert partial.usage == full.usage, step
        assert rec.applied_total == applied, step       # the full cycle had nothing to do
        assert {n: dict(slurm.core.nodes.get(n, {})) for n in ("n1", "n2", "n3")} == entries
    assert sum(partial_sets) > 100 and partial_sets.count(1) > 50   # one node, not all three


def test_a_silent_watch_is_not_trusted_and_releases_nothing(world):
    slurm, cache, rec, _ = world
    now = time.monotonic()
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
                                  'generic_node_qps = 0\n', 'generic_node_burst = 0\n',
                                  'generic_node_min_interval_seconds = -1\n',
                                  'generic_node_min_interval_seconds = 600\n'])
def test_config_rejects(tmp_path, text):
    p = tmp_path / "sync.toml"
    p.write_text(text)
    with pytest.raises(ConfigError):
        load_config(str(p))


def test_cli_flags_override(tmp_path, monkeypatch):
    a = sync.parse_args(["--once", "--ledger-socket", "/x", "--resync", "3", "--no-generic-nodes"])
    assert a.once and a.ledger_socket == "/x" and a.resync_seconds == 3 and a.generic_nodes is False


def test_config_reservation_grace_must_outlast_a_silent_watch(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text("reservation_grace = 20.0\nwatch_timeout = 15\n")
    with pytest.raises(ConfigError, match="reservation_grace"):
        load_config(str(p))
