"""Policy of the node_features/k8s_resources plugin: a node's k8scpu/k8smemory.

slurmctld asks (through the C shim) whenever a node registers, at startup and
on `scontrol reconfigure`.  The answer is the node's total: what it offers to
both schedulers, CPUs - ReserveCPUs and RealMemory - ReserveMemory
(k8s_resources.conf), never negative.  It is never lowered for Kubernetes:
what pods hold is *allocated* next to Slurm's jobs, by the ledger
(pyk8sres/slurmctld/ledger.py), so a job that fits the node is queued, not
refused.
"""
from __future__ import annotations


def capacity(config, cpus: int, real_memory_mb: int) -> tuple[int, int]:
    """What the node offers to both schedulers, after the admin's reserve."""
    return (max(0, int(cpus) - config.reserve_cpus),
            max(0, int(real_memory_mb) - config.reserve_memory_mb))
