"""Table-driven tests of the pure sync policy in pyk8sres.policy.usage and
pyk8sres.policy.quantities."""

from fractions import Fraction

import pytest

from memory_slurm import SNode
from pyk8sres.policy import quantities, usage

MI = 1024 * 1024


def N(*cores):
    """cores -> nanocores, the unit PodUsage/NodeUsage use."""
    return int(Fraction(*cores) * 10**9)


# ---------------------------------------------------------------- quantities

@pytest.mark.parametrize("text,value", [
    ("1735m", Fraction(1735, 1000)),
    ("2393Mi", Fraction(2393 * MI)),
    ("1.5Gi", Fraction(3, 2) * 2**30),
    ("1e3", Fraction(1000)),
    ("1E3", Fraction(1000)),
    ("1e-3", Fraction(1, 1000)),
    ("100k", Fraction(100_000)),
    ("0.5", Fraction(1, 2)),
    (".5", Fraction(1, 2)),
    ("1.", Fraction(1)),
    ("0", Fraction(0)),
    ("4", Fraction(4)),
    ("4000Mi", Fraction(4000 * MI)),
    ("128974848", Fraction(128974848)),
    ("129e6", Fraction(129_000_000)),
    ("123Mi", Fraction(123 * MI)),
    ("1Ki", Fraction(1024)),
    ("5G", Fraction(5 * 10**9)),
    ("250u", Fraction(250, 10**6)),
    ("100n", Fraction(100, 10**9)),
    ("  2 ", Fraction(2)),
    (3, Fraction(3)),
    ("0.1", Fraction(1, 10)),          # exact, no float rounding
])
def test_parse_quantity(text, value):
    assert quantities.parse_quantity(text) == value


@pytest.mark.parametrize("text", [
    "", "abc", "1.5.5", "1x", "Mi", "1 Mi", "1mi", "1KI", "--1", "1e", "1e3Mi",
    None, 1.5, True, {}, "1e9999",
])
def test_parse_quantity_rejects(text):
    with pytest.raises(quantities.QuantityError):
        quantities.parse_quantity(text)


def test_negative_request_rejected():
    assert quantities.parse_quantity("-1") == -1
    with pytest.raises(quantities.QuantityError):
        quantities.request_quantity("-1")


@pytest.mark.parametrize("cores,text", [
    (Fraction(0), "0"), (Fraction(3), "3"), (Fraction(2735, 1000), "2735m"),
    (Fraction(1, 2), "500m"),
    (Fraction(1, 3000), "1m"),  # below a millicore rounds up, never hides usage
])
def test_format_cpu(cores, text):
    assert quantities.format_cpu(cores) == text


@pytest.mark.parametrize("nbytes,text", [
    (Fraction(0), "0"), (Fraction(4000 * MI), "4000Mi"), (Fraction(3417 * MI), "3417Mi"),
    (Fraction(1536 * 1024), "1536Ki"), (Fraction(1000), "1000"), (Fraction(1, 2), "1"),
])
def test_format_memory(nbytes, text):
    assert quantities.format_memory(nbytes) == text


# ---------------------------------------------------------------- pod requests

def ctr(cpu=None, mem=None, restart=None, limits=None, name="c"):
    c = {"name": name, "resources": {}}
    req = {}
    if cpu is not None:
        req["cpu"] = cpu
    if mem is not None:
        req["memory"] = mem
    if req:
        c["resources"]["requests"] = req
    if limits:
        c["resources"]["limits"] = limits
    if restart:
        c["restartPolicy"] = restart
    return c


def pod(containers=(), init=(), overhead=None, node="n1", phase="Running",
        labels=None, pod_resources=None, name="p", namespace="default", sa=None,
        annotations=None):
    spec = {"containers": list(containers)}
    if sa:
        spec["serviceAccountName"] = sa
    if init:
        spec["initContainers"] = list(init)
    if overhead:
        spec["overhead"] = overhead
    if pod_resources:
        spec["resources"] = pod_resources
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": spec, "status": {"phase": phase}}


