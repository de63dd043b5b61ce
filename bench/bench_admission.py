"""Admission latency through the real Kubernetes API server and the coordinator's webhook.

    python3 bench/bench_admission.py [--nodes 100,1000] [--queue 10000] [--pods 500] [--threads 8]
                                     [--no-generic-nodes]

For each node count it brings up its own hybrid cluster (real slurmctld with
that many nodes in slurm.conf -- no slurmd, Gres= lines, the ledger served by
node_features/k8s_resources --, the real control plane: kube-apiserver with
RBAC calling the webhook with its client certificate, kube-scheduler,
kube-controller-manager, kwok playing every node's kubelet; `pyk8sres sync`
and `pyk8sres webhook` as their ServiceAccounts), then measures, from the
client (the admin), pod creations with spec.nodeName:
  baseline  on a Kubernetes node not shared with Slurm (the webhook is not
            called): the API server's own cost, measured in the same run,
  allow     round the shared nodes n2..nN (webhook + ledger reserve),
  deny      on n1 asking more than the node has (webhook + ledger refusal),
sequentially (p50/p99) and with --threads concurrent clients (pods/s);
with --queue, again with that many jobs queued in slurmctld.  For each case
also the CPU each pod costs every daemon of the cluster (sequential and
concurrent runs, less what the idle cluster spends meanwhile, measured for
10 s before the cases) and the writes the API server served per pod, by resource
and verb (its own apiserver_request_total).  Each shared case is then put
against the baseline of the same run; the last line, for the largest node
count, is what a script reads:
    admission: extra CPU per pod R1, pods/s admitted/alone R2
R1 = (admitted pod's CPU, all daemons - the baseline pod's) / the baseline
pod's; R2 = admitted pods/s / the baseline's.  Then what a GenericNode
status write (the sync daemon's; on objects with and without managedFields;
as a merge patch, JSON patch, PUT or server-side apply) and a pod GET cost
kube-apiserver and etcd.  --no-generic-nodes
runs the sync daemon with generic_nodes = false: the same without the
GenericNode write each admitted pod sets off.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kubernetes.client.exceptions import ApiException

from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.testbed import hybrid


def pod(name, node, cpu):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x", "resources": {
                "requests": {"cpu": cpu, "memory": "1Mi"}}}]}}


def one(kube, ns, node, cpu, expect_ok):
    name = "b-" + uuid.uuid4().hex[:10]
    t0 = time.perf_counter()
    try:
        kube_calls.create_pod(kube, ns, pod(name, node, cpu))
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


def settle(kube, timeout: float = 120) -> float:
    """Seconds until the webhook is in force (a pod asking more than n1 has
    is refused), measured from the cluster being up."""
    t0 = time.monotonic()
    ns = "settle-" + uuid.uuid4().hex[:6]
    kube.core.create_namespace({"metadata": {"name": ns}})
    while time.monotonic() - t0 < timeout:
        try:
            kube_calls.create_pod(kube, ns, pod("probe-" + uuid.uuid4().hex[:6], "n1", "1000"))
        except ApiException as e:
            if e.status == 403:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(f"the webhook refused nothing in {timeout} s")


def cpu_seconds(pids: dict) -> dict:
    """User+system CPU seconds so far of each daemon of the cluster."""
    out = {}
    for name, pid in pids.items():
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def daemons(c, cp) -> dict:
    """name -> PID of every daemon of the cluster (pid files): Slurm's, the
    coordinator's, the control plane's."""
    pids = {}
    for run in (os.path.join(c.work, "run"), os.path.join(cp.work, "run")):
        for f in os.listdir(run):
            if f.startswith("proc-") and f.endswith(".pid"):
                pids[f[5:-4]] = int(open(os.path.join(run, f)).read())
    return pids


WRITES = {"POST", "PUT", "PATCH", "DELETE", "APPLY"}
REQUEST_TOTAL = re.compile(r'^apiserver_request_total\{([^}]*)\} (\S+)$', re.M)


def api_writes(kube) -> collections.Counter:
    """The API server's own count of the writes it served so far, by
    resource[/subresource] and verb (its /metrics: apiserver_request_total)."""
    api = kube.core.api_client
    resp = api.call_api(*api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"]))
    resp.read()
    text = resp.data.decode()
    out: collections.Counter = collections.Counter()
    for labels, value in REQUEST_TOTAL.findall(text):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if label.get("verb") in WRITES:
            what = label.get("resource", "") + ("/" + label["subresource"]
                                                if label.get("subresource") else "")
            out[(what, label["verb"])] += float(value)
    return out


def per_pod(before: dict, after: dict, pods: int, scale: float = 1.0) -> dict:
    return {k: (after.get(k, 0) - before.get(k, 0)) * scale / pods
            for k in set(before) | set(after)}


def idle_rates(pids: dict, seconds: float = 10.0) -> dict:
    """CPU seconds per second each daemon spends with no pod coming: the
    idle cluster (kwok renewing every node's lease and status, and what
    that wakes).  At 1,000 nodes it is most of what runs while a case
    waits for its writes to end, and none of it is the pods' doing."""
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return per_pod(before, cpu_seconds(pids), 1, 1 / seconds)


