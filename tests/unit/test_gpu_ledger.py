"""The ledger's GPU indices (pyk8sres.policy.ledger, the journal in
pyk8sres.slurmctld.ledger, the client): table-driven.  The slurmctld side,
gpu GRES bitmaps and pending jobs: tests/integration/test_ledger_gpus.py."""
import json

import pytest

from pyk8sres.coordinator import slurm
from pyk8sres.policy import ledger as policy
from pyk8sres.policy.ledger import Entry, Facts, Request, RequestError
from pyk8sres.slurmctld import ledger as journal
from pyk8sres.slurmctld.ledger import Ledger

# 4 GPUs, a Slurm job holds index 3.
NODE = Facts(8, 16000, 0, 0, gpu_count=4, gpu_jobs=frozenset({3}))


@pytest.mark.parametrize("line, expected", [
    ('{"op":"reserve","node":"n1","key":"claim:u","cpu_m":0,"mem_bytes":0,"gpus":[1,0]}',
     Request("reserve", "n1", "claim:u", 0, 0, gpus=(0, 1))),
    ('{"op":"reserve","node":"n1","key":"u","cpu_m":5,"mem_bytes":0,"gpus":[]}',
     Request("reserve", "n1", "u", 5, 0)),
    ('{"op":"set","node":"n1","entries":{"b":[1,2,[2]],"a":[3,4],"c":[0,0,[]]}}',
     Request("set", "n1", entries=(("a", 3, 4), ("b", 1, 2, (2,)), ("c", 0, 0)))),
])
def test_parse_gpus(line, expected):
    assert policy.parse_request(line) == expected


@pytest.mark.parametrize("line, words", [
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":[0,0]}', "distinct"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":[-1]}', "gpus"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":[true]}', "gpus"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":[1.0]}', "gpus"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":"0"}', "gpus"),
    ('{"op":"reserve","node":"n1","key":"k","cpu_m":0,"mem_bytes":0,"gpus":[1024]}', "0 to 1023"),
    ('{"op":"set","node":"n1","entries":{"k":[1,2,[0],4]}}', "[cpu_m, mem_bytes, [gpu, ...]]"),
    ('{"op":"set","node":"n1","entries":{"k":[1,2,0]}}', "gpus"),
    ('{"op":"release","node":"n1","key":"k","gpus":[0]}', "unknown field(s) gpus"),
])
def test_parse_gpus_rejects(line, words):
    with pytest.raises(RequestError) as e:
        policy.parse_request(line)
    assert words in str(e.value) and e.value.code == "badrequest"


def held(**keys):
    return {k: Entry(0, 0, 1.0, True, None, tuple(g)) for k, g in keys.items()}


@pytest.mark.parametrize("entries, facts, gpus, cpu_m, words", [
    ({}, NODE, (0, 1), 0, None),
    ({}, NODE, (2,), 8000, None),
    ({}, NODE, (3,), 0, "Slurm jobs hold GPU index(es) [3]"),
    ({}, NODE, (1, 3), 0, "Slurm jobs hold GPU index(es) [3]"),
    (held(other=(1,)), NODE, (0, 1), 0, "GPU index(es) [1] are held by other"),
    ({}, NODE, (4,), 0, "it has 4 GPUs (indices 0-3), not [4]"),
    ({}, Facts(8, 16000, 0, 0), (0,), 0, "it has no gpu GRES"),
    ({}, NODE._replace(gpu_problem="no device files"), (0,), 0, "no device files"),
    # all or nothing: GPUs free, CPUs not
    ({}, NODE, (0,), 9000, "has no room"),
    # growing: only the new indices are checked (the entry holds 1 already)
    (held(k=(1,)), NODE, (1, 2), 0, None),
    (held(k=(1,)), NODE, (1, 3), 0, "Slurm jobs hold"),
])
def test_reserve_gpus(entries, facts, gpus, cpu_m, words):
    req = Request("reserve", "n1", "k", cpu_m, 0, gpus=gpus)
    new, reply = policy.decide(entries, req, facts, now=5.0)
    if words is None:
        assert reply == {"ok": True}
        assert set(new["k"].gpus) == set(gpus) | set(entries.get("k", Entry(0, 0, 0)).gpus)
        assert new["k"].gpus == tuple(sorted(new["k"].gpus))
    else:
        assert new is None and reply["code"] == "nofit" and words in reply["error"]


