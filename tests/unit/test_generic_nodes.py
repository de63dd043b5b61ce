"""The sync daemon's GenericNode objects without any server: a Reconciler
over an in-memory Slurm (memory_slurm.py) writing to an in-memory store --
the write budget, the relist that puts back what someone else changed, and
which nodes a pod change writes."""

import dataclasses
import threading
import time

import pytest
from kubernetes.client.exceptions import ApiException

from memory_slurm import SNode, SlurmWorld, knode, pod
from pyk8sres.coordinator import generic_nodes, sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import SyncConfig, exemptions_of
from pyk8sres.coordinator.kube import MANAGED_BY
from pyk8sres.coordinator.threads import GenericNodeWriter
from pyk8sres.policy import usage


class GenericNodeStore:
    """Stands in for kube.Kube's GenericNode calls: the objects, and the
    writes in order."""

    def __init__(self):
        self.objects, self.writes = {}, []
        self.owners = {}       # name -> metadata.managedFields, where not empty
        self.refuse = set()    # names whose owners may not be cleared

    def ensure_crd(self):
        pass

    def list_generic_nodes(self):
        return {n: {"metadata": {"name": n, "labels": dict(MANAGED_BY),
                                 **({"managedFields": self.owners[n]} if n in self.owners else {})},
                    **o}
                for n, o in self.objects.items()}

    def clear_generic_node_field_owners(self, name):
        self.writes.append(("clear", name))
        if name in self.refuse:
            raise ApiException(status=500)
        self.owners.pop(name, None)

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
    want = {n: usage.generic_node_body(n, slurm.nodes[n], rec.last.usage.get(n), "c1")
            for n in names}
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
    now[0] += generic_nodes.GN_RELIST_SECONDS - 1
    rec.cycle()
    assert len(store.writes) == writes and "n1" not in store.objects
    now[0] += 2
    rec.cycle()
    assert sorted(store.writes[writes:]) == ["n1", "n2"]
    assert store.objects == want


