"""`pyk8sres cluster up --kubernetes`: the local Slurm cluster plus the real
Kubernetes control plane (kubernetes.py), one kwok-simulated Kubernetes node
per Slurm node (same name and size), the GenericNode CRD and the
coordinator's RBAC (deploy/), and the coordinator itself: `pyk8sres sync`
and `pyk8sres webhook` (with its placeholder pods), each with its own
ServiceAccount's token, never as admin.

Ports from --kube-port on: kubernetes.Ports.  Every process is recorded under
WORKDIR (run/*.pid, kube/run/*.pid) and stopped by PID in `down`.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .. import data
from . import cluster, kubernetes

NAMESPACE = "pyk8sres-system"
SYNC_ACCOUNT, WEBHOOK_ACCOUNT = "pyk8sres-sync", "pyk8sres-webhook"


def up(work: str, *, nodes: int, cpus: int, memory: int, base_port: int, kube_port: int,
       node_features: bool | None = None, extra_conf: str = "", slurm: str | None = None,
       auth: str = "auto", slurmd: bool = True, accounting: bool = False, rest: bool = False,
       coordinator: bool = True, scale_nodes: int = 0, coordinator_path: str | None = None,
       **layout) -> tuple[cluster.Cluster, kubernetes.ControlPlane]:
    """slurmd=False: nodes in slurm.conf only (benchmarks); coordinator=False
    leaves sync and the webhook to the caller; `layout`: sockets /
    cores_per_socket / threads_per_core / node_sizes / gpus, as cluster.up.
    scale_nodes: N more Slurm nodes without slurmd (cluster.up), each also a
    kwok node of the same name and size (created in bulk; refused before
    the memory runs out, at the control plane's measured cost per node).
    coordinator_path: run sync and the webhook from the pyk8sres package in
    this directory (a benchmark's baseline build), not the one imported here."""
    sizes = layout.get("node_sizes") or [(cpus, memory)] * nodes
    if scale_nodes:
        cluster.check_memory(scale_nodes, cluster.SLURMCTLD_BYTES_PER_NODE +
                             cluster.KUBE_BYTES_PER_NODE, cluster.available_memory(),
                             "slurmctld and the Kubernetes control plane")
    c = cluster.up(work, nodes=nodes, cpus=cpus, memory=memory, base_port=base_port,
                   node_features=node_features, synced=True, extra_conf=extra_conf,
                   slurm=slurm, auth=auth, slurmd=slurmd,
                   accounting=accounting, rest=rest, scale_nodes=scale_nodes, **layout)
    names = cluster.node_names(nodes) + cluster.scale_names(scale_nodes)
    try:
        kube = start_kubernetes(c.work, kube_port, dict(zip(cluster.node_names(nodes), sizes)))
        if scale_nodes:
            kube.create_nodes({n: (cpus, memory) for n in cluster.scale_names(scale_nodes)},
                              budget=int(cluster.available_memory() * cluster.MEMORY_HEADROOM))
        if coordinator:
            start_sync(c, kube, path=coordinator_path)
            wait_generic_nodes(kube, names, c, timeout=30 + scale_nodes / 5)
            start_webhook(c, kube, path=coordinator_path)
            wait_webhook(kube, c)
    except BaseException:
        down(work)
        raise
    return c, kube


def start_kubernetes(work: str, kube_port: int,
                     nodes: dict[str, tuple[int, int]]) -> kubernetes.ControlPlane:
    """The control plane under WORK/kube, the nodes registered by their
    kubelets, the GenericNode CRD and the coordinator's RBAC applied."""
    ports = kubernetes.Ports(kube_port)
    kube = kubernetes.ControlPlane(os.path.join(work, "kube"), kube_port).start(
        webhook_urls=(f"127.0.0.1:{ports.webhook}",))
    kube.register_nodes(nodes)
    for manifest in ("crd-genericnode.yaml", "rbac.yaml"):
        kube.apply(data.path("deploy", manifest))
    return kube


def _coordinator(c: cluster.Cluster, name: str, args: list[str], path: str | None = None) -> None:
    env = dict(c.env, PYTHONUNBUFFERED="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    cluster.start_process(c.work, name, [sys.executable, "-m", "pyk8sres.cli", name, *args],
                          env=env)


def start_sync(c: cluster.Cluster, kube: kubernetes.ControlPlane, path: str | None = None) -> None:
    _coordinator(c, "sync", [
        "--kubeconfig", kube.service_account_kubeconfig(SYNC_ACCOUNT, NAMESPACE),
        "--metrics-address", f"127.0.0.1:{kube.ports.sync_metrics}"], path)


def apply_webhook_configuration(kube: kubernetes.ControlPlane, url: str) -> None:
    """As the admin: deploy/webhook.yaml's ValidatingWebhookConfiguration,
    calling `url` (a coordinator outside the cluster) instead of a Service."""
    from ..coordinator.webhook import webhook_template
    doc = webhook_template()
    for hook in doc["webhooks"]:
        hook["clientConfig"] = {"url": url}
    kube.kubectl("apply", "-f", "-", input=json.dumps(doc))


def start_webhook(c: cluster.Cluster, kube: kubernetes.ControlPlane, *extra: str,
                  path: str | None = None) -> None:
    """`pyk8sres webhook` as its ServiceAccount; extra: more of its options
    (e.g. --no-placeholders)."""
    port = kube.ports.webhook
    apply_webhook_configuration(kube, f"https://127.0.0.1:{port}/validate")
    _coordinator(c, "webhook", [
        "--kubeconfig", kube.service_account_kubeconfig(WEBHOOK_ACCOUNT, NAMESPACE),
        "--metrics-address", f"127.0.0.1:{kube.ports.webhook_metrics}",
        "--listen", f"127.0.0.1:{port}", "--url", f"https://127.0.0.1:{port}/validate",
        "--cert-dir", os.path.join(c.work, "webhook-tls"),
        "--client-ca", kube.webhook_client_ca, "--client-name", kubernetes.WEBHOOK_CLIENT, *extra],
        path)


def _wait(done, what: str, log: str, c: cluster.Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.3)
    raise cluster.ClusterError(f"{what}; log/{log} ends:\n{c.log_tail(log)}")


def wait_generic_nodes(kube, names: list[str], c: cluster.Cluster, timeout: float = 30) -> None:
    def published() -> bool:
        out = set(kube.kubectl("get", "genericnode", "-o", "name", check=False).stdout.split())
        return all(f"genericnode.pyk8sres.io/{n}" in out for n in names)
    _wait(published, "the sync daemon did not publish GenericNodes", "sync.out", c, timeout)


def wait_webhook(kube, c: cluster.Cluster, timeout: float = 30) -> None:
    """Until the coordinator has published its configuration with its CA."""
    def published() -> bool:
        return bool(kube.kubectl("get", "validatingwebhookconfiguration", "pyk8sres-admission",
                                 "-o", "jsonpath={.webhooks[0].clientConfig.caBundle}",
                                 check=False).stdout.strip())
    _wait(published, "the admission webhook did not publish its configuration", "webhook.out",
          c, timeout)


def down(work: str) -> list[str]:
    """The coordinator first, then the control plane by their PIDs (before
    cluster.down, whose sweep would otherwise SIGKILL them: their command
    lines name the work directory), then Slurm."""
    work = os.path.abspath(work)
    stopped = [name for name in ("sync", "webhook") if cluster.stop_process(work, name)]
    kube_dir = os.path.join(work, "kube")
    if os.path.isdir(os.path.join(kube_dir, "run")):
        stopped += kubernetes.ControlPlane(kube_dir, 0).stop()
    return stopped + cluster.down(work)
