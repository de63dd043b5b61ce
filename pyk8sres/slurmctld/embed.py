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
from .completion import NO_VAL, NO_VAL16, NO_VAL64, INFINITE, INFINITE16

PING_SENTINEL = 0x6b38
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


# Job field -> the values that mean "not set" in the C struct (Slurm's NO_VAL
# family, INFINITE for "no limit", 0 where the option cannot be 0).
_UNSET = {
    "cpus_per_task": (NO_VAL16, 0),
    "num_tasks": (NO_VAL, 0),
    "ntasks_per_node": (NO_VAL16, INFINITE16, 0),
    "min_cpus": (NO_VAL, 0),
    "min_nodes": (NO_VAL, 0),
    "max_nodes": (NO_VAL, INFINITE, 0),
    "pn_min_cpus": (NO_VAL16, NO_VAL, 0),
}
_STRINGS = ("partition", "tres_per_node", "tres_per_task", "tres_per_job", "tres_per_socket",
            "cpus_per_tres", "mem_per_tres")


# (Job field, C attribute, unset values) per struct prefix, computed once:
# this runs on every submission the C memo has not seen.
_READS = {prefix: [(name, prefix + name, unset) for name, unset in _UNSET.items()]
          for prefix in ("", "cur_")}
_TEXTS = {prefix: [(name, prefix + name) for name in _STRINGS] for prefix in ("", "cur_")}


def _job(ffi, c, prefix: str, exclusive: bool) -> completion.Job:
    values = {name: (None if value in unset else value)
              for name, attr, unset in _READS[prefix]
              for value in (getattr(c, attr),)}
    null, string = ffi.NULL, ffi.string
    for name, attr in _TEXTS[prefix]:
        ptr = getattr(c, attr)
        values[name] = None if ptr == null else string(ptr).decode("utf-8", "replace")
    memory = getattr(c, prefix + "pn_min_memory")
    values["mem_per_node"], values["mem_per_cpu"] = completion.decode_memory(
        None if memory == NO_VAL64 else memory)
    values["exclusive"] = exclusive
    return completion.Job(**values)


def job_from_c(ffi, c) -> completion.Job:
    """The submitted job, or for job_modify only the fields being changed."""
    return _job(ffi, c, "", c.shared == completion.JOB_SHARED_NONE)


def current_from_c(ffi, c) -> completion.Job | None:
    """job_modify: the job as it stands (None if the plugin cannot see it)."""
    return _job(ffi, c, "cur_", c.cur_whole_node == 1) if c.has_current else None


_site_key = None


def site_for(c_def_mem: int, slurm_version: int):
    """The Site, refreshed if slurmctld's own defaults changed (reconfigure)."""
    global _site, _site_key
    if (c_def_mem, slurm_version, _site) == _site_key:
        return _site
    per_node, per_cpu = completion.decode_memory(c_def_mem)
    cluster = completion.MemDefault(per_cpu=per_cpu, per_node=per_node)
    if cluster != _site.cluster_mem or slurm_version != _site.slurm_version:
        _forget_answers()
        _site = dataclasses.replace(_site, slurm_version=slurm_version, cluster_mem=cluster)
    _site_key = (c_def_mem, slurm_version, _site)
    return _site


def reconfigure(slurm_conf_path: str) -> None:
    global _config, _site
    from . import slurmconf
    _config = config.load(slurm_conf_path)
    _forget_answers()
    partitions, default = slurmconf.load_partition_memory(slurm_conf_path)
    _site = dataclasses.replace(_site, under_request=_config.under_request,
                                partition_mem=partitions, default_partition=default)


_ffi = None
_job_ptr = None
_lib = None


def _forget_answers() -> None:
    """The C side memoizes our answers: drop them when the inputs change."""
    if _lib is not None:
        _lib.pyk8sres_memo_clear()


def job_submit(c) -> tuple:
    """-> (rc, changed bits, tres_per_node, tres_per_task, error message)."""
    try:
        site = site_for(c.def_mem_per_cpu, c.slurm_version)
        if c.is_modify:
            result = completion.complete_modify(job_from_c(_ffi, c), current_from_c(_ffi, c), site)
        else:
            result = completion.complete(job_from_c(_ffi, c), site)
        bits = (1 if result.tres_per_node is not None else 0) | \
            (2 if result.tres_per_task is not None else 0)
        return OK, bits, result.tres_per_node or "", result.tres_per_task or "", ""
    except (completion.PolicyError, ValueError) as exc:
        return USER_ERROR, 0, "", "", str(exc)
    except BaseException as exc:  # a bug: never let it reach slurmctld
        log.exception("job_submit/k8s_resource_completion: internal error")
        if _config.on_internal_error == "accept":
            return OK, 0, "", "", ""
        return (INTERNAL_ERROR, 0, "", "", f"internal error ({type(exc).__name__}); the job "
                "was not submitted, please tell your administrator")


def job_submit_fast(address: int) -> tuple:
    """The hot path from C (plugins/pyk8sres_core.c): `address` is the job struct."""
    return job_submit(_ffi.cast(_job_ptr, address))


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

    global _ffi, _job_ptr, _lib
    _ffi, _job_ptr, _lib = ffi, ffi.typeof("struct pyk8sres_job *"), lib
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
