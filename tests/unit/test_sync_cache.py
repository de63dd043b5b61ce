"""The sync daemon's cache without any server: fed with watch events and
lists, its per-node sums, its health and the nodes a change dirties; and
the informer that feeds it, against a scripted API server."""

import random
import threading
import time

from memory_slurm import knode, pod
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.kube import Gone, Informer
from pyk8sres.policy import usage as usage_policy


def test_cache_tracks_watch_events():
    c = Cache(usage_policy.exemptions(["slurm"]))
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


def test_cache_sums_match_a_full_recount():
    """Incremental per-node sums == summing the pods from scratch, after
    random adds, modifies, moves, terminal phases, bad data and deletes."""
    rnd = random.Random(7)
    c = Cache(usage_policy.exemptions(["slurm"]))
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
    assert usage == usage_policy.usage_by_k8s_node(c.pods.values())


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


# ----------------------------------------------------------------- informer

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


def play(server, cache, settle=0.0) -> Informer:
    """An informer over `server`'s script until it is played (5 s at most)
    and `settle` seconds more, then stopped."""
    stop = threading.Event()
    inf = Informer(server, "pods", cache, watch_timeout=1, backoff_max=0.01, stop=stop)
    inf.start()
    deadline = time.monotonic() + 5
    while server.watches and time.monotonic() < deadline:
        time.sleep(0.01)
    if settle:
        time.sleep(settle)
    stop.set()
    inf.join(2)
    return inf


def test_informer_rewatch_relist_and_health():
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
    inf = play(server, c, settle=0.05)
    # A normal end resumes from the bookmark's rv; an error or 410 relists.
    assert server.watch_rvs[:4] == ["10", "20", "30", "50"]
    assert set(c.pods) == {"ns/z", "ns/y"}
    assert c.snapshot()[0]["n1"].cpu == 4 * 10**9
    assert inf.relists == 3


def test_informer_marks_the_cache_unhealthy_on_410_until_relisted():
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
    play(server, c)
    # open (True), 410 (False), relist, open again (True): never "in sync"
    # between the 410 and the relist.
    assert c.calls[:4] == [("replace", 1), ("health", True), ("health", False), ("replace", 0)]
