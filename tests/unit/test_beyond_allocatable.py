"""What a Slurm node offers beyond its Kubernetes node's allocatable is held
in its ledger (policy/backstop.beyond; coordinator/allocatable.py): the
rules, and the sync daemon holding them in a real ledger (in-process,
memory_slurm.SlurmWorld: n1 and n2 share 4 CPUs and 8000 MB each)."""
import dataclasses

import pytest

from pyk8sres.coordinator import cache as cache_mod, config, sync
from pyk8sres.policy import backstop, usage
from memory_slurm import SNode, SlurmWorld, knode, pod

KEY = backstop.BEYOND_KEY
MI = 1 << 20


def kn(name, alloc=None, capacity=None, **labels):
    status = {k: v for k, v in (("allocatable", alloc), ("capacity", capacity)) if v is not None}
    return {**knode(name, **labels), "status": status}


@pytest.mark.parametrize("case, node, want", [
    ("allocatable", kn("k", {"cpu": "3", "memory": "6000Mi"}), (3000, 6000 * MI)),
    ("millicores, binary and decimal", kn("k", {"cpu": "3900m", "memory": "1G"}),
     (3900, 10**9)),
    ("rounded down", kn("k", {"cpu": "1500u", "memory": "1.5"}), (1, 1)),
    ("capacity when no allocatable (the API's default)",
     kn("k", None, {"cpu": "8", "memory": "1Gi"}), (8000, 1 << 30)),
    ("no status", knode("k"), (None, None)),
    ("memory missing", kn("k", {"cpu": "2"}), (2000, None)),
    ("unparsable cpu", kn("k", {"cpu": "lots", "memory": "1Mi"}), (None, MI)),
    ("not a string", kn("k", {"cpu": 2.5, "memory": None}), (None, None)),
    ("negative", kn("k", {"cpu": "-1", "memory": "1Ki"}), (None, 1024)),
])
def test_offered(case, node, want):
    assert backstop.offered(node) == want


@pytest.mark.parametrize("now, last, want", [
    ((1000, 5), None, (1000, 5)),
    ((None, None), None, (None, None)),
    ((None, 5), (2000, 7), (2000, 5)),          # cpu unreadable now: the last kept
    ((1000, None), (2000, 7), (1000, 7)),
    ((4000, 9), (2000, 7), (4000, 9)),          # risen: the new one
])
def test_known_offer(now, last, want):
    assert backstop.known_offer(now, last) == want


@pytest.mark.parametrize("offers, want", [
    ([], (None, None)),
    ([(3000, None)], (3000, None)),
    ([(3000, 9), (4000, 5), (None, None)], (3000, 5)),
    (iter([(3000, 9), (4000, 5)]), (3000, 5)),      # read once
])
def test_smallest(offers, want):
    assert backstop.smallest(offers) == want


@pytest.mark.parametrize("case, node, offer, want", [
    ("within", SNode(), (4000, 8000 * MI), None),
    ("above", SNode(), (8000, 9000 * MI), None),
    ("cpu beyond", SNode(), (3000, 8000 * MI), (1000, 0)),
    ("fractions of a CPU, bytes", SNode(), (3900, 7000 * MI + 1), (100, 1000 * MI - 1)),
    ("a resource not known holds nothing", SNode(), (None, 6000 * MI), (0, 2000 * MI)),
    ("nothing known", SNode(), (None, None), None),
    ("no k8scpu/k8smemory", SNode(gres={}), (1000, MI), None),
    ("not in Slurm's view", None, (1000, MI), None),
])
def test_beyond(case, node, offer, want):
    assert backstop.beyond(node, offer) == want


def test_no_pod_uid_takes_the_key():
    assert ":" in KEY and KEY in backstop.KEYS


def test_the_generic_node_capacity_is_what_both_share():
    spec, status = usage.generic_node_body("k1", SNode(), None, "c1",
                                           beyond=(100, 1000 * MI))
    assert status["capacity"] == {"cpu": "3900m", "memory": "7000Mi"}
    _, status = usage.generic_node_body("k1", SNode(), None, "c1")
    assert status["capacity"] == {"cpu": "4", "memory": "8000Mi"}


# ----------------------------------------------------------------- in the sync loop

@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    cfg = config.SyncConfig(ledger_socket="unused")
    cache = cache_mod.Cache(config.exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [kn("n1", {"cpu": "3", "memory": "6000Mi"}), knode("n2")])
    cache.replace("pods", [pod("a", "n1", "1", "1000Mi")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.cycle()
    return slurm, cache, rec


def test_the_difference_is_held_so_jobs_and_pods_stay_within_allocatable(world):
    slurm, cache, rec = world
    assert slurm.core.nodes["n1"][KEY][:2] == (1000, 2000 * MI)
    # Jobs get 2 CPUs and 5000 MB: with the pod's 1 and 1000, allocatable.
    assert slurm.counts("n1") == (2, 5000)
    assert slurm.counts("n2") == (4, 8000)              # no allocatable known: nothing
    assert rec.allocatable.held_on("n1") == (1000, 2000 * MI)
    # Pods fill the allocatable, and no more: the ledger refuses the next.
    assert slurm.ledger.reserve("n1", "uid-b", 2000, 5000 * MI)["ok"]
    assert slurm.counts("n1") == (0, 0)
    assert not slurm.ledger.reserve("n1", "uid-c", 1, 1)["ok"]
    # A pod event's cycle keeps the entry.
    cache.event("pods", "ADDED", pod("b", "n1", "2", "5000Mi"))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.core.nodes["n1"][KEY][:2] == (1000, 2000 * MI)


def test_allocatable_rising_shrinks_the_entry_then_it_goes(world):
    slurm, cache, rec = world
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "3500m", "memory": "8000Mi"}))
    rec.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (500, 0)
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "4", "memory": "8Gi"}))
    rec.cycle()
    assert KEY not in slurm.core.nodes["n1"] and slurm.counts("n1") == (3, 7000)
    assert rec.allocatable.held_on("n1") == (0, 0)


