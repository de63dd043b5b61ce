"""Why a new job shape costs more inside slurmctld than the policy's own
work: the same completion.complete() calls, warm and with the CPU caches
evicted before each call (as slurmctld's RPC handling and file writes do
between two submissions).  Pure Python, no daemons.

    python3 bench/bench_policy_cold.py [--calls 300] [--evict-mb 64]

Prints both medians/p99s and their ratio (the cold/warm factor).
"""
from __future__ import annotations

import argparse
import statistics
import time

from pyk8sres.slurmctld import completion, jobspec

NODES = jobspec.Nodes(cpus=8, memory=16000, count=2, least_cpus=8)
SITE = jobspec.Site(partitions={"debug": jobspec.Partition(mem=jobspec.MemDefault(per_cpu=100), nodes=NODES)},
              default_partition="debug", all_nodes=NODES)


def job(i: int) -> jobspec.Job:
    """Every call a new shape, like bench_job_submit.py's "unique" workload."""
    fields = dict.fromkeys(jobspec.Job._fields)
    fields.update(cpus_per_task=1 + i % 4, mem_per_node=3000 + i, exclusive=False,
                  overcommit=False, spread_job=False, plane_distribution=False)
    return jobspec.Job(**fields)


def timed(calls: int, start: int, before=None) -> list[float]:
    out = []
    for i in range(calls):
        if before:
            before(i)
        t = time.perf_counter_ns()
        completion.complete(job(start + i), SITE)
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--evict-mb", type=int, default=64)
    args = ap.parse_args()
    junk = bytearray(args.evict_mb << 20)

    def evict(i: int) -> None:
        for k in range(0, len(junk), 64):
            junk[k] = i & 0xFF

    timed(args.calls, 0)                                     # warm up
    warm = timed(args.calls, 10_000)
    cold = timed(args.calls, 20_000, evict)
    p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]   # noqa: E731
    print(f"warm:          median {statistics.median(warm):7.1f} us, p99 {p99(warm):7.1f} us")
    print(f"caches evicted: median {statistics.median(cold):7.1f} us, p99 {p99(cold):7.1f} us")
    print(f"cold / warm median: {statistics.median(cold) / statistics.median(warm):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
