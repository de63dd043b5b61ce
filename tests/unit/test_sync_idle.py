"""When no event woke the sync loop, a cycle over every node is due only if
something changed that raises no event: the O(1) check that keeps an idle
daemon from recomputing every node each second."""
import pytest

from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import SyncConfig, exemptions_of

from memory_slurm import SlurmWorld, knode, pod


@pytest.fixture
def rec(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1")
    cfg = SyncConfig(ledger_socket="unused", idle_full_seconds=30.0)
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1")])
    cache.replace("pods", [pod("a", "n1", "2", "0")])
    r = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    r.cycle()
    return r


def _silent_watch(r):
    r.cache.stale_after = 5.0
    r.cache.contacted["pods"] = -1e9


def _failed_write(r):
    r.failed = True


def _long_ago(r):
    r.last_full -= 31


def _recently(r):
    r.last_full -= 29


def _lost_decision(r):
    r.last = None


@pytest.mark.parametrize("change, due", [
    (None, False),                  # nothing happened: no cycle over every node
    (_recently, False),             # 29 s after the last full cycle
    (_long_ago, True),              # idle_full_seconds passed
    (_silent_watch, True),          # the pods watch went quiet: fail closed now
    (_failed_write, True),          # a ledger or GenericNode write to retry
    (_lost_decision, True),         # no decision yet
])
def test_idle_cycle_due(rec, change, due):
    assert rec.idle_cycle_due() is False
    if change:
        change(rec)
    assert rec.idle_cycle_due() is due


def test_a_full_cycle_clears_what_made_it_due(rec):
    _failed_write(rec)
    _long_ago(rec)
    assert rec.idle_cycle_due()
    rec.cycle()
    assert not rec.idle_cycle_due()


def test_a_ledger_that_refuses_makes_the_next_idle_wake_retry(rec):
    def down(*_a, **_k):
        raise OSError("slurmctld is down")
    rec.ledger.set = down
    rec.cache.event("pods", "ADDED", pod("b", "n1", "1", "0"))
    rec.cycle(refresh=False, dirty=rec.cache.take_dirty())
    assert rec.failed and rec.idle_cycle_due()
