"""The job_submit hot path inside slurmctld: the call the C core makes for a
job shape its memo has not seen (job_submit_values), and the Site the policy
runs against: slurm.conf's facts (embed.reconfigure) refreshed with the
settings slurmctld passes with each job (its DefMemPerCPU, partitions'
memory and GPU defaults, which `scontrol update` changes live).

Compiled by mypyc with the policy (meson.build), so a miss never enters the
interpreter's eval loop.  No I/O; every exception becomes an answer.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import typing

from . import completion, jobspec
from .jobspec import Site

OK, USER_ERROR, INTERNAL_ERROR = 0, 1, 2
# job_submit_values' parameters, in the order pyk8sres_core.c _hot_args passes
# them (tests/unit/test_embed.py reads both; a compiled function has no
# signature to inspect).
HOT_ARGS = ("slurm_version", "def_mem_per_cpu", "select_type_param", "max_mem_per_cpu",
            "cpus_per_task", "num_tasks", "ntasks_per_node", "min_cpus", "min_nodes",
            "max_nodes", "pn_min_cpus", "ntasks_per_core", "threads_per_core", "overcommit",
            "pn_min_memory", "spread_job", "task_dist", "ntasks_per_tres", "shared",
            "partition", "tres_per_node", "tres_per_task", "tres_per_job", "tres_per_socket",
            "cpus_per_tres", "mem_per_tres", "part_mem")

log = logging.getLogger("pyk8sres")

_site = Site()
_site_key: tuple | None = None
_with_parts: dict = {}  # part_mem string -> Site (the live partition settings applied)
_forget_answers: typing.Callable[[], object] | None = None  # clears the C memo
# A bug that hits every job must not write a traceback per job into
# slurmctld's log: one per TRACEBACK_SECONDS, with a count of the others.
TRACEBACK_SECONDS = 10.0
_traceback_at: float | None = None
_tracebacks_held = 0
_topology: typing.Any = None  # topology.Topology: slurmctld's live partitions and nodes, once sent


def bind(forget_answers: typing.Callable[[], object]) -> None:
    """The C memo holds our answers: `forget_answers` drops them when the Site changes."""
    global _forget_answers
    _forget_answers = forget_answers


def _forget() -> None:
    if _forget_answers is not None:
        _forget_answers()


def use_site(site: Site) -> None:
    """Answer against `site` from now on (reconfigure; tests)."""
    global _site, _site_key
    _forget()
    _site, _site_key = site, None
    _with_parts.clear()


def use_topology(topology) -> None:
    """slurmctld's live partitions and nodes (topology.Topology) from now on;
    kept across a reload of slurm.conf (reapplied by with_topology)."""
    global _topology
    _topology = topology
    use_site(with_topology(_site))


def with_topology(site: Site) -> Site:
    """`site` with the nodes of each partition as slurmctld last had them:
    partitions slurmctld no longer has are dropped, new ones get the
    cluster's memory settings (the job's own partitions' live settings come
    with each job anyway: part_mem)."""
    if _topology is None:
        return site
    partitions = {name: dataclasses.replace(site.partitions.get(name, jobspec.Partition()),
                                            nodes=nodes)
                  for name, nodes in _topology.partitions.items()}
    return dataclasses.replace(site, partitions=partitions, all_nodes=_topology.all_nodes,
                               default_partition=_topology.default_partition
                               or site.default_partition)


def current_site() -> Site:
    """The Site with the live settings of the last job (reconfigure builds on it)."""
    return _site


def _max_per_cpu(value: int) -> int | None:
    """MaxMemPerCPU from Slurm's encoding (a MaxMemPerNode does not raise CPUs)."""
    per_node, per_cpu = jobspec.decode_memory(value)
    return per_cpu or None


def parse_part_mem(text: str) -> dict:
    """"name=DefMem:MaxMem:DefCpuPerGPU:DefMemPerGPU,..."
    (plugins/job_submit_k8s_resource_completion.c; Slurm's encodings, NO_VAL64
    for a JobDefaults entry the partition does not set)
    -> {name: (MemDefault, MaxMemPerCPU or None, GpuDefault)}."""
    out = {}
    for item in text.split(","):
        name, _, values = item.partition("=")
        fields = values.split(":")
        if not name or len(fields) != 4 or not all(f.isascii() and f.isdigit() for f in fields):
            continue
        def_mem, max_mem, gpu_cpus, gpu_mem = (int(f) for f in fields)
        per_node, per_cpu = jobspec.decode_memory(def_mem)
        unset = jobspec.NO_VAL64
        out[name] = (jobspec.MemDefault(per_cpu=per_cpu or None, per_node=per_node or None),
                     _max_per_cpu(max_mem),
                     jobspec.GpuDefault(cpus=None if gpu_cpus == unset else gpu_cpus,
                                        mem=None if gpu_mem == unset else gpu_mem))
    return out


