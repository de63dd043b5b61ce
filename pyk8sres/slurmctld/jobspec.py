"""The job and the cluster as the job_submit policy sees them: the job's
options (Job, decoded from Slurm's job_desc values), the site's facts (Site,
Partition, Nodes, memory and GPU defaults), the answer (Result), and
Slurm's encodings.  Data only: the rules are in nodefigures.py, plans.py
and completion.py.
"""
from __future__ import annotations

import dataclasses
import typing

NO_VAL16 = 0xFFFE
NO_VAL = 0xFFFFFFFE
NO_VAL64 = 0xFFFFFFFFFFFFFFFE
INFINITE16 = 0xFFFF
INFINITE = 0xFFFFFFFF
MEM_PER_CPU = 0x8000000000000000
JOB_SHARED_NONE = 0
# slurm.h SelectTypeParameters bits
CR_CPU, CR_SOCKET, CR_CORE, CR_BOARD = 0x1, 0x2, 0x4, 0x8
CR_MEMORY = 0x10
CR_ONE_TASK_PER_CORE = 0x100
# 23.02 (Site.per_task_pair_lost), seen with sbatch --tres-per-task=cpu:C,gres/k8scpu:C,
# gres/k8smemory:M on nodes of 8 CPUs, with or without SMT: C = 1 or 2 runs, 3 and 4 are refused.
PAIR_LOST_ABOVE_CPUS = 2
TRES_SLASH_FROM = 0x170B00  # 23.11: gres/NAME:N (when the build did not detect it)
PER_TASK_BREAKS_PLANE = 0x170000  # 23.00 on (SLURM_VERSION_NUMBER): plans._per_task_figures
SLURM_DIST_PLANE = 0x0004  # slurm.h task_dist_states_t, under SLURM_DIST_STATE_BASE


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
    ntasks_per_core: int | None = None   # --ntasks-per-core (--hint=nomultithread: 1)
    threads_per_core: int | None = None  # --threads-per-core (--hint=nomultithread: 1)
    overcommit: bool = False             # -O
    spread_job: bool = False             # --spread-job
    plane_distribution: bool = False     # --distribution=plane=N
    ntasks_per_tres: int | None = None   # --ntasks-per-gpu


@dataclasses.dataclass(frozen=True)
class MemDefault:
    per_cpu: int | None = None   # DefMemPerCPU
    per_node: int | None = None  # DefMemPerNode


@dataclasses.dataclass(frozen=True)
class GpuDefault:
    """DefCpuPerGPU / DefMemPerGPU (cluster-wide, or a partition's); None: not set."""
    cpus: int | None = None
    mem: int | None = None


@dataclasses.dataclass(frozen=True)
class Nodes:
    """What the policy needs of the nodes a partition holds (slurm.conf)."""
    threads_per_core: int = 1        # the most on any of its nodes
    cpus: int | None = None          # the most CPUs on any of its nodes
    memory: int | None = None        # the most RealMemory (MB) on any of its nodes
    count: int | None = None         # how many nodes
    least_cpus: int | None = None    # the fewest CPUs on any of its nodes
    least_memory: int | None = None  # the least RealMemory on any of its nodes (unset: 1)
    gpus: int | None = None          # the most GPUs on any of its nodes (Gres=gpu:N)
    cpu_counts: tuple = ()           # ((CPUs, how many nodes have that many), ...); (): unknown
    cores_per_socket: tuple = (1,)   # each distinct CoresPerSocket of its nodes (CR_Socket)


@dataclasses.dataclass(frozen=True)
class Partition:
    mem: MemDefault = MemDefault()   # DefMemPerCPU / DefMemPerNode (DEFAULT line included)
    max_mem_per_cpu: int | None = None
    nodes: Nodes = Nodes()
    gpu: GpuDefault = GpuDefault()   # DefCpuPerGPU / DefMemPerGPU (JobDefaults)


@dataclasses.dataclass(frozen=True)
class Site:
    """Cluster facts the policy needs, read at init/reconfigure."""
    slurm_version: int = 0x160508
    under_request: str = "correct"                  # or "reject"
    cluster_mem: MemDefault = MemDefault()
    cluster_gpu: GpuDefault = GpuDefault()          # cluster DefCpuPerGPU / DefMemPerGPU
    max_mem_per_cpu: int | None = None              # cluster MaxMemPerCPU
    reserve_memory: int = 0                         # k8s_resources.conf ReserveMemory (MB)
    select_type_param: int = CR_CORE                 # SelectTypeParameters bits
    partitions: dict = dataclasses.field(default_factory=dict)  # name -> Partition
    default_partition: str | None = None
    all_nodes: Nodes = Nodes()                       # every node (unknown partition)
    # Release behaviour, detected when building (meson.build, _lib/slurm_build.txt):
    # cons_tres fits the cores it picks on a node to a per-task CountOnly GRES
    # (every release to 26.05.2; not 26.05.3: GRES_FITS_CORES=0).
    gres_fits_cores: bool = True
    # --ntasks-per-node=k puts k tasks on every node whatever -n says (cons_tres
    # dist_tasks.c _get_task_count, 25.11 on: NTASKS_PER_NODE_FILLS=1).
    ntasks_per_node_fills: bool = False
    # --spread-job with a per-task or per-job GRES crashes slurmctld (24.11's
    # _eval_nodes_spread: SPREAD_PER_TASK_CRASHES=1; not 22.05, not 25.05 on).
    spread_per_task_crashes: bool = False
    # A per-task k8scpu and k8smemory together with -c above
    # PAIR_LOST_ABOVE_CPUS: 23.02's GRES filter loses the second count and
    # refuses the job (gres_select_filter.c restores total_cnt from a
    # total_cnt_before_filter never saved: PER_TASK_PAIR_LOST=1).
    per_task_pair_lost: bool = False
    # TRES strings gres/NAME:N (TRES_SLASH=1, 23.11 on) or gres:NAME:N; None:
    # not detected, inferred from slurm_version.
    tres_slash: bool | None = None


