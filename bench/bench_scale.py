#!/usr/bin/env python3
"""pyk8sres at growing node counts, each figure also as a ratio
against the smallest count, measured in the same run.

Every count N runs its own cluster from `cluster up --scale-nodes`
(pyk8sres.testbed.cluster): n1 with a real slurmd, and s1..s(N-1) declared in
slurm.conf without a slurmd, in a partition of their own (never registered:
UNKNOWN; the node_features plugin gives them k8scpu/k8smemory; the ledger
works on them as on any node).

ledger phase (slurmctld only), through the ledger's real socket:
  reserve and release on random nodes (p50/p99), `show` of one node, of
  every node, and since a token with one node changed (p50/p99, slurmctld
  CPU per show), a `set` that changes nothing; slurmctld's CPU per
  reserve+release and its resident memory per node.
--kubernetes phase: the real control plane (pyk8sres.testbed.hybrid: etcd,
  kube-apiserver, kcm, kube-scheduler, kwok with N nodes), sync and the
  webhook with its placeholders:
  admission latency of a pod created onto a shared node (p50/p99), against
  the same create onto a node outside the webhook's scope (the API server
  alone) in the same cluster; CPU per admitted pod of every daemon; idle CPU
  of sync, the webhook and slurmctld over --idle seconds, once sync has
  written every GenericNode ("GN s": when that was); the control plane's
  resident memory per node.
Pods per node: --pods-per-node K first puts K pods on every shared node
through admission (8 clients at once; the time it took is reported), then
measures idle and admission with them there.

Writes docs/img/scale-*.png (matplotlib; --plots elsewhere) and the figures as JSON (--json).

  nice python3 bench/bench_scale.py [--nodes 10,100,1000,3000,10000]
      [--kubernetes --kube-nodes 10,100,1000] [--ops 1000] [--pods 300]
      [--baseline-pkg DIR] [--base-port 22100] [--kube-port 22400] [--json FILE]
      [--plots DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kubernetes.client.exceptions import ApiException

from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.testbed import cluster, hybrid

CPUS, MEMORY = 32, 128000
TICK = os.sysconf("SC_CLK_TCK")
HERE = os.path.dirname(os.path.abspath(__file__))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def stats(ms: list[float]) -> dict:
    return {"p50": pct(ms, 50), "p99": pct(ms, 99), "max": max(ms)}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process and of its children it has
    waited for (sync runs scontrol)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def rss_bytes(pid: int) -> int:
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) * 1024


def names(n: int) -> list[str]:
    return ["n1"] + cluster.scale_names(n - 1)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


# ------------------------------------------------------------------ ledger
def ledger_phase(n: int, port: int, ops: int) -> dict:
    work = tempfile.mkdtemp(prefix="scale-ledger-", dir=os.environ.get("PYK8SRES_BENCH_DIR"))
    c = cluster.up(work, nodes=1, cpus=CPUS, memory=MEMORY, base_port=port, scale_nodes=n - 1,
                   node_features=True)
    try:
        ledger = Ledger(ledger_socket_path(c.conf), timeout=60)
        ledger.show()
        pid = c.pid("slurmctld")
        every = names(n)
        rng = random.Random(n)
        # One pod's share on every node, as a cluster in use has.
        for node in every:
            assert ledger.reserve(node, f"base-{node}", 1000, 1 << 30)["ok"]
        out = {"nodes": n, "rss_bytes": rss_bytes(pid)}
        reserve, release = [], []
        cpu0 = cpu_s(pid)
        for i in range(ops):
            node = rng.choice(every)
            reserve.append(timed(lambda: ledger.reserve(node, f"pod-{i}", 250, 256 << 20)))
            release.append(timed(lambda: ledger.release(node, f"pod-{i}")))
        out["slurmctld_cpu_ms_per_pod"] = (cpu_s(pid) - cpu0) * 1000 / ops
        out["reserve_ms"], out["release_ms"] = stats(reserve), stats(release)
        out["show_one_ms"] = stats([timed(lambda: ledger.show(rng.choice(every)))
                                    for _ in range(200)])
        shows = max(10, 2000 // n)
        cpu0 = cpu_s(pid)
        out["show_all_ms"] = stats([timed(ledger.show) for _ in range(shows)])
        out["show_all_cpu_ms"] = (cpu_s(pid) - cpu0) * 1000 / shows
        out["show_since_ms"], out["show_since_cpu_ms"] = since_polls(ledger, pid, rng, every)
        out["noop_set_ms"] = stats([timed(lambda node=rng.choice(every): ledger.set(
            node, {f"base-{node}": (1000, 1 << 30)}, 0)) for _ in range(200)])
        return out
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)


def since_polls(ledger, pid: int, rng, every: list[str], polls: int = 200):
    """A poller's `show` since its last token, one node changed before each
    (a reserve): (ms per show, slurmctld CPU ms per show)."""
    token = ledger.show()["token"]
    took, cpu = [], 0.0
    for i in range(polls):
        assert ledger.reserve(rng.choice(every), f"poll-{i}", 100, 1 << 20)["ok"]
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()
        reply = ledger.show(since=token)
        took.append((time.perf_counter() - t0) * 1000)
        cpu += cpu_s(pid) - cpu0
        assert reply["ok"] and not reply["full"] and len(reply["nodes"]) == 1, reply
        token = reply["token"]
    return stats(took), cpu * 1000 / polls


# -------------------------------------------------------------- Kubernetes
def fill(kube, ns: str, nodes: list[str], per_node: int, threads: int = 8) -> dict:
    """`per_node` pods of 1m CPU on every node, created through admission
    by `threads` clients at once: {"pods", "seconds", "refused"}."""
    refused = []

    def create(i: int) -> None:
        node = nodes[i % len(nodes)]
        try:
            kube_calls.create_pod(kube, ns, pod(f"f-{i}", node, "1m"))
        except ApiException as e:
            refused.append(f"{node}: {e.status} {e.reason}")
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, range(len(nodes) * per_node)))
    return {"pods": len(nodes) * per_node - len(refused), "seconds": time.monotonic() - t0,
            "refused": refused[:5], "refused_count": len(refused)}


def settle(kube, ns: str, start: float, timeout: float = 900) -> float:
    """Wait until kwok has every pod running (its status updates are most of
    the control plane's work after a fill): seconds it took."""
    while time.monotonic() - start < timeout:
        pending = kube.core.list_namespaced_pod(ns, field_selector="status.phase!=Running",
                                                limit=1, _request_timeout=60)
        if not pending.items:
            return time.monotonic() - start
        time.sleep(5)
    raise SystemExit(f"pods not all running after {timeout:.0f} s")


def kube_phase(n: int, port: int, kube_port: int, pods: int, idle: float,
               coordinator_path: str | None = None, per_node: int = 0) -> dict:
    work = tempfile.mkdtemp(prefix="scale-kube-", dir=os.environ.get("PYK8SRES_BENCH_DIR"))
    t0 = time.monotonic()
    c, cp = hybrid.up(work, nodes=1, cpus=CPUS, memory=MEMORY, base_port=port,
                      kube_port=kube_port, scale_nodes=n - 1, node_features=True,
                      coordinator_path=coordinator_path)
    try:
        out = {"nodes": n, "up_s": time.monotonic() - t0}
        os.environ["SLURM_CONF"] = c.conf
        cp.register_nodes({"not-shared": (CPUS, MEMORY)})
        kube = kube_calls.Kube(cp.kubeconfig)
        pids = {name: c.pid(name) for name in ("slurmctld", "sync", "webhook")}
        pids.update({name: cp.pid(name) for name in
                     ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok")})
        out["kube_rss_bytes"] = cp.rss()
        out["coordinator_rss_bytes"] = {k: rss_bytes(pids[k]) for k in ("sync", "webhook")}
        ns = "bench-" + uuid.uuid4().hex[:6]
        kube.core.create_namespace({"metadata": {"name": ns}})
        # Until the webhook is in force (a pod larger than n1 is refused).
        deadline = time.monotonic() + 300
        while True:
            try:
                kube_calls.create_pod(kube, ns, pod("probe-" + uuid.uuid4().hex[:6], "n1", "1000"))
            except ApiException as e:
                if e.status == 403:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the webhook refused nothing in 300 s")
            time.sleep(0.5)
        out["ready_s"] = time.monotonic() - t0
        if per_node:
            out["fill"] = fill(kube, ns, names(n), per_node)
            print(f"  {out['fill']['pods']} pods on {n} nodes in {out['fill']['seconds']:.0f} s "
                  f"({out['fill']['refused_count']} refused)", flush=True)
            out["settle_s"] = settle(kube, ns, time.monotonic())
        # Idle means after sync's paced GenericNode writes (20 per second).
        hybrid.wait_generic_nodes_current(cp, n, cp.ports.sync_metrics, c, 120 + n / 5)
        out["current_s"] = time.monotonic() - t0
        if per_node:
            out["filled_rss_bytes"] = {k: rss_bytes(pids[k]) for k in ("sync", "webhook")}
        time.sleep(5)
        before = {k: cpu_s(p) for k, p in pids.items()}
        time.sleep(idle)
        out["idle_cpu_pct"] = {k: (cpu_s(p) - before[k]) * 100 / idle for k, p in pids.items()}
        shared = names(n)
        rng = random.Random(n)
        for label, where in (("baseline", ["not-shared"]), ("allow", shared)):
            for _ in range(10):
                kube_calls.create_pod(kube, ns,
                                      pod("w-" + uuid.uuid4().hex[:10], rng.choice(where), "1m"))
            before = {k: cpu_s(p) for k, p in pids.items()}
            t1 = time.monotonic()
            lat = [timed(lambda: kube_calls.create_pod(kube, ns, pod("b-" + uuid.uuid4().hex[:10],
                                                             rng.choice(where), "1m")))
                   for _ in range(pods)]
            wall = time.monotonic() - t1
            out[f"{label}_ms"] = stats(lat)
            # CPU per pod, by daemon; minus the idle rate over the same time.
            out[f"{label}_cpu_ms_per_pod"] = {
                k: max(0.0, (cpu_s(p) - before[k]) - out["idle_cpu_pct"][k] / 100 * wall)
                * 1000 / pods for k, p in pids.items()}
        return out
    finally:
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


def pod(name, node, cpu):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x", "resources": {
                "requests": {"cpu": cpu, "memory": "1Mi"}}}]}}


