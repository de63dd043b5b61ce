"""Benchmark: what job_submit/k8s_resource_completion costs inside slurmctld.

Measured exactly, per submission, by a timing plugin listed on both sides of
the plugin under test (JobSubmitPlugins=bench_timer,<plugin>,bench_timer).
In one run, on one local cluster, over the same submissions:
  none  - bench_timer,bench_timer (the baseline: nothing between the stamps)
  ours  - our plugin (embedded Python, C-side memo of Python's answers)
  lua   - Slurm's job_submit/lua running the same completion (bench/job_submit.lua,
          every rule of our policy; tests/unit/test_lua_baseline.py checks the
          answers are ours, and this run compares the GRES the jobs got)
Three workloads: "mixed" cycles through a few common job shapes (what a real
queue sees: most submissions repeat a shape), "unique" gives every
submission a shape never seen before (every call goes into Python / Lua),
"stream" replays a realistic stream (fixed seed): campaigns that repeat one
shape a heavy-tailed number of times, arrays of varying size, -n drawn from
a heavy-tailed (Pareto) distribution.
Optionally with a big queue of held jobs (--queue 10000): job_submit/lua
rebuilds a table of all jobs before its calls.

Usage (root, after `pip install .`):  python3 bench/bench_job_submit.py [--jobs 1000] [--queue 0]
    [--workloads mixed,unique,stream]
Prints each figure and the ratios; exits 1 if the goals are missed.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pyk8sres.slurmctld import submit as hot_path
from pyk8sres.testbed import cluster

import lua_site

HERE = os.path.dirname(os.path.abspath(__file__))
MIXED = [["-c", "1"], ["-c", "2"], ["-c", "4", "--mem=2000"], ["-n", "4"],
         ["-N", "2", "--ntasks-per-node=2"], ["-c", "2", "--mem-per-cpu=300"],
         ["-n", "2", "-c", "2"], []]
GOAL_MEDIAN_US, GOAL_P99_US = 30.0, 200.0
NODES, CPUS = 2, 8


def stream_shapes(count: int, seed: int = 7) -> list[list[str]]:
    """Campaigns of one shape (heavy-tailed length), some of them arrays;
    -n heavy-tailed (mostly 1-3 tasks, sometimes the whole cluster)."""
    rng = random.Random(seed)
    out: list[list[str]] = []
    while len(out) < count:
        c = rng.choice([1, 1, 1, 2, 4, 8])
        n = max(1, min(int(rng.paretovariate(1.1)), NODES * CPUS // c))
        shape = [f"-n{n}", f"-c{c}"]
        memory = rng.random()
        if memory < 0.3:
            shape.append(f"--mem-per-cpu={rng.choice([500, 1000, 1500])}")
        elif memory < 0.5:
            shape.append(f"--mem={rng.randrange(500, 8000, 250)}")
        if rng.random() < 0.25:
            shape.append(f"--array=0-{min(int(rng.paretovariate(1.0) * 5), 500)}")
        campaign = min(int(rng.paretovariate(1.0)), 100)
        out += [shape] * campaign
    return out[:count]


def build_timer(plugin_dir: str) -> None:
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o",
                    os.path.join(plugin_dir, "job_submit_bench_timer.so"),
                    os.path.join(HERE, "job_submit_bench_timer.c")], check=True)


def use_plugins(c: cluster.Cluster, plugins: str, timer_file: str) -> None:
    with open(c.conf) as f:
        text = f.read()
    lines = [f"JobSubmitPlugins={plugins}" if line.startswith("JobSubmitPlugins=") else line
             for line in text.splitlines()]
    c.rewrite_conf("\n".join(lines) + "\n")
    if os.path.exists(timer_file):
        os.unlink(timer_file)
    os.environ["BENCH_TIMER_FILE"] = timer_file
    c.restart_slurmctld()


def submit(c: cluster.Cluster, opts: list[str]) -> str:
    """The job's id."""
    out = subprocess.run(["sbatch", "-H", "--parsable", "--output=/dev/null", *opts,
                          "--wrap", "true"], env=c.env, check=True, capture_output=True,
                         text=True, cwd="/tmp")
    return out.stdout.strip().split(";")[0]


def job_gres(c: cluster.Cluster) -> dict:
    """Every job's TresPerNode and TresPerTask as slurmctld holds them."""
    out = subprocess.run(["scontrol", "show", "job", "-o"], env=c.env, check=True,
                         capture_output=True, text=True).stdout
    gres = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        gres[fields.get("JobId")] = (fields.get("TresPerNode", ""), fields.get("TresPerTask", ""))
    return gres