class Result:
    """What complete() decides.  (A plain class, as plans._Plan: compiled by mypyc
    it is built natively, where a dataclass's generated __init__ would run
    interpreted on every new job shape.)"""

    def __init__(self, tres_per_node: str | None, tres_per_task: str | None, per_node: dict,
                 per_task: dict, clear_tres_per_job: bool = False) -> None:
        self.tres_per_node = tres_per_node  # new value, None = leave unchanged
        self.tres_per_task = tres_per_task
        self.per_node = per_node            # what we require per node, for logs/tests
        self.per_task = per_task
        self.clear_tres_per_job = clear_tres_per_job  # job_modify: reset the per-job GRES

    def __repr__(self) -> str:
        return (f"Result({self.tres_per_node!r}, {self.tres_per_task!r}, {self.per_node!r}, "
                f"{self.per_task!r}, {self.clear_tres_per_job!r})")


def decode_job(cpus_per_task: int, num_tasks: int, ntasks_per_node: int, min_cpus: int,
               min_nodes: int, max_nodes: int, pn_min_cpus: int, ntasks_per_core: int,
               threads_per_core: int, overcommit: int, pn_min_memory: int, spread_job: int,
               task_dist: int, ntasks_per_tres: int, exclusive: bool, partition: str | None,
               tres_per_node: str | None, tres_per_task: str | None, tres_per_job: str | None,
               tres_per_socket: str | None, cpus_per_tres: str | None,
               mem_per_tres: str | None) -> Job:
    """The Job from job_desc's raw values (submit.py, embed.py): Slurm's
    NO_VAL family, INFINITE ("no limit") and 0 where the option cannot be 0
    all mean "not given".

    Straight-line code that builds the tuple in Job's field order: this runs
    on every submission the plugin's C memo has not seen, with the CPU caches
    cold, where a loop over a table or Job(...) (a NamedTuple's __new__ is
    interpreted Python, even compiled) cost several times more."""
    # Slurm maps --mem-per-cpu=0 to --mem=0 (job_mgr.c _validate_job_desc)
    per_node, per_cpu = (0, None) if pn_min_memory == MEM_PER_CPU else \
        decode_memory(pn_min_memory)
    return tuple.__new__(Job, (
        None if cpus_per_task in (NO_VAL16, 0) else cpus_per_task,
        None if num_tasks in (NO_VAL, 0) else num_tasks,
        None if ntasks_per_node in (NO_VAL16, INFINITE16, 0) else ntasks_per_node,
        None if min_cpus in (NO_VAL, 0) else min_cpus,
        None if min_nodes in (NO_VAL, 0) else min_nodes,
        None if max_nodes in (NO_VAL, INFINITE, 0) else max_nodes,
        None if pn_min_cpus in (NO_VAL16, NO_VAL, 0) else pn_min_cpus,
        per_node, per_cpu, exclusive,
        partition, tres_per_node, tres_per_task, tres_per_job, tres_per_socket,
        cpus_per_tres, mem_per_tres,
        None if ntasks_per_core in (NO_VAL16, INFINITE16, 0) else ntasks_per_core,
        None if threads_per_core in (NO_VAL16, 0) else threads_per_core,
        overcommit not in (NO_VAL16, 0xFE, 0),  # uint8 in Slurm: NO_VAL8 = not given
        spread_job == 1,
        task_dist & 0xFFFF == SLURM_DIST_PLANE,
        None if ntasks_per_tres in (NO_VAL16, INFINITE16, 0) else ntasks_per_tres))


def decode_memory(value: int | None) -> tuple[int | None, int | None]:
    """Slurm's pn_min_memory / def_mem_per_cpu encoding -> (per_node, per_cpu)."""
    if value is None or value in (NO_VAL64, 0xFFFFFFFFFFFFFFFF):
        return None, None
    if value & MEM_PER_CPU:
        return None, value & ~MEM_PER_CPU
    return value, None
