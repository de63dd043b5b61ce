"""A stand-in for kube-scheduler, for tests and demos.

No kube-scheduler binary can be had here (Debian, PyPI and npm ship none;
see /work/shared/DESIGN.md §8), so tests drive the API server the way
kube-scheduler's default profile does for what matters to us:

  - fit (NodeResourcesFit): a pod's requests (usage.pod_requests, the same
    rule kube-scheduler uses) against the node's allocatable minus the
    requests of every non-terminal pod already bound there -- placeholder
    pods included, which is how Slurm's jobs become visible to it;
  - unschedulable (cordoned) nodes are skipped; the emptiest node wins;
  - POST pods/binding (DefaultBinder); on an error (a denying admission
    webhook) the pod backs off 1 s, doubling to 10 s, as kube-scheduler's
    podInitialBackoff/podMaxBackoff do, and nothing remembers the denial.

    sched = Scheduler(kube)            # kube: pyk8sres.coordinator.kube.Kube
    sched.run_once()                   # one pass over the pending pods
    sched.start(); ...; sched.stop()   # or keep going in a thread
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from ..coordinator import kube as K
from ..policy import usage as U

INITIAL_BACKOFF, MAX_BACKOFF = 1.0, 10.0


def _amounts(pod: dict) -> tuple[int, int]:
    r = U.pod_requests(pod)
    return math.ceil(r["cpu"] * 1000), math.ceil(r["memory"])


def allocatable(node: dict) -> tuple[int, int]:
    st = node.get("status") or {}
    a = st.get("allocatable") or st.get("capacity") or {}
    return (math.floor(U.parse_quantity(a.get("cpu", "0")) * 1000),
            math.floor(U.parse_quantity(a.get("memory", "0"))))


def pick_node(pod: dict, nodes: list[dict], bound: list[dict]) -> str | None:
    """Node a pod fits on (most CPU left after it), or None (pure)."""
    cpu, mem = _amounts(pod)
    used: dict[str, list[int]] = {}
    for p in bound:
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        n = (p.get("spec") or {}).get("nodeName")
        c, m = _amounts(p)
        u = used.setdefault(n, [0, 0])
        u[0] += c
        u[1] += m
    best, best_left = None, -1
    for node in nodes:
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        name = node["metadata"]["name"]
        ac, am = allocatable(node)
        uc, um = used.get(name, (0, 0))
        if uc + cpu <= ac and um + mem <= am and ac - uc - cpu > best_left:
            best, best_left = name, ac - uc - cpu
    return best


@dataclass
class Stats:
    bound: int = 0
    denied: int = 0          # binding refused (admission) or failed
    unschedulable: int = 0   # no node fits right now
    errors: list = field(default_factory=list)


class Scheduler:
    def __init__(self, kube, scheduler_name: str = "default-scheduler", namespace: str | None = None,
                 node_names=None):
        """namespace: only its pods; node_names: only these nodes (tests
        sharing one API server)."""
        self.kube, self.name, self.namespace = kube, scheduler_name, namespace
        self.node_names = set(node_names) if node_names is not None else None
        self.backoff: dict[str, tuple[float, float]] = {}   # pod uid -> (retry at, current delay)
        self.stats = Stats()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _fail(self, uid: str, now: float) -> None:
        _, delay = self.backoff.get(uid, (0.0, INITIAL_BACKOFF / 2))
        delay = min(MAX_BACKOFF, delay * 2)
        self.backoff[uid] = (now + delay, delay)

    def run_once(self, now: float | None = None) -> list[tuple[str, str | None, str | None]]:
        """One pass: [(namespace/name, node or None, error or None)] for the pods tried."""
        now = time.monotonic() if now is None else now
        nodes = [n for n in K.list_nodes(self.kube)
                 if self.node_names is None or n["metadata"]["name"] in self.node_names]
        pods = K.list_pods(self.kube)
        bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
        pending = [p for p in pods if not (p.get("spec") or {}).get("nodeName")
                   and (p.get("spec") or {}).get("schedulerName", "default-scheduler") == self.name
                   and not (p.get("metadata") or {}).get("deletionTimestamp")
                   and (self.namespace is None or p["metadata"].get("namespace") == self.namespace)]
        pending.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
        out = []
        for pod in pending:
            meta = pod["metadata"]
            uid, key = meta.get("uid", ""), f"{meta.get('namespace')}/{meta.get('name')}"
            if self.backoff.get(uid, (0.0, 0.0))[0] > now:
                continue
            node = pick_node(pod, nodes, bound)
            if node is None:
                self.stats.unschedulable += 1
                self._fail(uid, now)
                out.append((key, None, "no node fits"))
                continue
            try:
                K.bind_pod(self.kube, meta["namespace"], meta["name"], node, uid)
            except K.ApiException as e:
                self.stats.denied += 1
                self.stats.errors.append(f"{key} on {node}: {e.status} {e.body or e.reason}"[:500])
                self._fail(uid, now)
                out.append((key, node, f"{e.status}"))
                continue
            self.backoff.pop(uid, None)
            self.stats.bound += 1
            bound.append({**pod, "spec": {**pod["spec"], "nodeName": node}})
            out.append((key, node, None))
        return out

    def start(self, period: float = 0.1) -> "Scheduler":
        def loop():
            while not self.stop_event.wait(period):
                try:
                    self.run_once()
                except Exception as e:   # API server restarting: keep trying, like kube-scheduler
                    self.stats.errors.append(f"pass failed: {e}"[:500])
        self.thread = threading.Thread(target=loop, name="test-scheduler", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread:
            self.thread.join(10)


def main(argv=None) -> int:
    """`python3 -m pyk8sres.testbed.scheduler [--seconds S]`: schedule the
    pending pods for a while, printing each decision (for the demo)."""
    import argparse
    p = argparse.ArgumentParser(prog="python3 -m pyk8sres.testbed.scheduler",
                                description=main.__doc__)
    p.add_argument("--kubeconfig")
    p.add_argument("--namespace")
    p.add_argument("--seconds", type=float, default=5)
    a = p.parse_args(argv)
    sched = Scheduler(K.Kube(a.kubeconfig, None, 10), namespace=a.namespace)
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        for key, node, error in sched.run_once():
            print(f"{key}: {'bound to ' + node if not error else f'{error} (on {node})'}"
                  f"{'' if not error else ', backing off'}", flush=True)
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
