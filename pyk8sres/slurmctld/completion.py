"""job_submit policy: the k8scpu/k8smemory a job needs, and its new GRES.

Pure functions only (no I/O): `complete(job, site)` is all the plugin calls.

What a job "uses on a node" is the most Slurm may give it on any one node:
  CPUs   = tasks on the node x CPUs per task (or --cpus-per-gpu x GPUs there),
           at least --mincpus, at least its share of --ntasks x -c;
  memory = --mem, or --mem-per-cpu x those CPUs, or --mem-per-gpu x GPUs,
           else the partition's / cluster's DefMemPerCPU / DefMemPerNode.
When tasks may spread over any number of nodes (-n without -N), the per-node
figure is unknown before scheduling, so CPUs (and per-CPU memory) are asked
per task instead and Slurm multiplies by the tasks it places on each node.

Whole-node requests:
  --exclusive  Slurm gives the job every CPU of its nodes and (seen on 22.05)
               *all* of their k8scpu/k8smemory, i.e. everything Kubernetes
               leaves there; pods keep what they hold.  We request the job's
               own figures, so it starts wherever those fit.
  --mem=0      "all of the node's memory" cannot be shared with pods and has
               no count we could ask for: rejected with a clear message unless
               the job is --exclusive (then it gets all k8smemory, as above).
  no memory default anywhere (no DefMemPerCPU/DefMemPerNode): CPUs only;
               slurm-conf/slurm.conf sets DefMemPerCPU for this reason.
"""
from __future__ import annotations

import dataclasses
import typing

from .. import GRES_CPU, GRES_MEMORY
from . import gres

NO_VAL16 = 0xFFFE
NO_VAL = 0xFFFFFFFE
NO_VAL64 = 0xFFFFFFFFFFFFFFFE
INFINITE16 = 0xFFFF
INFINITE = 0xFFFFFFFF
MEM_PER_CPU = 0x8000000000000000
JOB_SHARED_NONE = 0


class PolicyError(ValueError):
    """Bad job options: shown to the user as `sbatch: error: ...`."""


class Job(typing.NamedTuple):
    """The job options that matter here; None means "not given".
    (A NamedTuple: it is built on every submission, and cheaply.)"""
    cpus_per_task: int | None = None
    num_tasks: int | None = None
    ntasks_per_node: int | None = None
    min_cpus: int | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None
    pn_min_cpus: int | None = None
    mem_per_node: int | None = None   # --mem (MB); 0 = whole node
    mem_per_cpu: int | None = None    # --mem-per-cpu (MB)
    exclusive: bool = False
    partition: str | None = None
    tres_per_node: str | None = None
    tres_per_task: str | None = None
    tres_per_job: str | None = None
    tres_per_socket: str | None = None
    cpus_per_tres: str | None = None
    mem_per_tres: str | None = None


@dataclasses.dataclass(frozen=True)
class MemDefault:
    per_cpu: int | None = None   # DefMemPerCPU
    per_node: int | None = None  # DefMemPerNode


@dataclasses.dataclass(frozen=True)
class Site:
    """Cluster facts the policy needs, read at init/reconfigure."""
    slurm_version: int = 0x160508
    under_request: str = "correct"                  # or "reject"
    cluster_mem: MemDefault = MemDefault()
    partition_mem: dict = dataclasses.field(default_factory=dict)  # name -> MemDefault
    default_partition: str | None = None


class Result(typing.NamedTuple):
    tres_per_node: str | None    # new value, None = leave unchanged
    tres_per_task: str | None
    per_node: dict               # what we require per node, for logs/tests
    per_task: dict


def decode_memory(value: int | None) -> tuple[int | None, int | None]:
    """Slurm's pn_min_memory / def_mem_per_cpu encoding -> (per_node, per_cpu)."""
    if value is None or value in (NO_VAL64, 0xFFFFFFFFFFFFFFFF):
        return None, None
    if value & MEM_PER_CPU:
        return None, value & ~MEM_PER_CPU
    return value, None


def _positive(value):
    return value if value else None


