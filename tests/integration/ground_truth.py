"""What is really allocated, for the integration tests' invariants, never our
own state: Slurm's jobs that hold CPUs (`scontrol -d show job`: CPU_IDs and
Mem per node; RUNNING ones, and COMPLETING ones while their processes still
run) and the pods the API server has bound (non-terminal, Terminating
included: a Terminating pod runs until its grace period ends), sized here by
Kubernetes' rules written afresh (pod_size), not by pyk8sres's own
arithmetic, so a bug there shows as a violation.

A sample that cannot read Slurm or the API server raises Unreadable: it is
never a clean sample (no jobs seen is not the same as none running)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import time
from fractions import Fraction

import urllib3

from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.policy import placeholder
from pyk8sres.testbed.stress import stepd_jobs  # noqa: F401 - ledger_checks uses it too

PLACEHOLDERS = "pyk8sres-placeholders"   # Slurm's own share as kube-scheduler sees it


class Unreadable(Exception):
    """A sample could not be taken: `side` ("slurm" or "kubernetes") gave
    no answer, or an error."""

    def __init__(self, side: str, detail: str):
        super().__init__(f"{side}: {detail}")
        self.side, self.detail = side, detail


# Kubernetes quantities: <number>[<suffix> | e<exponent>].
_SCALE = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
          "Ei": 1 << 60}


def quantity(value) -> Fraction:
    """'250m' -> 1/4, '1Gi' -> 2**30, '1e3' -> 1000, 2 -> 2."""
    m = re.fullmatch(r"([+-]?[\d.]+)(?:[eE]([+-]?\d+)|([KMGTPE]i|[numkMGTPE])?)",
                     str(value).strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    number = Fraction(m.group(1))
    return number * 10 ** int(m.group(2)) if m.group(2) else number * _SCALE[m.group(3) or ""]


def _requests(resources) -> dict[str, Fraction]:
    return {r: quantity(v) for r, v in ((resources or {}).get("requests") or {}).items()
            if r in ("cpu", "memory")}


def _larger(*lists) -> dict[str, Fraction]:
    return {r: max(x.get(r, Fraction(0)) for x in lists) for r in ("cpu", "memory")}


def _plus(a: dict, b: dict) -> dict[str, Fraction]:
    return {r: a.get(r, Fraction(0)) + b.get(r, Fraction(0)) for r in ("cpu", "memory")}


def pod_size(pod: dict) -> tuple[Fraction, Fraction]:
    """(CPUs, bytes) a bound pod may use, by Kubernetes' rules: each
    container at the largest of its spec and what its kubelet reports (the
    resources it runs with, allocatedResources), so a resize either way
    counts at its larger side until the kubelet has applied it; the spec of
    a resize the kubelet called Infeasible is left out (never applied).  App
    containers and sidecars (init containers that keep running) add up; an
    init container runs beside the sidecars started before it; pod-level
    requests, when larger, stand for the containers; overhead adds."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    reported = {c.get("name"): c for c in (status.get("containerStatuses") or []) +
                (status.get("initContainerStatuses") or [])}
    infeasible = any(c.get("type") == "PodResizePending" and c.get("reason") == "Infeasible"
                     for c in status.get("conditions") or [])

    def size(c):
        st = reported.get(c.get("name")) or {}
        ran = [_requests(st.get("resources")),
               _larger({r: quantity(v) for r, v in (st.get("allocatedResources") or {}).items()
                        if r in ("cpu", "memory")})]
        if infeasible and st.get("resources") is not None:
            return _larger(*ran)
        return _larger(_requests(c.get("resources")), *ran)

    running = {}                  # app containers and the sidecars so far
    init_peak = {}
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            running = _plus(running, size(c))
            init_peak = _larger(init_peak, running)
        else:
            init_peak = _larger(init_peak, _plus(running, size(c)))
    for c in spec.get("containers") or []:
        running = _plus(running, size(c))
    total = _larger(running, init_peak, _requests(spec.get("resources")))
    total = _plus(total, {r: quantity(v) for r, v in (spec.get("overhead") or {}).items()
                          if r in ("cpu", "memory")})
    return total["cpu"], total["memory"]


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


