"""Table-driven tests of placeholder sizing, of what kube-scheduler counts for
a pod (component-helpers' rules, KEP-1287) and of planning; plus a random
walk with a simulated kubelet checking that kube-scheduler never counts less
than Slurm holds at any step."""

import random

import pytest

from pyk8sres.policy import placeholder

MI = 1024 * 1024
GI = 1024 * MI
ALLOC = (8000, 16000 * MI)


def node(name, cpu="8", mem="16000Mi"):
    return {"metadata": {"name": name}, "status": {"allocatable": {"cpu": cpu, "memory": mem}}}


def ph(spec, applied=None, allocated=None, pending=None, phase="Running", deleting=False,
       node_name="k1", name="x"):
    """A placeholder pod as the API server returns it: spec requests,
    the kubelet's report (applied, allocatedResources), a PodResizePending
    reason."""
    p = placeholder.pod(node_name, "ns", *spec, ALLOC)
    p["metadata"]["name"] = name
    status = {"phase": phase}
    if applied is not None:
        cs = {"name": placeholder.CONTAINER,
              "resources": placeholder.resources(*applied, ALLOC),
              "allocatedResources":
                  placeholder.resources(*(allocated or applied), ALLOC)["requests"]}
        status["containerStatuses"] = [cs]
    if pending:
        status["conditions"] = [{"type": "PodResizePending", "status": "True", "reason": pending}]
    p["status"] = status
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


@pytest.mark.parametrize("jobs,alloc,expect", [
    ({"cpu": 6, "mem": 4000}, (8000, 16000 * MI), (6000, 4000 * MI)),
    ({"cpu": 0, "mem": 0}, (8000, 16000 * MI), (0, 0)),
    ({"cpu": 12, "mem": 99999}, (8000, 16000 * MI), (8000, 16000 * MI)),   # capped
    ({}, (8000, 1), (0, 0)),
])
def test_size(jobs, alloc, expect):
    assert placeholder.size(jobs, alloc) == expect


