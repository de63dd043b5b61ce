"""GPU rules (pyk8sres/policy/gpus.py): the identity mapping and its
fences, the decision on a claim's allocation, the legacy refusal, the
holder claims and the sync daemon's claim entries."""
import pytest

from pyk8sres.policy import admission, gpus
from pyk8sres.testbed import gpus as fake

ID = gpus.Identity()


def dev(name, index=None, uuid=None):
    attrs = {}
    if index is not None:
        attrs["index"] = {"int": index}
    if uuid is not None:
        attrs["uuid"] = {"string": uuid}
    return {"name": name, "attributes": attrs}


def slice_of(node, devices, driver="gpu.nvidia.com", generation=1, pool=None):
    return {"spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool or node, "generation": generation},
                     "devices": devices}}


UUIDS = ["GPU-a", "GPU-b"]


@pytest.mark.parametrize("ident,device,want", [
    (ID, dev("gpu-0", 0), 0),
    (ID, dev("gpu-7", 3), 3),                      # the attribute wins over the name
    (ID, dev("gpu-0"), None),                       # no attribute
    (ID, {"name": "g", "attributes": {"index": {"string": "0"}}}, None),
    (ID, {"name": "g", "attributes": {"index": {"int": -1}}}, None),
    (gpus.Identity(attribute="minor"), {"name": "g", "attributes": {"minor": {"int": 2}}}, 2),
    (gpus.Identity(mode="name"), dev("gpu-12"), 12),
    (gpus.Identity(mode="name"), dev("gpu-x"), None),
    (gpus.Identity(mode="name"), dev("mig-1g.5gb-0"), None),
    (gpus.Identity(mode="uuid", uuids={"s1": UUIDS}), dev("x", uuid="GPU-b"), 1),
    (gpus.Identity(mode="uuid", uuids={"s1": UUIDS}), dev("x", uuid="GPU-z"), None),
    (gpus.Identity(mode="uuid", uuids={}), dev("x", uuid="GPU-a"), None),
])
def test_device_index(ident, device, want):
    assert gpus.device_index(device, ident, "s1") == want


@pytest.mark.parametrize("ident", [
    gpus.Identity(mode="serial"), gpus.Identity(mode="name", pattern="gpu-\\d+"),
    gpus.Identity(mode="name", pattern="(gpu"), gpus.Identity(mode="uuid", uuids={"n": "GPU-a"}),
])
def test_bad_identity_refused(ident):
    with pytest.raises(ValueError):
        gpus.check_identity(ident)


FOUR = [slice_of("n1", [dev(f"gpu-{i}", i) for i in range(4)])]


@pytest.mark.parametrize("slices,count,fence", [
    (FOUR, 4, None),
    ([fake.resource_slice("n1", 4)], 4, None),      # what the test cluster publishes
    (FOUR, 2, "4 devices published for node n1, Slurm node s1 has 2 GPUs"),
    (FOUR, None, "Slurm's gpu count of node s1 is not known"),
    ([slice_of("n1", [dev("gpu-0", 0), dev("gpu-1")])], 2, "device gpu-1 (pool n1) maps to no"),
    ([slice_of("n1", [dev("gpu-0", 0), dev("gpu-1", 0)])], 2, "maps to index 0, as another"),
    ([slice_of("n1", [dev("gpu-0", 0), dev("gpu-1", 5)])], 2, "indices [5] are beyond"),
    # another node's, another driver's and an older generation's devices do not count
    (FOUR + [slice_of("n2", [dev("gpu-9", 9)]), slice_of("n1", [dev("x", 8)], driver="other"),
             slice_of("n1", [dev("old", 6)], generation=0)], 4, None),
])
def test_node_gpus_fences_any_mismatch(slices, count, fence):
    g = gpus.node_gpus(slices, "n1", "s1", count, ID)
    assert (g.fence is None) if fence is None else (fence in g.fence), g.fence
    if fence is None:
        assert sorted(g.index.values()) == list(range(count))


def test_node_without_slices_is_not_fenced():
    assert gpus.node_gpus([], "n1", "s1", 4, ID) == gpus.NodeGpus({}, ())


