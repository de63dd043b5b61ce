"""`pyk8sres cluster up --kubernetes --containerized {ack,slinky}`: Slurm
inside Kubernetes, laid out as ACK's SlurmCluster operator lays it out, or
as SchedMD's slurm-operator does (testbed/slinky.py: what differs).

Kubernetes nodes are kwok nodes named like a cloud's (cn-hongkong.10.1.0.19,
.20, ...).  Slurm's workers are real API objects: a StatefulSet in namespace
`slurm`, `<cluster>-worker-<group>`, one pod per node (required pod
anti-affinity), placed by kube-scheduler and "run" by kwok.  Its pods'
names are the Slurm node names, as ACK's operator makes them.

The test cluster plays the container runtime (ContainerRuntime, a daemon of
its own): for each worker pod bound to a node it starts a real slurmd as a
DYNAMIC node named as the pod (`slurmd -Z --conf "CPUs=<cpu limit>
RealMemory=<memory limit MB> Feature=<group>"`, as ACK's entrypoint does),
and stops it, by PID, when the pod goes (deleted, or replaced by a new pod
of the same name).  pyk8sres itself knows nothing of this: it sees only the
API server's pods and slurmctld's nodes, as on a site.

Many dynamic slurmds on one machine, each reached at a port or address of
its own.  Each runs in UTS and mount namespaces of its own, as in a pod: its
hostname is the pod name, which its /etc/hosts resolves to a loopback
address of its own (worker_address).  Then, by release:
- 23.11 on: `--conf` takes Port=, so each worker's slurmd gets a port of
  its own (worker_port), wherever slurmctld reaches it (these releases set
  a dynamic node's address from each registration's peer: 127.0.0.1 here).
- 22.05 and 23.02: a dynamic node listens on SlurmdPort (Port= is refused
  in `--conf`: "Must use SlurmdPort"), so each slurmd listens at its own address only
  (CommunicationParameters=NoInAddrAny in its own copy of slurm.conf).  Its
  registration still comes from 127.0.0.1 (the kernel's source for any
  loopback destination), so once the node has registered the runtime sets
  its NodeAddr to the worker's address, as a pod network gives each pod an
  address of its own; 22.05 keeps that address across the node's later
  registrations, and it stays with the pod's name, so a replacement pod's
  slurmd is reached there at once.
Spool, pid and log files follow %n, the node name, as for the static slurmds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from ..policy.quantities import parse_quantity
from . import cluster, daemons, slinky

ACK, SLINKY = "ack", slinky.SLINKY
LAYOUTS = (ACK, SLINKY)
NAMESPACE = "slurm"
CLUSTER_NAME = "slurm-test"         # the SlurmCluster's name
GROUP = "cpu"                       # the worker group (and the Slurm Feature)
NODE_PREFIX, FIRST_HOST = "cn-hongkong.10.1.0.", 19
RUNTIME = "container-runtime"       # the daemon's name under WORK/run and WORK/log
POLL_SECONDS = 0.5
GRACE_SECONDS = 3                   # the worker pods' terminationGracePeriodSeconds
# What the worker's limits leave of its node (Slurm is sized to the limits);
# its requests stay small, so that other pods still fit beside it.
SPARE_CPUS, SPARE_MB = 1, 512
REQUESTS = {"cpu": "100m", "memory": "256Mi"}


def kube_node_names(count: int) -> list[str]:
    """cn-hongkong.10.1.0.19, .20, ...: named as a cloud names its nodes."""
    if count > 254 - FIRST_HOST:
        raise cluster.ClusterError(f"--nodes {count}: at most {254 - FIRST_HOST} in this layout")
    return [f"{NODE_PREFIX}{FIRST_HOST + i}" for i in range(count)]


def statefulset_name(cluster_name: str = CLUSTER_NAME, group: str = GROUP) -> str:
    return f"{cluster_name}-worker-{group}"


def worker_limits(cpus: int, memory: int) -> tuple[int, int]:
    """(CPUs, MB) of a worker pod's limits on a node of cpus/memory: the
    node less a little for what else runs there."""
    return max(1, cpus - SPARE_CPUS), max(256, memory - SPARE_MB)


def statefulset(replicas: int, cpus: int, memory: int, cluster_name: str = CLUSTER_NAME,
                group: str = GROUP) -> dict:
    """The worker StatefulSet, one pod per node (required anti-affinity)."""
    name = statefulset_name(cluster_name, group)
    labels = {"app.kubernetes.io/name": "slurmd", "kai.alibabacloud.com/cluster": cluster_name,
              "kai.alibabacloud.com/worker-group": group}
    cpu, mem = worker_limits(cpus, memory)
    container = {"name": "slurmd", "image": "slurmd:test",
                 "resources": {"requests": dict(REQUESTS),
                               "limits": {"cpu": str(cpu), "memory": f"{mem}Mi"}}}
    spread = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"terminationGracePeriodSeconds": GRACE_SECONDS,
                                           "affinity": {"podAntiAffinity": {
                                               "requiredDuringSchedulingIgnoredDuringExecution":
                                                   [spread]}},
                                           "containers": [container]}}}}


def pod_ordinal(name: str) -> int:
    """A StatefulSet pod's index (the number after its last dash)."""
    m = re.search(r"-(\d+)\Z", name)
    if not m:
        raise ValueError(f"pod {name!r} has no StatefulSet index")
    return int(m.group(1))


