"""Read what the policy needs from slurm.conf (pure parsing, plus one loader).

Only partition memory defaults are needed inside slurmctld: DefMemPerCPU /
DefMemPerNode per partition and which partition is the default.  The
cluster-wide default comes from slurmctld itself (slurm_conf.def_mem_per_cpu).
"""
from __future__ import annotations

import os
import shlex

from .completion import MemDefault


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


def partition_memory(lines: list[str]) -> tuple[dict, str | None]:
    """({partition: MemDefault}, default partition name) from slurm.conf lines."""
    partitions: dict = {}
    default = None
    for line in lines:
        try:
            pairs = _pairs(line)
        except ValueError:
            continue
        name = pairs.get("partitionname")
        if not name:
            continue
        def _int(key):
            value = pairs.get(key)
            return int(value) if value and value.isdigit() else None
        if name.lower() == "default":
            continue
        partitions[name] = MemDefault(per_cpu=_int("defmempercpu"),
                                      per_node=_int("defmempernode"))
        if pairs.get("default", "").lower() == "yes":
            default = name
    return partitions, default


def load_partition_memory(slurm_conf_path: str) -> tuple[dict, str | None]:
    return partition_memory(_lines(slurm_conf_path, set()))
