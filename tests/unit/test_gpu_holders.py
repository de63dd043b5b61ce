"""The sync daemon's GPU side (pyk8sres/coordinator/gpus.py) with the
Kubernetes calls recorded: claims' ledger entries from the watched
objects, holder claims following Slurm's jobs, released deallocated first
(kube-scheduler requeues waiting pods on a deallocation, not a delete),
nothing written on untrusted data."""
import pytest

from pyk8sres.coordinator import gpus as cgpus
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.policy import gpus
from pyk8sres.testbed import gpus as fake
from test_gpus_policy import claim, review

ID = gpus.Identity()
NS = "pyk8sres-placeholders"


class Recorder:
    def __init__(self, monkeypatch, state):
        self.calls, self.state = [], state
        monkeypatch.setattr(kube_calls, "create_claim", self.create)
        monkeypatch.setattr(kube_calls, "put_claim_status", self.status)
        monkeypatch.setattr(kube_calls, "delete_claim", self.delete)
        monkeypatch.setattr(kube_calls, "get_claim", self.get)

    def create(self, kube, ns, body):
        self.calls.append(("create", body["metadata"]["name"]))
        return {**body, "metadata": {**body["metadata"], "uid": "u-" + body["metadata"]["name"]}}

    def status(self, kube, claim):
        alloc = (claim.get("status") or {}).get("allocation")
        self.calls.append(("status", claim["metadata"]["name"], bool(alloc)))
        self.state.event("resourceclaims", "MODIFIED", claim)
        return claim

    def delete(self, kube, ns, name):
        self.calls.append(("delete", name))
        self.state.event("resourceclaims", "DELETED", {"metadata": {"uid": "u-" + name}})

    def get(self, kube, ns, name):
        return next((c for c in self.state.snapshot()[0] if c["metadata"]["name"] == name), None)


def shown(jobs, count=4):
    return {"n1": {"gpus": {"count": count, "jobs": jobs, "share": []}}}


@pytest.fixture
def state():
    s = cgpus.GpuState(ID, NS)
    s.replace("resourceslices", [fake.resource_slice("n1", 4)])
    s.replace("resourceclaims", [])
    return s


def test_holders_follow_slurms_jobs_and_are_deallocated_before_deletion(monkeypatch, state):
    rec = Recorder(monkeypatch, state)
    h = cgpus.Holders(None, state)
    assert h.sync({"n1": "n1"}, shown([0, 1]))
    assert rec.calls == [("create", "slurm-gpu-n1-gpu-0"), ("status", "slurm-gpu-n1-gpu-0", True),
                         ("create", "slurm-gpu-n1-gpu-1"), ("status", "slurm-gpu-n1-gpu-1", True)]
    rec.calls.clear()
    assert h.sync({"n1": "n1"}, shown([0, 1]))
    assert rec.calls == []                           # nothing differs: nothing written
    assert h.sync({"n1": "n1"}, shown([1]))
    assert rec.calls == [("status", "slurm-gpu-n1-gpu-0", False), ("delete", "slurm-gpu-n1-gpu-0")]


def test_a_completing_jobs_gpus_keep_their_holders_until_it_is_gone(monkeypatch, state):
    """Slurm freed them (the ledger's jobs no longer name them) while the
    job's processes may still use them: their holders stay."""
    rec = Recorder(monkeypatch, state)
    h = cgpus.Holders(None, state)
    assert h.sync({"n1": "n1"}, shown([0, 1]))
    rec.calls.clear()
    assert h.sync({"n1": "n1"}, shown([]), {"n1": frozenset({0, 1})})
    assert rec.calls == []
    assert h.sync({"n1": "n1"}, shown([]), {})
    assert [c[0] for c in rec.calls] == ["status", "status", "delete", "delete"]


def test_a_fenced_node_holds_every_device(monkeypatch, state):
    rec = Recorder(monkeypatch, state)
    cgpus.Holders(None, state).sync({"n1": "n1"}, shown([], count=2))
    assert sorted(c[1] for c in rec.calls if c[0] == "create") == [
        f"slurm-gpu-n1-gpu-{i}" for i in range(4)]