def _gpus(tres: str | None) -> int | None:
    return gres.count_of(gres.parse(tres), "gpu") if tres else None


def _per_gpu(tres: str | None) -> int | None:
    """cpus_per_tres / mem_per_tres: 'gres:gpu:4' (or gres/gpu:4) -> 4."""
    return _gpus(tres)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tasks_per_node(job: Job) -> int | None:
    """Most tasks that can land on one node; None when tasks spread freely."""
    if job.ntasks_per_node:
        return job.ntasks_per_node
    if not job.num_tasks:
        return 1  # no --ntasks: one task per node
    if job.num_tasks == 1:
        return 1
    if job.min_nodes:
        return _ceil_div(job.num_tasks, job.min_nodes)
    return None


def _gpus_per_node(job: Job, tasks_per_node: int | None) -> int | None:
    per_node = _gpus(job.tres_per_node)
    if per_node:
        return per_node
    per_task = _gpus(job.tres_per_task)
    if per_task and tasks_per_node:
        return per_task * tasks_per_node
    per_job = _gpus(job.tres_per_job)
    if per_job:
        return _ceil_div(per_job, job.min_nodes or 1)
    return _gpus(job.tres_per_socket)


def _memory_default(job: Job, site: Site) -> MemDefault:
    part = site.partition_mem.get(job.partition or site.default_partition or "")
    if part and (part.per_cpu or part.per_node):
        return part
    return site.cluster_mem


def required(job: Job, site: Site) -> tuple[dict, dict]:
    """(per_node, per_task) counts of k8scpu/k8smemory the job must request."""
    cpus_per_task = job.cpus_per_task or 1
    tasks = _tasks_per_node(job)
    gpus = _gpus_per_node(job, tasks)
    cpus_per_gpu = _per_gpu(job.cpus_per_tres)
    mem_per_gpu = _per_gpu(job.mem_per_tres)

    per_node: dict = {}
    per_task: dict = {}
    if tasks is None:
        per_task[GRES_CPU] = cpus_per_task
        node_cpus = None
    else:
        node_cpus = tasks * cpus_per_task
        if cpus_per_gpu and gpus:
            node_cpus = max(node_cpus, cpus_per_gpu * gpus)
        if job.pn_min_cpus:
            node_cpus = max(node_cpus, job.pn_min_cpus)
        if job.min_cpus and (job.min_nodes or 1) >= 1:
            node_cpus = max(node_cpus, _ceil_div(job.min_cpus, job.min_nodes or 1))
        per_node[GRES_CPU] = node_cpus

    mem_node, mem_cpu = job.mem_per_node, job.mem_per_cpu
    if mem_node == 0 and not job.exclusive:
        raise PolicyError("--mem=0 (all of a node's memory) cannot share the node with "
                          "Kubernetes pods: ask for --mem=<MB>, or add --exclusive to take "
                          "all the memory Kubernetes leaves")
    if mem_node is None and mem_cpu is None and mem_per_gpu and gpus:
        mem_node = mem_per_gpu * gpus
    if mem_node is None and mem_cpu is None:
        default = _memory_default(job, site)
        mem_node, mem_cpu = default.per_node, default.per_cpu
    if mem_node:
        per_node[GRES_MEMORY] = mem_node
    elif mem_cpu:
        if node_cpus is None:
            per_task[GRES_MEMORY] = mem_cpu * cpus_per_task
        else:
            per_node[GRES_MEMORY] = mem_cpu * node_cpus
    # else: --mem=0 or no default anywhere: the whole node; nothing to count.
    limits = {GRES_CPU: NO_VAL, GRES_MEMORY: gres.MAX_COUNT}  # Slurm's own field widths
    for counts in (per_node, per_task):
        for name, value in counts.items():
            if value > limits[name]:
                raise PolicyError(f"{name}:{value} is larger than any node can have")
    return per_node, per_task


