"""The ledger across slurmctld restarts and reconfigure, on a real cluster.

- While slurmctld recovers its state the ledger answers "notready", never a
  node "unknown" (a `show` of every node then looked like "no shared nodes").
- kill -9 and restart under a stream of reserves: each one was refused or is
  durable; nothing is booked twice (scontrol -d show job vs the ledger).
- A second process never replaces the journal nor takes the socket while
  another live process owns them (the journal's flock): here the test is the
  owner, as 24.11's re-exec parent is while its child starts; every grant it
  acknowledged meanwhile is there once it lets go.
- `scontrol reconfigure` (24.11+: re-exec) under a stream: nothing lost.
"""
import fcntl
import json
import os
import socket
import time

import pytest

from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger
from pyk8sres.testbed import faults
from ledger_checks import (STATE_SAVED_WITHIN, ReserveStream, assert_durable,
                           assert_never_booked_twice, clean_after, raw_show,
                           sh, wait_serving)
from local_slurm import BUILD, RELEASE, local_cluster, port, requires_slurm

pytestmark = requires_slurm + [
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)")]

CPUS, MEMORY = 8, 8000


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "ledger-restart", nodes=2, cpus=CPUS,
                             memory=MEMORY, base_port=port(17700))


@pytest.fixture
def path(c):
    yield from clean_after(c)


def _journal(c) -> str:
    return os.path.join(c.work, "state", "k8s_resources.ledger")


def _probe_restart(c, path) -> dict:
    """Restart slurmctld while asking `show` as fast as possible: what came back."""
    seen: dict = {}
    c.stop("slurmctld")
    c.start_slurmctld(wait=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            reply = raw_show(path)
        except (OSError, ValueError) as exc:
            seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
            time.sleep(0.001)
            continue
        if reply.get("ok"):
            unknown = sorted(n for n, v in reply["nodes"].items() if v.get("unknown"))
            key = f"unknown {unknown}" if unknown else "ok"
        else:
            key = reply["code"]
        seen[key] = seen.get(key, 0) + 1
        if key == "ok":
            break
    c.wait_slurmctld()
    return seen


def test_while_recovering_it_says_notready_never_unknown(c, path):
    """Every reply while slurmctld starts is `notready` (or no connection):
    never a node "unknown".  The window is short: restart until it is seen."""
    Ledger(path).set("n1", {"pod-a": (2000, 100 << 20)}, 0)
    seen_total: dict = {}
    for attempt in range(8):
        seen = _probe_restart(c, path)
        for k, v in seen.items():
            seen_total[k] = seen_total.get(k, 0) + v
        assert not [k for k in seen if k.startswith("unknown")], seen
        assert set(seen) <= {"ok", "notready", "ConnectionRefusedError",
                             "FileNotFoundError", "ValueError", "BrokenPipeError",
                             "ConnectionResetError"}, seen
        if "notready" in seen:
            break
    print(f"replies while slurmctld restarted ({attempt + 1} restarts): {seen_total}")
    assert "notready" in seen_total, seen_total
    shown = Ledger(path).show("n1")["nodes"]["n1"]
    assert shown["share"]["cpu"] == 2 and not shown.get("unknown"), shown


def _running_job_on_n1(c) -> str:
    """A job of 3 CPUs and 1000 MB on n1, once it runs."""
    job = sh(c, "sbatch", "--parsable", "-w", "n1", "-c", "3", "--mem=1000", "-o", "/dev/null",
             "--wrap", "sleep 600").strip()
    deadline = time.monotonic() + 30
    while sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.3)
    return job


def test_kill9_and_restart_under_a_stream_of_reserves(c, path):
    job = _running_job_on_n1(c)
    time.sleep(STATE_SAVED_WITHIN)
    Ledger(path).set("n1", {"held": (4000, 2000 << 20)}, 0)
    stream = ReserveStream(path, "k9")
    stream.start()
    try:
        for _ in range(3):
            stream.wait_acked()
            faults.kill_and_restart(c)
        stream.wait_acked()
    finally:
        stream.stop()
    result = assert_durable(path, stream)
    print(f"kill -9 x3 under a stream of reserves: {result}")
    assert result["refused"], result        # some met a slurmctld down or not ready
    # The job survived, and with the pods' 4 (+1 for the stream) CPUs, a job
    # of 2 more does not fit next to it: it pends, it does not start.
    assert sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING"
    c.wait_nodes_idle(["n1", "n2"])         # registered again after the restarts
    pending = sh(c, "sbatch", "--parsable", "-w", "n1", "-c", "2", "--mem=100", "-o",
                 "/dev/null", "--wrap", "sleep 600").strip()
    time.sleep(3)
    assert sh(c, "squeue", "-h", "-j", pending, "-o", "%T %r").split() == ["PENDING", "Resources"]
    assert_never_booked_twice(c, path, CPUS, MEMORY)


