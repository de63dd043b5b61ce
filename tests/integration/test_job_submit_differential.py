"""Differential test of job_submit/k8s_resource_completion against plain Slurm.

Random submission shapes (fixed seed) run through two real clusters with the
same nodes, side by side: one with our job_submit plugin, one without it
(no JobSubmitPlugins).  For every shape, on an idle cluster:
  * it starts in both or in neither (the plugin never refuses or strands a
    job plain Slurm runs, and never starts one plain Slurm would not);
  * with the plugin, on every node of every job (array tasks included), the
    k8scpu/k8smemory held (`scontrol -d show job`: GRES=k8scpu(CNT:n)) is at
    least the CPUs (CPU_IDs) and memory (Mem) Slurm allocated there.
Six outcomes are counted apart, each checked against plain Slurm rather
than excused by shape: a shape plain Slurm refuses or holds too once it
carries any GRES, or starts only once it does (resubmitted there with
--gres=k8scpu:1), a --ntasks-per-gpu shape the plugin refuses that plain
Slurm refuses too with --gres=k8smemory:100,
an array whose tasks each start on an idle cluster but not all at once
(the running ones are cancelled and the others must then start; the
per-node over-hold of the policy's third mode), and, on nodes of different
sizes, a shape that starts only without the plugin where plain Slurm's own
layout gives one node more CPUs or memory than another node of the job has
(no count per node covers it; docs/job-requests.md, Known limits).  And a node Slurm
gives CPUs but no memory and no GRES (no tasks), as it does without the
plugin too, is not counted short (taskless_nodes).
Both on plain nodes and on SMT nodes (2 sockets x 2 cores x 2 threads, CR_Core),
on GPU nodes (2 sockets, 2 GPUs each; DefCpuPerGPU/DefMemPerGPU set for the
cluster and, differently, for partition b), where shapes also draw GPU options,
on nodes of three sizes (8, 4 and 12 CPUs) in the same partitions, and on
the SMT nodes under CR_Socket_Memory (whole sockets) and CR_CPU_Memory
(whole cores too, ThreadsPerCore being set).

CI runs PYK8SRES_DIFF_SHAPES shapes per topology (default 12, ~1 minute);
the full run is `PYK8SRES_DIFF_SHAPES=200 python3 -m pytest
integration/test_job_submit_differential.py` (docs/job-requests.md); PYK8SRES_DIFF_SEED
draws other shapes (default 9).  Each run writes
every outcome to diff-<topology>.json in the pytest tmp dir and prints a
summary.  PYK8SRES_DIFF_BASELINE=<site-packages>/pyk8sres/_lib runs another
build's plugin instead of this one (to measure a baseline, e.g. main).
Ports: port(17400) + 0..47 and 70..77.
"""
import json
import os
import random
import re
import subprocess
import time

import pytest
from local_slurm import SLURM, port, requires_slurm

from pyk8sres.slurmctld.slurmconf import expand_hostlist
from pyk8sres.testbed import cluster

pytestmark = requires_slurm

SEED = int(os.environ.get("PYK8SRES_DIFF_SEED", "9"))
COUNT = int(os.environ.get("PYK8SRES_DIFF_SHAPES", "12"))
NODES, CPUS, MEMORY = 3, 8, 16000
# b's GPU defaults matter only on the GPU topology (only there do shapes ask GPUs)
PARTITIONS = ("PartitionName=a Nodes=ALL Default=YES DefMemPerCPU=100 MaxTime=INFINITE State=UP\n"
              "PartitionName=b Nodes=ALL DefMemPerCPU=300 MaxMemPerCPU=1000 DefCpuPerGPU=2 "
              "DefMemPerGPU=1500 MaxTime=INFINITE State=UP")
