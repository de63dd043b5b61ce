"""Shared by the ledger's restart and failover tests: a stream of reserves
that records what was acknowledged, and the checks against ground truth."""
import json
import re
import socket
import subprocess
import threading
import time

from ground_truth import count_ids, stepd_jobs
from pyk8sres.coordinator.slurm import Ledger, LedgerError, ledger_socket_path

# slurmctld saves job state a few seconds after a change (controller.c's
# state save thread, at most every 5 s): what a kill -9 comes earlier than
# this loses (a running job comes back pending).  Slurm's behaviour, not the
# ledger's: tests let it pass before killing.
STATE_SAVED_WITHIN = 6.0


def sh(c, *argv) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True, env=c.env, timeout=60)
    assert p.returncode == 0, f"{argv}: {p.stderr}"
    return p.stdout


class ReserveStream(threading.Thread):
    """Reserve 1m CPU / 1 byte under a new key every `interval` s, alternating
    n1 and n2, through one kept-open client, as the webhook does; records
    every reply.  Tiny amounts: thousands fit (the share rounds up to 1 CPU)."""

    def __init__(self, path: str, prefix: str, interval: float = 0.02):
        super().__init__(daemon=True)
        self.path, self.prefix, self.interval = path, prefix, interval
        self.acked: dict[str, str] = {}       # key -> node, for every ok reply
        self.sent: dict[str, str] = {}
        self.refusals: dict[str, int] = {}    # code (or the client's error) -> count
        self.unknown_replies = []             # "unknown_node" for a node that exists
        self._halt = threading.Event()

    def run(self):
        ledger = Ledger(self.path, timeout=2.0)
        i = 0
        while not self._halt.is_set():
            node, key = f"n{1 + i % 2}", f"{self.prefix}-{i}"
            i += 1
            self.sent[key] = node
            try:
                reply = ledger.reserve(node, key, 1, 1)
            except LedgerError:
                code = "unreachable"
                self.refusals[code] = self.refusals.get(code, 0) + 1
                ledger.close()
                time.sleep(self.interval)
                continue
            if reply.get("ok"):
                self.acked[key] = node
            else:
                code = reply.get("code", "?")
                self.refusals[code] = self.refusals.get(code, 0) + 1
                if code == "unknown_node":
                    self.unknown_replies.append(reply)
            time.sleep(self.interval)
        ledger.close()

    def wait_acked(self, more: int = 20, timeout: float = 60) -> None:
        """Until `more` further reserves are acknowledged: whoever serves the
        ledger now has granted some (a count, not a sleep: a loaded machine's
        fsyncs are slower, not wrong)."""
        goal, deadline = len(self.acked) + more, time.monotonic() + timeout
        while len(self.acked) < goal:
            assert time.monotonic() < deadline and self.is_alive(), \
                f"{goal - len(self.acked)} of {more} reserves still unacknowledged: {self.refusals}"
            time.sleep(0.05)

    def stop(self):
        self._halt.set()
        self.join(30)
        assert not self.is_alive()


def wait_serving(path: str, timeout: float = 60) -> float:
    """Until the ledger answers `show` with ok; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if Ledger(path, timeout=2).show().get("ok"):
                return time.monotonic() - t0
        except LedgerError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the ledger at {path} did not serve within {timeout} s")


def ledger_keys(path: str) -> dict[str, str]:
    """Every key the ledger holds -> its node (show, node by node)."""
    ledger = Ledger(path, timeout=5)
    keys = {}
    for node in ("n1", "n2"):
        reply = ledger.show(node)
        assert reply["ok"], reply
        keys.update({k: node for k in reply["nodes"][node].get("entries", {})})
    return keys


def assert_durable(path: str, stream: ReserveStream) -> dict:
    """Every reserve acknowledged is held, on its node; nothing is held that
    was never asked for."""
    held = {k: n for k, n in ledger_keys(path).items() if k.startswith(stream.prefix + "-")}
    lost = {k: n for k, n in stream.acked.items() if held.get(k) != n}
    assert not lost, f"{len(lost)} acknowledged reserves lost: {sorted(lost)[:10]}"
    phantom = set(held) - set(stream.sent)
    assert not phantom, phantom
    assert not stream.unknown_replies, stream.unknown_replies[:3]
    return {"sent": len(stream.sent), "acked": len(stream.acked),
            "held_unacked": len(set(held) - set(stream.acked)), "refused": stream.refusals}


def jobs_hold(c) -> dict[str, dict[str, int]]:
    """Ground truth: CPUs and MB of memory Slurm's jobs hold per node
    (scontrol -d show job; it must answer): "cpu"/"mem" of RUNNING jobs,
    "cpu_completing"/"mem_completing" of COMPLETING jobs whose slurmstepd
    still lives (their processes run until killed; Slurm has already freed
    their GRES, so GresUsed does not count them)."""
    held: dict[str, dict[str, int]] = {}
    out = sh(c, "scontrol", "-d", "-o", "show", "job")
    alive = stepd_jobs(c.env) if "JobState=COMPLETING" in out else set()
    for line in out.splitlines():
        state = re.search(r"JobState=(\w+)", line)
        job = re.search(r"JobId=(\d+)", line)
        if not state or state.group(1) not in ("RUNNING", "COMPLETING"):
            continue
        if state.group(1) == "COMPLETING" and job.group(1) not in alive:
            continue
        tail = "" if state.group(1) == "RUNNING" else "_completing"
        for nodes, ids, mem in re.findall(r"Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)", line):
            assert re.fullmatch(r"n\d+", nodes), line    # one node per job here
            per = held.setdefault(nodes, {"cpu": 0, "mem": 0, "cpu_completing": 0,
                                          "mem_completing": 0})
            per["cpu" + tail] += count_ids(ids)
            per["mem" + tail] += int(mem)
    return held


def assert_never_booked_twice(c, path: str, cpus: int, memory: int) -> None:
    """On every node, what jobs hold (scontrol, COMPLETING ones with
    processes included) plus the pods' share (the ledger) fits the node; and
    Slurm's own GresUsed counts the RUNNING jobs and the share."""
    jobs = jobs_hold(c)
    shown = Ledger(path, timeout=5).show()
    assert shown["ok"], shown
    for node in ("n1", "n2"):
        share = shown["nodes"][node]["share"]
        job = jobs.get(node, {"cpu": 0, "mem": 0, "cpu_completing": 0, "mem_completing": 0})
        assert job["cpu"] + job["cpu_completing"] + share["cpu"] <= cpus, (node, job, share)
        assert job["mem"] + job["mem_completing"] + share["mem"] <= memory, (node, job, share)
        used = re.search(r"GresUsed=(\S*)", sh(c, "scontrol", "-d", "-o", "show", "node", node))
        counts = dict(re.findall(r"(k8s\w+):(\d+)", used.group(1) if used else ""))
        assert int(counts.get("k8scpu", 0)) == job["cpu"] + share["cpu"], (node, counts, job, share)


def raw_show(path: str) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(path)
        s.sendall(b'{"op":"show"}\n')
        return json.loads(s.makefile("rb").readline())


def clean_after(c, nodes=("n1", "n2")):
    """Fixture body: the ledger's socket path; afterwards whatever the test
    left is gone (no job, no share), so a failure does not cascade."""
    path = ledger_socket_path(c.conf)
    yield path
    c.cancel_all_jobs()
    wait_serving(path)
    for node in nodes:
        Ledger(path).set(node, {}, 0)