def test_a_restart_that_lost_node_state_still_counts_the_running_jobs(c, path):
    """slurmctld starts with no node state file (a failback that read the
    state while the backup was rewriting it, a damaged disk): the nodes come
    back without their k8scpu/k8smemory until the plugin gives them, and
    while Slurm rebuilds allocations from the jobs it drops the GRES of
    every job that does not fit a node's count.  The running job must still
    be counted once the ledger answers: by Slurm's GresUsed and by the
    ledger's facts, so neither a job nor a pod is placed on its CPUs."""
    job = _running_job_on_n1(c)
    assert Ledger(path).set("n1", {"held": (4000, 2000 << 20)}, 0)["ok"]
    c.stop("slurmctld")                     # saves its state, then we lose the nodes'
    for name in ("node_state", "node_state.old"):
        lost = os.path.join(c.work, "state", name)
        if os.path.exists(lost):
            os.unlink(lost)
    c.start_slurmctld()
    wait_serving(path)
    assert sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING"
    n1 = Ledger(path).show("n1")["nodes"]["n1"]
    assert n1["jobs"] == {"cpu": 3, "mem": 1000}, n1
    assert_never_booked_twice(c, path, CPUS, MEMORY)
    # The pods' 4 CPUs and the job's 3 leave one: a job of 2 more pends.
    pending = sh(c, "sbatch", "--parsable", "-w", "n1", "-c", "2", "--mem=100", "-o",
                 "/dev/null", "--wrap", "sleep 600").strip()
    time.sleep(3)
    assert sh(c, "squeue", "-h", "-j", pending, "-o", "%T").strip() == "PENDING"
    assert_never_booked_twice(c, path, CPUS, MEMORY)


def test_a_live_owner_keeps_its_journal_and_socket(c, path):
    """The test holds the journal's lock and serves the socket, as a live
    owner would (24.11's re-exec parent while its child starts; a primary
    while a backup starts).  A starting slurmctld must wait: not compact the
    journal, not take the socket; once the owner lets go, it loads every
    grant the owner acknowledged in the meantime."""
    ledger = Ledger(path)
    ledger.reserve("n2", "before", 1000, 1 << 20)
    c.stop("slurmctld")
    journal = _journal(c)
    lock = os.open(os.path.join(c.work, "state", "k8s_resources.ledger.lock"), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())
    os.unlink(path)
    ours = socket.socket(socket.AF_UNIX)
    ours.bind(path)
    ours.listen(8)
    ours_inode = os.stat(path).st_ino
    try:
        before = os.stat(journal)
        c.start_slurmctld()
        # The owner acknowledges a grant after the new slurmctld read the journal.
        with open(journal, "ab") as f:
            f.write(json.dumps({"t": time.time(), "op": "reserve", "node": "n2", "key": "late",
                                "cpu_m": 2000, "mem_bytes": 1 << 20}).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        time.sleep(2)
        after = os.stat(journal)
        assert after.st_ino == before.st_ino and after.st_size > before.st_size
        assert os.stat(path).st_ino == ours_inode
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(path)                 # reaches our listener, not slurmctld
        conn, _ = ours.accept()
        conn.close()
        probe.close()
        log = open(os.path.join(c.work, "log", "slurmctld.log")).read()
        assert f"another live slurmctld (pid {os.getpid()}) owns the ledger's journal" in log
    finally:
        ours.close()
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    took = wait_serving(path, timeout=10)
    print(f"slurmctld served {took:.2f} s after the owner let go")
    entries = Ledger(path).show("n2")["nodes"]["n2"]["entries"]
    assert entries == {"before": [1000, 1 << 20], "late": [2000, 1 << 20]}, entries
    assert_never_booked_twice(c, path, CPUS, MEMORY)
    node = sh(c, "scontrol", "-d", "-o", "show", "node", "n2")
    assert "k8scpu:3" in node.split("GresUsed=")[1].split()[0], node


def test_reconfigure_under_a_stream_loses_nothing(c, path):
    """`scontrol reconfigure`: in-process on 22.05; from 24.11 on slurmctld
    re-execs itself (here in the foreground: the same process), and the new
    image must load every grant the old one acknowledged."""
    stream = ReserveStream(path, "rc")
    stream.start()
    try:
        for _ in range(3):
            stream.wait_acked()
            sh(c, "scontrol", "reconfigure")
        wait_serving(path)
        stream.wait_acked()
    finally:
        stream.stop()
    result = assert_durable(path, stream)
    print(f"reconfigure x3 (re-exec: {BUILD.get('RECONFIGURE_REEXEC', '?')}) under a stream: "
          f"{result}")
    assert_never_booked_twice(c, path, CPUS, MEMORY)
