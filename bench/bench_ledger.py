#!/usr/bin/env python3
"""The ledger's cost inside slurmctld, against a baseline measured in the same run.

1. reserve/release latency (p50/p99) and throughput through the real socket,
   slurmctld idle, then with 10,000 queued jobs and backfill running;
2. what the per-attempt check (node_features user_update, called at the top
   of every select_nodes) adds to the scheduling cycles: sdiag's main and
   backfill cycle times with the plugin and, in a second identical cluster,
   without it (baseline).

The nodes exist in slurm.conf only (no slurmd: with Gres= lines their k8s
GRES exist from the start, so the ledger can reserve on them); queued jobs
pend for those nodes, so both schedulers keep trying them.

Usage (root, after `pip install .`):  python3 bench/bench_ledger.py [--ops 2000] [--queue 10000]
Goals: reserve p99 <= 5 ms idle; the check adds <= 1% to the cycle times.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.testbed import cluster

NODES, CPUS, MEMORY = 100, 64, 256000


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def up(work: str, port: int, with_plugin: bool) -> cluster.Cluster:
    # node_features=False writes Gres= lines; the plugin is then added by hand
    # (or not, for the baseline).  bf_interval=1 keeps backfill busy.
    extra = "NodeFeaturesPlugins=node_features/k8s_resources\n" if with_plugin else ""
    extra += "SchedulerParameters=sched_interval=1,bf_interval=1,bf_max_job_test=10000,default_queue_depth=10000\n"
    return cluster.up(work, nodes=NODES, cpus=CPUS, memory=MEMORY, base_port=port,
                      node_features=False, slurmd=False, extra_conf=extra)


def fill_queue(c: cluster.Cluster, count: int) -> None:
    """`count` pending jobs, submitted in parallel (not held: schedulers try them)."""
    script = ("for i in $(seq %d); do sbatch -o /dev/null -c 1 --gres=k8scpu:1 "
              "--wrap true >/dev/null; done")
    procs = [subprocess.Popen(["sh", "-c", script % (count // 4)], env=c.env, cwd="/tmp")
             for _ in range(4)]
    for p in procs:
        p.wait()


def ledger_ops(c: cluster.Cluster, ops: int) -> dict:
    ledger = Ledger(ledger_socket_path(c.conf), timeout=10)
    ledger.show()
    lat = []
    start = time.perf_counter()
    for i in range(ops // 2):
        node = f"n{1 + i % NODES}"
        for call in (lambda: ledger.reserve(node, f"pod-{i}", 250, 256 << 20),
                     lambda: ledger.release(node, f"pod-{i}")):
            t0 = time.perf_counter()
            reply = call()
            lat.append((time.perf_counter() - t0) * 1000)
            assert reply["ok"], reply
    wall = time.perf_counter() - start
    return {"p50_ms": statistics.median(lat), "p99_ms": pct(lat, 99),
            "ops_per_s": len(lat) / wall}


def sdiag_cycles(c: cluster.Cluster, seconds: float) -> dict:
    """Mean main and backfill cycle times (µs) over `seconds` (sdiag -r first)."""
    subprocess.run(["sdiag", "-r"], env=c.env, capture_output=True, check=True)
    time.sleep(seconds)
    out = subprocess.run(["sdiag"], env=c.env, capture_output=True, text=True, check=True).stdout
    main = re.search(r"Main schedule statistics.*?Mean cycle:\s+(\d+)", out, re.S)
    bf = re.search(r"Backfilling stats.*?Mean cycle:\s+(\d+)", out, re.S)
    cycles = re.search(r"Main schedule statistics.*?Cycles:\s+(\d+)", out, re.S)
    return {"main_us": int(main.group(1)) if main else 0, "backfill_us": int(bf.group(1)) if bf else 0,
            "main_cycles": int(cycles.group(1)) if cycles else 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2000, help="reserve+release calls per phase")
    p.add_argument("--queue", type=int, default=10000, help="pending jobs for phase 2")
    p.add_argument("--seconds", type=float, default=30, help="sdiag sampling time per cluster")
    p.add_argument("--base-port", type=int, default=18300)
    a = p.parse_args(argv)
    results = {}
    for with_plugin in (True, False):
        work = tempfile.mkdtemp(prefix="pyk8sres-bench-ledger-")
        c = up(work, a.base_port + (0 if with_plugin else 500), with_plugin)
        try:
            if with_plugin:
                results["idle"] = ledger_ops(c, a.ops)
            print(f"{'with' if with_plugin else 'without'} the plugin: filling the queue "
                  f"with {a.queue} jobs ...", flush=True)
            fill_queue(c, a.queue)
            if with_plugin:
                results["queued"] = ledger_ops(c, a.ops)
            results["cycles_" + ("plugin" if with_plugin else "baseline")] = \
                sdiag_cycles(c, a.seconds)
        finally:
            cluster.down(work)
    print(f"\nledger reserve/release through the socket ({a.ops} calls, {NODES} nodes):")
    print(f"{'slurmctld':<34} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}")
    for name, label in (("idle", "idle"), ("queued", f"{a.queue} queued jobs + backfill")):
        r = results[name]
        print(f"{label:<34} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['ops_per_s']:9.0f}")
    base, ours = results["cycles_baseline"], results["cycles_plugin"]
    print(f"\nscheduling cycles with {a.queue} queued jobs (sdiag mean, µs, {a.seconds:.0f} s each):")
    for key, label in (("main_us", "main"), ("backfill_us", "backfill")):
        ratio = ours[key] / base[key] if base[key] else float("nan")
        print(f"{label:<10} without {base[key]:>9}  with {ours[key]:>9}  ratio {ratio:.3f}")
    idle_ok = results["idle"]["p99_ms"] <= 5
    print(f"\ngoal reserve p99 <= 5 ms idle: {'met' if idle_ok else 'NOT met'} "
          f"({results['idle']['p99_ms']:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
