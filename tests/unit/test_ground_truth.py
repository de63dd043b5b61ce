"""The integration tests' ground truth, on its own: pods sized by Kubernetes'
rules (its own code, not pyk8sres's), Slurm's jobs that hold CPUs (COMPLETING
ones while a slurmstepd lives), and a sample that cannot read Slurm is an
error, never an empty node."""
import os
import sys
from fractions import Fraction

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import ground_truth  # noqa: E402
from pyk8sres.testbed import stress  # noqa: E402

GI = 1 << 30


def c(name, cpu=None, memory=None, **extra):
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"name": name, "resources": {"requests": requests}, **extra}


def st(name, cpu, allocated=None):
    out = {"name": name, "resources": {"requests": {"cpu": cpu}}}
    if allocated:
        out["allocatedResources"] = {"cpu": allocated}
    return out


@pytest.mark.parametrize("text,value", [
    ("250m", Fraction(1, 4)), ("1", 1), (2, 2), ("1.5", Fraction(3, 2)),
    ("1Gi", GI), ("128Mi", 128 << 20),
    ("100M", 10**8), ("1e3", 1000), ("2k", 2000), ("500u", Fraction(1, 2000)),
])
def test_quantity(text, value):
    assert ground_truth.quantity(text) == value


@pytest.mark.parametrize("what,pod,cpu,memory", [
    ("one container", {"spec": {"containers": [c("a", "500m", "1Gi")]}}, Fraction(1, 2), GI),
    ("containers add up", {"spec": {"containers": [c("a", "1"), c("b", "1500m", "1Gi")]}},
     Fraction(5, 2), GI),
    ("an init container alone needs more",
     {"spec": {"initContainers": [c("i", "3", "512Mi")], "containers": [c("a", "1", "1Gi")]}},
     3, GI),
    ("a sidecar runs beside later init containers and the app",
     {"spec": {"initContainers": [c("s", "1", "1Gi", restartPolicy="Always"), c("i", "2", "3Gi")],
               "containers": [c("a", "1", "1Gi")]}}, 3, 4 * GI),
    ("overhead adds", {"spec": {"containers": [c("a", "1")], "overhead": {"cpu": "100m"}}},
     Fraction(11, 10), 0),
    ("pod-level requests stand for the containers",
     {"spec": {"resources": {"requests": {"cpu": "4"}}, "containers": [c("a", "1")]}}, 4, 0),
    ("a resize down counts at the old size until applied",
     {"spec": {"containers": [c("a", "1")]},
      "status": {"containerStatuses": [st("a", "3", allocated="3")]}}, 3, 0),
    ("a resize up counts at once", {"spec": {"containers": [c("a", "4")]},
                                    "status": {"containerStatuses": [st("a", "1", "1")]}}, 4, 0),
    ("an Infeasible resize's spec is never applied",
     {"spec": {"containers": [c("a", "6")]},
      "status": {"conditions": [{"type": "PodResizePending", "reason": "Infeasible"}],
                 "containerStatuses": [st("a", "1", "1")]}}, 1, 0),
    ("a Deferred resize may be applied any time",
     {"spec": {"containers": [c("a", "6")]},
      "status": {"conditions": [{"type": "PodResizePending", "reason": "Deferred"}],
                 "containerStatuses": [st("a", "1", "1")]}}, 6, 0),
])
def test_pod_size(what, pod, cpu, memory):
    assert ground_truth.pod_size(pod) == (cpu, memory), what


SHOW_JOB = """JobId=7 JobName=a
   JobState=RUNNING Reason=None
     Nodes=n1 CPU_IDs=0-1 Mem=100 GRES=

JobId=8 JobName=b
   JobState=COMPLETING Reason=None
     Nodes=n1 CPU_IDs=2-4 Mem=200 GRES=

JobId=9 JobName=c
   JobState=COMPLETING Reason=None
     Nodes=n2 CPU_IDs=0 Mem=50 GRES=

JobId=10 JobName=d
   JobState=PENDING Reason=Resources
"""


@pytest.mark.parametrize("alive,want", [
    (None, {"n1": (2, 100)}),
    ({"8"}, {"n1": (5, 300)}),
    ({"8", "9"}, {"n1": (5, 300), "n2": (1, 50)}),
])
def test_completing_jobs_count_while_their_stepd_lives(alive, want):
    assert stress.jobs_per_node(SHOW_JOB, alive) == want


def test_an_unreadable_slurm_is_an_error_not_an_empty_node(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm "
                    "controller' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ground_truth.Unreadable) as e:
        ground_truth.slurm_jobs({"PATH": str(tmp_path)}, ["n1"])
    assert e.value.side == "slurm" and "Unable to contact" in e.value.detail