def test_reserve_gpus_only_grows_and_renews():
    entries = held(k=(0, 1))
    new, reply = policy.decide(entries, Request("reserve", "n1", "k", gpus=(1,)), NODE, 5.0)
    assert reply == {"ok": True} and new["k"].gpus == (0, 1) and new["k"].reserved_at == 5.0
    # even one a job holds now: the entry has it already (nothing new asked)
    facts = NODE._replace(gpu_jobs=frozenset({0}))
    new, reply = policy.decide(new, Request("reserve", "n1", "k", gpus=(0,)), facts, 5.0)
    assert reply == {"ok": True} and new is None


@pytest.mark.parametrize("old, listed, age, expected", [
    ((0, 1), (0,), 100, (0,)),          # seen bound long after the reserve: the set wins
    ((0, 1), (0,), 5, (0, 1)),          # reserved 5 s ago: the set may predate it
    ((0,), (2,), 5, (0, 2)),
    ((0, 1), (), 100, ()),
])
def test_set_keeps_recent_gpus(old, listed, age, expected):
    entries = {"k": Entry(0, 0, 0.0, False, 100.0 - age, old)}
    req = Request("set", "n1", entries=(("k", 0, 0, *([listed] if listed else [])),),
                  keep_younger_than=30)
    new, reply = policy.decide(entries, req, NODE, now=100.0)
    got = (new or entries)["k"].gpus
    assert got == expected and reply["ok"]


@pytest.mark.parametrize("listed, over", [
    ({"a": (0,), "b": (1,)}, False),
    ({"a": (0,), "b": (0,)}, True),       # two pods on one index
    ({"a": (3,)}, True),                  # a job holds it
    ({"a": (7,)}, True),                  # the node has 4
])
def test_set_reports_overbooked_gpus(listed, over):
    req = Request("set", "n1", entries=tuple((k, 0, 0, g) for k, g in sorted(listed.items())))
    new, reply = policy.decide({}, req, NODE, now=1.0)
    assert bool(reply.get("oversubscribed")) is over
    assert policy.node_view(new, NODE, with_entries=False)["oversubscribed"] is over


def test_node_view_gpus():
    entries = {**held(a=(0,), b=(2, 1)), "c": Entry(500, 0, 1.0)}
    view = policy.node_view(entries, NODE, with_entries=True)
    assert view["gpus"] == {"count": 4, "jobs": [3], "share": [0, 1, 2]}
    assert view["entries"] == {"a": [0, 0, [0]], "b": [0, 0, [2, 1]], "c": [500, 0]}
    assert "gpus" not in policy.node_view({"c": Entry(500, 0, 1.0)}, Facts(8, 16000, 0, 0),
                                          with_entries=False)
    problem = policy.node_view({}, NODE._replace(gpu_problem="no files"), with_entries=False)
    assert problem["gpus"]["problem"] == "no files"
    assert policy.node_view(held(a=(1,)), None, with_entries=False)["gpus"]["share"] == [1]


@pytest.mark.parametrize("view, entries, needed", [
    ({"reserved": 0, "share": {"cpu": 0, "mem": 0}, "gpus": {"share": [0]}},
     {"a": (0, 0, (0,))}, False),
    ({"reserved": 0, "share": {"cpu": 0, "mem": 0}, "gpus": {"share": [0, 1]}},
     {"a": (0, 0, (0,))}, True),
    ({"reserved": 0, "share": {"cpu": 0, "mem": 0}}, {"a": (0, 0, (0,))}, True),
    ({"reserved": 0, "share": {"cpu": 0, "mem": 0}}, {"a": (0, 0)}, False),
])
def test_repair_needed_compares_gpus(view, entries, needed):
    assert policy.repair_needed(view, entries) is needed


