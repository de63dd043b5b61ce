"""The GPU column of `kubectl get genericnode` (status.gpus): the pure
formatting (policy/gpus.py), and the sync daemon writing it in the same
write as the rest of the status, Slurm's side from the ledger's `show`,
the pods' from the claims' entries it set in the ledger."""
import pytest

from memory_slurm import SlurmWorld, knode
from pyk8sres.coordinator import cache as cache_mod, config, sync
from pyk8sres.policy import gpus, usage
from test_generic_nodes import GenericNodeStore
from test_gpu_holders import CLAIM, SetLedger, shown, state  # noqa: F401 (a fixture)


@pytest.mark.parametrize("indices, text", [
    ([], "-"),
    ([0], "0"),
    ([0, 1], "0-1"),
    ([3, 0, 1], "0-1,3"),
    ([0, 2, 4], "0,2,4"),
    ([1, 1, 2, 5, 6, 7], "1-2,5-7"),
])
def test_index_ranges(indices, text):
    assert gpus.index_ranges(indices) == text


@pytest.mark.parametrize("count, slurm, k8s, summary", [
    (4, [], [], "slurm:- k8s:- free:0-3"),
    (4, [0, 1], [2], "slurm:0-1 k8s:2 free:3"),
    (4, [0, 1], [2, 3], "slurm:0-1 k8s:2-3 free:-"),
    (8, [7, 0], [3, 4, 5], "slurm:0,7 k8s:3-5 free:1-2,6"),
    (2, [0], [0], "slurm:0 k8s:0 free:1"),     # an overlap shows as such, never hidden
    (0, [], [], "slurm:- k8s:- free:-"),
])
def test_generic_node_gpus(count, slurm, k8s, summary):
    g = gpus.generic_node_gpus(count, slurm, k8s)
    assert g == {"count": count, "slurm": sorted(set(slurm)), "kubernetes": sorted(set(k8s)),
                 "summary": summary}


@pytest.mark.parametrize("entries, indices", [
    ({}, ()),
    ({"pod-uid": (1000, 1 << 20)}, ()),
    ({"claim:a": (0, 0, [3]), "claim:b": (0, 0, [1, 0]), "pod": (5, 5)}, (0, 1, 3)),
    ({"claim:a": (0, 0, [])}, ()),
])
def test_claim_indices(entries, indices):
    assert gpus.claim_indices(entries) == indices


def test_generic_node_body_has_gpus_only_on_a_node_with_gpus():
    from memory_slurm import SNode
    _, plain = usage.generic_node_body("k", SNode(), None, "c1")
    assert "gpus" not in plain
    _, with_gpus = usage.generic_node_body("k", SNode(), None, "c1",
                                           gpus=gpus.generic_node_gpus(4, (1,), (0, 2)))
    assert with_gpus["gpus"]["summary"] == "slurm:1 k8s:0,2 free:3"
    assert with_gpus["allocatedResources"] == plain["allocatedResources"]


def test_the_generic_node_shows_which_gpus_each_side_holds(tmp_path, state):  # noqa: F811
    """One write per change carries the GPUs with the rest of the status:
    Slurm's jobs' indices as the ledger shows them, the claims' as set in
    the ledger; kept while the ledger does not answer."""
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    slurm.completing_allocations = lambda: ({}, {})
    cfg = config.SyncConfig(ledger_socket="unused", generic_node_min_interval_seconds=0)
    cache = cache_mod.Cache(config.exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("n2")])
    cache.replace("pods", [])
    store, led = GenericNodeStore(), SetLedger()
    rec = sync.Reconciler(cfg, cache, slurm, kube=store, ledger=led)
    rec.cluster = "c1"
    rec.gpus, rec.ledger_nodes = state, shown([0, 1])
    state.event("resourceclaims", "ADDED", CLAIM)      # gpu-3 on n1
    rec.cycle()

    def gpu_status(node):
        return store.objects[node]["status"].get("gpus")

    assert gpu_status("n1") == {"count": 4, "slurm": [0, 1], "kubernetes": [3],
                                "summary": "slurm:0-1 k8s:3 free:2"}
    assert gpu_status("n2") is None                    # no GPUs in Slurm: no column
    assert store.writes == ["n1", "n2"]                # created with it: no write of its own
    # The job leaves (the ledger's show), the claim goes: one write each.
    rec.ledger_nodes = shown([])
    rec.cycle()
    assert gpu_status("n1")["summary"] == "slurm:- k8s:3 free:0-2"
    state.event("resourceclaims", "DELETED", CLAIM)
    rec.cycle()
    assert gpu_status("n1")["summary"] == "slurm:- k8s:- free:0-3"
    assert store.writes == ["n1", "n2", "n1", "n1"]
    # The ledger does not answer: what was shown stays.
    rec.ledger_nodes = None
    rec.cycle()
    assert gpu_status("n1")["summary"] == "slurm:- k8s:- free:0-3"
    assert len(store.writes) == 4
