"""The ledger's rules (pyk8sres.policy.ledger) and its journal
(pyk8sres.slurmctld.ledger): table-driven, plus a fuzz of the request parser
and a crash-replay check.  The real slurmctld side: tests/integration."""
import json
import os
import random
import time

import pytest

from pyk8sres.coordinator import status
from pyk8sres.coordinator.config import SyncConfig
from pyk8sres.policy import ledger as ledger_policy
from pyk8sres.policy.ledger import Entry, Facts, Request, RequestError
from pyk8sres.slurmctld import ledger as ledger_journal
from pyk8sres.slurmctld.ledger import Ledger

MIB = 1 << 20
NODE = Facts(capacity_cpu=8, capacity_mem=16000, jobs_cpu=3, jobs_mem=4000)


@pytest.mark.parametrize("line, expected", [
    ('{"op":"show"}', Request("show")),
    ('{"op":"show","node":"n1"}', Request("show", node="n1")),
    ('{"op":"reserve","node":"n1","key":"u-1","cpu_m":2735,"mem_bytes":5}',
     Request("reserve", "n1", "u-1", 2735, 5)),
    ('{"op":"release","node":"n1","key":"u-1"}', Request("release", "n1", "u-1")),
    ('{"op":"release","node":"n1","key":"u-1","unbound_only":true}',
     Request("release", "n1", "u-1", unbound_only=True)),
    ('{"op":"release","node":"n1","key":"u-1","unbound_only":false}',
     Request("release", "n1", "u-1")),
    ('{"op":"set","node":"n1","entries":{"b":[1,2],"a":[3,4]},"keep_younger_than":30}',
     Request("set", "n1", entries=(("a", 3, 4), ("b", 1, 2)), keep_younger_than=30.0)),
    ('{"op":"set","node":"n1","entries":{}}', Request("set", "n1")),
])
def test_parse_request(line, expected):
    assert ledger_policy.parse_request(line) == expected


@pytest.mark.parametrize("line, words", [
    ("", "not a JSON object"),
    ("[1]", "a JSON object"),
    ('{"op":"grant"}', "op must be"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":-1,"mem_bytes":0}', "cpu_m"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":1.5,"mem_bytes":0}', "cpu_m"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":true,"mem_bytes":0}', "cpu_m"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":1e400,"mem_bytes":0}', "cpu_m"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":%d,"mem_bytes":0}' % (1 << 41), "cpu_m"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":1}', "missing field(s) mem_bytes"),
    ('{"op":"reserve","node":"","key":"k","cpu_m":1,"mem_bytes":1}', "node must be"),
    ('{"op":"reserve","node":"n1;rm","key":"k","cpu_m":1,"mem_bytes":1}', "node must be"),
    ('{"op":"reserve","node":"n\u00e9","key":"k","cpu_m":1,"mem_bytes":1}', "node must be"),
    ('{"op":"reserve","node":"n\u0661","key":"k","cpu_m":1,"mem_bytes":1}', "node must be"),
    ('{"op":"reserve","node":"-n1","key":"k","cpu_m":1,"mem_bytes":1}', "node must be"),
    ('{"op":"release","node":"n1","key":"k","extra":1}', "unknown field(s) extra"),
    ('{"op":"release","node":"n1","key":"k","unbound_only":1}', "unbound_only must be"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":1,"mem_bytes":1,"unbound_only":true}',
     "unknown field(s) unbound_only"),
    ('{"op":"set","node":"n1","entries":[]}', "entries must be"),
    ('{"op":"set","node":"n1","entries":{"k":[1]}}', "must be [cpu_m, mem_bytes]"),
    ('{"op":"set","node":"n1","entries":{},"keep_younger_than":-1}', "keep_younger_than"),
    ("[" * 100000, "not a JSON object"),
])
def test_parse_request_rejects(line, words):
    with pytest.raises(RequestError) as e:
        ledger_policy.parse_request(line)
    assert words in str(e.value) and e.value.code == "badrequest"