def test_nothing_written_while_the_claims_are_not_trusted(monkeypatch, state):
    rec = Recorder(monkeypatch, state)
    state.health("resourceclaims", False)
    assert cgpus.Holders(None, state).sync({"n1": "n1"}, shown([0]))
    assert rec.calls == []


def test_entries_of_allocated_claims(state):
    alloc = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1",
                                      "device": "gpu-3"}]},
             "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                 {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}
    claim = {"metadata": {"name": "c", "namespace": "default", "uid": "u1"},
             "spec": {"devices": {}}, "status": {"allocation": alloc, "reservedFor": []}}
    state.event("resourceclaims", "ADDED", claim)
    assert state.take_changed()
    assert state.entries({"n1": "n1"}, shown([])) == {"n1": {"claim:u1": (0, 0, [3])}}
    state.event("resourceclaims", "DELETED", claim)
    assert state.entries({"n1": "n1"}, shown([])) == {}
    # another driver's slices are not kept
    state.replace("resourceslices", [{"metadata": {"uid": "x"}, "spec": {"driver": "other"}}])
    assert state.snapshot()[1] == []


# ------------------------------------------------------------ the webhook

class GpuLedger:
    """reserve answers `reply`; show reports n1's gpu count."""

    def __init__(self, reply, count=4, show_ok=True):
        self.reply, self.count, self.show_ok, self.calls = reply, count, show_ok, []

    def reserve(self, node, key, cpu_m, mem_bytes, gpus=()):
        self.calls.append(("reserve", node, key, cpu_m, mem_bytes, tuple(gpus)))
        return self.reply

    def show(self, node=None, since=None):
        if not self.show_ok:
            raise OSError("ledger socket gone")
        return {"ok": True, "nodes": {"n1": {"gpus": {"count": self.count, "jobs": [0],
                                                      "share": []}}}}


def claim_review(devices=("gpu-2",), node="n1", labels=None, ns="default"):
    sel = {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    return {"request": {**review(claim(devices=devices, node_sel=sel if node else None,
                                       labels=labels, ns=ns)), "uid": "r1"}}


@pytest.mark.parametrize("case,body,ledger,allowed,reserved", [
    ("free device", claim_review(), GpuLedger({"ok": True}), True, (2,)),
    ("Slurm holds it", claim_review(devices=("gpu-0",)),
     GpuLedger({"ok": False, "code": "nofit", "error": "gpu 0 held by job 7"}), False, (0,)),
    ("ledger unreachable", claim_review(), GpuLedger({"ok": True}, show_ok=False), False, None),
    ("fenced: Slurm has 2", claim_review(), GpuLedger({"ok": True}, count=2), False, None),
    ("unshared node", claim_review(node="k8s-only"), GpuLedger({"ok": True}), True, None),
    ("holder", claim_review(ns=NS, labels={gpus.HOLDER_LABEL: "n1"}), GpuLedger({"ok": True}),
     True, None),
])
def test_webhook_reserves_a_claims_devices(monkeypatch, case, body, ledger, allowed, reserved):
    from test_not_ready import _scope
    from pyk8sres.coordinator import webhook
    monkeypatch.setattr(webhook, "list_resource_slices",
                        lambda kube, node, driver: [fake.resource_slice(node, 4)])
    answer = webhook.Admission(kube=None, ledger=ledger, scope=_scope()).review(body)
    assert answer["response"]["allowed"] is allowed, (case, answer)
    want = [] if reserved is None else [("reserve", "n1", "claim:u1", 0, 0, reserved)]
    assert ledger.calls == want, case
    if case.startswith("fenced"):
        assert "fenced" in answer["response"]["status"]["message"]


def test_webhook_refuses_legacy_gpus_on_a_shared_node():
    from test_not_ready import _scope, pod, req
    from pyk8sres.coordinator import webhook
    p = pod(node="n1")
    p["spec"]["containers"][0].setdefault("resources", {}).setdefault("limits", {})[
        "nvidia.com/gpu"] = "1"
    ledger = GpuLedger({"ok": True})
    answer = webhook.Admission(kube=None, ledger=ledger, scope=_scope()).review(
        {"request": req("CREATE", "pods", "", p)})
    assert answer["response"]["allowed"] is False
    assert "ResourceClaim" in answer["response"]["status"]["message"] and ledger.calls == []


# ------------------------------------------------------------ the sync loop

class SetLedger:
    """Records each node's last `set`; `show` reports 4 GPUs per node."""

    def __init__(self):
        self.sets = {}

    def set(self, node, entries, keep_younger_than):
        self.sets[node] = dict(entries)
        return {"ok": True, "share": {}}

    def show(self, node=None, since=None):
        return {"ok": True, "nodes": {node: {"entries": {}}}}


ALLOC = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1",
                                  "device": "gpu-3"}]},
         "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
             {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}