def test_the_relist_clears_field_owners_of_ours_that_carry_them(tmp_path, monkeypatch):
    """Objects written by an older version (or applied server-side by
    someone) carry managedFields: the relist clears them, once, and writes
    nothing else; one whose clearing fails is retried at the next relist
    and fails nothing else."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    slurm, cache, store, rec = publishing(tmp_path, 3)
    store.owners = {"n1": [{"manager": "OpenAPI-Generator"}], "n3": [{"manager": "x"}]}
    store.refuse = {"n3"}
    writes = len(store.writes)
    now[0] += generic_nodes.GN_RELIST_SECONDS + 1
    rec.cycle()
    assert store.writes[writes:] == [("clear", "n1"), ("clear", "n3")]
    assert not rec.failed and store.owners == {"n3": [{"manager": "x"}]}
    rec.cycle()
    assert store.writes[writes + 2:] == [], "cleared at a relist only"
    store.refuse = set()
    now[0] += generic_nodes.GN_RELIST_SECONDS + 1
    rec.cycle()
    assert store.writes[writes + 2:] == [("clear", "n3")] and store.owners == {}


def test_clearing_field_owners_keeps_the_write_budget(tmp_path, monkeypatch):
    """An upgrade over many objects clears their managedFields within the
    GenericNode write budget, the pass's status writes first, the rest on
    later passes as tokens come back."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    slurm, cache, store, rec = publishing(tmp_path, 5, generic_node_qps=1.0,
                                          generic_node_burst=2)
    store.owners = {n: [{"manager": "m"}] for n in store.objects}
    now[0] += generic_nodes.GN_RELIST_SECONDS + 1
    cache.event("pods", "ADDED", pod("p", "n5", "1", "1Gi"))
    writes = len(store.writes)
    rec.cycle()
    assert store.writes[writes:] == ["n5", ("clear", "n1")] and rec.gn_behind
    now[0] += 2.0
    rec.cycle()
    assert store.writes[writes + 2:] == [("clear", "n2"), ("clear", "n3")]
    now[0] += 10.0
    rec.cycle()
    assert store.owners == {} and not rec.gn_behind


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
    # Which nodes a pass looks at, not when it may write them: no interval.
    slurm, cache, store, rec = publishing(tmp_path, 6, generic_node_min_interval_seconds=0.0)
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
    assert (store.objects["n5"]["spec"], store.objects["n5"]["status"]) == usage.generic_node_body(
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
    w = GenericNodeWriter(None, threading.Event())
    for i, only in enumerate(offers):
        w.offer(f"decision {i}", {}, only)
    assert w.pending == (f"decision {len(offers) - 1}", {}, want)


def pod_cycle(cache, rec, kind, p):
    cache.event("pods", kind, p)
    rec.cycle(refresh=False, dirty=cache.take_dirty())


def test_one_nodes_changes_within_the_interval_cost_one_write_of_the_newest_state(
        tmp_path, monkeypatch):
    """generic_node_min_interval_seconds: the first change of a node is
    written at once; those that follow within the interval fold into one
    write of the newest state at its end (a pass with no new decision, as
    the writer thread makes when gn_next is due); a change undone within
    the interval costs no write; other nodes are not held back."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    slurm, cache, store, rec = publishing(tmp_path, 3, generic_node_min_interval_seconds=2.0)
    cache.take_dirty()
    assert len(store.writes) == 3                       # created: not paced
    now[0] += 10.0
    pod_cycle(cache, rec, "ADDED", pod("a", "n1", "1", "1Gi"))
    assert store.writes[3:] == ["n1"] and rec.gn_next is None
    for i, t in enumerate((0.1, 0.5, 1.0)):              # three more pods within 2 s
        now[0] += t
        pod_cycle(cache, rec, "ADDED", pod(f"b{i}", "n1", "1", "1Gi"))
    assert store.writes[3:] == ["n1"], "held back until the interval ends"
    assert rec.gn_next == pytest.approx(1012.0)
    now[0] += 0.1
    pod_cycle(cache, rec, "ADDED", pod("c", "n2", "1", "1Gi"))
    assert store.writes[3:] == ["n1", "n2"], "another node's change is written at once"
    now[0] = 1012.0                                      # n1's interval is over
    rec.sync_generic_nodes(rec.last, rec.slurm_view, set())
    assert store.writes[3:] == ["n1", "n2", "n1"]
    want = usage.generic_node_body("n1", slurm.nodes["n1"], rec.last.usage.get("n1"), "c1")
    assert (store.objects["n1"]["spec"], store.objects["n1"]["status"]) == want
    assert want[1]["allocatedResources"][1]["allocated"]["cpu"] == "4"
    assert rec.gn_next is None and not rec.gn_waiting

    now[0] += 0.5              # within n2's interval: added, finished, gone (nothing held)
    pod_cycle(cache, rec, "ADDED", pod("d", "n2", "1", "1Gi"))
    pod_cycle(cache, rec, "MODIFIED", pod("d", "n2", "1", "1Gi", phase="Succeeded"))
    pod_cycle(cache, rec, "DELETED", pod("d", "n2", "1", "1Gi", phase="Succeeded"))
    now[0] += 5.0
    rec.sync_generic_nodes(rec.last, rec.slurm_view, set())
    rec.cycle(refresh=False)
    assert store.writes[3:] == ["n1", "n2", "n1"], "nothing it shows changed: no write"


def test_the_writer_thread_writes_a_held_back_state_without_a_new_decision(tmp_path):
    """Level-triggered: a change held back by the node's interval is
    written when the interval ends, though no decision comes after it."""
    slurm, cache, store, rec = publishing(tmp_path, 2, generic_node_min_interval_seconds=1.0)
    cache.take_dirty()
    stop = threading.Event()
    rec.gn_thread = GenericNodeWriter(rec, stop)
    rec.gn_thread.start()

    def written(want, timeout=5.0):
        deadline = time.monotonic() + timeout
        while store.writes[2:] != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return store.writes[2:]
    try:
        pod_cycle(cache, rec, "ADDED", pod("a", "n1", "1", "1Gi"))
        assert written(["n1"]) == ["n1"]
        pod_cycle(cache, rec, "ADDED", pod("b", "n1", "1", "1Gi"))
        time.sleep(0.1)
        assert store.writes[2:] == ["n1"], "within the interval: held back"
        assert written(["n1", "n1"]) == ["n1", "n1"], "written at the interval's end"
        assert store.objects["n1"]["status"]["allocatedResources"][1]["allocated"]["cpu"] == "2"
    finally:
        stop.set()
        rec.gn_thread.join(5)


def test_a_held_share_and_completing_jobs_show_in_the_generic_node(tmp_path, monkeypatch):
    """What the ledger holds beyond what the API server and CPUAlloc show
    is on the GenericNode too: a pod gone without being seen finished (a
    force delete) counts on the Kubernetes side until its hold ends, and
    jobs still completing (their processes may run) on the Slurm side."""
    now = [1000.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: now[0])
    slurm, cache, store, rec = publishing(tmp_path, 1, generic_node_min_interval_seconds=0,
                                          departed_margin_seconds=5)

    def shown():
        return {r["type"]: r["allocated"] for r in
                store.objects["n1"]["status"]["allocatedResources"]}

    gone = pod("a", "n1", "1500m", "1Gi")
    gone["spec"]["terminationGracePeriodSeconds"] = 10
    pod_cycle(cache, rec, "ADDED", gone)
    assert shown()["Kubernetes"] == {"cpu": "1500m", "memory": "1024Mi"}
    pod_cycle(cache, rec, "DELETED", gone)          # never seen finished
    assert shown()["Kubernetes"] == {"cpu": "1500m", "memory": "1024Mi"}, "held, and shown"
    now[0] += 16.0                                  # its grace and the margin are over
    rec.cycle()
    assert shown()["Kubernetes"] == {"cpu": "0", "memory": "0"}

    slurm.nodes["n1"] = dataclasses.replace(slurm.nodes["n1"], state="IDLE+COMPLETING")
    slurm.completing = {"n1": (2, 1000)}
    rec.cycle()
    assert shown()["Slurm"] == {"cpu": "2", "memory": "1000Mi"}


@pytest.mark.parametrize("held, completing, want_k8s, want_slurm", [
    ((0, 0), (0, 0), ("1", "1024Mi"), ("3", "4000Mi")),
    ((500, 512 << 20), (0, 0), ("1500m", "1536Mi"), ("3", "4000Mi")),
    ((0, 0), (2, 1000), ("1", "1024Mi"), ("5", "5000Mi")),
])
def test_generic_node_body_adds_what_is_held_beyond_pods_and_cpualloc(
        held, completing, want_k8s, want_slurm):
    node = SNode(name="n1", alloc_cpus=3, alloc_memory=4000)
    _, status = usage.generic_node_body("n1", node, usage.NodeUsage(10**9, 1 << 30), "c1",
                                        held=held, completing=completing)
    slurm_side, k8s_side = (r["allocated"] for r in status["allocatedResources"])
    assert (k8s_side["cpu"], k8s_side["memory"]) == want_k8s
    assert (slurm_side["cpu"], slurm_side["memory"]) == want_slurm