def test_parser_fuzz_only_ever_raises_request_error():
    """Random bytes and mutated good requests: the parser answers with a
    Request or a RequestError, never anything else (inside slurmctld)."""
    rnd = random.Random(11)
    good = [b'{"op":"reserve","node":"n1","key":"k","cpu_m":2735,"mem_bytes":5}',
            b'{"op":"set","node":"n1","entries":{"a":[1,2]},"keep_younger_than":3}',
            b'{"op":"show","node":"n2"}', b'{"op":"release","node":"n1","key":"k"}']
    for i in range(20000):
        if i % 3 == 0:
            line = bytes(rnd.randrange(256) for _ in range(rnd.randrange(60)))
        else:
            line = bytearray(rnd.choice(good))
            for _ in range(rnd.randrange(1, 4)):
                pos = rnd.randrange(len(line))
                line[pos:pos + rnd.randrange(3)] = bytes(rnd.randrange(32, 127)
                                                        for _ in range(rnd.randrange(3)))
            line = bytes(line)
        try:
            assert isinstance(ledger_policy.parse_request(line), Request)
        except RequestError:
            pass


def e(cpu_m, mem_mb=0, since=0.0, bound=False, reserved_at=None):
    return Entry(cpu_m, mem_mb * MIB, since, bound, reserved_at)


@pytest.mark.parametrize("entries, req, facts, new, reply_ok", [
    # Fits next to jobs (3) and other pods: 3 + 2 + 3 = 8.
    ({"a": e(2000)}, Request("reserve", "n1", "b", 2100, 0), NODE,
     {"a": e(2000), "b": e(2100, 0, 100.0, reserved_at=100.0)}, True),
    # One millicore too many: 2000m + 3001m = 6 CPUs, 3 + 6 > 8.
    ({"a": e(2000)}, Request("reserve", "n1", "b", 3001, 0), NODE, None, False),
    # Memory decides too: 4000 + 12001 > 16000.
    ({}, Request("reserve", "n1", "b", 0, 12001 * MIB), NODE, None, False),
    # Idempotent: the same key and amount again holds the same, and is ok;
    # it only renews when it was last reserved (a `set` may not shrink it
    # for a while), even on a node pods oversubscribe.
    ({"a": e(2000)}, Request("reserve", "n1", "a", 2000, 0), NODE,
     {"a": e(2000, reserved_at=100.0)}, True),
    ({"a": e(2000, reserved_at=100.0)}, Request("reserve", "n1", "a", 2000, 0), NODE, None, True),
    ({"a": e(9000, bound=True)}, Request("reserve", "n1", "a", 9000, 0), NODE,
     {"a": e(9000, bound=True, reserved_at=100.0)}, True),
    # A reserve never shrinks a reservation (a forged review naming a bound
    # pod's UID with no requests): ok, the amounts stay; only `set` shrinks.
    ({"a": e(9000)}, Request("reserve", "n1", "a", 1000, 0), NODE,
     {"a": e(9000, reserved_at=100.0)}, True),
    ({"a": e(6000, 100)}, Request("reserve", "n1", "a", 0, 0), NODE,
     {"a": e(6000, 100, reserved_at=100.0)}, True),
    # It grows what is asked for more and keeps the rest: max of each.
    ({"a": e(2000, 100, bound=True)}, Request("reserve", "n1", "a", 1000, 200 * MIB), NODE,
     {"a": e(2000, 200, bound=True, reserved_at=100.0)}, True),
    # Unknown node: refused, nothing changes.
    ({}, Request("reserve", "n9", "a", 1, 1), None, None, False),
    # Release of what is not held is fine (the API server retries).
    ({}, Request("release", "n1", "a"), NODE, None, True),
    ({"a": e(1), "b": e(2)}, Request("release", "n1", "a"), NODE, {"b": e(2)}, True),
    # unbound_only: a reservation no `set` listed yet goes; a pod seen bound keeps its share.
    ({"a": e(1), "b": e(2)}, Request("release", "n1", "a", unbound_only=True), NODE,
     {"b": e(2)}, True),
    ({"a": e(1, bound=True)}, Request("release", "n1", "a", unbound_only=True), NODE, None, True),
    ({}, Request("release", "n1", "a", unbound_only=True), NODE, None, True),
    ({}, Request("release", "n9", "a", unbound_only=True), None, None, True),
])
def test_decide(entries, req, facts, new, reply_ok):
    got, reply = ledger_policy.decide(entries, req, facts, now=100.0)
    assert got == new and reply["ok"] is reply_ok
    if not reply_ok and facts is not None:
        assert reply["code"] == "nofit" and "n1" in reply["error"] and "Slurm jobs hold 3" in reply["error"]