def site_for(c_def_mem: int, slurm_version: int, select_type_param: int | None = None,
             max_mem_per_cpu: int | None = None, part_mem: str | None = None) -> Site:
    """The Site, refreshed if slurmctld's own settings changed (reconfigure),
    with the job's partitions' live memory settings when slurmctld gave them."""
    global _site, _site_key
    key = (c_def_mem, slurm_version, select_type_param, max_mem_per_cpu, _site)
    if key != _site_key:
        per_node, per_cpu = jobspec.decode_memory(c_def_mem)
        new = dataclasses.replace(
            _site, slurm_version=slurm_version,
            cluster_mem=jobspec.MemDefault(per_cpu=per_cpu, per_node=per_node),
            select_type_param=_site.select_type_param if select_type_param is None
            else select_type_param,
            max_mem_per_cpu=_site.max_mem_per_cpu if max_mem_per_cpu is None
            else _max_per_cpu(max_mem_per_cpu))
        if new != _site:
            _forget()
            _site = new
        _with_parts.clear()
        _site_key = (c_def_mem, slurm_version, select_type_param, max_mem_per_cpu, _site)
    if not part_mem:
        return _site
    site = _with_parts.get(part_mem)
    if site is None:
        partitions = dict(_site.partitions)
        for name, (mem, max_mpc, gpu) in parse_part_mem(part_mem).items():
            known = partitions.get(name, jobspec.Partition(nodes=_site.all_nodes))
            partitions[name] = dataclasses.replace(known, mem=mem, max_mem_per_cpu=max_mpc,
                                                   gpu=gpu)
        site = dataclasses.replace(_site, partitions=partitions)
        if len(_with_parts) > 256:
            _with_parts.clear()
        _with_parts[part_mem] = site
    return site


def answer(result: jobspec.Result) -> tuple:
    """(rc, changed bits, tres_per_node, tres_per_task, error message) for C."""
    bits = (1 if result.tres_per_node is not None else 0) | \
        (2 if result.tres_per_task is not None else 0) | \
        (4 if result.clear_tres_per_job else 0)
    return OK, bits, result.tres_per_node or "", result.tres_per_task or "", ""


def refusal(exc: BaseException) -> tuple:
    """The answer for an exception: the user's error, or a bug that must never
    reach slurmctld (logged).  A bug is always INTERNAL_ERROR, even with
    OnInternalError=accept: the C side accepts the job and logs that it did
    (plugins/job_submit_k8s_resource_completion.c), and the core's memo never
    keeps such an answer, so each job accepted that way is seen and logged."""
    if isinstance(exc, ValueError):  # PolicyError, GresError
        return USER_ERROR, 0, "", "", str(exc)
    log_bug(exc, time.monotonic())
    return (INTERNAL_ERROR, 0, "", "", f"internal error ({type(exc).__name__}) in "
            "job_submit/k8s_resource_completion, please tell your administrator")


def log_bug(exc: BaseException, now: float) -> None:
    """The traceback of an internal error, at most one per TRACEBACK_SECONDS
    (the next one says how many were not shown)."""
    global _traceback_at, _tracebacks_held
    if _traceback_at is not None and 0 <= now - _traceback_at < TRACEBACK_SECONDS:
        _tracebacks_held += 1
        return
    held, _tracebacks_held, _traceback_at = _tracebacks_held, 0, now
    log.error("job_submit/k8s_resource_completion: internal error%s",
              f" ({held} more since the last one logged)" if held else "", exc_info=exc)


def job_submit_values(slurm_version: int, def_mem_per_cpu: int, select_type_param: int,
                      max_mem_per_cpu: int, cpus_per_task: int, num_tasks: int,
                      ntasks_per_node: int, min_cpus: int, min_nodes: int, max_nodes: int,
                      pn_min_cpus: int, ntasks_per_core: int, threads_per_core: int,
                      overcommit: int, pn_min_memory: int, spread_job: int, task_dist: int,
                      ntasks_per_tres: int, shared: int, partition: str | None,
                      tres_per_node: str | None, tres_per_task: str | None,
                      tres_per_job: str | None, tres_per_socket: str | None,
                      cpus_per_tres: str | None, mem_per_tres: str | None,
                      part_mem: str | None) -> tuple:
    """The hot path from C (plugins/pyk8sres_core.c, _hot_args): a submission
    the memo has not seen, as the memo key's fields (HOT_ARGS); the same
    answer as embed.job_submit()."""
    try:
        site = site_for(def_mem_per_cpu, slurm_version, select_type_param, max_mem_per_cpu,
                        part_mem)
        job = jobspec.decode_job(
            cpus_per_task, num_tasks, ntasks_per_node, min_cpus, min_nodes, max_nodes,
            pn_min_cpus, ntasks_per_core, threads_per_core, overcommit, pn_min_memory,
            spread_job, task_dist, ntasks_per_tres, shared == jobspec.JOB_SHARED_NONE,
            partition, tres_per_node, tres_per_task, tres_per_job, tres_per_socket,
            cpus_per_tres, mem_per_tres)
        return answer(completion.complete(job, site))
    except BaseException as exc:
        return refusal(exc)
