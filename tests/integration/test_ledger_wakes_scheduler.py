"""A share the ledger lowers runs Slurm's scheduler: a job pending behind
pods' share starts at once after their release, not at slurmctld's next
periodic pass.  Here the periodic passes are minutes apart
(sched_interval, bf_interval) and a requested pass waits a minute after
the last (batch_sched_delay), as a busy site may set them, so the job can
only start that soon if the release ran a pass.  Real slurmctld and
slurmd; the pods' share is a ledger reservation, as the webhook makes it.
"""
import subprocess
import time

import pytest

from ledger_checks import clean_after
from local_slurm import local_cluster, port, requires_slurm
from pyk8sres.coordinator.slurm import Ledger

pytestmark = requires_slurm
CPUS, MEMORY = 4, 4000
# Minutes between periodic passes, a minute before a requested one.
QUIET = "SchedulerParameters=sched_interval=300,bf_interval=300,batch_sched_delay=60\n"


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "ledger-wakes", nodes=1, cpus=CPUS,
                             memory=MEMORY, base_port=port(17150), extra_conf=QUIET)


@pytest.fixture
def path(c):
    yield from clean_after(c, nodes=("n1",))


def state(c, job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=c.env,
                          capture_output=True, text=True).stdout.strip()


def test_a_job_pending_behind_pods_starts_soon_after_their_release(c, path):
    ledger = Ledger(path)
    assert ledger.reserve("n1", "default/pods", 3000, 0)["ok"]
    job = subprocess.run(["sbatch", "--parsable", "-w", "n1", "-c", "2", "-o", "/dev/null",
                          "--wrap", "sleep 300"], env=c.env, cwd="/tmp", capture_output=True,
                         text=True, check=True).stdout.strip().split(";")[0]
    try:
        time.sleep(6)
        assert state(c, job) == "PENDING"
        assert ledger.release("n1", "default/pods")["ok"]
        released = time.monotonic()
        while state(c, job) != "RUNNING" and time.monotonic() - released < 30:
            time.sleep(0.2)
        took = time.monotonic() - released
        print(f"job started {took:.1f} s after the release")
        # The pass the release ran, not one a minute after the last.
        assert took < 8, f"job {job} still {state(c, job)} {took:.0f} s after the release"
    finally:
        subprocess.run(["scancel", job], env=c.env)