def test_release_unbound_only_says_what_it_kept():
    _, reply = ledger_policy.decide({"a": e(1, bound=True)},
                                    Request("release", "n1", "a", unbound_only=True),
                                    NODE, now=1.0)
    assert reply == {"ok": True, "kept": True}


def test_journal_replays_release_unbound_only(tmp_path):
    """Replay decides as the server did: the entry a `set` had listed stays."""
    facts = {"n1": NODE}
    a = Ledger(str(tmp_path))
    a.load()
    _serve(a, facts,
           ledger_policy.encode("reserve", node="n1", key="phantom", cpu_m=2000, mem_bytes=0))
    _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="pod", cpu_m=1000, mem_bytes=0))
    _serve(a, facts, ledger_policy.encode("set", node="n1", entries={"pod": [1000, 0]},
                                          keep_younger_than=30))
    _serve(a, facts, ledger_policy.encode("release", node="n1", key="phantom", unbound_only=True))
    _serve(a, facts, ledger_policy.encode("release", node="n1", key="pod", unbound_only=True))
    assert set(a.nodes["n1"]) == {"pod"}
    b = Ledger(str(tmp_path))
    b.load()
    assert set(b.nodes["n1"]) == {"pod"} and b.shares() == {"n1": (1, 0)}


def test_set_keeps_only_young_reservations_never_seen_bound():
    entries = {"bound-gone": e(1000, since=99.0, bound=True),   # was bound, now deleted
               "young": e(1000, since=90.0),                  # admitted 10 s ago
               "stale": e(1000, since=10.0),                  # admitted, never bound
               "kept": e(1000, since=0.0, bound=True)}
    req = Request("set", "n1", entries=(("kept", 1000, 0), ("new", 500, 0)), keep_younger_than=30)
    new, reply = ledger_policy.decide(entries, req, NODE, now=100.0)
    assert set(new) == {"kept", "new", "young"} and new["new"].bound and new["kept"].since == 0.0
    assert reply == {"ok": True, "dropped": ["bound-gone", "stale"],
                     "share": {"cpu": 3, "mem": 0}}


