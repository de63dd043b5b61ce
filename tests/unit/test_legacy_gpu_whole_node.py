"""legacy_gpu = "whole-node" (docs/gpus.md): a pod asking for a device
plugin's GPUs (nvidia.com/gpu) on a shared node reserves every GPU index
of the node at admission, the sync daemon's `set` holds the same from the
pod object, holder claims show kube-scheduler those devices, and a node
whose GPU count cannot be told is left as the ledger holds it."""
import pytest

from pyk8sres.coordinator import config, webhook
from pyk8sres.coordinator import gpus as cgpus
from pyk8sres.coordinator.scope import Scope
from pyk8sres.policy import admission, gpus, usage
from test_gpu_holders import GpuLedger, Recorder, SetLedger, shown, state  # noqa: F401 (a fixture)
from test_not_ready import knode, pod as review_pod, req

WHOLE = usage.WHOLE_NODE_GPUS


def legacy(p, resource="nvidia.com/gpu", part="limits", init=False):
    c = {"name": "i" if init else "c", "resources": {part: {resource: "1"}}}
    key = "initContainers" if init else "containers"
    p["spec"].setdefault(key, []).append(c)
    return p


# ------------------------------------------------------------ pure rules

@pytest.mark.parametrize("mode, ok", [("refuse", True), ("whole-node", True),
                                      ("whole_node", False), ("", False)])
def test_check_legacy_mode(mode, ok):
    if ok:
        gpus.check_legacy_mode(mode)
    else:
        with pytest.raises(ValueError, match="legacy_gpu must be one of"):
            gpus.check_legacy_mode(mode)


@pytest.mark.parametrize("count, want", [
    (4, (0, 1, 2, 3)),
    (1, (0,)),
    (0, None),       # Slurm counts no GPU there: refused
    (None, None),    # not known: refused
])
def test_whole_node_gpus(count, want):
    got = gpus.whole_node_gpus("default", "p", "n1", ["nvidia.com/gpu"], count)
    if want is None:
        assert isinstance(got, admission.Deny) and got.code == "legacy_gpu"
        assert got.code in admission.DENY_CODES
        assert "every GPU of the node" in got.message and "ResourceClaim" in got.message
    else:
        assert got == want


@pytest.mark.parametrize("view, count", [
    ({"gpus": {"count": 4, "jobs": [], "share": []}}, 4),
    ({"share": {"cpu": 0, "mem": 0}}, 0),                      # known, no gpu GRES
    ({"unknown": True, "gpus": {"count": 0, "share": [1]}}, None),
    (None, None),
    ({"gpus": {"count": "4"}}, None),
    ({"gpus": {"count": True}}, None),
    ({"gpus": {"count": 2, "problem": "no File="}}, 2),
])
def test_view_gpu_count(view, count):
    assert gpus.view_gpu_count(view) == count


V4 = {"gpus": {"count": 4, "jobs": [], "share": []}}


@pytest.mark.parametrize("case, entries, view, previous, want, told", [
    ("nothing whole", {"u": (1, 2), "claim:c": (0, 0, [1])}, None, None,
     {"u": (1, 2), "claim:c": (0, 0, [1])}, True),
    ("count known", {"u": (1, 2, WHOLE), "v": (3, 4)}, V4, None,
     {"u": (1, 2, [0, 1, 2, 3]), "v": (3, 4)}, True),
    ("no GPUs in Slurm", {"u": (1, 2, WHOLE)}, {"share": {}}, None, {"u": (1, 2)}, True),
    ("count unknown, set before", {"u": (5, 6, WHOLE)}, None, {"u": (1, 2, [0, 1])},
     {"u": (5, 6, [0, 1])}, True),
    ("count unknown, never set", {"u": (5, 6, WHOLE)}, None, {"u": (1, 2)},
     {"u": (5, 6)}, False),
    ("count unknown, node unknown", {"u": (5, 6, WHOLE)}, {"unknown": True}, None,
     {"u": (5, 6)}, False),
])
def test_whole_node_entries(case, entries, view, previous, want, told):
    assert gpus.whole_node_entries(entries, view, previous) == (want, told), case


@pytest.mark.parametrize("entries, pods, k8s", [
    ({}, (), ()),
    ({"u": (1, 2, [0, 1]), "claim:c": (0, 0, [3]), "slurm:unheld": (1, 1, [2]), "v": (1, 1)},
     (0, 1), (0, 1, 3)),
    ({"u": (1, 2, WHOLE)}, (), ()),          # never counted before it is put as indices
])
def test_pod_and_kubernetes_indices(entries, pods, k8s):
    assert gpus.pod_indices(entries) == pods
    assert gpus.kubernetes_indices(entries) == k8s


