"""Randomized churn with injected faults: Slurm jobs (sbatch, arrays, srun)
and pods (through a kube-scheduler stand-in and straight onto nodes with
spec.nodeName) on 3 shared nodes, while the coordinator, slurmctld and the
API server are killed and restarted, slurmctld reconfigured, a partition
updated and the webhook made unreachable.

The invariant is checked all along from ground truth only: what slurmctld
has really allocated to running jobs on each node (`scontrol -d show job`:
CPU_IDs, Mem) and the non-terminal pods the API server has bound there.
On every node, at every sample: jobs + pods <= capacity.  At the end
nothing is stuck: every pod was bound or refused, every job started.

No kube-scheduler binary can be had here (DESIGN.md §8):
pyk8sres.testbed.scheduler drives the API server the way it does.

CI runs a bounded version (PYK8SRES_CHURN_SECONDS, default 60 s of churn); a soak by
hand:  PYK8SRES_CHURN_SECONDS=1800 python3 -m pytest -s tests/integration/test_churn.py
"""
import glob
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from fractions import Fraction

import pytest

from conftest_kube import pick_ports
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.coordinator import kube as K
from pyk8sres.policy import usage as U
from pyk8sres.testbed import cluster, hybrid
from pyk8sres.testbed.scheduler import Scheduler

pytestmark = requires_slurm
NODES, CPUS, MEMORY = 3, 8, 16000
SECONDS = float(os.environ.get("PYK8SRES_CHURN_SECONDS", "60"))
NAMESPACE = "churn"
PLACEHOLDERS = "pyk8sres-system"     # Slurm's own share as kube-scheduler sees it
# Liveness after the churn.  The churn leaves a backlog (jobs are submitted
# near the cluster's capacity: 60 s of churn leave 1.5-2 minutes of jobs).  A
# queue is stuck when no pending job starts for longer than a job can run:
# each has a 1-minute limit (plus KillWait 5 s and a scheduling pass).
STALL_SECONDS = 90


def _expand(hostlist: str) -> list[str]:
    m = re.fullmatch(r"(\w+?)\[([\d,\-]+)\]", hostlist)
    if not m:
        return hostlist.split(",")
    out = []
    for part in m.group(2).split(","):
        a, _, b = part.partition("-")
        out += [f"{m.group(1)}{i}" for i in range(int(a), int(b or a) + 1)]
    return out


def _ids(cpu_ids: str) -> int:
    return sum(int(b) - int(a) + 1 for a, _, b in
               (p.partition("-") if "-" in p else (p, "", p) for p in cpu_ids.split(",")))


def stepd_jobs() -> set[str]:
    """Job ids that have a slurmstepd on this host: jobs really running."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                m = re.match(rb"slurmstepd: \[(\d+)\.", f.read())
        except OSError:
            continue
        if m:
            out.add(m.group(1).decode())
    return out


def slurm_truth(env, restarted_at: float = 0.0) -> dict[str, list[int]]:
    """node -> [CPUs, MB] that slurmctld has allocated to running jobs.

    One exception, a phantom: a job that ended while slurmctld was being
    killed -9 is recovered from its older state file as RUNNING (with no
    process left) until slurmd next reports; it holds nothing.  A job is
    such a phantom only if it started before the last slurmctld restart and
    no slurmstepd of it exists."""
    out = subprocess.run(["scontrol", "-d", "-o", "show", "job"], capture_output=True, text=True,
                         env=env, timeout=30).stdout
    alive = stepd_jobs() if restarted_at else set()
    used = {f"n{i}": [0, 0] for i in range(1, NODES + 1)}
    for line in out.splitlines():
        if "JobState=RUNNING" not in line:
            continue
        job = re.search(r"JobId=(\d+)", line).group(1)
        start = re.search(r"StartTime=(\S+)", line).group(1)
        if restarted_at and job not in alive and start != "Unknown" and \
                time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) < restarted_at:
            continue
        for nodes, ids, mem in re.findall(r" Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)", line):
            for n in _expand(nodes):
                if n in used:
                    used[n][0] += _ids(ids)
                    used[n][1] += int(mem)
    return used


def bound_pods(kube) -> dict[str, tuple[str, Fraction, int]]:
    """uid -> (node, cpu, bytes) of every non-terminal pod bound to a node."""
    out = {}
    for p in K.list_pods(kube):
        node = (p.get("spec") or {}).get("nodeName")
        if not node or p["metadata"]["namespace"] == PLACEHOLDERS or \
                (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        r = U.pod_requests(p)
        out[p["metadata"]["uid"]] = (node, r["cpu"], int(r["memory"]))
    return out


def pending_jobs(env) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-t", "PD", "-o", "%i %r"], capture_output=True,
                         text=True, env=env).stdout
    return [line for line in out.split("\n") if line.strip()]


def held_after_a_refused_second_copy(c, pending: list[str]) -> list[str]:
    """Pending jobs Slurm itself held in its kill -9 window (seen once in CI):
    slurmctld, killed -9 just after it launched a batch job, recovers the job,
    sees it end, and launches it again while slurmd still has the first copy.
    slurmd refuses ("Job N already running, do not launch second copy",
    slurmd/req.c) and slurmctld requeues the job held ("launch failed
    requeued held").  Only jobs with that reason AND that slurmd log line."""
    logs = ""
    for path in glob.glob(os.path.join(c.work, "log", "slurmd-*.log")):
        with open(path, errors="replace") as f:
            logs += f.read()
    out = []
    for line in pending:
        job, _, reason = line.partition(" ")
        if reason != "launch failed requeued held":
            continue
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                               text=True, env=c.env).stdout
        found = re.search(r"JobId=(\d+)", shown)
        if found and f"Job {found.group(1)} already running, do not launch second copy" in logs:
            out.append(job)
    return out