# ------------------------------------------------------------------ output
def report(results: dict) -> None:
    rows = results.get("ledger", [])
    if rows:
        base = rows[0]
        print(f"\nledger, slurmctld with N node records (ms; ratio = / the {base['nodes']}-node "
              "figure of this run):")
        print(f"{'nodes':>6} {'reserve p50':>11} {'p99':>7} {'show1 p50':>9} {'p99':>7} "
              f"{'showall p50':>11} {'p99':>8} {'noop set p50':>12} {'ctld CPU ms/pod':>15} "
              f"{'RSS MB':>7}  ratios reserve p99, show-all p50")
        for r in rows:
            print(f"{r['nodes']:>6} {r['reserve_ms']['p50']:11.2f} {r['reserve_ms']['p99']:7.2f} "
                  f"{r['show_one_ms']['p50']:9.2f} {r['show_one_ms']['p99']:7.2f} "
                  f"{r['show_all_ms']['p50']:11.2f} {r['show_all_ms']['p99']:8.2f} "
                  f"{r['noop_set_ms']['p50']:12.2f} {r['slurmctld_cpu_ms_per_pod']:15.3f} "
                  f"{r['rss_bytes'] / 2**20:7.1f}  "
                  f"{r['reserve_ms']['p99'] / base['reserve_ms']['p99']:.2f}, "
                  f"{r['show_all_ms']['p50'] / base['show_all_ms']['p50']:.1f}")
        print("\n`show` of every node against `show` since a token, one node changed "
              "(a poller's refresh):")
        print(f"{'nodes':>6} {'all p50':>8} {'p99':>7} {'since p50':>9} {'p99':>7} "
              f"{'ctld CPU ms/show: all':>21} {'since':>6}  ratio all/since (CPU)")
        for r in rows:
            print(f"{r['nodes']:>6} {r['show_all_ms']['p50']:8.2f} {r['show_all_ms']['p99']:7.2f} "
                  f"{r['show_since_ms']['p50']:9.2f} {r['show_since_ms']['p99']:7.2f} "
                  f"{r['show_all_cpu_ms']:21.2f} {r['show_since_cpu_ms']:6.2f}  "
                  f"{r['show_all_cpu_ms'] / max(r['show_since_cpu_ms'], 1e-3):.1f}")
        if len(rows) > 1:
            a, b = rows[0], rows[-1]
            print(f"slurmctld memory per node: "
                  f"{(b['rss_bytes'] - a['rss_bytes']) / (b['nodes'] - a['nodes']):.0f} bytes; "
                  f"show of every node: {(b['show_all_ms']['p50'] - a['show_all_ms']['p50']) / (b['nodes'] - a['nodes']) * 1000:.1f} µs per node")
            big = [r for r in rows if r["nodes"] >= 10000]
            if big:
                ok = big[0]["reserve_ms"]["p99"] <= 5
                print(f"goal reserve p99 <= 5 ms at {big[0]['nodes']} nodes (idle slurmctld): "
                      f"{'met' if ok else 'NOT met'} ({big[0]['reserve_ms']['p99']:.2f} ms)")
    rows = results.get("kubernetes", [])
    if rows:
        base = rows[0]
        print("\nadmission onto a shared node (allow) and onto a node outside the webhook's scope "
              "(the API server alone), ms, sequential:")
        print(f"{'nodes':>6} {'allow p50':>9} {'p99':>7} {'alone p50':>9} {'p99':>7} "
              f"{'allow/alone p50':>15} {'CPU ms/pod all':>14} {'sync':>6} {'webhook':>7} "
              f"{'idle %: sync':>12} {'webhook':>7} {'slurmctld':>9} {'ready s':>7} {'GN s':>5} "
              f"{'kube MB':>8}")
        for r in rows:
            cpu = r["allow_cpu_ms_per_pod"]
            print(f"{r['nodes']:>6} {r['allow_ms']['p50']:9.1f} {r['allow_ms']['p99']:7.1f} "
                  f"{r['baseline_ms']['p50']:9.1f} {r['baseline_ms']['p99']:7.1f} "
                  f"{r['allow_ms']['p50'] / r['baseline_ms']['p50']:15.2f} "
                  f"{sum(cpu.values()):14.1f} {cpu['sync']:6.2f} {cpu['webhook']:7.2f} "
                  f"{r['idle_cpu_pct']['sync']:12.2f} {r['idle_cpu_pct']['webhook']:7.2f} "
                  f"{r['idle_cpu_pct']['slurmctld']:9.2f} {r['ready_s']:7.0f} {r['current_s']:5.0f} "
                  f"{r['kube_rss_bytes'] / 2**20:8.0f}")
        for r in rows:
            if "fill" in r:
                f, rss = r["fill"], r["filled_rss_bytes"]
                print(f"{r['nodes']} nodes filled with {f['pods']} pods through admission in "
                      f"{f['seconds']:.0f} s ({f['pods'] / f['seconds']:.0f} pods/s, "
                      f"{f['refused_count']} refused), all running {r['settle_s']:.0f} s later; "
                      f"then RSS sync {rss['sync'] / 2**20:.0f} MB, "
                      f"webhook {rss['webhook'] / 2**20:.0f} MB")
        if len(rows) > 1:
            a, b = rows[0], rows[-1]
            print(f"control plane memory per kwok node: "
                  f"{(b['kube_rss_bytes'] - a['kube_rss_bytes']) / (b['nodes'] - a['nodes']) / 1024:.0f} KiB; "
                  f"allow p99 at {b['nodes']} / at {a['nodes']}: "
                  f"{b['allow_ms']['p99'] / a['allow_ms']['p99']:.2f}")


