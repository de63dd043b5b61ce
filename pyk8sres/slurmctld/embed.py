"""The boundary between slurmctld and Python: every C entry point lives here.

Nothing escapes: each function catches every exception and turns it into a
return code plus a message in the caller's buffer.  Hot path (job_submit)
does no I/O and allocates little; configuration is read in reconfigure().
"""
from __future__ import annotations

import dataclasses
import logging
import os

from . import completion, config
from .completion import NO_VAL, NO_VAL16, INFINITE, INFINITE16

PING_SENTINEL = 0x6b38
SLURM_DIST_PLANE = 0x0004  # slurm.h task_dist_states_t, under SLURM_DIST_STATE_BASE
OK, USER_ERROR, INTERNAL_ERROR = 0, 1, 2

log = logging.getLogger("pyk8sres")

_site = completion.Site()
_config = config.Config()


class _SlurmLogHandler(logging.Handler):
    """Python log records -> slurmctld's log (error/info/verbose/debug)."""

    def __init__(self, lib):
        super().__init__()
        self.lib = lib

    def emit(self, record):
        try:
            level = 0 if record.levelno >= logging.ERROR else (
                1 if record.levelno >= logging.WARNING else (
                    2 if record.levelno >= logging.INFO else 3))
            self.lib.pyk8sres_log(level, self.format(record).encode(errors="replace"))
        except Exception:  # logging must never break a call
            pass


def _text(ffi, ptr) -> str | None:
    return None if ptr == ffi.NULL else ffi.string(ptr).decode("utf-8", "replace")


def _put(ffi, buf, size: int, text: str) -> None:
    data = text.encode("utf-8", "replace")[: max(size - 1, 0)]
    if size > 0:
        ffi.memmove(buf, data + b"\0", len(data) + 1)


# The job's numbers and strings as the C struct names them (`cur_` + name for
# the job as it stands, in job_modify), in decode_job's order.
_NUMBERS = ("cpus_per_task", "num_tasks", "ntasks_per_node", "min_cpus", "min_nodes",
            "max_nodes", "pn_min_cpus", "ntasks_per_core", "threads_per_core", "overcommit",
            "pn_min_memory", "spread_job", "task_dist", "ntasks_per_tres")
_STRINGS = ("partition", "tres_per_node", "tres_per_task", "tres_per_job", "tres_per_socket",
            "cpus_per_tres", "mem_per_tres")
# Read by site_for() rather than into the Job: cluster settings slurmctld passes with each job.
SITE_FIELDS = ("def_mem_per_cpu", "slurm_version", "select_type_param", "max_mem_per_cpu",
               "part_mem")
_new_tuple = tuple.__new__


