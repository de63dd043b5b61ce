"""The C/Python boundary: decoding the flat job struct, and the C memo key.

The core memoizes Python's answer per job in C (plugins/pyk8sres_core.c):
that is only correct if the memo key holds every field the policy reads.
"""
import re
from pathlib import Path

import cffi
import pytest

from pyk8sres.slurmctld import _core_build
from pyk8sres.slurmctld import completion
from pyk8sres.slurmctld import embed

REPO = Path(__file__).resolve().parents[2]
HEADER = (REPO / "plugins" / "pyk8sres_core.h").read_text()
CORE_C = (REPO / "plugins" / "pyk8sres_core.c").read_text()
NO_VAL16, NO_VAL, NO_VAL64 = completion.NO_VAL16, completion.NO_VAL, completion.NO_VAL64

ffi = cffi.FFI()
ffi.cdef(_core_build.embedding_declarations(HEADER))


_alive = []  # C strings must outlive the structs that point at them


def c_job(**fields):
    job = ffi.new("struct pyk8sres_job *")
    for name, value in dict(cpus_per_task=NO_VAL16, num_tasks=NO_VAL, ntasks_per_node=NO_VAL16,
                            min_cpus=NO_VAL, min_nodes=NO_VAL, max_nodes=NO_VAL,
                            pn_min_cpus=NO_VAL16, pn_min_memory=NO_VAL64, shared=NO_VAL16,
                            het_job_offset=NO_VAL, slurm_version=0x160508).items():
        setattr(job, name, value)
    for name, value in fields.items():
        if isinstance(value, str):
            value = ffi.new("char[]", value.encode())
            _alive.append(value)
        setattr(job, name, value)
    return job


@pytest.mark.parametrize("fields,expected", [
    ({}, completion.Job()),
    ({"cpus_per_task": 3, "pn_min_memory": 4000}, completion.Job(cpus_per_task=3, mem_per_node=4000)),
    ({"pn_min_memory": completion.MEM_PER_CPU | 500}, completion.Job(mem_per_cpu=500)),
    ({"ntasks_per_node": 0xFFFF, "max_nodes": 0xFFFFFFFF}, completion.Job()),
    ({"shared": 0, "tres_per_node": "gres:gpu:1"}, completion.Job(exclusive=True,
                                                                  tres_per_node="gres:gpu:1")),
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
    read_by_policy = set(embed._UNSET) | {"pn_min_memory", "shared"} | \
        {"def_mem_per_cpu", "slurm_version"}  # the last two: embed.site_for
    assert read_by_policy <= key
    assert set(embed._STRINGS) == strings
