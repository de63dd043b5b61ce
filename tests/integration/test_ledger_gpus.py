"""The ledger's GPU indices inside a real slurmctld (`cluster up --gpus 4`).

A reservation of GPU 0,1 on n1 is allocated in n1's gpu GRES itself: a job
asking for 3 GPUs pends (Resources), one asking for 2 runs on IDX 2-3
(`scontrol -d show job`); a reservation naming an index a job or another
entry holds is refused nofit; the reservation and its bits are back after
a slurmctld restart and a reconfigure (both rebuild allocations from jobs);
its release lets the pending job start on them.  After a kill -9 of
slurmctld, until n1's slurmd registers again, every GPU pods do not hold
counts as a job's (jobs slurmctld forgot may run there): reservations of
them are refused, then granted once it has.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ground_truth import job_gpus
from ledger_checks import sh, wait_serving
from local_slurm import RELEASE, local_cluster, port, requires_slurm
from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.testbed import faults
from pyk8sres.testbed.stress import stepd_jobs

pytestmark = requires_slurm + [
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)")]

GPUS = 4


# Seconds between SIGTERM and SIGKILL of a job's processes: a job that
# ignores SIGTERM completes for this long.
KILL_WAIT = 8


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "ledger-gpus", nodes=1, cpus=8, memory=8000,
                             gpus=GPUS, base_port=port(18300), extra_conf=f"KillWait={KILL_WAIT}\n")


def _wait(what, check, timeout=40):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.3)


def _sbatch(c, gpus: int) -> str:
    out = sh(c, "sbatch", "--parsable", f"--gres=gpu:{gpus}", "-w", "n1", "-n1",
             "--mem=100", "--wrap", "sleep 600")
    return out.strip().split(";")[0]


def _state(c, job: str) -> tuple[str, str]:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                         text=True, env=c.env, timeout=15).stdout.split()
    return (out[0], out[1]) if len(out) == 2 else ("", "")


def _job_idx(c, job: str) -> set[int]:
    return job_gpus(sh(c, "scontrol", "-d", "-o", "show", "job", job)).get("n1", set())


def _node_gpus_used(c) -> int:
    """How many of n1's GPUs Slurm counts as allocated (GresUsed=gpu:N, with
    (IDX:...) on some releases)."""
    used = re.search(r"GresUsed=(\S*)", sh(c, "scontrol", "-d", "-o", "show", "node", "n1"))
    m = re.search(r"(?:^|,)gpu(?::[^:(,]+)?:(\d+)", used.group(1) if used else "")
    return int(m.group(1)) if m else -1


def test_gpus_reserved_jobs_pend_then_start_and_survive_a_restart(c):
    path = ledger_socket_path(c.conf)
    wait_serving(path)
    ledger = Ledger(path, timeout=10)
    _wait("n1 registered its gpus",
          lambda: (ledger.show("n1")["nodes"]["n1"].get("gpus") or {}).get("count") == GPUS)

    # The operator's CLI, as a pod's claim would be reserved.
    reply = json.loads(sh(c, sys.executable, "-m", "pyk8sres", "ledger", "reserve", "n1",
                          "claim:a", "--cpu", "0", "--memory", "0", "--gpus", "0,1"))
    assert reply == {"ok": True}, reply
    assert ledger.show("n1")["nodes"]["n1"]["gpus"] == {"count": GPUS, "jobs": [],
                                                         "share": [0, 1]}
    assert _node_gpus_used(c) == 2                  # in Slurm's own record

    big = _sbatch(c, 3)                             # only 2 are free: ours block it
    _wait("the 3-GPU job pends (Resources)", lambda: _state(c, big) == ("PENDING", "Resources"))
    sh(c, "scontrol", "hold", big)                  # let the next job be the top one
    two = _sbatch(c, 2)
    _wait("the 2-GPU job runs", lambda: _state(c, two)[0] == "RUNNING")
    assert _job_idx(c, two) == {2, 3}
    assert ledger.show("n1")["nodes"]["n1"]["gpus"] == {"count": GPUS, "jobs": [2, 3],
                                                         "share": [0, 1]}
    table = sh(c, sys.executable, "-m", "pyk8sres", "ledger", "show")
    assert re.search(r"^n1 .* 2,3 +0,1\s*$", table, re.M), table

    refused = ledger.reserve("n1", "claim:b", 0, 0, gpus=[2])
    assert refused["code"] == "nofit" and "Slurm jobs hold" in refused["error"], refused
    refused = ledger.reserve("n1", "claim:b", 0, 0, gpus=[1])
    assert refused["code"] == "nofit" and "claim:a" in refused["error"], refused
    refused = ledger.reserve("n1", "claim:b", 0, 0, gpus=[GPUS])
    assert refused["code"] == "nofit", refused
    assert "claim:b" not in ledger.show("n1")["nodes"]["n1"]["entries"]

    sh(c, "scancel", two)
    sh(c, "scontrol", "release", big)
    _wait("the 2-GPU job ends", lambda: _state(c, two)[0] in ("", "COMPLETED", "CANCELLED"))
    time.sleep(3)                                   # a scheduling pass: still ours, still pending
    assert _state(c, big) == ("PENDING", "Resources")
    assert _node_gpus_used(c) == 2            # a job's end clears its bits, not ours

    c.restart_slurmctld()
    wait_serving(path)
    assert ledger.show("n1")["nodes"]["n1"]["gpus"]["share"] == [0, 1]
    _wait("the bits are back after the restart", lambda: _node_gpus_used(c) == 2)
    time.sleep(3)
    assert _state(c, big) == ("PENDING", "Resources")
    sh(c, "scontrol", "reconfigure")                # rebuilds allocations from jobs
    wait_serving(path)
    _wait("the bits are back after reconfigure", lambda: _node_gpus_used(c) == 2)
    time.sleep(3)
    assert _state(c, big) == ("PENDING", "Resources")

    assert ledger.release("n1", "claim:a")["ok"]
    _wait("the 3-GPU job starts on the freed GPUs", lambda: _state(c, big)[0] == "RUNNING")
    assert len(_job_idx(c, big)) == 3 and _job_idx(c, big) & {0, 1}
    assert ledger.show("n1")["nodes"]["n1"]["gpus"]["share"] == []
    sh(c, "scancel", big)
    c.cancel_all_jobs()


def test_gpus_of_a_node_not_registered_since_a_restart_are_not_given(c):
    """slurmctld killed -9 forgets the jobs it had not saved, while their
    processes run on until the node's slurmd registers and is told to kill
    them (Slurm starts no job there meanwhile: the node is UNKNOWN or
    NOT_RESPONDING).
    Until then the ledger counts every GPU pods do not hold as a job's.
    n1's slurmd is stopped (SIGSTOP) across the restart to hold that
    window open."""
    path = ledger_socket_path(c.conf)
    wait_serving(path)
    ledger = Ledger(path, timeout=10)
    _wait("n1 registered its gpus",
          lambda: (ledger.show("n1")["nodes"]["n1"].get("gpus") or {}).get("count") == GPUS)
    _wait("n1's slurmd registered", lambda: re.search(
        r"State=IDLE\S* ", sh(c, "scontrol", "-o", "show", "node", "n1")))
    assert ledger.reserve("n1", "claim:held", 0, 0, gpus=[3]) == {"ok": True}
    # A job run on n1 and slurmctld's state saved since (at most every 5 s):
    # the restart recovers n1 as it was, its GPU bitmap with it.
    job = sh(c, "sbatch", "--parsable", "--gres=gpu:1", "-w", "n1", "-n1", "--mem=100",
             "--wrap", "true").strip().split(";")[0]
    _wait("the job ran", lambda: _state(c, job)[0] in ("", "COMPLETED"))
    time.sleep(7)
    slurmd = c.pid("slurmd-n1")
    os.kill(slurmd, signal.SIGSTOP)
    try:
        faults.kill_and_restart(c)
        node = sh(c, "scontrol", "-o", "show", "node", "n1")
        assert re.search(r"State=(UNKNOWN|\S*NOT_RESPONDING)", node), node
        assert ledger.show("n1")["nodes"]["n1"]["gpus"] == {"count": GPUS, "jobs": [0, 1, 2],
                                                             "share": [3]}
        refused = ledger.reserve("n1", "claim:new", 0, 0, gpus=[0])
        assert refused["code"] == "nofit" and "Slurm jobs hold" in refused["error"], refused
    finally:
        os.kill(slurmd, signal.SIGCONT)
    _wait("n1's slurmd registered again", lambda: re.search(
        r"State=IDLE\S* ", sh(c, "scontrol", "-o", "show", "node", "n1")), timeout=90)
    assert ledger.show("n1")["nodes"]["n1"]["gpus"] == {"count": GPUS, "jobs": [],
                                                         "share": [3]}
    assert ledger.reserve("n1", "claim:new", 0, 0, gpus=[0]) == {"ok": True}
    assert ledger.release("n1", "claim:new")["ok"] and ledger.release("n1", "claim:held")["ok"]


def test_gpus_of_a_node_completing_a_job_are_not_given(c):
    """Slurm frees a job's GPUs when it begins completing, while its
    processes run on until they exit or KillWait has passed (here they
    ignore SIGTERM).  While the node completes, the ledger counts every GPU
    pods do not hold as a job's: the job's GPU is given to no pod until its
    processes are gone (ground truth: their slurmstepd)."""
    path = ledger_socket_path(c.conf)
    wait_serving(path)
    ledger = Ledger(path, timeout=10)
    job = sh(c, "sbatch", "--parsable", "--gres=gpu:1", "-w", "n1", "-n1", "--mem=100",
             "--wrap", 'trap "" TERM; sleep 600').strip().split(";")[0]
    _wait("the job running", lambda: _state(c, job)[0] == "RUNNING")
    idx = sorted(_job_idx(c, job))
    time.sleep(1)                  # the script's trap set
    sh(c, "scancel", job)
    _wait("n1 completing", lambda: "COMPLETING" in sh(c, "scontrol", "-o", "show", "node", "n1"))
    refused = ledger.reserve("n1", "claim:completing", 0, 0, gpus=idx)
    alive = job in stepd_jobs(c.env)
    assert alive, f"job {job}'s processes were gone before the check"
    assert refused.get("code") == "nofit", refused
    assert ledger.show("n1")["nodes"]["n1"]["gpus"]["jobs"] == list(range(GPUS))
    _wait("n1 done completing", lambda: "COMPLETING" not in sh(
        c, "scontrol", "-o", "show", "node", "n1"), timeout=KILL_WAIT + 30)
    assert job not in stepd_jobs(c.env)
    assert ledger.reserve("n1", "claim:completing", 0, 0, gpus=idx) == {"ok": True}
    assert ledger.release("n1", "claim:completing")["ok"]


def test_a_gpu_gres_without_device_files_is_refused_not_crashed(c):
    """gres.conf with `Name=gpu Count=4` (no File=): Slurm keeps no bitmap,
    so no index can be reserved there; the reserve is refused with the
    reason, slurmctld lives on, and a reservation without GPUs still works.
    (22.05's slurmd then reports 0 GPUs and the node is INVALID: Slurm's own
    refusal; the ledger's must not depend on it.)"""
    path = ledger_socket_path(c.conf)
    gres_conf = os.path.join(c.work, "etc", "gres.conf")
    with open(gres_conf) as f:
        text = f.read()
    with open(gres_conf, "w") as f:
        f.write(re.sub(r"Name=gpu File=\S+", f"Name=gpu Count={GPUS}", text))
    # Slurm keeps a node's gpu bitmap in its saved node state: start from none.
    c.stop("slurmd-n1")
    c.stop("slurmctld")
    for name in os.listdir(os.path.join(c.work, "state")):
        if name.startswith("node_state"):
            os.unlink(os.path.join(c.work, "state", name))
    c.start_slurmctld()
    c.start_slurmd("n1")
    wait_serving(path)
    ledger = Ledger(path, timeout=10)
    view = _wait("n1 registered without device files", lambda: (
        ledger.show("n1")["nodes"]["n1"].get("gpus") or {}).get("problem") and
        ledger.show("n1")["nodes"]["n1"]["gpus"])
    assert "File=" in view["problem"], view
    refused = ledger.reserve("n1", "claim:c", 0, 0, gpus=[0])
    assert refused["code"] == "nofit" and "File=" in refused["error"], refused
    assert ledger.reserve("n1", "pod", 1000, 0) == {"ok": True}
    assert ledger.release("n1", "pod")["ok"]
    c.wait_slurmctld()
