"""How long a pod that left the API server still holds its share: the pure
rules (policy/departures.py), then the sync daemon's cycle against the real
ledger code (memory_slurm.SlurmWorld), judged by what Slurm leaves to jobs."""

import time

import pytest

from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import SyncConfig, exemptions_of
from pyk8sres.policy import departures

from memory_slurm import SlurmWorld, knode, pod

NOW, WALL, MARGIN = 1000.0, 1_700_000_000.0, 5.0


def held(until, grace=30.0):
    return departures.Held(2000, 0, "k1", grace, until)


@pytest.mark.parametrize("case, grace, was_terminating_until, state, want", [
    ("forced delete on a Ready node: the whole grace period", 30.0, None, departures.READY,
     held(NOW + 30 + MARGIN)),
    ("seen Terminating, vanished when its grace ended", 30.0, WALL, departures.READY,
     held(NOW + MARGIN)),
    ("seen Terminating, then forced 10 s into 30", 30.0, WALL + 20, departures.READY,
     held(NOW + 20 + MARGIN)),
    ("a delete that asked a longer grace period: its deadline counts", 30.0, WALL + 500,
     departures.READY, held(NOW + 500 + MARGIN)),
    ("Node object deleted: grace and margin", 10.0, None, departures.ABSENT,
     held(NOW + 10 + MARGIN, grace=10.0)),
    ("node NotReady or Unknown: until it is back", 30.0, None, departures.UNREACHABLE, held(None)),
    ("node fenced (out-of-service): nothing runs there", 30.0, None, departures.FENCED, None),
])
def test_first_hold(case, grace, was_terminating_until, state, want):
    got = departures.first_hold(2000, 0, "k1", grace, was_terminating_until, state,
                                now=NOW, wall=WALL, margin=MARGIN)
    assert got == want, case


@pytest.mark.parametrize("case, h, state, now, want", [
    ("counting down", held(NOW + 10), departures.READY, NOW + 9, held(NOW + 10)),
    ("time is up", held(NOW + 10), departures.READY, NOW + 10, None),
    ("time is up, Node deleted meanwhile", held(NOW + 10), departures.ABSENT, NOW + 11, None),
    ("node became unreachable before the end: wait for it", held(NOW + 10), departures.UNREACHABLE,
     NOW + 11, held(None)),
    ("waited-for node back: a full grace period from now", held(None), departures.READY, NOW,
     held(NOW + 30 + MARGIN)),
    ("still unreachable", held(None), departures.UNREACHABLE, NOW + 1e6, held(None)),
    ("fenced while waiting", held(None), departures.FENCED, NOW, None),
])
def test_next_hold(case, h, state, now, want):
    assert departures.next_hold(h, state, now=now, margin=MARGIN) == want, case


def status(phase="Running", **states):
    return {"phase": phase, "containerStatuses": [
        {"name": n, "state": {s: {}}} for n, s in states.items()]}


@pytest.mark.parametrize("case, st, want", [
    ("running", status(c="running"), False),
    ("pod GC's Failed: the containers as they were", status("Failed", c="running"), False),
    ("a phase alone says nothing of the containers", {"phase": "Succeeded"}, False),
    ("succeeded as a kubelet reports it", status("Succeeded", c="terminated"), True),
    ("every container terminated", status(c="terminated"), True),
    ("one container still running", {"phase": "Running", "containerStatuses": [
        {"name": "c", "state": {"terminated": {}}}]}, False),   # c2 has no status
    ("no status at all", {}, False),
])
def test_containers_gone(case, st, want):
    p = {"spec": {"containers": [{"name": "c"}] + ([{"name": "c2"}] if case.startswith("one")
                                                   else [])}, "status": st}
    assert departures.containers_gone(p) is want, case


@pytest.mark.parametrize("case, node, want", [
    ("no object", None, departures.ABSENT),
    ("Ready", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, departures.READY),
    ("NotReady", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
     departures.UNREACHABLE),
    ("Unknown", {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}},
     departures.UNREACHABLE),
    ("fenced wins",
     {"spec": {"taints": [{"key": departures.OUT_OF_SERVICE_TAINT, "effect": "NoExecute"}]},
      "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}, departures.FENCED),
    ("never reported: no pod runs yet", {"status": {}}, departures.READY),
])
def test_node_state(case, node, want):
    assert departures.node_state(node) == want, case


def test_grace_and_kill_by_read_from_the_pod():
    p = {"metadata": {"deletionTimestamp": "2026-12-06T21:00:30Z",
                      "deletionGracePeriodSeconds": 7},
         "spec": {"terminationGracePeriodSeconds": 7}}
    assert departures.grace_of(p) == 7.0 and departures.grace_of({}) == departures.DEFAULT_GRACE
    longer = {"metadata": {"deletionGracePeriodSeconds": 90},
              "spec": {"terminationGracePeriodSeconds": 7}}
    assert departures.grace_of(longer) == 90.0   # `delete --grace-period=90`: the kubelet waits so
    assert departures.kill_by(p) == 1796590830.0 and departures.kill_by({}) is None
    # A forced delete: deletionTimestamp now and period 0, the object gone at
    # once; the kubelet was told nothing yet.
    forced = {"metadata": {"deletionTimestamp": "2026-12-06T21:00:30Z",
                           "deletionGracePeriodSeconds": 0}}
    assert departures.kill_by(forced) is None
    no_number = {"spec": {"terminationGracePeriodSeconds": True}}
    assert departures.grace_of(no_number) == departures.DEFAULT_GRACE


# ----------------------------------------------------------------- the cycle

class Clock:
    def __init__(self, monkeypatch):
        self.t = time.monotonic()
        monkeypatch.setattr(sync.time, "monotonic", lambda: self.t)


def ready_node(name, ready="True", **labels):
    n = knode(name, **labels)
    n["status"] = {"conditions": [{"type": "Ready", "status": ready}]}
    return n


def terminating(p, seconds_from_now, period=None):
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_from_now))
    p["metadata"]["deletionTimestamp"] = stamp
    p["metadata"]["deletionGracePeriodSeconds"] = period if period is not None else \
        p["spec"].get("terminationGracePeriodSeconds", 30)
    return p