def fill_queue(c: cluster.Cluster, count: int) -> None:
    """`count` held jobs, submitted in parallel (they stay for every config)."""
    script = "for i in $(seq %d); do sbatch -H --output=/dev/null --wrap true >/dev/null; done"
    procs = [subprocess.Popen(["sh", "-c", script % (count // 4)], env=c.env, cwd="/tmp")
             for _ in range(4)]
    for p in procs:
        p.wait()


def timings_us(path: str) -> list[float]:
    with open(path) as f:
        return [int(line) / 1000 for line in f if line.strip()]


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"n": len(values), "median": statistics.median(values),
            "p99": values[min(len(values) - 1, int(len(values) * 0.99))],
            "mean": statistics.fmean(values), "max": values[-1]}


def run(jobs: int, queue: int, port: int, workloads: tuple = ("mixed", "unique", "stream")) -> int:
    work = tempfile.mkdtemp(prefix="pyk8sres-bench-")
    c = cluster.up(work, nodes=NODES, cpus=CPUS, memory=16000, base_port=port,
                   node_features=False)
    try:
        build_timer(os.path.join(work, "plugins"))
        with open(os.path.join(work, "etc", "job_submit.lua"), "w") as f:
            f.write(lua_site.script(lua_site.site(c.conf, lua_site.slurm_version(c.env))))
        if queue:
            print(f"filling the queue with {queue} held jobs ...", flush=True)
            fill_queue(c, queue)
        configs = {"none": "bench_timer,bench_timer",
                   "ours": "bench_timer,k8s_resource_completion,bench_timer",
                   "lua": "bench_timer,lua,bench_timer"}
        results = {}
        ids = {}  # (config, workload) -> the job ids, in submission order
        stream = stream_shapes(jobs)
        for workload in workloads:
            for name, plugins in configs.items():
                timer_file = os.path.join(work, f"t-{name}-{workload}.txt")
                use_plugins(c, plugins, timer_file)
                ids[(name, workload)] = []
                for i in range(jobs):
                    opts = MIXED[i % len(MIXED)] if workload == "mixed" else \
                        stream[i] if workload == "stream" else \
                        ["-c", str(1 + i % 4), f"--mem={1000 + i}"]
                    ids[(name, workload)].append(submit(c, opts))
                time.sleep(0.2)
                results[(name, workload)] = summary(timings_us(timer_file))
        held = job_gres(c)
        same = {w: sum(held.get(a) == held.get(b) for a, b in
                       zip(ids[("ours", w)], ids[("lua", w)])) for w in workloads}
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)

    compiled = not hot_path.__file__.endswith(".py")
    print(f"\njob_submit cost inside slurmctld, microseconds per submission "
          f"({jobs} submissions each, queue of {queue} held jobs; our job_submit path "
          f"{'compiled by mypyc' if compiled else 'interpreted'})")
    print(f"{'workload':8} {'plugin':6} {'n':>6} {'median':>9} {'p99':>9} {'mean':>9} {'max':>9}")
    for (name, workload), s in results.items():
        print(f"{workload:8} {name:6} {s['n']:>6} {s['median']:>9.1f} {s['p99']:>9.1f} "
              f"{s['mean']:>9.1f} {s['max']:>9.1f}")
    ok = True
    for workload in workloads:
        print(f"[{workload}] lua's jobs hold the GRES ours hold: {same[workload]} of {jobs}")
        ok = ok and same[workload] == jobs
        base = results[("none", workload)]
        ours, lua = results[("ours", workload)], results[("lua", workload)]
        add_med, add_p99 = ours["median"] - base["median"], ours["p99"] - base["p99"]
        print(f"\n[{workload}] ours adds {add_med:.1f} us median, {add_p99:.1f} us p99 over no plugin; "
              f"lua adds {lua['median'] - base['median']:.1f} / {lua['p99'] - base['p99']:.1f}")
        print(f"[{workload}] ratio ours/lua: median {ours['median'] / lua['median']:.2f}, "
              f"p99 {ours['p99'] / lua['p99']:.2f}, mean {ours['mean'] / lua['mean']:.2f}")
        if workload == "mixed":
            met = add_med <= GOAL_MEDIAN_US and add_p99 <= GOAL_P99_US and \
                ours["median"] <= 0.2 * lua["median"]
            print(f"[{workload}] goal (<= {GOAL_MEDIAN_US:.0f} us median, <= {GOAL_P99_US:.0f} us p99, "
                  f"<= 0.2 x lua's median): {'met' if met else 'MISSED'}")
        else:  # shapes never seen before must cost no more than Lua
            met = ours["median"] <= lua["median"] and ours["p99"] <= lua["p99"]
            print(f"[{workload}] goal (ours <= lua at the median and at p99): "
                  f"{'met' if met else 'MISSED'}")
        ok = ok and met
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--queue", type=int, default=0, help="held jobs in the queue first")
    parser.add_argument("--base-port", type=int, default=17300)
    parser.add_argument("--workloads", default="mixed,unique,stream",
                        help="comma-separated subset of mixed,unique,stream")
    args = parser.parse_args()
    return run(args.jobs, args.queue, args.base_port, tuple(args.workloads.split(",")))


if __name__ == "__main__":
    sys.exit(main())