def worker_address(name: str) -> str:
    """The loopback address a worker's slurmd lives at (127.0.1.<index+1>),
    the same for every pod of that name."""
    index = pod_ordinal(name)
    if index > 253:
        raise ValueError(f"pod {name!r}: index {index} past this cluster's 254 addresses")
    return f"127.0.1.{index + 1}"


# The first release whose slurmd takes Port= in a dynamic node's --conf
# (slurmd.c through 23.02 refuses it: "Must use SlurmdPort").  23.02 takes
# the address path, seen on 22.05 only: no 23.02 build was at hand.
OWN_PORT_SINCE = (23, 11)


def slurmd_version(c: cluster.Cluster) -> tuple[int, int]:
    """(major, minor) of the cluster's slurmd (`slurmd -V`: "slurm 24.11.5")."""
    out = subprocess.run([daemons.need("slurmd", "slurmd", c.release), "-V"],
                         capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m:
        raise cluster.ClusterError(f"slurmd -V printed no version: {out!r}")
    return int(m.group(1)), int(m.group(2))


def worker_port(slurmd_port: int, name: str) -> int:
    """A worker's own port (releases with OWN_PORT_SINCE): after SlurmdPort."""
    return slurmd_port + 1 + pod_ordinal(name)


def slurmd_port_of(conf_text: str) -> int:
    m = re.search(r"^SlurmdPort=(\d+)", conf_text, flags=re.M)
    if not m:
        raise cluster.ClusterError("slurm.conf has no SlurmdPort=")
    return int(m.group(1))


def dynamic_conf(pod: dict, group: str = GROUP) -> str:
    """slurmd's --conf for a worker pod, as ACK's entrypoint writes it: the
    Slurm node sized to the pod's limits (CPUs whole, memory in MB)."""
    limits = {}
    for c in pod["spec"]["containers"]:
        for k, v in (c.get("resources", {}).get("limits") or {}).items():
            limits[k] = limits.get(k, 0) + parse_quantity(v)
    if not limits.get("cpu") or not limits.get("memory"):
        raise ValueError(f"pod {pod['metadata']['name']}: no cpu and memory limits")
    cpus = int(limits["cpu"])
    memory = int(limits["memory"] // (1 << 20))
    return f"CPUs={max(1, cpus)} RealMemory={memory} Feature={group}"


def wanted(pods: list[dict], name_of=lambda p: p["metadata"]["name"]
           ) -> dict[str, tuple[str, str, str]]:
    """{Slurm node name (name_of): (uid, node, pod name)} of the pods whose
    slurmd should run: bound, not being deleted, not finished."""
    out = {}
    for p in pods:
        meta, spec, status = p["metadata"], p.get("spec", {}), p.get("status", {})
        if spec.get("nodeName") and not meta.get("deletionTimestamp") and \
                status.get("phase") not in ("Succeeded", "Failed"):
            try:
                out[name_of(p)] = (meta["uid"], spec["nodeName"], meta["name"])
            except ValueError as e:
                print(f"{meta['name']}: not started: {e}", flush=True)
    return out


def slurmd_conf_text(text: str) -> str:
    """A worker's copy of slurm.conf: slurmd listens on its hostname's
    address only (slurmctld is not affected: NoCtldInAddrAny is its own)."""
    if re.search(r"^CommunicationParameters=", text, flags=re.M):
        raise cluster.ClusterError("slurm.conf sets CommunicationParameters already")
    return text + "\nCommunicationParameters=NoInAddrAny\n"


def node_addr(scontrol_line: str) -> str | None:
    """NodeAddr of `scontrol -o show node` output (None: no such node)."""
    m = re.search(r"\bNodeAddr=(\S+)", scontrol_line)
    return m.group(1) if m else None


class ContainerRuntime:
    """Plays the container runtime of the worker pods in `work`'s cluster."""

    def __init__(self, work: str, kubeconfig: str, group: str = GROUP, layout: str = ACK,
                 workers: int = 0, cpus: int = 0, memory: int = 0):
        from ..coordinator import kube    # the Kubernetes client, only where it runs
        self.c = cluster.Cluster(work)
        self.kube = kube.Kube(kubeconfig)
        self.group, self.layout = group, layout
        # slinky: the NodeSet controller's part too (workers pods of a
        # cpus/memory host; 0: none)
        self.nodeset = (workers, cpus, memory)
        self.labels = slinky.selector_labels() if layout == SLINKY else \
            {"kai.alibabacloud.com/worker-group": group}
        self.name_of = slinky.slurm_node if layout == SLINKY else lambda p: p["metadata"]["name"]
        self.running: dict[str, tuple] = {}       # Slurm node -> (uid, node, pod)
        self.unaddressed: dict[str, str] = {}     # Slurm node -> address to give it
        self.own_port = slurmd_version(self.c) >= OWN_PORT_SINCE
        with open(self.c.conf, encoding="utf-8") as f:
            self.slurmd_port = slurmd_port_of(f.read())

    def pods(self) -> list[dict] | None:
        """The bound worker pods (None: the API server did not answer)."""
        try:
            items, _ = self.kube.list("pods", namespace=NAMESPACE)
        except Exception as e:      # any failure of the client: try again next pass
            print(f"listing pods: {e}", flush=True)
            return None
        return [p for p in items
                if self.labels.items() <= (p["metadata"].get("labels") or {}).items()]

    def reconcile(self) -> None:
        if self.layout == SLINKY and self.nodeset[0]:
            try:
                for name in slinky.ensure_pods(self.kube.core, *self.nodeset):
                    print(f"{name}: pod created (NodeSet controller)", flush=True)
            except Exception as e:      # any failure of the client: try again next pass
                print(f"creating worker pods: {e}", flush=True)
        pods = self.pods()
        if pods is None:                 # the API server did not answer: keep what runs
            return
        want = wanted(pods, self.name_of)
        by_name = {p["metadata"]["name"]: p for p in pods}
        for name, seen in list(self.running.items()):
            if not self.c.pid(f"slurmd-{name}"):      # exited: restarted, as a kubelet does
                print(f"{name}: slurmd exited; log/slurmd-{name}.out ends:\n"
                      + self.c.log_tail(f"slurmd-{name}.out", 5), flush=True)
                self.stop(name)
            elif want.get(name) != seen:
                self.stop(name)
        for name, seen in want.items():
            if name not in self.running:
                self.start(by_name[seen[2]], seen, name)
        for name, address in list(self.unaddressed.items()):
            self.give_address(name, address)

    def give_address(self, name: str, address: str) -> None:
        """Once the node has registered: NodeAddr = the worker's address."""
        out = subprocess.run(["scontrol", "-o", "show", "node", name], capture_output=True,
                             text=True, env=self.c.env, timeout=30).stdout
        current = node_addr(out)
        if current is None:
            return                                  # not registered yet
        if current != address:
            subprocess.run(["scontrol", "update", f"NodeName={name}", f"NodeAddr={address}"],
                           capture_output=True, env=self.c.env, timeout=30)
            print(f"{name}: NodeAddr {current} -> {address}", flush=True)
            return                                  # checked again on the next pass
        self.unaddressed.pop(name, None)

    def conf(self, pod: dict, node: str) -> str:
        """The worker's slurmd --conf, as its operator's entrypoint writes it."""
        if self.layout != SLINKY:
            return dynamic_conf(pod, self.group)
        try:
            nodes, _ = self.kube.list("nodes")
        except Exception as e:      # any failure of the client: tried again next pass
            raise ValueError(f"listing nodes: {e}") from None
        found = [n for n in nodes if n["metadata"]["name"] == node]
        if not found:
            raise ValueError(f"no Node {node}")
        return slinky.dynamic_conf(pod, found[0])

    def start(self, pod: dict, seen: tuple, name: str) -> None:
        """Start Slurm node `name`'s slurmd for `pod`."""
        try:
            address, conf = worker_address(name), self.conf(pod, seen[1])
        except ValueError as e:
            print(f"{name}: not started: {e}", flush=True)
            return
        root = os.path.join(self.c.work, "containers", name)
        etc = os.path.join(root, "etc")
        os.makedirs(etc, exist_ok=True)
        conf_file, where = self.c.conf, address
        if self.own_port:
            where = f"port {worker_port(self.slurmd_port, name)}"
            conf += f" Port={worker_port(self.slurmd_port, name)}"
        else:
            conf_file = self.conf_copy(etc)
        with open("/etc/hosts", encoding="utf-8") as f:
            daemons.write_file(os.path.join(root, "hosts"), f"{address} {name}\n{f.read()}")
        os.makedirs(os.path.join(self.c.work, "spool", name), exist_ok=True)
        slurmd = daemons.need("slurmd", "slurmd", self.c.release)
        script = f"mount --bind {root}/hosts /etc/hosts && hostname {name} && exec \"$@\""
        argv = [daemons.need("unshare", "util-linux"), "--uts", "--mount", "--propagation",
                "private", "sh", "-c", script, "slurmd", slurmd, "-D", "-Z", "--conf", conf,
                "-N", name, "-f", conf_file]
        daemons.start_process(self.c.work, f"slurmd-{name}", argv, env=self.c.env)
        self.running[name] = seen
        if not self.own_port:
            self.unaddressed[name] = address
        print(f"{name}: slurmd started on {seen[1]} at {where} ({conf})", flush=True)

    def conf_copy(self, etc: str) -> str:
        """The worker's own slurm.conf (slurmd_conf_text) and the files
        slurmd reads beside it (gres.conf, k8s_resources.conf, keys)."""
        main_etc = os.path.dirname(self.c.conf)
        for f in os.listdir(main_etc):
            if os.path.isfile(os.path.join(main_etc, f)) and f != "slurm.conf":
                shutil.copy2(os.path.join(main_etc, f), os.path.join(etc, f))
        with open(self.c.conf, encoding="utf-8") as f:
            daemons.write_file(os.path.join(etc, "slurm.conf"), slurmd_conf_text(f.read()))
        return os.path.join(etc, "slurm.conf")

    def stop(self, name: str) -> None:
        daemons.stop_process(self.c.work, f"slurmd-{name}")
        self.running.pop(name, None)
        self.unaddressed.pop(name, None)
        print(f"{name}: slurmd stopped", flush=True)

    def run(self) -> None:
        while True:
            try:
                self.reconcile()
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                print(f"reconcile: {e}", flush=True)
            time.sleep(POLL_SECONDS)


def start_runtime(c: cluster.Cluster, kube, layout: str = ACK, nodeset=()) -> None:
    """The ContainerRuntime daemon of `c` (as root, like the slurmds it starts);
    nodeset: (workers, cpus, memory) of the pods it keeps (slinky)."""
    argv = [sys.executable, "-m", "pyk8sres.testbed.containerized", "--workdir", c.work,
            "--kubeconfig", kube.kubeconfig, "--layout", layout]
    if nodeset:
        argv += ["--nodeset", ",".join(map(str, nodeset))]
    env = dict(c.env, PYTHONUNBUFFERED="1")
    daemons.start_process(c.work, RUNTIME, argv, env=env, cwd="/")


def worker_names(count: int, cluster_name: str = CLUSTER_NAME, group: str = GROUP) -> list[str]:
    return [f"{statefulset_name(cluster_name, group)}-{i}" for i in range(count)]


# The coordinator as a site running ACK's operator configures it.
COORDINATOR_SETTINGS = f'worker_pods = "{ACK}"\nworker_namespace = "{NAMESPACE}"\n'


def coordinator_settings(layout: str = ACK) -> str:
    return slinky.COORDINATOR_SETTINGS if layout == SLINKY else COORDINATOR_SETTINGS


def chart_values(coordinator: bool, layout: str = ACK) -> tuple:
    """helm --set arguments: the worker settings for the coordinator; without
    one, the webhook leaves the workers' namespace alone (nothing answers it)."""
    if coordinator:
        return ("--set", f"sync.workerPods={layout}",
                "--set", f"sync.workerNamespace={NAMESPACE}")
    return ("--set", f"webhook.excludeNamespaces={{{NAMESPACE}}}")


def workers_ready(c: cluster.Cluster, names: list[str]) -> bool:
    """Is each worker's Slurm node registered and idle (with 22.05: at its
    own address)?"""
    own_port = slurmd_version(c) >= OWN_PORT_SINCE
    for name in names:
        out = subprocess.run(["scontrol", "-o", "show", "node", name], capture_output=True,
                             text=True, env=c.env, timeout=30).stdout
        state = re.search(r"\bState=(\S+)", out)
        if not state or not state.group(1).startswith("IDLE") or \
                (not own_port and node_addr(out) != worker_address(name)):
            return False
    return True


def wait_workers(c: cluster.Cluster, names: list[str], timeout: float) -> None:
    daemons.wait_until(lambda: workers_ready(c, names),
                       f"worker slurmds {', '.join(names)} to register (see log/{RUNTIME}.out)",
                       timeout)


def up(work: str, *, layout: str = ACK, nodes: int, workers: int | None = None, cpus: int,
       memory: int, base_port: int, kube_port: int, slurm: str | None = None,
       auth: str = "auto", node_features: bool | None = None, coordinator: bool = True,
       timeout: float = 120) -> tuple[cluster.Cluster, object]:
    """Slurm inside Kubernetes: slurmctld with no node in slurm.conf
    (dynamic nodes only, partition debug Nodes=ALL), `nodes` kwok nodes of
    cpus/memory, and `workers` worker pods (default nodes - 1: a node stays
    free for a worker to move to), each running its slurmd; returns once
    every worker's Slurm node is idle at its address.  coordinator: the
    chart, sync and the webhook as a site running that operator sets them
    (worker_pods = layout, worker_namespace = "slurm"), started before the
    workers; coordinator=False: none runs, and the chart's webhook leaves
    namespace `slurm` alone (every other pod's binding is refused, as
    always while no webhook answers)."""
    from . import hybrid
    if layout not in LAYOUTS:
        raise cluster.ClusterError(f"--containerized {layout!r}: one of {', '.join(LAYOUTS)}")
    workers = (nodes - 1 if nodes > 1 else 1) if workers is None else workers
    if not 1 <= workers <= nodes:
        raise cluster.ClusterError(f"--workers {workers}: 1 to --nodes ({nodes}); one worker "
                                   "pod per node")
    names = kube_node_names(nodes)
    slurmd_port = base_port + 1       # then each worker's own (worker_port), where used
    taken = [p for p in range(slurmd_port, slurmd_port + workers + 1) if not cluster.port_free(p)]
    if taken:
        raise cluster.ClusterError(f"port(s) {', '.join(map(str, taken))} (SlurmdPort and the "
                                   "workers') already in use: choose another --base-port")
    os.makedirs(work, exist_ok=True)
    c = cluster.up(work, nodes=0, cpus=cpus, memory=memory, base_port=base_port,
                   node_features=node_features, synced=True, slurm=slurm, auth=auth,
                   # a site running the coordinator for worker pods holds each
                   # new worker's node until its pods are counted (docs/ledger.md)
                   k8s_conf=hybrid.ledger_conf(work) + (
                       "HoldNewNodes=yes\n" if coordinator else ""),
                   # every dynamic slurmd listens on SlurmdPort, each at its own address
                   extra_conf=f"MaxNodeCount={workers + 8}\nSlurmdPort={slurmd_port}\n")
    try:
        hybrid.confine(c)
        kube = hybrid.start_kubernetes(c.work, kube_port, {n: (cpus, memory) for n in names},
                                       values=chart_values(coordinator, layout),
                                       namespaces=(NAMESPACE,))
        if coordinator:
            hybrid.start_sync(c, kube, settings=coordinator_settings(layout))
            hybrid.start_webhook(c, kube, settings=coordinator_settings(layout))
            hybrid.wait_webhook(kube, c)
        if layout == SLINKY:
            # the runtime creates the pods, as the NodeSet controller does
            start_runtime(c, kube, layout, (workers, cpus, memory))
            wait_workers(c, [slinky.slurm_node_name(i) for i in range(workers)], timeout)
        else:
            kube.kubectl("create", "-f", "-",
                         input=json.dumps(statefulset(workers, cpus, memory)))
            start_runtime(c, kube)
            wait_workers(c, worker_names(workers), timeout)
    except BaseException:
        hybrid.down(work)
        raise
    return c, kube


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the test cluster's container runtime for "
                                            "Slurm's worker pods")
    p.add_argument("--workdir", required=True)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--layout", choices=LAYOUTS, default=ACK)
    p.add_argument("--nodeset", default="0,0,0", help="slinky: WORKERS,CPUS,MB of the pods "
                   "to keep, as the NodeSet controller does")
    args = p.parse_args(argv)
    workers, cpus, memory = (int(x) for x in args.nodeset.split(","))
    ContainerRuntime(args.workdir, args.kubeconfig, layout=args.layout, workers=workers,
                     cpus=cpus, memory=memory).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
