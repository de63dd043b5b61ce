"""Per-option rules of the job_submit policy: for each partition the job
may run in, whether it asks per node or per task (--exclusive, -O, tasks
fixed by the shape, tasks spread, the most a node can get), and the
figures over all of its partitions (`required`).  The per-node arithmetic
is in nodefigures.py; completion.py's docstring has the whole table.
"""
from __future__ import annotations

from .. import GRES_CPU, GRES_MEMORY
from . import gres
from .jobspec import NO_VAL, PAIR_LOST_ABOVE_CPUS, PER_TASK_BREAKS_PLANE, Job, Nodes, Partition, \
    PolicyError, Site
from .nodefigures import NodeFigures, cpus_above_tasks, fixed_tasks, max_tasks, node_figures, \
    one_task_per_node


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
    (node_figures), then the mode: --exclusive, -O, tasks per node fixed
    by the shape, per task, or per node the most any node can get."""
    node = node_figures(job, site, part)
    if job.exclusive:
        return _exclusive_plan(node)
    if job.overcommit and not one_task_per_node(job):
        return _overcommit_spread_plan(job, node)
    fixed = 1 if job.overcommit else fixed_tasks(job)
    if fixed is not None:
        return _fixed_plan(job, node, fixed)
    per_task = _per_task_figures(job, site, node)
    if per_task is not None and not always_per_node:
        return _Plan(per_task, {}, node.mem_node)
    return _most_plan(job, node, per_task)


def _exclusive_plan(node: NodeFigures) -> _Plan:
    """--exclusive: whole nodes; Slurm allocates all of their CPUs and all
    of their k8scpu/k8smemory whatever is asked (seen in GresUsed), so ask
    the least a node with a task gets: the request must not change where
    Slurm puts the tasks (a per-task GRES would)."""
    return _Plan(None, node.figures(1, node.cpus(1)), node.mem_node)


def _overcommit_spread_plan(job: Job, node: NodeFigures) -> _Plan:
    """-O on a job with a TresPerTask: once it carries any GRES, Slurm lays
    its tasks out as without -O, c CPUs each, up to --ntasks-per-node on
    every node (25.11 dist_tasks.c _get_task_count: ntasks-per-node x
    nodes), but without raising pn_min_cpus (job_mgr.c: not for -O).  Seen
    on 25.11.7: -n 6 -c 1 --ntasks-per-node=2 -O with any GRES gets 2 CPUs
    on each of 3 nodes, without a GRES 1.  Per node, the most a node can
    get, capped at the biggest node (Slurm cannot allocate more there)."""
    most = job.ntasks_per_node or fixed_tasks(job) or max_tasks(job)
    one = node.cpus(1)
    n = node.cpus(most)
    if node.nodes.cpus:
        n = min(n, max(node.nodes.cpus, one))
    return _Plan(None, _capped_figures(node, most, n, one), node.mem_node, most=True)


def _fixed_plan(job: Job, node: NodeFigures, fixed: int) -> _Plan:
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


def _per_task_figures(job: Job, site: Site, node: NodeFigures) -> dict | None:
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
              and not job.threads_per_core and not cpus_above_tasks(job, node.c))
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


def _most_plan(job: Job, node: NodeFigures, per_task: dict | None) -> _Plan:
    """Per node: the most any node can get, capped at what the biggest node
    has (Slurm cannot allocate more there, so on nodes of one size this never
    makes a job unrunnable; on smaller nodes it cannot run: docs/job-requests.md, Known limits)."""
    most = max_tasks(job)
    one = node.cpus(1)
    extra = 0
    if cpus_above_tasks(job, node.c):
        # The extra may all land on one node (otherwise the tasks' CPUs
        # cover NumCPUs: cpus(most) is the most).
        extra = (job.min_cpus or 0) - ((job.min_nodes or 1) - 1) * one
    n = max(node.cpus(most), node.rounded(extra))
    if node.nodes.cpus:
        n = min(n, max(node.nodes.cpus, one))
    return _Plan(per_task, _capped_figures(node, most, n, one), node.mem_node, most=True)


def _capped_figures(node: NodeFigures, most: int, n: int, one: int) -> dict:
    """Figures of a node with `most` tasks on n CPUs, its per-CPU memory
    capped at the biggest node's (but never below one task's)."""
    out = {GRES_CPU: n}
    mem = node.memory(most, n)
    if mem and node.nodes.memory and not node.mem_node:
        mem = min(mem, max(node.nodes.memory, node.memory(1, one) or 0))
    if mem:
        out[GRES_MEMORY] = mem
    return out


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
