"""The C/Python boundary: decoding the flat job struct, and the C memo key.

The core memoizes Python's answer per job in C (plugins/pyk8sres_core.c):
that is only correct if the memo key holds every field the policy reads.
"""
import ast
import re
from pathlib import Path

import cffi
import pytest

from pyk8sres.slurmctld import _core_build
from pyk8sres.slurmctld import completion
from pyk8sres.slurmctld import jobspec
from pyk8sres.slurmctld import embed
from pyk8sres.slurmctld import submit

REPO = Path(__file__).resolve().parents[2]
HEADER = (REPO / "plugins" / "pyk8sres_core.h").read_text()
CORE_C = (REPO / "plugins" / "pyk8sres_core.c").read_text()
NO_VAL16, NO_VAL, NO_VAL64 = jobspec.NO_VAL16, jobspec.NO_VAL, jobspec.NO_VAL64

ffi = cffi.FFI()
ffi.cdef(_core_build.embedding_declarations(HEADER))


_alive = []  # C strings must outlive the structs that point at them


def c_job(**fields):
    job = ffi.new("struct pyk8sres_job *")
    for name, value in dict(cpus_per_task=NO_VAL16, num_tasks=NO_VAL, ntasks_per_node=NO_VAL16,
                            min_cpus=NO_VAL, min_nodes=NO_VAL, max_nodes=NO_VAL,
                            pn_min_cpus=NO_VAL16, pn_min_memory=NO_VAL64, shared=NO_VAL16,
                            het_job_offset=NO_VAL, slurm_version=0x160508,
                            ntasks_per_core=NO_VAL16, threads_per_core=NO_VAL16,
                            overcommit=0xFE, ntasks_per_tres=NO_VAL16).items():
        setattr(job, name, value)
    for name, value in fields.items():
        if isinstance(value, str):
            value = ffi.new("char[]", value.encode())
            _alive.append(value)
        setattr(job, name, value)
    return job


@pytest.mark.parametrize("fields,expected", [
    ({}, jobspec.Job()),
    ({"cpus_per_task": 3, "pn_min_memory": 4000}, jobspec.Job(cpus_per_task=3, mem_per_node=4000)),
    ({"pn_min_memory": jobspec.MEM_PER_CPU | 500}, jobspec.Job(mem_per_cpu=500)),
    # --mem-per-cpu=0: Slurm maps it to --mem=0 (job_mgr.c _validate_job_desc)
    ({"pn_min_memory": jobspec.MEM_PER_CPU}, jobspec.Job(mem_per_node=0)),
    ({"pn_min_memory": 0}, jobspec.Job(mem_per_node=0)),
    ({"ntasks_per_node": 0xFFFF, "max_nodes": 0xFFFFFFFF}, jobspec.Job()),
    ({"shared": 0, "tres_per_node": "gres:gpu:1"}, jobspec.Job(exclusive=True,
                                                                  tres_per_node="gres:gpu:1")),
    ({"ntasks_per_core": 1, "threads_per_core": 1, "overcommit": 1},
     jobspec.Job(ntasks_per_core=1, threads_per_core=1, overcommit=True)),
    ({"ntasks_per_core": 0xFFFF, "threads_per_core": NO_VAL16, "overcommit": 0xFE},
     jobspec.Job()),
    ({"spread_job": 1}, jobspec.Job(spread_job=True)),
    ({"task_dist": 0x4}, jobspec.Job(plane_distribution=True)),
    ({"task_dist": 0x2, "num_tasks": 4}, jobspec.Job(num_tasks=4)),  # cyclic
    ({"ntasks_per_tres": 2}, jobspec.Job(ntasks_per_tres=2)),
    ({"ntasks_per_tres": NO_VAL16}, jobspec.Job()),
])
def test_job_from_c(fields, expected):
    assert embed.job_from_c(ffi, c_job(**fields)) == expected


