"""Table-driven tests of the Event rate limiting (pyk8sres.policy.events)."""

import pytest

from pyk8sres.policy import events

L = events.Limits(update_interval=5.0, window=600.0, max_keys=3)
K = ("default", "Pod", "web-1", "u-1", "InsufficientSharedCapacity")


def seen(count, written, first, last, sent):
    return events.Seen(count=count, written=written, first=first, last=last, sent=sent)


@pytest.mark.parametrize("case,table,now,action,entry", [
    ("first occurrence creates", {}, 100.0, events.CREATE, seen(1, 1, 100, 100, 100)),
    ("again within the interval folds", {K: seen(1, 1, 100, 100, 100)}, 101.0, events.DROP,
     seen(2, 1, 100, 101, 100)),
    ("folds keep counting", {K: seen(7, 1, 100, 104, 100)}, 104.9, events.DROP,
     seen(8, 1, 100, 104.9, 100)),
    ("after the interval bumps the count with everything folded",
     {K: seen(7, 1, 100, 104, 100)}, 105.0, events.UPDATE, seen(8, 8, 100, 105, 105)),
    ("interval counts from the last write, not the last occurrence",
     {K: seen(3, 3, 100, 110, 108)}, 112.0, events.DROP, seen(4, 3, 100, 112, 108)),
    ("a key quiet for the window starts a new Event", {K: seen(9, 9, 100, 100, 100)}, 700.0,
     events.CREATE, seen(1, 1, 700, 700, 700)),
    ("just inside the window still bumps", {K: seen(9, 9, 100, 100, 100)}, 699.0, events.UPDATE,
     seen(10, 10, 100, 699, 699)),
    ("another key is independent", {("default", "Pod", "web-2", "u-2", "x"):
                                    seen(1, 1, 100, 100, 100)}, 100.5, events.CREATE,
     seen(1, 1, 100.5, 100.5, 100.5)),
    ("an occurrence stamped before the latest keeps last", {K: seen(2, 1, 100, 103, 100)}, 102.0,
     events.DROP, seen(3, 1, 100, 103, 100)),
])
def test_decide(case, table, now, action, entry):
    got_action, got = events.decide(K, now, table, L)
    assert (got_action, got) == (action, entry), case


def test_storm_of_n_is_one_create_and_few_writes():
    """100 refusals of one pod in 10 s (kube-scheduler retrying): one Event,
    the count complete once due() has flushed, and at most one write per interval."""
    table, writes = {}, []
    for i in range(100):
        now = 1000.0 + i * 0.1
        action, table[K] = events.decide(K, now, table, L)
        if action != events.DROP:
            writes.append((action, now))
    assert [a for a, _ in writes] == [events.CREATE, events.UPDATE]        # at 1000.0 and 1005.0
    assert table[K].count == 100 and table[K].written < 100
    assert events.due(table, 1009.95, L) == []                        # 4.95 s after the last write
    assert events.due(table, 1010.0, L) == [K]
    table[K] = events.flushed(table[K], 1010.0)
    assert table[K].written == 100 and events.due(table, 2000.0, L) == []


@pytest.mark.parametrize("case,table,now,keys", [
    ("nothing pending", {"a": seen(3, 3, 0, 1, 1)}, 100.0, []),
    ("pending but written too recently", {"a": seen(4, 3, 0, 3, 1)}, 5.9, []),
    ("pending and due", {"a": seen(4, 3, 0, 3, 1)}, 6.0, ["a"]),
    ("oldest write first", {"a": seen(4, 3, 0, 9, 3), "b": seen(2, 1, 0, 9, 1),
                            "c": seen(5, 5, 0, 9, 0)}, 20.0, ["b", "a"]),
])
def test_due(case, table, now, keys):
    assert events.due(table, now, L) == keys, case


@pytest.mark.parametrize("case,table,now,kept", [
    ("keys past the window go", {"old": seen(1, 1, 0, 0, 0), "new": seen(1, 1, 0, 500, 500)},
     600.0, ["new"]),
    ("pending keys in their window stay", {"p": seen(5, 1, 0, 590, 0)}, 600.0, ["p"]),
    ("at most max_keys, most recent kept",
     {k: seen(1, 1, 0, t, t) for k, t in (("a", 1), ("b", 4), ("c", 2), ("d", 3))}, 10.0,
     ["b", "c", "d"]),
])
def test_prune(case, table, now, kept):
    assert sorted(events.prune(table, now, L)) == kept, case


