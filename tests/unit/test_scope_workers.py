"""The webhook's Scope with worker_pods: Slurm's worker pods map the nodes
they run on exactly as the sync daemon maps them (its matchCondition, each
review and the placeholders agree with sync), and while those pods are not
known nothing is taken as not shared (fail closed)."""

import threading
import time

import pytest

from pyk8sres.coordinator import mapping
from pyk8sres.coordinator.config import SyncConfig, exemptions_of
from pyk8sres.coordinator.kube import Informer
from pyk8sres.coordinator.scope import Scope, WorkersUnknown
from pyk8sres.policy import admission
from pyk8sres.policy import usage

K19, K20 = "cn-hongkong.10.1.0.19", "cn-hongkong.10.1.0.20"
SLINKY = SyncConfig(worker_pods="slinky", worker_namespace="slurm")
SLURM = ["n1", "n2", "n3"]


def worker(name, node, slurm_node, ns="slurm", phase="Running", hostname_label=True):
    labels = {"app.kubernetes.io/name": "slurmd", "app.kubernetes.io/component": "worker"}
    if hostname_label:
        labels["nodeset.slinky.slurm.net/pod-hostname"] = slurm_node
    return {"metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": node}, "status": {"phase": phase}}


def knode(name, label=None):
    return {"metadata": {"name": name, "labels": {usage.NODE_LABEL: label} if label else {}},
            "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}}}


def scope(cfg, nodes, pods, slurm=SLURM, listed=True):
    s = Scope(cfg)
    s.replace_slim("nodes", [s.slim("nodes", n) for n in nodes])
    s.update(slurm_names=slurm)
    if listed:
        s.replace_slim("pods", [s.slim("pods", p) for p in pods])
    return s


NODES = [knode(K19), knode(K20), knode("n1")]

# (case, settings, nodes, worker pods, Kubernetes node -> Slurm node expected)
CASES = [
    ("a worker maps its node", SLINKY, NODES, [worker("w-0", K19, "n2")],
     {K19: "n2", K20: None, "n1": "n1"}),
    ("its name from spec.hostname without the label", SLINKY, NODES,
     [{**worker("n3", K20, "", hostname_label=False),
       "spec": {"nodeName": K20, "hostname": "n3"}}],
     {K19: None, K20: "n3", "n1": "n1"}),
    ("a Slurm node Slurm lacks maps nothing", SLINKY, NODES, [worker("w-0", K19, "n9")],
     {K19: None, K20: None, "n1": "n1"}),
    ("two nodes naming n2: neither", SLINKY, NODES,
     [worker("w-0", K19, "n2"), worker("w-1", K20, "n2")], {K19: None, K20: None, "n1": "n1"}),
    ("the same name wins over a worker naming it elsewhere", SLINKY, NODES,
     [worker("w-0", K19, "n1")], {K19: None, K20: None, "n1": "n1"}),
    ("the admin's label wins over a worker", SLINKY, [knode(K19, "n3"), knode(K20)],
     [worker("w-0", K19, "n2")], {K19: "n3", K20: None}),
    ("a worker outside worker_namespace is any pod", SLINKY, NODES,
     [worker("w-0", K19, "n2", ns="default")], {K19: None, K20: None, "n1": "n1"}),
    ("a finished worker maps nothing", SLINKY, NODES,
     [worker("w-0", K19, "n2", phase="Succeeded")], {K19: None, K20: None, "n1": "n1"}),
    ("worker_pods off: workers map nothing", SyncConfig(), NODES, [worker("w-0", K19, "n2")],
     {K19: None, K20: None, "n1": "n1"}),
]


@pytest.mark.parametrize("case,cfg,nodes,pods,want", CASES, ids=[c[0] for c in CASES])
def test_the_scope_maps_as_the_sync_daemon(case, cfg, nodes, pods, want):
    s = scope(cfg, nodes, pods)
    by_name = {n["metadata"]["name"]: usage.slim_node(n, cfg.node_key) for n in nodes}
    synced = mapping.with_workers(cfg, mapping.slurm_nodes(cfg, by_name, frozenset(SLURM)),
                                  by_name, frozenset(SLURM), pods)
    assert synced == want                 # what sync (and `pyk8sres status`) map
    assert {k: s.slurm_node(k) for k in want} == want
    assert s.shared() == {k: v for k, v in want.items() if v}
    assert s.unshared() == sorted(k for k, v in want.items() if not v)


def test_worker_pod_events_move_the_mapping_and_bump_the_version():
    s = scope(SLINKY, NODES, [])
    assert s.slurm_node(K19) is None and K19 in s.unshared()
    _, v0 = s.snapshot()
    s.event("pods", "ADDED", worker("w-0", K19, "n2"))
    assert s.slurm_node(K19) == "n2" and K19 not in s.unshared()
    assert s.snapshot()[1] > v0 and s.changed.is_set()
    s.event("pods", "DELETED", worker("w-0", K19, "n2"))          # rescheduled...
    s.event("pods", "ADDED", worker("w-0", K20, "n2"))            # ...onto K20
    assert s.shared() == {K20: "n2", "n1": "n1"}
    s.event("pods", "MODIFIED", worker("w-0", K20, "n2", phase="Failed"))
    assert s.shared() == {"n1": "n1"}
    _, v1 = s.snapshot()
    s.event("pods", "MODIFIED", {**worker("x", K19, "n2", ns="slurm"),
                                 "metadata": {"name": "x", "namespace": "slurm"}})
    assert s.snapshot()[1] == v1          # a pod that is no worker changes nothing


# (case, how the worker pods are known) -> unshared() and each node's answer
# ("refused": WorkersUnknown) while they are not trusted.
UNTRUSTED = [
    ("never listed", lambda s: None),
    ("watch broken", lambda s: s.health("pods", False)),
    ("watch silent", lambda s: setattr(s, "workers_contacted", time.monotonic() - 60)),
]


@pytest.mark.parametrize("case,how", UNTRUSTED, ids=[c[0] for c in UNTRUSTED])
def test_while_the_workers_are_not_known_nothing_is_taken_as_not_shared(case, how):
    cfg = SyncConfig(worker_pods="slinky", worker_namespace="slurm", node_map={"k-map": "n3"})
    nodes = NODES + [knode("k-label", "n3"), knode("k-map"), knode("k-gone", "n7")]
    s = scope(cfg, nodes, [worker("w-0", K19, "n2")], listed=case != "never listed")
    s.stale_after = 30.0
    s.contact("pods")
    s.contact("nodes")
    if case != "never listed":
        assert s.unshared() == sorted([K20, "k-gone"])   # trusted: as sync maps
    how(s)
    assert s.unshared() == []                           # every node checked
    want = {"n1": "n1", "k-label": "n3", "k-map": "n3",   # the admin's word stands
            "k-gone": None}                            # labelled for a node Slurm lacks
    if case == "never listed":
        want[K19] = want[K20] = "refused"
    else:
        want[K19], want[K20] = "n2", "refused"           # as last seen; unknown
    got = {}
    for k in want:
        try:
            got[k] = s.slurm_node(k)
        except WorkersUnknown as e:
            assert "worker pods (slinky, namespace slurm) are not known" in str(e)
            got[k] = "refused"
    assert got == want


def test_the_webhook_refuses_a_pod_where_the_mapping_is_unknown_unless_exempt():
    t = admission.Target("bind", "default", "p", K20, False)
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u1"},
           "spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}
    why = "cannot tell whether node ... is shared with Slurm"
    ex = usage.exemptions((), None, None)
    d = admission.plan(t, pod, None, ex, unknown=why)
    assert isinstance(d, admission.Deny) and d.code == "workers_unknown" and why in d.message
    assert d.code in admission.DENY_CODES
    assert isinstance(admission.plan(t, pod, None, ex), admission.Allow)       # known not shared
    w = worker("w-0", K20, "n2")
    bind = admission.Target("bind", "slurm", "w-0", K20, False)
    d = admission.plan(bind, w, None, exemptions_of(SLINKY), unknown=why)
    assert isinstance(d, admission.Allow) and d.code == "exempt"       # Slurm's own worker
    # the pod not found:
    assert isinstance(admission.plan(t, None, None, ex, unknown=why), admission.Deny)


class QuietServer:
    """Lists, then opens watches that say nothing; records each request's
    namespace (the webhook's worker Informer reads only worker_namespace)."""
    timeout = 0.2

    def __init__(self, items):
        self.items, self.calls = items, []
        self.release = threading.Event()

    def list(self, kind, reduce=None, namespace=None):
        self.calls.append(("list", kind, namespace))
        objs = [o for o in self.items if namespace is None
                or o["metadata"].get("namespace") == namespace]
        return [reduce(o) for o in objs] if reduce else objs, "10"

    def watch(self, kind, rv, timeout, namespace=None):
        self.calls.append(("watch", kind, namespace))

        def quiet():
            self.release.wait()
            return
            yield
        return quiet()


def test_a_live_worker_informer_maps_and_a_stuck_one_checks_every_node():
    s = Scope(SLINKY)
    s.replace_slim("nodes", [s.slim("nodes", n) for n in NODES])
    s.update(slurm_names=SLURM)
    s.health("nodes", True)
    server = QuietServer([worker("w-0", K19, "n2"), worker("w-x", K20, "n3", ns="other")])
    stop = threading.Event()
    inf = Informer(server, "pods", s, watch_timeout=1, stop=stop, namespace="slurm")
    s.stale_after = inf.stale_after()
    s.contact("nodes")
    inf.start()

    def wait(cond, seconds=5.0):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s.contact("nodes")           # only the workers' watch goes quiet
            if cond():
                return True
            time.sleep(0.02)
        return False
    try:
        assert wait(lambda: s.unshared() == [K20])
        assert s.shared() == {K19: "n2", "n1": "n1"}
        assert ("list", "pods", "slurm") in server.calls
        assert {c[2] for c in server.calls} == {"slurm"}
        assert wait(lambda: s.unshared() == [], 3)     # stuck: every node checked
    finally:
        stop.set()
        server.release.set()
