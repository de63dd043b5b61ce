"""A node slurmctld newly registers is held whole until the coordinator's
first `set` there (HoldNewNodes=yes): the pure rule, and the journal."""
import pytest

from pyk8sres.policy import backstop
from pyk8sres.policy import ledger as ledger_policy
from pyk8sres.policy.ledger import MIB, REGISTERED_KEY, Entry, Facts
from pyk8sres.slurmctld import config
from pyk8sres.slurmctld.ledger import Ledger

KEY = REGISTERED_KEY
NODE = Facts(8, 16000, 0, 0)


def whole(cpus, mb, since=5.0):
    return Entry(cpus * 1000, mb * MIB, since, True)


@pytest.mark.parametrize("case,entries,known,capacity,new", [
    ("a node not met is held whole", {}, False, (8, 16000), {KEY: whole(8, 16000)}),
    ("a node met before is not", {}, True, (8, 16000), None),
    ("a node met before keeps its pods' entries", {"pod": Entry(1000, MIB, 0.0, True)}, True,
     (8, 16000), None),
    ("entries left under its name stay; the hold is the rest",
     {"slurm:fence": Entry(3000, 1000 * MIB, 0.0, True)}, False, (8, 16000),
     {"slurm:fence": Entry(3000, 1000 * MIB, 0.0, True), KEY: whole(5, 15000)}),
    ("a hold follows the capacity of a re-registration", {KEY: whole(8, 16000, 1.0)}, True,
     (16, 32000), {KEY: whole(16, 32000, 1.0)}),
    ("an unchanged hold is unchanged", {KEY: whole(8, 16000, 1.0)}, True, (8, 16000), None),
    ("others above the capacity: nothing more to hold", {"pod": Entry(9000, 0, 0.0, True)},
     False, (8, 16000), {"pod": Entry(9000, 0, 0.0, True), KEY: whole(0, 16000)}),
    ("a node registering with no capacity (its counts failed)", {}, False, (0, 0),
     {KEY: whole(0, 0)}),
])
def test_registered(case, entries, known, capacity, new):
    assert ledger_policy.registered(entries, known, capacity, 5.0) == new, case


@pytest.mark.parametrize("case,listed,left", [
    ("the coordinator's first set replaces the hold", {}, {}),
    ("with the pods it counts there", {"pod": [1500, 2 * MIB]}, {"pod": (1500, 2 * MIB)}),
])
def test_first_set_replaces_the_hold(case, listed, left):
    req = ledger_policy.parse_request(ledger_policy.encode("set", node="n1", entries=listed,
                                                           keep_younger_than=30))
    new, reply = ledger_policy.decide({KEY: whole(8, 16000)}, req, NODE, 10.0)
    assert reply["ok"] and not reply.get("oversubscribed"), case
    assert {k: (e.cpu_m, e.mem_bytes) for k, e in (new or {}).items()} == left, case


def test_a_held_node_admits_no_pod():
    req = ledger_policy.parse_request(ledger_policy.encode(
        "reserve", node="n1", key="p", cpu_m=100, mem_bytes=0))
    new, reply = ledger_policy.decide({KEY: whole(8, 16000)}, req, NODE, 10.0)
    assert new is None and reply["code"] == "nofit"


@pytest.mark.parametrize("entries,flag", [({KEY: whole(8, 16000)}, True), ({}, None),
                                          ({"pod": Entry(1000, MIB, 0.0, True)}, None)])
def test_show_says_a_node_is_held_as_new(entries, flag):
    for with_entries in (False, True):
        assert ledger_policy.node_view(entries, NODE, with_entries=with_entries).get(
            "registered") == flag


def test_the_coordinator_never_holds_it_as_a_departed_pod():
    assert KEY in backstop.KEYS


@pytest.mark.parametrize("text,value", [("", "no"), ("HoldNewNodes=yes\n", "yes"),
                                        ("holdnewnodes=No\n", "no")])
def test_setting(text, value):
    assert config.parse(text).hold_new_nodes == value


def test_setting_rejects_anything_else():
    with pytest.raises(config.ConfigError, match="no/yes"):
        config.parse("HoldNewNodes=1\n")


# ------------------------------------------------------------ the journal

def _serve(ledger, facts, line):
    ticket, reply = ledger.prepare(0, line)
    if ticket:
        reply = ledger.apply(ticket, facts.get, lambda *a: None)
    return reply


def _held(ledger):
    return {n: {k: (e.cpu_m, e.mem_bytes) for k, e in entries.items()}
            for n, entries in ledger.nodes.items()}


def test_only_nodes_not_met_are_held_and_the_hold_is_journaled(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    assert a.registered("n9", 8, 16000, hold=True) is None       # before meet(): nothing
    a.meet(["n1", "n9"])
    assert a.registered("n1", 8, 16000, hold=True) is None       # slurm.conf's
    assert a.registered("n2", 4, 100, hold=False) is None        # not asked to
    assert a.registered("n3", 8, 16000, hold=True) == (8, 16000, ())
    assert a.registered("n3", 8, 16000, hold=True) is None       # re-registering
    b = Ledger(str(tmp_path))                                    # slurmctld restarts
    b.load()
    assert _held(b) == {"n3": {KEY: (8000, 16000 * MIB)}}
    b.meet(["n1", "n2", "n3"])
    assert _serve(b, {"n3": NODE}, ledger_policy.encode("set", node="n3", entries={}))["ok"]
    assert b.nodes == {}
    assert b.registered("n3", 8, 16000, hold=True) is None       # set once: never again
    c = Ledger(str(tmp_path))
    c.load()
    assert c.nodes == {}


def test_a_node_given_a_set_before_it_registers_is_not_held(tmp_path):
    a = Ledger(str(tmp_path))
    a.load()
    a.meet([])
    assert _serve(a, {"d1": NODE}, ledger_policy.encode("set", node="d1", entries={}))["ok"]
    assert a.registered("d1", 8, 16000, hold=True) is None


@pytest.mark.parametrize("listed", [{}, {"pod": [1000, MIB]}])
def test_a_set_prepared_before_the_hold_replays_as_it_was_decided(tmp_path, listed):
    """The coordinator's `set` is journaled outside slurmctld's locks; the
    node registers before the set is applied: replay must end where the
    live ledger did (the set applied after the hold)."""
    a = Ledger(str(tmp_path))
    a.load()
    a.meet([])
    ticket, _ = a.prepare(0, ledger_policy.encode("set", node="n3", entries=listed))
    a.registered("n3", 8, 16000, hold=True)
    assert a.apply(ticket, {"n3": NODE}.get, lambda *a: None)["ok"]
    live = _held(a)
    assert KEY not in live.get("n3", {})
    b = Ledger(str(tmp_path))
    b.load()
    assert _held(b) == live