# mixed: nodes of three sizes in every partition, as real partitions often are
MIXED_SIZES = [(8, 16000), (4, 8000), (12, 24000)]
TOPOLOGIES = {"plain": {}, "smt": {"sockets": 2, "threads_per_core": 2},
              "gpu": {"sockets": 2, "gpus": 2,
                      "extra_conf": "DefCpuPerGPU=3\nDefMemPerGPU=3000\n"},
              "mixed": {"node_sizes": MIXED_SIZES},
              "socket": {"sockets": 2, "threads_per_core": 2,
                         "select_type_parameters": "CR_Socket_Memory"},
              "cpu": {"sockets": 2, "threads_per_core": 2,
                      "select_type_parameters": "CR_CPU_Memory"}}
# (port(17400) + 50..69 is test_churn's)
PORTS = {"plain": 0, "smt": 10, "gpu": 20, "mixed": 30, "socket": 40, "cpu": 70}
START_TIMEOUT = 6.0


# Options seen less often, one of them in some shapes (sockets: the SMT
# topology has 2 per node).
RARER_OPTIONS = [["--ntasks-per-socket=1"], ["--ntasks-per-socket=2"], ["-B", "1:2"],
                 ["-B", "2:1"], ["--cores-per-socket=2"], ["-w", "n2"], ["-w", "n[1-2]"],
                 ["-x", "n1"], ["--contiguous"], ["--exclusive=user"], ["--use-min-nodes"],
                 ["--gres=k8scpu:1"], ["--gres=k8smemory:10"], ["--mem=16000"],
                 ["--ntasks-per-node=8"], ["--oversubscribe"]]


# GPU requests (the GPU topology: 2 per node), and what a job may add to them.
GPU_REQUESTS = [["--gpus-per-node=1"], ["--gpus-per-node=2"], ["--gpus=1"], ["--gpus=3"],
                ["--gpus-per-task=1"], ["--gres=gpu:1"], ["--gpus-per-socket=1",
                                                          "--sockets-per-node=1"]]
GPU_OPTIONS = [["--cpus-per-gpu=1"], ["--cpus-per-gpu=2"], ["--mem-per-gpu=1000"],
               ["--ntasks-per-gpu=2"]]
# Options sbatch refuses together (so a shape would test nothing)
EXCLUSIVE_WITH = {"--cpus-per-gpu": ("-c",), "--mem-per-gpu": ("--mem=", "--mem-per-cpu=")}
# Slurm 24.11.5 itself segfaults on --spread-job with a per-job GPU count
# (`sbatch -n3 --spread-job --gpus=1` kills a slurmctld without any
# job_submit plugin: topology/default eval_nodes, as in docs/job-requests.md row 23; the
# plugin refuses it, the plain side would die), so such shapes ask their
# GPUs per node.
PER_NODE_GPU_REQUESTS = [["--gpus-per-node=1"], ["--gpus-per-node=2"], ["--gres=gpu:1"]]