CLAIM = {"metadata": {"name": "c", "namespace": "default", "uid": "u1"},
         "status": {"allocation": ALLOC}}


def test_sync_holds_allocated_claims_and_never_drops_them_on_missing_data(tmp_path, state):
    from memory_slurm import SlurmWorld, knode, pod
    from pyk8sres.coordinator import cache as cache_mod, config, sync
    slurm = SlurmWorld(str(tmp_path), "n1")
    slurm.completing_allocations = lambda: ({}, {})
    cfg = config.SyncConfig(ledger_socket="unused")
    cache = cache_mod.Cache(config.exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1")])
    cache.replace("pods", [pod("a", "n1", "1", "1000Mi")])
    led = SetLedger()
    rec = sync.Reconciler(cfg, cache, slurm, ledger=led)
    rec.gpus, rec.ledger_nodes = state, shown([])
    state.event("resourceclaims", "ADDED", CLAIM)
    rec.cycle()
    assert led.sets["n1"]["claim:u1"] == (0, 0, [3])
    assert any(not k.startswith("claim:") for k in led.sets["n1"])     # the pod's entry
    # The claims watch breaks and the claim is gone from what we saw: kept.
    state.health("resourceclaims", False)
    state.event("resourceclaims", "DELETED", CLAIM)
    rec.cycle()
    assert led.sets["n1"]["claim:u1"] == (0, 0, [3])
    # Trusted again: the claim is gone, so are its GPUs.
    state.replace("resourceclaims", [])
    rec.cycle()
    assert "claim:u1" not in led.sets["n1"]


def test_holders_are_all_deallocated_before_any_is_deleted(monkeypatch, state):
    """A pod waiting for the four GPUs a job frees is retried by
    kube-scheduler on the last deallocation: no delete comes before it."""
    rec = Recorder(monkeypatch, state)
    h = cgpus.Holders(None, state)
    assert h.sync({"n1": "n1"}, shown([0, 1, 2, 3]))
    rec.calls.clear()
    assert h.sync({"n1": "n1"}, shown([]))
    names = [f"slurm-gpu-n1-gpu-{i}" for i in range(4)]
    assert rec.calls == [("status", n, False) for n in names] + [("delete", n) for n in names]
    assert h.existing() == {}


def test_a_holder_that_cannot_be_deallocated_is_not_deleted(monkeypatch, state):
    rec = Recorder(monkeypatch, state)
    h = cgpus.Holders(None, state)
    assert h.sync({"n1": "n1"}, shown([0, 1]))
    rec.calls.clear()
    status = rec.status

    def refuse_gpu0(kube, claim):
        if claim["metadata"]["name"].endswith("gpu-0"):
            raise kube_calls.ApiException(status=500, reason="etcd timeout")
        return status(kube, claim)
    monkeypatch.setattr(kube_calls, "put_claim_status", refuse_gpu0)
    assert not h.sync({"n1": "n1"}, shown([]))
    assert rec.calls == [("status", "slurm-gpu-n1-gpu-1", False),
                         ("delete", "slurm-gpu-n1-gpu-1")]
    assert list(h.existing()) == ["slurm-gpu-n1-gpu-0"]   # retried next pass