@pytest.mark.parametrize("case,p,cpu,mem", [
    ("empty", pod(), "0", "0"),
    ("one container", pod([ctr("1735m", "2393Mi")]), "1735m", "2393Mi"),
    ("app sum", pod([ctr("1", "1Gi"), ctr("500m", "512Mi")]), "1500m", "1536Mi"),
    ("init bigger than apps", pod([ctr("1", "1Gi")], init=[ctr("2", "100Mi")]),
     "2", "1Gi"),
    ("largest init, not the sum",
     pod([ctr("100m")], init=[ctr("2"), ctr("3"), ctr("1")]), "3", "0"),
    ("overhead added", pod([ctr("1", "1Gi")], overhead={"cpu": "250m", "memory": "120Mi"}),
     "1250m", "1144Mi"),
    ("overhead on top of init max",
     pod([ctr("1")], init=[ctr("2")], overhead={"cpu": "100m"}), "2100m", "0"),
    ("sidecar adds to apps", pod([ctr("1", "1Gi")], init=[ctr("500m", "256Mi", "Always")]),
     "1500m", "1280Mi"),
    ("sidecar before init adds to it",
     pod([ctr("100m")], init=[ctr("1", None, "Always"), ctr("2")]), "3", "0"),
    ("sidecar after init does not add to it",
     pod([ctr("100m")], init=[ctr("2"), ctr("1", None, "Always")]), "2", "0"),
    ("two sidecars then init",
     pod([ctr("1")], init=[ctr("1", None, "Always"), ctr("1", None, "Always"), ctr("1")]),
     "3", "0"),
    ("limits default requests", pod([ctr(limits={"cpu": "2", "memory": "1Gi"})]), "2", "1Gi"),
    ("request wins over limit", pod([ctr("1", limits={"cpu": "2"})]), "1", "0"),
    ("pod-level requests replace container sum",
     pod([ctr("1", "1Gi"), ctr("1", "1Gi")], pod_resources={"requests": {"cpu": "3"}}),
     "3", "2Gi"),
    ("exact decimal", pod([ctr("0.1"), ctr("0.2")]), "300m", "0"),
])
def test_pod_requests(case, p, cpu, mem):
    r = quantities.pod_requests(p)
    assert r["cpu"] == quantities.parse_quantity(cpu), case
    assert r["memory"] == quantities.parse_quantity(mem), case


def reported(p, *statuses, pending=None, init=()):
    """p as its kubelet reported it: containerStatuses (name, status requests,
    allocatedResources; requests None: no status resources), optionally a
    PodResizePending condition with that reason."""
    def cs(name, requests, allocated):
        out = {"name": name}
        if requests is not None:
            out["resources"] = {"requests": requests}
        if allocated is not None:
            out["allocatedResources"] = allocated
        return out
    p["status"]["containerStatuses"] = [cs(*s) for s in statuses]
    if init:
        p["status"]["initContainerStatuses"] = [cs(*s) for s in init]
    if pending:
        p["status"]["conditions"] = [
            {"type": "PodResizeInProgress", "status": "False"},
            {"type": "PodResizePending", "status": "True", "reason": pending}]
    return p


CPU2 = {"cpu": "2", "memory": "2Gi"}
CPU1 = {"cpu": "1", "memory": "1Gi"}


