"""Table-driven tests of placeholder sizing and planning."""

import pytest

from pyk8sres.policy import placeholder as P

MI = 1024 * 1024


def node(name, cpu="8", mem="16000Mi", unschedulable=False):
    n = {"metadata": {"name": name}, "status": {"allocatable": {"cpu": cpu, "memory": mem}}}
    if unschedulable:
        n["spec"] = {"unschedulable": True}
    return n


@pytest.mark.parametrize("jobs,alloc,expect", [
    ({"cpu": 6, "mem": 4000}, (8000, 16000 * MI), (6000, 4000 * MI)),
    ({"cpu": 0, "mem": 0}, (8000, 16000 * MI), (0, 0)),
    ({"cpu": 12, "mem": 99999}, (8000, 16000 * MI), (8000, 16000 * MI)),   # capped
    ({}, (8000, 1), (0, 0)),
])
def test_size(jobs, alloc, expect):
    assert P.size(jobs, alloc) == expect


def test_pod_stays_burstable_and_round_trips():
    p = P.pod("k1", "pyk8sres-system", 0, 0, (8000, 16 * MI))
    c = p["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "8000m"} and "memory" not in c["resources"]["limits"]
    assert p["metadata"]["name"] == "slurm-share-k1" and p["spec"]["nodeName"] == "k1"
    assert p["spec"]["priorityClassName"] == "system-node-critical"
    assert P.current(p) == (0, 0)
    assert P.current(P.pod("k1", "x", 2500, 3 * MI, (8000, 16 * MI))) == (2500, 3 * MI)
    assert P.current({"spec": {"containers": [{"name": "other"}]}}) is None


def test_plan():
    shared = {"k1": "n1", "k2": "n2", "k3": "n3"}
    nodes = {"k1": node("k1"), "k2": node("k2"), "k3": node("k3")}
    shown = {"n1": {"jobs": {"cpu": 2, "mem": 100}}, "n2": {"jobs": {"cpu": 3, "mem": 0}}}
    existing = {"slurm-share-k2": P.pod("k2", "ns", 1000, 0, (8000, 16000 * MI)),
                "slurm-share-old": P.pod("old", "ns", 0, 0, (1, 1))}
    create, resize, delete = P.plan(shared, nodes, shown, existing)
    assert create == {"k1": (2000, 100 * MI, (8000, 16000 * MI))}
    assert resize == {"k2": (3000, 0, (8000, 16000 * MI))}
    assert delete == ["slurm-share-old"]        # k3: Slurm shows nothing -> left alone
    existing["slurm-share-k2"] = P.pod("k2", "ns", 3000, 0, (8000, 16000 * MI))
    assert P.plan(shared, nodes, shown, existing)[1] == {}
