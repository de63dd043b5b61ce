#!/usr/bin/env python3
"""A long stress run of the ledger under admission load, checked while it
runs (pyk8sres.testbed.stress): client threads reserve and release pods'
shares on the nodes that run real jobs, jobs of random sizes are submitted
there, and a checker verifies all along that no grant is lost, nothing is
granted beyond capacity (against `scontrol -d show job`: CPU_IDs and Mem per
node) and slurmctld answers squeue and sbatch within 1 s.  --scale-nodes adds
node records without slurmd (cluster up --scale-nodes) for the size of a
large cluster.  Exits 1 on any violation.

  nice python3 bench/bench_ledger_stress.py [--seconds 300] [--clients 7]
      [--nodes 2] [--cpus 16] [--scale-nodes 10000] [--base-port 22500] [--baseline]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading

from pyk8sres.testbed import cluster, stress


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--clients", type=int, default=7,
                   help="ledger connections: at most 7 (8 per uid, one is the checker's)")
    p.add_argument("--nodes", type=int, default=2, help="nodes with slurmd (jobs run there)")
    p.add_argument("--cpus", type=int, default=16)
    p.add_argument("--memory", type=int, default=32000)
    p.add_argument("--scale-nodes", type=int, default=10000)
    p.add_argument("--base-port", type=int,
                   default=17500 + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0")))
    p.add_argument("--baseline", action="store_true",
                   help="at the same time, the same jobs and probes against a second, identical "
                        "cluster that gets no ledger requests (ports from --base-port + 50)")
    a = p.parse_args(argv)
    works, clusters = [], []
    try:
        for offset in (0, 50) if a.baseline else (0,):
            works.append(tempfile.mkdtemp(prefix="ledger-stress-",
                                          dir=os.environ.get("PYK8SRES_BENCH_DIR")))
            clusters.append(cluster.up(works[-1], nodes=a.nodes, cpus=a.cpus, memory=a.memory,
                                       base_port=a.base_port + offset,
                                       scale_nodes=a.scale_nodes, node_features=True))
        load0 = os.getloadavg()
        nodes = {n: (a.cpus, a.memory) for n in cluster.node_names(a.nodes)}
        base = None
        if a.baseline:
            base = stress.Stress(clusters[1], nodes, clients=0)
            thread = threading.Thread(target=base.run, args=(a.seconds,))
            thread.start()
        report = stress.Stress(clusters[0], nodes, clients=a.clients).run(a.seconds)
        if base:
            thread.join()
        load1 = os.getloadavg()
    finally:
        for work in works:
            cluster.down(work)
            shutil.rmtree(work, ignore_errors=True)
    print(f"{a.seconds:.0f} s, {a.clients} clients, {a.nodes} nodes of {a.cpus} CPUs with slurmd "
          f"+ {a.scale_nodes} scale nodes; load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print(report.summary())
    if base:
        b = base.report
        over = [v for v in b.violations if "answered in" in v]
        print(f"baseline (same jobs and probes, no ledger requests, same time): squeue max "
              f"{b.max_squeue_s * 1000:.0f} ms, sbatch max {b.max_sbatch_s * 1000:.0f} ms, "
              f"{len(over)} of {b.probes} probes over 1 s; ratio of the squeue maxima "
              f"{report.max_squeue_s / b.max_squeue_s if b.max_squeue_s else float('nan'):.2f}")
    for line in (report.violations + report.errors)[:20]:
        print("  ", line)
    for line in report.slow_local[:10]:
        print("   over 1 s only by process start:", line)
    ok = not report.violations and not report.errors
    print("no grant lost, nothing beyond capacity, squeue/sbatch within 1 s: "
          + ("met" if ok else "NOT met"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