def _holding_jobs(env, restarted_at: float) -> list[str]:
    """The `scontrol -d -o show job` lines of the jobs that hold resources
    now (see slurm_jobs).  Raises Unreadable when slurmctld does not answer."""
    argv = ["scontrol", "-d", "-o", "show", "job"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    except subprocess.TimeoutExpired:
        raise Unreadable("slurm", f"{' '.join(argv)}: no answer in 30 s") from None
    if proc.returncode != 0:
        raise Unreadable("slurm", f"{' '.join(argv)}: exit {proc.returncode}: "
                                  f"{proc.stderr.strip()[:300]}")
    lines = [line for line in proc.stdout.splitlines()
             if re.search(r"JobState=(RUNNING|COMPLETING)\b", line)]
    # Listed after scontrol answered: a slurmstepd still here was there then.
    alive = stepd_jobs(env) if restarted_at or any("JobState=COMPLETING" in x for x in lines) \
        else set()
    held = []
    for line in lines:
        job = re.search(r"JobId=(\d+)", line).group(1)
        if "JobState=COMPLETING" in line and job not in alive:
            continue
        if job not in alive and _started_before(line, restarted_at):
            continue
        held.append(line)
    return held


def _started_before(line: str, restarted_at: float) -> bool:
    """Did the job of a `scontrol -o show job` line start before the last
    slurmctld restart (restarted_at, 0: none)?"""
    start = re.search(r"StartTime=(\S+)", line).group(1)
    return bool(restarted_at) and start != "Unknown" and \
        time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) < restarted_at


def slurm_jobs(env, nodes, restarted_at: float = 0.0) -> dict[str, list[int]]:
    """node -> [CPUs, MB] that Slurm's jobs hold: RUNNING ones, and
    COMPLETING ones whose slurmstepd still lives (their processes run until
    killed, up to KillWait; Slurm starts no job on such a node meanwhile,
    but its GRES are freed at once).  Raises Unreadable when slurmctld does
    not answer.

    One exception, a phantom: a job that ended while slurmctld was being
    killed -9 is recovered from its older state file as RUNNING (with no
    process left) until slurmd next reports; it holds nothing.  A job is
    such a phantom only if it started before the last slurmctld restart
    (restarted_at, epoch seconds) and no slurmstepd of it exists."""
    used = {n: [0, 0] for n in nodes}
    for line in _holding_jobs(env, restarted_at):
        for hosts, ids, mem in re.findall(r" Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)", line):
            for n in expand(hosts):
                if n in used:
                    used[n][0] += count_ids(ids)
                    used[n][1] += int(mem)
    return used


def all_pods(kube) -> list[dict]:
    """Every pod the API server has.  Raises Unreadable when it does not answer."""
    try:
        return kube_calls.list_pods(kube)
    except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
        raise Unreadable("kubernetes", f"list pods: {type(e).__name__}: {e}"[:300]) from None