# A `set` from a view of the pods older than a reserve made since (the sync
# daemon's pass racing an admitted resize) may not shrink what that reserve
# holds for keep_younger_than (30 s here); now = 100.
@pytest.mark.parametrize("case, old, listed, held", [
    ("resize admitted 5 s ago, set from the view before it: held",
     e(4000, 400, bound=True, reserved_at=95.0), (1000, 100 * MIB), (4000, 400 * MIB)),
    ("each size by itself: the larger of each",
     e(4000, 100, bound=True, reserved_at=95.0), (1000, 400 * MIB), (4000, 400 * MIB)),
    ("a set asking for more grows it as before",
     e(4000, 400, bound=True, reserved_at=95.0), (6000, 500 * MIB), (6000, 500 * MIB)),
    ("reserved 31 s ago: the set shrinks it",
     e(4000, 400, bound=True, reserved_at=69.0), (1000, 100 * MIB), (1000, 100 * MIB)),
    ("reserved exactly 30 s ago: no longer held",
     e(4000, 400, bound=True, reserved_at=70.0), (1000, 100 * MIB), (1000, 100 * MIB)),
    ("never reserved (a set made it, or an older journal): the set decides",
     e(4000, 400, bound=True), (1000, 100 * MIB), (1000, 100 * MIB)),
    ("a reservation not seen bound yet, shrunk by its first set: held",
     e(4000, 400, since=95.0, reserved_at=95.0), (1000, 100 * MIB), (4000, 400 * MIB)),
])
def test_a_stale_set_never_shrinks_a_recent_reserve(case, old, listed, held):
    req = Request("set", "n1", entries=(("p", *listed),), keep_younger_than=30)
    new, reply = ledger_policy.decide({"p": old}, req, NODE, now=100.0)
    got = (new or {"p": old})["p"]
    assert (got.cpu_m, got.mem_bytes, got.bound) == (*held, True), case
    assert got.since == old.since and got.reserved_at == old.reserved_at, case
    assert reply["ok"] and reply["share"] == {"cpu": -(-held[0] // 1000),
                                              "mem": -(-held[1] // MIB)}, case


@pytest.mark.parametrize("case, old, kept", [
    ("bound, reserved 5 s ago, not listed: its pod object is gone, so is its share",
     e(4000, bound=True, reserved_at=95.0), False),
    ("never seen bound, admitted 40 s ago, resized 5 s ago: the grace runs from the resize",
     e(4000, since=60.0, reserved_at=95.0), True),
    ("never seen bound, last reserved 31 s ago", e(4000, since=60.0, reserved_at=69.0), False),
    ("never seen bound, from an older journal (no reserve time): by its age",
     e(4000, since=80.0), True),
])
def test_set_drops_what_it_does_not_list(case, old, kept):
    req = Request("set", "n1", entries=(), keep_younger_than=30)
    new, reply = ledger_policy.decide({"p": old}, req, NODE, now=100.0)
    assert ("p" in (new if new is not None else {"p": old})) is kept, case
    assert reply["dropped"] == ([] if kept else ["p"]), case


def test_the_sync_daemons_next_set_shrinks_it_once_the_hold_is_over():
    """The race end to end: bound at 1 CPU, a resize to 4 admitted, the
    daemon's set from its older view (1 CPU) arrives: 4 stay held; its sets
    shrink the entry only once the hold is over (it would have seen the
    resize long before; a pod really shrunk by then is shrunk then)."""
    held = {"p": e(1000, bound=True)}
    held, _ = ledger_policy.decide(held, Request("reserve", "n1", "p", 4000, 0), NODE, now=10.0)
    stale = Request("set", "n1", entries=(("p", 1000, 0),), keep_younger_than=30)
    new, reply = ledger_policy.decide(held, stale, NODE, now=10.5)
    assert new is None and reply["share"]["cpu"] == 4     # unchanged: nothing journaled
    assert ledger_policy.repair_needed({"share": reply["share"], "reserved": 0}, {"p": (1000, 0)})
    new, reply = ledger_policy.decide(held, stale, NODE, now=40.0)
    assert new["p"].cpu_m == 1000 and reply["share"]["cpu"] == 1


def test_set_reports_more_than_jobs_leave():
    req = Request("set", "n1", entries=(("a", 6000, 0),))
    new, reply = ledger_policy.decide({}, req, NODE, now=1.0)
    assert reply["oversubscribed"] and ledger_policy.share_units(new) == (6, 0)
    # allocated <= total
    assert ledger_policy.applied(ledger_policy.share_units(new), NODE) == (5, 0)
    view = ledger_policy.node_view(new, NODE, with_entries=False)
    assert view["oversubscribed"] and view["free"] == {"cpu": 0, "mem": 12000}


def test_share_rounds_the_sum_up_once():
    assert ledger_policy.share_units({"a": e(500), "b": e(500)}) == (1, 0)
    assert ledger_policy.share_units({"a": e(1735, 2393), "b": e(1000, 1024)}) == (3, 3417)
    assert ledger_policy.share_units({"a": Entry(0, 1, 0.0)}) == (0, 1)


# ----------------------------------------------------------------- journal

def _serve(ledger, facts, line, uid=0):
    ticket, reply = ledger.prepare(uid, line if isinstance(line, bytes) else line.encode())
    shares = {}
    if ticket:
        reply = ledger.apply(ticket, lambda n: facts.get(n),
                             lambda n, c, m, g=(): shares.__setitem__(n, (c, m, *([g] if g else []))))
    return reply, shares


def _held(ledger):
    """What each key holds and whether it was seen bound (`since` is the
    owning process's own clock: a new process rebases it)."""
    return {n: {k: (e.cpu_m, e.mem_bytes, e.bound) for k, e in entries.items()}
            for n, entries in ledger.nodes.items()}


def test_journal_replays_grants_not_denials(tmp_path):
    facts = {"n1": NODE}
    a = Ledger(str(tmp_path))
    a.load()
    assert _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="p", cpu_m=2000,
                                                 mem_bytes=0))[1] == {"n1": (2, 0)}
    assert not _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="q", cpu_m=9000,
                                                     mem_bytes=0))[0]["ok"]
    # A resize denied must restore the old amount on replay.
    assert not _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="p", cpu_m=7000,
                                                     mem_bytes=0))[0]["ok"]
    _serve(a, {**facts, "n2": NODE},
           ledger_policy.encode("set", node="n2", entries={"x": [1500, 0]}))
    b = Ledger(str(tmp_path))       # slurmctld restarts
    b.load()
    assert b.shares() == {"n1": (2, 0), "n2": (2, 0)}
    assert b.nodes["n1"]["p"].cpu_m == 2000


