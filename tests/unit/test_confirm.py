"""A create reserved at admission and refused afterwards (ResourceQuota,
AlreadyExists) has its reservation handed back (coordinator/confirm.py),
and its namespace's next creates on shared nodes wait a while.  The API
server's answers are scripted; the ledger's rules are the real ones
(pyk8sres.policy.ledger.decide)."""

import time

import pytest

from test_admission import binding, pod, req
from test_not_ready import _scope

from pyk8sres.coordinator import confirm
from pyk8sres.coordinator import webhook
from pyk8sres.coordinator.config import ConfigError, SyncConfig, WebhookConfig
from pyk8sres.policy import admission
from pyk8sres.policy import ledger as ledger_policy
from pyk8sres.policy.ledger import Entry, Facts, Request

NODE = Facts(8, 16000, 0, 0)


class Ledger:
    """The ledger's own decide() over one node's entries."""

    def __init__(self, entries=None, answer=None):
        self.entries = dict(entries or {})
        self.answer = answer      # a fixed reply instead (old server, not ready)
        self.calls = []

    def release_unbound(self, node, key):
        self.calls.append((node, key))
        if self.answer is not None:
            return self.answer
        new, reply = ledger_policy.decide(self.entries,
                                          Request("release", node, key, unbound_only=True),
                                          NODE, now=1.0)
        if new is not None:
            self.entries = new
        return reply


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def stored(uid, node="n1"):
    return {"metadata": {"name": "p", "namespace": "q", "uid": uid}, "spec": {"nodeName": node}}


@pytest.mark.parametrize("case,pod,entries,left,blocked", [
    ("landed: nothing to do", stored("u-1"), {"u-1": Entry(6000, 0, 0.0)}, {"u-1"}, False),
    ("never stored (quota): released, namespace waits", None,
     {"u-1": Entry(6000, 0, 0.0), "other": Entry(1000, 0, 0.0, True)}, {"other"}, True),
    ("name taken by another pod (AlreadyExists): released", stored("u-0"),
     {"u-1": Entry(6000, 0, 0.0)}, set(), True),
    ("bound to another node: released", stored("u-1", "n2"),
     {"u-1": Entry(6000, 0, 0.0)}, set(), True),
    # The sync daemon saw it bound (it landed after all, and went): kept.
    ("seen bound by the sync daemon: kept", None, {"u-1": Entry(6000, 0, 0.0, True)}, {"u-1"},
     False),
    ("already gone from the ledger", None, {}, set(), True),
])
def test_check(monkeypatch, case, pod, entries, left, blocked):
    monkeypatch.setattr(confirm, "get_pod", lambda kube, ns, name: pod)
    ledger, clock = Ledger(entries), Clock()
    c = confirm.CreateConfirmer(None, ledger, hold=10.0, clock=clock)
    assert c.check(confirm.Created("q", "p", "u-1", "n1", clock.t, "n1")) is True, case
    assert set(ledger.entries) == left, case
    # One is forgiven (a pod created and deleted before the sync daemon saw it)...
    assert c.blocked_for("q") == 0, case
    # ...a second within `hold` seconds is not.
    clock.t += 9.0
    ledger.entries["u-2"] = Entry(6000, 0, 0.0, entries.get("u-1", Entry(0, 0, 0.0)).bound)
    c.check(confirm.Created("q", "p", "u-2", "n1", clock.t, "n1"))
    assert (c.blocked_for("q") > 0) is blocked, case
    assert c.blocked_for("other-namespace") == 0, case
    if blocked:
        assert c.blocked_for("q") == pytest.approx(10.0)
        clock.t += 10.5
        assert c.blocked_for("q") == 0, case


def test_failures_further_apart_than_hold_are_forgiven(monkeypatch):
    monkeypatch.setattr(confirm, "get_pod", lambda kube, ns, name: None)
    clock = Clock()
    c = confirm.CreateConfirmer(None, Ledger(), hold=10.0, clock=clock)
    for i in range(5):
        c.check(confirm.Created("q", "p", f"u-{i}", "n1", clock.t, "n1"))
        assert c.blocked_for("q") == 0
        clock.t += 11


@pytest.mark.parametrize("case,get,answer,done", [
    ("API server unreachable: again later", "raise", None, False),
    ("ledger not ready: again later", None, {"ok": False, "code": "notready", "error": "x"},
     False),
    ("ledger refuses the option (older plugin): its grace period does it", None,
     {"ok": False, "code": "badrequest", "error": "unknown field(s) unbound_only"}, True),
])
def test_check_when_something_does_not_answer(monkeypatch, case, get, answer, done):
    def read(kube, ns, name):
        if get == "raise":
            raise OSError("connection refused")
        return None
    monkeypatch.setattr(confirm, "get_pod", read)
    ledger = Ledger({"u-1": Entry(6000, 0, 0.0)}, answer=answer)
    c = confirm.CreateConfirmer(None, ledger)
    assert c.check(confirm.Created("q", "p", "u-1", "n1", 0.0, "n1")) is done, case
    assert c.blocked_for("q") == 0, case


