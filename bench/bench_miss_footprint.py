"""Where a job shape never seen before goes, in instructions and cache misses.

This VM exposes no hardware counters to perf, so cachegrind simulates them.
The program makes the Python half of a memo miss: the call the C core makes
(pyk8sres.slurmctld.submit.job_submit_values, with bench_job_submit.py's
"unique" shapes). Before each call it writes 4 MB, as slurmctld's own work
does between two submissions. The baseline is the same loop calling an empty
Python function, in the same run. The difference is printed per call.

    python3 bench/bench_miss_footprint.py [--calls 100]     (needs valgrind)

The caches are modelled on this machine's: 32 KB L1i and L1d, 1 MB L2 as the
last level. A miss of the last level goes to memory, and most of a cold call
is such misses.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

from pyk8sres.slurmctld import jobspec, submit

CACHES = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]


def args(i: int) -> tuple:
    """-c (1 + i % 4) --mem=(1000 + i) on a 22.05 CR_Core cluster, in
    the order plugins/pyk8sres_core.c _hot_args passes them."""
    nv, nv16 = jobspec.NO_VAL, jobspec.NO_VAL16
    return (0x160508, jobspec.MEM_PER_CPU | 100, jobspec.CR_CORE, 0, 1 + i % 4, nv, nv16, nv, nv, nv,
            nv16, nv16, nv16, 0xFE, 1000 + i, 0, nv, nv16, nv16,
            None, None, None, None, None, None, None, f"debug=0:0:{jobspec.NO_VAL64}:{jobspec.NO_VAL64}")


def child(mode: str, calls: int) -> None:
    """Runs under valgrind: warm up, then `calls` cold calls."""
    nodes = jobspec.Nodes(cpus=8, memory=16000, count=2, least_cpus=8)
    submit.use_site(jobspec.Site(partitions={"debug": jobspec.Partition(mem=jobspec.MemDefault(per_cpu=100),
                                                            nodes=nodes)},
                           default_partition="debug", all_nodes=nodes))

    def empty(*_):
        return None
    call = submit.job_submit_values if mode == "miss" else empty
    for i in range(300):
        submit.job_submit_values(*args(i))
    todo = [args(20_000 + i) for i in range(calls)]
    junk = ctypes.create_string_buffer(4 << 20)
    for values in todo:
        ctypes.memset(junk, 1, 4 << 20)
        call(*values)


def totals(path: str) -> dict:
    events = summary = None
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:"):
                summary = [int(x) for x in line.split()[1:]]
    return dict(zip(events, summary))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--child", choices=("miss", "empty"))
    a = ap.parse_args()
    if a.child:
        child(a.child, a.calls)
        return 0
    if not shutil.which("valgrind"):
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    wanted = len(submit.HOT_ARGS)
    if len(args(0)) != wanted:  # else the child dies of a TypeError under valgrind
        print(f"args() gives {len(args(0))} values, job_submit_values takes {wanted}: "
              "update args() to pyk8sres_core.c _hot_args", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="pyk8sres-footprint-")
    env = dict(os.environ, PYTHONHASHSEED="0")  # same dict layouts in both runs
    runs = {}
    for mode in ("miss", "empty"):
        out = os.path.join(work, mode)
        subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES,
                        f"--cachegrind-out-file={out}", sys.executable, __file__,
                        "--child", mode, "--calls", str(a.calls)],
                       env=env, check=True, capture_output=True)
        runs[mode] = totals(out)
    shutil.rmtree(work, ignore_errors=True)
    d = {k: (runs["miss"][k] - runs["empty"][k]) / a.calls for k in runs["miss"]}
    code, data = d["ILmr"], d["DLmr"] + d["DLmw"]
    print(f"per memo miss, Python side, over an empty Python call ({a.calls} calls):")
    print(f"  instructions        {d['Ir']:9.0f}")
    print(f"  L1 misses           {d['I1mr'] + d['D1mr'] + d['D1mw']:9.0f} "
          f"(code {d['I1mr']:.0f}, data {d['D1mr'] + d['D1mw']:.0f})")
    print(f"  last-level misses   {code + data:9.0f} (code {code:.0f}, data {data:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
