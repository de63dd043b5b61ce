"""A node that newly registers is held until the coordinator counts its pods.

With HoldNewNodes=yes (k8s_resources.conf), a dynamic node (`slurmd -Z`,
as a Slinky or ACK worker pod starts it) that the ledger never met is held
whole from its registration on: a job sent to it pends (ground truth:
`scontrol -d show job`) until the coordinator's first `set` there, here
sent by hand with no coordinator running, replaces the hold; so for a node
made with `scontrol create node` before its slurmd registers.  The hold
survives a slurmctld restart (journal); a node once set, and slurm.conf's
nodes, are not held again when they re-register.
Ports: PYK8SRES_TEST_HOLD_PORT (default 18100) .. +3 (+3: the dynamic slurmd).
"""
import os
import subprocess
import time

import pytest
from local_slurm import local_cluster, port, requires_slurm
from test_job_submit_differential import allocations

from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.policy.ledger import REGISTERED_KEY

BASE_PORT = int(os.environ.get("PYK8SRES_TEST_HOLD_PORT", port(18100)))
CPUS, MEMORY = 4, 8000
DYN_CPUS, DYN_MEMORY = 2, 4000

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "hold", nodes=1, cpus=CPUS, memory=MEMORY,
                             base_port=BASE_PORT, node_features=True,
                             k8s_conf="HoldNewNodes=yes\n",
                             # a dynamic slurmd takes SlurmdPort (no Port= in --conf)
                             extra_conf=f"MaxNodeCount=8\nSlurmdPort={BASE_PORT + 3}\n")


@pytest.fixture(autouse=True)
def no_jobs_left(c):
    yield
    c.cancel_all_jobs()


def run(*args, check=True):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd="/tmp")
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


def entries(c, node: str) -> dict:
    reply = Ledger(ledger_socket_path(c.conf)).show(node)
    assert reply["ok"], reply
    return reply["nodes"][node]["entries"]


def job(job_id: str) -> dict:
    return allocations(run("scontrol", "-d", "show", "job", job_id))[0]


def submit(node: str) -> str:
    return run("sbatch", "--parsable", "--output=/dev/null", "-w", node, "-c", "1",
               "--mem=100", "--wrap", "sleep 300").strip().split(";")[0]


def pends(job_id: str, seconds: float) -> None:
    """Ground truth, sampled for `seconds`: the job never runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        j = job(job_id)
        assert j["state"] == "PENDING" and not j["nodes"], j
        time.sleep(0.5)
    assert job(job_id)["reason"] == "Resources", job(job_id)


def runs_on(job_id: str, node: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (j := job(job_id))["state"] != "RUNNING":
        assert time.monotonic() < deadline, j
        time.sleep(0.3)
    assert list(j["nodes"]) == [node] and j["nodes"][node]["k8scpu"] == 1, j


def set_share(c, node: str) -> None:
    """The coordinator's first `set` there: no pod on that Kubernetes node."""
    reply = Ledger(ledger_socket_path(c.conf)).set(node, {}, 30)
    assert reply["ok"], reply


def test_a_new_node_accepts_no_job_until_its_pods_are_counted(c):
    assert entries(c, "n1") == {}                 # slurm.conf's node: not held
    os.makedirs(os.path.join(c.work, "spool", "d1"), exist_ok=True)
    c.start_slurmd("d1", dynamic_conf=f"CPUs={DYN_CPUS} RealMemory={DYN_MEMORY}")
    c.wait_nodes_idle(["d1"])
    job_id = submit("d1")
    pends(job_id, 4)
    whole = [DYN_CPUS * 1000, DYN_MEMORY << 20]
    assert entries(c, "d1") == {REGISTERED_KEY: whole}
    shown = Ledger(ledger_socket_path(c.conf)).show()["nodes"]
    assert shown["d1"].get("registered") and not shown["n1"].get("registered"), shown
    # slurmctld restarts, then d1's slurmd (a fresh registration: 22.05
    # may not reach a dynamic node it recovered): the journal keeps the hold.
    c.restart_slurmctld()
    c.stop("slurmd-d1")
    c.start_slurmd("d1", dynamic_conf=f"CPUs={DYN_CPUS} RealMemory={DYN_MEMORY}")
    c.wait_nodes_idle(["n1", "d1"])
    assert entries(c, "d1") == {REGISTERED_KEY: whole}
    pends(job_id, 3)
    set_share(c, "d1")
    assert entries(c, "d1") == {}
    runs_on(job_id, "d1")
    run("scancel", job_id)
    # Once set, a re-registration (slurmd restarts) is not new: no hold.
    c.stop("slurmd-d1")
    c.start_slurmd("d1", dynamic_conf=f"CPUs={DYN_CPUS} RealMemory={DYN_MEMORY}")
    c.wait_nodes_idle(["d1"])
    assert entries(c, "d1") == {}
    runs_on(submit("d1"), "d1")
    runs_on(submit("n1"), "n1")


def test_a_node_made_with_scontrol_create_node_is_held_too(c):
    """`scontrol create node` then its slurmd: held from that registration
    (the node had no capacity before it)."""
    run("scontrol", "create", f"NodeName=d2 NodeAddr=127.0.0.1 CPUs={DYN_CPUS} "
        f"RealMemory={DYN_MEMORY} State=FUTURE")
    c.stop("slurmd-d1")                          # its port: one dynamic slurmd at a time
    os.makedirs(os.path.join(c.work, "spool", "d2"), exist_ok=True)
    c.start_slurmd("d2", dynamic_conf=f"CPUs={DYN_CPUS} RealMemory={DYN_MEMORY}")
    c.wait_nodes_idle(["d2"])
    job_id = submit("d2")
    pends(job_id, 3)
    assert entries(c, "d2") == {REGISTERED_KEY: [DYN_CPUS * 1000, DYN_MEMORY << 20]}
    set_share(c, "d2")
    runs_on(job_id, "d2")
