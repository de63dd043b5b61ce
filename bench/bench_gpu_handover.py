#!/usr/bin/env python3
"""How soon a GPU one side frees is taken by the other side's waiting work,
against Slurm handing it from one job to the next in the same run.

One hybrid test cluster (`cluster up --kubernetes --gpus 4`: real
slurmctld/slurmd, the real API server, kube-scheduler and
kube-controller-manager, kwok; the product's sync daemon and webhook), one
node of 4 GPUs.  Each round, every case holds all 4 GPUs on one side with
the other side's work waiting for them, frees them, and times until the
waiting work runs:

  job -> job   (baseline) scancel of a gpu:4 job; a second gpu:4 job pending
               behind it until squeue says RUNNING: Slurm alone.
  job -> pod   scancel of the gpu:4 job; a pod whose claim asks 4 GPUs
               (pending: the holder claims name the job's devices) until
               the API server reports it Running.
  pod -> job   delete of the Running pod (grace 0); a gpu:4 job pending
               behind the pod's devices until squeue says RUNNING.

Prints each case's median and p90 and the ratio of its median to the
baseline's, then the line `gpu handover: job->pod R1, pod->job R2` (median
ratios, two decimals each) for scripts.

Usage (root): python3 bench/bench_gpu_handover.py [--rounds 5]
    [--base-port 18500] [--kube-port 18600] [--slurm RELEASE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time

from pyk8sres.coordinator.kube import Kube
from pyk8sres.testbed import gpus, hybrid

GPUS = 4


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def until(check, what: str, timeout: float = 120.0) -> float:
    """Poll check() every 20 ms; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic()


class Handover:
    def __init__(self, c, cp):
        self.c, self.cp = c, cp
        self.core = Kube(cp.kubeconfig).core

    def sh(self, *argv) -> str:
        return subprocess.run(argv, env=self.c.env, capture_output=True, text=True, check=True,
                              cwd="/tmp", timeout=60).stdout

    def job(self) -> str:
        return self.sh("sbatch", "--parsable", "-w", "n1", f"--gres=gpu:{GPUS}", "-o",
                       "/dev/null", "--wrap", "sleep 600").strip().split(";")[0]

    def state(self, job: str) -> str:
        return self.sh("squeue", "-h", "-j", job, "-o", "%T").strip()

    def running_job(self) -> str:
        job = self.job()
        until(lambda: self.state(job) == "RUNNING", f"job {job} running")
        return job

    def pod(self, name: str) -> None:
        """Pod `name` on n1 whose claim (a ResourceClaimTemplate) asks all GPUs."""
        pod = gpus.gpu_pod(name, name, "n1", grace=0)
        self.cp.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List",
             "items": [gpus.claim_template(name, GPUS), pod]}))

    def phase(self, name: str) -> str | None:
        try:
            return self.core.read_namespaced_pod(name, "default").status.phase
        except Exception:       # noqa: BLE001 - gone (404) reads as no phase
            return None

    def delete_pod(self, name: str) -> None:
        self.cp.kubectl("delete", "pod", name, "--grace-period=0", "--wait=false")

    def pod_gone(self, name: str) -> None:
        until(lambda: self.phase(name) is None, f"pod {name} gone")
        self.cp.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found")

    def job_to_job(self, i: int) -> float:
        first = self.running_job()
        second = self.job()
        time.sleep(1)
        assert self.state(second) == "PENDING", self.state(second)
        t0 = time.monotonic()
        self.sh("scancel", first)
        took = until(lambda: self.state(second) == "RUNNING", "the second job") - t0
        self.sh("scancel", second)
        return took

    def job_to_pod(self, i: int) -> float:
        job = self.running_job()
        name = f"waits-{i}"
        self.pod(name)
        time.sleep(2)
        assert self.phase(name) == "Pending", self.phase(name)
        t0 = time.monotonic()
        self.sh("scancel", job)
        took = until(lambda: self.phase(name) == "Running", f"pod {name} running") - t0
        self.delete_pod(name)
        self.pod_gone(name)
        return took

    def pod_to_job(self, i: int) -> float:
        name = f"holds-{i}"
        self.pod(name)
        until(lambda: self.phase(name) == "Running", f"pod {name} running")
        job = self.job()
        time.sleep(2)
        assert self.state(job) == "PENDING", self.state(job)
        t0 = time.monotonic()
        self.delete_pod(name)
        took = until(lambda: self.state(job) == "RUNNING", f"job {job} running") - t0
        self.sh("scancel", job)
        self.pod_gone(name)
        return took

    def settle(self) -> None:
        """Nothing left running or completing before the next case."""
        until(lambda: not self.sh("squeue", "-h", "-w", "n1").strip(), "n1 idle")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base-port", type=int, default=18500)
    ap.add_argument("--kube-port", type=int, default=18600)
    ap.add_argument("--slurm", default=None, help="a built release (default: the installed one)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-gpu-handover-")
    c, cp = hybrid.up(work, nodes=1, cpus=8, memory=16000, base_port=args.base_port,
                      kube_port=args.kube_port, slurm=args.slurm, gpus=GPUS)
    try:
        h = Handover(c, cp)
        cases = {"job -> job": h.job_to_job, "job -> pod": h.job_to_pod,
                 "pod -> job": h.pod_to_job}
        took: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(args.rounds):     # cases take turns: load drifts alike
            for name, case in cases.items():
                took[name].append(case(i))
                h.settle()
        base = statistics.median(took["job -> job"])
        for name, values in took.items():
            med = statistics.median(values)
            print(f"{name}: median {med * 1000:.0f} ms, p90 {pct(values, 90) * 1000:.0f} ms "
                  f"over {len(values)} rounds ({med / base:.2f}x job -> job)")
        r1 = statistics.median(took["job -> pod"]) / base
        r2 = statistics.median(took["pod -> job"]) / base
        print(f"gpu handover: job->pod {r1:.2f}, pod->job {r2:.2f}")
        return 0
    finally:
        subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
