"""The benchmark's Lua baseline (bench/job_submit.lua) completes jobs exactly
as our policy does, so bench_job_submit.py compares the same work.

Random jobs (fixed seeds) as slurmctld hands them to job_submit/lua (its
getters: min_mem_per_node/min_mem_per_cpu, bitflags, nil for NULL strings)
go through the script's slurm_job_submit in a real Lua 5.1 interpreter (the
one Debian's job_submit/lua links), and the same raw values through
jobspec.decode_job + completion.complete.  Each answer must match: the same
refusal or the same tres_per_node and tres_per_task.  -O and --distribution
are never drawn: job_submit/lua cannot see them.
"""
import dataclasses
import os
import random
import shutil
import subprocess
import sys

import pytest

from pyk8sres.slurmctld import completion, jobspec
from pyk8sres.slurmctld.jobspec import MEM_PER_CPU, NO_VAL, NO_VAL16, NO_VAL64, INFINITE, \
    INFINITE16

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import lua_site  # noqa: E402

LUA = shutil.which("lua5.1")
SPREAD_JOB = 1 << 8
V2205, V2411 = 0x160508, 0x180B05

# slurm.conf of three sites: identical nodes; SMT nodes under CR_Socket with
# partition limits and GPU defaults; nodes of three sizes under CR_CPU
# without any memory default (whole nodes' memory).
CONFS = {
    "plain": (V2205, "correct", """
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=100
NodeName=n[1-2] CPUs=8 RealMemory=16000
PartitionName=debug Nodes=n[1-2] Default=YES
PartitionName=small Nodes=n1 DefMemPerCPU=300 MaxMemPerCPU=1000
"""),
    "smt": (V2411, "reject", """
SelectTypeParameters=CR_Socket_Memory
DefMemPerCPU=100
DefCpuPerGPU=2
NodeName=s[1-3] Sockets=2 CoresPerSocket=2 ThreadsPerCore=2 RealMemory=16000 Gres=gpu:2
PartitionName=DEFAULT DefMemPerCPU=200
PartitionName=a Nodes=s[1-3] Default=YES MaxMemPerCPU=1000
PartitionName=b Nodes=s[1-2] DefMemPerNode=4000 DefMemPerGPU=1500
"""),
    "mixed": (V2205, "correct", """
SelectTypeParameters=CR_CPU_Memory
NodeName=m1 CPUs=8 RealMemory=16000
NodeName=m2 CPUs=4 RealMemory=8000
NodeName=m3 CPUs=12 Sockets=2 CoresPerSocket=3 ThreadsPerCore=2 RealMemory=24000
PartitionName=all Nodes=m[1-3] Default=YES
PartitionName=same Nodes=m1 MaxMemPerCPU=2000
"""),
}

TRES_NODE = [None, None, None, "", "gres:gpu:1", "gres/gpu:2", "gres:k8scpu:2",
             "gres:k8scpu:99,gres:gpu:1", "gres:k8smemory:64", "gres:k8scpu:x",
             "gres:gpu:a100:1;gres:k8scpu:1", "license:foo:1", "gres:k8scpu:1k"]
TRES_TASK = [None, None, None, "gres:gpu:1", "gres/gpu=1", "gres:k8scpu:3",
             "gres:k8smemory:500", "gres:k8scpu:a:1"]
TRES_JOB = [None, None, None, None, "gres:gpu:2", "gres:k8scpu:1"]
TRES_SOCKET = [None] * 8 + ["gres:gpu:1"]
PER_GPU = [None] * 5 + ["gres:gpu:2", "gres:gpu:3000"]


def conf_site(name: str, tmp_path) -> jobspec.Site:
    """The Site our plugin reads from CONFS[name] (through bench/lua_site.py)."""
    version, under_request, text = CONFS[name]
    conf = tmp_path / "slurm.conf"
    conf.write_text(text)
    return dataclasses.replace(lua_site.site(str(conf), version), under_request=under_request,
                               spread_per_task_crashes=version == V2411)


def random_job(rng: random.Random, partitions: list[str]) -> dict:
    """Raw job_desc values, as slurmctld fills them (NO_VAL: not given)."""
    pick = rng.choice
    return dict(
        cpus_per_task=pick([NO_VAL16, NO_VAL16, 1, 2, 3, 4, 8]),
        num_tasks=pick([NO_VAL, NO_VAL, 1, 2, 3, 5, 8, 12, 17]),
        ntasks_per_node=pick([NO_VAL16, NO_VAL16, NO_VAL16, INFINITE16, 1, 2, 4]),
        min_cpus=pick([NO_VAL, NO_VAL, 0, 1, 4, 9, 20]),
        min_nodes=pick([NO_VAL, NO_VAL, 1, 2, 3]),
        max_nodes=pick([NO_VAL, NO_VAL, INFINITE, 1, 2, 3]),
        pn_min_cpus=pick([NO_VAL16, NO_VAL16, NO_VAL16, 2, 6]),
        ntasks_per_core=pick([NO_VAL16, NO_VAL16, INFINITE16, 1, 2]),
        threads_per_core=pick([NO_VAL16, NO_VAL16, NO_VAL16, 1, 2]),
        pn_min_memory=pick([NO_VAL64, NO_VAL64, 0, 2000, 20000, MEM_PER_CPU,
                            MEM_PER_CPU | 500, MEM_PER_CPU | 3000]),
        shared=pick([NO_VAL16, NO_VAL16, 0, 1]),
        bitflags=pick([0, 0, 0, SPREAD_JOB]),
        ntasks_per_tres=pick([NO_VAL16] * 9 + [2]),
        partition=pick([None, None, "", "nope", *partitions, ",".join(partitions),
                        ",".join(reversed(partitions))]),
        tres_per_node=pick(TRES_NODE), tres_per_task=pick(TRES_TASK),
        tres_per_job=pick(TRES_JOB), tres_per_socket=pick(TRES_SOCKET),
        cpus_per_tres=pick(PER_GPU), mem_per_tres=pick(PER_GPU))


