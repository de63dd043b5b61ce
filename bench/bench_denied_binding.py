"""How long a pod takes to be bound when Slurm fills the node kube-scheduler
would pick, through the real kube-scheduler (default profile, its backoff
after a refused binding) and the coordinator's webhook.

    python3 bench/bench_denied_binding.py [--tries 10] [--timeout 30]

Two shared nodes of 8 CPUs; a 1-CPU pod sits on n2, so kube-scheduler's
scoring (least allocated) prefers n1 whenever it sees both empty.  Each try:
a Slurm job takes 6 of n1's CPUs, then a 4-CPU pod is created; measured:
creation -> bound (spec.nodeName), and how often the webhook refused its
binding.  Cases:
  baseline       no Slurm job: kube-scheduler's own latency, same run
  settled        placeholders on, the pod created once they show the job
  racing         placeholders on, the pod created the moment the job runs
                 (before the placeholders can show it: the webhook refuses
                 n1, kube-scheduler backs off and retries)
  no-placeholders  the webhook alone (pyk8sres webhook --no-placeholders):
                 kube-scheduler sees n1 empty, picks it, is refused, backs
                 off, picks it again...
  no-placeholders-tie  the same without the pod on n2: both nodes score
                 alike (kube-scheduler 1.35 breaks ties at random only when
                 an extender scores too: pkg/scheduler/schedule_one.go,
                 Randomizer; otherwise by its node order)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.policy import placeholder
from pyk8sres.testbed import chart, cluster, hybrid

NAMESPACE = "bench"


def pod(name, cpu, node=None):
    spec = {"terminationGracePeriodSeconds": 0,
            "containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def squeue_state(env, job):
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                          text=True).stdout.strip()


def wait(pred, timeout, every=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    return None


def placeholders_on(kube, node):
    return [p for p in kube_calls.list_namespace_pods(kube, chart.PLACEHOLDERS)
            if placeholder.current(p) is not None and p["spec"]["nodeName"] == node]


def refusals(kube, name):
    return sum(e.get("count") or 1 for e in kube_calls.list_events(
        kube, NAMESPACE, field_selector=f"reason=InsufficientSharedCapacity,"
                                        f"involvedObject.name={name}"))


def one(c, kube, case, timeout):
    """(seconds to bound or None, node, refusals)."""
    job = None
    if case != "baseline":   # (every other case has a job)
        job = subprocess.run(["sbatch", "--parsable", "-w", "n1", "-c", "6", "--mem=1000",
                              "-o", "/dev/null", "--wrap", "sleep 600"], env=c.env, cwd="/tmp",
                             capture_output=True, text=True, check=True).stdout.strip()
        wait(lambda: squeue_state(c.env, job) == "RUNNING", 30)
        if case == "settled":
            wait(lambda: placeholders_on(kube, "n1"), 10)
            time.sleep(0.5)          # kube-scheduler's informer has it too
    name = "p-" + uuid.uuid4().hex[:8]
    t0 = time.monotonic()
    kube_calls.create_pod(kube, NAMESPACE, pod(name, "4"))
    node = wait(lambda: ((kube_calls.get_pod(kube, NAMESPACE, name) or {}).get("spec") or {}).get(
        "nodeName"), timeout)
    took = time.monotonic() - t0 if node else None
    refused = refusals(kube, name)
    kube_calls.delete_pod(kube, NAMESPACE, name)
    if job:
        subprocess.run(["scancel", job], env=c.env, check=True)
        wait(lambda: squeue_state(c.env, job) in ("", "COMPLETED", "CANCELLED"), 30, 0.1)
        wait(lambda: not placeholders_on(kube, "n1"), 10, 0.1)
    time.sleep(0.5)
    return took, node, refused


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds a pod may take to be bound before the try counts as never")
    ap.add_argument("--base-port", type=int, default=19100)
    ap.add_argument("--kube-port", type=int, help="default: --base-port + 50")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="pyk8sres-bench-deny-")
    c, cp = hybrid.up(work, nodes=2, cpus=8, memory=16000, base_port=args.base_port,
                      kube_port=args.kube_port or args.base_port + 50)
    rows = []
    try:
        os.environ["SLURM_CONF"] = c.conf
        kube = kube_calls.Kube(cp.kubeconfig)
        kube.core.create_namespace({"metadata": {"name": NAMESPACE}})
        kube_calls.create_pod(kube, NAMESPACE, pod("filler", "1", node="n2"))
        for case in ("baseline", "settled", "racing", "no-placeholders", "no-placeholders-tie"):
            if case == "no-placeholders":
                cluster.stop_process(c.work, "webhook")
                for p in kube_calls.list_namespace_pods(kube, chart.PLACEHOLDERS):
                    kube_calls.delete_pod(kube, chart.PLACEHOLDERS, p["metadata"]["name"])
                hybrid.start_webhook(c, cp, "--no-placeholders")
                hybrid.wait_webhook(cp, c)
                time.sleep(3)
            if case == "no-placeholders-tie":
                kube_calls.delete_pod(kube, NAMESPACE, "filler")
            results = [one(c, kube, case, args.timeout) for _ in range(args.tries)]
            print(f"{case}: " + ", ".join(f"{t:.2f}s {n} ({r} refused)" if t is not None
                                          else f"never ({r} refused)" for t, n, r in results),
                  flush=True)
            rows.append((case, results))
    finally:
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(t for t, _, _ in rows[0][1] if t is not None)
    print(f"\n{'case':<20} {'bound':>7} {'median s':>9} {'p90 s':>7} {'x baseline':>11} "
          f"{'refused/try':>12}  ({args.tries} tries; never = not bound within "
          f"{args.timeout:.0f} s)")
    for case, results in rows:
        times = [t for t, _, _ in results if t is not None]
        refused = statistics.mean(r for _, _, r in results)
        if times and len(times) == len(results):
            med, p90 = statistics.median(times), pct(times, 90)
            print(f"{case:<20} {len(times):>3}/{len(results):<3} {med:9.2f} {p90:7.2f} "
                  f"{med / base:11.1f} {refused:12.1f}")
        else:
            med = f"{statistics.median(times):.2f}" if times else "never"
            print(f"{case:<20} {len(times):>3}/{len(results):<3} {med:>9} {'never':>7} "
                  f"{'-':>11} {refused:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
