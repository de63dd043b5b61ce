"""The ledger under admission load, checked while it runs.

Client threads reserve and release pods' shares through the ledger's real
socket as the webhook does (unique keys, random sizes, held for a moment),
on the nodes that run Slurm jobs, while jobs of random sizes are submitted
to those nodes and run.  A checker compares, over and over:
  - no grant lost: every reservation answered ok before a `show` began and
    not yet being released when it ended is in that `show`, at its size;
    none released before it began is still there;
  - nothing granted beyond capacity, against Slurm's ground truth: on every
    node, the CPUs of the RUNNING jobs (`scontrol -d show job`: CPU_IDs per
    node) plus the whole CPUs of the reservations held all along (in a
    `show` before and one after) never exceed the node's CPUs, and their
    memory (Mem= per node) plus the reservations' MB never exceeds its
    RealMemory;
  - slurmctld answers `squeue` and `sbatch` within `max_answer_s`
    (a probe every half second, each timed, next to the same command's
    `--version`: starting a process on a loaded shared machine is not
    slurmctld's answer).
Used by bench/bench_ledger_stress.py (long) and
tests/integration/test_ledger_stress.py (short).
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import threading
import time

from ..coordinator.slurm import Ledger, ledger_socket_path
from .cluster import unix_sockets_under
from ..policy.ledger import MIB

CPU_IDS = re.compile(r"Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)")


def count_ids(spec: str) -> int:
    """'0-3,6' -> 5 (scontrol's CPU_IDs list)."""
    total = 0
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        total += int(hi or lo) - int(lo) + 1
    return total


def stepd_jobs(env) -> set[str]:
    """Job ids that have a slurmstepd in this cluster: jobs whose processes
    may still run.  A slurmstepd listens on SlurmdSpoolDir/<node>_<job>.<step>
    while it lives (as cluster.cluster_processes finds them); the command
    line ("slurmstepd: [7.batch]") would not do, since another test cluster
    on this host (CI runs two) has job 7 too."""
    with open(env["SLURM_CONF"]) as f:
        spool = re.search(r"^SlurmdSpoolDir=(\S+)", f.read(), re.M | re.I).group(1)
    root = os.path.dirname(spool) if "%n" in spool else spool
    return {m.group(1) for path in unix_sockets_under(root)
            if (m := re.search(r"_(\d+)\.\d+$", path))}


def jobs_per_node(text: str, alive: set[str] | None = None) -> dict[str, tuple[int, int]]:
    """{node: (CPUs, MB)} held by the jobs of `scontrol -d show job` output:
    RUNNING ones, and COMPLETING ones whose job id is in `alive` (a
    slurmstepd still lives: their processes run until killed, while Slurm
    has freed their GRES already).  One node per job in this harness (-w
    picks it)."""
    held: dict[str, list[int]] = {}
    for record in re.split(r"\n\s*\n", text):
        state = re.search(r"JobState=(\w+)", record)
        job = re.search(r"JobId=(\d+)", record)
        if not state or not (state.group(1) == "RUNNING" or state.group(1) == "COMPLETING"
                             and job.group(1) in (alive or ())):
            continue
        for node, ids, mem in CPU_IDS.findall(record):
            if "," in node or "[" in node:   # several nodes on one line: not made here
                raise AssertionError(f"unexpected node list {node} in {record[:200]}")
            cur = held.setdefault(node, [0, 0])
            cur[0] += count_ids(ids)
            cur[1] += int(mem)
    return {n: (c, m) for n, (c, m) in held.items()}


@dataclasses.dataclass
class Grant:
    node: str
    cpu_m: int
    mem: int
    granted: float                  # monotonic, after the ok
    releasing: float | None = None  # monotonic, before the release was sent
    released: float | None = None   # monotonic, after its answer


@dataclasses.dataclass
class Report:
    reserves: int = 0
    granted: int = 0
    refused: int = 0
    jobs_submitted: int = 0
    checks: int = 0
    max_squeue_s: float = 0.0
    max_sbatch_s: float = 0.0
    max_local_s: float = 0.0        # the slowest `--version` (no RPC) next to a probe
    slow_local: list = dataclasses.field(default_factory=list)   # over the limit, not slurmctld's
    probes: int = 0
    max_cpu_used: dict = dataclasses.field(default_factory=dict)   # node -> jobs + pods CPUs
    # Samples over capacity only with COMPLETING jobs whose processes live
    # counted: the sync daemon's part (policy/backstop.py), not run here.
    completing_over: int = 0
    violations: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.reserves} reserves ({self.granted} granted, {self.refused} refused), "
                f"{self.jobs_submitted} jobs, {self.checks} checks, {self.probes} probes: "
                f"squeue max {self.max_squeue_s * 1000:.0f} ms, sbatch max "
                f"{self.max_sbatch_s * 1000:.0f} ms (a --version alone up to "
                f"{self.max_local_s * 1000:.0f} ms; {len(self.slow_local)} over the limit only "
                f"by process start); peak CPUs in use (jobs + pods) "
                f"{self.max_cpu_used}; {self.completing_over} sample(s) over only with "
                f"COMPLETING jobs counted; {len(self.violations)} violation(s), "
                f"{len(self.errors)} error(s)")