def bound_pods(kube, pods: list[dict] | None = None) -> dict[str, tuple[str, Fraction, int]]:
    """uid -> (node, CPUs, bytes) of every non-terminal pod bound to a node
    (Terminating ones included), placeholders left out; of `pods` when
    given, else of what the API server has now.  Raises Unreadable when the
    API server does not answer."""
    pods = all_pods(kube) if pods is None else pods
    out = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if not node or p["metadata"]["namespace"] == PLACEHOLDERS or \
                (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        cpu, memory = pod_size(p)
        out[p["metadata"]["uid"]] = (node, cpu, math.ceil(memory))
    return out


def over_capacity(env, kube, capacity: dict[str, tuple[int, int]],
                  restarted_at: float = 0.0, still_running=None) -> list[str]:
    """Nodes where Slurm's jobs + bound pods exceed (CPUs, MB), now.  Pods
    bound before and after slurmctld is asked were bound meanwhile: no false
    alarm from pods coming or going during the sample.  still_running:
    {node: (cpus, bytes)} of pods the API server no longer has whose
    containers their kubelet may still run (force-deleted within their grace
    period).  Raises Unreadable when either side cannot be read."""
    before = bound_pods(kube)
    jobs = slurm_jobs(env, capacity, restarted_at)
    after = bound_pods(kube)
    pods = {n: [Fraction(0), 0] for n in capacity}
    for node, (cpu, mem) in (still_running or {}).items():
        if node in pods:
            pods[node][0] += cpu
            pods[node][1] += mem
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


def pod_named_node(p: dict) -> str:
    """ACK's layout: a worker pod is named as its Slurm node."""
    return p["metadata"]["name"]


def worker_hosts(pods: list[dict], namespace: str, names, slurm_name=pod_named_node
                 ) -> dict[str, set[str]]:
    """Kubernetes node -> the Slurm nodes whose worker pod (in `namespace`,
    slurm_name(pod) its Slurm node) is bound there and not finished,
    Terminating ones included (their slurmd may still run jobs)."""
    out: dict[str, set[str]] = {}
    for p in pods:
        meta, node = p["metadata"], (p.get("spec") or {}).get("nodeName")
        if meta["namespace"] == namespace and slurm_name(p) in names and node and \
                (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            out.setdefault(node, set()).add(slurm_name(p))
    return out


def workers_over_capacity(env, kube, capacity: dict[str, tuple[int, int]],
                          namespace: str, still_running=None,
                          crowded: list | None = None, slurm_name=pod_named_node) -> list[str]:
    """Slurm in Kubernetes: Slurm nodes (capacity: Slurm node -> (CPUs, MB))
    where Slurm's jobs + the pods bound on the Kubernetes node their worker
    pod runs on (the workers themselves left out) exceed it, now.  A pod
    counts on the Slurm nodes whose worker ran beside it when the API server
    was asked before or after slurmctld (a worker moving counts on both).
    still_running: as over_capacity's, by Kubernetes node.  Pods alone over
    a Slurm node, no job there, are no double booking: pods bound while no
    worker ran on their node were admitted against nothing, and a worker
    coming back finds them (the ledger holds them, clamped, and no job
    starts there until they leave); such samples go to `crowded`.
    slurm_name: a worker pod's Slurm node (Slinky's: its hostname label).
    Raises Unreadable when either side cannot be read."""
    first = all_pods(kube)
    jobs = slurm_jobs(env, capacity)
    second = all_pods(kube)
    hosts: dict[str, set[str]] = {}
    for listing in (first, second):
        for k, names in worker_hosts(listing, namespace, capacity, slurm_name).items():
            hosts.setdefault(k, set()).update(names)
    workers = {p["metadata"]["uid"] for p in first + second
               if p["metadata"]["namespace"] == namespace and slurm_name(p) in capacity}
    before, after = bound_pods(kube, first), bound_pods(kube, second)
    pods = {s: [Fraction(0), 0] for s in capacity}
    running = [after[uid] for uid in (before.keys() & after.keys()) - workers]
    for node, cpu, mem in running + [(k, c, m) for k, (c, m) in (still_running or {}).items()]:
        for s in hosts.get(node, ()):
            pods[s][0] += cpu
            pods[s][1] += mem
    out = []
    for s, (cpus, mb) in capacity.items():
        jc, jm = jobs[s]
        pc, pm = math.ceil(pods[s][0]), math.ceil(pods[s][1] / (1 << 20))
        if jc + pc > cpus or jm + pm > mb:
            text = (f"{time.strftime('%T')} {s} (on "
                    f"{sorted(k for k, v in hosts.items() if s in v)}): jobs {jc} CPUs {jm} MB "
                    f"+ pods {pc} CPUs {pm} MB > {cpus}/{mb}")
            if jc or jm:
                out.append(text)
            elif crowded is not None:
                crowded.append(text)
    return out


def scheduler_view(kube) -> dict[str, tuple[int, int]]:
    """node -> (millicores, bytes) kube-scheduler counts for the placeholders
    there (policy.placeholder.counted: its rules for a pod's requests)."""
    out: dict[str, tuple[int, int]] = {}
    for p in kube_calls.list_namespace_pods(kube, PLACEHOLDERS):
        node = (p.get("spec") or {}).get("nodeName")
        if node and placeholder.current(p) is not None:
            c, m = placeholder.counted(p)
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


# --- GPUs: which device each side holds, index by index ----------------------
# Slurm: `scontrol -d -o show job` gives each node of a job as
# " Nodes=n1 CPU_IDs=0 Mem=100 GRES=gpu:1(IDX:0),k8scpu(CNT:1),..." (typed:
# gpu:a100:2(IDX:0-1); several: IDX:0-1,3).  Kubernetes: a claim's
# status.allocation names (driver, pool, device); the ResourceSlice of that
# pool gives the device's node and its `index` attribute, the number Slurm's
# IDX counts on that node (the test cluster publishes them so: testbed/gpus.py).
GPU_DRIVER = "gpu.nvidia.com"
_NODE_GRES = re.compile(r" Nodes=(\S+) CPU_IDs=\S+ Mem=\d+ GRES=(\S*)")
_GPU_IDX = re.compile(r"(?:^|,)gpu(?::[^:(),]+)?:\d+\(IDX:([^)]*)\)")


def index_set(text: str) -> set[int]:
    """'0-1,3' -> {0, 1, 3}; 'N/A' or '' -> set()."""
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        if a.isdigit() and (not b or b.isdigit()):
            out.update(range(int(a), int(b or a) + 1))
    return out


def job_gpus(line: str) -> dict[str, set[int]]:
    """node -> the GPU indices one job holds there, from its line of
    `scontrol -d -o show job`."""
    out: dict[str, set[int]] = {}
    for hosts, gres in _NODE_GRES.findall(line):
        held = set().union(*(index_set(m.group(1)) for m in _GPU_IDX.finditer(gres)))
        for n in expand(hosts) if held else ():
            out.setdefault(n, set()).update(held)
    return out


def slurm_gpus(env, restarted_at: float = 0.0,
               running: set[str] | None = None) -> dict[str, dict[int, set[str]]]:
    """node -> GPU index -> ids of the RUNNING jobs holding it (slurm_jobs's
    rules).  A COMPLETING job's GPUs count through its processes
    (process_gpus), not through a slurmstepd of its ID: after a kill -9 of
    slurmctld a job ID may be allocated again while the slurmstepd of its
    first run still lives (slurmd then refuses the launch, "Duplicate
    jobid", and the job completes at once without running on its new
    GPUs), so that slurmstepd says nothing of the new IDX.  So does a job
    started before the last restart (running: the ids whose processes run
    now, when known): one that ended while slurmctld was down is recovered
    RUNNING, its slurmstepd lingering to report the end, and nothing of it
    runs on its GPUs."""
    out: dict[str, dict[int, set[str]]] = {}
    for line in _holding_jobs(env, restarted_at):
        if "JobState=RUNNING" not in line:
            continue
        job = re.search(r"JobId=(\d+)", line).group(1)
        if running is not None and job not in running and _started_before(line, restarted_at):
            continue
        for node, held in job_gpus(line).items():
            for i in held:
                out.setdefault(node, {}).setdefault(i, set()).add(job)
    return out


def process_gpus(conf: str, proc: str = "/proc") -> dict[str, dict[int, set[str]]]:
    """node -> GPU index -> "<job id>(processes)" for each job whose
    processes run now on this host with GPUs: a batch job's processes carry
    SLURM_JOB_ID, SLURMD_NODENAME and SLURM_JOB_GPUS (Slurm's global
    indices) in their environment, and the SLURM_CONF sbatch had (this
    cluster's: other test clusters on the host are left out).  What really
    runs, whatever slurmctld says: a job it forgot (killed -9 before it
    saved the job) runs until slurmd next registers and is told to kill it,
    and its ID may meanwhile be given to another job."""
    want = f"SLURM_CONF={conf}".encode()
    out: dict[str, dict[int, set[str]]] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/environ", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if want not in data:
            continue
        env = dict(v.split(b"=", 1) for v in data.split(b"\0") if b"=" in v)
        if env.get(b"SLURM_CONF") != conf.encode() or b"SLURM_JOB_ID" not in env:
            continue
        node = env.get(b"SLURMD_NODENAME", b"?").decode()
        job = f"{env[b'SLURM_JOB_ID'].decode()}(processes)"
        for i in index_set(env.get(b"SLURM_JOB_GPUS", b"").decode()):
            out.setdefault(node, {}).setdefault(i, set()).add(job)
    return out


def merge_gpus(*sides: dict[str, dict[int, set[str]]]) -> dict[str, dict[int, set[str]]]:
    """The union of node -> index -> holders maps."""
    out: dict[str, dict[int, set[str]]] = {}
    for side in sides:
        for node, held in side.items():
            for i, who in held.items():
                out.setdefault(node, {}).setdefault(i, set()).update(who)
    return out


def slice_devices(slices: list[dict]) -> dict[tuple[str, str], tuple[str, int]]:
    """(pool, device) -> (node, index) of every GPU_DRIVER device a
    ResourceSlice publishes with an int `index` attribute."""
    out = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != GPU_DRIVER:
            continue
        pool = (spec.get("pool") or {}).get("name")
        for d in spec.get("devices") or []:
            index = ((d.get("attributes") or {}).get("index") or {}).get("int")
            if isinstance(index, int):
                out[(pool, d.get("name"))] = (spec.get("nodeName"), index)
    return out


def claim_gpus(claims: list[dict], slices: list[dict],
               running: set[str]) -> dict[str, dict[int, set[str]]]:
    """node -> GPU index -> the claims (namespace/name) allocated that GPU
    for a pod in `running` (uids of pods bound to a node and not
    terminal).  A claim naming a device that no slice maps to an index
    raises Unreadable: the sample cannot say which GPU it holds."""
    devices = slice_devices(slices)
    out: dict[str, dict[int, set[str]]] = {}
    for c in claims:
        status, meta = c.get("status") or {}, c.get("metadata") or {}
        if not any(r.get("resource") == "pods" and r.get("uid") in running
                   for r in status.get("reservedFor") or []):
            continue
        name = f"{meta.get('namespace')}/{meta.get('name')}"
        for r in ((status.get("allocation") or {}).get("devices") or {}).get("results") or []:
            if r.get("driver") != GPU_DRIVER:
                continue
            where = devices.get((r.get("pool"), r.get("device")))
            if where is None:
                raise Unreadable("kubernetes", f"claim {name} holds {r.get('device')} of pool "
                                               f"{r.get('pool')}: no ResourceSlice gives its index")
            out.setdefault(where[0], {}).setdefault(where[1], set()).add(name)
    return out


def gpu_overlaps(jobs: dict[str, dict[int, set[str]]],
                 pods: dict[str, dict[int, set[str]]]) -> list[str]:
    """Each GPU that a job and a pod's claim hold at once, described."""
    return [f"{node} gpu {i}: jobs {','.join(sorted(jobs[node][i]))} and claims "
            f"{','.join(sorted(pods[node][i]))}"
            for node in sorted(jobs.keys() & pods.keys())
            for i in sorted(jobs[node].keys() & pods[node].keys())]


def _list_resource(kube, plural: str) -> list[dict]:
    try:
        return kube.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", plural, _request_timeout=kube.timeout).get("items") or []
    except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
        raise Unreadable("kubernetes", f"list {plural}: {type(e).__name__}: {e}"[:300]) from None


def gpu_sample(env, kube, restarted_at: float = 0.0):
    """(jobs, pods, overlaps) now: GPU indices per node held by Slurm's
    jobs (slurm_gpus, and the jobs whose processes run with GPUs:
    process_gpus, so that a job slurmctld forgot still counts) and by the
    claims of pods bound before and after both are read (claim_gpus;
    placeholders left out, as bound_pods), and each GPU both hold
    (gpu_overlaps).  Raises Unreadable when either side cannot be read."""
    before = bound_pods(kube)
    claims = _list_resource(kube, "resourceclaims")
    slices = _list_resource(kube, "resourceslices")
    # Processes first: a job recovered from before a restart whose processes
    # ran then still runs when slurmctld is asked, or has ended.
    procs = process_gpus(env["SLURM_CONF"])
    running = {j.split("(")[0] for held in procs.values() for js in held.values() for j in js}
    jobs = merge_gpus(slurm_gpus(env, restarted_at, running), procs)
    running = before.keys() & bound_pods(kube).keys()
    pods = claim_gpus(claims, slices, running)
    return jobs, pods, gpu_overlaps(jobs, pods)
