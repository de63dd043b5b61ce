"""slurmctld's live partitions and nodes, as the job_submit plugin reads them.

Pure parsing (no I/O).  The plugin walks slurmctld's partition list and
node table under its read locks and passes a flat description whenever it
changed (plugins/job_submit_k8s_resource_completion.c, _topology_refresh):

    N <index> <cpus> <memory MB> <threads_per_core> <cores_per_socket> <gpus>
    P <partition> <index> <index> ...
    D <default partition>

(cpus: the node's effective CPUs, less CoreSpecCount/CpuSpecList, the
most Slurm allocates there, a whole node included; memory: RealMemory less
MemSpecLimit, what Slurm gives a job asking for all of a node's memory), so the policy caps per-node counts with the nodes
a partition really holds:
`scontrol update PartitionName=p Nodes=...`, dynamic nodes (`slurmd -Z`,
`scontrol create node`) and nodes a reconfigure added included.
"""
from __future__ import annotations

import typing

from .jobspec import Nodes
from .slurmconf import summarize


class Topology(typing.NamedTuple):
    partitions: dict   # name -> Nodes
    all_nodes: Nodes   # every node in the table
    default_partition: str | None = None


class TopologyError(ValueError):
    """A description the plugin should never send."""


def parse(text: str) -> Topology:
    nodes: dict[int, tuple] = {}
    members: dict[str, list[int]] = {}
    default = None
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            if fields[0] == "N" and len(fields) == 7:
                index, cpus, memory, threads, cores, gpus = (int(f) for f in fields[1:])
                # (ThreadsPerCore, CPUs, RealMemory, GPUs, CoresPerSocket), as slurmconf
                nodes[index] = (max(threads, 1), cpus, memory or None, gpus, max(cores, 1))
            elif fields[0] == "P" and len(fields) >= 2:
                members[fields[1]] = [int(f) for f in fields[2:]]
            elif fields[0] == "D" and len(fields) == 2:
                default = fields[1]
            else:
                raise TopologyError(f"line {number}: {line[:80]!r}")
        except ValueError as exc:
            raise TopologyError(f"line {number}: {line[:80]!r}: {exc}") from None
    every = list(nodes.values())
    all_nodes = summarize(every)
    partitions = {}
    for name, indices in members.items():
        held = [nodes[i] for i in indices if i in nodes]
        # A partition without nodes takes no job; the whole cluster bounds it as
        # slurm.conf's reader does.
        partitions[name] = summarize(held) if held else all_nodes
    return Topology(partitions, all_nodes, default)