def baseline_report(results: dict) -> None:
    base = {r["nodes"]: r for r in results.get("kubernetes_baseline", [])}
    rows = [(base[r["nodes"]], r) for r in results.get("kubernetes", []) if r["nodes"] in base]
    if not rows:
        return
    print("\nsync and the webhook, the baseline build (--baseline-pkg) against this one, "
          "same counts, one run (CPU incl. children such as scontrol):")
    print(f"{'nodes':>6} {'idle % sync base':>16} {'this':>6} {'ratio':>6} "
          f"{'sync ms/pod base':>16} {'this':>6} {'ratio':>6} {'idle % slurmctld base':>21} "
          f"{'this':>6} {'allow p99 base':>14} {'this':>6} {'idle % apiserver+kwok base':>26} "
          f"{'this':>6}")
    for b, r in rows:
        ib, ir = b["idle_cpu_pct"]["sync"], r["idle_cpu_pct"]["sync"]
        cb, cr = b["allow_cpu_ms_per_pod"]["sync"], r["allow_cpu_ms_per_pod"]["sync"]
        print(f"{r['nodes']:>6} {ib:16.2f} {ir:6.2f} {ir / ib if ib else float('nan'):6.2f} "
              f"{cb:16.2f} {cr:6.2f} {cr / cb if cb else float('nan'):6.2f} "
              f"{b['idle_cpu_pct']['slurmctld']:21.2f} {r['idle_cpu_pct']['slurmctld']:6.2f} "
              f"{b['allow_ms']['p99']:14.1f} {r['allow_ms']['p99']:6.1f} "
              f"{cp_idle(b):26.1f} {cp_idle(r):6.1f}")