def shapes(count: int, seed: int = SEED, gpus: bool = False) -> list[list[str]]:
    """Random sbatch option lists; some invalid on purpose (both must refuse them).
    gpus: most shapes also ask GPUs (drawn after everything else, so the
    other options are the same shapes as without)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        opts = []
        n = rng.choice([None, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16])
        if n:
            opts.append(f"-n{n}")
        nodes = rng.choice([None, None, "1", "2", "3", "1-2", "1-3", "2-3"])
        if nodes:
            opts.append(f"-N{nodes}")
        c = rng.choice([None, None, 1, 2, 3, 4])
        if c:
            opts.append(f"-c{c}")
        if rng.random() < 0.3:
            opts.append(f"--ntasks-per-node={rng.choice([1, 2, 3, 4])}")
        if rng.random() < 0.4:
            opts.append(rng.choice(["--mem=1000", "--mem=3000", "--mem-per-cpu=200",
                                    "--mem-per-cpu=1500", "--mem=0", "--mem-per-cpu=0"]))
        for flag, chance in (("--exclusive", 0.1), ("-O", 0.1), ("--spread-job", 0.1)):
            if rng.random() < chance:
                opts.append(flag)
        if rng.random() < 0.15:
            opts.append("--distribution=" + rng.choice(["block", "cyclic", "plane=2"]))
        if rng.random() < 0.15:
            opts.append(f"--ntasks-per-core={rng.choice([1, 2])}")
        if rng.random() < 0.1:
            opts.append("--hint=" + rng.choice(["nomultithread", "multithread", "compute_bound"]))
        elif rng.random() < 0.1:
            opts.append("--threads-per-core=1")
        if rng.random() < 0.1:
            opts.append(f"--mincpus={rng.choice([2, 3])}")
        if rng.random() < 0.1:
            opts.append("--array=0-1")
        if rng.random() < 0.3:
            opts.append("-p" + rng.choice(["b", "a,b", "b,a"]))
        if rng.random() < 0.3:
            opts += rng.choice(RARER_OPTIONS)
        out.append(opts)
    if gpus:
        for opts in out:
            if rng.random() < 0.8:
                opts += rng.choice(PER_NODE_GPU_REQUESTS if "--spread-job" in opts
                                   else GPU_REQUESTS)
                extra = rng.choice(GPU_OPTIONS) if rng.random() < 0.4 else []
                clashes = EXCLUSIVE_WITH.get(extra[0].split("=")[0], ()) if extra else ()
                if not any(o.startswith(clashes) for o in opts):
                    opts += extra
    return out


def _cpu_count(ids: str) -> int:
    total = 0
    for item in ids.split(","):
        lo, _, hi = item.partition("-")
        total += int(hi or lo) - int(lo) + 1
    return total


def allocations(text: str) -> list[dict]:
    """Per job record of `scontrol -d show job` (one per array task): state,
    NumCPUs, and for each node: CPUs, memory and k8s GRES held there."""
    jobs = []
    for record in re.split(r"\n\s*\n", text.strip()):
        if "JobId=" not in record:
            continue
        state = re.search(r"JobState=(\S+)", record).group(1)
        nodes = {}
        for m in re.finditer(r"^\s+Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+)(?: GRES=(\S*))?",
                             record, re.M):
            held = {k: int(v) for k, v in re.findall(r"(k8s\w+)\(CNT:(\d+)\)", m.group(4) or "")}
            for node in expand_hostlist(m.group(1)):
                nodes[node] = {"cpus": _cpu_count(m.group(2)), "mem": int(m.group(3)),
                               "k8scpu": held.get("k8scpu", 0),
                               "k8smemory": held.get("k8smemory", 0)}
        array = re.search(r"ArrayJobId=(\d+) ArrayTaskId=(\d+)", record)
        jobs.append({"id": re.search(r"JobId=(\d+)", record).group(1), "state": state,
                     "reason": re.search(r"Reason=(\S+)", record).group(1),
                     "name": "_".join(array.groups()) if array else None,
                     "num_cpus": re.search(r"NumCPUs=(\d+)", record).group(1), "nodes": nodes})
    return jobs


class Side:
    """One cluster of the pair, with its own SLURM_CONF."""

    def __init__(self, handle: cluster.Cluster):
        self.c = handle
        self.job = None

    def run(self, *args, timeout=30):
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              env=self.c.env, cwd="/tmp")

    def submit(self, opts: list[str]) -> dict:
        proc = self.run("sbatch", "--parsable", "--output=/dev/null", *opts, "--wrap", "sleep 60")
        self.job = proc.stdout.strip().split(";")[0] if proc.returncode == 0 else None
        return {"accepted": proc.returncode == 0,
                "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else ""}

    def jobs(self) -> list[dict]:
        if not self.job:
            return []
        return allocations(self.run("scontrol", "-d", "show", "job", self.job).stdout)

    def started(self) -> bool:
        jobs = self.jobs()
        return bool(jobs) and all(j["state"] == "RUNNING" for j in jobs)

    def held(self) -> bool:
        """Every record held by Slurm itself (JobHeldAdmin)."""
        jobs = self.jobs()
        return bool(jobs) and all(j["reason"] == "JobHeldAdmin" for j in jobs)

    def start_one_after_another(self) -> list[dict] | None:
        """An array some of whose tasks run while the others pend: cancel the
        running ones; the records of the others if they then start (they
        could not all run at once, but each runs on an idle cluster), else None."""
        jobs = self.jobs()
        running = {j["id"]: j["name"] for j in jobs if j["state"] == "RUNNING"}
        if len(jobs) < 2 or not running or len(running) == len(jobs) or \
                None in running.values():
            return None
        self.run("scancel", *sorted(running.values()))  # 22.05 refuses a task's own JobId

        def later_all_running():
            later = [j for j in self.jobs() if j["id"] not in running]
            return later if later and all(j["state"] == "RUNNING" for j in later) else None
        return poll(later_all_running)

    def clean(self):
        self.run("scancel", "--user=root")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.run("squeue", "-h").stdout.strip():
            time.sleep(0.2)
        self.job = None


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def pair(request, tmp_path_factory):
    topology = request.param
    base = port(17400) + PORTS[topology]
    works = []
    sides = []
    try:
        for i, with_plugin in enumerate((True, False)):
            work = str(tmp_path_factory.mktemp(f"diff-{topology}-{'ours' if with_plugin else 'plain'}"))
            works.append(work)
            baseline = os.environ.get("PYK8SRES_DIFF_BASELINE") if with_plugin else None
            handle = cluster.up(work, nodes=NODES, cpus=CPUS, memory=MEMORY,
                                base_port=base + i * (NODES + 1), node_features=False,
                                def_mem_per_cpu=100, job_submit=with_plugin,
                                partitions=PARTITIONS, plugin_lib=baseline, slurm=SLURM,
                                **TOPOLOGIES[topology])
            sides.append(Side(handle))
        yield topology, sides[0], sides[1], tmp_path_factory.getbasetemp()
    finally:
        for work in works:
            cluster.down(work)


def node_sizes(topology: str) -> dict:
    """Each node's (CPUs, RealMemory): all of its k8scpu and k8smemory."""
    sizes = TOPOLOGIES[topology].get("node_sizes") or [(CPUS, MEMORY)] * NODES
    return {f"n{i}": size for i, size in enumerate(sizes, 1)}


