"""Table-driven tests of the Event rate limiting (pyk8sres.policy.events)."""

import pytest

from pyk8sres.policy import events as E

L = E.Limits(update_interval=5.0, window=600.0, max_keys=3)
K = ("default", "Pod", "web-1", "u-1", "InsufficientSharedCapacity")


def seen(count, written, first, last, sent):
    return E.Seen(count=count, written=written, first=first, last=last, sent=sent)


@pytest.mark.parametrize("case,table,now,action,entry", [
    ("first occurrence creates", {}, 100.0, E.CREATE, seen(1, 1, 100, 100, 100)),
    ("again within the interval folds", {K: seen(1, 1, 100, 100, 100)}, 101.0, E.DROP,
     seen(2, 1, 100, 101, 100)),
    ("folds keep counting", {K: seen(7, 1, 100, 104, 100)}, 104.9, E.DROP,
     seen(8, 1, 100, 104.9, 100)),
    ("after the interval bumps the count with everything folded",
     {K: seen(7, 1, 100, 104, 100)}, 105.0, E.UPDATE, seen(8, 8, 100, 105, 105)),
    ("interval counts from the last write, not the last occurrence",
     {K: seen(3, 3, 100, 110, 108)}, 112.0, E.DROP, seen(4, 3, 100, 112, 108)),
    ("a key quiet for the window starts a new Event", {K: seen(9, 9, 100, 100, 100)}, 700.0,
     E.CREATE, seen(1, 1, 700, 700, 700)),
    ("just inside the window still bumps", {K: seen(9, 9, 100, 100, 100)}, 699.0, E.UPDATE,
     seen(10, 10, 100, 699, 699)),
    ("another key is independent", {("default", "Pod", "web-2", "u-2", "x"):
                                    seen(1, 1, 100, 100, 100)}, 100.5, E.CREATE,
     seen(1, 1, 100.5, 100.5, 100.5)),
    ("an occurrence stamped before the latest keeps last", {K: seen(2, 1, 100, 103, 100)}, 102.0,
     E.DROP, seen(3, 1, 100, 103, 100)),
])
def test_decide(case, table, now, action, entry):
    got_action, got = E.decide(K, now, table, L)
    assert (got_action, got) == (action, entry), case


def test_storm_of_n_is_one_create_and_few_writes():
    """100 refusals of one pod in 10 s (kube-scheduler retrying): one Event,
    the count complete once due() has flushed, and at most one write per interval."""
    table, writes = {}, []
    for i in range(100):
        now = 1000.0 + i * 0.1
        action, table[K] = E.decide(K, now, table, L)
        if action != E.DROP:
            writes.append((action, now))
    assert [a for a, _ in writes] == [E.CREATE, E.UPDATE]        # at 1000.0 and 1005.0
    assert table[K].count == 100 and table[K].written < 100
    assert E.due(table, 1009.95, L) == []                        # 4.95 s after the last write
    assert E.due(table, 1010.0, L) == [K]
    table[K] = E.flushed(table[K], 1010.0)
    assert table[K].written == 100 and E.due(table, 2000.0, L) == []


@pytest.mark.parametrize("case,table,now,keys", [
    ("nothing pending", {"a": seen(3, 3, 0, 1, 1)}, 100.0, []),
    ("pending but written too recently", {"a": seen(4, 3, 0, 3, 1)}, 5.9, []),
    ("pending and due", {"a": seen(4, 3, 0, 3, 1)}, 6.0, ["a"]),
    ("oldest write first", {"a": seen(4, 3, 0, 9, 3), "b": seen(2, 1, 0, 9, 1),
                            "c": seen(5, 5, 0, 9, 0)}, 20.0, ["b", "a"]),
])
def test_due(case, table, now, keys):
    assert E.due(table, now, L) == keys, case


@pytest.mark.parametrize("case,table,now,kept", [
    ("keys past the window go", {"old": seen(1, 1, 0, 0, 0), "new": seen(1, 1, 0, 500, 500)},
     600.0, ["new"]),
    ("pending keys in their window stay", {"p": seen(5, 1, 0, 590, 0)}, 600.0, ["p"]),
    ("at most max_keys, most recent kept",
     {k: seen(1, 1, 0, t, t) for k, t in (("a", 1), ("b", 4), ("c", 2), ("d", 3))}, 10.0,
     ["b", "c", "d"]),
])
def test_prune(case, table, now, kept):
    assert sorted(E.prune(table, now, L)) == kept, case


@pytest.mark.parametrize("code,reason", [
    ("nofit", "InsufficientSharedCapacity"),
    ("ledger_unreachable", "LedgerUnreachable"),
    ("pod_unreadable", "AdmissionRefused"),
    ("internal", "AdmissionRefused"),
])
def test_refusal_reason(code, reason):
    assert E.refusal_reason(code) == reason