@pytest.fixture
def world(tmp_path, monkeypatch):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    cfg = SyncConfig(ledger_socket="unused", departed_margin_seconds=MARGIN)
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [ready_node("n1"), ready_node("k8s-b", **{cfg.node_key: "n2"})])
    cache.replace("pods", [])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.cycle()
    return slurm, cache, rec, Clock(monkeypatch)


def with_grace(p, grace):
    p["spec"]["terminationGracePeriodSeconds"] = grace
    return p


def test_forced_delete_holds_for_the_grace_period_and_margin(world):
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", with_grace(pod("a", "n1", "3", "0"), 20))
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    # --force: the API server sets deletionTimestamp (period 0), then deletes.
    cache.event("pods", "MODIFIED", terminating(with_grace(pod("a", "n1", "3", "0"), 20), 0, 0))
    cache.event("pods", "DELETED", with_grace(pod("a", "n1", "3", "0"), 20))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.counts("n1") == (1, 8000)
    clock.t += 20 + MARGIN - 0.1
    assert not rec.idle_cycle_due() or rec.cycle() is not None
    assert slurm.counts("n1") == (1, 8000)
    clock.t += 0.2
    assert rec.idle_cycle_due()
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_a_graceful_delete_holds_only_the_margin_after_its_deadline(world):
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", with_grace(pod("a", "n1", "3", "0"), 20))
    cache.event("pods", "MODIFIED", terminating(with_grace(pod("a", "n1", "3", "0"), 20), 0))
    rec.cycle()
    cache.event("pods", "DELETED", with_grace(pod("a", "n1", "3", "0"), 20))  # kwok, at its end
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    clock.t += MARGIN + 1.5      # deletionTimestamp has whole seconds
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_a_delete_whose_last_object_shows_the_containers_gone_releases_at_once(world):
    slurm, cache, rec, _ = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    gone = pod("a", "n1", "3", "0")
    gone["status"] = status(c="terminated")
    cache.event("pods", "DELETED", gone)
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_pods_gone_from_an_unreachable_node_are_held_until_it_is_back_or_fenced(world):
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    cache.event("pods", "ADDED", pod("b", "k8s-b", "2", "0"))
    rec.cycle()
    cache.event("nodes", "MODIFIED", ready_node("n1", "Unknown"))
    cache.event("nodes", "MODIFIED", ready_node("k8s-b", "False", **{rec.cfg.node_key: "n2"}))
    cache.event("pods", "DELETED", pod("a", "n1", "3", "0"))      # pod GC / eviction, forced
    cache.event("pods", "DELETED", pod("b", "k8s-b", "2", "0"))
    rec.cycle()
    clock.t += 3600
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000) and slurm.counts("n2") == (2, 8000)
    fenced = ready_node("n1", "Unknown")
    fenced["spec"] = {"taints": [{"key": departures.OUT_OF_SERVICE_TAINT, "effect": "NoExecute"}]}
    cache.event("nodes", "MODIFIED", fenced)                      # the admin: it is shut down
    cache.event("nodes", "MODIFIED", ready_node("k8s-b", **{rec.cfg.node_key: "n2"}))  # back
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000) and slurm.counts("n2") == (2, 8000)
    clock.t += 30 + MARGIN + 0.1       # its kubelet kills it within its grace period
    rec.cycle()
    assert slurm.counts("n2") == (4, 8000)


