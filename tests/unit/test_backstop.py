"""The backstop's rules (policy/backstop.py) and the sync daemon holding
them in a real ledger (in-process, memory_slurm.SlurmWorld)."""
import dataclasses

import pytest

from pyk8sres.coordinator import cache as cache_mod, config, sync
from pyk8sres.policy import backstop
from memory_slurm import SlurmWorld, knode, pod


@pytest.mark.parametrize("alloc, jobs, completing, want", [
    ((4, 4000), {"cpu": 4, "mem": 4000}, (0, 0), backstop.Gap()),       # jobs hold it all
    ((4, 4000), {"cpu": 6, "mem": 5000}, (0, 0), backstop.Gap()),       # more held than allocated
    ((4, 4000), {"cpu": 1, "mem": 4000}, (0, 0), backstop.Gap(3, 0)),   # a job under-held
    ((2, 8000), {"cpu": 2, "mem": 1000}, (0, 0), backstop.Gap(0, 7000)),
    ((0, 0), {"cpu": 0, "mem": 0}, (2, 1000), backstop.Gap(0, 0, 2, 1000)),  # a job completing
    ((3, 100), {"cpu": 1, "mem": 100}, (2, 50), backstop.Gap(2, 0, 2, 50)),
])
def test_gap_table(alloc, jobs, completing, want):
    assert backstop.gap(*alloc, jobs, completing) == want


@pytest.mark.parametrize("jobs", [None, {}, {"cpu": 1}])
def test_no_count_of_the_jobs_is_no_gap(jobs):
    assert backstop.gap(4, 4000, jobs) is None


@pytest.mark.parametrize("gap, want", [
    (None, None), (backstop.Gap(), None), (backstop.Gap(1, 0), (1000, 0)),
    (backstop.Gap(0, 10, 2, 5), (2000, 15 << 20)),
])
def test_entry_table(gap, want):
    assert backstop.entry(gap) == want


@pytest.mark.parametrize("text, want", [("0", 1), ("0-3", 4), ("0-3,6", 5), ("1,3,5-6", 4)])
def test_cpu_ids_count(text, want):
    assert backstop.cpu_ids_count(text) == want


@pytest.mark.parametrize("text", ["x", "0-", "²", "1-b"])
def test_cpu_ids_refused(text):
    with pytest.raises(ValueError):
        backstop.cpu_ids_count(text)


def test_completing_per_node_sums_only_completing_jobs():
    jobs = [("COMPLETING", [(["n1", "n2"], 2, 1000)]),
            ("RUNNING", [(["n1"], 4, 4000)]),
            ("COMPLETING", [(["n1"], 1, 10), (["n3"], 3, 30)])]
    assert backstop.completing_per_node(jobs) == {"n1": (3, 1010), "n2": (2, 1000), "n3": (3, 30)}


# ----------------------------------------------------------------- in the sync loop

@pytest.fixture
def world(tmp_path):
    slurm = SlurmWorld(str(tmp_path), "n1", "n2")
    slurm.completing = {}
    slurm.completing_gpus = {}
    slurm.completing_allocations = lambda: (dict(slurm.completing), dict(slurm.completing_gpus))
    cfg = config.SyncConfig(ledger_socket="unused")
    cache = cache_mod.Cache(config.exemptions_of(cfg), cfg.node_key)
    cache.replace("nodes", [knode("n1"), knode("n2")])
    cache.replace("pods", [pod("a", "n1", "1", "1000Mi")])
    rec = sync.Reconciler(cfg, cache, slurm, ledger=slurm.ledger)
    seen = []
    rec.backstop.emit = lambda *a: seen.append(a)
    return slurm, rec, seen


def _slurm_side(slurm, rec, name, **fields):
    slurm.nodes[name] = dataclasses.replace(slurm.nodes[name], **fields)
    rec.ledger_nodes = slurm.ledger.show()["nodes"]