def cp_idle(r: dict) -> float:
    """The control plane's own idle CPU (kwok's heartbeats): a run whose
    control plane is busier than the other's is not comparable."""
    return r["idle_cpu_pct"]["kube-apiserver"] + r["idle_cpu_pct"]["kwok"]


def plot(results: dict, out_dir: str, load: str) -> list[str]:
    import matplotlib  # here, not at the top: optional, and its backend is set before pyplot loads
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    rows = results.get("ledger", [])
    if rows:
        x = [r["nodes"] for r in rows]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label, color in (("reserve_ms", "reserve", "C0"), ("show_one_ms", "show one node", "C1"),
                                  ("show_all_ms", "show every node", "C2"),
                                  ("show_since_ms", "show since a token", "C4"),
                                  ("noop_set_ms", "set, unchanged", "C3")):
            ax.plot(x, [r[key]["p50"] for r in rows], "o-", color=color, label=f"{label} p50")
            ax.plot(x, [r[key]["p99"] for r in rows], "s--", color=color, label=f"{label} p99")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Slurm nodes")
        ax.set_ylabel("ms")
        ax.set_title(f"ledger latency in slurmctld (load avg {load})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        save(fig, "scale-ledger-latency.png")
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax.plot(x, [r["slurmctld_cpu_ms_per_pod"] for r in rows], "o-",
                label="slurmctld CPU per reserve+release")
        ax.set_xscale("log")
        ax.set_xlabel("Slurm nodes")
        ax.set_ylabel("CPU ms per pod")
        ax.set_ylim(bottom=0)
        ax.set_title(f"slurmctld CPU per pod (load avg {load})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "scale-ledger-cpu.png")
    rows = results.get("kubernetes", [])
    if rows:
        x = [r["nodes"] for r in rows]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label, color in (("allow_ms", "admitted by the webhook", "C0"),
                                  ("baseline_ms", "API server alone", "C7")):
            ax.plot(x, [r[key]["p50"] for r in rows], "o-", color=color, label=f"{label} p50")
            ax.plot(x, [r[key]["p99"] for r in rows], "s--", color=color, label=f"{label} p99")
        ax.set_xscale("log")
        ax.set_xlabel("nodes (Slurm records = kwok nodes)")
        ax.set_ylabel("ms per pod create")
        ax.set_ylim(bottom=0)
        ax.set_title(f"admission latency (load avg {load})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "scale-admission-latency.png")
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
        daemons = sorted(rows[-1]["allow_cpu_ms_per_pod"], key=lambda k: -rows[-1]["allow_cpu_ms_per_pod"][k])
        for d in daemons:
            ax.plot(x, [r["allow_cpu_ms_per_pod"][d] for r in rows], "o-", label=d)
        ax.plot(x, [sum(r["allow_cpu_ms_per_pod"].values()) for r in rows], "k^-", label="all")
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("CPU ms per admitted pod")
        ax.set_title("CPU per pod, by daemon")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        for d in ("sync", "webhook", "slurmctld", "kube-apiserver"):
            ax2.plot(x, [r["idle_cpu_pct"][d] for r in rows], "o-", label=d)
        ax2.set_xscale("log")
        ax2.set_xlabel("nodes")
        ax2.set_ylabel("% of one core, no pods arriving")
        ax2.set_title(f"idle CPU (load avg {load})")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=7)
        save(fig, "scale-cpu-per-pod.png")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="10,100,1000,3000,10000", help="ledger phase ('' skips it)")
    p.add_argument("--kubernetes", action="store_true", help="also the Kubernetes phase")
    p.add_argument("--kube-nodes", default="10,100,1000")
    p.add_argument("--ops", type=int, default=1000, help="reserve+release pairs per count")
    p.add_argument("--pods", type=int, default=300, help="pods created per case per count")
    p.add_argument("--idle", type=float, default=20, help="seconds of idle CPU sampling")
    p.add_argument("--pods-per-node", type=int, default=0,
                   help="pods (1m CPU) put on every shared node through admission before "
                        "measuring (the goals are for 30)")
    off = int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0"))
    p.add_argument("--base-port", type=int, default=17100 + off)
    p.add_argument("--kube-port", type=int, default=17400 + off)
    p.add_argument("--baseline-pkg", metavar="DIR",
                   help="with --kubernetes: also run sync and the webhook from the pyk8sres "
                        "package under DIR (another build), each count right before this one's")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--plots", default=os.path.join(os.path.dirname(HERE), "docs", "img"))
    a = p.parse_args(argv)
    load = os.getloadavg()
    results: dict = {"loadavg_start": load}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)

    # Each count's figures are kept as soon as they exist; a count that
    # fails (e.g. does not fit, or does not start in time) ends its phase
    # and is reported as the first that did not run.
    phases = [("ledger", n, lambda n: ledger_phase(n, a.base_port, a.ops))
              for n in [int(x) for x in a.nodes.split(",") if x]]
    if a.kubernetes:
        for n in [int(x) for x in a.kube_nodes.split(",") if x]:
            if a.baseline_pkg:
                phases.append(("kubernetes_baseline", n, lambda n: kube_phase(
                    n, a.base_port, a.kube_port, a.pods, a.idle, a.baseline_pkg,
                    a.pods_per_node)))
            phases.append(("kubernetes", n, lambda n: kube_phase(
                n, a.base_port, a.kube_port, a.pods, a.idle, per_node=a.pods_per_node)))
    failed = set()
    for phase, n, run in phases:
        if phase in failed:
            continue
        print(f"{phase} phase, {n} nodes ...", flush=True)
        try:
            results.setdefault(phase, []).append(run(n))
        except Exception as e:  # noqa: BLE001 - reported with the figures
            failed.add(phase)
            results.setdefault("failed", []).append({"phase": phase, "nodes": n,
                                                     "error": str(e)[-2000:]})
            print(f"{phase} phase at {n} nodes failed: {str(e)[:500]}", flush=True)
        save()
    results["loadavg_end"] = os.getloadavg()
    label = f"{results['loadavg_start'][0]:.1f}-{results['loadavg_end'][0]:.1f}"
    print(f"\nload average (1 min) at start and end: {label} (2 cores, shared)")
    report(results)
    baseline_report(results)
    for f in results.get("failed", []):
        print(f"did not run: {f['phase']} at {f['nodes']} nodes: {f['error'][:300]}")
    save()
    for path in plot(results, a.plots, label):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