@pytest.mark.parametrize("status", [
    {}, {"allocatable": {"cpu": "x", "memory": "1e"}}, {"allocatable": {"pods": "110"}}])
def test_allocatable_missing_or_unparsable_keeps_the_last_known(world, status):
    slurm, cache, rec = world
    cache.event("nodes", "MODIFIED", {**knode("n1"), "status": status})
    rec.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (1000, 2000 * MI)
    # One resource readable again: it counts, the other is still the last known.
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "4"}))
    rec.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (0, 2000 * MI)


def test_the_entry_follows_the_nodes_whose_pods_count_there(world):
    slurm, cache, rec = world
    # n1 mapped by its label to the Slurm node n2 now: its pod's containers
    # did not move, they count on both, and so does n1's allocatable.
    cache.event("nodes", "MODIFIED",
                kn("n1", {"cpu": "3", "memory": "6000Mi"}, **{rec.cfg.node_key: "n2"}))
    rec.cycle()
    for s in ("n1", "n2"):
        assert slurm.core.nodes[s][KEY][:2] == (1000, 2000 * MI) and "uid-a" in slurm.core.nodes[s]
    # Its Node object deleted while the pod runs: its last allocatable still bounds both.
    cache.event("nodes", "DELETED", kn("n1"))
    rec.cycle()
    for s in ("n1", "n2"):
        assert slurm.core.nodes[s][KEY][:2] == (1000, 2000 * MI)
    # The pod gone, nothing of n1 counts anywhere: neither does its allocatable.
    cache.event("pods", "DELETED", pod("a", "n1", phase="Succeeded"))
    rec.cycle()
    assert not rec.holds.sticky
    assert all(KEY not in slurm.core.nodes.get(s, {}) for s in ("n1", "n2"))
    rec.cycle()                                   # and its offer is forgotten
    assert "n1" not in rec.allocatable.known


def test_a_deleted_nodes_pods_held_after_they_left_keep_its_entry(world):
    """Node n1 deleted, then its pod force-deleted (as the pod garbage
    collector does): the pod's share is held its grace period, and n1's
    last allocatable still bounds the Slurm node meanwhile."""
    slurm, cache, rec = world
    cache.event("nodes", "DELETED", kn("n1"))
    rec.cycle()
    cache.event("pods", "DELETED", pod("a", "n1", "1", "1000Mi"))
    rec.cycle()
    assert "uid-a" in slurm.core.nodes["n1"]
    assert slurm.core.nodes["n1"][KEY][:2] == (1000, 2000 * MI)
    assert slurm.counts("n1") == (2, 5000)


def test_a_restarted_daemon_keeps_the_entry_while_the_offer_is_unknown(world):
    slurm, cache, rec = world
    cache.event("nodes", "MODIFIED", knode("n1"))
    again = sync.Reconciler(rec.cfg, cache, slurm, ledger=slurm.ledger)
    again.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (1000, 2000 * MI)
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "4", "memory": "7000Mi"}))
    again.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (0, 1000 * MI)


def test_a_restarted_daemon_keeps_what_it_cannot_compute_of_one_resource(world):
    slurm, cache, rec = world
    # Restarted while n1's status reads its CPUs only: memory as held before.
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "3500m"}))
    again = sync.Reconciler(rec.cfg, cache, slurm, ledger=slurm.ledger)
    again.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (500, 2000 * MI)
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "3500m", "memory": "8000Mi"}))
    again.cycle()
    assert slurm.core.nodes["n1"][KEY][:2] == (500, 0)


@pytest.mark.parametrize("entry,offer,inherited,want", [
    ((500, 0), (3500, None), (1000, 7), (500, 7)),      # memory not known: as held
    (None, (None, None), (1000, 7), (1000, 7)),         # nothing known: all as held
    ((0, 0), (4000, None), (1000, 0), None),            # nothing to hold
    ((500, 9), (3500, 1), (1000, 7), (500, 9)),         # all known: as computed
])
def test_keep_unknown(entry, offer, inherited, want):
    assert backstop.keep_unknown(entry, offer, inherited) == want


def test_a_restarted_daemon_drops_an_entry_the_offer_no_longer_needs(world):
    slurm, cache, rec = world
    cache.event("nodes", "MODIFIED", kn("n1", {"cpu": "4", "memory": "8000Mi"}))
    again = sync.Reconciler(rec.cfg, cache, slurm, ledger=slurm.ledger)
    again.cycle()
    assert KEY not in slurm.core.nodes["n1"]
    # Never held as a departed pod's share either.
    assert not again.holds.entries("n1")


def test_allocatable_shrinking_under_running_jobs_says_why_in_the_event(world):
    """Jobs already use what the entry now holds: the node is oversubscribed
    (no new job starts) and its Event names the part held beyond allocatable."""
    slurm, cache, rec = world
    posted = []
    rec.events = type("E", (), {"generic_node": lambda self, *a, **k: posted.append(a)})()
    slurm.nodes["n1"] = dataclasses.replace(slurm.nodes["n1"], alloc_cpus=3,
                                            gres_used={"k8scpu": 3, "k8smemory": 0})
    rec.ledger_nodes = slurm.ledger.show()["nodes"]
    cache.event("pods", "ADDED", pod("b", "n1", "100m", "0"))
    rec.cycle()
    (message,) = [m for _, reason, m in posted if reason == "Oversubscribed"]
    assert "with 1000m CPU and 2000 MB held beyond the Kubernetes node's allocatable" in message
