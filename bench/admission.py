"""Admission latency through a real API server and the coordinator's webhook.

    SLURM_CONF=... KUBECONFIG=... python bench/admission.py [--pods 500] [--threads 8]

Against `pyk8sres cluster up --kubernetes` (nodes n1, n2). Measures, from the
client, pod creations with spec.nodeName:
  baseline  on a node not shared with Slurm (the webhook is not called),
  allow     on n2 (webhook + ledger reserve),
  deny      on n1 asking more than the node has (webhook + ledger refusal),
sequentially (p50/p99) and with --threads concurrent clients (pods/s).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kubernetes.client.exceptions import ApiException

from pyk8sres.coordinator import kube as K


def pod(name, node, cpu):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x", "resources": {
                "requests": {"cpu": cpu, "memory": "1Mi"}}}]}}


def one(kube, ns, node, cpu, expect_ok):
    name = "b-" + uuid.uuid4().hex[:10]
    t0 = time.perf_counter()
    try:
        K.create_pod(kube, ns, pod(name, node, cpu))
        ok = True
    except ApiException as e:
        ok = False
        if e.status != 403:
            raise
    dt = time.perf_counter() - t0
    if ok != expect_ok:
        raise SystemExit(f"{node}: expected {'allow' if expect_ok else 'deny'}")
    return dt


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    kube = K.Kube(os.environ["KUBECONFIG"])
    ns = "bench-" + uuid.uuid4().hex[:6]
    kube.core.create_namespace({"metadata": {"name": ns}}, _preload_content=False).release_conn()
    cases = [("baseline", "not-shared", "1m", True), ("allow", "n2", "1m", True),
             ("deny", "n1", "1000", False)]
    for label, node, cpu, ok in cases:
        for _ in range(20):
            one(kube, ns, node, cpu, ok)            # warm up connections
        seq = [one(kube, ns, node, cpu, ok) for _ in range(args.pods)]
        with ThreadPoolExecutor(args.threads) as ex:
            t0 = time.perf_counter()
            list(ex.map(lambda _: one(kube, ns, node, cpu, ok), range(args.pods)))
            rate = args.pods / (time.perf_counter() - t0)
        print(f"{label:8s} p50 {pct(seq, 50):6.1f} ms  p99 {pct(seq, 99):6.1f} ms  "
              f"mean {statistics.mean(seq) * 1000:6.1f} ms  {rate:6.0f} pods/s "
              f"({args.threads} clients)", flush=True)
    kube.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0,
                                               _preload_content=False).release_conn()
    kube.core.delete_namespace(ns, _preload_content=False).release_conn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
