"""job_submit policy: the k8scpu/k8smemory a job needs, and its new GRES.

Pure functions only (no I/O): `complete(job, site)` is all the plugin calls.

The promise: on every node, the k8scpu/k8smemory a job holds is at least the
CPUs and memory Slurm allocates it there (`scontrol -d show job`: CPU_IDs,
Mem), and a job plain Slurm would start is never made unrunnable.  Every rule
follows Slurm 22.05's own code (docs/job-requests.md has the table):

CPUs on a node holding t tasks (cons_tres dist_tasks.c _block_sync_core_bitmap):
    cpus  = max(t x cpus_per_task, --mincpus, --cpus-per-gpu x GPUs)
    CR_Core/CR_Socket (and CR_CPU, below): whole cores,
      cores = ceil(cpus / vpus), or (cpus // c) x ceil(c / vpus) with
              --ntasks-per-core=1 and c > vpus
      CPUs  = cores x ThreadsPerCore
      vpus  = usable threads per core (cons_common.c common_cpus_per_core):
              min(ThreadsPerCore, --ntasks-per-core x c, --threads-per-core)
      CR_Socket: whole sockets, up to one for each core (the default
              distribution takes a core from each socket in turn), at most
              the node's
    CR_CPU: the same whole cores when slurm.conf gives the nodes
      ThreadsPerCore > 1 (slurm.conf(5): that "will prevent more than one
      job from being allocated on each core"; seen: -n 1 -c 1 gets
      CPU_IDs 0-1); with CPUs= alone every CPU is a core.
Memory on a node (cons_common job_test.c): --mem, or per-CPU memory x the
    node's CPUs (counting only --threads-per-core threads of each core).
Per-CPU memory above MaxMemPerCPU raises cpus_per_task by the ratio and
    lowers the memory (job_mgr.c _valid_pn_min_mem); a job without memory
    gets its partition's DefMemPerCPU/DefMemPerNode, else the cluster's,
    decided when the job is scheduled in that partition (job_limits_check).

How many tasks land on a node is decided only when Slurm schedules the job
(block distribution packs the first node up to n - N + 1 tasks).  So:
  * tasks per node fixed by the shape (no -n, -n 1, -n = -N, or -n = -N x
    --ntasks-per-node with a fixed -N): ask per node, exactly;
  * otherwise, when the per-node figure is t x (one task's figure) for every
    t: ask per task (TresPerTask), and Slurm multiplies by the tasks it puts
    on each node;
  * otherwise (SMT rounding of odd cpus_per_task, --mincpus): ask per
    node the most any node can get, capped at the largest node's CPUs and
    memory (never more than Slurm could allocate there, so never a runnable
    job made unrunnable on an idle cluster of nodes of one size; a node
    smaller than the count cannot take the job).
  -O/--overcommit: Slurm allocates one task's CPUs per node (dist_tasks.c
    one_task_per_node), unless the job asks anything per task: per node.
  --ntasks-per-node with -n: every node gets c x ntasks-per-node CPUs
    (pn_min_cpus), so that is asked per node.
  --exclusive: Slurm allocates whole nodes and (seen on 22.05) all of their
    k8scpu/k8smemory; we ask one task's figures per node, which cannot change
    where Slurm puts the tasks.
  --spread-job, --distribution=plane: never per task after 22.05 (with a
    per-task GRES slurmctld 24.11 crashes on the first and never runs the
    second): per node, the most any node can get.
  All of a node's memory (--mem=0, --mem-per-cpu=0 which Slurm maps to it,
    or no memory asked and no DefMemPerCPU/DefMemPerNode anywhere, Slurm's
    default) when memory is consumable (CR_*_Memory): the node's whole
    k8smemory (RealMemory - ReserveMemory), which one count covers only when
    the job's nodes all have the same RealMemory (else refused, with the
    ways out).  With --exclusive Slurm allocates all of it anyway.
  Several partitions (-p a,b): the largest figure over those whose biggest
    node can hold the job (it may run in any of them, and in no other).
  GPU jobs (cons_tres _set_gpu_defaults): the partition's DefCpuPerGPU /
    DefMemPerGPU, else the cluster's, stand in for --cpus-per-gpu (when no
    -c was given) and --mem-per-gpu (when no --mem/--mem-per-cpu was given);
    a node gets at most the GPUs its partition's biggest node has.
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
# slurm.h SelectTypeParameters bits
CR_CPU, CR_SOCKET, CR_CORE, CR_BOARD = 0x1, 0x2, 0x4, 0x8
CR_MEMORY = 0x10
CR_ONE_TASK_PER_CORE = 0x100
# 23.02 (Site.per_task_pair_lost), seen with sbatch --tres-per-task=cpu:C,gres/k8scpu:C,
# gres/k8smemory:M on nodes of 8 CPUs, with or without SMT: C = 1 or 2 runs, 3 and 4 are refused.
PAIR_LOST_ABOVE_CPUS = 2
TRES_SLASH_FROM = 0x170B00  # 23.11: gres/NAME:N (when the build did not detect it)
PER_TASK_BREAKS_PLANE = 0x170000  # Slurm 23.00 on (SLURM_VERSION_NUMBER): see _per_task_figures
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
    """What complete() decides.  (A plain class, as _Plan: compiled by mypyc
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


def _gpus(tres: str | None) -> int | None:
    return gres.count_of(gres.parse(tres), "gpu") if tres else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fixed_tasks(job: Job) -> int | None:
    """Tasks on every node when the shape fixes it, else None."""
    if not job.num_tasks:
        return job.ntasks_per_node or 1  # no -n: one task (or --ntasks-per-node) per node
    if job.num_tasks == 1:
        return 1
    nodes = job.min_nodes or 1
    if job.max_nodes != nodes:
        return None  # a node range, or no -N at all: Slurm chooses
    if nodes == 1:
        return job.num_tasks
    if job.num_tasks == nodes:
        return 1
    if job.ntasks_per_node and job.num_tasks == nodes * job.ntasks_per_node:
        return job.ntasks_per_node
    return None


def _max_tasks(job: Job) -> int:
    """The most tasks Slurm can put on one node (every other node gets one)."""
    if not job.num_tasks:
        return job.ntasks_per_node or 1
    most = job.num_tasks - (job.min_nodes or 1) + 1
    if job.ntasks_per_node:
        most = min(most, job.ntasks_per_node)
    return max(most, 1)


def _gpus_per_node(job: Job, tasks: int | None, most: int | None) -> int | None:
    """The most GPUs the job can get on a node holding `tasks` tasks; no node
    has more than `most` (the biggest Gres=gpu count of the partition, if known)."""
    gpus = _gpus(job.tres_per_node)
    if not gpus:
        per_task = _gpus(job.tres_per_task)
        if per_task and tasks:
            gpus = per_task * tasks
        else:
            # Per job: all of them may land on one node; on several nodes
            # Slurm 22.05 may count up to all of a node's GPUs on each (seen:
            # --gpus=1 -n 5 --ntasks-per-node=2 had 2 GPUs' memory on each of
            # its 3 nodes, plugin or not).
            gpus = _gpus(job.tres_per_job)
            if gpus and most and not _one_node(job):
                gpus = most
    if not gpus:
        per_socket = _gpus(job.tres_per_socket)  # that many on each socket it uses
        gpus = (most or per_socket) if per_socket else None
    return min(gpus, most) if gpus and most else gpus


def _one_node(job: Job) -> bool:
    """Whether the job surely runs on one node."""
    return job.max_nodes == 1 or ((job.min_nodes or 1) == 1 and (job.num_tasks or 1) == 1)


def _asks_gpus(job: Job) -> bool:
    for tres in (job.tres_per_node, job.tres_per_task, job.tres_per_job, job.tres_per_socket):
        if tres and _gpus(tres):
            return True
    return False


class _Plan:
    def __init__(self, per_task: dict | None, per_node: dict, mem_per_node: int | None,
                 most: bool = False) -> None:
        self.per_task = per_task          # exact per-task figures, or None when none exist
        self.per_node = per_node          # per-node figures (always available)
        self.mem_per_node = mem_per_node  # memory asked per node in either mode (--mem, ...)
        self.most = most                  # per_node is the most a node may get, not the same


def _plan(job: Job, site: Site, part: Partition, always_per_node: bool = True) -> _Plan:
    """What the job needs if it runs in `part` (per-node figures for a job
    that has per-task ones only when `always_per_node`).  Which rule applies
    where, in order: the node's figures as functions of its tasks
    (_node_figures), then the mode: --exclusive, -O, tasks per node fixed
    by the shape, per task, or per node the most any node can get."""
    node = _node_figures(job, site, part)
    if job.exclusive:
        return _exclusive_plan(node)
    if job.overcommit and not _one_task_per_node(job):
        return _overcommit_spread_plan(job, node)
    fixed = 1 if job.overcommit else _fixed_tasks(job)
    if fixed is not None:
        return _fixed_plan(job, node, fixed)
    per_task = _per_task_figures(job, site, node)
    if per_task is not None and not always_per_node:
        return _Plan(per_task, {}, node.mem_node)
    return _most_plan(job, node, per_task)


class _NodeFigures:
    """What Slurm allocates on a node of one partition for this job, as
    functions of the tasks the node holds: the job's options once that
    partition's defaults and limits apply (job_mgr.c, cons_tres job_test.c),
    and the node layout (dist_tasks.c _block_sync_core_bitmap).  A plain
    class, as _Plan."""

    def __init__(self, job: Job, nodes: Nodes, param: int, c: int, min_cpus_node: int,
                 cpus_per_gpu: int | None, mem_node: int | None, mem_cpu: int | None,
                 mem_per_gpu: int | None) -> None:
        self.job = job
        self.nodes = nodes
        self.c = c                          # CPUs per task, after MaxMemPerCPU
        self.min_cpus_node = min_cpus_node  # pn_min_cpus
        self.cpus_per_gpu = cpus_per_gpu
        self.mem_node = mem_node            # memory asked per node (--mem, a default)
        self.mem_cpu = mem_cpu
        self.mem_per_gpu = mem_per_gpu
        tpc = nodes.threads_per_core
        self.tpc = tpc
        # CR_Socket: whole sockets of each of these sizes (in cores); (1,): none
        self.socket_cores: tuple = nodes.cores_per_socket if param & CR_SOCKET else (1,)
        self.by_sockets = self.socket_cores != (1,)
        self.whole_cores = bool(param & (CR_CPU | CR_CORE | CR_SOCKET | CR_BOARD)) and \
            (tpc > 1 or self.by_sockets)
        self.most_cores = nodes.cpus // tpc if nodes.cpus else None  # the biggest node's
        ntasks_per_core = job.ntasks_per_core or (1 if param & CR_ONE_TASK_PER_CORE else None)
        self.ntasks_per_core = ntasks_per_core
        vpus = tpc
        if ntasks_per_core:
            vpus = min(vpus, ntasks_per_core * c)
        if job.threads_per_core:
            vpus = min(vpus, job.threads_per_core)
        self.vpus = vpus  # usable threads per core (cons_common.c common_cpus_per_core)
        self.mem_threads = min(tpc, job.threads_per_core or tpc)

    def cpus(self, t: int) -> int:
        """CPUs Slurm allocates on a node with t tasks."""
        c = self.c
        n = max(t * c, self.min_cpus_node)
        if self.cpus_per_gpu:
            gpus = _gpus_per_node(self.job, t, self.nodes.gpus)
            if gpus:
                n = max(n, self.cpus_per_gpu * gpus)
        if not self.whole_cores:
            return n
        cores = _ceil_div(n, self.vpus)
        if self.ntasks_per_core == 1 and c > self.vpus:  # each task on cores of its own
            cores = max(cores, n // c * _ceil_div(c, self.vpus))
        return _whole_sockets(cores, self.socket_cores, self.most_cores) * self.tpc

    def rounded(self, n: int) -> int:
        """n CPUs as Slurm allocates them: whole cores (sockets) where it does."""
        if not self.whole_cores:
            return n
        return _whole_sockets(_ceil_div(n, self.tpc), self.socket_cores, self.most_cores) * \
            self.tpc

    def memory(self, t: int, node_cpus: int) -> int | None:
        """Memory on a node with t tasks and node_cpus CPUs."""
        if self.mem_node:
            return self.mem_node
        if self.mem_per_gpu:
            gpus = _gpus_per_node(self.job, t, self.nodes.gpus)
            return self.mem_per_gpu * gpus if gpus else None
        if self.mem_cpu:
            counted = node_cpus // self.tpc * self.mem_threads if self.whole_cores else node_cpus
            return self.mem_cpu * counted
        return None  # memory not consumable, or --exclusive: nothing to count

    def figures(self, t: int, node_cpus: int) -> dict:
        """k8scpu/k8smemory of a node with t tasks and node_cpus CPUs."""
        out = {GRES_CPU: node_cpus}
        mem = self.memory(t, node_cpus)
        if mem:
            out[GRES_MEMORY] = mem
        return out


def _node_figures(job: Job, site: Site, part: Partition) -> _NodeFigures:
    """The job's figures in `part`: GPU defaults, the memory default,
    MaxMemPerCPU, all of a node's memory, --ntasks-per-node; then the layout."""
    nodes = part.nodes
    c = job.cpus_per_task or 1
    min_cpus_node = job.pn_min_cpus or 0
    mem_node, mem_cpu = job.mem_per_node, job.mem_per_cpu
    mem_per_gpu = _gpus(job.mem_per_tres)
    cpus_per_gpu = _gpus(job.cpus_per_tres)
    default_cpus_per_gpu = None
    if (job.tres_per_node or job.tres_per_task or job.tres_per_job or job.tres_per_socket) \
            and _asks_gpus(job):  # (most jobs have no TRES at all: no call)
        # cons_tres _set_gpu_defaults(): the partition's DefCpuPerGPU /
        # DefMemPerGPU, else the cluster's; CPUs only for a job without -c,
        # memory only for one without --mem/--mem-per-cpu (job_test.c: the
        # GPUs' memory then replaces DefMemPerCPU/DefMemPerNode).
        gpu_cpus, gpu_mem = _gpu_default(part, site)
        if job.cpus_per_task is None and gpu_cpus:
            default_cpus_per_gpu = gpu_cpus
            cpus_per_gpu = cpus_per_gpu or gpu_cpus
        if mem_node is None and mem_cpu is None:
            mem_per_gpu = mem_per_gpu or gpu_mem
    if mem_node is None and mem_cpu is None and not mem_per_gpu:
        default = part.mem if (part.mem.per_cpu or part.mem.per_node) else site.cluster_mem
        mem_node, mem_cpu = default.per_node, default.per_cpu
    # MaxMemPerCPU (job_mgr.c _valid_pn_min_mem, again when scheduled in a partition)
    max_mpc = part.max_mem_per_cpu or site.max_mem_per_cpu
    if max_mpc and mem_cpu and mem_cpu > max_mpc:
        ratio = _ceil_div(mem_cpu, max_mpc)
        c *= ratio
        mem_cpu = _ceil_div(mem_cpu, ratio)
    elif max_mpc and mem_node:
        min_cpus_node = max(min_cpus_node, _ceil_div(mem_node, max_mpc))
        if job.ntasks_per_node:
            c = max(c, _ceil_div(min_cpus_node, job.ntasks_per_node))
    if default_cpus_per_gpu and job.tres_per_task:  # gres_select_util_job_set_defs()
        c = max(c, (_gpus(job.tres_per_task) or 0) * default_cpus_per_gpu)

    param = site.select_type_param
    if mem_node == 0 and param & CR_MEMORY and not job.exclusive:
        mem_node = _whole_node_memory(nodes, site)
    if mem_per_gpu and not mem_node and _gpus(job.tres_per_socket):
        # Slurm 22.05 gives a --gpus-per-socket job memory per GPU x a count
        # that is not its GPUs (seen: Mem=24000 on a 16000 MB node for -n 4
        # -c 4, 9000 for -n 2, with DefMemPerGPU=3000 and 2 GPUs a node):
        # all of the node's memory is the most anything can hold there.
        mem_node = _whole_node_memory(nodes, site)

    # --ntasks-per-node with tasks: every node gets that many tasks' CPUs
    # (job_mgr.c _copy_job_desc_to_job_record: pn_min_cpus >= c x ntasks-per-node);
    # from 25.11 on even for -n 1, and for -O with a TresPerTask (dist_tasks.c
    # _get_task_count: k tasks on each node; seen on 26.05.3: -n 1
    # --ntasks-per-node=8 gets 8 CPUs once it carries any GRES).
    if job.ntasks_per_node and (
            (not job.overcommit and
             (job.num_tasks or job.ntasks_per_node * (job.min_nodes or 1)) > 1) or
            (site.ntasks_per_node_fills and not _one_task_per_node(job))):
        min_cpus_node = max(min_cpus_node, c * job.ntasks_per_node)
    return _NodeFigures(job, nodes, param, c, min_cpus_node, cpus_per_gpu, mem_node, mem_cpu,
                        mem_per_gpu)


def _exclusive_plan(node: _NodeFigures) -> _Plan:
    """--exclusive: whole nodes; Slurm allocates all of their CPUs and all
    of their k8scpu/k8smemory whatever is asked (seen in GresUsed), so ask
    the least a node with a task gets: the request must not change where
    Slurm puts the tasks (a per-task GRES would)."""
    return _Plan(None, node.figures(1, node.cpus(1)), node.mem_node)


def _one_task_per_node(job: Job) -> bool:
    """-O: Slurm gives each node one task's CPUs only when the job has no
    TresPerTask at all (cons_tres dist_tasks.c: `overcommit &&
    !tres_per_task`, the same from 22.05 to 26.05).  What differs by
    release is what puts something there: from 24.05 on, sbatch and salloc
    write `cpu=<c>` into TresPerTask whenever -c is given (slurm_opt.c
    slurm_option_update_tres_per_task); before, only a per-task GRES did.
    Our own per-task entries are never there for a -O job (it is asked
    per node)."""
    return job.overcommit and not gres.without(gres.parse(job.tres_per_task), gres.OURS)


def _overcommit_spread_plan(job: Job, node: _NodeFigures) -> _Plan:
    """-O on a job with a TresPerTask: once it carries any GRES, Slurm lays
    its tasks out as without -O, c CPUs each, up to --ntasks-per-node on
    every node (25.11 dist_tasks.c _get_task_count: ntasks-per-node x
    nodes), but without raising pn_min_cpus (job_mgr.c: not for -O).  Seen
    on 25.11.7: -n 6 -c 1 --ntasks-per-node=2 -O with any GRES gets 2 CPUs
    on each of 3 nodes, without a GRES 1.  Per node, the most a node can
    get, capped at the biggest node (Slurm cannot allocate more there)."""
    most = job.ntasks_per_node or _fixed_tasks(job) or _max_tasks(job)
    one = node.cpus(1)
    n = node.cpus(most)
    if node.nodes.cpus:
        n = min(n, max(node.nodes.cpus, one))
    return _Plan(None, _capped_figures(node, most, n, one), node.mem_node, most=True)


def _fixed_plan(job: Job, node: _NodeFigures, fixed: int) -> _Plan:
    """Tasks per node fixed by the shape (or one task's CPUs per node, -O):
    per node, exactly."""
    n = node.cpus(fixed)
    if job.min_cpus and not job.overcommit:
        # NumCPUs above the tasks' CPUs: the extra may all land on one
        # node (the others keep their tasks' CPUs).
        n = max(n, job.min_cpus - ((job.min_nodes or 1) - 1) * n)
        if node.nodes.cpus:
            n = min(n, max(node.nodes.cpus, node.cpus(fixed)))
        n = node.rounded(n)
    return _Plan(None, node.figures(fixed, n), node.mem_node)


def _cpus_above_tasks(job: Job, c: int) -> bool:
    """NumCPUs (--mincpus x nodes, or -n x -c raised) above the tasks' CPUs."""
    return bool(job.min_cpus and job.min_cpus > (job.num_tasks or 0) * c)


def _per_task_figures(job: Job, site: Site, node: _NodeFigures) -> dict | None:
    """Tasks spread: the per-task figures when every node's are t x one
    task's, else None.  Exact with no --mincpus above one task, no per-GPU
    figures, and under whole cores either c a multiple of the usable
    threads per core or --ntasks-per-core=1 with c > vpus (then each task
    has its own cores)."""
    nodes = node.nodes
    tasks = job.num_tasks or 0  # given: a job without -n has fixed tasks per node
    one = node.cpus(1)
    # --threads-per-core (also --hint=compute_bound/nomultithread): Slurm then
    # may put more tasks on a node than its CPUs / c (seen: -n 5 -N 2 -c 3
    # --hint=compute_bound on 8-CPU nodes runs 3 tasks on 8 CPUs); a per-task
    # GRES would forbid that layout, so ask per node.
    linear = (node.min_cpus_node <= node.c and not node.cpus_per_gpu and not node.mem_per_gpu
              and not job.threads_per_core and not _cpus_above_tasks(job, node.c))
    rounding_only = linear
    if linear and node.whole_cores:
        linear = node.c % node.vpus == 0 or (node.ntasks_per_core == 1 and node.c > node.vpus)
    if not linear and rounding_only and nodes.count and nodes.least_cpus and \
            site.gres_fits_cores:
        # Only the whole-core rounding is not linear: one task's rounded
        # figure per task covers every t (t x ceil(c/u) cores >= ceil(t x c/u))
        # but lets fewer tasks onto a node; use it when the job still fits
        # the nodes it may use, so Slurm places it without over-holding
        # whole nodes (which would keep e.g. a second array task out).
        # Only where Slurm fits the cores it picks to that per-task count:
        # 26.05.3 picks them by CPUs alone (seen: -n 12 on 3 nodes of 4 x 2
        # threads gets 8 + 4 + 1 CPUs, where k8scpu:2 a task allows 4 tasks a
        # node, and pends for ever: BAD_TASK_COUNT), so there per node.
        usable = min(job.max_nodes or nodes.count, nodes.count)
        linear = usable * (nodes.least_cpus // one) >= tasks
    if (job.spread_job and site.spread_per_task_crashes) or \
            (job.plane_distribution and site.slurm_version >= PER_TASK_BREAKS_PLANE):
        # Seen on 24.11.5, with or without the plugin: --spread-job with a
        # per-task GRES segfaults slurmctld (topology/common eval_nodes.c
        # _eval_nodes_spread passes a NULL max_tasks on to eval_nodes_gres
        # once the job has a per-job GRES count, which a per-task one
        # implies; detected when building, fixed in 25.05).  And
        # --distribution=plane with one is never runnable (seen on 24.11.5,
        # 25.05.8, 25.11.7, 26.05.3: "Requested node configuration is not
        # available"; assumed for every release after 22.05).  A per-node
        # GRES is fine with both; 22.05 has neither problem.
        linear = False
    if node.by_sockets:
        # Whole sockets, one per core, are never t x one task's; and the
        # rounded per-task figure above makes 22.05 refuse fixed node counts
        # (seen: -n 5 -N 3 on 3 nodes of 2 x 2 x 2, BadConstraints).
        linear = False
    if not linear:
        return None
    per_task = {GRES_CPU: one}
    one_mem = node.memory(1, one)
    if one_mem and not node.mem_node:
        if site.per_task_pair_lost and node.c > PAIR_LOST_ABOVE_CPUS:
            # 23.02 refuses such a job ("Requested node configuration is not
            # available"), even -n 1 -c 3 on an idle node: per node instead.
            return None
        per_task[GRES_MEMORY] = one_mem
    return per_task


def _most_plan(job: Job, node: _NodeFigures, per_task: dict | None) -> _Plan:
    """Per node: the most any node can get, capped at what the biggest node
    has (Slurm cannot allocate more there, so on nodes of one size this never
    makes a job unrunnable; on smaller nodes it cannot run: docs/job-requests.md, Known limits)."""
    most = _max_tasks(job)
    one = node.cpus(1)
    extra = 0
    if _cpus_above_tasks(job, node.c):
        # The extra may all land on one node (otherwise the tasks' CPUs
        # cover NumCPUs: cpus(most) is the most).
        extra = (job.min_cpus or 0) - ((job.min_nodes or 1) - 1) * one
    n = max(node.cpus(most), node.rounded(extra))
    if node.nodes.cpus:
        n = min(n, max(node.nodes.cpus, one))
    return _Plan(per_task, _capped_figures(node, most, n, one), node.mem_node, most=True)


def _capped_figures(node: _NodeFigures, most: int, n: int, one: int) -> dict:
    """Figures of a node with `most` tasks on n CPUs, its per-CPU memory
    capped at the biggest node's (but never below one task's)."""
    out = {GRES_CPU: n}
    mem = node.memory(most, n)
    if mem and node.nodes.memory and not node.mem_node:
        mem = min(mem, max(node.nodes.memory, node.memory(1, one) or 0))
    if mem:
        out[GRES_MEMORY] = mem
    return out


def _whole_sockets(cores: int, socket_cores: tuple, most_cores: int | None) -> int:
    """Cores Slurm allocates under CR_Socket for `cores` cores on a node:
    whole sockets, up to one for each core.  The default (cyclic) task
    distribution takes a core from each socket in turn (dist_tasks.c
    _cyclic_sync_core_bitmap packs a task into one socket only for -c > 1,
    and not even then once the job has -n and a GRES: seen -n 2 -N 1 get
    CPU_IDs 0-7 on 2 x 4 cores, and -n 1 -c 4 with any GRES both sockets of
    2 x 2 x 2).  At most the biggest node's sockets; the most over the
    sockets' sizes."""
    if socket_cores == (1,):
        return cores
    return max(cores, max(min(cores, most_cores // size if most_cores else cores) * size
                          for size in socket_cores))


def _gpu_default(part: Partition, site: Site) -> tuple[int | None, int | None]:
    """(DefCpuPerGPU, DefMemPerGPU): the partition's, each else the cluster's
    (a partition's 0 is a setting too: it overrides the cluster's)."""
    own, cluster = part.gpu, site.cluster_gpu
    return (cluster.cpus if own.cpus is None else own.cpus,
            cluster.mem if own.mem is None else own.mem)


_unknown: tuple = (None, None)  # (Nodes, Partition): the last unknown partition built


def _unknown_partition(nodes: Nodes) -> Partition:
    """A partition slurm.conf does not list: every node, cluster defaults.
    (Cached by identity: the site's Nodes object stays the same between
    reconfigures, and hashing a dataclass runs interpreted code.)"""
    global _unknown
    if _unknown[0] is not nodes:
        _unknown = (nodes, Partition(nodes=nodes))
    return _unknown[1]


def _partitions(job: Job, site: Site) -> list[Partition]:
    if not job.partition:
        part = site.partitions.get(site.default_partition or "")
        return [part or _unknown_partition(site.all_nodes)]
    names = [n.strip() for n in job.partition.split(",") if n.strip()]
    return [site.partitions.get(name) or _unknown_partition(site.all_nodes)
            for name in names] or [_unknown_partition(site.all_nodes)]


def _merge(dicts: list) -> dict:
    if len(dicts) == 1:
        return dict(dicts[0])
    out: dict = {}
    for d in dicts:
        for name, value in d.items():
            out[name] = max(out.get(name, 0), value)
    return out


def _whole_node_memory(nodes: Nodes, site: Site) -> int | None:
    """k8smemory of a job Slurm gives all of a node's memory (cons_tres
    job_test.c "Allocate all node memory"): all the node has, so no pod gets
    any of it."""
    most = nodes.memory or 1   # Slurm's default RealMemory
    if nodes.least_memory is not None and nodes.least_memory != most:
        raise PolicyError(
            f"this job gets all of a node's memory (--mem=0, or no memory asked and no "
            f"DefMemPerCPU/DefMemPerNode set), and its nodes have {nodes.least_memory} to "
            f"{most} MB: no single k8smemory count covers that; ask for --mem=<MB> or "
            f"--mem-per-cpu=<MB>, or add --exclusive (or set DefMemPerCPU in slurm.conf)")
    return max(0, most - site.reserve_memory) or None


def _fits(per_node: dict, nodes: Nodes) -> bool:
    """Whether the biggest of the nodes can hold these per-node figures."""
    return (not nodes.cpus or per_node.get(GRES_CPU, 0) <= nodes.cpus) and \
        (not nodes.memory or per_node.get(GRES_MEMORY, 0) <= nodes.memory)


def _room(per_node: dict, nodes: Nodes) -> int | None:
    """How many of the nodes have as many CPUs as per_node's k8scpu (None: unknown)."""
    need = per_node.get(GRES_CPU, 0)
    return sum(count for cpus, count in nodes.cpu_counts if cpus >= need) \
        if nodes.cpu_counts else None


def required(job: Job, site: Site) -> tuple[dict, dict]:
    """(per_node, per_task) counts of k8scpu/k8smemory the job must request."""
    parts = _partitions(job, site)
    plans = [_plan(job, site, part, len(parts) > 1) for part in parts]
    if len(parts) > 1:
        # Slurm runs the job in a partition whose nodes can hold it: one
        # that needs more per node than its biggest node has (seen: -p b,a
        # --mem-per-cpu above b's MaxMemPerCPU doubles the CPUs) is not where
        # it runs, so its figures must not make the job unrunnable in the others.
        fitting = [(plan, part) for plan, part in zip(plans, parts)
                   if _fits(plan.per_node, part.nodes)]
        if fitting:
            plans, parts = [plan for plan, _ in fitting], [part for _, part in fitting]
    memory_per_node = {bool(p.mem_per_node) for p in plans}
    if all(p.per_task is not None for p in plans) and len(memory_per_node) == 1:
        per_task = _merge([p.per_task for p in plans])
        mem = [p.mem_per_node for p in plans if p.mem_per_node]
        per_node = {GRES_MEMORY: max(mem)} if mem and GRES_MEMORY not in per_task else {}
    else:
        per_task, per_node = {}, _merge([p.per_node for p in plans])
        nodes = job.min_nodes or 1
        rooms = [_room(p.per_node, part.nodes) for p, part in zip(plans, parts)] \
            if all(p.most for p in plans) else [None]
        if all(r is not None and r < nodes for r in rooms):
            # Nodes of different sizes, and Slurm decides how many CPUs each
            # gets: the count that covers the most on one node does not fit
            # enough of them (Slurm would refuse it less clearly).
            raise PolicyError(
                f"this job may get up to {per_node[GRES_CPU]} CPUs on one of its nodes (Slurm "
                f"decides when it schedules it), so it must hold k8scpu:{per_node[GRES_CPU]} on "
                f"each; it needs {nodes} nodes and only {max(r or 0 for r in rooms)} of its "
                f"partition's nodes have that many CPUs: ask --ntasks-per-node=<k> (each node "
                f"then gets k x -c CPUs), fewer nodes (-N), or a partition whose nodes are all "
                f"of one size")
    limits = {GRES_CPU: NO_VAL, GRES_MEMORY: gres.MAX_COUNT}  # Slurm's own field widths
    for counts in (per_node, per_task):
        for name, value in counts.items():
            if value > limits[name]:
                raise PolicyError(f"{name}:{value} is larger than any node can have")
    return per_node, per_task


def _apply(current: str | None, want: dict, site: Site, field: str) -> str | None:
    """The new TRES string for `field`, or None if `current` already fits."""
    if not current and not want:
        return None
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
    slash = site.tres_slash if site.tres_slash is not None else site.slurm_version >= TRES_SLASH_FROM
    new = gres.with_counts(entries, final, slash)
    return None if new == (current or "") else new


def complete(job: Job, site: Site) -> Result:
    """Add or correct the job's k8scpu/k8smemory; PolicyError for bad input."""
    if job.ntasks_per_tres:
        # gres.c/gres_select_filter.c (22.05 and 24.11): --ntasks-per-gpu sets
        # ntasks_per_gres on every GRES of the job, and a GRES's CPUs are then
        # ntasks_per_gres x -c each: k8smemory:100 alone would need 200 CPUs.
        raise PolicyError("--ntasks-per-gpu cannot run with the k8scpu/k8smemory every job here "
                          "holds: Slurm applies it to each of a job's GRES (every MB of "
                          "k8smemory would need --ntasks-per-gpu CPUs); ask -n <tasks> with "
                          "--gpus or --gpus-per-node instead")
    if job.spread_job and site.spread_per_task_crashes and any(
            e.name for e in gres.parse(job.tres_per_job) + gres.parse(job.tres_per_task)):
        # Seen on 24.11.5 without any job_submit plugin: `sbatch -n3 --spread-job
        # --gpus=1` segfaults slurmctld (topology/default eval_nodes, as in _plan).
        raise PolicyError("--spread-job with a per-job or per-task GRES (--gpus, --gpus-per-task, "
                          "--tres-per-task) crashes slurmctld on this Slurm release; ask it per "
                          "node (--gpus-per-node) or leave out --spread-job")
    for tres in (job.tres_per_job, job.tres_per_socket):
        if tres and any(e.name in gres.OURS for e in gres.parse(tres)):
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
    elif job.tres_per_task:
        # Asked per node: a per-task entry of the same name would make Slurm
        # reject the mix (gres.c _test_gres_cnt); it is folded in instead.
        task_entries = gres.parse(job.tres_per_task)
        for name in per_node:
            asked = gres.count_of(task_entries, name)
            if asked is not None:
                per_node[name] = max(per_node[name], asked)
    new_node = _apply(job.tres_per_node, per_node, site, "tres_per_node")
    if per_task:
        # Drop per-node entries of names now counted per task.
        base = new_node if new_node is not None else (job.tres_per_node or "")
        stripped = gres.without(gres.parse(base), per_task)
        if stripped != (job.tres_per_node or ""):
            new_node = stripped
        new_task = _apply(job.tres_per_task, per_task, site, "tres_per_task")
    elif job.tres_per_task:
        stripped = gres.without(gres.parse(job.tres_per_task), per_node)
        new_task = stripped if stripped != job.tres_per_task else None
    else:
        new_task = None
    return Result(new_node, new_task, per_node, per_task)


# Fields of a job_modify that change what the job uses per node.
SHAPE_FIELDS = ("cpus_per_task", "num_tasks", "ntasks_per_node", "min_cpus", "min_nodes",
                "max_nodes", "pn_min_cpus", "mem_per_node", "mem_per_cpu", "tres_per_node",
                "tres_per_task", "tres_per_job", "tres_per_socket", "cpus_per_tres",
                "mem_per_tres", "partition", "ntasks_per_core", "threads_per_core",
                "ntasks_per_tres")


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
    if change.mem_per_node is not None:
        merged["mem_per_cpu"] = None
    if change.mem_per_cpu is not None:
        merged["mem_per_node"] = None
    result = complete(Job(**merged), site)

    def final(new, field):
        """Set the field when the job would otherwise end up different."""
        value = new if new is not None else (merged[field] or "")
        would_be = getattr(change, field) if getattr(change, field) is not None \
            else getattr(current, field)
        return None if value == (would_be or "") else value
    node, task = final(result.tres_per_node, "tres_per_node"), \
        final(result.tres_per_task, "tres_per_task")
    if result.per_task and task is None:
        # Slurm keeps per-task GRES x NumTasks as the job's per-job count
        # (gres.c _test_gres_cnt) and recomputes it only when the GRES is
        # sent again: resend it, so a new NumTasks is counted.
        task = result.tres_per_task if result.tres_per_task is not None \
            else (merged["tres_per_task"] or "")
    # That per-job count is stale once tasks or the mode change (Slurm then
    # refuses: "per-job not a multiple of per-task x NumTasks", or "per node
    # above per job"): clear it, and Slurm derives it anew.  Unless it also
    # holds the user's own per-job GRES: then Slurm refuses the update,
    # nothing is silently wrong.
    was_per_task = any(e.name in gres.OURS for e in gres.parse(current.tres_per_task))
    clear_job = bool(was_per_task and change.tres_per_job is None
                     and not gres.parse(current.tres_per_job))
    return Result(node, task, result.per_node, result.per_task, clear_job)
