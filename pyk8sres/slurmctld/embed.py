"""The boundary between slurmctld and Python: every cffi entry point lives
here (the C core's one direct call, for job shapes its memo has not seen, is
submit.job_submit_values).

Nothing escapes: each function catches every exception and turns it into a
return code plus a message in the caller's buffer.  job_submit does no I/O
and allocates little; configuration is read in reconfigure().
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os

from . import completion, config, jobspec, nodefeatures, slurmconf, submit, topology
from .ledger import FACTS_WORDS, MAX_CHANGED, Ledger, facts_from_words, gpu_mask

PING_SENTINEL = 0x6b38
OK, USER_ERROR, INTERNAL_ERROR = submit.OK, submit.USER_ERROR, submit.INTERNAL_ERROR

log = logging.getLogger("pyk8sres")

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
# the job as it stands, in job_modify), in jobspec.decode_job's order.
_NUMBERS = ("cpus_per_task", "num_tasks", "ntasks_per_node", "min_cpus", "min_nodes",
            "max_nodes", "pn_min_cpus", "ntasks_per_core", "threads_per_core", "overcommit",
            "pn_min_memory", "spread_job", "task_dist", "ntasks_per_tres")
_STRINGS = ("partition", "tres_per_node", "tres_per_task", "tres_per_job", "tres_per_socket",
            "cpus_per_tres", "mem_per_tres")
# Read by site_for() rather than into the Job: cluster settings slurmctld passes with each job.
SITE_FIELDS = ("def_mem_per_cpu", "slurm_version", "select_type_param", "max_mem_per_cpu",
               "part_mem")

def node_names(ffi, node_name):
    """The names node_name(0), node_name(1), ... give until NULL (slurmctld's
    node table; empty slots skipped)."""
    i = 0
    while (name := node_name(i)) != ffi.NULL:
        if name[0] != b"\0":
            yield ffi.string(name).decode()
        i += 1


def _job(ffi, c, prefix: str, exclusive: bool) -> jobspec.Job:
    numbers = [getattr(c, prefix + name) for name in _NUMBERS]
    texts = [_text(ffi, getattr(c, prefix + name)) for name in _STRINGS]
    return jobspec.decode_job(*numbers, exclusive, *texts)


def job_from_c(ffi, c) -> jobspec.Job:
    """The submitted job, or for job_modify only the fields being changed."""
    return _job(ffi, c, "", c.shared == jobspec.JOB_SHARED_NONE)


def current_from_c(ffi, c) -> jobspec.Job | None:
    """job_modify: the job as it stands (None if the plugin cannot see it)."""
    return _job(ffi, c, "cur_", c.cur_whole_node == 1) if c.has_current else None


def conf_facts(slurm_conf_path: str, settings: config.Config) -> dict:
    """The Site's fields that slurm.conf and k8s_resources.conf (`settings`)
    give; slurmctld passes the rest with each job (submit.site_for)."""
    conf = slurmconf.load(slurm_conf_path)
    return dict(under_request=settings.under_request, reserve_memory=settings.reserve_memory_mb,
                partitions=conf.partitions, default_partition=conf.default_partition,
                select_type_param=conf.select_type_param, max_mem_per_cpu=conf.max_mem_per_cpu,
                all_nodes=conf.all_nodes, cluster_gpu=conf.cluster_gpu)


# What meson detected in the Slurm release these plugins were built for.
BUILD_FACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_lib",
                           "slurm_build.txt")


def release_facts(path: str = BUILD_FACTS) -> dict:
    """The Site's release behaviour, as meson detected it in that release's
    source (_lib/slurm_build.txt, NAME=0|1 lines).  A build without the
    source detected nothing: then the answer right on every release (which
    may hold more than a given release needs, never less)."""
    detected = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.strip().partition("=")
                if sep:
                    detected[name] = value
    except OSError:
        pass
    return dict(gres_fits_cores=detected.get("GRES_FITS_CORES") == "1",
                ntasks_per_node_fills=detected.get("NTASKS_PER_NODE_FILLS", "1") == "1",
                spread_per_task_crashes=detected.get("SPREAD_PER_TASK_CRASHES", "1") == "1",
                per_task_pair_lost=detected.get("PER_TASK_PAIR_LOST", "1") == "1",
                tres_slash=detected["TRES_SLASH"] == "1" if "TRES_SLASH" in detected else None)


def reconfigure(slurm_conf_path: str) -> None:
    global _config
    _config = config.load(slurm_conf_path)
    if _ledger is not None:
        _ledger.allowed_uids = _allowed_uids()
    # slurmctld's live partitions and nodes, when the plugin sent them, stay
    # ahead of slurm.conf's until it sends them again (node_features reloads
    # slurm.conf too, without the job_submit plugin knowing).
    submit.use_site(submit.with_topology(dataclasses.replace(
        submit.current_site(), **conf_facts(slurm_conf_path, _config), **release_facts())))


_ffi = None


def job_submit(c) -> tuple:
    """The struct through cffi (job_modify; every call on Python >= 3.12)
    -> (rc, changed bits, tres_per_node, tres_per_task, error message)."""
    try:
        site = submit.site_for(c.def_mem_per_cpu, c.slurm_version, c.select_type_param,
                               c.max_mem_per_cpu, _text(_ffi, c.part_mem))
        if c.is_modify:
            return submit.answer(completion.complete_modify(job_from_c(_ffi, c),
                                                            current_from_c(_ffi, c), site))
        return submit.answer(completion.complete(job_from_c(_ffi, c), site))
    except BaseException as exc:
        return submit.refusal(exc)


def bind(ffi, lib) -> None:
    """Register the entry points declared in plugins/pyk8sres_core.h."""
    _log_to_slurmctld(lib)
    _bind_job_submit(ffi)
    global _ffi
    _ffi = ffi
    submit.bind(lib.pyk8sres_memo_clear)
    # Everything imported so far lives as long as slurmctld: keep the cyclic
    # GC from rescanning it in the middle of a submission.
    gc.freeze()
    _bind_node_counts(ffi)
    _bind_ledger_setup(ffi)
    _bind_ledger_requests(ffi)
    _bind_ledger_nodes(ffi)


def _log_to_slurmctld(lib) -> None:
    """Send the package's log records to slurmctld's log (once)."""
    if not log.handlers:
        handler = _SlurmLogHandler(lib)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False


def _bind_job_submit(ffi) -> None:
    """The job_submit plugin's entry points: ping, reconfigure, slurmctld's
    partitions and nodes, and the job through cffi."""
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
    def pyk8sres_topology(description, err, errlen):
        try:
            submit.use_topology(topology.parse(ffi.string(description).decode("utf-8",
                                                                              "replace")))
            return OK
        except BaseException as exc:
            log.exception("job_submit/k8s_resource_completion: slurmctld's partitions and nodes")
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_job_submit_py(c, changed, node_out, node_len, task_out, task_len, err, errlen):
        rc, bits, node, task, message = job_submit(c)
        changed[0] = bits
        _put(ffi, node_out, node_len, node)
        _put(ffi, task_out, task_len, task)
        _put(ffi, err, errlen, message)
        return rc


def _bind_node_counts(ffi) -> None:
    """node_features: a node's k8scpu/k8smemory capacity."""
    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_node_capacity(node, cpus, cpus_effective, real_memory, mem_spec_limit,
                               k8scpu, k8smemory, err, errlen):
        try:
            k8scpu[0], k8smemory[0] = nodefeatures.capacity(
                _config, cpus, real_memory, cpus_effective, mem_spec_limit)
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR


def _bind_ledger_setup(ffi) -> None:
    """node_features: opening the ledger, and its server's settings."""
    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_open(state_dir, allowed, n_allowed, owner, share, err, errlen):
        global _ledger, _ledger_base_uids
        try:
            _ledger_base_uids = frozenset({0, *(allowed[i] for i in range(n_allowed))})
            directory = _text(ffi, state_dir)
            ledger = _ledger if _ledger is not None and _ledger.directory == directory \
                else Ledger(directory)
            ledger.allowed_uids = _allowed_uids()
            before = (ledger.shares(), ledger.gpus())
            ledger.load(compact=bool(owner))
            _ledger = ledger
            after = (ledger.shares(), ledger.gpus())
            for node in sorted({*before[0], *before[1], *after[0], *after[1]}):
                if any(b.get(node) != a.get(node) for b, a in zip(before, after)):
                    cpu, mem = after[0].get(node, (0, 0))
                    share(node.encode(), cpu, mem,
                          ffi.new("uint64_t[]", gpu_mask(after[1].get(node, ()))))
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_settings(uids, max_uids, n_uids, group, conn_per_uid, socket_path,
                                 pathlen):
        try:
            users = _config.ledger_users[:max_uids]
            for i, uid in enumerate(users):
                uids[i] = uid
            n_uids[0] = len(users)
            group[0] = -1 if _config.ledger_group is None else _config.ledger_group
            conn_per_uid[0] = _config.ledger_connections_per_user
            _put(ffi, socket_path, pathlen, _config.ledger_socket)
            return OK
        except BaseException as exc:
            _put(ffi, socket_path, pathlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR


def _bind_ledger_requests(ffi) -> None:
    """node_features: a ledger request, checked (prepare) then applied."""
    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_prepare(uid, line, ticket, read_only, reply, replylen):
        ticket[0] = read_only[0] = 0
        try:
            number, answer = _ledger.prepare(uid, ffi.string(line))
            read_only[0] = int(bool(number) and _ledger.read_only(number))
        except BaseException as exc:
            log.exception("node_features/k8s_resources: ledger request failed")
            number, answer = 0, _internal(exc)
        ticket[0] = number
        if answer is not None:
            _put(ffi, reply, replylen, _reply_line(answer, replylen))
        return OK

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_apply(ticket, facts_fn, share, node_name, stats_fn, changes_fn,
                              reply, replylen):
        out = ffi.new("uint64_t[]", FACTS_WORDS)

        def facts(node: str):
            return facts_from_words(out) if facts_fn(node.encode(), out) == 0 else None

        def set_share(node: str, cpu: int, mem: int, gpus: tuple):
            share(node.encode(), cpu, mem, ffi.new("uint64_t[]", gpu_mask(gpus)))

        def names():
            return node_names(ffi, node_name)

        def stats():
            counters = ffi.new("uint64_t[3]")
            stats_fn(counters)
            return {"checks": counters[0], "check_ns": counters[1], "rebuilds": counters[2]}

        def fact_changes(layout: int, since: int):
            now = ffi.new("uint64_t[2]")
            indices = ffi.new("int[]", MAX_CHANGED)
            n = changes_fn(layout, since, now, indices, MAX_CHANGED)
            changed = None if n < 0 else [ffi.string(node_name(indices[i])).decode()
                                          for i in range(n)]
            return now[0], now[1], changed
        try:
            answer = _ledger.apply(ticket, facts, set_share,
                                   names, stats, fact_changes)
        except BaseException as exc:
            log.exception("node_features/k8s_resources: ledger request failed")
            answer = _internal(exc)
        _put(ffi, reply, replylen, _reply_line(answer, replylen))
        return OK

def _bind_ledger_nodes(ffi) -> None:
    """node_features: the nodes slurmctld has once in control, and a node
    registering (held whole if new: Ledger.registered)."""
    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_meet(node_name, err, errlen):
        try:
            if _ledger is not None:
                _ledger.meet(node_names(ffi, node_name))
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR

    @ffi.def_extern(error=INTERNAL_ERROR)
    def pyk8sres_ledger_registered(node, k8scpu, k8smemory, share, err, errlen):
        try:
            name = ffi.string(node).decode()
            new = None if _ledger is None else _ledger.registered(
                name, int(k8scpu), int(k8smemory), _config.hold_new_nodes == "yes")
            if new is not None:
                share(node, new[0], new[1], ffi.new("uint64_t[]", gpu_mask(new[2])))
            return OK
        except BaseException as exc:
            _put(ffi, err, errlen, f"{type(exc).__name__}: {exc}")
            return INTERNAL_ERROR


_ledger = None
_ledger_base_uids: frozenset = frozenset({0})   # root and SlurmUser


def _allowed_uids() -> frozenset:
    """Who may call the ledger: root, SlurmUser and LedgerUsers= as last read."""
    return frozenset({*_ledger_base_uids, *_config.ledger_users})


def _internal(exc: BaseException) -> dict:
    return {"ok": False, "code": "internal", "error": f"internal error ({type(exc).__name__}): "
            "see slurmctld's log"}


def _reply_line(answer: dict, limit: int) -> str:
    text = json.dumps(answer, separators=(",", ":"))
    if len(text) + 2 > limit:
        text = json.dumps({"ok": False, "code": "badrequest",
                           "error": f"reply larger than {limit} bytes: show one node at a time"})
    return text + "\n"
