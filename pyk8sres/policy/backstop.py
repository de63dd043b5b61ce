"""Belt and braces: what Slurm really allocated on a node beyond what its
jobs hold as k8scpu/k8smemory.

job_submit makes every job hold k8scpu/k8smemory covering what Slurm
allocates it, and the ledger admits pods against that.  Two things can
still leave CPUs or memory in use that no k8scpu/k8smemory covers:

  a job holds less than it was allocated      a bug in the completion, a job
  (CPUAlloc/AllocMem above its k8s GRES)      submitted while the plugin was
                                              not loaded, an update it missed
  a job is COMPLETING                         Slurm frees its GRES, CPUs and
                                              memory at once, while its
                                              processes may run until KillWait

The sync daemon holds the difference in the node's ledger as one entry of
its own (KEY), next to the pods'.  Pods are then admitted against the
larger of what jobs hold and what Slurm allocated; jobs are not held back
twice (Slurm's own CPU and memory accounting already counts the first case,
and does not start jobs on a node while one completes).  A node newly
mapped while its pods cannot be counted is held whole (fence).

A Slurm node may offer more than its Kubernetes node's allocatable (a
worker pod whose limits exceed it, a host whose kubelet reserves CPUs and
memory for the system): Kubernetes keeps its pods within allocatable, but
jobs and pods together would not be.  The difference is held as one more
entry (BEYOND_KEY), so jobs + pods never exceed allocatable.  Pure: no I/O.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, NamedTuple

from .. import GRES_CPU, GRES_MEMORY
from .ledger import REGISTERED_KEY
from .hostlist import ascii_digits
from .quantities import QuantityError, parse_quantity

# The ledger entry that holds the difference (a name no pod UID can take).
KEY = "slurm:unheld"
# The entry that holds a whole node newly mapped to a Kubernetes node while
# the pods there cannot be counted yet (a watch broken, an unparsable pod):
# pods may already run on it, so no job may start until they are counted.
FENCE_KEY = "slurm:fence"
# The entry that holds what a Slurm node offers beyond its Kubernetes
# node's allocatable (no pod UID has a colon).
BEYOND_KEY = "k8s:beyond-allocatable"
# Entries that are no pod's, never held as a departed pod's (the ledger's
# own hold of a newly registered node included).
KEYS = (KEY, FENCE_KEY, BEYOND_KEY, REGISTERED_KEY)

# What a Kubernetes node offers pods, per resource: (millicores, bytes),
# None for a resource not known.
Offer = tuple  # tuple[int | None, int | None]


class Gap(NamedTuple):
    """CPUs and MB in use on a node that no job's k8s GRES covers."""
    unheld_cpus: int = 0         # allocated beyond the jobs' k8scpu
    unheld_mb: int = 0           # allocated beyond the jobs' k8smemory
    completing_cpus: int = 0     # of jobs COMPLETING there
    completing_mb: int = 0

    @property
    def cpus(self) -> int:
        return self.unheld_cpus + self.completing_cpus

    @property
    def mb(self) -> int:
        return self.unheld_mb + self.completing_mb


def gap(alloc_cpus: int, alloc_mb: int, jobs: Mapping | None,
        completing: tuple[int, int] = (0, 0)) -> Gap | None:
    """A node's gap from Slurm's CPUAlloc/AllocMem, the jobs' k8scpu/
    k8smemory as the ledger counts them ({"cpu": CPUs, "mem": MB}) and the
    CPUs and MB of its COMPLETING jobs.  None when the ledger's count is
    unknown: the caller keeps what it held before."""
    if not jobs or "cpu" not in jobs or "mem" not in jobs:
        return None
    return Gap(max(0, alloc_cpus - int(jobs["cpu"])), max(0, alloc_mb - int(jobs["mem"])),
               max(0, completing[0]), max(0, completing[1]))


def entry(g: Gap | None) -> tuple[int, int] | None:
    """The ledger entry (millicores, bytes) for a gap; None when nothing is
    to be held."""
    if g is None or (g.cpus <= 0 and g.mb <= 0):
        return None
    return g.cpus * 1000, g.mb << 20


def fence_rest(node, entries: Mapping[str, tuple]) -> tuple[int, int] | None:
    """The entry that, with `entries` (key -> (millicores, bytes), the
    fence's own left out), holds all of the node's k8scpu/k8smemory; None
    when they hold it all already, or the node is unknown."""
    whole = fence(node)
    if whole is None:
        return None
    others = [v for k, v in entries.items() if k != FENCE_KEY]
    cpu_m = max(0, whole[0] - sum(int(v[0]) for v in others))
    mem = max(0, whole[1] - sum(int(v[1]) for v in others))
    return (cpu_m, mem) if cpu_m or mem else None


def fence(node) -> tuple[int, int] | None:
    """The entry (millicores, bytes) that holds all of a Slurm node's
    k8scpu/k8smemory; None for a node Slurm does not list or without them."""
    if node is None:
        return None
    cpus, mb = node.gres.get(GRES_CPU, 0), node.gres.get(GRES_MEMORY, 0)
    return (cpus * 1000, mb << 20) if cpus or mb else None


