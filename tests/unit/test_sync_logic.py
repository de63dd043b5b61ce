"""The sync daemon's logic without any server: the cache fed with watch
events, the reconcile decision, and a reconcile cycle against an in-memory
Slurm (we check the counts the 'cluster' ends up with, not the calls)."""

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction as F

import pytest

from pyk8sres import nodestate, sync
from pyk8sres import usage as U

MI = 1024 * 1024


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
    """An in-memory Slurm: nodes with counts that set_node_gres changes and
    'restart' resets to slurm.conf, like slurmctld does."""

    def __init__(self, *names):
        self.nodes = {n: SNode(n) for n in names}

    def list_nodes(self):
        return list(self.nodes.values())

    def set_node_gres(self, name, counts):
        n = self.nodes[name]
        self.nodes[name] = dataclasses.replace(n, gres={**n.gres, **counts})

    def cluster_name(self):
        return "c1"

    def restart(self):
        for k, n in self.nodes.items():
            self.nodes[k] = dataclasses.replace(n, gres=dict(n.reported_gres))

    def counts(self, name):
        g = self.nodes[name].gres
        return g["k8scpu"], g["k8smemory"]


def pod(name, node, cpu="1", mem="1Gi", phase="Running", labels=None):
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels or {},
                         "resourceVersion": "1"},
            "spec": {"nodeName": node,
                     "containers": [{"name": "c", "resources": {
                         "requests": {"cpu": cpu, "memory": mem}}}]},
            "status": {"phase": phase}}


def knode(name, **annotations):
    return {"metadata": {"name": name, "annotations": annotations, "labels": {"x": "y"}}}


@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld("n1", "n2", "n3")
    cfg = sync.SyncConfig(state_file=str(tmp_path / "state"), reserve_cpus=0,
                          reserve_memory_mb=0)
    cache = sync.Cache(cfg.slurm_worker_selector, cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("k8s-b", **{cfg.node_key: "n2"})])
    cache.replace("pods", [])
    rec = sync.Reconciler(cfg, cache, slurm)
    return slurm, cache, rec, cfg


# ----------------------------------------------------------------- cache

def test_cache_tracks_watch_events():
    c = sync.Cache("pyk8sres.io/slurm-worker=true")
    c.replace("pods", [pod("a", "n1"), pod("u", None), pod("done", "n1", phase="Succeeded")])
    c.replace("nodes", [])
    assert set(c.pods) == {"ns/a"}
    c.changed.clear()
    c.event("pods", "MODIFIED", pod("a", "n1"))          # nothing we count changed
    assert not c.changed.is_set()
    c.event("pods", "ADDED", pod("b", "n1", cpu="2"))
    assert c.changed.is_set() and c.pods["ns/b"].cpu == 2
    c.event("pods", "MODIFIED", pod("b", "n1", phase="Failed"))
    c.event("pods", "ADDED", pod("w", "n1", labels={"pyk8sres.io/slurm-worker": "true"}))
    c.event("pods", "DELETED", pod("a", "n1"))
    pods, nodes, healthy = c.snapshot()
    assert pods == [] and healthy


def test_cache_health_needs_both_lists_and_live_watches():
    c = sync.Cache()
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
    c = sync.Cache(node_key="k")
    c.replace("nodes", [{"metadata": {"name": "a", "labels": {"k": "n1", "big": "x" * 1000},
                                      "annotations": {"other": "y"}}, "status": {"x": 1}}])
    assert c.nodes == {"a": {"metadata": {"name": "a", "labels": {"k": "n1"}}}}


# ----------------------------------------------------------------- desired_state

def test_desired_state_table():
    nodes = [SNode("n1"), SNode("n2"), SNode("n3"), SNode("n4")]
    knodes = {"n1": knode("n1"), "k8s-b": knode("k8s-b", **{"pyk8sres.io/slurm-node": "n2"}),
              "kx": knode("kx")}
    pods = [U.PodUsage("n1", F(1735, 1000), F(2393 * MI)),
            U.PodUsage("k8s-b", F(1), F(1000 * MI)),
            U.PodUsage("kx", F(3), F(0))]                  # unmapped node: ignored
    d = U.desired_state(pods, knodes, nodes, {}, [], True)
    assert d.targets == {"n1": {"k8scpu": 2, "k8smemory": 5607},
                         "n2": {"k8scpu": 3, "k8smemory": 7000}}
    assert d.unmanaged == ["n3", "n4"]
    assert d.k8s_to_slurm == {"n1": "n1", "k8s-b": "n2"}

    # Unhealthy, previous state known: never above it; unmanaged list kept.
    last = {"n1": {"k8scpu": 1, "k8smemory": 9000}}
    d = U.desired_state(pods, knodes, nodes, last, ["n4"], False)
    assert d.targets["n1"] == {"k8scpu": 1, "k8smemory": 5607}
    assert d.targets["n2"] == {"k8scpu": 0, "k8smemory": 0}
    assert d.unmanaged == ["n4"]


