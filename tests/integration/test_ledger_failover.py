"""The ledger with a real backup slurmctld (two SlurmctldHost lines, one
StateSaveLocation; `pyk8sres cluster up --backup-controller`).

- The standby backup neither compacts the journal nor touches the socket.
- The backup takes over (the primary killed with -9, or `scontrol takeover`)
  while pods hold shares, a job runs and reserves stream in: every reserve
  acknowledged by either controller is held afterwards, and on every node
  what jobs hold (scontrol -d show job) plus the pods' share fits.
- The primary comes back and takes journal and socket back the same way.
  From 25.05 on Slurm itself may come back without its jobs (the backup
  rewrites its state files while the primary reads them; it logs "Old
  state possible"): the checks against what Slurm holds must pass either way.
"""
import os
import time

import pytest

from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger
from pyk8sres.testbed import faults
from ledger_checks import (STATE_SAVED_WITHIN, ReserveStream, assert_durable,
                           assert_never_booked_twice, clean_after, sh)
from local_slurm import RELEASE, local_cluster, port, requires_slurm

pytestmark = requires_slurm + [
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)")]

CPUS, MEMORY = 8, 8000


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "ledger-failover", nodes=2, cpus=CPUS,
                             memory=MEMORY, base_port=port(17800), backup_controller=True)


@pytest.fixture
def path(c):
    yield from clean_after(c)


def _backup_log(c) -> str:
    with open(os.path.join(c.work, "backup", "log", "slurmctld.log"), errors="replace") as f:
        return f.read()


# The highest job ID used: a primary that came back without its jobs
# numbers from 1 again while their batch steps still run on n1, and a
# reused ID there drains the node ("Duplicate jobid").
_used = [0]


def _job(c, cpus: int, hold: bool = False) -> str:
    job = sh(c, "sbatch", "--parsable", *(["-H"] if hold else []), "-w", "n1", "-c", str(cpus),
             "--mem=500", "-o", "/dev/null", "--wrap", "sleep 600").strip()
    _used[0] = max(_used[0], int(job))
    return job


def _number_past_used_ids(c) -> None:
    """Let Slurm's job IDs run past every ID used so far (held jobs,
    cancelled)."""
    last = _used[0]
    while int(_job(c, 1, hold=True)) <= last:
        pass
    c.cancel_all_jobs()


def _state(c, job: str) -> list:
    return sh(c, "squeue", "-h", "-j", job, "-o", "%T %r").split()


def _slurm_lost_jobs_on_failback(c, backup_said: int, *jobs: str) -> bool:
    """Did the primary come back without these jobs?  Only Slurm's own loss
    is allowed: from 25.05 on, a backup answers the primary's REQUEST_CONTROL
    only when it times out (the backup waits for that very RPC to finish
    before it saves: "Old state possible"), then rewrites its state files
    while the primary reads them, and the primary may find none."""
    known = sh(c, "squeue", "-h", "-o", "%i").split()
    if all(job in known for job in jobs):
        return False
    assert "Old state possible" in _backup_log(c)[backup_said:], (jobs, known)
    return True


def _wait_state(c, job: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _state(c, job)[:1] != [state]:
        assert time.monotonic() < deadline, (job, _state(c, job))
        time.sleep(0.3)


def test_a_standby_backup_leaves_journal_and_socket_alone(c, path):
    ledger = Ledger(path)
    assert ledger.reserve("n2", "standby", 1000, 1 << 20)["ok"]
    journal = os.path.join(c.work, "state", "k8s_resources.ledger")
    before = (os.stat(journal).st_ino, os.stat(path).st_ino)
    size = os.path.getsize(journal)
    c.stop("slurmctld-backup")              # a backup (re)starting, as after a reboot
    c.start_slurmctld(backup=True)
    time.sleep(2)
    assert (os.stat(journal).st_ino, os.stat(path).st_ino) == before
    assert os.path.getsize(journal) >= size     # appended to, never replaced
    assert faults._lock_owner(c) == c.pid("slurmctld")
    assert "standing by" in _backup_log(c)
    assert ledger.show("n2")["nodes"]["n2"]["entries"] == {"standby": [1000, 1 << 20]}
    ledger.release("n2", "standby")


@pytest.mark.parametrize("how", ["kill -9", "takeover"])
def test_backup_takes_over_under_a_stream_and_the_primary_comes_back(c, path, how):
    ledger = Ledger(path)
    running = _job(c, 3)
    _wait_state(c, running, "RUNNING")
    time.sleep(STATE_SAVED_WITHIN)
    assert ledger.set("n1", {"pods": (4000, 2000 << 20)}, 0)["ok"]
    stream = ReserveStream(path, f"fo{how[:4]}")
    stream.start()
    try:
        stream.wait_acked()                 # by the primary
        took = faults.fail_over(c, how)
        print(f"{how}: the backup served the ledger {took:.1f} s later")
        stream.wait_acked()                 # by the backup
        # On the backup: the pods' 4 CPUs (+1 for the stream's) and the job's
        # 3 fill n1, so a job of 2 more pends there.
        pending = _job(c, 2)
        time.sleep(3)
        assert _state(c, pending)[0] == "PENDING", _state(c, pending)
        assert _state(c, running)[0] == "RUNNING"
        assert_never_booked_twice(c, path, CPUS, MEMORY)
        time.sleep(STATE_SAVED_WITHIN)      # the backup's state file has both jobs
        # The primary comes back: the backup lets go, the primary takes over.
        backup_said = len(_backup_log(c))
        took = faults.fail_back(c)
        print(f"{how}: the primary served the ledger again {took:.1f} s after it started")
        stream.wait_acked()                 # by the primary again
    finally:
        stream.stop()
    result = assert_durable(path, stream)
    print(f"{how} and back under a stream of reserves: {result}")
    assert_never_booked_twice(c, path, CPUS, MEMORY)
    if _slurm_lost_jobs_on_failback(c, backup_said, running, pending):
        print(f"{how}: Slurm lost its jobs on failback (its backup logged 'Old state "
              "possible'); the same two jobs again")
        c.cancel_all_jobs()
        _number_past_used_ids(c)
        running = _job(c, 3)
        _wait_state(c, running, "RUNNING")
        pending = _job(c, 2)
        time.sleep(3)
    assert _state(c, pending)[0] == "PENDING"
    assert_never_booked_twice(c, path, CPUS, MEMORY)
    # The pods leave: the pending job starts.
    ledger.set("n1", {}, 0)
    ledger.set("n2", {}, 0)
    _wait_state(c, pending, "RUNNING")
    assert_never_booked_twice(c, path, CPUS, MEMORY)
