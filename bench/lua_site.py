"""The SITE table of bench/job_submit.lua, written from the facts our plugin
reads: slurm.conf and k8s_resources.conf (embed.conf_facts, as reconfigure
reads them), and the cluster's DefMemPerCPU/DefMemPerNode and Slurm release,
which slurmctld hands our plugin live and which Lua cannot see.

Used by bench_job_submit.py (the Lua baseline it times) and by
tests/unit/test_lua_baseline.py (the same answers as completion.complete).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess

from pyk8sres.slurmctld import config, embed, jobspec

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job_submit.lua")
PLACEHOLDER = "local SITE = nil -- @SITE@"
# Fields (of Nodes, Partition, Site) Python tests for truth, 0 and None
# alike; in Lua 0 is true.
_TRUTHY_ONLY = ("cpus", "memory", "count", "least_cpus", "gpus", "max_mem_per_cpu")


def lua(value) -> str:
    """A Lua literal for a Site and what it holds."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "{ " + ", ".join(lua(v) for v in value) + " }"
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        value = {k: (None if k in _TRUTHY_ONLY and not v else v) for k, v in value.items()}
    if isinstance(value, dict):
        return "{ " + ", ".join(f"[{lua(k)}] = {lua(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no Lua literal for {value!r}")


def script(site: jobspec.Site) -> str:
    """bench/job_submit.lua with its SITE filled in."""
    with open(SCRIPT) as f:
        text = f.read()
    if PLACEHOLDER not in text:
        raise ValueError(f"{SCRIPT} has no line {PLACEHOLDER!r}")
    return text.replace(PLACEHOLDER, f"local SITE = {lua(site)}")


def cluster_memory(lines: list[str]) -> jobspec.MemDefault:
    """slurm.conf's cluster-wide DefMemPerCPU / DefMemPerNode as slurmctld
    encodes them for our plugin (neither: per node 0, all of a node's memory)."""
    per_cpu = per_node = None
    for line in lines:
        if re.match(r"\s*(PartitionName|NodeName)=", line, re.I):
            continue
        for key, value in re.findall(r"(DefMemPerCPU|DefMemPerNode)=(\d+)", line, re.I):
            if key.lower() == "defmempercpu":
                per_cpu, per_node = int(value), None
            else:
                per_cpu, per_node = None, int(value)
    if per_cpu is None and per_node is None:
        per_node = 0
    return jobspec.MemDefault(per_cpu=per_cpu, per_node=per_node)


def slurm_version(env: dict | None = None) -> int:
    """The release the cluster of `env` (its SLURM_CONF) runs, as
    SLURM_VERSION_NUMBER (`slurm 22.05.8` -> 0x160508)."""
    out = subprocess.run(["scontrol", "--version"], capture_output=True, text=True,
                         env=env, check=True).stdout
    major, minor, micro = (int(x) for x in re.search(r"(\d+)\.(\d+)\.(\d+)", out).groups())
    return (major << 16) | (minor << 8) | micro


def site(slurm_conf: str, version: int) -> jobspec.Site:
    """What our plugin's Site holds for this slurm.conf (embed.reconfigure, site_for)."""
    with open(slurm_conf) as f:
        lines = f.read().splitlines()
    return jobspec.Site(slurm_version=version, cluster_mem=cluster_memory(lines),
                           **embed.conf_facts(slurm_conf, config.load(slurm_conf)))