def no_count_per_node_covers(plain_jobs: list[dict], sizes: dict) -> bool:
    """Ground truth for a shape that starts only without the plugin, on nodes
    of different sizes: plain Slurm's own layout gives one node of the job
    more CPUs (or memory) than another node of the same job has in all, so
    no count per node can both cover the one and fit the other; or it gives
    the job all of a node's memory where nodes differ in memory (docs/job-requests.md,
    row 17: the plugin refuses that with the ways out)."""
    memories = {memory for _, memory in sizes.values()}
    for job in plain_jobs:
        used = job["nodes"]
        if len(memories) > 1 and used and \
                all(a["mem"] == sizes[node][1] for node, a in used.items()):
            return True
        for i, what in enumerate(("cpus", "mem")):
            if len(used) > 1 and max(a[what] for a in used.values()) > \
                    min(sizes[node][i] for node in used):
                return True
    return False


def held_short(jobs: list[dict], sizes: dict | None = None,
               skip: frozenset = frozenset()) -> list[str]:
    """Every node where the GRES held is below what Slurm allocated (memory:
    at most the node's own, which is all its k8smemory; Slurm 22.05 gives a
    --gpus-per-socket job more, e.g. Mem=24000 on these 16000 MB nodes),
    but the (job, node) pairs in `skip`.  sizes: node_sizes() (default:
    nodes of MEMORY, as the other modules' clusters have)."""
    short = []
    for job in jobs:
        for node, a in job["nodes"].items():
            if (job["id"], node) in skip:
                continue
            real_memory = sizes[node][1] if sizes else MEMORY
            if a["k8scpu"] < a["cpus"] or a["k8smemory"] < min(a["mem"], real_memory):
                short.append(f"job {job['id']} {node}: {a['cpus']} CPUs/{a['mem']} MB allocated, "
                             f"holds k8scpu {a['k8scpu']} k8smemory {a['k8smemory']}")
    return short