def drain(env) -> list[str]:
    """Wait while the queue drains.  Returns the jobs still pending when it
    stops draining (nothing started for STALL_SECONDS).  Nothing is submitted
    any more, so this ends, however long a soak's backlog is."""
    pending, progressed = pending_jobs(env), time.monotonic()
    while pending and time.monotonic() < progressed + STALL_SECONDS:
        time.sleep(1)
        now = pending_jobs(env)
        if {p.split()[0] for p in pending} - {p.split()[0] for p in now}:
            progressed = time.monotonic()     # a job left the queue: it started
        pending = now
    return pending


class Churn:
    def __init__(self, c, kas, kube, seed: int):
        self.c, self.kas, self.kube = c, kas, kube
        self.rnd = random.Random(seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.jobs: list[str] = []
        self.sruns: list[subprocess.Popen] = []
        self.counts = {"pods admitted": 0, "pods refused": 0, "pod create errors": 0,
                       "jobs submitted": 0, "sruns": 0, "faults": 0, "samples": 0}
        self.violations: list[str] = []
        self.ctld_restarted_at = 0.0
        self.faults: list[str] = []

    # --- the workload -------------------------------------------------------
    def submit_jobs(self):
        while not self.stop.wait(self.rnd.uniform(0.2, 0.6)):
            cpus, mem = self.rnd.randint(1, 4), self.rnd.choice([100, 500, 1000, 2000, 4000])
            secs = self.rnd.randint(1, 6)
            kind = self.rnd.random()
            try:
                if kind < 0.15:
                    with self.lock:
                        self.counts["sruns"] += 1
                        name = f"churn-srun-{self.counts['sruns']}"
                    p = subprocess.Popen(["srun", "-J", name, "-t", "1", "-c", str(cpus),
                                          f"--mem={mem}", "sleep", str(secs)], env=self.c.env,
                                         cwd="/tmp", stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
                    with self.lock:
                        self.sruns.append((name, p))
                    continue
                extra = ["--array=0-2"] if kind < 0.3 else []
                out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-t", "1",
                                      "-c", str(cpus),
                                      f"--mem={mem}", *extra, "--wrap", f"sleep {secs}"],
                                     capture_output=True, text=True, env=self.c.env, timeout=30,
                                     cwd="/tmp")
                if out.returncode == 0:
                    with self.lock:
                        self.jobs.append(out.stdout.strip().split(";")[0])
                        self.counts["jobs submitted"] += 1
            except subprocess.TimeoutExpired:
                pass    # slurmctld being killed: submissions may time out

    def _pod(self, name: str, node: str | None) -> dict:
        cpu = self.rnd.choice(["250m", "500m", "1", "1500m", "2", "3"])
        mem = self.rnd.choice(["128Mi", "512Mi", "1Gi", "2Gi", "4Gi"])
        spec = {"containers": [{"name": "c", "image": "x",
                                "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
        if node:
            spec["nodeName"] = node
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    def create_pods(self):
        i = 0
        while not self.stop.wait(self.rnd.uniform(0.1, 0.4)):
            i += 1
            direct = self.rnd.random() < 0.5
            node = f"n{self.rnd.randint(1, NODES)}" if direct else None
            try:
                K.create_pod(self.kube, NAMESPACE, self._pod(f"p{i}", node))
                if direct:
                    with self.lock:
                        self.counts["pods admitted"] += 1
            except K.ApiException as e:
                key = "pods refused" if direct and e.status in (400, 403, 500) else \
                    "pod create errors"
                with self.lock:
                    self.counts[key] += 1
            except Exception:
                with self.lock:
                    self.counts["pod create errors"] += 1   # API server restarting

    def delete_pods(self):
        while not self.stop.wait(self.rnd.uniform(0.5, 1.5)):
            try:
                pods = K.list_pods(self.kube, NAMESPACE)
                for p in self.rnd.sample(pods, min(len(pods), self.rnd.randint(0, 4))):
                    K.delete_pod(self.kube, NAMESPACE, p["metadata"]["name"])
            except Exception:
                pass

    # --- the invariant ------------------------------------------------------
    def check(self):
        while not self.stop.wait(0.2):
            try:
                # Pods bound at t1 and still at t3 were bound at t2, when
                # slurmctld was asked: no false alarm from pods coming or going.
                before = bound_pods(self.kube)
                jobs = slurm_truth(self.c.env, self.ctld_restarted_at)
                after = bound_pods(self.kube)
            except Exception:
                continue
            self.counts["samples"] += 1
            pods = {n: [Fraction(0), 0] for n in jobs}
            for uid in before.keys() & after.keys():
                node, cpu, mem = after[uid]
                if node in pods:
                    pods[node][0] += cpu
                    pods[node][1] += mem
            for node, (jc, jm) in jobs.items():
                pc, pm = math.ceil(pods[node][0]), math.ceil(pods[node][1] / (1 << 20))
                if jc + pc > CPUS or jm + pm > MEMORY:
                    self.violations.append(f"{time.strftime('%T')} {node}: jobs {jc} CPUs "
                                           f"{jm} MB + pods {pc} CPUs {pm} MB > {CPUS}/{MEMORY}")

    # --- faults -------------------------------------------------------------
    def _restart(self, name: str, how=signal.SIGKILL, pause: float = 1.0):
        pid_file = os.path.join(self.c.work, "run", f"proc-{name}.pid")
        pid = int(open(pid_file).read())
        argv = open(f"/proc/{pid}/cmdline", "rb").read().rstrip(b"\0").split(b"\0")
        env = dict(self.c.env, PYTHONUNBUFFERED="1")
        os.kill(pid, how)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            while cluster.alive(pid):
                time.sleep(0.05)
        time.sleep(pause)
        cluster.start_process(self.c.work, name, [a.decode() for a in argv], env=env)

    def _slurmctld_restart(self):
        self.ctld_restarted_at = time.time()
        self._restart("slurmctld")
        self.c._wait(self.c._ctld_up, "slurmctld", 30)

    def _webhook_unreachable(self):
        pid = int(open(os.path.join(self.c.work, "run", "proc-webhook.pid")).read())
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(pid, signal.SIGCONT)

    def _apiserver_restart(self):
        workdir, port_ = self.kas.workdir, self.kas.port
        self.kas.stop()
        time.sleep(1)
        self.kas.start(workdir, port_)

    def inject(self):
        faults = [
            ("webhook unreachable (SIGSTOP 4 s)", self._webhook_unreachable),
            ("coordinator kill -9 + restart",
             lambda: (self._restart("sync"), self._restart("webhook"))),
            ("slurmctld kill -9 + restart", self._slurmctld_restart),
            ("scontrol reconfigure", lambda: subprocess.run(
                ["scontrol", "reconfigure"], env=self.c.env, capture_output=True, timeout=60)),
            # A partition update makes Slurm rebuild allocations from jobs;
            # MaxTime stays unlimited (the jobs have no time limit).
            ("partition update", lambda: subprocess.run(
                ["scontrol", "update", "PartitionName=debug", "MaxTime=UNLIMITED"],
                env=self.c.env, capture_output=True, timeout=60)),
            ("API server restart", self._apiserver_restart),
        ]
        gap = SECONDS / (len(faults) + 1)
        while not self.stop.is_set():
            for name, fault in faults:
                if self.stop.wait(gap):
                    return
                fault()
                with self.lock:
                    self.faults.append(f"{time.strftime('%T')} {name}")
                    self.counts["faults"] += 1


@pytest.fixture(scope="module")
def world(kube_paths):
    work = tempfile.mkdtemp(prefix="pyk8sres-churn-")
    # Time limits as a site has them: an srun whose allocation answer died
    # with a kill -9'd slurmctld waits forever, its allocation ends at the limit.
    c, kas = hybrid.up(work, nodes=NODES, cpus=CPUS, memory=MEMORY, base_port=port(17450),
                       kube_port=pick_ports(27800, 27990), extra_conf="KillWait=5\n",
                       slurm=SLURM)
    kube = K.Kube(kas.kubeconfig, None, 10)
    kube.core.create_namespace({"metadata": {"name": NAMESPACE}}, _preload_content=False)
    try:
        yield c, kas, kube
    finally:
        hybrid.down(work)


def test_churn_with_faults_never_double_books(world):
    c, kas, kube = world
    churn = Churn(c, kas, kube, seed=int(os.environ.get("PYK8SRES_CHURN_SEED", "8")))
    sched = Scheduler(kube, namespace=NAMESPACE).start(period=0.2)
    workers = [threading.Thread(target=f, daemon=True) for f in
               (churn.submit_jobs, churn.create_pods, churn.delete_pods, churn.check,
                churn.inject)]
    for w in workers:
        w.start()
    time.sleep(SECONDS)
    churn.stop.set()
    for w in workers:
        w.join(120)
    sched.stop()

    # Nothing stuck: with the pods gone, every job starts (or has run).
    for p in K.list_pods(kube, NAMESPACE):
        K.delete_pod(kube, NAMESPACE, p["metadata"]["name"])
    drain_started = time.monotonic()
    pending = drain(c.env)
    # Jobs Slurm held itself after its kill -9 window hold nothing; released,
    # they must run like every other job.
    refused_copies = held_after_a_refused_second_copy(c, pending)
    if refused_copies:
        subprocess.run(["scontrol", "release", *refused_copies], env=c.env, check=True,
                       capture_output=True)
        pending = drain(c.env)
    drained_in = time.monotonic() - drain_started
    deadline = time.monotonic() + STALL_SECONDS
    lost = 0
    for name, p in churn.sruns:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            known = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True,
                                   text=True, env=c.env).stdout.strip()
            if known:
                pending.append(f"srun {name} (job {known})")
            else:
                # Its job was accepted by a slurmctld killed -9 before it
                # saved its state: srun waits for an answer that never comes.
                # Slurm's own window, not a stuck job; nothing holds resources.
                lost += 1
                p.kill()
                p.wait()
    states = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True,
                            env=c.env).stdout
    started = len(re.findall(r"JobState=(?:COMPLETED|RUNNING|COMPLETING)", states))
    summary = dict(churn.counts, **{"pods bound by the scheduler": sched.stats.bound,
                                    "bindings refused": sched.stats.denied,
                                    "jobs started (still known to slurmctld)": started,
                                    "sruns whose job died with slurmctld's kill -9": lost,
                                    "jobs Slurm held after slurmd refused a second copy "
                                    "(released, then ran)": len(refused_copies),
                                    "seconds the backlog took to run": round(drained_in),
                                    "violations": len(churn.violations)})
    print("\nchurn summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    print("faults: " + "; ".join(churn.faults))
    assert not churn.violations, churn.violations[:20]
    if pending:
        ledger = subprocess.run([sys.executable, "-m", "pyk8sres", "ledger", "show"],
                                capture_output=True, text=True, env=c.env).stdout
        jobs = subprocess.run(["squeue", "-o", "%i %T %C %m %N %r %b %S"], capture_output=True,
                              text=True, env=c.env).stdout
        first = subprocess.run(["scontrol", "-d", "show", "job", pending[0].split()[0]],
                               capture_output=True, text=True, env=c.env).stdout
        nodes = subprocess.run(["scontrol", "-d", "show", "node"], capture_output=True,
                               text=True, env=c.env).stdout
        pytest.fail(f"stuck after the churn: {pending}\nledger:\n{ledger}\njobs:\n{jobs}\n"
                    f"{first}\n{nodes}\nsync log: {c.log_tail('sync.out', 10)}\n"
                    f"daemon logs kept in {c.work}/log")
    # The churn really churned, and the faults really happened.
    assert churn.counts["samples"] > 50 and churn.counts["faults"] >= 6
    assert sched.stats.bound + churn.counts["pods admitted"] > 10
    assert churn.counts["pods refused"] + sched.stats.denied > 0
    assert started > 10
