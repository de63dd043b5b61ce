"""Stale data: a watch that has gone quiet while the API server moved on.

The Informer reports every sign of life (an event, a bookmark, a watch
opened) through contact(); a watch quiet for longer than a live one ever
is (stale_after: each is reopened every watch_timeout seconds) is not
trusted.  The sync daemon then releases nothing; the webhook's scope
then checks every node (a node may have joined or been relabelled shared
meanwhile)."""

import threading
import time

from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import SyncConfig, exemptions_of
from pyk8sres.coordinator.kube import Informer
from pyk8sres.coordinator.scope import Scope
from pyk8sres.policy import usage

from memory_slurm import SlurmWorld, knode, pod


class StuckServer:
    """An API server whose watch opens, then says nothing more (a stuck
    stream, a watch cache that stopped following etcd) while its objects
    change: the list it would give now has moved on."""

    timeout = 0.2

    def __init__(self, items, rv="10"):
        self.items, self.rv = items, rv
        self.release = threading.Event()
        self.watches = 0

    def list(self, kind, reduce=None):
        return ([reduce(o) for o in self.items] if reduce else list(self.items)), self.rv

    def watch(self, kind, rv, timeout):
        self.watches += 1

        def quiet():
            self.release.wait()
            return
            yield
        return quiet()


def _wait(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_stuck_pods_watch_is_detected_and_releases_nothing(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1")
    cfg = SyncConfig(ledger_socket="unused")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    servers = {"nodes": StuckServer([knode("n1")]),
               "pods": StuckServer([pod("a", "n1", "2", "0")])}
    stop = threading.Event()
    informers = [Informer(srv, kind, cache, watch_timeout=1, stop=stop)
                 for kind, srv in servers.items()]
    cache.stale_after = informers[1].stale_after()
    assert cache.stale_after == 1.2
    for i in informers:
        i.start()
    try:
        assert _wait(lambda: cache.not_ready() is None)
        rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
        rec.cycle()
        assert slurm.counts("n1") == (2, 8000)
        # The pod is deleted on the server, and b bound; the stuck watch says
        # nothing of either.  Once it has been quiet past stale_after:
        # (the nodes watch, stuck too, may be found silent a moment earlier)
        assert _wait(lambda: "pods" in (cache.not_ready() or ""))
        cache.event("pods", "DELETED", pod("a", "n1"))    # what a late event would say
        rec.cycle()
        assert slurm.counts("n1") == (2, 8000)            # nothing released
    finally:
        stop.set()
        for srv in servers.values():
            srv.release.set()


def test_the_webhook_scope_checks_every_node_while_the_nodes_watch_is_quiet():
    s = Scope(SyncConfig())
    s.stale_after = 0.2
    s.replace_slim("nodes", [s.slim("nodes", knode(n)) for n in ("n1", "k8s-only")])
    s.update(slurm_names=["n1"])
    s.contact("nodes")
    assert s.unshared() == ["k8s-only"]
    # Quiet past stale_after: "k8s-only" may have been relabelled shared.
    assert _wait(lambda: s.unshared() == [], 2)
    s.contact("nodes")
    assert s.unshared() == ["k8s-only"]
    # A scope no Informer feeds (stale_after None) is never silent.
    t = Scope(SyncConfig())
    t.replace_slim("nodes", [t.slim("nodes", knode("k8s-only"))])
    t.update(slurm_names=["n1"])
    assert t.unshared() == ["k8s-only"]


def test_the_webhook_scope_follows_a_live_informer_and_detects_a_stuck_one():
    s = Scope(SyncConfig())
    server = StuckServer([knode("n1"), knode("k8s-only", **{usage.NODE_LABEL: ""})])
    stop = threading.Event()
    inf = Informer(server, "nodes", s, watch_timeout=1, stop=stop)
    s.stale_after = inf.stale_after()
    s.update(slurm_names=["n1"])
    inf.start()
    try:
        assert _wait(lambda: s.unshared() == ["k8s-only"])
        assert _wait(lambda: s.unshared() == [], 3)     # stuck: every node checked
    finally:
        stop.set()
        server.release.set()
