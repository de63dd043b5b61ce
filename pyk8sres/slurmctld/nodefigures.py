"""Per-node arithmetic of the job_submit policy: what Slurm allocates on
one node of a partition for a job, as functions of the tasks the node
holds (CPUs under whole cores and sockets, memory per node, per CPU or per
GPU, the partition's defaults and limits).  Pure functions; the rules
that choose per node or per task are in plans.py.
"""
from __future__ import annotations

from .. import GRES_CPU, GRES_MEMORY
from . import gres
from .jobspec import CR_BOARD, CR_CORE, CR_CPU, CR_MEMORY, CR_ONE_TASK_PER_CORE, CR_SOCKET, \
    Job, Nodes, Partition, PolicyError, Site


def gpu_count(tres: str | None) -> int | None:
    return gres.count_of(gres.parse(tres), "gpu") if tres else None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fixed_tasks(job: Job) -> int | None:
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


def max_tasks(job: Job) -> int:
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
    gpus = gpu_count(job.tres_per_node)
    if not gpus:
        per_task = gpu_count(job.tres_per_task)
        if per_task and tasks:
            gpus = per_task * tasks
        else:
            # Per job: all of them may land on one node; on several nodes
            # Slurm 22.05 may count up to all of a node's GPUs on each (seen:
            # --gpus=1 -n 5 --ntasks-per-node=2 had 2 GPUs' memory on each of
            # its 3 nodes, plugin or not).
            gpus = gpu_count(job.tres_per_job)
            if gpus and most and not _one_node(job):
                gpus = most
    if not gpus:
        per_socket = gpu_count(job.tres_per_socket)  # that many on each socket it uses
        gpus = (most or per_socket) if per_socket else None
    return min(gpus, most) if gpus and most else gpus


def _one_node(job: Job) -> bool:
    """Whether the job surely runs on one node."""
    return job.max_nodes == 1 or ((job.min_nodes or 1) == 1 and (job.num_tasks or 1) == 1)


def _asks_gpus(job: Job) -> bool:
    for tres in (job.tres_per_node, job.tres_per_task, job.tres_per_job, job.tres_per_socket):
        if tres and gpu_count(tres):
            return True
    return False


class NodeFigures:
    """What Slurm allocates on a node of one partition for this job, as
    functions of the tasks the node holds: the job's options once that
    partition's defaults and limits apply (job_mgr.c, cons_tres job_test.c),
    and the node layout (dist_tasks.c _block_sync_core_bitmap).  A plain
    class, as plans._Plan."""

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
        cores = ceil_div(n, self.vpus)
        if self.ntasks_per_core == 1 and c > self.vpus:  # each task on cores of its own
            cores = max(cores, n // c * ceil_div(c, self.vpus))
        return _whole_sockets(cores, self.socket_cores, self.most_cores) * self.tpc

    def rounded(self, n: int) -> int:
        """n CPUs as Slurm allocates them: whole cores (sockets) where it does."""
        if not self.whole_cores:
            return n
        return _whole_sockets(ceil_div(n, self.tpc), self.socket_cores, self.most_cores) * \
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


def node_figures(job: Job, site: Site, part: Partition) -> NodeFigures:
    """The job's figures in `part`: GPU defaults, the memory default,
    MaxMemPerCPU, all of a node's memory, --ntasks-per-node; then the layout."""
    nodes = part.nodes
    c = job.cpus_per_task or 1
    min_cpus_node = job.pn_min_cpus or 0
    mem_node, mem_cpu = job.mem_per_node, job.mem_per_cpu
    mem_per_gpu = gpu_count(job.mem_per_tres)
    cpus_per_gpu = gpu_count(job.cpus_per_tres)
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
        ratio = ceil_div(mem_cpu, max_mpc)
        c *= ratio
        mem_cpu = ceil_div(mem_cpu, ratio)
    elif max_mpc and mem_node:
        min_cpus_node = max(min_cpus_node, ceil_div(mem_node, max_mpc))
        if job.ntasks_per_node:
            c = max(c, ceil_div(min_cpus_node, job.ntasks_per_node))
    if default_cpus_per_gpu and job.tres_per_task:  # gres_select_util_job_set_defs()
        c = max(c, (gpu_count(job.tres_per_task) or 0) * default_cpus_per_gpu)

    param = site.select_type_param
    if mem_node == 0 and param & CR_MEMORY and not job.exclusive:
        mem_node = _whole_node_memory(nodes, site)
    if mem_per_gpu and not mem_node and gpu_count(job.tres_per_socket):
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
            (site.ntasks_per_node_fills and not one_task_per_node(job))):
        min_cpus_node = max(min_cpus_node, c * job.ntasks_per_node)
    return NodeFigures(job, nodes, param, c, min_cpus_node, cpus_per_gpu, mem_node, mem_cpu,
                        mem_per_gpu)


def one_task_per_node(job: Job) -> bool:
    """-O: Slurm gives each node one task's CPUs only when the job has no
    TresPerTask at all (cons_tres dist_tasks.c: `overcommit &&
    !tres_per_task`, the same from 22.05 to 26.05).  What differs by
    release is what puts something there: from 24.05 on, sbatch and salloc
    write `cpu=<c>` into TresPerTask whenever -c is given (slurm_opt.c
    slurm_option_update_tres_per_task); before, only a per-task GRES did.
    Our own per-task entries are never there for a -O job (it is asked
    per node)."""
    return job.overcommit and not gres.without(gres.parse(job.tres_per_task), gres.OURS)


def cpus_above_tasks(job: Job, c: int) -> bool:
    """NumCPUs (--mincpus x nodes, or -n x -c raised) above the tasks' CPUs."""
    return bool(job.min_cpus and job.min_cpus > (job.num_tasks or 0) * c)


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