# ----------------------------------------------------------------- reconcile cycles

def test_reconcile_walkthrough(world):
    slurm, cache, rec, cfg = world
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000) and slurm.counts("n2") == (4, 8000)
    st = nodestate.read_state(cfg.state_file)
    assert st["nodes"]["n1"] == {"k8scpu": 4, "k8smemory": 8000}
    assert st["unmanaged"] == ["n3"]

    cache.event("pods", "ADDED", pod("a", "n1", "1735m", "2393Mi"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 5607)
    cache.event("pods", "ADDED", pod("b", "n1", "1", "1024Mi"))
    rec.cycle()
    assert slurm.counts("n1") == (1, 4583)
    assert nodestate.read_state(cfg.state_file)["nodes"]["n1"] == {"k8scpu": 1, "k8smemory": 4583}

    # slurmctld restart resets counts to slurm.conf: the next cycle re-applies.
    slurm.restart()
    rec.cycle()
    assert slurm.counts("n1") == (1, 4583)

    cache.event("pods", "DELETED", pod("a", "n1"))
    cache.event("pods", "DELETED", pod("b", "n1"))
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_api_loss_never_hands_capacity_back(world):
    slurm, cache, rec, _ = world
    cache.event("pods", "ADDED", pod("a", "n1", "2", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    cache.health("pods", False)
    cache.event("pods", "DELETED", pod("a", "n1"))   # e.g. stale data before the loss
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    slurm.restart()                                   # and slurmctld restarts meanwhile
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    cache.event("pods", "ADDED", pod("c", "n1", "3", "0"))  # going down is always fine
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    cache.replace("pods", [])                          # relist: in sync again
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_malformed_pod_holds_its_node_only(world):
    slurm, cache, rec, _ = world
    cache.event("pods", "ADDED", pod("a", "n1", "1", "0"))
    cache.event("pods", "ADDED", pod("x", "k8s-b", "1", "0"))
    rec.cycle()
    assert slurm.counts("n1") == (3, 8000) and slurm.counts("n2") == (3, 8000)
    cache.event("pods", "DELETED", pod("a", "n1"))
    cache.event("pods", "ADDED", pod("bad", "n1", "lots", "0"))
    cache.event("pods", "DELETED", pod("x", "k8s-b"))
    rec.cycle()
    assert slurm.counts("n1") == (3, 8000)     # held at last applied
    assert slurm.counts("n2") == (4, 8000)     # other nodes unaffected
    cache.event("pods", "DELETED", pod("bad", "n1"))
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_daemon_restart_remembers_state(world):
    slurm, cache, rec, cfg = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    slurm.restart()
    # New daemon process: nothing listed yet, but the state file is known.
    cache2 = sync.Cache()
    rec2 = sync.Reconciler(cfg, cache2, slurm)
    rec2.cycle()
    assert slurm.counts("n1") == (1, 8000)


def test_never_above_what_slurmd_reports(world):
    slurm, cache, rec, _ = world
    slurm.nodes["n1"] = dataclasses.replace(slurm.nodes["n1"],
                                            reported_gres={"k8scpu": 2, "k8smemory": 100})
    rec.cycle()
    assert slurm.counts("n1") == (2, 100)


def test_slurm_down_is_survivable(world):
    slurm, cache, rec, _ = world

    def boom():
        raise RuntimeError("slurmctld unreachable")
    slurm.list_nodes = boom
    assert rec.cycle() is None


# ----------------------------------------------------------------- config

def test_config_file(tmp_path):
    p = tmp_path / "sync.toml"
    p.write_text('resync_seconds = 2\nnode-key = "example.com/slurm"\nreserve_cpus = 1\n')
    cfg = sync.load_config(str(p))
    assert (cfg.resync_seconds, cfg.node_key, cfg.reserve_cpus) == (2.0, "example.com/slurm", 1)
    p.write_text('[sync]\nmap_by_name = false\n')
    assert sync.load_config(str(p)).map_by_name is False


@pytest.mark.parametrize("text", ['resync_secs = 1\n', 'map_by_name = "yes"\n',
                                  'reserve_cpus = true\n', 'x = \n'])
def test_config_rejects(tmp_path, text):
    p = tmp_path / "sync.toml"
    p.write_text(text)
    with pytest.raises(sync.ConfigError):
        sync.load_config(str(p))


def test_cli_flags_override(tmp_path, monkeypatch):
    a = sync.parse_args(["--once", "--state-file", "/x", "--resync", "3", "--no-generic-nodes"])
    assert a.once and a.state_file == "/x" and a.resync_seconds == 3 and a.generic_nodes is False