class Stress:
    def __init__(self, cluster, nodes: dict[str, tuple[int, int]], clients: int = 6,
                 max_answer_s: float = 1.0, seed: int = 27):
        """nodes: {name: (CPUs, RealMemory MB)} that run slurmd.  The
        ledger serves LedgerConnectionsPerUser= connections per uid (at
        least 8 where this runs): the clients and the checker share them."""
        if not 0 <= clients <= 7:
            raise ValueError(f"{clients} clients + the checker: the ledger serves 8 "
                             "connections per uid")
        self.c, self.nodes, self.clients = cluster, nodes, clients
        self.max_answer_s = max_answer_s
        self.rng = random.Random(seed)
        self.grants: dict[str, Grant] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.report = Report()
        self.socket = ledger_socket_path(cluster.conf)

    def _run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.c.env, capture_output=True, text=True,
                              timeout=timeout, cwd="/tmp")

    # --- load ------------------------------------------------------------
    def _client(self, index: int) -> None:
        try:
            self._client_loop(index)
        except Exception as e:  # noqa: BLE001 - a client that fails is a finding
            with self.lock:
                self.report.errors.append(f"client {index}: {e!r}")

    def _client_loop(self, index: int) -> None:
        ledger = Ledger(self.socket, timeout=30)
        rng = random.Random(index)
        n = 0
        while not self.stop.is_set():
            node = rng.choice(list(self.nodes))
            key = f"stress-{index}-{n}"
            n += 1
            cpu_m, mem = rng.randrange(100, 3001, 50), rng.randrange(64, 2049) * MIB
            reply = ledger.reserve(node, key, cpu_m, mem)
            with self.lock:
                self.report.reserves += 1
                if reply.get("ok"):
                    self.report.granted += 1
                    self.grants[key] = Grant(node, cpu_m, mem, time.monotonic())
                elif reply.get("code") == "nofit":
                    self.report.refused += 1
                else:
                    self.report.errors.append(f"reserve {key}: {reply}")
            if not reply.get("ok"):
                time.sleep(rng.uniform(0, 0.05))
                continue
            time.sleep(rng.uniform(0, 0.4))
            with self.lock:
                self.grants[key].releasing = time.monotonic()
            reply = ledger.release(node, key)
            with self.lock:
                if reply.get("ok"):
                    self.grants[key].released = time.monotonic()
                else:
                    self.report.errors.append(f"release {key}: {reply}")

    def _jobs(self) -> None:
        rng = random.Random(1)
        while not self.stop.is_set():
            node = rng.choice(list(self.nodes))
            cpus = rng.randint(1, max(1, self.nodes[node][0] // 2))
            proc = self._run("sbatch", "-o", "/dev/null", "-w", node, "-c", str(cpus),
                             f"--mem={rng.randint(100, 2000)}", "--wrap",
                             f"sleep {rng.uniform(0.5, 3):.1f}")
            with self.lock:
                if proc.returncode == 0:
                    self.report.jobs_submitted += 1
                else:
                    self.report.errors.append(f"sbatch: {proc.stderr.strip()}")
            self.stop.wait(rng.uniform(0.1, 0.4))

    def _timed(self, *argv: str) -> tuple[bool, float]:
        t0 = time.monotonic()
        try:
            ok = self._run(*argv, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        return ok, time.monotonic() - t0

    def _probe(self) -> None:
        """Each command is timed right after the same binary's --version
        (no RPC): on a machine shared with others, what exceeds the limit
        only because starting a process took that long is counted apart
        (slow_local), not as slurmctld's answer."""
        while not self.stop.is_set():
            for what, argv in (("squeue", ("squeue", "-h")),
                               ("sbatch", ("sbatch", "-H", "-o", "/dev/null", "--wrap", "true"))):
                _, local = self._timed(what, "--version")
                ok, took = self._timed(*argv)
                with self.lock:
                    self.report.probes += 1
                    attr = f"max_{what}_s"
                    setattr(self.report, attr, max(getattr(self.report, attr), took))
                    self.report.max_local_s = max(self.report.max_local_s, local)
                    if ok and took > self.max_answer_s and took - local <= self.max_answer_s:
                        self.report.slow_local.append(
                            f"{what} {took:.2f} s, {what} --version alone {local:.2f} s")
                    elif not ok or took > self.max_answer_s:
                        self.report.violations.append(
                            f"{what} answered in {took:.2f} s (ok={ok}; {what} --version alone "
                            f"{local:.2f} s), limit {self.max_answer_s} s")
            self.stop.wait(0.5)

    # --- the checker -----------------------------------------------------
    def check_once(self, ledger: Ledger) -> None:
        nodes = list(self.nodes)
        t1 = time.monotonic()
        first = {n: ledger.show(n)["nodes"][n] for n in nodes}
        t2 = time.monotonic()
        proc = self._run("scontrol", "-d", "show", "job")
        if proc.returncode != 0:     # not a clean check: the caller records it
            raise RuntimeError(f"scontrol -d show job: exit {proc.returncode}: "
                               f"{proc.stderr.strip()[:300]}")
        # RUNNING jobs only: Slurm frees a COMPLETING job's GRES at once, and
        # holding its room until its processes are gone is the sync daemon's
        # part (policy/backstop.py), which this ledger-only harness does not run.
        truth = jobs_per_node(proc.stdout)
        with_completing = jobs_per_node(proc.stdout, stepd_jobs(self.c.env)) \
            if "JobState=COMPLETING" in proc.stdout else truth
        t3 = time.monotonic()
        second = {n: ledger.show(n)["nodes"][n] for n in nodes}
        t4 = time.monotonic()
        with self.lock:
            grants = dict(self.grants)
        problems = []
        for key, g in grants.items():
            for shown, start, end in ((first, t1, t2), (second, t3, t4)):
                entries = shown[g.node].get("entries", {})
                held = g.granted < start and (g.releasing is None or g.releasing > end)
                gone = g.released is not None and g.released < start
                if held and entries.get(key) != [g.cpu_m, g.mem]:
                    problems.append(f"grant lost: {key} on {g.node} ({g.cpu_m}m, {g.mem} B) "
                                    f"shown as {entries.get(key)}")
                if gone and key in entries:
                    problems.append(f"released {key} still held on {g.node}")
        for node, (cpus, mem_mb) in self.nodes.items():
            # Held all along [t1, t4]: in both shows (keys are never reused).
            a = first[node].get("entries", {})
            b = second[node].get("entries", {})
            both = [a[k] for k in a if k in b]
            pods_cpu = -(-sum(e[0] for e in both) // 1000)
            pods_mem = -(-sum(e[1] for e in both) // MIB)
            jobs_cpu, jobs_mem = truth.get(node, (0, 0))
            with self.lock:
                self.report.max_cpu_used[node] = max(self.report.max_cpu_used.get(node, 0),
                                                     jobs_cpu + pods_cpu)
            all_cpu, all_mem = with_completing.get(node, (0, 0))
            over = jobs_cpu + pods_cpu > cpus or jobs_mem + pods_mem > mem_mb
            if not over and (all_cpu + pods_cpu > cpus or all_mem + pods_mem > mem_mb):
                with self.lock:
                    self.report.completing_over += 1
            if over:
                problems.append(
                    f"beyond capacity on {node}: jobs {jobs_cpu} CPUs {jobs_mem} MB "
                    f"(RUNNING, scontrol -d show job) + pods {pods_cpu} CPUs {pods_mem} MB "
                    f"> {cpus} CPUs {mem_mb} MB")
        with self.lock:
            self.report.checks += 1
            self.report.violations.extend(problems)

    def run(self, seconds: float) -> Report:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                   for i in range(self.clients)]
        threads += [threading.Thread(target=self._jobs, daemon=True),
                    threading.Thread(target=self._probe, daemon=True)]
        for t in threads:
            t.start()
        ledger = Ledger(self.socket, timeout=30)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    self.check_once(ledger)
                except Exception as e:  # noqa: BLE001 - reported, not swallowed
                    with self.lock:
                        self.report.errors.append(f"check: {e!r}")
                time.sleep(0.2)
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=60)
        return self.report
