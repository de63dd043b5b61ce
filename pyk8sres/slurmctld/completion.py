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

from .. import GRES_CPU, GRES_MEMORY
from . import gres
from .jobspec import TRES_SLASH_FROM, Job, PolicyError, Result, Site
from .plans import required


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
        # --gpus=1` segfaults slurmctld (topology/default eval_nodes, as in plans._plan).
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