def test_the_worker_releases_a_refused_create_after_the_delay(monkeypatch):
    monkeypatch.setattr(confirm, "get_pod", lambda kube, ns, name: None)
    ledger = Ledger({"u-1": Entry(6000, 0, 0.0)})
    c = confirm.CreateConfirmer(None, ledger, after=0.05)
    try:
        c.track("q", "p", "u-1", "n1", "n1")
        assert ledger.calls == []            # not before the delay
        deadline = time.monotonic() + 5
        while ledger.entries and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ledger.entries == {} and ledger.calls == [("n1", "u-1")]
        assert c.pending() == 0
    finally:
        c.stop()


def test_tracking_is_bounded():
    c = confirm.CreateConfirmer(None, Ledger(), after=3600, cap=3)
    try:
        for i in range(10):
            c.track("q", f"p{i}", f"u-{i}", "n1", "n1")
        assert c.pending() == 3
    finally:
        c.stop()


def test_landed():
    assert admission.landed("u-1", "n1", stored("u-1"))
    assert not admission.landed("u-1", "n1", stored("u-2"))
    assert not admission.landed("u-1", "n1", stored("u-1", "n2"))      # a binding that lost
    assert not admission.landed("u-1", "n1", stored("u-1", None))
    assert not admission.landed("u-1", "n1", None)
    assert not admission.landed("u-1", "n1", {})


def test_a_failed_binding_is_released_but_never_pauses_the_namespace(monkeypatch):
    """Bindings are kube-scheduler's, not the namespace's doing."""
    monkeypatch.setattr(confirm, "get_pod", lambda kube, ns, name: stored("u-1", "n2"))
    ledger, clock = Ledger({"u-1": Entry(6000, 0, 0.0)}), Clock()
    c = confirm.CreateConfirmer(None, ledger, hold=10.0, clock=clock)
    for _ in range(3):
        assert c.check(confirm.Created("q", "p", "u-1", "n1", clock.t, "n1", create=False))
        ledger.entries["u-1"] = Entry(6000, 0, 0.0)
    assert ledger.calls == [("n1", "u-1")] * 3 and c.blocked_for("q") == 0


def test_phantom_refusal_names_namespace_and_why():
    t = admission.Target("create", "q", "p", "n1", False)
    d = admission.phantom_refusal(t, 7.2)
    assert isinstance(d, admission.Deny) and d.code == "phantom_creates"
    assert d.code in admission.DENY_CODES
    assert "namespace q" in d.message and "8 s" in d.message and "ResourceQuota" in d.message


class Tracking(confirm.CreateConfirmer):
    def __init__(self, blocked=0.0):
        super().__init__(None, None)
        self.tracked, self.blocked = [], blocked

    def track(self, *a, create=True):
        self.tracked.append(a)
        self.kinds = getattr(self, "kinds", []) + [create]

    def blocked_for(self, namespace):
        return self.blocked


class Reserving:
    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def reserve(self, *a):
        self.calls.append(a)
        return self.reply


@pytest.mark.parametrize("case,request_,reply,blocked,allowed,tracked", [
    ("create reserved: read back later", ("CREATE", "pods", "", "n1"), {"ok": True}, 0, True,
     True),
    ("create refused by the ledger: nothing to read back", ("CREATE", "pods", "", "n1"),
     {"ok": False, "code": "nofit", "error": "full"}, 0, False, False),
    ("create while the namespace waits: refused, nothing reserved",
     ("CREATE", "pods", "", "n1"), {"ok": True}, 5.0, False, False),
    ("create on an unshared node: not tracked", ("CREATE", "pods", "", "k8s-only"),
     {"ok": True}, 5.0, True, False),
    ("binding: read back too, whatever the namespace's pause",
     ("CREATE", "pods", "binding", "n1"), {"ok": True}, 5.0, True, True),
])
def test_admission_reads_reserved_creates_back(case, request_, reply, blocked, allowed,
                                               tracked, monkeypatch):
    op, res, sub, node = request_
    obj = binding(node) if sub == "binding" else pod(node=node, ns="q")
    confirmer, ledger = Tracking(blocked), Reserving(reply)
    adm = webhook.Admission(kube=None, ledger=ledger, scope=_scope(), confirmer=confirmer)
    if sub == "binding":
        monkeypatch.setattr(webhook, "get_pod", lambda kube, ns, name: pod(node=None, ns="q"))
    review = adm.review({"request": req(op, res, sub, obj, ns="q")})
    answer = review["response"]
    assert answer["allowed"] is allowed, (case, answer)
    assert bool(confirmer.tracked) is tracked, case
    if tracked:
        assert confirmer.tracked == [("q", "p", "u-1", "n1", "n1")]
        assert confirmer.kinds == [sub != "binding"]
    if blocked and not allowed:
        assert ledger.calls == [] and "namespace q" in answer["status"]["message"]