def test_journal_torn_last_line_is_ignored_but_corruption_is_an_error(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    _serve(a, {"n1": NODE},
           ledger_policy.encode("reserve", node="n1", key="p", cpu_m=1000, mem_bytes=0))
    with open(a.path, "ab") as f:
        f.write(b'{"t":1,"op":"reserve","node":"n1","ke')      # crash mid-write
    b = Ledger(str(tmp_path))
    b.load()
    assert b.shares() == {"n1": (1, 0)}
    with open(b.path, "ab") as f:
        f.write(b'{"t":1,"op":"bogus"}\n{"t":2,"op":"show"}\n')
    with pytest.raises(ValueError, match="bad ledger line"):
        Ledger(str(tmp_path)).load()


def test_journal_is_private_and_compacts(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_journal, "COMPACT_AFTER", 50)
    a = Ledger(str(tmp_path))
    a.load()
    for i in range(200):
        _serve(a, {"n1": NODE}, ledger_policy.encode("set", node="n1", entries={f"p{i}": [100, 0]}))
    assert os.stat(a.path).st_mode & 0o077 == 0
    with open(a.path) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 51 and json.loads(lines[0])["op"] == "snapshot"
    b = Ledger(str(tmp_path))
    b.load()
    assert _held(b) == _held(a) and set(b.nodes["n1"]) == {"p199"}


def test_only_the_owner_replaces_the_journal(tmp_path):
    """A reader (a standby backup; a process waiting for the journal's lock)
    replays without touching the file; a failed load changes nothing."""
    owner = Ledger(str(tmp_path))
    owner.load()
    _serve(owner, {"n1": NODE},
           ledger_policy.encode("reserve", node="n1", key="p", cpu_m=1000, mem_bytes=0))
    before = os.stat(owner.path)
    reader = Ledger(str(tmp_path))
    reader.load(compact=False)
    after = os.stat(owner.path)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert reader.shares() == {"n1": (1, 0)}
    # The owner keeps appending to the very file the reader read.
    _serve(owner, {"n1": NODE},
           ledger_policy.encode("reserve", node="n1", key="q", cpu_m=1000, mem_bytes=0))
    reader.load(compact=False)
    assert reader.shares() == {"n1": (2, 0)}
    with open(owner.path, "ab") as f:
        f.write(b'{"t":1,"op":"bogus"}\n{"t":2,"op":"show"}\n')
    with pytest.raises(ValueError, match="bad ledger line"):
        reader.load(compact=False)
    assert reader.shares() == {"n1": (2, 0)}


def test_a_request_that_changes_nothing_is_not_journaled(tmp_path):
    """No fsync for the sync daemon's `set` of an unchanged node every
    second or a release of what is not held; the replay is the same without
    them.  A repeated reserve is written: it renews the entry's hold against
    a shrinking `set`, which must outlive a restart."""
    clock = iter(range(100, 1000)).__next__
    a = Ledger(str(tmp_path), clock=clock)
    a.load()
    facts = {"n1": NODE}
    entries = {"p": [1000, 1 << 20], "q": [500, 0]}
    assert _serve(a, facts, ledger_policy.encode("set", node="n1", entries=entries,
                                                 keep_younger_than=30))[0]["ok"]
    assert _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="r", cpu_m=250,
                                                 mem_bytes=0))[0]["ok"]
    bound = ledger_policy.encode("set", node="n1", entries={**entries, "r": [250, 0]},
                                 keep_younger_than=30)
    assert _serve(a, facts, bound)[0]["ok"]                 # r is seen bound: a change
    size = os.path.getsize(a.path)
    for line in (bound,
                 ledger_policy.encode("release", node="n1", key="absent"),
                 ledger_policy.encode("release", node="n9", key="absent"),
                 ledger_policy.encode("show")):
        assert _serve(a, facts, line)[0]["ok"], line
    assert os.path.getsize(a.path) == size
    assert _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="r", cpu_m=250,
                                                 mem_bytes=0))[0]["ok"]
    assert os.path.getsize(a.path) > size
    size = os.path.getsize(a.path)
    # A change is journaled as before.
    assert _serve(a, facts, ledger_policy.encode("set", node="n1", entries=entries))[0]["ok"]
    assert os.path.getsize(a.path) > size
    b = Ledger(str(tmp_path))
    b.load()
    assert _held(b) == _held(a)


