"""`show` since a token: a reply lists only the nodes whose view changed,
and a client that merges the replies holds what a full `show` says.

FakeCopy stands in for node_features' copy of the facts (its C twin is
_copy_facts/_copied_changes in plugins/node_features_k8s_resources.c, run
against slurmctld in tests/integration/test_ledger_show_since.py)."""
import random
import threading
import types

import pytest

from pyk8sres.coordinator import placeholder
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator.config import SyncConfig
from pyk8sres.coordinator.scope import Scope
from pyk8sres.coordinator.threads import SlurmPoller
from pyk8sres.policy import ledger as ledger_policy
from pyk8sres.policy.ledger import Facts, Request, RequestError, ShowToken
from pyk8sres.slurmctld.ledger import MAX_CHANGED, Ledger


class FakeCopy:
    """The plugin's copy: each show copies every node's facts and numbers
    the ones that changed; a node added or gone moves the layout."""

    def __init__(self, facts: dict):
        self.live = facts                  # what slurmctld holds now
        self.copied: dict[str, tuple] = {}  # name -> (facts, gen)
        self.layout, self.gen = 1, 0

    def copy(self):
        if list(self.copied) != list(self.live):
            self.layout += 1
            self.copied = {n: (None, 0) for n in self.live}
        for name, facts in self.live.items():
            if self.copied[name][0] != facts:
                self.gen += 1
                self.copied[name] = (facts, self.gen)

    def changes(self, layout: int, since: int):
        if layout != self.layout or since > self.gen:
            return self.layout, self.gen, None
        changed = [n for n, (_, gen) in self.copied.items() if gen > since]
        return self.layout, self.gen, changed if len(changed) <= MAX_CHANGED else None

    def facts(self, name):
        return self.copied.get(name, (None, 0))[0]


def serve(ledger, copy, op, **fields):
    ticket, reply = ledger.prepare(0, ledger_policy.encode(op, **fields).strip())
    if not ticket:
        return reply
    if op == "show":
        copy.copy()
        return ledger.apply(ticket, copy.facts, lambda *a: None, lambda: list(copy.copied),
                            dict, copy.changes)
    return ledger.apply(ticket, copy.live.get, lambda *a: None)


