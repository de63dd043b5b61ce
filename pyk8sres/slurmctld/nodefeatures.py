"""Policy of the node_features/k8s_resources plugin: a node's k8scpu/k8smemory.

slurmctld asks (through the C shim) whenever a node registers, at startup and
on `scontrol reconfigure`.  The answer is the total count Slurm may hand out
on that node; Slurm subtracts its own running jobs itself, so nothing here
looks at jobs.

What the state file (pyk8sres.slurmctld.nodestate) means here -- fail closed, because
handing Slurm capacity that Kubernetes pods hold double-books the node:

  node listed in `nodes`          -> that entry, capped at capacity
  node matching `unmanaged`       -> full capacity (no kubelet there)
  node in neither                 -> HOLD (0, 0): the daemon manages the
                                     cluster but has not counted this node
                                     yet (e.g. a new dynamic node); it will
                                     `scontrol update` it within a moment
  state file absent (state=None)  -> HOLD: nobody has said what Kubernetes
                                     holds.  A Slurm-only cluster says so
                                     with `"unmanaged": ["*"]`.
  state file corrupt              -> the caller gets StateError; the C shim
                                     then applies HOLD too (see plugin).

Capacity = CPUs - ReserveCPUs and RealMemory - ReserveMemory (k8s_resources.conf),
never negative.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

from .. import GRES_CPU, GRES_MEMORY

HOLD = (0, 0)


def capacity(config, cpus: int, real_memory_mb: int) -> tuple[int, int]:
    """What the node offers to both schedulers, after the admin's reserve."""
    return (max(0, int(cpus) - config.reserve_cpus),
            max(0, int(real_memory_mb) - config.reserve_memory_mb))


def is_unmanaged(state: dict, node_name: str) -> bool:
    return any(fnmatch.fnmatchcase(node_name, p) for p in state.get("unmanaged", ()))


def node_counts(config, node_name: str, cpus: int, real_memory_mb: int,
                state: Optional[dict]) -> tuple[int, int]:
    """(k8scpu, k8smemory) for `node_name`; `state` is nodestate.read_state()'s
    result or None when the file does not exist."""
    cap_cpu, cap_mem = capacity(config, cpus, real_memory_mb)
    if state is None:
        return HOLD
    entry = state.get("nodes", {}).get(node_name)
    if entry is not None:
        # Never above capacity: a count above what the node has would let
        # Slurm overbook it (and is what slurmd would call INVALID_REG).
        return (min(cap_cpu, max(0, entry[GRES_CPU])),
                min(cap_mem, max(0, entry[GRES_MEMORY])))
    if is_unmanaged(state, node_name):
        return cap_cpu, cap_mem
    return HOLD