def python_answer(raw: dict, site: jobspec.Site) -> tuple:
    """("error",) or ("ok", final tres_per_node, final tres_per_task)."""
    job = jobspec.decode_job(
        raw["cpus_per_task"], raw["num_tasks"], raw["ntasks_per_node"], raw["min_cpus"],
        raw["min_nodes"], raw["max_nodes"], raw["pn_min_cpus"], raw["ntasks_per_core"],
        raw["threads_per_core"], 0, raw["pn_min_memory"], int(bool(raw["bitflags"] & SPREAD_JOB)),
        0, raw["ntasks_per_tres"], raw["shared"] == jobspec.JOB_SHARED_NONE,
        raw["partition"], raw["tres_per_node"], raw["tres_per_task"], raw["tres_per_job"],
        raw["tres_per_socket"], raw["cpus_per_tres"], raw["mem_per_tres"])
    try:
        result = completion.complete(job, site)
    except ValueError:  # PolicyError, GresError: the user's error
        return ("error",)
    node = raw["tres_per_node"] if result.tres_per_node is None else result.tres_per_node
    task = raw["tres_per_task"] if result.tres_per_task is None else result.tres_per_task
    return ("ok", node or "", task or "")


def lua_job_desc(raw: dict) -> str:
    """The job as job_submit/lua's getters show it."""
    fields = {k: v for k, v in raw.items() if k != "pn_min_memory"}
    memory = raw["pn_min_memory"]
    if memory != NO_VAL64:
        key = "min_mem_per_cpu" if memory & MEM_PER_CPU else "min_mem_per_node"
        fields[key] = memory & ~MEM_PER_CPU
    return lua_site.lua({k: v for k, v in fields.items() if v is not None})


def part_list(site: jobspec.Site) -> str:
    """job_submit/lua's part_list: each partition's live memory settings."""
    parts = {}
    for name, part in site.partitions.items():
        live = {"def_mem_per_node": 0}  # Slurm's encoding of "not set"
        if part.mem.per_cpu:
            live = {"def_mem_per_cpu": part.mem.per_cpu}
        elif part.mem.per_node:
            live = {"def_mem_per_node": part.mem.per_node}
        if part.max_mem_per_cpu:
            live["max_mem_per_cpu"] = part.max_mem_per_cpu
        parts[name] = live
    return lua_site.lua(parts)


def lua_answers(jobs: list[dict], site: jobspec.Site, tmp_path) -> list[tuple]:
    script = tmp_path / "job_submit.lua"
    script.write_text(lua_site.script(site))
    driver = tmp_path / "driver.lua"
    driver.write_text(f"""
slurm = {{ SUCCESS = 0, ERROR = -1, log_user = function(...) end }}
dofile({lua_site.lua(str(script))})
local part_list = {part_list(site)}
local jobs = {{ {", ".join(lua_job_desc(raw) for raw in jobs)} }}
for _, d in ipairs(jobs) do
  if slurm_job_submit(d, part_list, 0) ~= slurm.SUCCESS then
    io.write("error\\n")
  else
    io.write("ok\\t", d.tres_per_node or "", "\\t", d.tres_per_task or "", "\\n")
  end
end
""")
    out = subprocess.run([LUA, str(driver)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [tuple(line.split("\t")) for line in out.stdout.split("\n")[:-1]]


@pytest.mark.skipif(LUA is None, reason="no lua5.1 (tools/install-deps.sh installs it)")
@pytest.mark.parametrize("name", sorted(CONFS))
def test_lua_baseline_answers_as_the_policy(name, tmp_path):
    site = conf_site(name, tmp_path)
    rng = random.Random(f"lua-{name}")
    jobs = [random_job(rng, sorted(site.partitions)) for _ in range(1500)]
    want = [python_answer(raw, site) for raw in jobs]
    got = lua_answers(jobs, site, tmp_path)
    assert len(got) == len(jobs)
    differ = [(raw, w, g) for raw, w, g in zip(jobs, want, got) if w != g]
    assert not differ, f"{len(differ)} of {len(jobs)} differ, e.g. {differ[:3]}"
    # Not vacuous: refusals, per-node and per-task answers all came up.
    assert sum(w == ("error",) for w in want) > 20
    assert sum("k8scpu" in w[1] for w in want if w[0] == "ok") > 100
    per_task = sum("k8scpu" in w[2] for w in want if w[0] == "ok")
    assert per_task == 0 if name == "smt" else per_task > 20  # CR_Socket: never per task


def test_site_literal():
    nodes = jobspec.Nodes(cpus=0, memory=None, least_memory=0, cpu_counts=((8, 2),))
    text = lua_site.lua(jobspec.Partition(nodes=nodes, max_mem_per_cpu=0))
    assert '["cpus"] = nil' in text and '["least_memory"] = 0' in text
    assert '["cpu_counts"] = { { 8, 2 } }' in text and '["max_mem_per_cpu"] = nil' in text
    assert lua_site.cluster_memory(["DefMemPerCPU=100"]) == jobspec.MemDefault(per_cpu=100)
    assert lua_site.cluster_memory(["PartitionName=a DefMemPerCPU=5"]) == \
        jobspec.MemDefault(per_node=0)