# What kube-scheduler 1.35 counts once a kubelet reports the pod
# (component-helpers/resource/helpers.go, determineEffectiveRequests):
# max(spec, status resources, allocatedResources); spec left out while a
# resize is Infeasible.
@pytest.mark.parametrize("case,p,cpu,mem", [
    ("running as specified", reported(pod([ctr("1", "1Gi")]), ("c", CPU1, CPU1)), "1", "1Gi"),
    ("downsize not applied yet: old size",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2)), "2", "2Gi"),
    ("downsize Deferred: old size",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2), pending="Deferred"), "2", "2Gi"),
    ("downsize Infeasible: old size (what runs)",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2), pending="Infeasible"), "2", "2Gi"),
    ("downsize applied", reported(pod([ctr("1", "1Gi")]), ("c", CPU1, CPU1)), "1", "1Gi"),
    ("growth not applied yet: new size at once",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1)), "2", "2Gi"),
    ("growth Deferred: new size",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1), pending="Deferred"), "2", "2Gi"),
    ("growth Infeasible: spec dropped",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1), pending="Infeasible"), "1", "1Gi"),
    ("allocated ahead of what runs", reported(pod([ctr("1", "1Gi")]), ("c", CPU1, CPU2)),
     "2", "2Gi"),
    ("Infeasible: allocated still counts",
     reported(pod([ctr("3")]), ("c", {"cpu": "1"}, {"cpu": "2"}), pending="Infeasible"),
     "2", "0"),
    ("per resource", reported(pod([ctr("1", "1Gi")]), ("c", {"cpu": "2", "memory": "512Mi"},
                                                         None)), "2", "1Gi"),
    ("status without memory keeps the spec's",
     reported(pod([ctr("1", "1Gi")]), ("c", {"cpu": "1"}, {"cpu": "1"})), "1", "1Gi"),
    ("Infeasible, status without memory: none",
     reported(pod([ctr("1", "1Gi")]), ("c", {"cpu": "1"}, {"cpu": "1"}), pending="Infeasible"),
     "1", "0"),
    ("allocatedResources alone (no status resources) is not read",
     reported(pod([ctr("1", "1Gi")]), ("c", None, CPU2)), "1", "1Gi"),
    ("Infeasible without status resources: spec",
     reported(pod([ctr("2")]), ("c", None, None), pending="Infeasible"), "2", "0"),
    ("statuses matched by container name",
     reported(pod([ctr("1", name="a"), ctr("1", name="b")]), ("b", {"cpu": "3"}, None),
              ("other", {"cpu": "9"}, None)), "4", "0"),
    ("an init container's status is not read",
     reported(pod([ctr("1")], init=[ctr("2", name="i")]), ("c", {"cpu": "1"}, None),
              init=[("i", {"cpu": "5"}, None)]), "2", "0"),
    ("a sidecar's status is",
     reported(pod([ctr("1")], init=[ctr("500m", None, "Always", name="s")]),
              ("c", {"cpu": "1"}, None), init=[("s", {"cpu": "2"}, None)]), "3", "0"),
    ("pod-level requests still replace the sum",
     reported(pod([ctr("1")], pod_resources={"requests": {"cpu": "3"}}),
              ("c", {"cpu": "2"}, None)), "3", "0"),
    ("overhead on top", reported(pod([ctr("1")], overhead={"cpu": "100m"}),
                                 ("c", {"cpu": "2"}, None)), "2100m", "0"),
])
def test_pod_requests_as_kube_scheduler_counts_a_reported_pod(case, p, cpu, mem):
    r = quantities.pod_requests(p)
    assert (r["cpu"], r["memory"]) == (quantities.parse_quantity(cpu), quantities.parse_quantity(mem)), case


def test_only_the_first_resize_pending_condition_decides():
    p = reported(pod([ctr("2")]), ("c", {"cpu": "1"}, None))
    p["status"]["conditions"] = [{"type": "PodResizePending", "reason": "Deferred"},
                                 {"type": "PodResizePending", "reason": "Infeasible"}]
    assert quantities.pod_requests(p)["cpu"] == 2


def test_a_terminating_pod_holds_its_share():
    """Deleted with a grace period, it runs until the kubelet kills it:
    kube-scheduler keeps counting it, so do we."""
    p = pod([ctr("1")])
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert usage.pod_usage(p, EX).cpu == N(1)


# What the admin configured: namespace "slurm" is Slurm's; in "hpc" only the
# service account "slurmd"; placeholders live in "pyk8sres-system".
EX = usage.exemptions(["slurm", "hpc/slurmd"], "pyk8sres-system")
SELF_SERVICE = {"pyk8sres.io/slurm-worker": "true", "pyk8sres.io/exempt": "true"}