NODE_SEL = {"nodeSelectorTerms": [{"matchFields": [
    {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}


def claim(uid="u1", devices=("gpu-2", "gpu-3"), node_sel=NODE_SEL, ns="default", labels=None,
          driver="gpu.nvidia.com"):
    alloc = {"devices": {"results": [{"request": "gpu", "driver": driver, "pool": "n1",
                                      "device": d} for d in devices]}}
    if node_sel is not None:
        alloc["nodeSelector"] = node_sel
    return {"metadata": {"name": "c", "namespace": ns, "uid": uid, "labels": labels or {}},
            "status": {"allocation": alloc} if devices else {}}


def review(new, old=None, dry=False):
    return {"operation": "UPDATE", "resource": {"resource": "resourceclaims"},
            "subResource": "status", "namespace": "default", "name": "c", "dryRun": dry,
            "object": new, "oldObject": old or {"metadata": new["metadata"], "status": {}}}


NODE = gpus.node_gpus(FOUR, "n1", "s1", 4, ID)
FENCED = gpus.node_gpus(FOUR, "n1", "s1", 2, ID)


@pytest.mark.parametrize("request_,slurm_node,node,want", [
    (review(claim()), "s1", NODE, gpus.GpuReserve("s1", "claim:u1", (2, 3))),
    (review(claim()), None, NODE, "not_shared"),
    (review(claim()), "s1", FENCED, "gpus_fenced"),
    (review(claim()), "s1", None, "internal"),                  # slices unreadable
    (review(claim(devices=("gpu-9",))), "s1", NODE, "bad_request"),
    (review(claim(node_sel=None)), "s1", NODE, "bad_request"),   # no node named
    (review(claim(uid="")), "s1", NODE, "bad_request"),
    (review(claim(), dry=True), "s1", NODE, "dry_run"),
    # not allocations of ours: allowed without the ledger
    (review(claim(devices=())), "s1", NODE, "not_checked"),          # deallocation
    (review(claim(), old=claim()), "s1", NODE, "not_checked"),       # already allocated
    (review(claim(driver="other")), "s1", NODE, "not_checked"),
    (review(claim(ns="pyk8sres-placeholders", labels={gpus.HOLDER_LABEL: "n1"})), "s1", NODE,
     "exempt"),
    # a holder label outside the coordinator's namespace counts for nothing
    (review(claim(labels={gpus.HOLDER_LABEL: "n1"})), "s1", NODE,
     gpus.GpuReserve("s1", "claim:u1", (2, 3))),
])
def test_claim_decisions(request_, slurm_node, node, want):
    t = gpus.classify_claim(request_, ID, "pyk8sres-placeholders")
    d = gpus.claim_plan(t, slurm_node, node) if isinstance(t, gpus.ClaimTarget) else t
    if isinstance(want, gpus.GpuReserve):
        assert d == want
    else:
        assert d.code == want, d
        codes = admission.ALLOW_CODES if isinstance(d, admission.Allow) else admission.DENY_CODES
        assert d.code in codes


def test_sharing_unknown_fails_closed():
    t = gpus.classify_claim(review(claim()), ID, "x")
    assert gpus.claim_plan(t, None, None, unknown="workers not listed").code == "workers_unknown"


@pytest.mark.parametrize("reply,allowed,code", [
    ({"ok": True}, True, "reserved"),
    ({"ok": False, "code": "nofit", "error": "gpu 2 held by job 7"}, False, "nofit"),
    ({"ok": False, "code": "notready", "error": "replaying"}, False, "ledger_not_ready"),
    ({"ok": False, "code": "unknown_node"}, False, "ledger_refused"),
    ({}, False, "internal"),
])
def test_claim_verdict(reply, allowed, code):
    t = gpus.classify_claim(review(claim()), ID, "x")
    d = gpus.claim_verdict(t, gpus.GpuReserve("s1", "claim:u1", (2, 3)), reply)
    assert isinstance(d, admission.Allow) == allowed and d.code == code
    if not allowed:
        assert "GPU 2,3 of Slurm node s1" in d.message


@pytest.mark.parametrize("resources,want", [
    ({"limits": {"nvidia.com/gpu": "1"}}, ["nvidia.com/gpu"]),
    ({"requests": {"cpu": "1", "nvidia.com/gpu": "2"}}, ["nvidia.com/gpu"]),
    ({"requests": {"cpu": "1"}, "claims": [{"name": "gpu"}]}, []),
    ({}, []),
])
def test_legacy_requests(resources, want):
    pod = {"spec": {"containers": [{"name": "c", "resources": resources}]}}
    assert gpus.legacy_requests(pod) == want
    init = {"spec": {"containers": [], "initContainers": [{"resources": resources}]}}
    assert gpus.legacy_requests(init) == want


def test_legacy_refusal_says_what_to_do():
    d = gpus.legacy_refusal("default", "p", "n1", ["nvidia.com/gpu"])
    assert d.code == "legacy_gpu" and "ResourceClaim" in d.message and d.code in admission.DENY_CODES


def test_holder_claim_is_one_allocated_device_reserved_for_nobody():
    c, status = gpus.holder_claim("ns", "n1", "n1", "gpu-0", ID)
    assert c["metadata"] == {"name": "slurm-gpu-n1-gpu-0", "namespace": "ns",
                             "labels": {gpus.HOLDER_LABEL: "n1"}}
    req = c["spec"]["devices"]["requests"]
    assert req == [{"name": "slurm", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}]
    assert status["allocation"]["devices"]["results"] == [
        {"request": "slurm", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]
    assert gpus.allocation_node(status["allocation"]) == "n1"
    assert "reservedFor" not in status
    assert len(gpus.holder_name("n" * 300, "gpu-0")) <= 253


def test_wanted_holders_and_changes():
    shared = {"s1": "n1", "s2": "n2"}
    nodes = {"n1": NODE, "n2": gpus.node_gpus([slice_of("n2", [dev("gpu-0", 0), dev("gpu-1")])],
                                               "n2", "s2", 2, ID)}
    want = gpus.wanted_holders({"s1": [0, 1], "s2": []}, shared, nodes)
    # Slurm's devices on n1; every device of the fenced n2
    assert want == {"slurm-gpu-n1-gpu-0": ("n1", "n1", "gpu-0"),
                    "slurm-gpu-n1-gpu-1": ("n1", "n1", "gpu-1"),
                    "slurm-gpu-n2-gpu-0": ("n2", "n2", "gpu-0"),
                    "slurm-gpu-n2-gpu-1": ("n2", "n2", "gpu-1")}
    have = {}
    for name in ("slurm-gpu-n1-gpu-1", "slurm-gpu-n1-gpu-3"):
        c, status = gpus.holder_claim("ns", "n1", "n1", name.rsplit("-", 2)[1] + "-" +
                                      name.rsplit("-", 1)[1], ID)
        have[name] = {**c, "status": status}
    unallocated, _ = gpus.holder_claim("ns", "n2", "n2", "gpu-0", ID)
    have["slurm-gpu-n2-gpu-0"] = unallocated                     # its status write failed
    create, delete = gpus.holder_changes(want, have, ID)
    assert create == ["slurm-gpu-n1-gpu-0", "slurm-gpu-n2-gpu-0", "slurm-gpu-n2-gpu-1"]
    assert delete == ["slurm-gpu-n1-gpu-3", "slurm-gpu-n2-gpu-0"]


def test_claim_entries_count_allocated_claims_on_shared_nodes():
    holder = {**gpus.holder_claim("ph", "n1", "n1", "gpu-0", ID)[0],
              "status": gpus.holder_claim("ph", "n1", "n1", "gpu-0", ID)[1]}
    holder["metadata"]["uid"] = "h"
    other_node = claim(uid="u3", node_sel={"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["n9"]}]}]})
    claims = [claim(), claim(uid="u2", devices=()), claim(uid="u4", devices=("gpu-9",)),
              other_node, holder]
    out, warnings = gpus.claim_entries(claims, {"n1": NODE}, {"n1": "s1"}, ID, "ph")
    assert out == {"s1": {"claim:u1": (0, 0, [2, 3])}}
    assert len(warnings) == 1 and "maps to no Slurm GPU index" in warnings[0]


def test_a_problem_slurm_reports_fences_the_node():
    g = gpus.node_gpus(FOUR, "n1", "s1", 4, ID, "gres.conf has no File= for gpu")
    assert "gres.conf has no File=" in g.fence


def bare_claim(namespace="default", allocated=False, holder=False):
    labels = {gpus.HOLDER_LABEL: "k1"} if holder else {}
    return {"metadata": {"name": "c", "namespace": namespace, "labels": labels},
            "status": {"allocation": {"devices": {"results": []}}} if allocated else {}}


JOBS_HOLD = {"n1": {"gpus": {"count": 4, "jobs": [0]}}}
NO_JOBS = {"n1": {"gpus": {"count": 4, "jobs": []}}, "n2": {}}


@pytest.mark.parametrize("claims,nodes,want", [
    ([], JOBS_HOLD, 1.0),                                           # nothing waits
    ([bare_claim(allocated=True)], JOBS_HOLD, 1.0),                      # allocated: runs
    ([bare_claim("holders", holder=True)], JOBS_HOLD, 1.0),              # a holder never waits
    ([bare_claim()], NO_JOBS, 1.0),                                      # no job holds a GPU
    ([bare_claim()], None, 1.0),                                         # no ledger view
    ([bare_claim()], JOBS_HOLD, gpus.WAITING_POLL_SECONDS),              # a pod waits on jobs
    ([bare_claim(allocated=True), bare_claim()], JOBS_HOLD, gpus.WAITING_POLL_SECONDS),
])
def test_slurm_is_read_often_only_while_a_claim_waits_on_jobs_gpus(claims, nodes, want):
    assert gpus.poll_period(1.0, claims, "holders", nodes) == want


def test_a_shorter_period_stays():
    assert gpus.poll_period(0.1, [bare_claim()], "holders", JOBS_HOLD) == 0.1
