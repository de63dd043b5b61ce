"""Read what the policy needs from slurm.conf (pure parsing, plus one loader).

Read at plugin init and `scontrol reconfigure`, never per job:
  * per partition: DefMemPerCPU / DefMemPerNode / MaxMemPerCPU /
    DefCpuPerGPU / DefMemPerGPU (a `PartitionName=DEFAULT` line sets them for
    the partitions after it, as in Slurm), and its nodes' most
    ThreadsPerCore, CPUs, RealMemory and GPUs;
  * which partition is the default; SelectTypeParameters; MaxMemPerCPU;
    the cluster's DefCpuPerGPU / DefMemPerGPU.
The cluster-wide DefMemPerCPU, and partition memory settings changed at run
time with `scontrol update PartitionName=...`, come from slurmctld itself
(the plugin passes them with every job: plugins/job_submit_k8s_resource_completion.c).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shlex

from ..policy.hostlist import ascii_digits as _digits, expand_hostlist  # noqa: F401
from .jobspec import (CR_BOARD, CR_CORE, CR_CPU, CR_MEMORY, CR_ONE_TASK_PER_CORE, CR_SOCKET,
                      GpuDefault, MemDefault, Nodes, Partition)


def _pairs(line: str) -> dict:
    pairs = {}
    for token in shlex.split(line, comments=False, posix=True):
        key, sep, value = token.partition("=")
        if sep:
            pairs[key.lower()] = value
    return pairs


def _lines(path: str, seen: set) -> list[str]:
    real = os.path.realpath(path)
    if real in seen:  # include loops
        return []
    seen.add(real)
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.lower().startswith("include "):
                target = line.split(None, 1)[1].strip()
                if not os.path.isabs(target):
                    target = os.path.join(os.path.dirname(path), target)
                out += _lines(target, seen)
                continue
            out.append(line)
    return out


def _int(pairs: dict, key: str) -> int | None:
    value = pairs.get(key)
    return int(value) if value and _digits(value) else None


@dataclasses.dataclass(frozen=True)
class SlurmConf:
    partitions: dict          # name -> Partition
    default_partition: str | None
    select_type_param: int
    max_mem_per_cpu: int | None
    all_nodes: Nodes
    cluster_gpu: GpuDefault = GpuDefault()


def _gpus(gres_list: str | None) -> int:
    """GPUs of a node's Gres= ("gpu:2", "gpu:a100:2,gpu:v100:1", "gpu:2(S:0-1)"),
    counted as Slurm does (gres.c _get_gres_cnt): socket bindings ignored, a
    type without a count ("gpu:a100") or a bare "gpu" is one, K/M suffixes
    multiply.  The job_submit plugin counts the node table the same way
    (_gres_gpus)."""
    total = 0
    for item in (gres_list or "").split(","):
        item = item.split("(", 1)[0]
        name, _, rest = item.partition(":")
        if name != "gpu":
            continue
        count = rest.rpartition(":")[2] if rest else ""
        digits = len(count) - len(count.lstrip("0123456789"))
        if not digits:
            total += 1
            continue
        unit = count[digits:digits + 1].lower()
        total += int(count[:digits]) * {"k": 1024, "m": 1024 * 1024}.get(unit, 1)
    return total


def effective_cpus(cpus: int, threads: int, tot_cores: int, core_spec_count: int = 0,
                   cpu_spec_list: str | None = None) -> int:
    """The CPUs Slurm can give jobs on a node, a whole node included:
    node_conf.c's cpus_efctv = CPUs less specialized cores x tpc, tpc the
    threads per core Slurm schedules (ThreadsPerCore when the node has fewer
    cores than CPUs, else 1).  CpuSpecList, when given, replaces
    CoreSpecCount, each CPU it names reserving its whole core (CPU i is in
    core i / tpc).  cons_tres never allocates the specialized cores (its
    mark_avail_cores and, for whole nodes, _clear_spec_cores) unless a job
    asks --core-spec under AllowSpecResourcesUsage."""
    tpc = threads if 0 < tot_cores < cpus else 1
    spec = max(0, core_spec_count)
    if cpu_spec_list:
        ids = set()
        for part in cpu_spec_list.split(","):
            low, _, high = part.strip().partition("-")
            if _digits(low) and (not high or _digits(high)):
                ids.update(range(int(low), min(int(high or low), cpus) + 1))
        spec = len({i // tpc for i in ids if i < cpus})
    return max(0, cpus - spec * tpc)


def _node(pairs: dict) -> tuple[int, int | None, int | None, int, int]:
    """(ThreadsPerCore, effective CPUs, RealMemory less MemSpecLimit, GPUs,
    CoresPerSocket) of one NodeName line's values (Slurm's defaults: a line with CPUs alone has
    sockets of one core)."""
    threads = _int(pairs, "threadspercore") or 1
    sockets = (_int(pairs, "sockets") or _int(pairs, "socketsperboard") or 1) * \
        (_int(pairs, "boards") or 1)
    cores = _int(pairs, "corespersocket")
    cpus = _int(pairs, "cpus") or _int(pairs, "procs")
    if cpus is None:
        cpus = sockets * (cores or 1) * threads
    # read_config.c: no Sockets= infers them from CPUs / (cores x threads)
    has_sockets = "sockets" in pairs or "socketsperboard" in pairs
    tot_sockets = sockets if has_sockets or cpus % ((cores or 1) * threads) else \
        max(1, cpus // ((cores or 1) * threads))
    tot_cores = tot_sockets * (cores or 1)
    if cores is None:
        cores = max(1, cpus // (sockets * threads)) if has_sockets else 1
    cpus = effective_cpus(cpus, threads, tot_cores, _int(pairs, "corespeccount") or 0,
                          pairs.get("cpuspeclist"))
    memory = _int(pairs, "realmemory")
    if memory:          # what Slurm gives a job asking for all of it (--mem=0)
        memory = (memory - (_int(pairs, "memspeclimit") or 0)) or None
        memory = memory if memory and memory > 0 else None
    return threads, cpus, memory, _gpus(pairs.get("gres")), cores


def summarize(nodes: list[tuple]) -> Nodes:
    """What the policy needs of a set of nodes, each (ThreadsPerCore, CPUs,
    RealMemory or None, GPUs, CoresPerSocket)."""
    if not nodes:
        return Nodes()
    memory = [n[2] for n in nodes if n[2]]
    return Nodes(threads_per_core=max(n[0] for n in nodes), cpus=max(n[1] for n in nodes),
                 memory=max(memory) if memory else None, count=len(nodes),
                 least_cpus=min(n[1] for n in nodes),
                 least_memory=min(n[2] or 1 for n in nodes),
                 gpus=max(n[3] for n in nodes) or None,
                 cores_per_socket=tuple(sorted({n[4] for n in nodes})),
                 cpu_counts=tuple(sorted(collections.Counter(n[1] for n in nodes).items(),
                                         reverse=True)))


def _gpu_default(pairs: dict) -> GpuDefault:
    return GpuDefault(cpus=_int(pairs, "defcpupergpu"), mem=_int(pairs, "defmempergpu"))


def _select_type_param(text: str | None) -> int:
    bits = {"cr_cpu": CR_CPU, "cr_cpu_memory": CR_CPU | CR_MEMORY, "cr_socket": CR_SOCKET,
            "cr_socket_memory": CR_SOCKET | CR_MEMORY, "cr_core": CR_CORE,
            "cr_core_memory": CR_CORE | CR_MEMORY, "cr_memory": CR_MEMORY,
            "cr_board": CR_BOARD, "cr_board_memory": CR_BOARD | CR_MEMORY,
            "cr_one_task_per_core": CR_ONE_TASK_PER_CORE}
    value = 0
    for word in (text or "").lower().split(","):
        value |= bits.get(word.strip(), 0)
    # Unset: assume whole cores (rounding up can only ask more, never less);
    # slurmctld's own value replaces this at run time anyway (submit.site_for).
    return value or CR_CORE


def parse(lines: list[str]) -> SlurmConf:
    node_default: dict = {}
    nodes: dict = {}          # name -> (threads, cpus, memory)
    part_default: dict = {}
    parts: dict = {}
    default = None
    select = None
    max_mpc = None
    cluster_gpu: dict = {}
    for line in lines:
        try:
            pairs = _pairs(line)
        except ValueError:
            continue
        if "selecttypeparameters" in pairs:
            select = pairs["selecttypeparameters"]
        if "partitionname" not in pairs and "nodename" not in pairs:
            if "maxmempercpu" in pairs:
                max_mpc = _int(pairs, "maxmempercpu")
            cluster_gpu.update({k: v for k, v in pairs.items()
                                if k in ("defcpupergpu", "defmempergpu")})
        if "nodename" in pairs:
            name = pairs["nodename"]
            if name.lower() == "default":
                node_default.update({k: v for k, v in pairs.items() if k != "nodename"})
                continue
            values = _node({**node_default, **pairs})
            for host in expand_hostlist(name):
                nodes[host] = values
        elif "partitionname" in pairs:
            name = pairs["partitionname"]
            if name.lower() == "default":
                part_default.update({k: v for k, v in pairs.items() if k != "partitionname"})
                continue
            merged = {**part_default, **pairs}
            parts[name] = merged
            if merged.get("default", "").lower() == "yes":
                default = name
    partitions = {}
    for name, pairs in parts.items():
        members = pairs.get("nodes", "")
        held = list(nodes.values()) if members.upper() == "ALL" else \
            [nodes[n] for n in expand_hostlist(members) if n in nodes]
        per_node = _int(pairs, "defmempernode")
        partitions[name] = Partition(
            mem=MemDefault(per_cpu=None if per_node else _int(pairs, "defmempercpu"),
                           per_node=per_node),
            max_mem_per_cpu=_int(pairs, "maxmempercpu"),
            nodes=summarize(held) if held else summarize(list(nodes.values())),
            gpu=_gpu_default(pairs))
    return SlurmConf(partitions, default, _select_type_param(select), max_mpc,
                     summarize(list(nodes.values())), _gpu_default(cluster_gpu))


def partition_memory(lines: list[str]) -> tuple[dict, str | None]:
    """({partition: MemDefault}, default partition name) from slurm.conf lines."""
    conf = parse(lines)
    return {name: p.mem for name, p in conf.partitions.items()}, conf.default_partition


def load(slurm_conf_path: str) -> SlurmConf:
    return parse(_lines(slurm_conf_path, set()))