@pytest.fixture
def world(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.load()
    copy = FakeCopy({f"n{i}": Facts(8, 16000, 0, 0) for i in range(1, 6)})
    return ledger, copy


@pytest.mark.parametrize("change, listed", [
    ("nothing", []),
    ("reserve on n2", ["n2"]),
    ("a job starts on n4", ["n4"]),
    ("reserve on n1, job on n3", ["n1", "n3"]),
    ("a refused reserve on n5", []),
    ("a release on ghost, a node Slurm no longer has", ["ghost"]),
])
def test_since_lists_only_what_changed(world, change, listed):
    ledger, copy = world
    serve(ledger, copy, "reserve", node="ghost", key="k0", cpu_m=0, mem_bytes=0)
    # held on a node since removed
    ledger.nodes["ghost"] = {"k0": ledger_policy.Entry(500, 0, 0.0)}
    first = serve(ledger, copy, "show")
    assert first["full"] and set(first["nodes"]) == {"n1", "n2", "n3", "n4", "n5", "ghost"}
    if "n2" in change:
        assert serve(ledger, copy, "reserve", node="n2", key="a", cpu_m=1000, mem_bytes=1)["ok"]
    if "n1" in change:
        assert serve(ledger, copy, "reserve", node="n1", key="b", cpu_m=1000, mem_bytes=1)["ok"]
    if "n4" in change:
        copy.live["n4"] = Facts(8, 16000, 2, 1000)
    if "n3" in change:
        copy.live["n3"] = Facts(8, 16000, 1, 0)
    if "refused" in change:
        assert not serve(ledger, copy, "reserve", node="n5", key="c", cpu_m=9000,
                         mem_bytes=1)["ok"]
    if "ghost" in change:
        assert serve(ledger, copy, "release", node="ghost", key="k0")["ok"]
    since = serve(ledger, copy, "show", since=first["token"])
    assert since["full"] is False and sorted(since["nodes"]) == sorted(listed)
    assert since["token"] != first["token"] or not listed


@pytest.mark.parametrize("why, token", [
    ("another process or journal load", lambda t, ledger: "00000000." + t.split(".", 1)[1]),
    ("a token that cannot be read", lambda t, ledger: "not-a-token"),
    ("a token from the future", lambda t, ledger: str(
        ShowToken.parse(t)._replace(entries=ledger.entries_gen + 5))),
])
def test_a_token_it_cannot_follow_gets_every_node(world, why, token):
    ledger, copy = world
    first = serve(ledger, copy, "show")
    reply = serve(ledger, copy, "show", since=token(first["token"], ledger))
    assert reply["full"] and len(reply["nodes"]) == 5, why


def test_the_node_table_changing_gets_every_node(world):
    ledger, copy = world
    first = serve(ledger, copy, "show")
    copy.live["n6"] = Facts(4, 8000, 0, 0)            # scontrol reconfigure with a new node
    reply = serve(ledger, copy, "show", since=first["token"])
    assert reply["full"] and "n6" in reply["nodes"]


def test_a_reload_of_the_journal_starts_a_new_epoch(world):
    ledger, copy = world
    first = serve(ledger, copy, "show")
    ledger.load()                                     # a takeover, a re-exec
    assert serve(ledger, copy, "show", since=first["token"])["full"]


def test_too_many_changes_get_every_node(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.load()
    copy = FakeCopy({f"n{i}": Facts(8, 16000, 0, 0) for i in range(MAX_CHANGED + 10)})
    first = serve(ledger, copy, "show")
    for name in copy.live:
        copy.live[name] = Facts(8, 16000, 1, 0)
    assert serve(ledger, copy, "show", since=first["token"])["full"]


@pytest.mark.parametrize("line, words", [
    ('{"op":"show","node":"n1","since":"a.1.2.3"}', "every node"),
    ('{"op":"show","since":7}', "since"),
    ('{"op":"show","since":"' + "x" * 300 + '"}', "since"),
])
def test_since_is_checked(line, words):
    with pytest.raises(RequestError, match=words):
        ledger_policy.parse_request(line)


def test_since_parses():
    assert (ledger_policy.parse_request('{"op":"show","since":"ab12.3.4.5"}')
            == Request("show", since="ab12.3.4.5"))
    assert ShowToken.parse("ab12.3.4.5") == ShowToken("ab12", 3, 4, 5)


@pytest.mark.parametrize("known, reply, nodes, changed", [
    (None, {"full": False, "nodes": {"a": 1}}, {"a": 1}, None),
    ({"a": 1, "b": 2}, {"full": True, "nodes": {"a": 3}}, {"a": 3}, None),
    ({"a": 1, "b": 2}, {"full": False, "nodes": {"b": 5}}, {"a": 1, "b": 5}, {"b"}),
    ({"a": 1}, {"full": False, "nodes": {}}, {"a": 1}, set()),
    ({"a": 1}, {"nodes": {"b": 1}}, {"b": 1}, None),     # an older server: always full
])
def test_merged_show(known, reply, nodes, changed):
    assert ledger_policy.merged_show(known, reply) == (nodes, changed)


def test_merged_replies_hold_what_a_full_show_says_under_random_churn(world):
    """Differential: a follower merging `since` replies against a fresh full
    show after every step of random reserves, releases, sets, job starts and
    ends, nodes added, journal reloads."""
    ledger, copy = world
    rnd = random.Random(7)
    known, token = None, None
    partial = 0
    for step in range(600):
        name = rnd.choice(sorted(copy.live))
        kind = rnd.random()
        if kind < 0.35:
            serve(ledger, copy, "reserve", node=name, key=f"k{rnd.randrange(20)}",
                  cpu_m=rnd.randrange(0, 3000), mem_bytes=rnd.randrange(0, 1 << 30))
        elif kind < 0.5:
            serve(ledger, copy, "release", node=name, key=f"k{rnd.randrange(20)}")
        elif kind < 0.6:
            serve(ledger, copy, "set", node=name, keep_younger_than=0,
                  entries={f"k{i}": [100, 1 << 20] for i in range(rnd.randrange(3))})
        elif kind < 0.9:
            copy.live[name] = Facts(8, 16000, rnd.randrange(0, 9), rnd.randrange(0, 16000))
        elif kind < 0.93:
            copy.live[f"m{step}"] = Facts(4, 8000, 0, 0)
        elif kind < 0.95:
            ledger.load()
        reply = serve(ledger, copy, "show", **({"since": token} if token else {}))
        known, _ = ledger_policy.merged_show(known, reply)
        token = reply["token"]
        partial += not reply["full"]
        assert known == serve(ledger, copy, "show")["nodes"], step
    assert partial > 400        # most replies were partial: the test followed changes


class LocalLedger:
    """The coordinator's ledger client, served by `world` in this process."""

    def __init__(self, ledger, copy):
        self.ledger, self.copy, self.asked = ledger, copy, []

    def show(self, node=None, since=None):
        self.asked.append(since)
        return serve(self.ledger, self.copy, "show", **({"since": since} if since else {}))


def test_the_follower_asks_for_changes_and_for_everything_now_and_then(world, monkeypatch):
    ledger, copy = world
    client = LocalLedger(ledger, copy)
    clock = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    follower = slurm_calls.ShowFollower(client, full_seconds=30)
    shown, changed = follower.refresh()
    assert changed is None and len(shown["nodes"]) == 5 and client.asked == [None]
    assert serve(ledger, copy, "reserve", node="n3", key="p", cpu_m=1500, mem_bytes=1)["ok"]
    shown, changed = follower.refresh()
    assert changed == {"n3"} and shown["nodes"]["n3"]["share"]["cpu"] == 2
    assert len(shown["nodes"]) == 5 and client.asked[-1] is not None
    assert follower.refresh()[1] == set()
    clock[0] += 30
    assert follower.refresh()[1] is None and client.asked[-1] is None
    assert follower.nodes == serve(ledger, copy, "show")["nodes"]


def test_the_follower_passes_a_refusal_on_and_keeps_its_view(world):
    ledger, copy = world
    replies = [serve(ledger, copy, "show"), {"ok": False, "code": "notready", "error": "x"}]

    class Scripted:
        def show(self, node=None, since=None):
            return replies.pop(0)
    follower = slurm_calls.ShowFollower(Scripted())
    known = follower.refresh()[0]["nodes"]
    reply, changed = follower.refresh()
    assert ledger_policy.not_ready(reply) and changed is None and follower.nodes == known


class FakeApi:
    """The placeholders' Kubernetes calls (pyk8sres.coordinator.kube), in
    memory: this test is about what they ask the ledger and when they plan."""

    def __init__(self):
        self.pods, self.calls, self.down = {}, [], False

    def list_namespace_pods(self, kube, namespace):
        self.calls.append("list")
        if self.down:
            raise RuntimeError("API server down")
        return list(self.pods.values())

    def create_pod(self, kube, namespace, body):
        name = f"ph-{len(self.pods)}"
        body["metadata"]["name"] = name
        self.pods[name] = body
        self.calls.append(("create", body["spec"]["nodeName"]))
        return body


def test_placeholders_plan_from_changes_and_never_lose_one(world, monkeypatch):
    ledger, copy = world
    api = FakeApi()
    for name in ("list_namespace_pods", "create_pod"):
        monkeypatch.setattr(placeholder, name, getattr(api, name))
    scope = Scope(SyncConfig())
    scope.replace_slim("nodes", [scope.slim("nodes", {
        "metadata": {"name": f"n{i}"},
        "status": {"allocatable": {"cpu": "8", "memory": "16000Mi"}}}) for i in range(1, 6)])
    client = LocalLedger(ledger, copy)
    ph = placeholder.Placeholders(None, client, scope, "ns")
    assert ph.sync_once() == {"created": [], "resized": [], "deleted": []}
    copy.live["n2"] = Facts(8, 16000, 2, 1000)                 # a job starts
    assert ph.sync_once()["created"] == ["n2"]
    calls = len(api.calls)
    assert ph.sync_once()["created"] == [] and len(api.calls) == calls    # nothing to do
    assert client.asked[-1] is not None                        # and only changes were asked
    # A pod's share moving is not a job: nothing to plan, nothing left pending.
    assert serve(ledger, copy, "reserve", node="n1", key="pod", cpu_m=500, mem_bytes=1)["ok"]
    assert ph.sync_once()["created"] == [] and len(api.calls) == calls and ph.moved == set()
    # A change seen by a pass that then failed is planned by the next one.
    copy.live["n3"] = Facts(8, 16000, 3, 0)
    ph.listed_at, api.down = -1e9, True
    with pytest.raises(RuntimeError, match="API server down"):
        ph.sync_once()
    api.down = False
    assert ph.sync_once()["created"] == ["n3"]


def test_sync_reads_slurm_when_the_ledger_saw_a_change_and_now_and_then(world, monkeypatch):
    ledger, copy = world
    clock = [1000.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    read_at = []
    rec = types.SimpleNamespace(
        slurm=types.SimpleNamespace(list_nodes=lambda: read_at.append(clock[0]) or []),
        slurm_view=None, cfg=types.SimpleNamespace(repair_seconds=30),
        cache=types.SimpleNamespace(mark_all=lambda: None, mark=lambda names: list(names)),
        observe_ledger=lambda shown: None, k8s_name=lambda name: name,
        backstop=types.SimpleNamespace(read_completing=lambda slurm, view: None,
                                       holding=lambda: False))

    def job_on_n4():
        copy.live["n4"] = Facts(8, 16000, 4, 100)

    def restart():        # another slurmctld process: another epoch
        ledger.load()

    def pod_on_n2():      # the pods' share moves: not Slurm's side
        serve(ledger, copy, "reserve", node="n2", key="pod", cpu_m=500, mem_bytes=1)
    # Per period of 1 s: what happens during it, and whether Slurm is read
    # at its end.  The poller asks the ledger at the start of a period, so
    # a change is read at the end of the next one.
    actions = [None, pod_on_n2, job_on_n4, None, restart, None, "9 s pass", None]
    reads = [True,   # every node is new to the follower
             False, False, True, False, True, True,   # read_period (10 s) has passed
             False]
    seen = []

    class Periods:
        def wait(self, period):
            seen.append(len(read_at))
            clock[0] += period
            if len(seen) > len(actions):
                return True
            action = actions[len(seen) - 1]
            if callable(action):
                action()
            elif action:
                clock[0] += 9
            return False

    poller = SlurmPoller(rec, 1.0, Periods(), LocalLedger(ledger, copy), read_period=10)
    poller.run()
    assert [b > a for a, b in zip(seen, seen[1:])] == reads


def test_the_poller_wakes_the_gpu_holders_when_slurms_gpu_jobs_move(world):
    """The holder claims follow a job's GPUs in the poller's own period, not
    one of the holders' thread later; nothing else wakes them."""
    ledger, copy = world
    copy.live["n1"] = Facts(8, 16000, 0, 0, 4)
    rec = types.SimpleNamespace(ledger_nodes=None)
    moved = threading.Event()
    poller = SlurmPoller(rec, 1.0, threading.Event(), LocalLedger(ledger, copy),
                         gpus_moved=moved)
    poller.ledger_moved()        # every node new: the holders' own pass reads them
    moved.clear()
    steps = [("nothing", None, False),
             ("a pod reserves on n2", lambda: serve(ledger, copy, "reserve", node="n2",
                                                    key="pod", cpu_m=500, mem_bytes=1), False),
             ("a CPU job on n3", lambda: copy.live.update(n3=Facts(8, 16000, 1, 100)), False),
             ("a job takes GPUs 0-1 of n1",
              lambda: copy.live.update(n1=Facts(8, 16000, 1, 100, 4, frozenset({0, 1}))), True),
             ("it frees GPU 1",
              lambda: copy.live.update(n1=Facts(8, 16000, 1, 100, 4, frozenset({0}))), True),
             ("it ends", lambda: copy.live.update(n1=Facts(8, 16000, 0, 0, 4)), True)]
    for what, change, woken in steps:
        if change:
            change()
        poller.ledger_moved()
        assert moved.is_set() == woken, what
        assert rec.ledger_nodes is not None, what   # the holders read this view
        moved.clear()


def test_a_gpu_count_change_is_slurms_side_moving(world):
    """Whole-node pods hold every GPU of their node: a count Slurm changes
    (gres.conf, reconfigure) is a change of Slurm's side, read at once."""
    ledger, copy = world
    copy.live["n1"] = Facts(8, 16000, 0, 0, 4)
    poller = SlurmPoller(types.SimpleNamespace(ledger_nodes=None), 1.0, threading.Event(),
                         LocalLedger(ledger, copy))
    poller.ledger_moved()
    assert not poller.ledger_moved()
    copy.live["n1"] = Facts(8, 16000, 0, 0, 6)
    assert poller.ledger_moved()
