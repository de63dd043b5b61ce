"""Slurm's worker pods as Slurm nodes (Slinky, ACK, custom): the settings,
which pods are workers and which Slurm node each one is (policy/workers.py),
the mapping they add and its conflicts, and the sync daemon's cycle against
the real ledger code (test_sync_logic.SlurmWorld), judged by what Slurm
leaves to jobs."""

import dataclasses

import pytest

from pyk8sres.coordinator import mapping, status, sync
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import ConfigError, SyncConfig, exemptions_of, load_config
from pyk8sres.policy import moves, usage
from pyk8sres.policy import workers

from memory_slurm import SNode
from test_sync_logic import SlurmWorld, knode, pod

HOST = workers.SLINKY_HOSTNAME_LABEL
SLINKY_LABELS = dict(workers.SLINKY_LABELS)


def slinky(name, node, hostname_label=None, hostname=None, ns="slurm", cpu="4", **more):
    labels = {**SLINKY_LABELS, **more}
    if hostname_label is not None:
        labels[HOST] = hostname_label
    p = pod(name, node, cpu, "1Gi", labels=labels, ns=ns)
    if hostname is not None:
        p["spec"]["hostname"] = hostname
    return p


# ----------------------------------------------------------------- settings

@pytest.mark.parametrize("case, args, want", [
    ("off", ("",), None),
    ("slinky preset", ("slinky", "slurm"),
     workers.Selector("slinky", "slurm", workers.SLINKY_LABELS, None,
                      ("label:" + HOST, "hostname", "pod-name"))),
    ("slinky narrowed to one cluster", ("slinky", "slurm", {"slinky.slurm.net/cluster": "c1"}),
     workers.Selector("slinky", "slurm",
                      workers.SLINKY_LABELS + (("slinky.slurm.net/cluster", "c1"),), None,
                      ("label:" + HOST, "hostname", "pod-name"))),
    ("ack preset", ("ack", "slurm-test"),
     workers.Selector("ack", "slurm-test", (), workers.ACK_NAME, ("pod-name",))),
    ("ack, name from the hostname", ("ack", "s", {}, "hostname"),
     workers.Selector("ack", "s", (), workers.ACK_NAME, ("hostname",))),
    ("custom", ("custom", "hpc", {"role": "slurmd"}, "label:slurm/node"),
     workers.Selector("custom", "hpc", (("role", "slurmd"),), None, ("label:slurm/node",))),
])
def test_selector(case, args, want):
    assert workers.selector(*args) == want, case


@pytest.mark.parametrize("case, args, text", [
    ("unknown preset", ("slurm-operator", "slurm"), "worker_pods 'slurm-operator'"),
    ("no namespace: labels alone are anyone's", ("slinky", ""), "needs worker_namespace"),
    ("custom without labels", ("custom", "hpc", {}, "pod-name"), "needs worker_labels"),
    ("custom without a name source", ("custom", "hpc", {"a": "b"}), "needs worker_labels"),
    ("bad name source", ("ack", "s", {}, "annotation:x"), "worker_node_name 'annotation:x'"),
    ("empty label key as a source", ("ack", "s", {}, "label:"), "worker_node_name 'label:'"),
    ("label values are strings", ("slinky", "s", {"a": 1}), "worker_labels maps"),
    ("settings without worker_pods", ("", "slurm"), "need worker_pods"),
])
def test_selector_refused(case, args, text):
    with pytest.raises(ValueError, match=text):
        workers.selector(*args)