def _apply(current: str | None, want: dict, site: Site, field: str) -> str | None:
    """The new TRES string for `field`, or None if `current` already fits."""
    entries = gres.parse(current)
    final = {}
    for name in (GRES_CPU, GRES_MEMORY):
        asked = gres.count_of(entries, name)
        need = want.get(name)
        if need is None:
            if asked is not None:
                final[name] = asked  # user's own request: keep it, deduplicated
            continue
        if asked is not None and asked < need and site.under_request == "reject":
            raise PolicyError(f"--gres={name}:{asked} is less than the job uses "
                              f"({name}:{need} {field.replace('tres_', '').replace('_', ' ')})")
        final[name] = max(need, asked or 0)
    new = gres.with_counts(entries, final, site.slurm_version)
    return None if new == (current or "") else new


def complete(job: Job, site: Site) -> Result:
    """Add or correct the job's k8scpu/k8smemory; PolicyError for bad input."""
    for field in ("tres_per_job", "tres_per_socket"):
        entries = gres.parse(getattr(job, field))
        if any(e.name in gres.OURS for e in entries):
            raise PolicyError("k8scpu/k8smemory can only be requested per node "
                              "(--gres=k8scpu:N), not per job or per socket")
    per_node, per_task = required(job, site)
    if per_task:
        # Asked per task: per-node entries of the same name would be stale.
        node_entries = gres.parse(job.tres_per_node)
        for name in per_task:
            asked = gres.count_of(node_entries, name)
            if asked is not None and site.under_request == "reject":
                tasks = job.num_tasks or 1
                if asked < per_task[name] * tasks:
                    raise PolicyError(f"--gres={name}:{asked} is less than the job uses "
                                      f"({name}:{per_task[name]} per task)")
    new_node = _apply(job.tres_per_node, per_node, site, "tres_per_node")
    if per_task:
        # Drop per-node entries of names now counted per task.
        base = new_node if new_node is not None else (job.tres_per_node or "")
        stripped = gres.without(gres.parse(base), per_task)
        if stripped != (job.tres_per_node or ""):
            new_node = stripped
    new_task = _apply(job.tres_per_task, per_task, site, "tres_per_task") if per_task else None
    return Result(new_node, new_task, per_node, per_task)


# Fields of a job_modify that change what the job uses per node.
SHAPE_FIELDS = ("cpus_per_task", "num_tasks", "ntasks_per_node", "min_cpus", "min_nodes",
                "max_nodes", "pn_min_cpus", "mem_per_node", "mem_per_cpu", "tres_per_node",
                "tres_per_task", "tres_per_job", "tres_per_socket", "cpus_per_tres",
                "mem_per_tres", "partition")


def complete_modify(change: Job, current: Job | None, site: Site) -> Result:
    """job_modify: `change` holds only the fields being updated.

    Unrelated updates (time limit, name, ...) leave the GRES alone.  A shape
    change is completed against the job as it stands; our own earlier
    k8scpu/k8smemory entries are recomputed (not kept as if the user had
    asked for them) unless the update itself sets the GRES.
    """
    changed = [f for f in SHAPE_FIELDS if getattr(change, f) is not None]
    if not changed:
        return Result(None, None, {}, {})
    if current is None:
        raise PolicyError("this build of k8s_resource_completion cannot see a submitted "
                          f"job, so it cannot update {', '.join(changed)}; cancel and "
                          "resubmit the job (or rebuild pyk8sres with -Dslurm_source)")
    merged = current._asdict()
    for name in ("tres_per_node", "tres_per_task"):
        if getattr(change, name) is None:  # drop our completion, keep the rest
            merged[name] = gres.without(gres.parse(merged[name]), gres.OURS) or None
    merged.update({f: getattr(change, f) for f in changed})
    result = complete(Job(**merged), site)

    def final(new, field):
        """Set the field when the job would otherwise end up different."""
        value = new if new is not None else (merged[field] or "")
        would_be = getattr(change, field) if getattr(change, field) is not None \
            else getattr(current, field)
        return None if value == (would_be or "") else value
    return Result(final(result.tres_per_node, "tres_per_node"),
                  final(result.tres_per_task, "tres_per_task"),
                  result.per_node, result.per_task)
