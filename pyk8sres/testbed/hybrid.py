"""`pyk8sres cluster up --kubernetes`: the local Slurm cluster plus a real
Kubernetes API server, one Kubernetes Node per Slurm node, the GenericNode
CRD, `pyk8sres sync` running between them, and the coordinator's admission
webhook (`pyk8sres webhook`, HTTPS on kube_port+3, with placeholder pods).

Every process is recorded under WORKDIR (run/*.pid, kube/*.pid) and stopped
by PID in `down`.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .. import data
from . import cluster, kubeapi_server


def node_manifest(names: list[str], cpus: int, memory_mb: int) -> dict:
    """Kubernetes Nodes standing for the Slurm nodes (same names: the default mapping)."""
    capacity = {"cpu": str(cpus), "memory": f"{memory_mb}Mi", "pods": "110"}
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Node",
         "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
         "status": {"capacity": capacity, "allocatable": capacity}}
        for name in names]}


def up(work: str, *, nodes: int, cpus: int, memory: int, base_port: int, kube_port: int,
       node_features: bool | None = None, extra_conf: str = "", slurm: str | None = None,
       auth: str = "auto", slurmd: bool = True, accounting: bool = False, rest: bool = False,
       **layout) -> tuple[cluster.Cluster, kubeapi_server.KubeAPIServer]:
    """slurmd=False: nodes in slurm.conf only (benchmarks with 1000 nodes);
    `layout`: sockets / cores_per_socket / threads_per_core, as cluster.up."""
    c = cluster.up(work, nodes=nodes, cpus=cpus, memory=memory, base_port=base_port,
                   node_features=node_features, synced=True, extra_conf=extra_conf,
                   slurm=slurm, auth=auth, slurmd=slurmd,
                   accounting=accounting, rest=rest, **layout)
    try:
        kas = kubeapi_server.KubeAPIServer().start(os.path.join(c.work, "kube"), kube_port)
        for manifest in ("crd-genericnode.yaml", "rbac.yaml"):
            kas.apply(data.path("deploy", manifest))
        nodes_file = os.path.join(c.work, "kube", "nodes.json")
        with open(nodes_file, "w") as f:
            json.dump(node_manifest(cluster.node_names(nodes), cpus, memory), f)
        kas.apply(nodes_file)
        # kube_port+1, +2: etcd; +3 the webhook; +4, +5 sync's and the webhook's /metrics
        webhook_port = kube_port + 3
        for p, what in ((webhook_port, "webhook"), (kube_port + 4, "sync metrics"),
                        (kube_port + 5, "webhook metrics")):
            if not cluster.port_free(p):
                raise cluster.ClusterError(f"port {p} ({what}) is in use")
        cluster.start_process(c.work, "sync", [sys.executable, "-m", "pyk8sres.cli", "sync",
                                         "--kubeconfig", kas.kubeconfig,
                                         "--metrics-address", f"127.0.0.1:{kube_port + 4}"],
                       env=dict(c.env, PYTHONUNBUFFERED="1"))
        wait_generic_nodes(kas, cluster.node_names(nodes), c)
        cluster.start_process(c.work, "webhook", [
            sys.executable, "-m", "pyk8sres.cli", "webhook", "--kubeconfig", kas.kubeconfig,
            "--metrics-address", f"127.0.0.1:{kube_port + 5}",
            "--listen", f"127.0.0.1:{webhook_port}",
            "--url", f"https://127.0.0.1:{webhook_port}/validate",
            "--cert-dir", os.path.join(c.work, "webhook-tls")],
            env=dict(c.env, PYTHONUNBUFFERED="1"))
        wait_webhook(kas, c)
    except BaseException:
        down(work)
        raise
    return c, kas


def wait_generic_nodes(kas, names: list[str], c: cluster.Cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = kas.kubectl("get", "genericnode", "-o", "name", check=False).stdout
        if all(f"genericnode.pyk8sres.io/{n}" in out for n in names):
            return
        time.sleep(0.3)
    raise cluster.ClusterError("the sync daemon did not publish GenericNodes: "
                               + c.log_tail("sync.out"))


def wait_webhook(kas, c: cluster.Cluster, timeout: float = 30) -> None:
    """Until the coordinator has published its configuration with its CA."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = kas.kubectl("get", "validatingwebhookconfiguration", "pyk8sres-admission",
                          "-o", "jsonpath={.webhooks[0].clientConfig.caBundle}", check=False).stdout
        if out.strip():
            return
        time.sleep(0.3)
    raise cluster.ClusterError("the admission webhook did not publish its configuration: "
                               + c.log_tail("webhook.out"))


def down(work: str) -> list[str]:
    """The coordinator first, then the API server and etcd by their PIDs
    (before cluster.down, whose sweep would otherwise SIGKILL them: their
    command lines name the work directory), then Slurm."""
    work = os.path.abspath(work)
    stopped = [name for name in ("sync", "webhook") if cluster.stop_process(work, name)]
    kube_dir = os.path.join(work, "kube")
    if os.path.exists(os.path.join(kube_dir, "apiserver.pid")) or \
            os.path.exists(os.path.join(kube_dir, "etcd.pid")):
        kas = kubeapi_server.KubeAPIServer(paths=kubeapi_server.Paths("", "", ""))
        kas.workdir = kubeapi_server.Path(kube_dir)
        kas.stop()
        stopped += ["apiserver", "etcd"]
    return stopped + cluster.down(work)