def test_config_file(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('worker_pods = "slinky"\nworker_namespace = "slurm"\n'
                    '[worker_labels]\n"slinky.slurm.net/cluster" = "c1"\n')
    cfg = load_config(str(good))
    assert exemptions_of(cfg).workers.labels[-1] == ("slinky.slurm.net/cluster", "c1")
    assert exemptions_of(SyncConfig()).workers is None        # off: as before
    for text, msg in [('worker_pods = "ack"\n', "needs worker_namespace"),
                      ('worker_pods = "yes"\nworker_namespace = "s"\n', "want one of"),
                      ('worker_pods = true\n', "worker_pods must be str"),
                      ('worker_namespace = "slurm"\n', "need worker_pods")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_config(str(bad))


# ----------------------------------------------------------------- which pods, which Slurm node

SL = workers.selector("slinky", "slurm")
ACK = workers.selector("ack", "slurm")
CUSTOM = workers.selector("custom", "hpc", {"role": "slurmd"}, "label:slurm/node")


def renamed(p, **labels):
    p["metadata"]["labels"].update(labels)
    return p


@pytest.mark.parametrize("case, sel, p, want", [
    ("slinky: the pod-hostname label", SL, slinky("ns0-abc", "k1", "slinky-0", "h"),
     workers.WorkerPod("slurm/ns0-abc", "k1", "slinky-0")),
    ("slinky: no label, spec.hostname", SL, slinky("ns0-abc", "k1", hostname="slinky-1"),
     workers.WorkerPod("slurm/ns0-abc", "k1", "slinky-1")),
    ("slinky: neither, the pod name", SL, slinky("slinky-2", "k1"),
     workers.WorkerPod("slurm/slinky-2", "k1", "slinky-2")),
    ("slinky: a blank label is not a name", SL, slinky("slinky-3", "k1", " "),
     workers.WorkerPod("slurm/slinky-3", "k1", "slinky-3")),
    ("slinky labels in another namespace: not a worker", SL,
     slinky("x", "k1", "slinky-0", ns="team-a"), None),
    ("one of slinky's labels missing", SL,
     renamed(slinky("x", "k1", "slinky-0"), **{"app.kubernetes.io/component": "login"}), None),
    ("not bound yet", SL, slinky("x", None, "slinky-0"), None),
    ("terminal", SL, {**slinky("x", "k1", "slinky-0"), "status": {"phase": "Failed"}}, None),
    ("ack: the pod name", ACK, pod("slurm-test-worker-cpu-0", "cn-hongkong.10.1.0.19", ns="slurm"),
     workers.WorkerPod("slurm/slurm-test-worker-cpu-0", "cn-hongkong.10.1.0.19",
                       "slurm-test-worker-cpu-0")),
    ("ack: the controller is no worker", ACK, pod("slurm-test-head-0", "k1", ns="slurm"), None),
    ("ack: no index", ACK, pod("slurm-test-worker-cpu", "k1", ns="slurm"), None),
    ("ack: another namespace", ACK, pod("slurm-test-worker-cpu-0", "k1", ns="default"), None),
    ("custom: the label named", CUSTOM,
     pod("w", "k1", ns="hpc", labels={"role": "slurmd", "slurm/node": "n7"}),
     workers.WorkerPod("hpc/w", "k1", "n7")),
    ("custom: the label missing, no name", CUSTOM, pod("w", "k1", ns="hpc", labels={"role": "slurmd"}),
     workers.WorkerPod("hpc/w", "k1", None)),
    ("off", None, slinky("x", "k1", "slinky-0"), None),
])
def test_worker_pod(case, sel, p, want):
    assert workers.worker_pod(p, sel) == want, case


def test_a_worker_is_exempt_because_it_is_a_worker():
    ex = usage.exemptions((), None, SL)
    assert usage.pod_usage(slinky("w", "k1", "s0"), ex) is None
    why = usage.exempt_reason(slinky("w", "k1", "s0"), ex)
    assert why.startswith("Slurm worker pod (slinky, namespace slurm)")
    # The same labels elsewhere hold their requests: anyone can write labels.
    assert usage.pod_usage(slinky("w", "k1", "s0", ns="team-a"), ex).cpu == 4 * 10**9
    # Off: a slinky-labelled pod counts like any other, as before.
    assert usage.pod_usage(slinky("w", "k1", "s0"), usage.Exemptions()).cpu == 4 * 10**9


# ----------------------------------------------------------------- the mapping

def wp(name, k, s):
    return workers.WorkerPod(f"slurm/{name}", k, s)


NODES = {"k1": {}, "k2": {}, "k3": {}, "n1": {}}
SLURM = frozenset({"s1", "s2", "s3", "n1"})
BASE = {"k1": None, "k2": None, "k3": None, "n1": "n1"}


@pytest.mark.parametrize("case, base, pods, want, warns", [
    ("no workers: base as it is", BASE, [], {}, []),
    ("one worker per node", BASE, [wp("a", "k1", "s1"), wp("b", "k2", "s2")],
     {"k1": "s1", "k2": "s2"}, []),
    ("two workers, one node, one Slurm node (a replacement starting)", BASE,
     [wp("a", "k1", "s1"), wp("a2", "k1", "s1")], {"k1": "s1"}, []),
    ("two workers claim one Slurm node: neither node maps", BASE,
     [wp("a", "k1", "s1"), wp("b", "k2", "s1")], {}, ["Slurm node s1 is named by worker pods on "
                                                      "several kubernetes nodes (k1, k2)"]),
    ("one node, workers naming two Slurm nodes", BASE,
     [wp("a", "k1", "s1"), wp("b", "k1", "s2"), wp("c", "k3", "s3")], {"k3": "s3"},
     ["kubernetes node k1: worker pods name different Slurm nodes"]),
    ("a worker without a name", BASE, [wp("a", "k1", None), wp("b", "k1", "s1")], {},
     ["worker pod slurm/a on kubernetes node k1: no Slurm node name"]),
    ("a Slurm node another node maps to (same name)", BASE, [wp("a", "k1", "n1")], {},
     ["names Slurm node n1, already mapped to kubernetes node n1"]),
    ("a Slurm node another node maps to (node_map)", {**BASE, "k3": "s1"}, [wp("a", "k1", "s1")],
     {"k3": "s1"}, ["already mapped to kubernetes node k3"]),
    ("the node's own setting wins", {**BASE, "k1": "s2"}, [wp("a", "k1", "s1")], {"k1": "s2"},
     ["maps it to Slurm node s2: that is kept"]),
    ("the node's own setting agrees", {**BASE, "k1": "s1"}, [wp("a", "k1", "s1")], {"k1": "s1"}, []),
    ("same-name node running its own worker", BASE, [wp("a", "n1", "n1")], {}, []),
    ("a Slurm node Slurm does not have (yet)", BASE, [wp("a", "k1", "s9")], {},
     ["names Slurm node s9, which Slurm does not have"]),
    ("a node with no Node object", BASE, [wp("a", "k9", "s1")], {}, ["there is no Node k9"]),
])
def test_merge(case, base, pods, want, warns):
    got, warnings = workers.merge(base, pods, NODES, SLURM)
    assert got == {**base, **want}, case
    assert len(warnings) == len(warns), (case, warnings)
    for w, text in zip(warnings, warns):
        assert text in w, (case, w)


@pytest.mark.parametrize("case, pods, before, want", [
    ("a second worker names k1's Slurm node: k1 keeps it, k2 gets nothing",
     [wp("a", "k1", "s1"), wp("b", "k2", "s1")], {"k1": "s1"}, {"k1": "s1"}),
    ("k1's worker loses its name: k1 keeps what it had",
     [wp("a", "k1", None)], {"k1": "s1"}, {"k1": "s1"}),
    ("k1 runs workers naming two nodes: it keeps the one it had",
     [wp("a", "k1", "s1"), wp("b", "k1", "s2")], {"k1": "s1"}, {"k1": "s1"}),
    ("what k1 had is now k3's, cleanly: k1 keeps nothing",
     [wp("a", "k1", None), wp("c", "k3", "s1")], {"k1": "s1"}, {"k3": "s1"}),
    ("what k1 had Slurm no longer has", [wp("a", "k1", None)], {"k1": "s8"}, {"k1": None}),
    ("a node that had nothing keeps nothing", [wp("a", "k2", "s1"), wp("b", "k3", "s1")],
     {}, {}),
])
def test_a_conflict_keeps_what_the_node_had(case, pods, before, want):
    got, warnings = workers.merge(BASE, pods, NODES, SLURM, (), before)
    assert got == {**BASE, **want}, case
    assert warnings, case


def test_the_admins_word_stands_even_where_it_names_no_slurm_node():
    # node_map says k1 is s9, which Slurm lacks: the worker there does not
    # override it (k1 maps to nothing, as without workers).
    got, warnings = workers.merge(BASE, [wp("a", "k1", "s1")], NODES, SLURM, {"k1"})
    assert got == BASE and len(warnings) == 1
    assert "maps it to a Slurm node Slurm does not have: that is kept" in warnings[0]
    knodes = {"k1": knode("k1", **{usage.NODE_LABEL: "s9"}), "k2": knode("k2")}
    d = usage.desired_state({}, knodes, [SNodeLike("s1"), SNodeLike("s2")],
                            workers=[wp("a", "k1", "s1"), wp("b", "k2", "s2")])
    assert d.k8s_to_slurm == {"k2": "s2"}
    d = usage.desired_state({}, knodes, [SNodeLike("s1")], node_map={"k2": "s1"},
                            workers=[wp("b", "k2", "s2")])
    assert d.k8s_to_slurm == {"k2": "s1"}


def test_desired_state_maps_worker_nodes_and_leaves_others_alone():
    nodes = [SNodeLike(n) for n in ("slurm-test-worker-cpu-0", "h1")]
    knodes = {"cn-hongkong.10.1.0.19": knode("cn-hongkong.10.1.0.19"), "h1": knode("h1")}
    pods = [usage.pod_usage(pod("x", "cn-hongkong.10.1.0.19", "1")),
            usage.pod_usage(pod("y", "h1", "2"))]
    k8s = usage.usage_by_k8s_node(pods)
    off = usage.desired_state(k8s, knodes, nodes)
    on = usage.desired_state(k8s, knodes, nodes, workers=[
        workers.WorkerPod("slurm/slurm-test-worker-cpu-0", "cn-hongkong.10.1.0.19",
                          "slurm-test-worker-cpu-0")])
    assert off.k8s_to_slurm == {"h1": "h1"}
    assert off == usage.desired_state(k8s, knodes, nodes, workers=None)
    assert on.k8s_to_slurm == {"cn-hongkong.10.1.0.19": "slurm-test-worker-cpu-0", "h1": "h1"}
    assert on.usage["slurm-test-worker-cpu-0"].cpu == 10**9 and on.usage["h1"].cpu == 2 * 10**9


class SNodeLike:
    def __init__(self, name):
        self.name = name
        self.gres = self.reported_gres = {"k8scpu": 4, "k8smemory": 8000}


def test_status_maps_worker_nodes_too():
    cfg = SyncConfig(worker_pods="ack", worker_namespace="slurm")
    pods = [pod("slurm-test-worker-cpu-0", "k1", "4", "0", ns="slurm"), pod("x", "k1", "1", "0")]
    assert status.pods_share(pods, [knode("k1")], {"slurm-test-worker-cpu-0"}, cfg) == {
        "slurm-test-worker-cpu-0": (1, 0)}
    assert status.pods_share(pods, [knode("k1")], {"slurm-test-worker-cpu-0"}, SyncConfig()) == {}
    assert mapping.with_workers(SyncConfig(), {"k1": None}, {"k1": {}}, set(), pods) == {"k1": None}


# ----------------------------------------------------------------- the cache

def test_cache_keeps_workers_apart_and_counts_the_rest():
    c = Cache(usage.exemptions((), None, SL))
    c.replace("pods", [slinky("w0", "k1", "s1"), pod("x", "k1", "1"),
                       slinky("w1", "k2", "s2", ns="team-a")])   # not the admin's namespace
    assert set(c.workers) == {"slurm/w0"} and set(c.pods) == {"ns/x", "team-a/w1"}
    assert c.worker_pods() == [workers.WorkerPod("slurm/w0", "k1", "s1")]
    c.take_dirty()
    c.event("pods", "MODIFIED", slinky("w0", "k3", "s1"))        # recreated elsewhere
    assert c.take_dirty() is None and c.worker_pods()[0].k8s_node == "k3"
    c.event("pods", "MODIFIED", slinky("w0", "k3", "s1"))        # no change: no full cycle
    assert c.take_dirty() == set()
    # Relabelled out of the workers: it counts from now on, and back.
    c.event("pods", "MODIFIED", renamed(slinky("w0", "k3", "s1"), **{"app.kubernetes.io/name": "x"}))
    assert "slurm/w0" in c.pods and not c.workers and c.snapshot()[0]["k3"].cpu == 4 * 10**9
    c.event("pods", "MODIFIED", slinky("w0", "k3", "s1"))
    assert "slurm/w0" not in c.pods and c.workers and "k3" not in c.snapshot()[0]
    assert [pu.uid for pu, _ in c.take_departures()] == ["uid-w0"]   # held as a pod that left
    c.event("pods", "DELETED", slinky("w0", "k3", "s1"))
    assert not c.workers and c.take_dirty() is None


# ----------------------------------------------------------------- the cycle

K19, K20 = "cn-hongkong.10.1.0.19", "cn-hongkong.10.1.0.20"


@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "slinky-0", "slinky-1")
    cfg = SyncConfig(ledger_socket="unused", worker_pods="slinky", worker_namespace="slurm")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode(K19), knode(K20)])
    cache.replace("pods", [slinky("slinky-0", K19, "slinky-0"), pod("x", K19, "1", "0")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.cycle()
    return slurm, cache, rec


def test_a_worker_maps_its_node_and_holds_no_share(world):
    slurm, cache, rec = world
    assert rec.last.k8s_to_slurm == {K19: "slinky-0"} and rec.k8s_name("slinky-0") == K19
    assert slurm.counts("slinky-0") == (3, 8000)       # x alone, not the worker's 4 CPUs
    cache.event("pods", "ADDED", pod("y", K19, "2", "0"))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.counts("slinky-0") == (1, 8000)


def test_a_conflict_maps_nothing_new_and_keeps_the_pods_counted(world):
    slurm, cache, rec = world
    # A second worker names slinky-0 from the other node: K19 keeps what it
    # had, K20 maps nothing...
    cache.event("pods", "ADDED", slinky("slinky-0-dup", K20, "slinky-0"))
    cache.event("pods", "ADDED", pod("z", K20, "2", "0"))
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K19: "slinky-0"}
    assert any("Slurm node slinky-0 is named by worker pods" in w for w in rec.warned)
    # ...so x keeps counting, and so does a pod that comes to K19 meanwhile;
    # z, never counted there, is not added.
    assert slurm.counts("slinky-0") == (3, 8000) and slurm.counts("slinky-1") == (4, 8000)
    cache.event("pods", "ADDED", pod("y", K19, "1", "0"))
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.counts("slinky-0") == (2, 8000)
    cache.event("pods", "DELETED", pod("y", K19, "1", "0", phase="Succeeded"))
    cache.event("pods", "DELETED", slinky("slinky-0-dup", K20, "slinky-0"))
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K19: "slinky-0"} and not rec.warned
    assert slurm.counts("slinky-0") == (3, 8000)


