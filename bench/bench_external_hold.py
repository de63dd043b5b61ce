#!/usr/bin/env python3
"""Holding a pod's share with a Slurm 25.05+ external job (`sbatch --external`)
instead of the ledger, measured against the ledger in the same run.

What the sync daemon needs when a pod is bound to a node: its CPUs and
memory held there before the pod runs, and refused if Slurm's jobs already
use them.  The ledger does that with one request over its socket, decided
under slurmctld's locks (pyk8sres ledger reserve).  The alternative is an
external job (no batch script, no slurmd launch) on that node asking the
pod's CPUs and memory: submitted, then scheduled by slurmctld, and the pod's
share is held once the job runs.

One real cluster of the release given (node_features, so the ledger is
there); for each of --holds pods: the time from request to held (ledger:
reserve answered ok; external job: sbatch until squeue shows RUNNING), then
the release (ledger release; scancel until the job is gone).  Prints medians,
p90 and the ratio external / ledger.

Usage (root): PYTHONPATH=<release site-packages> python3 bench/bench_external_hold.py
    --slurm 25.11 [--holds 20] [--base-port 17500]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.testbed import cluster


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def sh(c, *argv) -> str:
    return subprocess.run(argv, env=c.env, capture_output=True, text=True, check=True,
                          cwd="/tmp", timeout=60).stdout


def until(check, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slurm", required=True, help="a release with --external (25.05 on)")
    ap.add_argument("--holds", type=int, default=20)
    ap.add_argument("--base-port", type=int, default=17500)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-external-")
    c = cluster.up(work, nodes=1, cpus=8, memory=16000, base_port=args.base_port,
                   node_features=True, slurm=args.slurm)
    try:
        ledger = Ledger(ledger_socket_path(c.conf))
        held_ledger, held_job, gone_job = [], [], []
        for i in range(args.holds):
            t = time.monotonic()
            assert ledger.reserve("n1", f"pod-{i}", 2000, 1000 << 20)["ok"]
            held_ledger.append(time.monotonic() - t)
            assert ledger.release("n1", f"pod-{i}")["ok"]

            t = time.monotonic()
            job = sh(c, "sbatch", "--parsable", "--external", "-w", "n1", "-c", "2",
                     "--mem=1000", f"--job-name=pod-{i}").strip().split(";")[0]
            until(lambda: sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING")
            held_job.append(time.monotonic() - t)
            t = time.monotonic()
            sh(c, "scancel", job)
            until(lambda: not sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip())
            gone_job.append(time.monotonic() - t)
        med_l, med_j = statistics.median(held_ledger), statistics.median(held_job)
        print(f"Slurm {c.release.name}, {args.holds} holds of 2 CPUs / 1000 MB on an idle node")
        print(f"ledger reserve:        median {med_l * 1000:8.2f} ms  p90 {pct(held_ledger, 90) * 1000:8.2f} ms")
        print(f"external job running:  median {med_j * 1000:8.2f} ms  p90 {pct(held_job, 90) * 1000:8.2f} ms")
        print(f"external job gone:     median {statistics.median(gone_job) * 1000:8.2f} ms")
        print(f"ratio external / ledger (median time to held): {med_j / med_l:.0f}x")
    finally:
        cluster.down(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
