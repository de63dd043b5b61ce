"""Benchmark `pyk8sres sync` (a benchmark, not a timed test).

For each cluster size (default 10, 100, 1000 nodes, ~30 pods per node):
  - a real slurmctld whose nodes are defined in slurm.conf only (Gres=
    lines, no slurmd), with the ledger (node_features/k8s_resources),
    ports --base-port+ on 127.0.0.1 (default 27200 + $PYK8SRES_TEST_PORT_OFFSET);
  - the real Kubernetes control plane (pyk8sres.testbed.kubernetes:
    kube-apiserver with RBAC, kube-controller-manager, kube-scheduler, kwok
    playing every kubelet) on --kube-port+ (9 ports), nodes n1..nN (Ready,
    leases renewed by kwok) and 30 bound pods each, which kwok runs;
  - the daemon as its own process (`python -m pyk8sres.coordinator.sync`),
    with the pyk8sres-sync ServiceAccount's token (the Helm chart's RBAC).
Measured: latency from a pod being bound (create with spec.nodeName) to the
node's share being set in the ledger inside slurmctld (the daemon's "share
set" log line, written after the ledger's answer; same clock), p50/p99; the daemon's CPU time (startup, idle resync, per sample)
and memory (peak RSS).  Compared with the 30 s polling interval of Slinky
slurm-bridge, the nearest open-source peer.

  python bench/bench_sync.py [--nodes 10,100,1000] [--pods-per-node 30] [--samples 100]
                             [--base-port P] [--kube-port K] [--json FILE] [--plots DIR]

--json merges this run's rows into FILE by (nodes, pods per node), so
counts measured in separate runs (a large count can take most of an
hour) draw one curve; each row keeps its date and load average.
--plots DIR writes sync-latency.png from every row of FILE with this run's
pods per node.

Goals: p99 < 100 ms at 1,000 nodes and < 1 s at 10,000; sync < 500 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from kubernetes import client, config

# the installed package (tools/install-deps.sh)
from pyk8sres.coordinator.kube import done
from pyk8sres.testbed import chart, cluster, hybrid, kubernetes

ROOT = os.environ.get("PYK8SRES_BENCH_DIR", "/tmp/pyk8sres-bench-sync")
SLURM_PORT = 27200 + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0"))
KUBE_PORT = 27250
CPUS, MEM = 32, 128000
POD_CPU, POD_MEM = "250m", "256Mi"     # 30 pods: 7.5 CPUs -> 8, 7680 MB
PEER_INTERVAL = 30.0                   # Slinky slurm-bridge polls Slurm every 30 s
TICK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- Slurm

# ----------------------------------------------------------------- Kubernetes

def start_api(work):
    """The control plane, the GenericNode CRD and the coordinator's RBAC (the chart's); the
    sync daemon's kubeconfig (its ServiceAccount's token)."""
    kube = kubernetes.ControlPlane(work, KUBE_PORT).start()
    try:
        kube.apply(chart.CRD)
        kube.apply(chart.rbac_manifest(kube.bin.helm, kube.webhook_client_ca,
                                       f"{work}/rbac.yaml"))
        return kube, kube.service_account_kubeconfig("pyk8sres-sync", "pyk8sres-system")
    except BaseException:
        kube.stop()
        raise


def populate(kube, core, nodes: int, per_node: int):
    """Nodes n1..nN as their kubelets register them (kwok plays those
    kubelets: created here by the admin, which is quicker than N client
    certificates), Ready; then per_node pods bound to each."""

    def mk_node(i):
        done(core.create_node(kubernetes.node_object(f"n{i}", CPUS, MEM),
                         _preload_content=False))

    def mk_pods(i):
        for j in range(per_node):
            pod(core, f"n{i}", f"p{i}-{j}", POD_CPU, POD_MEM)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(mk_node, range(1, nodes + 1)))
        kube.wait_nodes_ready([f"n{i}" for i in range(1, nodes + 1)], timeout=300)
        list(ex.map(mk_pods, range(1, nodes + 1)))



def pod(core, node, name, cpu, mem):
    done(core.create_namespaced_pod("default", {
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [{
            "name": "c", "image": "x", "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}},
        _preload_content=False))


# ----------------------------------------------------------------- daemon

class Daemon:
    LINE = re.compile(r"^(\S+ \S+) pyk8sres sync: INFO node (\S+): Kubernetes share set "
                      r"\(\d+ pods\): k8scpu=(\d+) k8smemory=(\d+)")

    def __init__(self, work, kubeconfig, slurm):
        self.slurm = slurm
        self.log = f"{slurm.work}/log/bench-sync.out"
        self.pos = 0
        self.pid = cluster.start_process(slurm.work, "bench-sync", [
            sys.executable, "-m", "pyk8sres.coordinator.sync", "--kubeconfig", kubeconfig,
            "--cluster-name", "bench", "--resync", "1", "--metrics-address", "127.0.0.1:0"],
            env=slurm.env)

    def alive(self) -> bool:
        return cluster.alive(self.pid)

    def cpu(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def mem_mb(self) -> tuple[float, float]:
        vals = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    vals[k] = int(v.split()[0]) / 1024
        return vals["VmRSS"], vals["VmHWM"]

    def applied(self):
        """New (time, node, cpu, mem) apply records since the last call."""
        with open(self.log) as f:
            f.seek(self.pos)
            data = f.read()
        cut = data.rfind("\n") + 1
        self.pos += len(data[:cut].encode())
        out = []
        for line in data[:cut].splitlines():
            m = self.LINE.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((t, m.group(2), int(m.group(3)), int(m.group(4))))
        return out

    def metrics_port(self) -> int | None:
        """The port the daemon chose for /metrics (it logs it), or None yet."""
        with open(self.log) as f:
            m = re.search(r"metrics and health on http://127\.0\.0\.1:(\d+)/", f.read())
        return int(m.group(1)) if m else None

    def stop(self):
        cluster.stop_process(self.slurm.work, "bench-sync")


# ----------------------------------------------------------------- run

def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def wait_started(daemon, server, nodes: int, expect: dict, t0: float) -> tuple[float, float]:
    """Seconds since t0 (the daemon's start) until it has set every node's
    share, and until every GenericNode exists with its newest state (their
    writes are paced, generic_node_qps), so that the idle figure is idle."""
    seen: dict[str, tuple[int, int]] = {}
    while {n: seen.get(n) for n in expect} != expect:
        for _, n, c, m in daemon.applied():
            seen[n] = (c, m)
        if not daemon.alive():
            raise RuntimeError(f"daemon exited; see {daemon.log}")
        if time.monotonic() - t0 > 600:
            raise RuntimeError("initial sync took over 600 s")
        time.sleep(0.05)
    startup = time.monotonic() - t0
    while True:
        port = daemon.metrics_port()
        if port is not None and hybrid.generic_nodes_current(server, nodes, port):
            break
        if time.monotonic() - t0 > 900:
            raise RuntimeError("GenericNodes not all written within 900 s")
        time.sleep(0.5)
    return startup, time.monotonic() - t0


def sample_latency(daemon, core, nodes: int, expect: dict, samples: int) -> list[float]:
    """Seconds from a pod's create to its node's new share in the ledger,
    for `samples` pods on random nodes."""
    lat = []
    rnd = random.Random(1)
    for k in range(samples):
        node = f"n{rnd.randint(1, nodes)}"
        cpu_now, mem_now = expect[node]
        want = (cpu_now + 1, mem_now + 100)
        daemon.applied()                      # skip older lines
        tb = time.time()
        pod(core, node, f"s{k}", "1", "100Mi")
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            for ta, n, c, m in daemon.applied():
                if n == node and (c, m) == want:
                    got = ta
            time.sleep(0.002)
        if got is None:
            print(f"  sample {k}: {node} not updated within 10 s", flush=True)
            lat.append(10.0)
        else:
            lat.append(max(0.0, got - tb))
        expect[node] = want
        time.sleep(0.05)
    return lat


def bench(nodes: int, per_node: int, samples: int) -> dict:
    work = f"{ROOT}/{nodes}"
    load_start = os.getloadavg()[0]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # munged + slurmctld only: nodes exist in slurm.conf (Gres= lines), no
    # slurmd needed; the ledger is served by node_features/k8s_resources.
    slurm = cluster.up(f"{work}/slurm", nodes=nodes, cpus=CPUS, memory=MEM,
                       base_port=SLURM_PORT, node_features=False, slurmd=False,
                       extra_conf="NodeFeaturesPlugins=node_features/k8s_resources\n")
    server = daemon = None
    try:
        server, sync_kubeconfig = start_api(f"{work}/kube")
        core = client.CoreV1Api(config.new_client_from_config(server.kubeconfig))
        t = time.monotonic()
        populate(server, core, nodes, per_node)
        print(f"  [{nodes} nodes] created {nodes} nodes, {nodes * per_node} pods in "
              f"{time.monotonic() - t:.1f}s", flush=True)
        used_cpu = -(-per_node * 250 // 1000)
        used_mem = per_node * 256
        expect = {f"n{i}": (used_cpu, used_mem) for i in range(1, nodes + 1)}   # the share
        t0 = time.monotonic()
        daemon = Daemon(work, sync_kubeconfig, slurm)
        startup, gn_ready = wait_started(daemon, server, nodes, expect, t0)
        time.sleep(2)
        cpu_start = daemon.cpu()
        # Idle: only the periodic comparison with Slurm runs.
        c0, w0 = daemon.cpu(), time.monotonic()
        time.sleep(10)
        idle_cpu = (daemon.cpu() - c0) / (time.monotonic() - w0)
        c0 = daemon.cpu()
        lat = sample_latency(daemon, core, nodes, expect, samples)
        sample_cpu = (daemon.cpu() - c0) / samples
        rss, hwm = daemon.mem_mb()
        return {"nodes": nodes, "pods": nodes * per_node, "per_node": per_node, "samples": samples,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "load": [round(load_start, 1), round(os.getloadavg()[0], 1)],
                "p50": statistics.median(lat), "p99": pct(lat, 99), "max": max(lat),
                "startup_s": startup, "genericnodes_s": gn_ready, "startup_cpu_s": cpu_start,
                "idle_cpu_pct": 100 * idle_cpu, "cpu_ms_per_event": 1000 * sample_cpu,
                "rss_mb": rss, "peak_rss_mb": hwm}
    finally:
        if daemon:
            daemon.stop()
        if server:
            server.stop()
        cluster.down(slurm.work)


def merge(path: str, rows: list[dict]) -> list[dict]:
    """The rows of `path` with this run's put in by (nodes, pods per node);
    written back, sorted by node count."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except FileNotFoundError:
        kept = []
    new = {(r["nodes"], r["per_node"]) for r in rows}
    merged = sorted([r for r in kept if (r["nodes"], r.get("per_node")) not in new] + rows,
                    key=lambda r: (r.get("per_node", 0), r["nodes"]))
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
    return merged


def plot(rows: list[dict], per_node: int, out_dir: str) -> str:
    """sync-latency.png: pod bound -> share set p50/p99 (left) and sync's CPU
    per pod (right) against node count, for `per_node` pods per node."""
    import matplotlib  # here, not at the top: optional, and its backend is set before pyplot loads
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("per_node") == per_node]
    x = [r["nodes"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    ax.plot(x, [1000 * r["p50"] for r in rows], "o-", color="C0", label="p50")
    ax.plot(x, [1000 * r["p99"] for r in rows], "s--", color="C0", label="p99")
    ax.axhline(100, color="C3", lw=0.8, ls=":", label="goal at 1,000 nodes (100 ms)")
    ax.set_xlabel("nodes (Slurm records = kwok nodes)")
    ax.set_ylabel("ms, pod created -> share set in the ledger")
    ax.set_ylim(bottom=0)
    ax.set_title(f"pod bound -> ledger share set, {per_node} pods per node")
    ax2.plot(x, [r["cpu_ms_per_event"] for r in rows], "o-", color="C1", label="sync CPU per pod")
    ax2.set_xlabel("nodes")
    ax2.set_ylabel("CPU ms per pod")
    ax2.set_ylim(bottom=0)
    loads = ", ".join(f"{r['nodes']}: {r['load'][0]}->{r['load'][1]}" for r in rows if "load" in r)
    ax2.set_title(f"sync CPU per pod (load avg {loads})", fontsize=8)
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sync-latency.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="10,100,1000")
    p.add_argument("--pods-per-node", type=int, default=30)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--base-port", type=int, default=SLURM_PORT,
                   help="slurmctld's port (the nodes' follow)")
    p.add_argument("--kube-port", type=int, default=KUBE_PORT,
                   help="the control plane's first port (kubernetes.Ports: 9 in a row)")
    p.add_argument("--json", help="merge this run's rows into this file")
    p.add_argument("--plots", help="write sync-latency.png here (from --json's rows)")
    a = p.parse_args(argv)
    if a.plots and not a.json:
        p.error("--plots draws from --json's file: give both")
    globals().update(SLURM_PORT=a.base_port, KUBE_PORT=a.kube_port)
    results = []
    for n in [int(x) for x in a.nodes.split(",")]:
        r = bench(n, a.pods_per_node, a.samples)
        results.append(r)
        print(f"  {r}", flush=True)
    print()
    print(f"{'nodes':>6} {'pods':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'vs 30s poll':>12} {'startup s':>9} {'idle CPU':>8} {'CPU/event':>10} {'peak RSS':>9}")
    for r in results:
        print(f"{r['nodes']:>6} {r['pods']:>6} {1000 * r['p50']:>8.1f} {1000 * r['p99']:>8.1f} "
              f"{1000 * r['max']:>8.1f} {PEER_INTERVAL / r['p99']:>10.0f}x "
              f"{r['startup_s']:>9.1f} {r['idle_cpu_pct']:>7.1f}% "
              f"{r['cpu_ms_per_event']:>8.1f}ms {r['peak_rss_mb']:>7.0f}MB")
    print("vs 30s poll = Slinky slurm-bridge's 30 s polling interval / our p99 "
          "(its average wait is 15 s: / p50 gives that ratio x0.5).")
    if a.json:
        rows = merge(a.json, results)
        if a.plots:
            print(f"wrote {plot(rows, a.pods_per_node, a.plots)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