def test_a_refused_set_is_undone_on_replay(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    _serve(a, {"n1": NODE},
           ledger_policy.encode("reserve", node="n1", key="p", cpu_m=1000, mem_bytes=0))
    # n1 left slurmctld (unknown now): the set is refused, and must not come
    # back from the journal after a restart.
    reply = _serve(a, {}, ledger_policy.encode("set", node="n1", entries={"x": [3000, 0]}))[0]
    assert reply["code"] == "unknown_node"
    b = Ledger(str(tmp_path))
    b.load()
    assert b.shares() == {"n1": (1, 0)} and set(b.nodes["n1"]) == {"p"}


def test_show_is_read_only(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    show, _ = a.prepare(0, ledger_policy.encode("show").strip())
    reserve, _ = a.prepare(0, ledger_policy.encode("reserve", node="n1", key="k", cpu_m=1,
                                                   mem_bytes=1))
    assert a.read_only(show) and not a.read_only(reserve)


def test_uid_is_checked_before_the_line_is_parsed(tmp_path):
    a = Ledger(str(tmp_path), allowed_uids={0})
    a.load()
    assert _serve(a, {}, b"not json at all", uid=7)[0]["code"] == "denied"


def test_only_root_slurmuser_and_listed_uids(tmp_path):
    a = Ledger(str(tmp_path), allowed_uids={0, 64030, 1001})
    a.load()
    line = ledger_policy.encode("show").strip()
    assert _serve(a, {}, line, uid=64030)[0]["ok"]
    assert _serve(a, {}, line, uid=1001)[0]["ok"]
    denied = _serve(a, {}, line, uid=1002)[0]
    assert denied["code"] == "denied" and "LedgerUsers" in denied["error"]
    # A denied caller writes nothing.
    size = os.path.getsize(a.path)
    _serve(a, {"n1": NODE},
           ledger_policy.encode("reserve", node="n1", key="k", cpu_m=1, mem_bytes=1), uid=7)
    assert os.path.getsize(a.path) == size


# ----------------------------------------------------------------- pyk8sres status

def test_status_rows_compare_the_ledger_with_the_bound_pods():
    node = {"capacity": {"cpu": 8, "mem": 16000}, "jobs": {"cpu": 3, "mem": 4000},
            "share": {"cpu": 3, "mem": 3417}, "free": {"cpu": 2, "mem": 8583},
            "oversubscribed": False}
    table = status.rows({"n1": node, "n2": dict(node, share={"cpu": 0, "mem": 0}),
                         "n3": dict(node, share={"cpu": 1, "mem": 0})},
                        {"n1": (3, 3417), "n2": (1, 0)})
    assert [r["agree"] for r in table] == ["yes", "LEDGER HOLDS LESS", "ledger holds more"]
    down = status.rows({"n1": node}, None)
    assert down[0]["agree"] is None and "API server down" in status.render(down, "refused")


def test_status_counts_pods_as_the_ledger_does():
    def pod(name, node, cpu, ns="default"):
        return {"metadata": {"name": name, "namespace": ns, "uid": name},
                "spec": {"nodeName": node, "containers": [
                    {"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "1Mi"}}}]}}
    pods = [pod("a", "n1", "500m"), pod("b", "n1", "500m"), pod("c", "n1", "1"),
            pod("slurm-share-n1", "n1", "7", ns="pyk8sres-placeholders"), pod("x", "kx", "3")]
    nodes = [{"metadata": {"name": "n1"}}, {"metadata": {"name": "kx"}}]
    assert status.pods_share(pods, nodes, {"n1"}, SyncConfig()) == {"n1": (2, 3)}


# ----------------------------------------------------------------- clocks

class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def _keys(ledger, node="n1"):
    return sorted(ledger.nodes.get(node, {}))


def test_a_wall_clock_step_ends_no_grace_period(tmp_path, monkeypatch):
    """The grace period runs on the monotonic clock: the wall clock jumping
    an hour ahead (NTP, an admin) drops no reservation not yet seen bound."""
    a = Ledger(str(tmp_path))
    assert a.clock is time.monotonic
    a.load()
    facts = {"n1": NODE}
    assert _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="admitted", cpu_m=1000,
                                                 mem_bytes=0))[0]["ok"]
    wall = time.time()
    monkeypatch.setattr(ledger_journal.time, "time", lambda: wall + 3600)
    assert _serve(a, facts, ledger_policy.encode("set", node="n1", entries={"other": [500, 0]},
                                                 keep_younger_than=30))[0]["ok"]
    assert _keys(a) == ["admitted", "other"]


@pytest.mark.parametrize("case,writer_clock,reader_clock", [
    ("monotonic clock reset (reboot, backup host booted later)", 1_000_000.0, 5.0),
    ("monotonic clock ahead (backup host up for longer)", 5.0, 1_000_000.0),
    ("same host, restarted", 100.0, 160.0),
])
def test_a_new_process_rebases_grace_periods_to_its_own_clock(tmp_path, case,
                                                             writer_clock, reader_clock):
    """Across a restart or a takeover the journal's times are another
    clock's: every entry counts from the load.  A reservation not seen
    bound gets a fresh grace period (never dropped early), a bound pod's is
    held as long as it is listed, and the replay of what the new process
    writes agrees with what it decided."""
    facts = {"n1": NODE}
    clock = Clock(writer_clock)
    a = Ledger(str(tmp_path), clock=clock)
    a.load()
    _serve(a, facts, ledger_policy.encode("set", node="n1", entries={"bound": [1000, 0]}))
    _serve(a, facts,
           ledger_policy.encode("reserve", node="n1", key="admitted", cpu_m=1000, mem_bytes=0))
    clock.now += 20                                  # 20 s of its 30 s grace used
    clock = Clock(reader_clock)
    b = Ledger(str(tmp_path), clock=clock)
    b.load()                                         # slurmctld restarts / a backup takes over
    assert {k: e.since for k, e in b.nodes["n1"].items()} == {"bound": reader_clock,
                                                              "admitted": reader_clock}, case
    keep = ledger_policy.encode("set", node="n1", entries={"bound": [1000, 0]},
                                keep_younger_than=30)
    clock.now += 29
    assert _serve(b, facts, keep)[0]["dropped"] == [], case
    assert _keys(b) == ["admitted", "bound"], case
    clock.now += 2                                   # 31 s after the load: its grace is over
    assert _serve(b, facts, keep)[0]["dropped"] == ["admitted"], case
    c = Ledger(str(tmp_path), clock=Clock(reader_clock + 100))
    c.load(compact=False)
    assert _held(c) == _held(b) == {"n1": {"bound": (1000, 0, True)}}, case


def test_replay_across_owners_agrees_with_what_each_decided(tmp_path):
    """Journal lines of two owners with unrelated clocks replay as each
    decided: the second owner's snapshot is in its own clock."""
    facts = {"n1": NODE}
    a = Ledger(str(tmp_path), clock=Clock(10.0))
    a.load()
    _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="p", cpu_m=1000, mem_bytes=0))
    clock = Clock(5_000.0)
    b = Ledger(str(tmp_path), clock=clock)
    b.load()
    clock.now += 10
    _serve(b, facts, ledger_policy.encode("reserve", node="n1", key="q", cpu_m=1000, mem_bytes=0))
    clock.now += 25      # p: 35 s since b took over (dropped), q: 25 s (kept)
    assert _serve(b, facts, ledger_policy.encode("set", node="n1", entries={},
                                                 keep_younger_than=30))[0]["dropped"] == ["p"]
    replayed = Ledger(str(tmp_path), clock=Clock(1.0))
    replayed.load(compact=False)
    assert _held(replayed) == _held(b) == {"n1": {"q": (1000, 0, False)}}


@pytest.mark.parametrize("compact", [True, False])
def test_a_reserves_hold_outlives_a_restart_with_its_age(tmp_path, compact):
    """The hold a reserve puts on an entry's size is journaled: a new
    process (another clock) keeps it for what was left of it when the last
    journal line was written, then a `set` may shrink the entry."""
    facts = {"n1": NODE, "n2": NODE}
    clock = Clock(1_000.0)
    a = Ledger(str(tmp_path), clock=clock)
    a.load()
    _serve(a, facts, ledger_policy.encode("set", node="n1", entries={"p": [1000, 0]}))
    _serve(a, facts, ledger_policy.encode("reserve", node="n1", key="p", cpu_m=4000, mem_bytes=0))
    clock.now += 10
    # the last line
    _serve(a, facts, ledger_policy.encode("set", node="n2", entries={"x": [500, 0]}))
    if compact:
        a._compact()
    clock = Clock(7.0)
    b = Ledger(str(tmp_path), clock=clock)
    b.load()
    assert b.nodes["n1"]["p"].reserved_at == 7.0 - 10
    stale = ledger_policy.encode("set", node="n1", entries={"p": [1000, 0]}, keep_younger_than=30)
    clock.now += 19
    assert _serve(b, facts, stale)[0]["share"]["cpu"] == 4
    clock.now += 2                                   # 31 s after the reserve
    assert _serve(b, facts, stale)[0]["share"]["cpu"] == 1
    c = Ledger(str(tmp_path), clock=Clock(1.0))
    c.load(compact=False)
    assert _held(c) == _held(b)


def test_a_journal_from_before_reserve_times_is_read(tmp_path):
    """Snapshot entries of three or four fields (older releases): no reserve
    time, the `set` decides their size as before; reserve lines replay with
    theirs."""
    with open(tmp_path / "k8s_resources.ledger", "w") as f:
        f.write(json.dumps({"t": 50.0, "op": "snapshot", "nodes": {
            "n1": {"old": [4000, 0, 10.0, True], "older": [1000, 0, 10.0]}}}) + "\n")
        f.write(json.dumps({"t": 60.0, "op": "reserve", "node": "n1", "key": "r",
                            "cpu_m": 2000, "mem_bytes": 0}) + "\n")
    clock = Clock(500.0)
    a = Ledger(str(tmp_path), clock=clock)
    a.load()
    held = a.nodes["n1"]
    assert (held["old"].bound, held["old"].reserved_at) == (True, None)
    assert (held["older"].bound, held["older"].reserved_at) == (False, None)
    assert held["r"].reserved_at == 500.0
    reply = _serve(a, {"n1": NODE},
                   ledger_policy.encode("set", node="n1", keep_younger_than=30, entries={
                       "old": [1000, 0], "r": [1000, 0]}))[0]
    assert reply["dropped"] == [] and reply["share"]["cpu"] == 1 + 2 + 1   # old shrunk, r held
    with open(a.path) as f:                           # written back in the new form
        assert all(len(v) == 5 for v in json.loads(f.readline())["nodes"]["n1"].values())


@pytest.mark.parametrize("node", ["gpu_01", "rack_1-n_2", "_x", "n1.example.com"])
def test_slurm_node_names_with_underscores(tmp_path, node):
    """Slurm allows "_" in NodeName (a node_map or the mapping label points
    at one); the ledger serves such a node like any other."""
    assert ledger_policy.parse_request(ledger_policy.encode("reserve", node=node, key="k", cpu_m=1,
                                                            mem_bytes=1)).node == node
    a = Ledger(str(tmp_path))
    a.load()
    reply, shares = _serve(a, {node: NODE},
                           ledger_policy.encode("set", node=node, entries={"p": [1500, 0]}))
    assert reply["ok"] and shares == {node: (2, 0)}
    b = Ledger(str(tmp_path))
    b.load()
    assert b.shares() == {node: (2, 0)}


@pytest.mark.parametrize("view,entries,needed", [
    (None, {}, True),                                                  # no show yet
    ({"unknown": True, "share": {"cpu": 0, "mem": 0}, "reserved": 0}, {}, True),
    ({"share": {"cpu": 0, "mem": 0}}, {}, True),                       # server without "reserved"
    ({"share": {"cpu": 0, "mem": 0}, "reserved": 0}, {}, False),
    ({"share": {"cpu": 2, "mem": 1}, "reserved": 0}, {"a": (1500, 1)}, False),
    ({"share": {"cpu": 2, "mem": 1}, "reserved": 1}, {"a": (1500, 1)}, True),   # may expire
    ({"share": {"cpu": 1, "mem": 1}, "reserved": 0}, {"a": (1500, 1)}, True),   # released by hand
    ({"share": {"cpu": 2, "mem": 2}, "reserved": 0}, {"a": (1500, 1)}, True),
])
def test_repair_needed(view, entries, needed):
    assert ledger_policy.repair_needed(view, entries) is needed


def test_node_view_counts_reservations_not_seen_bound():
    entries = {"r": ledger_policy.Entry(500, 0, 1.0, False),
               "b": ledger_policy.Entry(500, 0, 1.0, True)}
    assert ledger_policy.node_view(entries, NODE, with_entries=False)["reserved"] == 1