def test_fields_outside_the_memo_key_do_not_change_the_job():
    base = embed.job_from_c(ffi, c_job(cpus_per_task=2))
    other = embed.job_from_c(ffi, c_job(cpus_per_task=2, uid=1000, bitflags=123, max_cpus=9,
                                        contiguous=1, het_job_offset=1, array_inx="1-9",
                                        script_name="x.sh", is_modify=0))
    assert base == other


def test_memo_key_covers_every_field_the_policy_reads():
    body = re.search(r"struct memo_key \{(.*?)\};", CORE_C, re.S).group(1)
    key = set(re.findall(r"\b([a-z_]+)\b(?=[,;])", body))
    strings = set(re.findall(r"strings\[\d\] = j->(\w+);", CORE_C))
    site_numbers = set(embed.SITE_FIELDS) - {"part_mem"}  # submit.site_for
    read_by_policy = set(embed._NUMBERS) | {"shared"} | site_numbers
    assert read_by_policy <= key
    assert set(embed._STRINGS) | {"part_mem"} == strings


def _hot_args_order():
    """The names C passes to job_submit_values, in order (pyk8sres_core.c _hot_args)."""
    body = re.search(r"static int _hot_args\(.*?\n\}", CORE_C, re.S).group(0)
    numbers = re.findall(r"k->(\w+)", re.search(r"numbers\[\] = \{(.*?)\};", body, re.S).group(1))
    strings = dict((int(i), name) for i, name in re.findall(r"strings\[(\d)\] = j->(\w+);", CORE_C))
    return numbers + [strings[i] for i in sorted(strings)]