@pytest.mark.parametrize("case, p, names, whole", [
    ("limits", legacy(review_pod(node="n1")), ("nvidia.com/gpu",), True),
    ("requests", legacy(review_pod(node="n1"), part="requests"), ("nvidia.com/gpu",), True),
    ("init container", legacy(review_pod(node="n1"), init=True), ("nvidia.com/gpu",), True),
    ("another resource", legacy(review_pod(node="n1"), "example.com/fpga"),
     ("nvidia.com/gpu",), False),
    ("mode refuse: no names", legacy(review_pod(node="n1")), (), False),
    ("no device", review_pod(node="n1"), ("nvidia.com/gpu",), False),
])
def test_pod_usage_marks_whole_node_pods(case, p, names, whole):
    p["metadata"]["uid"] = "u1"
    pu = usage.pod_usage(p, usage.Exemptions(), names)
    assert pu.whole_gpus is whole, case
    assert usage.pod_entry(pu) == usage.ledger_entry(pu) + ((WHOLE,) if whole else ()), case


@pytest.mark.parametrize("text, mode, resources", [
    ("", "refuse", ()),
    ('legacy_gpu = "whole-node"\n', "whole-node", ("nvidia.com/gpu",)),
    ('legacy-gpu = "whole-node"\nlegacy_gpu_resources = ["a/gpu"]\n', "whole-node", ("a/gpu",)),
])
def test_config(tmp_path, text, mode, resources):
    path = tmp_path / "c.toml"
    path.write_text(text)
    cfg = config.load_config(str(path))
    assert cfg.legacy_gpu == mode
    assert config.whole_node_gpu_resources(cfg) == resources