def test_a_worker_rescheduled_leaves_its_old_nodes_pods_counted(world):
    slurm, cache, rec = world
    cache.event("pods", "DELETED", slinky("slinky-0", K19, "slinky-0"))
    cache.event("pods", "ADDED", slinky("slinky-0", K20, "slinky-0"))
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K20: "slinky-0"}
    assert slurm.counts("slinky-0") == (3, 8000)        # x still runs on K19: still counted
    cache.event("pods", "DELETED", pod("x", K19, "1", "0", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (4, 8000)


class Events:
    def __init__(self):
        self.posted = []

    def generic_node(self, name, reason, message, type_="Warning"):
        self.posted.append((name, reason, message))


def test_a_slurm_node_over_its_nodes_allocatable_gets_one_event(tmp_path):
    """The Slurm node shares 4 CPUs and 8000 MB; its Kubernetes node offers
    pods 3500m and 7000Mi (kube-reserved): a warning and one Event on the
    GenericNode, again only once it has been fixed and come back."""
    slurm = SlurmWorld(str(tmp_path), "slinky-0")
    cfg = SyncConfig(ledger_socket="unused", worker_pods="slinky", worker_namespace="slurm")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    small = dict(knode(K19), status={"allocatable": {"cpu": "3500m", "memory": "7000Mi"}})
    cache.replace("nodes", [small])
    cache.replace("pods", [slinky("slinky-0", K19, "slinky-0")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.events = Events()
    rec.cycle()
    rec.cycle()
    ((name, reason, message),) = rec.events.posted
    assert (name, reason) == (K19, "SlurmCapacityOverAllocatable")
    assert "4 CPUs > allocatable cpu 3500m" in message and "8000 MB" in message
    assert message in rec.warned and "held in the ledger" in message
    # The difference is held, the worker's own requests (4 CPUs) still not:
    # jobs get 3500m - 0 of pods, rounded down, and 7000 MB.
    entries = slurm.core.nodes["slinky-0"]
    assert set(entries) == {"k8s:beyond-allocatable"}
    assert entries["k8s:beyond-allocatable"][:2] == (500, 1000 << 20)
    assert slurm.counts("slinky-0") == (3, 7000)
    cache.event("nodes", "MODIFIED", dict(small, status={"allocatable": {"cpu": "4",
                                                                          "memory": "8000Mi"}}))
    rec.cycle()
    assert not rec.last.over_allocatable and len(rec.events.posted) == 1
    assert not slurm.core.nodes.get("slinky-0") and slurm.counts("slinky-0") == (4, 8000)


# ----------------------------------------------------------------- moves

W = workers.WorkerPod


@pytest.mark.parametrize("case, known, pods, mapping, want_known, want_unplaced", [
    ("a running worker maps its node: known, held by it", (), [W("s/a", "k1", "a")],
     {"k1": "a"}, {"a"}, set()),
    ("its pod being deleted: its slurmd is going", (), [W("s/a", "k1", "a", leaving=True)],
     {"k1": "a"}, {"a"}, {"a"}),
    ("no pod at all (between the old one and its successor)", ("a",), [], {"k1": None},
     {"a"}, {"a"}),
    ("the successor bound, not yet mapped (its node maps elsewhere)", ("a",),
     [W("s/a", "k2", "a")], {"k2": "b"}, {"a"}, {"a"}),
    ("the successor mapped on another node", ("a",), [W("s/a", "k2", "a")], {"k2": "a"},
     {"a"}, set()),
    ("Slurm no longer has the node: forgotten", ("gone",), [], {}, set(), set()),
    ("a worker whose node maps nothing (a conflict): known, held whole", (),
     [W("s/a", "k1", "a")], {"k1": None}, {"a"}, {"a"}),
    ("refused, but its Slurm node mapped from another node (node_map): not held", (),
     [W("s/a", "k1", "a")], {"k1": None, "k2": "a"}, set(), set()),
    ("no usable name", (), [W("s/x", "k1", None)], {"k1": None}, set(), set()),
])
def test_unplaced(case, known, pods, mapping, want_known, want_unplaced):
    got = workers.unplaced(known, pods, mapping, {"a", "b"})
    assert got == (want_known, want_unplaced), case


def test_a_deleted_worker_pod_is_leaving():
    p = slinky("slinky-0", K19, "slinky-0")
    assert not workers.worker_pod(p, SL).leaving
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert workers.worker_pod(p, SL).leaving


@pytest.mark.parametrize("gres, entries, want", [
    ({"k8scpu": 4, "k8smemory": 8000}, {}, (4000, 8000 << 20)),
    ({"k8scpu": 4, "k8smemory": 8000}, {"u1": (1500, 1 << 30)}, (2500, (8000 << 20) - (1 << 30))),
    ({"k8scpu": 4, "k8smemory": 8000}, {"slurm:fence": (4000, 1), "u1": (1000, 0)},
     (3000, 8000 << 20)),                                           # the fence's own left out
    ({"k8scpu": 4, "k8smemory": 8000}, {"u1": (5000, 9000 << 20)}, None),   # held all already
    ({}, {}, None),
])
def test_fence_rest(gres, entries, want):
    from pyk8sres.policy import backstop
    node = type("N", (), {"gres": gres})()
    assert backstop.fence_rest(node, entries) == want
    assert backstop.fence_rest(None, entries) is None


def leaving(p):
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


def test_a_worker_moved_holds_its_slurm_node_whole_until_the_new_nodes_pods_are_counted(world):
    """The worker on K19 is deleted; its successor comes to K20, where z
    runs already.  From the deletion on, no job may start on slinky-0 (its
    slurmd is going, and the next one may register before z is counted);
    once the successor maps K20, slinky-0 holds z and, while x runs on
    K19, x too."""
    slurm, cache, rec = world
    cache.event("pods", "ADDED", pod("z", K20, "2", "0"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (3, 8000) and slurm.counts("slinky-1") == (4, 8000)
    cache.event("pods", "MODIFIED", leaving(slinky("slinky-0", K19, "slinky-0")))
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)               # held whole
    assert rec.last.k8s_to_slurm == {K19: "slinky-0"}       # x still counts there
    cache.event("pods", "DELETED", leaving(slinky("slinky-0", K19, "slinky-0")))
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)               # no pod: still whole
    cache.event("pods", "ADDED", pod("y", K19, "1", "0"))   # a pod event's cycle keeps it
    rec.cycle(refresh=False, dirty=cache.take_dirty())
    assert slurm.counts("slinky-0") == (0, 0)
    cache.event("pods", "ADDED", slinky("slinky-0", K20, "slinky-0"))
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K20: "slinky-0"}
    assert slurm.counts("slinky-0") == (0, 8000)            # z (2) + x, y kept from K19 (2)
    assert "slurm:fence" not in slurm.core.nodes["slinky-0"]
    for name in ("x", "y"):
        cache.event("pods", "DELETED", pod(name, K19, "1", "0", phase="Succeeded"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (2, 8000)            # z alone


def test_a_worker_scaled_in_keeps_its_slurm_node_held(world):
    slurm, cache, rec = world
    cache.event("pods", "DELETED", slinky("slinky-0", K19, "slinky-0"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)
    assert not rec.oversubscribed.get("slinky-0")           # on purpose, not pods over


def test_a_slurm_node_deleted_while_held_is_no_longer_sent(world):
    """Scaled in, then `scontrol delete node`: the name is gone from Slurm,
    so the daemon stops sending its share (the ledger would refuse every
    `set`, a failed cycle each time); its other nodes are unaffected."""
    slurm, cache, rec = world
    cache.event("pods", "DELETED", slinky("slinky-0", K19, "slinky-0"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)             # held whole
    del slurm.nodes["slinky-0"]
    sent = []
    call = slurm.ledger.call
    slurm.ledger.call = lambda op, **f: (sent.append((op, f.get("node"))), call(op, **f))[1]
    for _ in range(3):
        rec.cycle()
    assert ("set", "slinky-0") not in sent and not rec.failed, sent
    assert "slinky-0" not in rec.last_set


# ----------------------------------------------------------------- a moved worker's old pods

def SN(alloc=0, state="IDLE", slurmd="T1"):
    """slinky-0 after the move; slurmd: its SlurmdStartTime (T0 at the move)."""
    return SNode("slinky-0", alloc_cpus=alloc, alloc_memory=alloc * 1000, state=state,
                 slurmd_start=slurmd)


L0 = moves.Left("k1", "slinky-0", since=10.0, slurmd="T0")
L1 = moves.Left("k1", "slinky-0", since=10.0, jobs=frozenset({"7"}), slurmd="T0")


@pytest.mark.parametrize("case, left, node, view_at, jobs, placed, want", [
    ("idle after the move, placed again: released", L0, SN(), 11, None, True, None),
    ("idle, not placed yet (fenced, its new pods not counted): kept", L0, SN(), 11, None,
     False, L0),
    ("a view read before the move says nothing", L0, SN(), 10, None, True, L0),
    ("no view of the node", L0, None, 11, None, True, L0),
    ("busy, jobs not read: kept", L0, SN(2), 11, None, True, L0),
    ("completing, nothing allocated: busy", L0, SN(0, "IDLE+COMPLETING"), 11, None, True, L0),
    ("first read: its jobs noted, kept while they run", L0, SN(2), 11, frozenset({"7"}), True,
     L1),
    ("none listed on a busy node (PrivateData hides them, or ended meanwhile): kept", L0,
     SN(2), 11, frozenset(), True, L0),
    ("none listed on a busy node, jobs noted: kept", L1, SN(2), 11, frozenset(), True, L1),
    ("a job of then still runs: kept", L1, SN(2), 11, frozenset({"7", "9"}), True, L1),
    ("only later jobs (on the new node): released", L1, SN(2), 11, frozenset({"9"}), True,
     None),
    ("jobs of then gone, not placed: kept", L1, SN(2), 11, frozenset({"9"}), False, L1),
    ("the read failed: kept", L1, SN(2), 11, None, True, L1),
    ("idle: released whatever was noted", L1, SN(), 11, None, True, None),
    ("the slurmd of the move still registered (its pod force-deleted, it lives on): kept",
     L0, SN(slurmd="T0"), 11, None, True, L0),
    ("same, only later jobs listed: kept", L1, SN(2, slurmd="T0"), 11, frozenset({"9"}), True,
     L1),
    ("slurmd unknown at the move: kept", moves.Left("k1", "slinky-0", 10.0, slurmd=""), SN(),
     11, None, True, moves.Left("k1", "slinky-0", 10.0, slurmd="")),
    ("slurmd unknown now: kept", L0, SN(slurmd="None"), 11, None, True, L0),
])
def test_moved_workers_old_pods_step(case, left, node, view_at, jobs, placed, want):
    assert moves.step(left, node, view_at, jobs, placed) == want, case


@pytest.mark.parametrize("left, node, view_at, want", [
    (L0, SN(2), 11, True), (L0, SN(), 11, False), (L0, SN(2), 9, False), (L0, None, 11, False),
])
def test_moved_workers_jobs_are_read_only_when_they_can_tell(left, node, view_at, want):
    assert moves.wants_jobs(left, node, view_at) == want


@pytest.mark.parametrize("case, pods, mapping, want_unplaced", [
    ("trusted, its worker running: placed", [W("s/a", "k1", "a")], {"k1": "a"}, set()),
    ("the pods not trusted: possibly between pods unseen", [W("s/a", "k1", "a")], {"k1": "a"},
     {"a"}),
    ("not trusted, no pod known either", [], {"k1": None}, {"a"}),
])
def test_unplaced_is_level_triggered(case, pods, mapping, want_unplaced):
    trusted = case.startswith("trusted")
    assert workers.unplaced(("a",), pods, mapping, {"a", "b"}, trusted)[1] == want_unplaced, case


def moved(slurm, cache, rec, job=None):
    """slinky-0's worker leaves K19 (x, a long-lived pod, stays) for K20; a
    job runs on slinky-0 meanwhile when `job` names one."""
    if job:
        slurm.nodes["slinky-0"] = dataclasses.replace(slurm.nodes["slinky-0"], alloc_cpus=1,
                                                      alloc_memory=100, state="MIXED")
        slurm.jobs["slinky-0"] = {job}
    cache.event("pods", "DELETED", slinky("slinky-0", K19, "slinky-0"))
    cache.event("pods", "ADDED", slinky("slinky-0", K20, "slinky-0"))
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K20: "slinky-0"}
    assert slurm.counts("slinky-0") == (3, 8000)     # x counted while the new node is fenced
    registered(slurm)


def registered(slurm):
    """The replacement's slurmd registers slinky-0 (a new SlurmdStartTime)."""
    slurm.nodes["slinky-0"] = dataclasses.replace(slurm.nodes["slinky-0"],
                                                  slurmd_start="2026-01-01T00:05:00")


def test_a_moved_workers_old_pods_count_until_its_new_slurmd_registers(world):
    """Forced delete: the old slurmd may outlive its pod on K19, and takes
    slinky-0's jobs until the replacement registers: x counts until then."""
    slurm, cache, rec = world
    cache.event("pods", "DELETED", slinky("slinky-0", K19, "slinky-0"))
    cache.event("pods", "ADDED", slinky("slinky-0", K20, "slinky-0"))
    for _ in range(3):
        rec.cycle()
        assert slurm.counts("slinky-0") == (3, 8000)
    registered(slurm)
    rec.cycle()
    assert slurm.counts("slinky-0") == (4, 8000)


def test_a_moved_workers_old_pods_stop_counting_once_no_job_of_then_is_left(world):
    slurm, cache, rec = world
    moved(slurm, cache, rec)
    rec.cycle()
    assert slurm.counts("slinky-0") == (4, 8000)     # x lives on, on K19: no longer counted
    assert not rec.holds.sticky and not rec.holds.moves and not rec.move_checks
    rec.cycle()
    assert slurm.counts("slinky-0") == (4, 8000)


def test_a_moved_workers_old_pods_count_while_a_job_of_then_runs(world):
    slurm, cache, rec = world
    moved(slurm, cache, rec, job="7")
    for _ in range(3):
        rec.cycle()
        assert slurm.counts("slinky-0") == (3, 8000)     # job 7 ran beside x: x still counts
    slurm.jobs["slinky-0"] = {"7", "9"}                   # 9: later, on K20
    slurm.nodes["slinky-0"] = dataclasses.replace(slurm.nodes["slinky-0"], alloc_cpus=2)
    rec.cycle()
    assert slurm.counts("slinky-0") == (3, 8000)
    slurm.jobs["slinky-0"] = {"9"}
    slurm.nodes["slinky-0"] = dataclasses.replace(slurm.nodes["slinky-0"], alloc_cpus=1)
    rec.cycle()
    assert slurm.counts("slinky-0") == (4, 8000)      # 7 ended: only K20's pods count


def test_a_moved_workers_old_pods_count_while_its_jobs_cannot_be_read(world):
    slurm, cache, rec = world
    moved(slurm, cache, rec, job="7")

    def unreadable(names):
        raise slurm_calls.SlurmError("squeue: timed out")
    slurm.jobs_on_nodes = unreadable
    slurm.nodes["slinky-0"] = dataclasses.replace(slurm.nodes["slinky-0"], alloc_cpus=2)
    for _ in range(2):
        rec.cycle()
        assert slurm.counts("slinky-0") == (3, 8000)


def test_a_host_whose_mapping_changed_keeps_counting_its_pods_there(tmp_path):
    """Not a worker: the Slurm node did not move with a pod, its pods stay."""
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    cfg = SyncConfig(ledger_socket="unused", node_key="slurm-node")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("k1", **{"slurm-node": "n1"})])
    cache.replace("pods", [pod("x", "k1", "1", "0")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.cycle()
    cache.event("nodes", "MODIFIED", knode("k1", **{"slurm-node": "n2"}))
    for _ in range(3):
        rec.cycle()
    assert slurm.counts("n1") == (3, 8000) and slurm.counts("n2") == (3, 8000)


def test_a_move_while_the_pods_watch_is_broken_is_fenced(world):
    """The worker's deletion is never seen (the pods watch broken): its node
    is held whole while the pods are not trusted, and placed again only
    once a fresh list shows its worker running and that node's pods are
    counted."""
    slurm, cache, rec = world
    cache.event("pods", "ADDED", pod("z", K20, "2", "0"))
    rec.cycle()
    assert slurm.counts("slinky-0") == (3, 8000)
    cache.health("pods", False)
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)               # possibly between pods: whole
    assert not rec.oversubscribed.get("slinky-0")
    # The relist: the worker on K20 now, its old pod simply absent.
    cache.replace("pods", [slinky("slinky-0", K20, "slinky-0"), pod("x", K19, "1", "0"),
                           pod("z", K20, "2", "0")])
    cache.health("pods", True)
    rec.cycle()
    assert rec.last.k8s_to_slurm == {K20: "slinky-0"}
    assert "slurm:fence" not in slurm.core.nodes["slinky-0"]
    assert slurm.counts("slinky-0") == (1, 8000)            # z + x (kept from K19)


def test_a_worker_node_this_process_could_not_set_is_fenced_while_the_pods_are_not_trusted(
        world):
    """Its last write failed (nothing this process set there to keep), then
    the pods watch breaks: the node is held whole all the same."""
    slurm, cache, rec = world
    rec.last_set.clear()
    cache.health("pods", False)
    rec.cycle()
    assert slurm.counts("slinky-0") == (0, 0)


def test_a_move_waiting_while_the_pods_are_not_trusted_asks_no_cycle_after_cycle(world):
    """Placed again but not trusted: no full cycle is asked for each cycle
    (a loop that would spin), and none is released."""
    slurm, cache, rec = world
    moved(slurm, cache, rec)
    cache.health("nodes", False)
    cache.take_dirty()
    for _ in range(2):
        rec.cycle()
        assert cache.take_dirty() == set()
    assert rec.holds.moves


def test_jobs_on_nodes_reads_every_waiting_node_in_one_squeue(monkeypatch):
    calls = []
    out = ["7 R slinky-[0-1]", "8 CG slinky-1", "9 PD (null)", "10 S slinky-0,other",
           "11 R other", "garbled"]

    def run(*argv, **kw):
        calls.append(argv)
        return "\n".join(out)
    monkeypatch.setattr(slurm_calls, "run", run)
    assert slurm_calls.jobs_on_nodes({"slinky-0", "slinky-1", "slinky-2"}) == {
        "slinky-0": {"7", "10"}, "slinky-1": {"7", "8"}, "slinky-2": frozenset()}
    assert len(calls) == 1 and calls[0][calls[0].index("-w") + 1] == "slinky-0,slinky-1,slinky-2"
    assert slurm_calls.jobs_on_nodes(set()) == {} and len(calls) == 1


def test_a_node_squeue_does_not_know_fails_only_its_own_read(world):
    """squeue -w refuses every name for one it does not know (a node
    deleted meanwhile): each node is read alone then, and only that one's
    move is kept unread."""
    slurm, _, rec = world
    read = slurm.jobs_on_nodes
    calls = []

    def jobs_on_nodes(names):
        calls.append(set(names))
        if "gone" in names:
            raise slurm_calls.SlurmError("squeue: error: Invalid node name specified")
        return read(names)
    slurm.jobs["slinky-0"] = {"7"}
    rec.slurm.jobs_on_nodes = jobs_on_nodes
    got, _ = rec._jobs_on({"slinky-0", "gone"})
    assert got == {"slinky-0": {"7"}}
    assert calls == [{"slinky-0", "gone"}, {"gone"}, {"slinky-0"}]