@pytest.mark.parametrize("case,p,expect", [
    ("running", pod([ctr("1")]), ("n1", "1")),
    ("pending but bound", pod([ctr("1")], phase="Pending"), ("n1", "1")),
    ("unknown phase counts", pod([ctr("1")], phase="Unknown"), ("n1", "1")),
    ("unbound", pod([ctr("1")], node=None), None),
    ("succeeded", pod([ctr("1")], phase="Succeeded"), None),
    ("failed", pod([ctr("1")], phase="Failed"), None),
    ("worker namespace", pod([ctr("4")], namespace="slurm"), None),
    ("worker service account", pod([ctr("4")], namespace="hpc", sa="slurmd"), None),
    ("other sa in worker-sa namespace counts", pod([ctr("1")], namespace="hpc", sa="default"),
     ("n1", "1")),
    ("worker sa name in another namespace counts", pod([ctr("1")], sa="slurmd"), ("n1", "1")),
    ("placeholder", pod([ctr("4")], namespace="pyk8sres-system", name="slurm-share-n1"), None),
    ("placeholder name elsewhere counts", pod([ctr("1")], name="slurm-share-n1"), ("n1", "1")),
    ("other pod in placeholder namespace counts",
     pod([ctr("1")], namespace="pyk8sres-system", name="coordinator"), ("n1", "1")),
    # Nothing the pod creator writes exempts a pod.
    ("self-service labels count", pod([ctr("1")], labels=SELF_SERVICE), ("n1", "1")),
    ("self-service annotations count", pod([ctr("1")], annotations=SELF_SERVICE), ("n1", "1")),
    ("namespace named like the worker one counts", pod([ctr("1")], namespace="slurm-x"),
     ("n1", "1")),
])
def test_pod_usage(case, p, expect):
    got = usage.pod_usage(p, EX)
    if expect is None:
        assert got is None, case
    else:
        assert (got.node, got.cpu, got.error) == (expect[0], N(quantities.parse_quantity(expect[1])), None)


def test_no_exemption_without_config():
    for p in (pod([ctr("1")], namespace="slurm"), pod([ctr("1")], labels=SELF_SERVICE),
              pod([ctr("1")], namespace="pyk8sres-system", name="slurm-share-n1")):
        assert usage.pod_usage(p).cpu == N(1)


@pytest.mark.parametrize("entry", ["", "/", "a/b/c", "a/", "/b", 7])
def test_exemptions_reject(entry):
    with pytest.raises(ValueError):
        usage.exemptions([entry])


@pytest.mark.parametrize("key,ok", [
    ("node-restriction.kubernetes.io/pyk8sres-slurm-node", True),
    ("example.node-restriction.kubernetes.io/slurm", True),
    ("pyk8sres.io/slurm-node", False),           # the node's kubelet can set it
    ("evilnode-restriction.kubernetes.io/x", False),
    ("node-restriction.kubernetes.io/", False),
    ("slurm-node", False),
])
def test_check_node_label(key, ok):
    if ok:
        assert usage.check_node_label(key) == key
    else:
        with pytest.raises(ValueError):
            usage.check_node_label(key)


@pytest.mark.parametrize("bad", [
    pod([ctr("lots")]),
    pod([ctr("1", "12 GB")]),
    pod([ctr("-1")]),
    pod([ctr("1")], overhead={"cpu": "x"}),
    pod([ctr("1")], init=[ctr("1.2.3")]),
    {"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": [{"resources": "oops"}]}},
])
def test_malformed_pod_is_an_error_not_zero(bad):
    got = usage.pod_usage(bad, EX)
    assert got is not None and got.node == "n1"
    assert got.error and "pod" in got.error


# ---------------------------------------------------------------- mapping

KEY = usage.NODE_LABEL
SLURM = {"n1", "n2", "worker-0"}