def test_what_jobs_do_not_hold_is_held_from_pods(world):
    slurm, rec, seen = world
    # A job allocated 3 CPUs and 2000 MB holds k8scpu:1, k8smemory:2000.
    _slurm_side(slurm, rec, "n1", alloc_cpus=3, alloc_memory=2000,
                gres_used={"k8scpu": 1, "k8smemory": 2000})
    rec.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (2000, 0)
    assert slurm.counts("n1") == (4 - 1 - 2, 8000 - 1000)   # pods see 1 CPU left, not 3
    assert [s[:2] for s in seen] == [("n1", "SlurmAllocationUnheld")]
    assert "2 CPUs and 0 MB on node n1" in seen[0][2]
    # A pod that needs 2 CPUs no longer fits n1.
    reply = slurm.ledger.reserve("n1", "uid-big", 2000, 1 << 20)
    assert not reply["ok"], reply
    # The job ends: the entry goes, nothing more is said.
    _slurm_side(slurm, rec, "n1", alloc_cpus=0, alloc_memory=0, gres_used={})
    rec.cycle()
    assert backstop.KEY not in slurm.core.nodes["n1"] and len(seen) == 1
    assert slurm.ledger.reserve("n1", "uid-big", 2000, 1 << 20)["ok"]


def test_a_completing_job_is_held_until_it_is_gone(world):
    slurm, rec, seen = world
    slurm.completing = {"n2": (2, 500)}
    _slurm_side(slurm, rec, "n2", state="IDLE+COMPLETING")
    rec.cycle()
    assert slurm.core.nodes["n2"][backstop.KEY][:2] == (2000, 500 << 20)
    assert seen == []                       # completing is normal: no Event
    slurm.completing = {}
    _slurm_side(slurm, rec, "n2", state="IDLE")
    rec.cycle()
    assert backstop.KEY not in slurm.core.nodes.get("n2", {})


def test_a_completing_jobs_gpus_are_held_until_it_is_gone(world):
    """Slurm frees a completing job's GPUs at once; its processes may still
    use them: held in the same entry (the webhook refuses them, holder
    claims steer kube-scheduler away), gone with the job."""
    slurm, rec, _ = world
    slurm.completing = {"n2": (1, 100)}
    slurm.completing_gpus = {"n2": frozenset({0, 1})}
    _slurm_side(slurm, rec, "n2", state="IDLE+COMPLETING")
    rec.cycle()
    assert slurm.core.nodes["n2"][backstop.KEY].gpus == (0, 1)
    slurm.completing, slurm.completing_gpus = {}, {}
    _slurm_side(slurm, rec, "n2", state="IDLE")
    rec.cycle()
    assert backstop.KEY not in slurm.core.nodes.get("n2", {})


@pytest.mark.parametrize("jobs, want", [
    ([("COMPLETING", [(["n1", "n2"], [0, 1])]), ("RUNNING", [(["n1"], [2])])],
     {"n1": {0, 1}, "n2": {0, 1}}),
    ([("COMPLETING", [(["n1"], [0])]), ("COMPLETING", [(["n1"], [3]), (["n2"], [])])],
     {"n1": {0, 3}}),
    ([], {}),
])
def test_completing_gpus_per_node(jobs, want):
    assert backstop.completing_gpus_per_node(jobs) == want


@pytest.mark.parametrize("held, completing, jobs_hold, want", [
    (None, (), (), None),
    ((1000, 5), (), (), (1000, 5)),
    (None, (1, 0), (), (0, 0, [0, 1])),
    ((1000, 5), (0, 1), (1,), (1000, 5, [0])),       # 1 given to a job since: its own
    ((1000, 5), (1,), (1,), (1000, 5)),
])
def test_with_gpus(held, completing, jobs_hold, want):
    assert backstop.with_gpus(held, completing, jobs_hold) == want


@pytest.mark.parametrize("text, want", [
    ("0", [0]), ("0-1", [0, 1]), ("0-1,3", [0, 1, 3]), ("x", []), ("1-", []), ("", []),
])
def test_gpu_indices(text, want):
    assert backstop.gpu_indices(text) == want


def test_completing_allocations_reads_cpus_memory_and_gpus(monkeypatch):
    from pyk8sres.coordinator import slurm as slurm_calls
    lines = [
        "JobId=7 JobState=COMPLETING Nodes=n1 CPU_IDs=0-1 Mem=100 "
        "GRES=gpu:2(IDX:0-1),k8scpu(CNT:2),k8smemory(CNT:100)",
        "JobId=8 JobState=COMPLETING Nodes=n[1-2] CPU_IDs=2 Mem=10 GRES=gpu:a100:1(IDX:3)",
        "JobId=9 JobState=RUNNING Nodes=n2 CPU_IDs=0 Mem=10 GRES=gpu:1(IDX:0)",
        "JobId=10 JobState=COMPLETING Nodes=n3 CPU_IDs=0 Mem=10"]
    monkeypatch.setattr(slurm_calls, "run", lambda *a, **k: "\n".join(lines))
    alloc, gpus = slurm_calls.completing_allocations()
    assert alloc == {"n1": (3, 110), "n2": (1, 10), "n3": (1, 10)}
    assert gpus == {"n1": {0, 1, 3}, "n2": {3}}


