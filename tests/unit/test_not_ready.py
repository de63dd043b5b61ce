"""The coordinator against a ledger that answers "notready" (slurmctld
starting, a backup taking over): the webhook refuses and says so, never
allows a pod unreserved; the shared-node scope keeps the last known set,
never "no shared nodes"; the placeholders plan nothing; sync keeps every
share and sends it again once the ledger is back."""

import types

import pytest

from pyk8sres.coordinator import sync
from pyk8sres.coordinator.cache import Cache
from pyk8sres.coordinator.config import SyncConfig, exemptions_of
from pyk8sres.coordinator.placeholder import Placeholders
from pyk8sres.coordinator.scope import LedgerNotReady, Scope, slurm_names
from pyk8sres.coordinator.slurm import ShowFollower
from pyk8sres.coordinator.webhook import Admission, Webhook
from pyk8sres.policy import admission
from pyk8sres.policy import ledger as ledger_policy

from memory_slurm import SlurmWorld, knode
from memory_slurm import pod as bound_pod
from test_admission import MI, pod, req, target

NOT_READY = {"ok": False, "code": "notready",
             "error": "slurmctld has not recovered its node and job state yet"}


@pytest.mark.parametrize("reply,expect", [
    (NOT_READY, True),
    ({"ok": False, "code": "notready"}, True),
    ({"ok": True, "code": "notready"}, False),        # only a refusal is one
    ({"ok": False, "code": "nofit", "error": "full"}, False),
    ({"ok": True, "nodes": {}}, False),
    ({}, False),
    (None, False),
    ("notready", False),
])
def test_not_ready_is_recognised_only_as_the_servers_refusal(reply, expect):
    assert ledger_policy.not_ready(reply) is expect


@pytest.mark.parametrize("static", [False, True])
def test_webhook_verdict_refuses_and_names_not_ready(static):
    d = admission.verdict(target(),
                          admission.Reserve("n1", "u-1", 500, 256 * MI, static=static), NOT_READY)
    assert isinstance(d, admission.Deny) and d.code == "ledger_not_ready"
    assert d.code in admission.DENY_CODES
    assert "not ready" in d.message and "node n1" in d.message and "retry" in d.message
    answer = admission.review_response({"uid": "r"}, d)["response"]
    assert answer["allowed"] is False and "not ready" in answer["status"]["message"]


class ScriptedLedger:
    """A ledger client whose every reply is `reply` (recording the calls)."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def call(self, op, **fields):
        self.calls.append((op, fields))
        return self.reply

    def reserve(self, node, key, cpu_m, mem_bytes):
        return self.call("reserve", node=node, key=key, cpu_m=cpu_m, mem_bytes=mem_bytes)

    def set(self, node, entries, keep_younger_than):
        return self.call("set", node=node, entries=entries, keep=keep_younger_than)

    def show(self, node=None, since=None):
        return self.call("show", node=node, since=since)


def _scope(names=("n1", "n2")):
    s = Scope(SyncConfig())
    s.replace_slim("nodes", [s.slim("nodes", knode(n)) for n in ("n1", "n2", "k8s-only")])
    s.update(slurm_names=list(names))
    return s


@pytest.mark.parametrize("case,reply,admitted", [
    ("reserved", {"ok": True}, True),
    ("not ready", NOT_READY, False),
    ("no fit", {"ok": False, "code": "nofit", "error": "full"}, False),
])
def test_admission_of_a_pod_on_a_shared_node(case, reply, admitted):
    ledger = ScriptedLedger(reply)
    review = Admission(kube=None, ledger=ledger, scope=_scope()).review(
        {"request": req("CREATE", "pods", "", pod(node="n1"))})
    assert review["response"]["allowed"] is admitted, case
    assert [op for op, _ in ledger.calls] == ["reserve"], case
    if not admitted and ledger_policy.not_ready(reply):
        assert "Slurm's ledger is not ready" in review["response"]["status"]["message"]


@pytest.mark.parametrize("case,shown,raises", [
    ("not ready", NOT_READY, LedgerNotReady),
    ("refused", {"ok": False, "code": "denied", "error": "uid 5"}, RuntimeError),
    ("every node unknown", {"ok": True, "nodes": {"n1": {"unknown": True}}}, RuntimeError),
    ("ready", {"ok": True, "nodes": {"n1": {"share": {}}, "x": {"unknown": True}}}, None),
])
def test_slurm_names_never_takes_not_ready_for_no_shared_nodes(case, shown, raises):
    if raises is None:
        assert slurm_names(shown) == ["n1"], case
    else:
        with pytest.raises(raises):
            slurm_names(shown)


def test_webhook_refresh_keeps_the_last_known_shared_set_while_not_ready():
    scope = _scope()
    before = (scope.shared(), scope.unshared())
    assert before == ({"n1": "n1", "n2": "n2"}, ["k8s-only"])
    published = []
    hook = types.SimpleNamespace(
        scope=scope, follower=ShowFollower(ScriptedLedger(NOT_READY)), certs=None,
        server=types.SimpleNamespace(reload_if_changed=lambda: None),
        publish=lambda: published.append(scope.unshared()))
    Webhook.refresh(hook)
    assert (scope.shared(), scope.unshared()) == before
    assert published == [["k8s-only"]]       # never "every node unshared"


def test_placeholders_plan_nothing_while_not_ready():
    class NoKube:
        def __getattr__(self, name):
            raise AssertionError(f"the placeholders touched the API ({name}) while not ready")
    scope = _scope()
    ph = Placeholders(NoKube(), ScriptedLedger(NOT_READY), scope, "pyk8sres-system")
    with pytest.raises(LedgerNotReady):
        ph.sync_once()
    assert scope.shared() == {"n1": "n1", "n2": "n2"}


def test_sync_keeps_shares_while_not_ready_and_sends_them_again(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    cfg = SyncConfig(ledger_socket="unused")
    cache = Cache(exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("n2")])
    cache.replace("pods", [bound_pod("a", "n1", "2", "0")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    rec.cycle()
    assert slurm.counts("n1") == (2, 8000)
    held = dict(rec.last_set)

    rec.ledger = ScriptedLedger(NOT_READY)      # slurmctld restarting
    cache.event("pods", "DELETED", bound_pod("a", "n1", phase="Succeeded"))
    cache.event("pods", "ADDED", bound_pod("b", "n2", "1", "0"))
    rec.cycle()
    assert {c[1]["node"] for c in rec.ledger.calls if c[0] == "set"} == {"n1", "n2"}
    assert rec.last_set == held                 # what the ledger acknowledged, kept
    assert slurm.counts("n1") == (2, 8000) and slurm.counts("n2") == (4, 8000)

    rec.ledger = slurm.ledger                   # back: the differences are sent again
    rec.cycle()
    assert slurm.counts("n1") == (4, 8000) and slurm.counts("n2") == (3, 8000)