@pytest.mark.parametrize("settings,words", [
    ({"confirm_create_seconds": 0}, "confirm_create_seconds"),
    ({"confirm_create_seconds": 30}, "reservation_grace"),
    ({"phantom_hold_seconds": -1}, "phantom_hold_seconds"),
])
def test_webhook_settings_are_checked(settings, words):
    with pytest.raises(ConfigError) as e:
        webhook.Webhook(WebhookConfig(**settings), SyncConfig(), None, None)
    assert words in str(e.value)


class ShowingLedger(Ledger):
    """Ledger with the real `show` of one node (policy.ledger.node_view)."""

    def __init__(self, entries=None, answer=None, show_answer=None):
        super().__init__(entries, answer)
        self.show_answer, self.shows = show_answer, 0

    def show(self, node=None):
        self.shows += 1
        if isinstance(self.show_answer, Exception):
            raise self.show_answer
        if self.show_answer is not None:
            return self.show_answer
        return {"ok": True, "nodes": {node: ledger_policy.node_view(
            self.entries, NODE, with_entries=True)}}


@pytest.mark.parametrize("case,entries,show_answer,reads_pod", [
    ("seen bound in the ledger: landed, the pod is not read", {"u-1": Entry(6000, 0, 0.0, True)},
     None, False),
    ("still a reservation: the pod is read", {"u-1": Entry(6000, 0, 0.0)}, None, True),
    ("not in the ledger: the pod is read", {"other": Entry(1000, 0, 0.0, True)}, None, True),
    ("an older ledger (no unbound list): the pod is read", {"u-1": Entry(6000, 0, 0.0, True)},
     {"ok": True, "nodes": {"n1": {"entries": {"u-1": [6000, 0]}, "reserved": 0}}}, True),
    ("not ready: the pod is read", {"u-1": Entry(6000, 0, 0.0, True)},
     {"ok": False, "code": "notready", "error": "starting"}, True),
    ("no answer: the pod is read", {"u-1": Entry(6000, 0, 0.0, True)}, OSError("refused"), True),
])
def test_ledger_asked_before_the_api_server(monkeypatch, case, entries, show_answer, reads_pod):
    reads = []

    def read(kube, ns, name):
        reads.append(name)
        return stored("u-1")          # it did land on n1
    monkeypatch.setattr(confirm, "get_pod", read)
    ledger = ShowingLedger(entries, show_answer=show_answer)
    c = confirm.CreateConfirmer(None, ledger, clock=Clock())
    assert c.check(confirm.Created("q", "p", "u-1", "n1", 100.0, "n1")) is True, case
    assert ledger.shows == 1, case
    assert bool(reads) is reads_pod, case
    assert ledger.calls == [], case         # a landed pod's reservation is never released


def test_a_failed_create_is_still_released_with_the_ledger_asked_first(monkeypatch):
    monkeypatch.setattr(confirm, "get_pod", lambda kube, ns, name: None)   # never stored
    ledger = ShowingLedger({"u-1": Entry(6000, 0, 0.0)})
    c = confirm.CreateConfirmer(None, ledger, clock=Clock())
    assert c.check(confirm.Created("q", "p", "u-1", "n1", 100.0, "n1")) is True
    assert ledger.entries == {} and ledger.calls == [("n1", "u-1")]


@pytest.mark.parametrize("reply,expected", [
    ({"ok": True, "nodes": {"n1": {"entries": {"k": [1, 1]}, "unbound": []}}}, True),
    ({"ok": True, "nodes": {"n1": {"entries": {"k": [1, 1]}, "unbound": ["k"]}}}, False),
    ({"ok": True, "nodes": {"n1": {"entries": {}, "unbound": []}}}, False),
    ({"ok": True, "nodes": {"n1": {"entries": {"k": [1, 1]}}}}, False),      # older server
    ({"ok": True, "nodes": {"n2": {"entries": {"k": [1, 1]}, "unbound": []}}}, False),
    ({"ok": False, "nodes": {"n1": {"entries": {"k": [1, 1]}, "unbound": []}}}, False),
    ({"ok": True, "nodes": {"n1": {"entries": {"k": [1, 1]}, "unbound": "k"}}}, False),
    ({"ok": True}, False),
])
def test_seen_bound(reply, expected):
    assert ledger_policy.seen_bound(reply, "n1", "k") is expected


def test_show_of_one_node_lists_its_unbound_entries():
    view = ledger_policy.node_view({"a": Entry(1000, 0, 0.0), "b": Entry(1000, 0, 0.0, True)},
                                   NODE, with_entries=True)
    assert view["unbound"] == ["a"] and view["reserved"] == 1
    assert "unbound" not in ledger_policy.node_view({}, NODE, with_entries=False)