def test_without_the_ledgers_count_the_last_gap_is_kept(world):
    slurm, rec, seen = world
    _slurm_side(slurm, rec, "n1", alloc_cpus=2, gres_used={"k8scpu": 0})
    rec.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (2000, 0)
    rec.ledger_nodes = None                  # the poller's show failed
    slurm.nodes["n1"] = dataclasses.replace(slurm.nodes["n1"], alloc_cpus=0)
    rec.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (2000, 0)


def test_a_failed_read_of_completing_jobs_keeps_the_last(world):
    slurm, rec, seen = world
    slurm.completing = {"n1": (1, 0)}
    _slurm_side(slurm, rec, "n1", state="MIXED+COMPLETING")
    rec.cycle()

    def broken():
        raise RuntimeError("slurmctld down")
    slurm.completing_allocations = broken
    rec.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (1000, 0)


# ----------------------------------------------------------------- newly mapped nodes

def test_a_node_newly_mapped_while_its_pods_cannot_be_counted_is_held_whole(world):
    """A Kubernetes node gains its mapping (a label) while the pods watch is
    broken: its pods may run there already, so no job may start on the Slurm
    node until they are counted; then it holds exactly its pods."""
    slurm, rec, seen = world
    slurm.nodes["n3"] = dataclasses.replace(slurm.nodes["n1"], name="n3")
    rec.cycle()
    assert slurm.counts("n3") == (4, 8000)               # unmapped: nothing held
    rec.cache.health("pods", False)
    rec.cache.event("nodes", "ADDED", knode("k8s-c", **{rec.cfg.node_key: "n3"}))
    rec.cycle()
    assert slurm.counts("n3") == (0, 0)                  # fenced: all of it held
    assert set(slurm.core.nodes["n3"]) == {backstop.FENCE_KEY}
    rec.cache.event("pods", "ADDED", pod("c", "k8s-c", "2", "1000Mi"))
    rec.cache.health("pods", True)
    rec.cycle()
    assert slurm.counts("n3") == (2, 7000)               # its pod, counted
    assert backstop.FENCE_KEY not in slurm.core.nodes["n3"]


def test_a_node_mapped_when_the_daemon_starts_is_not_fenced(world):
    slurm, rec, seen = world
    slurm.nodes["n3"] = dataclasses.replace(slurm.nodes["n1"], name="n3")
    rec.cache.health("pods", False)
    rec.cache.event("nodes", "ADDED", knode("k8s-c", **{rec.cfg.node_key: "n3"}))
    rec.cycle()       # the first cycle: the ledger keeps what it held
    assert slurm.counts("n3") == (4, 8000)


@pytest.mark.parametrize("gres, want", [
    ({"k8scpu": 4, "k8smemory": 8000}, (4000, 8000 << 20)), ({}, None)])
def test_fence_table(gres, want):
    node = type("N", (), {"gres": gres})()
    assert backstop.fence(node) == want and backstop.fence(None) is None


def test_a_restarted_daemon_keeps_the_entry_until_it_can_compute_it(world):
    slurm, rec, seen = world
    _slurm_side(slurm, rec, "n1", alloc_cpus=3, gres_used={"k8scpu": 0})
    rec.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (3000, 0)
    # A new daemon, before its poller has read the ledger's counts.
    again = sync.Reconciler(rec.cfg, rec.cache, slurm, ledger=slurm.ledger)
    again.cycle()
    assert slurm.core.nodes["n1"][backstop.KEY][:2] == (3000, 0)
    # Once it can: the job has ended meanwhile, the entry goes.
    _slurm_side(slurm, again, "n1", alloc_cpus=0, gres_used={})
    again.cycle()
    assert backstop.KEY not in slurm.core.nodes["n1"]