def decode_job(cpus_per_task, num_tasks, ntasks_per_node, min_cpus, min_nodes, max_nodes,
               pn_min_cpus, ntasks_per_core, threads_per_core, overcommit, pn_min_memory,
               spread_job, task_dist, ntasks_per_tres, exclusive, partition, tres_per_node,
               tres_per_task, tres_per_job, tres_per_socket, cpus_per_tres,
               mem_per_tres) -> completion.Job:
    """The Job from the struct's raw numbers: Slurm's NO_VAL family, INFINITE
    ("no limit") and 0 where the option cannot be 0 all mean "not given".

    Straight-line code that builds the tuple in Job's field order: this runs
    on every submission the C memo has not seen, with the CPU caches cold,
    where a loop over a table or Job(**fields) cost several times more."""
    # Slurm maps --mem-per-cpu=0 to --mem=0 (job_mgr.c _validate_job_desc)
    per_node, per_cpu = (0, None) if pn_min_memory == completion.MEM_PER_CPU else \
        completion.decode_memory(pn_min_memory)
    return _new_tuple(completion.Job, (
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


def _job(ffi, c, prefix: str, exclusive: bool) -> completion.Job:
    numbers = [getattr(c, prefix + name) for name in _NUMBERS]
    texts = [_text(ffi, getattr(c, prefix + name)) for name in _STRINGS]
    return decode_job(*numbers, exclusive, *texts)


def job_from_c(ffi, c) -> completion.Job:
    """The submitted job, or for job_modify only the fields being changed."""
    return _job(ffi, c, "", c.shared == completion.JOB_SHARED_NONE)


def current_from_c(ffi, c) -> completion.Job | None:
    """job_modify: the job as it stands (None if the plugin cannot see it)."""
    return _job(ffi, c, "cur_", c.cur_whole_node == 1) if c.has_current else None


_site_key = None
_with_parts: dict = {}  # part_mem string -> Site (the live partition settings applied)


def _max_per_cpu(value: int) -> int | None:
    """MaxMemPerCPU from Slurm's encoding (a MaxMemPerNode does not raise CPUs)."""
    per_node, per_cpu = completion.decode_memory(value)
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
        if not name or len(fields) != 4 or not all(f.isdigit() for f in fields):
            continue
        def_mem, max_mem, gpu_cpus, gpu_mem = (int(f) for f in fields)
        per_node, per_cpu = completion.decode_memory(def_mem)
        unset = completion.NO_VAL64
        out[name] = (completion.MemDefault(per_cpu=per_cpu or None, per_node=per_node or None),
                     _max_per_cpu(max_mem),
                     completion.GpuDefault(cpus=None if gpu_cpus == unset else gpu_cpus,
                                           mem=None if gpu_mem == unset else gpu_mem))
    return out


def site_for(c_def_mem: int, slurm_version: int, select_type_param: int | None = None,
             max_mem_per_cpu: int | None = None, part_mem: str | None = None):
    """The Site, refreshed if slurmctld's own settings changed (reconfigure),
    with the job's partitions' live memory settings when slurmctld gave them."""
    global _site, _site_key
    key = (c_def_mem, slurm_version, select_type_param, max_mem_per_cpu, _site)
    if key != _site_key:
        per_node, per_cpu = completion.decode_memory(c_def_mem)
        changes = dict(slurm_version=slurm_version,
                       cluster_mem=completion.MemDefault(per_cpu=per_cpu, per_node=per_node))
        if select_type_param is not None:
            changes["select_type_param"] = select_type_param
        if max_mem_per_cpu is not None:
            changes["max_mem_per_cpu"] = _max_per_cpu(max_mem_per_cpu)
        new = dataclasses.replace(_site, **changes)
        if new != _site:
            _forget_answers()
            _site = new
        _with_parts.clear()
        _site_key = (c_def_mem, slurm_version, select_type_param, max_mem_per_cpu, _site)
    if not part_mem:
        return _site
    site = _with_parts.get(part_mem)
    if site is None:
        partitions = dict(_site.partitions)
        for name, (mem, max_mpc, gpu) in parse_part_mem(part_mem).items():
            known = partitions.get(name, completion.Partition(nodes=_site.all_nodes))
            partitions[name] = dataclasses.replace(known, mem=mem, max_mem_per_cpu=max_mpc,
                                                   gpu=gpu)
        site = dataclasses.replace(_site, partitions=partitions)
        if len(_with_parts) > 256:
            _with_parts.clear()
        _with_parts[part_mem] = site
    return site


def reconfigure(slurm_conf_path: str) -> None:
    global _config, _site
    from . import slurmconf
    _config = config.load(slurm_conf_path)
    _forget_answers()
    conf = slurmconf.load(slurm_conf_path)
    _site = dataclasses.replace(_site, under_request=_config.under_request,
                                reserve_memory=_config.reserve_memory_mb,
                                partitions=conf.partitions, default_partition=conf.default_partition,
                                select_type_param=conf.select_type_param,
                                max_mem_per_cpu=conf.max_mem_per_cpu, all_nodes=conf.all_nodes,
                                cluster_gpu=conf.cluster_gpu)
    _with_parts.clear()


_ffi = None
_lib = None


def _forget_answers() -> None:
    """The C side memoizes our answers: drop them when the inputs change."""
    if _lib is not None:
        _lib.pyk8sres_memo_clear()


def _answer(result: completion.Result) -> tuple:
    bits = (1 if result.tres_per_node is not None else 0) | \
        (2 if result.tres_per_task is not None else 0) | \
        (4 if result.clear_tres_per_job else 0)
    return OK, bits, result.tres_per_node or "", result.tres_per_task or "", ""


def _refusal(exc: BaseException) -> tuple:
    if isinstance(exc, (completion.PolicyError, ValueError)):
        return USER_ERROR, 0, "", "", str(exc)
    # a bug: never let it reach slurmctld
    log.error("job_submit/k8s_resource_completion: internal error", exc_info=exc)
    if _config.on_internal_error == "accept":
        return OK, 0, "", "", ""
    return (INTERNAL_ERROR, 0, "", "", f"internal error ({type(exc).__name__}); the job "
            "was not submitted, please tell your administrator")


def job_submit(c) -> tuple:
    """The struct through cffi (job_modify; every call on Python >= 3.12)
    -> (rc, changed bits, tres_per_node, tres_per_task, error message)."""
    try:
        site = site_for(c.def_mem_per_cpu, c.slurm_version, c.select_type_param,
                        c.max_mem_per_cpu, _text(_ffi, c.part_mem))
        if c.is_modify:
            return _answer(completion.complete_modify(job_from_c(_ffi, c),
                                                      current_from_c(_ffi, c), site))
        return _answer(completion.complete(job_from_c(_ffi, c), site))
    except BaseException as exc:
        return _refusal(exc)


def job_submit_values(slurm_version, def_mem_per_cpu, select_type_param, max_mem_per_cpu,
                      cpus_per_task, num_tasks, ntasks_per_node, min_cpus, min_nodes,
                      max_nodes, pn_min_cpus, ntasks_per_core, threads_per_core, overcommit,
                      pn_min_memory, spread_job, task_dist, ntasks_per_tres, shared, partition,
                      tres_per_node, tres_per_task, tres_per_job, tres_per_socket, cpus_per_tres,
                      mem_per_tres, part_mem) -> tuple:
    """The hot path from C (plugins/pyk8sres_core.c, hot_args): a submission
    the memo has not seen, as the memo key's fields; the same answer as
    job_submit()."""
    try:
        site = site_for(def_mem_per_cpu, slurm_version, select_type_param, max_mem_per_cpu,
                        part_mem)
        job = decode_job(cpus_per_task, num_tasks, ntasks_per_node, min_cpus, min_nodes,
                         max_nodes, pn_min_cpus, ntasks_per_core, threads_per_core, overcommit,
                         pn_min_memory, spread_job, task_dist, ntasks_per_tres,
                         shared == completion.JOB_SHARED_NONE,
                         partition, tres_per_node, tres_per_task, tres_per_job,
                         tres_per_socket, cpus_per_tres, mem_per_tres)
        return _answer(completion.complete(job, site))
    except BaseException as exc:
        return _refusal(exc)


def bind(ffi, lib) -> None:
    """Register the entry points declared in plugins/pyk8sres_core.h."""
    if not log.handlers:
        handler = _SlurmLogHandler(lib)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False

    @ffi.def_extern(error=-1)
    def pyk8sres_ping(err, errlen):
        return PING_SENTINEL

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_reconfigure(path, accept_on_error, err, errlen):
        try:
            reconfigure(_text(ffi, path) or os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
            accept_on_error[0] = int(_config.on_internal_error == "accept")
            return OK
        except Exception as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return USER_ERROR if isinstance(exc, (config.ConfigError, OSError)) else INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_job_submit_py(c, changed, node_out, node_len, task_out, task_len, err, errlen):
        rc, bits, node, task, message = job_submit(c)
        changed[0] = bits
        _put(ffi, node_out, node_len, node)
        _put(ffi, task_out, task_len, task)
        _put(ffi, err, errlen, message)
        return rc

    global _ffi, _lib
    _ffi, _lib = ffi, lib
    # Everything imported so far lives as long as slurmctld: keep the cyclic
    # GC from rescanning it in the middle of a submission.
    import gc
    gc.freeze()

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_node_counts(node, cpus, real_memory, k8scpu, k8smemory, err, errlen):
        try:
            from . import nodefeatures
            k8scpu[0], k8smemory[0] = nodefeatures.capacity(_config, cpus, real_memory)
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_open(state_dir, allowed, n_allowed, share, err, errlen):
        global _ledger
        try:
            from .ledger import Ledger
            uids = {0, *(allowed[i] for i in range(n_allowed)), *_config.ledger_users}
            ledger = Ledger(_text(ffi, state_dir), allowed_uids=uids)
            ledger.load()
            for node, (cpu, mem) in ledger.shares().items():
                share(node.encode(), cpu, mem)
            _ledger = ledger
            _put(ffi, err, errlen, _config.ledger_socket or
                 os.path.join(_text(ffi, state_dir), "k8s_resources.socket"))
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_prepare(uid, line, ticket, reply, replylen):
        ticket[0] = 0
        try:
            number, answer = _ledger.prepare(uid, ffi.string(line))
        except BaseException as exc:
            log.exception("node_features/k8s_resources: ledger request failed")
            number, answer = 0, _internal(exc)
        ticket[0] = number
        if answer is not None:
            _put(ffi, reply, replylen, _reply_line(answer, replylen))
        return OK

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_apply(ticket, facts_fn, share, node_name, stats_fn, reply, replylen):
        from ..policy.ledger import Facts
        out = ffi.new("uint64_t[4]")

        def facts(node: str):
            return Facts(*out) if facts_fn(node.encode(), out) == 0 else None

        def names():
            i = 0
            while (name := node_name(i)) != ffi.NULL:
                if name[0] != b"\0":
                    yield ffi.string(name).decode()
                i += 1
        def stats():
            counters = ffi.new("uint64_t[3]")
            stats_fn(counters)
            return {"checks": counters[0], "check_ns": counters[1], "rebuilds": counters[2]}
        try:
            answer = _ledger.apply(ticket, facts, lambda n, c, m: share(n.encode(), c, m),
                                   names, stats)
        except BaseException as exc:
            log.exception("node_features/k8s_resources: ledger request failed")
            answer = _internal(exc)
        _put(ffi, reply, replylen, _reply_line(answer, replylen))
        return OK


_ledger = None


def _internal(exc: BaseException) -> dict:
    return {"ok": False, "code": "internal", "error": f"internal error ({type(exc).__name__}): "
            "see slurmctld's log"}


def _reply_line(answer: dict, limit: int) -> str:
    import json
    text = json.dumps(answer, separators=(",", ":"))
    if len(text) + 2 > limit:
        text = json.dumps({"ok": False, "code": "badrequest",
                           "error": f"reply larger than {limit} bytes: show one node at a time"})
    return text + "\n"