@pytest.mark.parametrize("code,reason", [
    ("nofit", "InsufficientSharedCapacity"),
    ("ledger_unreachable", "LedgerUnreachable"),
    ("pod_unreadable", "AdmissionRefused"),
    ("internal", "AdmissionRefused"),
])
def test_refusal_reason(code, reason):
    assert events.refusal_reason(code) == reason


B = events.Limits(update_interval=5.0, window=600.0, rate=2.0, burst=3)


@pytest.mark.parametrize("case,bucket,now,ok,after", [
    ("full bucket gives a token", events.Bucket(3.0, 10.0), 10.0, True, events.Bucket(2.0, 10.0)),
    ("empty bucket refuses", events.Bucket(0.4, 10.0), 10.0, False, events.Bucket(0.4, 10.0)),
    ("refills at rate", events.Bucket(0.4, 10.0), 10.3, True, events.Bucket(0.0, 10.3)),
    ("never above burst", events.Bucket(2.0, 0.0), 100.0, True, events.Bucket(2.0, 100.0)),
    ("a clock going back refills nothing", events.Bucket(0.5, 10.0), 9.0, False,
     events.Bucket(0.5, 9.0)),
])
def test_take(case, bucket, now, ok, after):
    got_ok, got = events.take(bucket, now, B)
    assert (got_ok, got.at) == (ok, after.at) and got.tokens == pytest.approx(after.tokens), case


@pytest.mark.parametrize("case,bucket,now,seconds", [
    ("a token now", events.Bucket(1.0, 10.0), 10.0, 0.0),
    ("refilled meanwhile", events.Bucket(0.4, 10.0), 10.3, 0.0),
    ("at rate 2/s, 0.6 tokens short", events.Bucket(0.4, 10.0), 10.0, 0.3),
    ("partly refilled", events.Bucket(0.0, 10.0), 10.25, 0.25),
])
def test_until_token(case, bucket, now, seconds):
    assert events.until_token(bucket, now, B) == pytest.approx(seconds), case
    ok, _ = events.take(bucket, now + seconds + 1e-9, B)
    assert ok, case                                     # take() agrees at that moment


def test_until_token_never_refilling():
    assert events.until_token(events.Bucket(0.0, 0.0), 5.0, events.Limits(rate=0.0)) == float("inf")


@pytest.mark.parametrize("case,table,bucket,action,entry", [
    ("new key with a token creates", {}, events.Bucket(1, 100), events.CREATE,
     seen(1, 1, 100, 100, 100)),
    ("new key without a token is suppressed (nothing remembered)", {}, events.Bucket(0, 100),
     events.SUPPRESS, None),
    ("a due bump without a token folds", {K: seen(3, 3, 0, 90, 90)}, events.Bucket(0, 100),
     events.DROP,
     seen(4, 3, 0, 100, 90)),
    ("a due bump with a token updates", {K: seen(3, 3, 0, 90, 90)}, events.Bucket(1, 100),
     events.UPDATE,
     seen(4, 4, 0, 100, 100)),
    ("a fold costs no token", {K: seen(3, 3, 0, 99, 99)}, events.Bucket(0, 100), events.DROP,
     seen(4, 3, 0, 100, 99)),
])
def test_throttled(case, table, bucket, action, entry):
    got_action, got, after = events.throttled(K, 100.0, table, bucket, B)
    assert (got_action, got) == (action, entry), case
    spent = action in (events.CREATE, events.UPDATE)
    assert after.tokens == pytest.approx(bucket.tokens - (1 if spent else 0)), case


def test_churn_of_distinct_pods_is_bounded_by_the_budget():
    """1000 different pods refused, 100 every 0.25 s for 2.25 s: burst + rate x 2.25 s
    Events (a token every 0.5 s), no more."""
    table, bucket, created = {}, events.Bucket(B.burst, 0.0), 0
    for i in range(1000):
        key = ("ns", "Pod", f"p{i}", f"u{i}", "InsufficientSharedCapacity")
        action, s, bucket = events.throttled(key, (i // 100) * 0.25, table, bucket, B)
        if s is not None:
            table[key] = s
        created += action == events.CREATE
    assert created == B.burst + 4 == len(table)
