"""Compiled by mypyc (meson.build), the job_submit path runs no interpreted
Python on a memo miss.  A dataclass's generated __init__ or __hash__, or a
NamedTuple's __new__, would each enter the eval loop, its code cold inside
slurmctld, on every job shape the memo has not seen (docs/performance.md)."""
import gc
import random
import sys

import pytest

from pyk8sres.slurmctld import jobspec, submit

from test_lua_baseline import CONFS, conf_site, random_job

SPREAD_JOB = 1 << 8


def hot_args(raw: dict, site: jobspec.Site) -> tuple:
    """A random job as pyk8sres_core.c _hot_args passes it (submit.HOT_ARGS)."""
    values = dict(raw, slurm_version=site.slurm_version,
                  def_mem_per_cpu=jobspec.MEM_PER_CPU | 100, select_type_param=site.select_type_param, max_mem_per_cpu=0, overcommit=0xFE,
                  spread_job=int(bool(raw["bitflags"] & SPREAD_JOB)), task_dist=0,
                  part_mem=None)
    return tuple(values[name] for name in submit.HOT_ARGS)


@pytest.mark.skipif(submit.__file__.endswith(".py"),
                    reason="the job_submit path runs interpreted here (source tree, no mypyc)")
@pytest.mark.parametrize("name", sorted(CONFS))
def test_a_miss_runs_no_interpreted_python(name, tmp_path):
    site = conf_site(name, tmp_path)
    rng = random.Random(f"compiled-{name}")
    jobs = [hot_args(random_job(rng, sorted(site.partitions)), site) for _ in range(400)]
    submit.use_site(site)
    for values in jobs:  # what is built once per site (its live settings, an unknown partition)
        submit.job_submit_values(*values)
    interpreted = []

    def profile(frame, event, arg):
        if event == "call":
            interpreted.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
    answers = []
    # Objects earlier tests left (HTTP clients, queues) are finalized by
    # whichever code triggers the collector: not inside the window.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        for values in jobs:
            answers.append(submit.job_submit_values(*values))
    finally:
        sys.setprofile(None)
        gc.enable()
    assert not interpreted, sorted(set(interpreted))
    assert {rc for rc, *_ in answers} == {submit.OK, submit.USER_ERROR}  # both paths ran