def test_config_refuses_an_unknown_mode(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('legacy_gpu = "count"\n')
    with pytest.raises(config.ConfigError, match="legacy_gpu must be one of refuse, whole-node"):
        config.load_config(str(path))


# ------------------------------------------------------------ the webhook

def whole_scope(mode="whole-node"):
    s = Scope(config.SyncConfig(legacy_gpu=mode))
    s.replace_slim("nodes", [s.slim("nodes", knode(n)) for n in ("n1", "n2", "k8s-only")])
    s.update(slurm_names=["n1", "n2"])
    return s


@pytest.mark.parametrize("case, ledger, allowed, reserved, says", [
    ("every GPU free", GpuLedger({"ok": True}), True, (0, 1, 2, 3), None),
    ("a job or a claim holds one", GpuLedger(
        {"ok": False, "code": "nofit", "error": "node n1 cannot give GPU(s) [0, 1, 2, 3]: "
         "gpu 0 held by job 7"}), False, (0, 1, 2, 3), "held by job 7"),
    ("Slurm counts none", GpuLedger({"ok": True}, count=None), False, None,
     "every GPU of the node"),
    ("ledger unreachable", GpuLedger({"ok": True}, show_ok=False), False, None,
     "did not answer"),
])
def test_webhook_reserves_every_gpu_of_the_node(case, ledger, allowed, reserved, says):
    p = legacy(review_pod(node="n1"))
    answer = webhook.Admission(kube=None, ledger=ledger, scope=whole_scope()).review(
        {"request": req("CREATE", "pods", "", p)})
    assert answer["response"]["allowed"] is allowed, (case, answer)
    if reserved is None:
        assert [c for c in ledger.calls if c[0] == "reserve"] == [], case
    else:
        assert [c[-1] for c in ledger.calls if c[0] == "reserve"] == [reserved], case
    if says:
        assert says in answer["response"]["status"]["message"], (case, answer)


def test_webhook_in_whole_node_mode_leaves_other_pods_and_nodes_as_they_were():
    ledger = GpuLedger({"ok": True})
    a = webhook.Admission(kube=None, ledger=ledger, scope=whole_scope())
    assert a.review({"request": req("CREATE", "pods", "", review_pod(node="n1"))})[
        "response"]["allowed"]
    assert ledger.calls[-1][-1] == ()                 # no GPU for a pod asking none
    ledger.calls.clear()
    assert a.review({"request": req("CREATE", "pods", "", legacy(review_pod(node="k8s-only")))})[
        "response"]["allowed"]
    assert ledger.calls == []                         # not shared: nothing reserved
    refuse = webhook.Admission(kube=None, ledger=ledger, scope=whole_scope("refuse"))
    answer = refuse.review({"request": req("CREATE", "pods", "", legacy(review_pod(node="n1")))})
    assert answer["response"]["allowed"] is False and ledger.calls == []


# ------------------------------------------------------------ the sync daemon

def reconciler(tmp_path, state, pods):
    from memory_slurm import SlurmWorld, knode as mknode
    from pyk8sres.coordinator import cache as cache_mod, sync
    slurm = SlurmWorld(str(tmp_path), "n1")
    slurm.completing_allocations = lambda: {}
    cfg = config.SyncConfig(ledger_socket="unused", legacy_gpu="whole-node")
    cache = cache_mod.Cache(config.exemptions_of(cfg), cfg.node_key,
                            config.whole_node_gpu_resources(cfg))
    cache.replace("nodes", [mknode("n1")])
    cache.replace("pods", pods)
    led = SetLedger()
    rec = sync.Reconciler(cfg, cache, slurm, ledger=led)
    rec.gpus = state
    return rec, cache, led


def test_sync_holds_every_gpu_of_a_whole_node_pod_until_it_is_gone(tmp_path, state):
    from memory_slurm import pod
    rec, cache, led = reconciler(tmp_path, state, [legacy(pod("a", "n1", "1", "1000Mi")),
                                                   pod("b", "n1", "1", "1000Mi")])
    rec.ledger_nodes = shown([])
    rec.cycle()
    assert led.sets["n1"]["uid-a"] == (1000, 1000 << 20, [0, 1, 2, 3])
    assert led.sets["n1"]["uid-b"] == (1000, 1000 << 20)
    # The pods' holders: rec.last_set is what keep_holders reads.
    assert gpus.pod_indices(rec.last_set["n1"]) == (0, 1, 2, 3)
    # Its containers seen gone: the GPUs go back with its share.
    cache.event("pods", "MODIFIED", legacy(pod("a", "n1", "1", "1000Mi", phase="Succeeded")))
    rec.cycle()
    assert "uid-a" not in led.sets["n1"] and gpus.pod_indices(rec.last_set["n1"]) == ()


def test_a_whole_node_pod_gone_unseen_keeps_its_gpus_while_its_share_is_held(tmp_path, state):
    """Force-deleted, its containers never seen stopping: its share is held
    for its grace period (policy/departures.py), and so are its GPUs."""
    from memory_slurm import pod
    rec, cache, led = reconciler(tmp_path, state, [legacy(pod("a", "n1", "1", "1000Mi"))])
    rec.ledger_nodes = shown([])
    rec.cycle()
    cache.event("pods", "DELETED", legacy(pod("a", "n1", "1", "1000Mi")))
    rec.cycle()
    assert led.sets["n1"]["uid-a"] == (1000, 1000 << 20, [0, 1, 2, 3])
    assert rec.holds.entries("n1") == {"uid-a": (1000, 1000 << 20, WHOLE)}


def test_sync_never_sets_a_whole_node_pod_without_its_gpus(tmp_path, state):
    from memory_slurm import pod
    rec, _, led = reconciler(tmp_path, state, [legacy(pod("a", "n1", "1", "1000Mi"))])
    rec.ledger_nodes = None          # no show answered yet: the count is not known
    rec.cycle()
    assert "n1" not in led.sets      # the ledger keeps what it holds (the reserve's GPUs)
    rec.ledger_nodes = shown([])
    rec.cycle()
    assert led.sets["n1"]["uid-a"][2] == [0, 1, 2, 3]
    rec.ledger_nodes = None          # the show fails later: what was set stands in
    rec.last_set["n1"] = {**rec.last_set["n1"], "x": (1, 1)}   # force a new set
    rec.cycle()
    assert led.sets["n1"]["uid-a"][2] == [0, 1, 2, 3]


def test_holders_hold_the_devices_of_whole_node_pods(monkeypatch, state):
    rec = Recorder(monkeypatch, state)
    h = cgpus.Holders(None, state)
    assert h.sync({"n1": "n1"}, shown([]), {"n1": (0, 1, 2, 3)})
    assert sorted(c[1] for c in rec.calls if c[0] == "create") == [
        f"slurm-gpu-n1-gpu-{i}" for i in range(4)]
    rec.calls.clear()
    assert h.sync({"n1": "n1"}, shown([]), {"n1": ()})       # the pod left
    assert sorted(c[1] for c in rec.calls if c[0] == "delete") == [
        f"slurm-gpu-n1-gpu-{i}" for i in range(4)]


def test_a_restarted_sync_holds_a_vanished_whole_node_pods_gpus(tmp_path, state):
    """The ledger lists a pod entry with GPUs that no bound pod has any
    more (it left while no sync ran): held as a forced delete, GPUs too."""
    rec, _, led = reconciler(tmp_path, state, [])
    led.show = lambda node=None, since=None: {"ok": True, "nodes": {node: {
        "entries": {"uid-z": [1000, 1 << 20, [0, 1, 2, 3]], "claim:c": [0, 0, [1]]}}}}
    rec.ledger_nodes = shown([])
    rec.cycle()
    assert led.sets["n1"]["uid-z"] == (1000, 1 << 20, [0, 1, 2, 3])


def test_whole_node_wanted():
    wanted = {"n1": {"u": (1, 2, WHOLE)}, "n2": {"v": (1, 2, WHOLE)}, "n3": {"w": (1, 2)}}
    got, blind = gpus.whole_node_wanted(wanted, {"n1": V4}, {})
    assert got == {"n1": {"u": (1, 2, [0, 1, 2, 3])}, "n2": {"v": (1, 2)}, "n3": {"w": (1, 2)}}
    assert blind == {"n2"}