@pytest.mark.parametrize("how", ["Node deleted", "mapping label removed"])
def test_a_node_that_loses_its_mapping_keeps_its_pods_share_until_they_are_gone(world, how):
    slurm, cache, rec, clock = world
    key = rec.cfg.node_key
    cache.event("pods", "ADDED", with_grace(pod("b", "k8s-b", "3", "0"), 10))
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000)
    if how == "Node deleted":
        cache.event("nodes", "DELETED", ready_node("k8s-b", **{key: "n2"}))
    else:
        cache.event("nodes", "MODIFIED", ready_node("k8s-b"))
    rec.cycle()
    clock.t += 300                   # the pod still bound (pod GC has not run yet)
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000)
    cache.event("pods", "ADDED", pod("c", "k8s-b", "1", "0"))    # still counted there
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.counts("n2") == (0, 8000)
    cache.event("pods", "DELETED", with_grace(pod("b", "k8s-b", "3", "0"), 10))  # pod GC
    cache.event("pods", "DELETED", pod("c", "k8s-b", "1", "0", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000)
    clock.t += 10 + MARGIN + 0.1
    rec.cycle()
    rec.cycle()
    assert slurm.counts("n2") == (4, 8000)
    assert not rec.holds.sticky and not rec.holds.by_node


def test_a_restarted_daemon_holds_ledger_entries_no_pod_explains(world, monkeypatch):
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    # The daemon stops; meanwhile pod a is force-deleted.  A new daemon starts.
    cache2 = Cache(exemptions_of(rec.cfg), rec.cfg.node_key)
    cache2.replace("nodes", [ready_node("n1"), ready_node("k8s-b", **{rec.cfg.node_key: "n2"})])
    cache2.replace("pods", [pod("x", "n1", "1", "0")])
    rec2 = sync.Reconciler(rec.cfg, cache2, slurm, ledger=slurm.ledger)
    rec2.cycle()
    assert slurm.counts("n1") == (0, 8000)          # a (held, unexplained) + x
    clock.t += departures.DEFAULT_GRACE + MARGIN + 0.1
    rec2.cycle()
    assert slurm.counts("n1") == (3, 8000)


def test_relist_holds_what_vanished_unseen(world):
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", pod("a", "n1", "3", "0"))
    rec.cycle()
    cache.replace("pods", [])          # a watch broke; the pod is gone from the new list
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    clock.t += departures.DEFAULT_GRACE + MARGIN + 0.1
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000)


def test_pod_gc_marks_an_orphaned_pod_failed_before_its_forced_delete(world):
    """Pod GC (podgc gcOrphaned/gcTerminating, markFailedAndDeletePod) first
    patches phase Failed onto a pod whose Node is gone, keeping its container
    statuses as they were (running), then deletes it with grace 0.  No
    kubelet said anything: the containers may still run."""
    slurm, cache, rec, clock = world
    key = rec.cfg.node_key
    cache.event("pods", "ADDED", with_grace(pod("b", "k8s-b", "3", "0"), 10))
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000)
    cache.event("nodes", "DELETED", ready_node("k8s-b", **{key: "n2"}))
    rec.cycle()
    gc = with_grace(pod("b", "k8s-b", "3", "0", phase="Failed"), 10)
    gc["status"]["containerStatuses"] = [{"name": "c", "state": {"running": {}}}]
    gc["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                   "reason": "DeletionByPodGC"}]
    cache.event("pods", "MODIFIED", gc)                 # the status patch
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    cache.event("pods", "DELETED", gc)                  # the forced delete
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000), "released while its containers may run"


def test_a_pod_that_leaves_while_a_cycle_runs_is_never_released_early(world, monkeypatch):
    """The watch thread may deliver a forced delete at any moment of a cycle.
    The cycle takes the departures first and reads each node's bound pods
    later: a pod that leaves in between is in neither, and its share goes
    until the next cycle holds it again (a job or a pod may take it then)."""
    slurm, cache, rec, clock = world
    cache.event("pods", "ADDED", with_grace(pod("a", "n1", "3", "0"), 20))
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000)
    take = cache.take_departures

    def take_then_delete():
        out = take()
        cache.event("pods", "DELETED", with_grace(pod("a", "n1", "3", "0"), 20))  # --force
        monkeypatch.setattr(cache, "take_departures", take)
        return out
    monkeypatch.setattr(cache, "take_departures", take_then_delete)
    rec.cycle()
    assert slurm.counts("n1") == (1, 8000), "the departed pod's share went for a cycle"


def test_a_deleted_unreachable_node_is_not_the_admins_fence(world):
    """docs/admission.md: pods gone from a NotReady/Unknown node are held until
    it is Ready again or carries the out-of-service taint.  Deleting the Node
    object of a partitioned machine (an admin, an autoscaler) says nothing of
    its containers, yet the hold then counts down as if it were back."""
    slurm, cache, rec, clock = world
    key = rec.cfg.node_key
    cache.event("pods", "ADDED", with_grace(pod("b", "k8s-b", "3", "0"), 10))
    rec.cycle()
    cache.event("nodes", "MODIFIED", ready_node("k8s-b", "Unknown", **{key: "n2"}))
    cache.event("pods", "DELETED", with_grace(pod("b", "k8s-b", "3", "0"), 10))  # --force
    rec.cycle()
    cache.event("nodes", "DELETED", ready_node("k8s-b", "Unknown", **{key: "n2"}))
    rec.cycle()
    clock.t += 10 + MARGIN + 0.1
    rec.cycle()
    assert slurm.counts("n2") == (1, 8000), "released while the machine may still run it"