def knode(name, annotations=None, labels=None):
    return {"metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}}}


@pytest.mark.parametrize("case,node,by_name,node_map,expect", [
    ("same name", knode("n1"), True, None, "n1"),
    ("same name disabled", knode("n1"), False, None, None),
    ("no such slurm node", knode("kx"), True, None, None),
    ("admin label", knode("k1", labels={KEY: "n2"}), True, None, "n2"),
    ("admin label beats same name", knode("n1", labels={KEY: "n2"}), True, None, "n2"),
    ("admin label naming unknown node", knode("n1", labels={KEY: "zz"}), True, None, None),
    ("config map", knode("cn-hongkong.10.1.0.19"), False, {"cn-hongkong.10.1.0.19": "worker-0"},
     "worker-0"),
    ("config beats label", knode("k1", labels={KEY: "n2"}), True, {"k1": "n1"}, "n1"),
    # What the node's kubelet can write never maps a node.
    ("annotation ignored", knode("k1", annotations={KEY: "n2"}), True, None, None),
    ("annotation cannot redirect", knode("n1", annotations={KEY: "n2",
                                                            "pyk8sres.io/slurm-node": "n2"}),
     True, None, "n1"),
    ("old label key ignored", knode("k1", labels={"pyk8sres.io/slurm-node": "n2"}), True, None,
     None),
])
def test_slurm_node_for(case, node, by_name, node_map, expect):
    assert usage.slurm_node_for(node, KEY, SLURM, by_name, node_map) == expect, case


def test_usage_by_k8s_node():
    pods = [usage.PodUsage("a", N(1), 5), usage.PodUsage("a", N(1, 2), 1), usage.PodUsage("b", 0, 0, "bad")]
    assert usage.usage_by_k8s_node(pods) == {"a": usage.NodeUsage(N(3, 2), 6),
                                         "b": usage.NodeUsage(0, 0, ("bad",))}


def test_two_k8s_nodes_on_one_slurm_node_add_up():
    got = usage.usage_by_slurm_node({"a": usage.NodeUsage(1, 2), "b": usage.NodeUsage(3, 4, ("x",))},
                                {"a": "n1", "b": "n1"}, SLURM)
    assert got == {"n1": usage.NodeUsage(4, 6, ("x",))}


def test_usage_by_slurm_node():
    pods = [usage.PodUsage("k1", N(1), MI), usage.PodUsage("k1", N(1, 2), 0),
            usage.PodUsage("n2", N(2), 0),            # no node object: same name
            usage.PodUsage("kx", N(8), 0),            # unmapped: ignored
            usage.PodUsage("k1", error="pod a/b: bad")]
    got = usage.usage_by_slurm_node(usage.usage_by_k8s_node(pods), {"k1": "n1", "kx": None}, SLURM)
    assert got == {"n1": usage.NodeUsage(N(3, 2), MI, ("pod a/b: bad",)),
                   "n2": usage.NodeUsage(N(2), 0)}


# ---------------------------------------------------------------- desired counts

def test_generic_node_body_matches_reference():
    node = SNode(name="slurm-test-worker-cpu-0", alloc_cpus=3, alloc_memory=4000)
    spec, status = usage.generic_node_body(
        "cn-hongkong.10.1.0.19", node, usage.NodeUsage(N(2735, 1000), 3417 * MI), "c1")
    assert spec == {"clusterName": "c1", "alias": "slurm-test-worker-cpu-0", "type": "Slurm"}
    assert status["allocatedResources"] == [
        {"type": "Slurm", "allocated": {"cpu": "3", "memory": "4000Mi"}},
        {"type": "Kubernetes", "allocated": {"cpu": "2735m", "memory": "3417Mi"}}]
    assert status["capacity"] == {"cpu": "4", "memory": "8000Mi"}
    _, idle = usage.generic_node_body("k", SNode(), None, "c1")
    assert idle["allocatedResources"][0]["allocated"] == {"cpu": "0", "memory": "0"}


def test_generic_node_body_says_when_a_node_is_oversubscribed():
    _, fine = usage.generic_node_body("k", SNode(), None, "c1")
    _, over = usage.generic_node_body("k", SNode(), None, "c1", oversubscribed=True)
    assert [(c["type"], c["status"]) for c in fine["conditions"]] == [("Oversubscribed", "False")]
    assert over["conditions"][0]["status"] == "True"
    assert "no new Slurm job starts here" in over["conditions"][0]["message"]


@pytest.mark.parametrize("k8s,expect", [
    ("k8s-a", "n1"),         # mapped (label or node_map)
    ("gpu-1", None),         # known node, shares nothing
    ("n2", "n2"),            # no node object: counts by name
    ("nowhere", None),       # no node object, no Slurm node of that name
])
def test_slurm_node_of(k8s, expect):
    mapping = {"k8s-a": "n1", "gpu-1": None}
    assert usage.slurm_node_of(k8s, mapping, {"n1", "n2"}) == expect
    assert usage.slurm_node_of("n2", mapping, {"n1", "n2"}, map_by_name=False) is None


def test_counting_on_and_refreshed_usage():
    mapping = {"k8s-a": "n1", "k8s-b": "n1", "k8s-c": "n3", "gpu-1": None}
    # and pods on a Kubernetes node named n1 we have no object for
    here = usage.mapped_here(mapping)
    assert here == {"n1": ("k8s-a", "k8s-b"), "n3": ("k8s-c",)}
    assert usage.counting_on({"n1"}, mapping, here) == {"k8s-a", "k8s-b", "n1"}
    assert usage.counting_on({"n2"}, mapping, here) == {"n2"}   # pods on an unknown node named n2
    before = {"n1": usage.NodeUsage(1, 1), "n3": usage.NodeUsage(5, 5)}
    part = {"k8s-a": usage.NodeUsage(2, 20), "k8s-b": usage.NodeUsage(3, 30)}
    assert usage.refreshed_usage(before, part, {"n1"}, mapping, {"n1", "n3"}) == {
        "n1": usage.NodeUsage(5, 50), "n3": usage.NodeUsage(5, 5)}
    assert usage.refreshed_usage(before, {}, {"n1"}, mapping, {"n1", "n3"}) == {"n3": usage.NodeUsage(5, 5)}


@pytest.mark.parametrize("case,node,offered,want", [
    ("name and the mapping label only",
     {"metadata": {"name": "k1", "labels": {usage.NODE_LABEL: "n1", "team": "x"},
                   "annotations": {usage.NODE_LABEL: "n9"}},
      "status": {"allocatable": {"cpu": "8", "memory": "1Gi"}}}, False,
     {"metadata": {"name": "k1", "labels": {usage.NODE_LABEL: "n1"}}}),
    ("offered: allocatable cpu and memory",
     {"metadata": {"name": "k1"}, "status": {
         "allocatable": {"cpu": "7", "memory": "1Gi", "pods": "110"}, "capacity": {"cpu": "8"}}},
     True, {"metadata": {"name": "k1"}, "status": {"allocatable": {"cpu": "7", "memory": "1Gi"}}}),
    ("offered: capacity when no allocatable",
     {"metadata": {"name": "k1"}, "status": {"capacity": {"cpu": "8"}}}, True,
     {"metadata": {"name": "k1"}, "status": {"allocatable": {"cpu": "8"}}}),
    ("offered, no status", {"metadata": {"name": "k1"}}, True, {"metadata": {"name": "k1"}}),
])
def test_slim_node(case, node, offered, want):
    assert usage.slim_node(node, usage.NODE_LABEL, offered=offered) == want, case


def test_spec_counts_keeps_an_infeasible_resize_spec():
    """Admission of the next resize: the kubelet judges its spec afresh."""
    p = reported(pod([ctr("3")]), ("c", {"cpu": "1"}, {"cpu": "1"}), pending="Infeasible")
    assert quantities.pod_requests(p)["cpu"] == 1
    assert quantities.pod_requests(p, spec_counts=True)["cpu"] == 3


# What the ledger holds (held_requests, what pod_usage counts): the larger of
# the spec and what the kubelet may run, whatever the pending resize's
# state.  Unlike kube-scheduler, an Infeasible resize's spec is held: the
# kubelet may still apply it, and its condition stays stale after the next
# resize until the kubelet reports again.
@pytest.mark.parametrize("case,p,cpu,mem", [
    ("running as specified", reported(pod([ctr("1", "1Gi")]), ("c", CPU1, CPU1)), "1", "1Gi"),
    ("not reported yet: spec", pod([ctr("2", "1Gi")]), "2", "1Gi"),
    ("growth not applied yet: new size",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1)), "2", "2Gi"),
    ("growth Deferred: new size",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1), pending="Deferred"), "2", "2Gi"),
    ("growth Infeasible: new size held",
     reported(pod([ctr("2", "2Gi")]), ("c", CPU1, CPU1), pending="Infeasible"), "2", "2Gi"),
    ("downsize not applied yet: old size",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2)), "2", "2Gi"),
    ("downsize Deferred: old size",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2), pending="Deferred"), "2", "2Gi"),
    ("downsize Infeasible: old size",
     reported(pod([ctr("1", "1Gi")]), ("c", CPU2, CPU2), pending="Infeasible"), "2", "2Gi"),
    # 1 -> 4 left Infeasible, then 4 -> 3: the condition is still the old
    # one's; the kubelet may apply 3 as soon as it looks again.
    ("shrink after an Infeasible growth: the new spec",
     reported(pod([ctr("3", "1Gi")]), ("c", CPU1, CPU1), pending="Infeasible"), "3", "1Gi"),
    ("allocated ahead of what runs", reported(pod([ctr("1", "1Gi")]), ("c", CPU1, CPU2)),
     "2", "2Gi"),
    ("per resource: CPU from the spec, memory from what runs",
     reported(pod([ctr("3", "1Gi")]), ("c", {"cpu": "1", "memory": "2Gi"}, None),
              pending="Infeasible"), "3", "2Gi"),
    ("sidecar Infeasible growth held",
     reported(pod([ctr("1")], init=[ctr("2", None, "Always", name="s")]),
              ("c", {"cpu": "1"}, None), init=[("s", {"cpu": "1"}, None)],
              pending="Infeasible"), "3", "0"),
])
def test_held_requests(case, p, cpu, mem):
    r = quantities.held_requests(p)
    assert (r["cpu"], r["memory"]) == (quantities.parse_quantity(cpu), quantities.parse_quantity(mem)), case
    # ...and that is what the sync daemon counts for the pod
    assert usage.pod_usage(p, EX).cpu == N(quantities.parse_quantity(cpu)), case
    # never less than kube-scheduler counts
    s = quantities.pod_requests(p)
    assert r["cpu"] >= s["cpu"] and r["memory"] >= s["memory"], case