def test_words_and_masks():
    words = [8, 16000, 1, 2, 130, 0] + journal.gpu_mask([0, 64, 129])
    facts = journal.facts_from_words(words)
    assert facts == Facts(8, 16000, 1, 2, 130, frozenset({0, 64, 129}), "")
    assert len(words) == journal.FACTS_WORDS
    assert journal.facts_from_words([8, 1, 0, 0, 2, 1] + [0] * 16).gpu_problem.startswith(
        "its gpu GRES has no device bitmap (no File=")
    assert journal.gpu_mask([]) == [0] * journal.GPU_WORDS


# ----------------------------------------------------------------- journal

def _serve(ledger, facts, **fields):
    op = fields.pop("op")
    ticket, reply = ledger.prepare(0, policy.encode(op, **fields))
    shares = {}
    if ticket:
        reply = ledger.apply(ticket, facts.get,
                             lambda n, c, m, g: shares.__setitem__(n, (c, m, g)))
    return reply, shares


def test_journal_keeps_gpus_across_restart_and_undo(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    facts = {"n1": NODE}
    reply, shares = _serve(a, facts, op="reserve", node="n1", key="claim:x", cpu_m=0,
                           mem_bytes=0, gpus=[1, 0])
    assert reply["ok"] and shares == {"n1": (0, 0, (0, 1))}
    reply, shares = _serve(a, facts, op="reserve", node="n1", key="claim:y", cpu_m=0,
                           mem_bytes=0, gpus=[1, 2])          # 1 is x's: refused, undone
    assert reply["code"] == "nofit" and shares == {}
    reply, _ = _serve(a, facts, op="set", node="n1", keep_younger_than=30,
                      entries={"claim:x": [0, 0, [0, 1]], "pod": [1000, 0]})
    assert reply["ok"]
    b = Ledger(str(tmp_path))                  # a restart: replay
    b.load()
    assert b.gpus() == {"n1": (0, 1)} and b.nodes["n1"]["claim:x"].bound
    c = Ledger(str(tmp_path))                  # b compacted: the snapshot keeps them
    c.load()
    assert c.gpus() == {"n1": (0, 1)} and c.shares() == {"n1": (1, 0)}
    with open(c.path) as f:
        snap = json.loads(f.readline())["nodes"]["n1"]
    assert snap["claim:x"][5] == [0, 1] and len(snap["pod"]) == 5
    reply, shares = _serve(c, facts, op="release", node="n1", key="claim:x")
    assert reply["ok"] and shares == {"n1": (1, 0, ())}
    d = Ledger(str(tmp_path))
    d.load()
    assert d.gpus() == {}


def test_show_reports_gpus(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    _serve(a, {"n1": NODE}, op="reserve", node="n1", key="k", cpu_m=0, mem_bytes=0, gpus=[2])
    reply, _ = _serve(a, {"n1": NODE}, op="show", node="n1")
    assert reply["nodes"]["n1"]["gpus"] == {"count": 4, "jobs": [3], "share": [2]}
    assert slurm.show_gpus(reply["nodes"]["n1"]) == (4, {3}, {2})
    assert slurm.show_gpus({"share": {"cpu": 0, "mem": 0}}) == (0, set(), set())


def test_client_encodes_gpus():
    sent = []

    class Recording(slurm.Ledger):
        def __init__(self):
            pass

        def call(self, op, **fields):
            sent.append({"op": op, **fields})
            return {"ok": True}
    c = Recording()
    c.reserve("n1", "k", 0, 0, gpus=(2, 0))
    c.reserve("n1", "p", 1, 2)
    c.set("n1", {"a": (1, 2), "b": (0, 0, [1]), "c": (0, 0, ())}, 30)
    assert sent[0]["gpus"] == [0, 2] and "gpus" not in sent[1]
    assert sent[2]["entries"] == {"a": [1, 2], "b": [0, 0, [1]], "c": [0, 0]}
    for doc in sent:
        policy.parse_request(json.dumps(doc))