def _source_params(function: str) -> list:
    """A function's parameters as submit.py's source declares them (the
    compiled function has no signature to inspect)."""
    tree = ast.parse((REPO / "pyk8sres" / "slurmctld" / "submit.py").read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return [a.arg for a in node.args.args]


def test_hot_path_gets_the_memo_key_in_the_order_python_takes_it():
    """C calls job_submit_values positionally: a name out of place would
    hand the policy one field's value as another's."""
    params = _source_params("job_submit_values")
    assert _hot_args_order() == params == list(submit.HOT_ARGS)
    assert len(params) == int(re.search(r"#define HOT_ARGS (\d+)", CORE_C).group(1))


def test_decode_job_puts_each_value_in_its_field():
    numbers = {name: 100 + i for i, name in enumerate(embed._NUMBERS)}
    numbers["overcommit"] = 1
    numbers["spread_job"] = 1
    numbers["task_dist"] = 0x10004  # plane, with a flag bit above the base
    numbers["pn_min_memory"] = jobspec.MEM_PER_CPU | 777
    texts = {name: f"text-{name}" for name in embed._STRINGS}
    job = jobspec.decode_job(*numbers.values(), True, *texts.values())
    expected = {name: value for name, value in numbers.items()
                if name not in ("pn_min_memory", "task_dist")}
    expected.update(texts, overcommit=True, spread_job=True, plane_distribution=True,
                    exclusive=True, mem_per_cpu=777, mem_per_node=None)
    assert job._asdict() == expected
    assert type(job) is jobspec.Job


@pytest.mark.parametrize("fields", [
    {}, {"cpus_per_task": 3, "pn_min_memory": 4000}, {"num_tasks": 5, "min_nodes": 2},
    {"pn_min_memory": jobspec.MEM_PER_CPU | 500, "partition": "a,b"},
    {"shared": 0, "tres_per_node": "gres:gpu:1"}, {"tres_per_node": "gres:k8scpu:x"},
    {"ntasks_per_core": 1, "threads_per_core": 1, "overcommit": 1, "num_tasks": 3},
    {"tres_per_job": "gres:k8scpu:2"}, {"pn_min_memory": 0},
    {"num_tasks": 9, "min_nodes": 3, "max_nodes": 3, "spread_job": 1, "slurm_version": 0x180B05},
    {"num_tasks": 4, "min_nodes": 1, "max_nodes": 2, "task_dist": 4, "slurm_version": 0x180B05},
    {"num_tasks": 4, "ntasks_per_tres": 2, "tres_per_job": "gres:gpu:2"},
])
def test_hot_path_answers_as_the_cffi_path(fields, monkeypatch):
    """Same struct, both ways in: the arguments C builds from the memo key
    (_hot_args), and the struct read through cffi (job_modify, Python >= 3.12)."""
    monkeypatch.setattr(embed, "_ffi", ffi)
    c = c_job(**fields)
    values = [getattr(c, name) for name in _hot_args_order()]
    values = [ffi.string(v).decode() if isinstance(v, ffi.CData) and v != ffi.NULL else
              None if isinstance(v, ffi.CData) else v for v in values]
    assert submit.job_submit_values(*values) == embed.job_submit(c)


def test_every_job_field_is_read_from_c():
    """A Job field the C struct does not fill would silently stay None."""
    read = (set(embed._NUMBERS) - {"pn_min_memory", "task_dist"}) | set(embed._STRINGS) | \
        {"mem_per_node", "mem_per_cpu", "exclusive", "plane_distribution"}
    assert read == set(jobspec.Job._fields)


UNSET = jobspec.NO_VAL64
NO_GPU = jobspec.GpuDefault()


@pytest.mark.parametrize("text,expected", [
    ("", {}),
    (f"a={jobspec.MEM_PER_CPU | 300}:{jobspec.MEM_PER_CPU | 1000}:{UNSET}:{UNSET}",
     {"a": (jobspec.MemDefault(per_cpu=300), 1000, NO_GPU)}),
    (f"b=2000:0:{UNSET}:{UNSET},c=0:4000:{UNSET}:{UNSET}",
     {"b": (jobspec.MemDefault(per_node=2000), None, NO_GPU),
      "c": (jobspec.MemDefault(), None, NO_GPU)}),  # MaxMemPerNode: no CPU raise
    (f"g=0:0:4:{UNSET}", {"g": (jobspec.MemDefault(), None, jobspec.GpuDefault(cpus=4))}),
    ("h=0:0:0:2500",  # a partition's own 0 is a setting (it overrides the cluster's)
     {"h": (jobspec.MemDefault(), None, jobspec.GpuDefault(cpus=0, mem=2500))}),
    ("garbage,d=x:1:2:3,e=1:2", {}),
])
def test_live_partition_memory(text, expected):
    assert submit.parse_part_mem(text) == expected


def test_live_partition_memory_overrides_slurm_conf():
    """`scontrol update PartitionName=a DefMemPerCPU=300` reaches the policy
    through the string the C shim builds for each job."""
    submit.use_site(jobspec.Site(partitions={"a": jobspec.Partition(
        mem=jobspec.MemDefault(per_cpu=100))}, default_partition="a"))
    site = submit.site_for(jobspec.MEM_PER_CPU | 50, 0x160508, jobspec.CR_CORE, 0,
                          f"a={jobspec.MEM_PER_CPU | 300}:0:{UNSET}:{UNSET}")
    assert site.partitions["a"].mem == jobspec.MemDefault(per_cpu=300)
    assert site.cluster_mem == jobspec.MemDefault(per_cpu=50)
    assert completion.complete(jobspec.Job(partition="a"), site).per_node == \
        {"k8scpu": 1, "k8smemory": 300}
    assert submit.site_for(jobspec.MEM_PER_CPU | 50, 0x160508, jobspec.CR_CORE, 0,
                          None).partitions["a"].mem == jobspec.MemDefault(per_cpu=100)


def test_live_partition_gpu_defaults_override_slurm_conf():
    """`scontrol update PartitionName=a JobDefaults=DefCpuPerGPU=3` reaches the
    policy the same way; the cluster's own (slurm.conf) stays underneath."""
    submit.use_site(jobspec.Site(
        partitions={"a": jobspec.Partition(gpu=jobspec.GpuDefault(cpus=1))},
        default_partition="a", cluster_gpu=jobspec.GpuDefault(mem=2000)))
    site = submit.site_for(jobspec.MEM_PER_CPU | 100, 0x160508, jobspec.CR_CORE, 0,
                          f"a={jobspec.MEM_PER_CPU | 100}:0:3:{UNSET}")
    assert site.partitions["a"].gpu == jobspec.GpuDefault(cpus=3)
    assert completion.complete(jobspec.Job(partition="a", tres_per_node="gres:gpu:2"),
                               site).per_node == {"k8scpu": 6, "k8smemory": 4000}


@pytest.mark.parametrize("text,facts", [
    ("SLURM_VERSION=22.5.8\nGRES_FITS_CORES=1\nNTASKS_PER_NODE_FILLS=0\n"
     "SPREAD_PER_TASK_CRASHES=0\nPER_TASK_PAIR_LOST=0\nTRES_SLASH=0\n",
     (True, False, False, False, False)),
    ("SLURM_VERSION=23.2.8\nGRES_FITS_CORES=1\nNTASKS_PER_NODE_FILLS=0\n"
     "SPREAD_PER_TASK_CRASHES=0\nPER_TASK_PAIR_LOST=1\nTRES_SLASH=0\n",
     (True, False, False, True, False)),
    ("SLURM_VERSION=24.11.5\nGRES_FITS_CORES=1\nNTASKS_PER_NODE_FILLS=0\n"
     "SPREAD_PER_TASK_CRASHES=1\nPER_TASK_PAIR_LOST=0\nTRES_SLASH=1\n",
     (True, False, True, False, True)),
    ("SLURM_VERSION=26.5.3\nGRES_FITS_CORES=0\nNTASKS_PER_NODE_FILLS=1\n"
     "SPREAD_PER_TASK_CRASHES=0\nPER_TASK_PAIR_LOST=0\n", (False, True, False, False, None)),
    # no record: the answers that hold at least what any release allocates
    # and never hand slurmctld the job that crashes 24.11
    (None, (False, True, True, True, None)),
])
def test_release_facts_come_from_the_build(tmp_path, text, facts):
    path = tmp_path / "slurm_build.txt"
    if text is not None:
        path.write_text(text)
    assert embed.release_facts(str(path)) == dict(zip(
        ("gres_fits_cores", "ntasks_per_node_fills", "spread_per_task_crashes",
         "per_task_pair_lost", "tres_slash"),
        facts))


@pytest.mark.parametrize("setting", ["reject", "accept"])
def test_a_bug_is_an_internal_error_whatever_on_internal_error_says(tmp_path, setting):
    """OnInternalError=accept is the C side's to apply (and to log for every
    job it lets through): Python never answers "ok" for a bug, or the
    core's memo would keep that answer and accept the next jobs of the same
    shape silently."""
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    (tmp_path / "k8s_resources.conf").write_text(f"OnInternalError={setting}\n")
    site = submit.current_site()
    try:
        embed.reconfigure(str(tmp_path / "slurm.conf"))
        rc, changed, node, task, message = submit.refusal(RuntimeError("a bug"))
    finally:
        submit.use_site(site)
    assert rc == submit.INTERNAL_ERROR and (changed, node, task) == (0, "", "")
    assert "internal error (RuntimeError)" in message and "administrator" in message
    assert submit.refusal(ValueError("bad gres"))[0] == submit.USER_ERROR


def test_internal_error_tracebacks_are_rate_limited(caplog, monkeypatch):
    """A bug that hits every job logs one traceback per 10 s, the next one
    counting those not shown: slurmctld's log is not flooded."""
    monkeypatch.setattr(submit, "_traceback_at", None)
    monkeypatch.setattr(submit, "_tracebacks_held", 0)
    caplog.set_level("ERROR", logger="pyk8sres")
    for now in (100.0, 101.0, 105.0, 109.9, 110.0, 111.0):
        submit.log_bug(RuntimeError("a bug"), now)
    lines = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert lines == ["job_submit/k8s_resource_completion: internal error",
                     "job_submit/k8s_resource_completion: internal error "
                     "(3 more since the last one logged)"]
    assert all(r.exc_info for r in caplog.records if "internal error" in r.getMessage())