def test_pod_stays_burstable_and_round_trips():
    p = placeholder.pod("k1", "pyk8sres-system", 0, 0, (8000, 16 * MI))
    c = p["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "8000m"} and "memory" not in c["resources"]["limits"]
    assert p["metadata"]["generateName"] == "slurm-share-k1-" and p["spec"]["nodeName"] == "k1"
    assert p["metadata"]["labels"]["app.kubernetes.io/component"] == "slurm-share"
    assert p["spec"]["priorityClassName"] == "system-node-critical"
    assert placeholder.current(p) == (0, 0)
    assert placeholder.current(placeholder.pod("k1", "x", 2500, 3 * MI,
                                               (8000, 16 * MI))) == (2500, 3 * MI)
    assert placeholder.current({"spec": {"containers": [{"name": "other"}]}}) is None


@pytest.mark.parametrize("pod,expect", [
    (ph((6000, GI)), (6000, GI)),                                       # not started: spec
    (ph((6000, GI), applied=(6000, GI)), (6000, GI)),
    (ph((6000, GI), applied=(2000, GI)), (6000, GI)),                   # growth in flight
    (ph((6000, GI), applied=(2000, GI), pending="Deferred"), (6000, GI)),
    (ph((6000, GI), applied=(2000, GI), pending="Infeasible"), (2000, GI)),   # spec dropped
    (ph((6000, 2 * GI), applied=(2000, GI), allocated=(3000, GI), pending="Infeasible"),
     (3000, GI)),
    (ph((2000, GI), applied=(6000, GI)), (6000, GI)),                   # downsize in flight
    (ph((2000, GI), applied=(6000, GI), pending="Deferred"), (6000, GI)),
    (ph((2000, GI), applied=(6000, GI), pending="Infeasible"), (6000, GI)),
    (ph((2000, GI), applied=(2000, GI), allocated=(4000, GI)), (4000, GI)),
    (ph((6000, GI), applied=(6000, GI), phase="Failed"), (0, 0)),       # not watched
    (ph((6000, GI), applied=(6000, GI), phase="Succeeded"), (0, 0)),
    (ph((6000, GI), applied=(6000, GI), deleting=True), (6000, GI)),    # until gone
])
def test_what_kube_scheduler_counts(pod, expect):
    assert placeholder.counted(pod) == expect


@pytest.mark.parametrize("pods,want,create,resize,delete", [
    ({}, (0, 0), None, {}, []),
    ({}, (6000, GI), (6000, GI), {}, []),
    ({"a": ph((6000, GI), (6000, GI))}, (6000, GI), None, {}, []),
    # growth: a new pod for the shortfall, never a resize (Infeasible drops spec)
    ({"a": ph((2000, GI), (2000, GI))}, (6000, GI), (4000, 0), {}, []),
    ({"a": ph((2000, GI), (2000, GI), pending="Infeasible")}, (6000, 3 * GI),
     (4000, 2 * GI), {}, []),
    # shrink: whole pods first, then one downsize
    ({"a": ph((4000, GI), (4000, GI)), "b": ph((2000, GI), (2000, GI))}, (4000, GI),
     None, {}, ["b"]),
    ({"a": ph((6000, GI), (6000, GI))}, (2000, GI), None, {"a": (2000, GI)}, []),
    ({"a": ph((4000, 4 * GI), (4000, 4 * GI)), "b": ph((2000, GI), (2000, GI))},
     (6000, 3 * GI), None, {"a": (4000, 2 * GI)}, []),
    ({"a": ph((4000, GI), (4000, GI)), "b": ph((2000, GI), (2000, GI))}, (0, 0),
     None, {}, ["a", "b"]),
    ({"a": ph((0, 0), (0, 0))}, (0, 0), None, {}, ["a"]),
    # a downsize the kubelet is applying: wait; one it left pending: replace
    ({"a": ph((2000, GI), (6000, GI))}, (2000, GI), None, {}, []),
    ({"a": ph((2000, GI), (6000, GI), pending="Infeasible")}, (2000, GI), (2000, GI), {}, ["a"]),
    ({"a": ph((2000, GI), (6000, GI), pending="Deferred")}, (2000, GI), (2000, GI), {}, ["a"]),
    # an in-place growth left Infeasible (an older coordinator's): replaced
    ({"a": ph((6000, GI), (2000, GI), pending="Infeasible")}, (6000, GI), (6000, GI), {}, ["a"]),
    # gone or going: a Failed pod is not counted; a Terminating one is, but not for long
    ({"a": ph((6000, GI), (6000, GI), phase="Failed")}, (6000, GI), (6000, GI), {}, ["a"]),
    ({"a": ph((6000, GI), (6000, GI), deleting=True)}, (6000, GI), (6000, GI), {}, []),
])
def test_plan_node(pods, want, create, resize, delete):
    plan = placeholder.plan_node(want, pods)
    assert (plan.create, plan.resize, plan.delete) == (create, resize, delete)


def test_plan_node_merges_beyond_max_pods():
    pods = {n: ph((1000, 0), (1000, 0)) for n in "abc"}
    plan = placeholder.plan_node((4000, 0), pods, max_pods=3)
    assert plan.create == (2000, 0) and plan.delete == ["a"] and not plan.resize
    assert not placeholder.plan_node((3000, 0), pods, max_pods=3)


def test_plan():
    shared = {"k1": "n1", "k2": "n2", "k3": "n3"}
    nodes = {"k1": node("k1"), "k2": node("k2"), "k3": node("k3")}
    shown = {"n1": {"jobs": {"cpu": 2, "mem": 100}}, "n2": {"jobs": {"cpu": 3, "mem": 0}}}
    existing = {"p2": ph((1000, 0), (1000, 0), node_name="k2"),
                "p3": ph((1000, 0), (1000, 0), node_name="k3"),
                "old": ph((0, 0), (0, 0), node_name="gone")}
    plans = placeholder.plan(shared, nodes, shown, existing)
    assert plans["k1"].create == (2000, 100 * MI) and plans["k1"].alloc == (8000, 16000 * MI)
    assert plans["k2"].create == (2000, 0) and not plans["k2"].delete
    assert plans["gone"].delete == ["old"]
    assert "k3" not in plans                   # Slurm shows nothing: left alone
    existing["p2b"] = ph((2000, 0), (2000, 0), node_name="k2")
    assert "k2" not in placeholder.plan(shared, nodes, shown, existing)


# ------------------------------------------------- a random walk, simulated

class World:
    """Placeholder pods as the API server holds them, a kubelet that applies,
    defers or refuses resizes at random, and kube-scheduler's count."""

    def __init__(self, rnd):
        self.rnd, self.pods, self.n = rnd, {}, 0

    def seen(self):
        return tuple(map(sum, zip((0, 0), *(placeholder.counted(p) for p in self.pods.values()))))

    def create(self, size):
        self.n += 1
        name = f"p{self.n}"
        self.pods[name] = ph(size, name=name)        # counted at spec from creation

    def resize(self, name, size):
        p = self.pods[name]
        p["spec"]["containers"][0]["resources"] = placeholder.resources(*size, ALLOC)
        p["status"].pop("conditions", None)

    def kubelet(self):
        for name, p in list(self.pods.items()):
            if (p["metadata"].get("deletionTimestamp") and self.rnd.random() < 0.5) or \
                    p["status"]["phase"] == "Failed":
                if p["metadata"].get("deletionTimestamp"):
                    del self.pods[name]
                continue
            spec = placeholder.current(p)
            cs = p["status"].get("containerStatuses")
            if cs is None:
                if self.rnd.random() < 0.05:                     # refused at admission
                    p["status"]["phase"] = "Failed"
                else:
                    self.pods[name] = ph(spec, spec, name=name)
                continue
            if (placeholder.resize_pending(p)
                    or placeholder.counted(p) == spec and placeholder._applied(p) == spec):
                continue
            outcome = self.rnd.choice(["apply", "apply", "Deferred", "Infeasible"])
            if outcome == "apply":
                self.pods[name] = ph(spec, spec, name=name)
            else:
                p["status"]["conditions"] = [{"type": "PodResizePending", "status": "True",
                                              "reason": outcome}]


@pytest.mark.parametrize("seed", range(40))
def test_scheduler_never_counts_less_than_slurm_holds(seed):
    rnd = random.Random(seed)
    w = World(rnd)
    want = (0, 0)
    for step in range(60):
        if rnd.random() < 0.3:
            want = (rnd.randrange(0, 9) * 1000, rnd.choice([0, 500, 1000, 4000]) * MI)
        if rnd.random() < 0.05 and w.pods:                  # someone deletes one with grace
            w.pods[rnd.choice(sorted(w.pods))]["metadata"]["deletionTimestamp"] = "x"
        before = w.seen()
        floor = tuple(min(b, x) for b, x in zip(before, want))
        plan = placeholder.plan_node(want, dict(w.pods), max_pods=3)
        if plan.create:
            w.create(plan.create)
            assert all(s >= f for s, f in zip(w.seen(), floor)), (step, "create")
        for name, size in plan.resize.items():
            w.resize(name, size)
            assert all(s >= f for s, f in zip(w.seen(), floor)), (step, "resize")
        for name in plan.delete:
            del w.pods[name]
            assert all(s >= f for s, f in zip(w.seen(), floor)), (step, "delete", w.seen(), want)
        w.kubelet()
    # Settled: with want fixed and a kubelet that applies everything, the
    # count converges to exactly what Slurm holds, within the pod budget.
    for _ in range(10):
        plan = placeholder.plan_node(want, dict(w.pods), max_pods=3)
        if plan.create:
            w.create(plan.create)
        for name, size in plan.resize.items():
            w.resize(name, size)
        for name in plan.delete:
            del w.pods[name]
        for name, p in list(w.pods.items()):
            if p["metadata"].get("deletionTimestamp"):
                del w.pods[name]
            elif p["status"]["phase"] != "Failed":
                w.pods[name] = ph(placeholder.current(p), placeholder.current(p), name=name)
    assert w.seen() == want
    assert len(w.pods) <= 3
