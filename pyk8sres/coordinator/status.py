"""`pyk8sres status`: the admin's first command when something pends.

One row per shared node: capacity, what Slurm jobs hold, the Kubernetes
share the ledger holds inside slurmctld, free, and whether the ledger agrees
with the pods the API server has bound there.  The ledger is asked first and
alone decides capacity; the API server may be down, and the output says so.
"""
from __future__ import annotations

import json
from typing import Mapping

from . import mapping
from . import slurm
from .config import SyncConfig, exemptions_of, load_config
from .kube import Kube, list_nodes, list_pods
from ..policy import ledger
from ..policy import usage


def pods_share(pods: list[dict], k8s_nodes: list[dict], slurm_names: set[str], cfg) -> dict:
    """Slurm node -> (CPUs, MB) the non-exempt pods bound there request,
    each sum rounded up once, as the ledger counts them (pure)."""
    exempt = exemptions_of(cfg)
    by_name = {(n.get("metadata") or {}).get("name"): n for n in k8s_nodes}
    slurm_of = mapping.with_workers(cfg, mapping.slurm_nodes(cfg, by_name, frozenset(slurm_names)),
                                    by_name, frozenset(slurm_names), pods)
    sums: dict[str, list[int]] = {}
    for pod in pods:
        pu = usage.pod_usage(pod, exempt)
        slurm_node = slurm_of.get(pu.node) if pu else None
        if pu is None or slurm_node is None:
            continue
        cpu_m, mem = usage.ledger_entry(pu)
        s = sums.setdefault(slurm_node, [0, 0])
        s[0] += cpu_m
        s[1] += mem
    return {n: (-(-c // 1000), -(-m // ledger.MIB)) for n, (c, m) in sums.items()}


def rows(ledger_nodes: Mapping[str, dict], pods: Mapping[str, tuple] | None) -> list[dict]:
    """The table (pure).  pods None: the API server could not be asked."""
    out = []
    for name, n in sorted(ledger_nodes.items()):
        share = (n["share"]["cpu"], n["share"]["mem"])
        seen = None if pods is None else pods.get(name, (0, 0))
        out.append({
            "node": name,
            "capacity": n.get("capacity"), "jobs": n.get("jobs"), "kubernetes": n["share"],
            "free": n.get("free"), "oversubscribed": bool(n.get("oversubscribed")),
            "pods_bound": None if seen is None else {"cpu": seen[0], "mem": seen[1]},
            # A fresh reservation (admitted, not yet bound) makes the ledger
            # hold more for a moment; less than the pods hold is the alarm.
            "agree": None if seen is None else ("yes" if seen == share else
                                                "ledger holds more" if seen <= share
                                                else "LEDGER HOLDS LESS")})
    return out


def render(table: list[dict], api_error: str | None) -> str:
    def cell(v):
        return "-" if not v else f"{v['cpu']}/{v['mem']}"
    lines = [f"{'NODE':<14} {'CAPACITY':>12} {'SLURM JOBS':>12} {'KUBERNETES':>12} "
             f"{'FREE':>12} {'PODS BOUND':>12}  AGREE"]
    for r in table:
        agree = r["agree"] or "? (API server down)"
        if r["oversubscribed"]:
            agree += ", OVERSUBSCRIBED"
        lines.append(f"{r['node']:<14} {cell(r['capacity']):>12} {cell(r['jobs']):>12} "
                     f"{cell(r['kubernetes']):>12} {cell(r['free']):>12} "
                     f"{cell(r['pods_bound']):>12}  {agree}")
    lines.append("(CPUs/MB; KUBERNETES is what the ledger holds inside slurmctld, PODS BOUND "
                 "what the API server has bound there)")
    if api_error:
        lines.append(f"Kubernetes API server unreachable: {api_error}; Slurm's side above is "
                     "current, the Kubernetes side could not be checked")
    return "\n".join(lines)


def main(args) -> int:
    cfg = load_config(args.config) if args.config else SyncConfig()
    ledger_client = slurm.Ledger(args.socket or slurm.ledger_socket_path(), timeout=5)
    nodes = ledger_client.show()["nodes"]
    shared = {n: v for n, v in nodes.items() if not v.get("unknown")}
    pods, api_error = None, None
    try:
        kube = Kube(args.kubeconfig, None, 5)
        pods = pods_share(list_pods(kube), list_nodes(kube), set(shared), cfg)
    except Exception as exc:  # API server down or unreachable: say so, show Slurm's side
        api_error = f"{type(exc).__name__}: {exc}"[:300]
    table = rows(shared, pods)
    if args.output == "json":
        print(json.dumps({"nodes": table, "kubernetes_error": api_error}, indent=1))
    else:
        print(render(table, api_error))
    return 0