def cpu_per_pod(before: dict, after: dict, elapsed: float, idle: dict, pods: int) -> dict:
    """CPU ms per pod by daemon over a window of `elapsed` seconds, less
    what the idle cluster spends in that time."""
    used = per_pod(before, after, 1)
    return {k: (v - idle.get(k, 0) * elapsed) * 1000 / pods for k, v in used.items()}


def cpu_line(what: str, used: dict) -> str:
    return (f"  {what:<20} CPU ms per pod: " + ", ".join(
        f"{k} {v:.1f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        + f"; total {sum(used.values()):.1f}")


def measure(kube, pods: int, threads: int, nodes: int, pids: dict,
            generic_nodes: bool = True) -> dict:
    """Per case: p50 and p99 ms (sequential), pods/s (threads clients), CPU
    ms per pod by daemon (sequential and concurrent), API writes per pod
    (sequential)."""
    ns = "bench-" + uuid.uuid4().hex[:6]
    kube.core.create_namespace({"metadata": {"name": ns}})
    # Allowed pods go round the shared nodes n2..nN, as a scheduler spreads
    # them (and no node gets more than its 110 pods); refusals all ask n1.
    shared = [f"n{i}" for i in range(2, nodes + 1)]
    cases = [("baseline", ["not-shared"], "1m", True), ("allow", shared, "1m", True),
             ("deny", ["n1"], "1000", False)]
    out = {}
    idle = idle_rates(pids)
    print(f"  idle cluster: {sum(idle.values()):.2f} cores, subtracted from each case's "
          "CPU per pod over its time", flush=True)
    for label, where, cpu, ok in cases:
        spots = itertools.cycle(where)
        for _ in range(20):
            one(kube, ns, next(spots), cpu, ok)            # warm up connections
        t0, cpu0, writes0 = time.monotonic(), cpu_seconds(pids), api_writes(kube)
        seq = [one(kube, ns, next(spots), cpu, ok) for _ in range(pods)]
        settle_writes(kube)
        t1, cpu1, writes1 = time.monotonic(), cpu_seconds(pids), api_writes(kube)
        todo = [next(spots) for _ in range(pods)]
        with ThreadPoolExecutor(threads) as ex:
            start = time.perf_counter()
            list(ex.map(lambda node: one(kube, ns, node, cpu, ok), todo))
            rate = pods / (time.perf_counter() - start)
        settle_writes(kube)
        t2, cpu2 = time.monotonic(), cpu_seconds(pids)
        out[label] = {"p50": pct(seq, 50), "p99": pct(seq, 99), "rate": rate,
                      "cpu": cpu_per_pod(cpu0, cpu1, t1 - t0, idle, pods),
                      "cpu_concurrent": cpu_per_pod(cpu1, cpu2, t2 - t1, idle, pods),
                      "writes": {k: v for k, v in per_pod(writes0, writes1, pods).items() if v}}
        print(cpu_line(f"{label} sequential", out[label]["cpu"]), flush=True)
        print(cpu_line(f"{label} concurrent", out[label]["cpu_concurrent"]), flush=True)
    costs = request_costs(kube, pids, idle) if generic_nodes else {}
    base = sum(out["baseline"]["cpu"][k] for k in CONTROL_PLANE if k in out["baseline"]["cpu"])
    if costs:
        print("  kube-apiserver + etcd CPU ms per request:", flush=True)
        ref = costs[WITH_FIELDS]
        for what, ms in costs.items():
            print(f"    {what:<46} {ms:5.2f} ({ms / base:.2f}x theirs per baseline pod, "
                  f"{ms / ref:.2f}x with managedFields)", flush=True)
    kube.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    return out


CONTROL_PLANE = ("kube-apiserver", "etcd")
WITH_FIELDS = "the same, object with managedFields"


def request_costs(kube, pids: dict, idle: dict, count: int = 200, rounds: int = 5) -> dict:
    """kube-apiserver + etcd CPU ms per request of each kind an admitted
    pod may set off beyond the baseline's, made `count` times from here
    (less the idle cluster's CPU meanwhile): a GenericNode status write
    (the Kubernetes share flipping between two values: a real write each
    time) in each way it can be sent, and a pod read back.  The kinds take
    turns, `rounds` times, and each gets its median round: the idle
    cluster's heartbeats come in bursts as large as the differences
    measured.  What a profile of our daemons cannot show: the API server's
    share."""
    pids = {k: v for k, v in pids.items() if k in CONTROL_PLANE}
    ns = "cost-" + uuid.uuid4().hex[:6]
    kube.core.create_namespace({"metadata": {"name": ns}})
    kube_calls.create_pod(kube, ns, pod("probe", "not-shared", "1m"))
    calls, scratch = status_writes(kube, "n2")
    calls["pod GET"] = lambda i: kube_calls.get_pod(kube, ns, "probe")
    seen = collections.defaultdict(list)
    try:
        for _ in range(rounds):
            for what, call in calls.items():
                call(0)     # the first of each kind may be a no-op
                t0, cpu0 = time.monotonic(), cpu_seconds(pids)
                for i in range(1, count + 1):
                    call(i)
                used = cpu_per_pod(cpu0, cpu_seconds(pids), time.monotonic() - t0, idle, count)
                seen[what].append(sum(used.values()))
    finally:
        for name in scratch:
            kube.delete_generic_node(name)
    return {what: sorted(v)[len(v) // 2] for what, v in seen.items()}


def status_writes(kube, name: str) -> tuple[dict, list]:
    """The ways to write a GenericNode's status, each a function of i
    writing the Kubernetes share "1m" or "2m" (i's parity), and the scratch
    objects they write.  First the sync daemon's own write on `name` (as
    this build left it), then on two copies of it made here: one carrying
    the managedFields a create and a status patch leave (what every object
    had before the sync daemon cleared them), one without; on the first,
    the other forms of the same write."""
    obj = kube_calls.get_generic_node(kube, name)
    status = obj["status"]
    k8s = next(i for i, a in enumerate(status["allocatedResources"])
               if a["type"] == "Kubernetes")
    tracked, cleared = f"cost-{name}-fields", f"cost-{name}-cleared"
    applied = f"cost-{name}-applied"     # its own: apply makes its manager own the status
    for copy in (tracked, cleared, applied):
        kube.custom.create_cluster_custom_object(
            kube_calls.GROUP, kube_calls.VERSION, kube_calls.PLURAL,
            {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
             "metadata": {"name": copy}, "spec": obj["spec"]})
    kube_calls.done(kube.request("PATCH", kube_calls.GENERIC_NODE_PATH,
                                 {"metadata": {"managedFields": [{}]}},
                                 kube_calls.MERGE_PATCH, name=cleared))
    gn = kube_calls.GENERIC_NODE_STATUS_PATH
    merge, jsonpatch = kube_calls.MERGE_PATCH, "application/json-patch+json"

    def with_cpu(i):
        s = json.loads(json.dumps(status))
        s["allocatedResources"][k8s]["allocated"]["cpu"] = f"{i % 2 + 1}m"
        return s

    def patch(on):
        return lambda i: kube_calls.done(kube.request("PATCH", gn, {"status": with_cpu(i)},
                                                      merge, name=on))
    version = {}

    def put(i):
        if i == 0:
            version.update(kube_calls.get_generic_node(kube, tracked)["metadata"])
        body = dict(obj, metadata=version, status=with_cpu(i))
        resp = kube.request("PUT", gn, body, name=tracked)
        data = resp.data
        resp.release_conn()
        version["resourceVersion"] = json.loads(data)["metadata"]["resourceVersion"]

    def apply(i):
        body = {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                "metadata": {"name": applied}, "status": with_cpu(i)}
        kube_calls.done(kube.request("PATCH", gn + "?fieldManager=bench&force=true", body,
                                     "application/apply-patch+yaml", name=applied))

    return {
        "GenericNode status PATCH (the sync daemon's)": patch(name),
        WITH_FIELDS: patch(tracked),
        "the same, object without managedFields": patch(cleared),
        "with managedFields: merge, changed key only": lambda i: kube_calls.done(kube.request(
            "PATCH", gn, {"status": {"allocatedResources": with_cpu(i)["allocatedResources"]}},
            merge, name=tracked)),
        "with managedFields: JSON patch, one value": lambda i: kube_calls.done(kube.request(
            "PATCH", gn, [{"op": "replace", "value": f"{i % 2 + 1}m",
                           "path": f"/status/allocatedResources/{k8s}/allocated/cpu"}],
            jsonpatch, name=tracked)),
        "with managedFields: PUT with resourceVersion": put,
        "with managedFields: server-side apply": apply,
    }, [tracked, cleared, applied]


# Writes every kubelet (kwok) makes whatever the pods do: node leases and
# node status.  At 1,000 nodes they never pause, so waiting for them to stop
# would only add the idle cluster's CPU to every pod's.
HEARTBEATS = {"leases", "nodes", "nodes/status"}


def settle_writes(kube, quiet: float = 2.0, timeout: float = 30.0) -> None:
    """Wait until the writes a burst set off (bindings, status, placeholders,
    GenericNodes, Events) are done: no new write but the kubelets'
    heartbeats for `quiet` seconds."""
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    start = api_writes(kube)
    while time.monotonic() < deadline:
        seen = api_writes(kube)
        now = sum(v for (what, _), v in seen.items() if what not in HEARTBEATS)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.5)
    busy = {k: v - start.get(k, 0) for k, v in seen.items()
            if k[0] not in HEARTBEATS and v != start.get(k, 0)}
    print(f"  (writes went on for {timeout:.0f} s, counted in the CPU per pod: {busy})",
          flush=True)


def report(rows: list, threads: int) -> None:
    """The table, each shared case against the API server alone in the same
    run, and as the last line the two ratios a script reads."""
    print(f"\n{'nodes':>5} {'slurmctld':<13} {'case':<9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'pods/s':>7} {'CPU ms/pod':>10}  ({threads} clients for pods/s; "
          "baseline = no webhook; CPU: all daemons, sequential)")
    for n, load, out in rows:
        for label, r in out.items():
            print(f"{n:>5} {load:<13} {label:<9} {r['p50']:7.1f} {r['p99']:7.1f} "
                  f"{r['rate']:7.0f} {sum(r['cpu'].values()):10.1f}")
        base, allow = out["baseline"], out["allow"]
        for what in ("cpu", "cpu_concurrent"):
            extra = sum(allow[what].values()) - sum(base[what].values())
            print(f"{'':>5} {'':<13} extra CPU per admitted pod ({what}): {extra:.1f} ms = "
                  f"{extra / sum(base[what].values()):.2f}x the baseline's")
        print(f"{'':>5} {'':<13} admitted/alone: p50 {allow['p50'] / base['p50']:.2f}x, "
              f"p99 {allow['p99'] / base['p99']:.2f}x, pods/s {allow['rate'] / base['rate']:.2f}x")
        more = {k: allow["writes"].get(k, 0) - base["writes"].get(k, 0)
                for k in set(allow["writes"]) | set(base["writes"])}
        ranked = sorted(more.items(), key=lambda kv: -abs(kv[1]))
        print(f"{'':>5} {'':<13} API writes per admitted pod beyond the baseline's: " + (", ".join(
            f"{res} {verb} {v:+.2f}" for (res, verb), v in ranked if abs(v) >= 0.01) or "none"))
    n, load, out = max((r for r in rows if r[1] == "idle"), key=lambda r: r[0])
    base, allow = out["baseline"], out["allow"]
    r1 = (sum(allow["cpu"].values()) - sum(base["cpu"].values())) / sum(base["cpu"].values())
    print(f"admission: extra CPU per pod {r1:.2f}, pods/s admitted/alone "
          f"{allow['rate'] / base['rate']:.2f}   ({n} nodes)")


def fill_queue(c, count: int) -> None:
    script = "for i in $(seq %d); do sbatch -H -o /dev/null --wrap true >/dev/null; done"
    procs = [subprocess.Popen(["sh", "-c", script % (count // 4)], env=c.env, cwd="/tmp")
             for _ in range(4)]
    for p in procs:
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="100,1000")
    ap.add_argument("--queue", type=int, default=0, help="also measure with this many queued jobs")
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--base-port", type=int, default=19000)
    ap.add_argument("--kube-port", type=int, help="default: --base-port + 50")
    ap.add_argument("--no-generic-nodes", action="store_true",
                    help="the sync daemon writes no GenericNodes (generic_nodes = false): "
                         "what an admitted pod costs without them")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        work = tempfile.mkdtemp(prefix="pyk8sres-bench-adm-")
        print(f"{n} nodes: starting slurmctld, the control plane, sync and the webhook ...",
              flush=True)
        t0 = time.monotonic()
        c, cp = hybrid.up(work, nodes=n, cpus=64, memory=256000, base_port=args.base_port,
                          kube_port=args.kube_port or args.base_port + 50, node_features=False,
                          slurmd=False,
                          extra_conf="NodeFeaturesPlugins=node_features/k8s_resources\n",
                          coordinator=not args.no_generic_nodes)
        try:
            if args.no_generic_nodes:
                hybrid.start_sync(c, cp, settings="generic_nodes = false\n")
                hybrid.start_webhook(c, cp)
                hybrid.wait_webhook(cp, c)
            os.environ["SLURM_CONF"] = c.conf
            cp.register_nodes({"not-shared": (64, 256000)})
            kube = kube_calls.Kube(cp.kubeconfig)
            print(f"{n} nodes: up in {time.monotonic() - t0:.0f} s, the webhook in force "
                  f"{settle(kube):.0f} s later", flush=True)
            rows.append((n, "idle", measure(kube, args.pods, args.threads, n, daemons(c, cp),
                                            not args.no_generic_nodes)))
            if args.queue:
                print(f"{n} nodes: queueing {args.queue} jobs ...", flush=True)
                fill_queue(c, args.queue)
                rows.append((n, f"{args.queue} queued",
                             measure(kube, args.pods, args.threads, n, daemons(c, cp))))
        except BaseException:
            for log in ("sync.out", "webhook.out"):
                print(f"--- {log} ends:\n{c.log_tail(log)}", flush=True)
            raise
        finally:
            hybrid.down(work)
            shutil.rmtree(work, ignore_errors=True)
    report(rows, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