def completing_per_node(jobs: list[tuple[str, list[tuple[list[str], int, int]]]]
                        ) -> dict[str, tuple[int, int]]:
    """Sum, per node, the CPUs and MB of COMPLETING jobs: each job as
    (state, [(nodes, cpus per node, MB per node), ...]) from `scontrol -d
    show job` (CPU_IDs and Mem of each node group)."""
    out: dict[str, tuple[int, int]] = {}
    for state, groups in jobs:
        if state != "COMPLETING":
            continue
        for nodes, cpus, mb in groups:
            for node in nodes:
                c, m = out.get(node, (0, 0))
                out[node] = (c + cpus, m + mb)
    return out


def completing_gpus_per_node(jobs: list[tuple[str, list[tuple[list[str], Iterable[int]]]]]
                             ) -> dict[str, frozenset]:
    """Per node, the GPU indices (Slurm's IDX) COMPLETING jobs were given:
    each job as (state, [(nodes, indices on each), ...]).  Slurm freed them
    when the job began completing; its processes may still use them."""
    out: dict[str, frozenset] = {}
    for state, groups in jobs:
        if state != "COMPLETING":
            continue
        for nodes, indices in groups:
            for node in nodes:
                out[node] = out.get(node, frozenset()) | frozenset(indices)
    return {n: g for n, g in out.items() if g}


def with_gpus(held: tuple[int, int] | None, completing: Iterable[int],
              jobs_hold: Iterable[int] = ()) -> tuple | None:
    """The backstop entry `held` (millicores, bytes) with the completing
    jobs' GPU indices added, less those a job holds now (Slurm gave them on:
    the job's own GRES count them)."""
    gpus = sorted(set(completing) - set(jobs_hold))
    if not gpus:
        return held
    cpu_m, mem = held or (0, 0)
    return cpu_m, mem, gpus


def gpu_indices(text: str) -> list[int]:
    """An IDX list -> its indices: '0-1,3' -> [0, 1, 3]; [] if malformed."""
    out = []
    for part in text.split(","):
        low, dash, high = part.partition("-")
        if not ascii_digits(low) or (dash and not ascii_digits(high)):
            return []
        out.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    return out


def cpu_ids_count(text: str) -> int:
    """How many CPUs a CPU_IDs list names: '0-3,6' -> 5."""
    count = 0
    for part in text.split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not ascii_digits(low) or (dash and not ascii_digits(high)):
            raise ValueError(f"not a CPU_IDs list: {text!r}")
        count += (int(high) - int(low) + 1) if high else 1
    return count


def message(node: str, g: Gap) -> str:
    """The Event's words for a gap that no COMPLETING job explains."""
    return (f"Slurm allocated {g.unheld_cpus} CPUs and {g.unheld_mb} MB on node {node} that "
            "its jobs do not hold as k8scpu/k8smemory (a job submitted while "
            "job_submit/k8s_resource_completion was not loaded, or a bug in it); "
            "they are held from pods until the jobs end")


def offered(k8s_node: Mapping) -> Offer:
    """(millicores, bytes) of a Kubernetes node's status.allocatable (which
    defaults to its capacity, as the API says); None for a resource missing
    or unparsable.  Rounded down: what is held beyond it rounds up."""
    status = k8s_node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    out = []
    for resource, scale in (("cpu", 1000), ("memory", 1)):
        try:
            value = parse_quantity(alloc[resource]) * scale
            out.append(math.floor(value) if value >= 0 else None)
        except (KeyError, QuantityError):
            out.append(None)
    return tuple(out)


def known_offer(now: Offer, last: Offer | None) -> Offer:
    """What a node offers as far as is known: each resource as it reads now,
    else as it last read (a status that loses its allocatable, or one that
    cannot be parsed, hands nothing back: fail closed)."""
    last = last or (None, None)
    return tuple(n if n is not None else o for n, o in zip(now, last))


def smallest(offers: Iterable[Offer]) -> Offer:
    """One Slurm node mapped from several Kubernetes nodes: the smallest
    known offer of each resource (holding the most)."""
    offers = list(offers)
    cpu = [o[0] for o in offers if o[0] is not None]
    mem = [o[1] for o in offers if o[1] is not None]
    return (min(cpu) if cpu else None, min(mem) if mem else None)


def beyond(node, offer: Offer) -> tuple[int, int] | None:
    """The entry (millicores, bytes) that holds what Slurm node `node`
    offers (its k8scpu/k8smemory totals) beyond `offer`; None when nothing
    is beyond it, the node is unknown, or nothing of the offer is known
    (a resource not known holds nothing of its own)."""
    whole = fence(node)
    if whole is None:
        return None
    held = tuple(max(0, w - o) if o is not None else 0 for w, o in zip(whole, offer))
    return held if any(held) else None


def keep_unknown(entry: tuple[int, int] | None, offer: Offer,
                 inherited: tuple[int, int]) -> tuple[int, int] | None:
    """A restarted sync daemon's BEYOND_KEY entry: `entry` as computed, with
    what the ledger held before (`inherited`) for each resource whose offer
    is not known yet (nothing is handed back that cannot be computed)."""
    got = tuple(i if o is None else e for e, o, i in zip(entry or (0, 0), offer, inherited))
    return got if any(got) else None
