"""Policy of the node_features/k8s_resources plugin: a node's k8scpu/k8smemory.

slurmctld asks (through the C shim) whenever a node registers, at startup and
on `scontrol reconfigure`.  The answer is the node's total as Slurm itself
schedules it: its effective CPUs (CPUs less the specialized ones,
CoreSpecCount x threads used per core or CpuSpecList, which Slurm keeps in
the node record as cpus_efctv) and RealMemory less MemSpecLimit, then less
the admin's ReserveCPUs/ReserveMemory (k8s_resources.conf), never negative.
Slurm never gives jobs the specialized cores or MemSpecLimit's memory, so
counting them would let a node look able to hold more than it can; under
Slinky's slurm-operator they are exactly what lies outside the worker pod's
limits.  It is never lowered for Kubernetes: what pods hold is *allocated*
next to Slurm's jobs, by the ledger (pyk8sres/slurmctld/ledger.py), so a job
that fits the node is queued, not refused.
"""
from __future__ import annotations


def capacity(config, cpus: int, real_memory_mb: int, cpus_effective: int | None = None,
             mem_spec_limit_mb: int = 0) -> tuple[int, int]:
    """What the node offers to both schedulers: Slurm's schedulable CPUs and
    memory (cpus_effective, None: all cpus; real memory less
    mem_spec_limit_mb), after the admin's reserve."""
    cpus = max(0, int(cpus))
    usable = cpus if cpus_effective is None else min(cpus, max(0, int(cpus_effective)))
    memory = max(0, int(real_memory_mb) - max(0, int(mem_spec_limit_mb)))
    return (max(0, usable - config.reserve_cpus),
            max(0, memory - config.reserve_memory_mb))