def taskless_nodes(jobs: list[dict]) -> frozenset:
    """(job, node) where Slurm gave the job CPUs but no memory and no GRES
    while another node of the job has memory: a node without tasks.  Seen on
    22.05 with --distribution=plane=N and --ntasks-per-node below N (-n2 -c3
    --ntasks-per-node=1 --distribution=plane=2 puts both tasks on n1 and
    8 CPUs, Mem=0 on n2, plugin or not; a per-node --gres=k8scpu:4 is not
    allocated there either): no GRES request reaches such a node."""
    return frozenset((job["id"], node) for job in jobs for node, a in job["nodes"].items()
                     if a["mem"] == 0 and not a["k8scpu"] and not a["k8smemory"]
                     and any(b["mem"] for b in job["nodes"].values()))


def poll(check):
    """check()'s first truthy answer within START_TIMEOUT, else None."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if answer := check():
            return answer
        time.sleep(0.2)
    return None


def with_gres(opts: list[str], entry: str) -> list[str]:
    """opts plus a GRES entry; merged into the shape's own --gres (a second
    --gres would replace it: sbatch keeps the last one)."""
    own = [i for i, o in enumerate(opts) if o.startswith("--gres=")]
    if not own:
        return [*opts, f"--gres={entry}"]
    last = own[-1]
    return [*opts[:last], f"{opts[last]},{entry}", *opts[last + 1:]]


def submit_with_a_gres(plain: Side, opts: list[str], entry: str = "k8scpu:1") -> dict:
    """The shape again on the plain cluster, with the smallest GRES there is."""
    plain.clean()
    return plain.submit(with_gres(opts, entry))


def refused_with_any_gres(plain: Side, opts: list[str], ours: dict) -> bool:
    """Ground truth for a shape refused with the plugin: plain Slurm refuses it
    as well once it carries any GRES at all (22.05 cons_tres: with a GRES a
    node takes only the tasks its CPUs hold at c each, and with -O about as
    many as its cores), so no count we could ask for would let it run."""
    if ours["accepted"]:
        return False
    again = submit_with_a_gres(plain, opts)
    return not again["accepted"] and again["error"] == ours["error"]


def refused_with_a_memory_count(plain: Side, opts: list[str], ours: dict) -> bool:
    """Ground truth for --ntasks-per-gpu, which the plugin refuses: plain Slurm
    refuses it as well once it carries the smallest k8smemory a job here holds
    (Slurm applies --ntasks-per-gpu to every GRES: each MB needs its CPUs)."""
    if ours["accepted"] or not any(o.startswith("--ntasks-per-gpu") for o in opts):
        return False
    return not submit_with_a_gres(plain, opts, "k8smemory:100")["accepted"]


def held_by_slurm_with_any_gres(ours: Side, plain: Side, opts: list[str]) -> bool:
    """Ground truth for a shape accepted with the plugin that Slurm then holds
    itself (22.05 dist_tasks.c: "sync loop not progressing, holding ...",
    JobHeldAdmin; seen on SMT nodes with --mincpus): plain Slurm holds it too
    once it carries any GRES."""
    if not poll(ours.held):
        return False
    return submit_with_a_gres(plain, opts)["accepted"] and bool(poll(plain.held))


def starts_with_any_gres(plain: Side, opts: list[str]) -> bool:
    """Ground truth for a shape that starts only with the plugin: plain Slurm
    starts it too once it carries any GRES (seen on 24.11: -n 2 -N 2
    --ntasks-per-node=1 --mincpus=2 is refused without one, runs with one)."""
    return submit_with_a_gres(plain, opts)["accepted"] and bool(poll(plain.started))


def test_differential(pair):
    topology, ours, plain, out_dir = pair
    results, violations = [], []
    sizes = node_sizes(topology)
    for opts in shapes(COUNT, gpus=topology == "gpu"):
        accepted = (ours.submit(opts), plain.submit(opts))
        deadline = time.monotonic() + START_TIMEOUT
        started = [False, False]
        while time.monotonic() < deadline and not all(
                s or not a["accepted"] for s, a in zip(started, accepted)):
            started = [side.started() for side in (ours, plain)]
            time.sleep(0.2)
        ours_jobs, plain_jobs = ours.jobs(), plain.jobs()
        result = {"opts": " ".join(opts), "ours": {**accepted[0], "started": started[0],
                                                   "jobs": ours_jobs},
                  "plain": {**accepted[1], "started": started[1], "jobs": plain_jobs}}
        problems = held_short(ours_jobs, sizes) if started[0] else []
        if problems and taskless_nodes(plain_jobs):  # Slurm does that without the plugin too
            skip = taskless_nodes(ours_jobs)
            result["taskless_node"] = bool(skip)
            problems = held_short(ours_jobs, sizes, skip)
        if started[1] and not started[0] and refused_with_any_gres(plain, opts, accepted[0]):
            result["refused_with_any_gres"] = True
        elif started[1] and not started[0] and \
                refused_with_a_memory_count(plain, opts, accepted[0]):
            result["refused_with_a_memory_count"] = True
        elif started[1] and not started[0] and held_by_slurm_with_any_gres(ours, plain, opts):
            result["held_with_any_gres"] = True
        elif started[1] and not started[0] and \
                (later := ours.start_one_after_another()) is not None:
            result["one_after_another"] = True
            problems += held_short([j for j in ours_jobs if j["state"] == "RUNNING"] + later,
                                   sizes)
        elif started[1] and not started[0] and no_count_per_node_covers(plain_jobs, sizes):
            result["no_count_per_node"] = True
        elif started[0] and not started[1] and starts_with_any_gres(plain, opts):
            result["starts_only_with_a_gres"] = True
        elif started[0] != started[1]:
            problems.append(f"starts {'only with' if started[0] else 'only without'} the plugin"
                            f" ({accepted[0]['error'] or 'pending'})")
        result["problems"] = problems
        violations += [f"{' '.join(opts)}: {p}" for p in problems]
        results.append(result)
        ours.clean()
        plain.clean()
    path = os.path.join(out_dir, f"diff-{topology}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    both = sum(r["ours"]["started"] and r["plain"]["started"] for r in results)
    print(f"\n{topology}: {len(results)} shapes, started in both {both}, neither "
          f"{sum(not r['ours']['started'] and not r['plain']['started'] for r in results)}, "
          f"refused by Slurm with any GRES {sum('refused_with_any_gres' in r for r in results)}, "
          f"with a k8smemory count {sum('refused_with_a_memory_count' in r for r in results)}, "
          f"held by Slurm with any GRES {sum('held_with_any_gres' in r for r in results)}, "
          f"array tasks one after another {sum('one_after_another' in r for r in results)}, "
          f"starts only with a GRES {sum('starts_only_with_a_gres' in r for r in results)}, "
          f"no count per node covers plain Slurm's layout "
          f"{sum('no_count_per_node' in r for r in results)}, nodes without tasks "
          f"{sum(r.get('taskless_node', False) for r in results)}, "
          f"violations {len(violations)} ({path})")
    assert both > len(results) // 3, "too few shapes started to mean anything"
    assert not violations, "\n".join(violations)