# ------------------------------------------- capacity as Slurm schedules it

def test_generic_node_capacity_is_what_the_node_shares():
    """Slinky's worker on a 4-CPU, 8000 MB host, limits 3 CPUs/7488 MB: Slurm
    has CPUTot=4 RealMemory=8000 and holds back CoreSpecCount=1,
    MemSpecLimit=512; node_features gives it k8scpu=3, k8smemory=7488."""
    node = SNode(name="slinky-0", gres={"k8scpu": 3, "k8smemory": 7488})
    _, status = usage.generic_node_body("cn-hongkong.10.1.0.19", node, None, "c1")
    assert status["capacity"] == {"cpu": "3", "memory": "7488Mi"}
    # Not yet registered with its GRES: its hardware.
    _, status = usage.generic_node_body("k", SNode(gres={}), None, "c1")
    assert status["capacity"] == {"cpu": "4", "memory": "8000Mi"}


def kn(cpu=None, memory=None):
    alloc = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"metadata": {"name": "k1"}, "status": {"allocatable": alloc} if alloc else {}}


@pytest.mark.parametrize("k8s_node, gres, over", [
    (kn("4", "8000Mi"), {"k8scpu": 4, "k8smemory": 8000}, None),
    (kn("4", "8000Mi"), {"k8scpu": 3, "k8smemory": 7488}, None),
    # kube-reserved 100m and 500Mi: Slurm's whole-host node exceeds both.
    (kn("3900m", "7500Mi"), {"k8scpu": 4, "k8smemory": 8000},
     ["4 CPUs > allocatable cpu 3900m", "8000 MB > allocatable memory 7500Mi"]),
    (kn("8", "7500Mi"), {"k8scpu": 4, "k8smemory": 8000}, ["8000 MB > allocatable memory"]),
    (kn("3", None), {"k8scpu": 4, "k8smemory": 8000}, ["4 CPUs > allocatable cpu 3"]),
    # Nothing known of the node, or a quantity that does not parse: no claim.
    (kn(), {"k8scpu": 4, "k8smemory": 8000}, None),
    (kn("lots", "8000Mi"), {"k8scpu": 4, "k8smemory": 8000}, None),
])
def test_over_allocatable(k8s_node, gres, over):
    got = usage.over_allocatable("k1", k8s_node, SNode(gres=gres))
    if over is None:
        assert got is None
    else:
        assert got and all(o in got for o in over) and "k1" in got and "n1" in got, got


def test_desired_state_reports_a_slurm_node_over_its_allocatable():
    nodes = {"k1": {"metadata": {"name": "k1", "labels": {usage.NODE_LABEL: "n1"}},
                    "status": {"allocatable": {"cpu": "3", "memory": "8000Mi"}}},
             "k2": {"metadata": {"name": "k2", "labels": {usage.NODE_LABEL: "n2"}},
                    "status": {"allocatable": {"cpu": "4", "memory": "8000Mi"}}}}
    d = usage.desired_state({}, nodes, [SNode("n1"), SNode("n2")])
    assert list(d.over_allocatable) == ["k1"]
    assert d.over_allocatable["k1"] in d.warnings
