"""What is really allocated, for the integration tests' invariants, never our
own state: Slurm's running jobs (`scontrol -d show job`: CPU_IDs and Mem per
node) and the pods the API server has bound (non-terminal, Terminating
included: a Terminating pod runs until its grace period ends)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import time
from fractions import Fraction

from pyk8sres.coordinator import kube as K
from pyk8sres.policy import placeholder as P
from pyk8sres.policy import usage as U
from pyk8sres.testbed import cluster

PLACEHOLDERS = "pyk8sres-placeholders"   # Slurm's own share as kube-scheduler sees it


def expand(hostlist: str) -> list[str]:
    m = re.fullmatch(r"(\w+?)\[([\d,\-]+)\]", hostlist)
    if not m:
        return hostlist.split(",")
    out = []
    for part in m.group(2).split(","):
        a, _, b = part.partition("-")
        out += [f"{m.group(1)}{i}" for i in range(int(a), int(b or a) + 1)]
    return out


def count_ids(cpu_ids: str) -> int:
    return sum(int(b) - int(a) + 1 for a, _, b in
               (p.partition("-") if "-" in p else (p, "", p) for p in cpu_ids.split(",")))


def stepd_jobs(env) -> set[str]:
    """Job ids that have a slurmstepd in this cluster: jobs really running.
    A slurmstepd listens on SlurmdSpoolDir/<node>_<job>.<step> while it
    lives (as cluster.cluster_processes finds them); the command line
    ("slurmstepd: [7.batch]") would not do, since another test cluster on
    this host (CI runs two) has job 7 too."""
    with open(env["SLURM_CONF"]) as f:
        spool = re.search(r"^SlurmdSpoolDir=(\S+)", f.read(), re.M | re.I).group(1)
    root = os.path.dirname(spool) if "%n" in spool else spool
    return {m.group(1) for path in cluster.unix_sockets_under(root)
            if (m := re.search(r"_(\d+)\.\d+$", path))}


def slurm_jobs(env, nodes, restarted_at: float = 0.0) -> dict[str, list[int]]:
    """node -> [CPUs, MB] that slurmctld has allocated to running jobs.

    One exception, a phantom: a job that ended while slurmctld was being
    killed -9 is recovered from its older state file as RUNNING (with no
    process left) until slurmd next reports; it holds nothing.  A job is
    such a phantom only if it started before the last slurmctld restart
    (restarted_at, epoch seconds) and no slurmstepd of it exists."""
    out = subprocess.run(["scontrol", "-d", "-o", "show", "job"], capture_output=True, text=True,
                         env=env, timeout=30).stdout
    alive = stepd_jobs(env) if restarted_at else set()
    used = {n: [0, 0] for n in nodes}
    for line in out.splitlines():
        if "JobState=RUNNING" not in line:
            continue
        job = re.search(r"JobId=(\d+)", line).group(1)
        start = re.search(r"StartTime=(\S+)", line).group(1)
        if restarted_at and job not in alive and start != "Unknown" and \
                time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) < restarted_at:
            continue
        for hosts, ids, mem in re.findall(r" Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)", line):
            for n in expand(hosts):
                if n in used:
                    used[n][0] += count_ids(ids)
                    used[n][1] += int(mem)
    return used


def bound_pods(kube) -> dict[str, tuple[str, Fraction, int]]:
    """uid -> (node, CPUs, bytes) of every non-terminal pod bound to a node
    (Terminating ones included), placeholders left out."""
    out = {}
    for p in K.list_pods(kube):
        node = (p.get("spec") or {}).get("nodeName")
        if not node or p["metadata"]["namespace"] == PLACEHOLDERS or \
                (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        r = U.pod_requests(p)
        out[p["metadata"]["uid"]] = (node, r["cpu"], int(r["memory"]))
    return out


def over_capacity(env, kube, capacity: dict[str, tuple[int, int]],
                  restarted_at: float = 0.0) -> list[str]:
    """Nodes where running jobs + bound pods exceed (CPUs, MB), now.  Pods
    bound before and after slurmctld is asked were bound meanwhile: no false
    alarm from pods coming or going during the sample."""
    before = bound_pods(kube)
    jobs = slurm_jobs(env, capacity, restarted_at)
    after = bound_pods(kube)
    pods = {n: [Fraction(0), 0] for n in capacity}
    for uid in before.keys() & after.keys():
        node, cpu, mem = after[uid]
        if node in pods:
            pods[node][0] += cpu
            pods[node][1] += mem
    out = []
    for node, (cpus, mb) in capacity.items():
        jc, jm = jobs[node]
        pc, pm = math.ceil(pods[node][0]), math.ceil(pods[node][1] / (1 << 20))
        if jc + pc > cpus or jm + pm > mb:
            out.append(f"{time.strftime('%T')} {node}: jobs {jc} CPUs {jm} MB + pods {pc} CPUs "
                       f"{pm} MB > {cpus}/{mb}")
    return out


def scheduler_view(kube) -> dict[str, tuple[int, int]]:
    """node -> (millicores, bytes) kube-scheduler counts for the placeholders
    there (policy.placeholder.counted: its rules for a pod's requests)."""
    out: dict[str, tuple[int, int]] = {}
    for p in K.list_namespace_pods(kube, PLACEHOLDERS):
        node = (p.get("spec") or {}).get("nodeName")
        if node and P.current(p) is not None:
            c, m = P.counted(p)
            have = out.get(node, (0, 0))
            out[node] = (have[0] + c, have[1] + m)
    return out


def scheduler_cache(kube, timeout: float = 5.0) -> dict[str, tuple[int, int]]:
    """node -> (millicores, bytes) the running kube-scheduler itself has
    counted as requested there (its cache, every pod placeholders included),
    from the dump it logs on SIGUSR2 (pkg/scheduler/backend/cache/debugger)."""
    log = kube.log_path("kube-scheduler")
    with open(os.path.join(kube.work, "run", "proc-kube-scheduler.pid")) as f:
        pid = int(f.read())
    start = os.path.getsize(log)
    os.kill(pid, 12)                                   # SIGUSR2
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            f.seek(start)
            text = f.read()
        dump, found, rest = text.partition('"Dump of cached NodeInfo"')
        if found and "\n >" in rest:
            body = rest.split("\n >", 1)[0]
            return {name: (int(cpu), int(mem)) for name, cpu, mem in re.findall(
                r"Node name: (\S+)\n\s*Deleted: \w+\n\s*Requested Resources: "
                r"&\{MilliCPU:(\d+) Memory:(\d+)", body)}
        time.sleep(0.02)
    raise AssertionError(f"kube-scheduler logged no cache dump in {timeout} s ({log})")
