"""The helpers of test_webhook_e2e.py: Slurm's own counts and job states,
pods as the tests write them, waiting until the webhook is in force, the
coordinator's webhook restarted or run in the test's process, and the
hostile callers some tests start as another uid (faults.Caller): a probe of
what the coordinator's uid may open, a flood of idle and slow connections,
a hog of the ledger's connections."""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from kubernetes.client.exceptions import ApiException

from conftest_kube import wait_for  # noqa: F401 (the webhook tests take it from here)
from ground_truth import over_capacity
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator import webhook
from pyk8sres.coordinator.config import SyncConfig, WebhookConfig
from pyk8sres.testbed import cluster, hybrid, kubernetes

NODE_CPUS, NODE_MEM = 8, 16000
CAPACITY = {"n1": (NODE_CPUS, NODE_MEM), "n2": (NODE_CPUS, NODE_MEM)}
NOBODY_SCHEDULES = "test-binds-it-itself"
KUBELET_RESIZE = "pyk8sres.io/kubelet-resize"   # kube/kwok.yaml: leave a resize pending


def used(slurm, node):
    """Slurm's own word: k8scpu/k8smemory allocated = jobs + Kubernetes' share."""
    n = slurm_calls.get_node(node)
    return n.gres_used.get("k8scpu", 0), n.gres_used.get("k8smemory", 0)


def sbatch(slurm, node, cpus, mem=1000):
    out = subprocess.run(["sbatch", "--parsable", "-w", node, "-c", str(cpus), f"--mem={mem}",
                          "-o", "/dev/null", "--wrap", "sleep 300"],
                         env=slurm.env, capture_output=True, text=True, check=True,
                         cwd="/tmp").stdout
    return out.strip().split(";")[0]


def job_state(slurm, job):
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=slurm.env,
                         capture_output=True, text=True).stdout.split()
    return tuple(out[:2]) if out else ("GONE", "")


def pod(name, cpu, mem="1Gi", node=None, scheduler=None):
    spec = {"containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": mem}}}],
            "terminationGracePeriodSeconds": 0}
    if node:
        spec["nodeName"] = node
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def node_of(kube, ns, name):
    return ((kube_calls.get_pod(kube, ns, name) or {}).get("spec") or {}).get("nodeName")


def active(kube, ns, node="n1"):
    """Wait until the webhook is in force: its configuration reaches the API
    server's plugin through an informer, and the ledger answers (slurmctld
    may have just restarted).  The probe asks for more than any node has:
    refused by the ledger, so it reserves nothing."""
    last = []

    def refused():
        try:
            kube_calls.create_pod(kube, ns, pod("probe", "100", node=node))
        except ApiException as e:
            last[:] = [e.status, e.body]
            return e.status == 403 and "does not fit" in (e.body or "")
        last[:] = ["created"]
        kube_calls.delete_pod(kube, ns, "probe")
        return False
    try:
        wait_for(refused, 30, "webhook in force")
    except AssertionError:
        hook_config = kube_calls.get_webhook_config(kube, "pyk8sres-admission")
        raise AssertionError(f"webhook not in force: last answer {last}; configuration "
                             f"{hook_config}") from None


def refused_every_way(kube, ns, node, cpu, mem="1Gi") -> str:
    """A pod of cpu/mem is refused on `node` (403, "does not fit on node
    <node>") each way it may get there: created with spec.nodeName; dressed
    as a Slurm worker (named as ACK's, labelled as Slinky's, with the
    labels and annotations anyone may write: nothing exempts it outside the
    workers' namespace); bound as kube-scheduler's DefaultBinder binds
    (pods/binding), the pod `sched` left unbound for the test to place.
    Returns the first refusal's text."""
    selfish = pod("slurm-test-worker-cpu-9", cpu, mem, node=node)
    selfish["metadata"]["labels"] = {"pyk8sres.io/slurm-worker": "true",
                                     "app.kubernetes.io/name": "slurmd",
                                     "app.kubernetes.io/component": "worker"}
    selfish["metadata"]["annotations"] = {"pyk8sres.io/slurm-worker": "true"}
    kube_calls.create_pod(kube, ns, pod("sched", cpu, mem, scheduler=NOBODY_SCHEDULES))
    bodies = []
    for attempt in (lambda: kube_calls.create_pod(kube, ns, pod("direct", cpu, mem, node=node)),
                    lambda: kube_calls.create_pod(kube, ns, selfish),
                    lambda: kube_calls.bind_pod(kube, ns, "sched", node)):
        try:
            attempt()
        except ApiException as e:
            assert e.status == 403 and f"does not fit on node {node}" in e.body, e.body
            bodies.append(e.body)
        else:
            raise AssertionError(f"a pod of {cpu} CPUs was let onto {node}")
    assert node_of(kube, ns, "sched") is None
    return bodies[0]


def no_double_booking(slurm, kube):
    assert over_capacity(slurm.env, kube, CAPACITY) == []


def restart_coordinator_webhook(slurm, control_plane, kube, ns):
    """`pyk8sres webhook` again as its ServiceAccount (it was stopped)."""
    hybrid.start_webhook(slurm, control_plane)
    hybrid.wait_webhook(control_plane, slurm)
    active(kube, ns)


def in_process_webhook(slurm, control_plane, ledger, **cfg):
    """The coordinator's webhook in this process, as its ServiceAccount, on
    the port the API server presents its client certificate to (the
    `pyk8sres webhook` process is stopped first)."""
    cluster.stop_process(slurm.work, "webhook")
    p = control_plane.ports.webhook
    sa = control_plane.service_account_kubeconfig(hybrid.WEBHOOK_ACCOUNT, hybrid.NAMESPACE)
    wcfg = WebhookConfig(listen=f"127.0.0.1:{p}", url=f"https://127.0.0.1:{p}/validate",
                           client_ca_file=control_plane.webhook_client_ca,
                           client_names=(kubernetes.WEBHOOK_CLIENT,), **cfg)
    hook = webhook.Webhook(wcfg, SyncConfig(), kube_calls.Kube(sa), ledger).start()
    served = []                      # monotonic times of the calls that reached us
    review = hook.server.admission.review
    hook.server.admission.review = lambda body: served.append(time.monotonic()) or review(body)
    return hook, served


def ran_with(kube, ns, name):
    """CPU the kubelet (kwok) reports the pod's container running with."""
    st = ((kube_calls.get_pod(kube, ns, name) or {}).get("status") or {})
    return ((st.get("containerStatuses") or [{}])[0].get("resources") or {}).get(
        "requests", {}).get("cpu")


def resize_pending(kube, ns, name):
    status = (kube_calls.get_pod(kube, ns, name) or {}).get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodResizePending":
            return c.get("reason")
    return None


def cpu_to(kube, ns, name, cpu):
    kube_calls.resize_pod(kube, ns, name, [{"name": "c", "resources": {"requests": {
        "cpu": cpu, "memory": "1Gi"}}}])


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def timed_create(kube, ns, body) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        kube_calls.create_pod(kube, ns, body)
        return time.monotonic() - t0, "created"
    except ApiException as e:
        return time.monotonic() - t0, e


# The hostile callers: each runs as another uid in a child forked by
# faults.Caller, and reports through its queue until `stop` is set.
def probe_reach(queue, stop, path, state, journal, key):
    """As the coordinator's uid: the ledger answers; Slurm's state, the
    journal and the munge key do not open."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b'{"op":"show"}\n')
        shown = json.loads(s.makefile("rb").readline())
    denied = []
    for what, fn in (("state", lambda: os.listdir(state)), ("journal", lambda: open(journal)),
                     ("munge key", lambda: open(key, "rb"))):
        try:
            fn()
        except PermissionError:
            denied.append(what)
    queue.put(("done", (shown.get("ok"), sorted(shown.get("nodes", {})), sorted(denied))))


def hold_ledger(queue, stop, path, n):
    """Open up to n connections to the ledger, each answered, until one is
    refused; hold them until stopped (a minute at most)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(path)
        try:                  # over the budget: "busy", or closed before we wrote
            s.sendall(b'{"op":"show"}\n')
            ok = json.loads(s.makefile("rb").readline()).get("ok")
        except (OSError, ValueError):
            ok = False
        if not ok:
            s.close()
            break
        socks.append(s)
    queue.put(("holding", len(socks)))
    stop.wait(60)
    for s in socks:
        s.close()
    queue.put(("done", None))


def client_hello() -> bytes:
    """A real TLS ClientHello, to dribble byte by byte."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def stall_handshakes(port, n, hello, batch=4, timeout=0.5, total=10.0) -> list:
    """n TCP connections that send a whole ClientHello, wait for the
    server's answer (so each is accepted and its handshake under way), then
    never go on; `batch` at a time (within a listen backlog of 5, so none
    waits on a dropped ACK), each batch given up after `timeout`, all of
    them after `total` seconds."""
    stalled = []
    end = time.monotonic() + total
    while len(stalled) < n and time.monotonic() < end:
        socks = []
        for _ in range(min(batch, n - len(stalled))):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        poller, waiting = select.poll(), {s.fileno(): s for s in socks}
        for s in socks:
            poller.register(s, select.POLLOUT)
        sent, deadline = set(), time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for fd, ev in poller.poll(50):
                if fd not in sent:        # connected: the whole ClientHello
                    try:
                        waiting[fd].send(hello)
                    except OSError:
                        pass
                    sent.add(fd)
                    poller.modify(fd, select.POLLIN)
                else:                     # the server answered (or closed)
                    poller.unregister(fd)
                    del waiting[fd]
        stalled += socks
    return stalled


def flood_webhook(queue, stop, port, idle, stalled, hellos, headers):
    """As an unprivileged user: `headers` TLS connections (no certificate)
    dribbling an HTTP request's headers a byte every 0.1 s, `stalled` TLS
    handshakes started and never finished, `hellos` TCP connections
    dribbling a ClientHello a byte every 0.1 s, then `idle` TCP connections
    that never send a byte.  Nothing is reopened."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    request = (b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 10\r\n"
               + b"X-Slow: 1\r\n" * 1000)
    dribbling, failed = [], 0
    for _ in range(headers):
        try:
            s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            failed += 1
            continue
        s.setblocking(False)
        dribbling.append([s, request, 0])
    hello = client_hello()
    held = stall_handshakes(port, stalled, hello)
    stalled_n = len(held)
    for n, data in ((hellos, hello), (idle, None)):
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            (held.append(s) if data is None else dribbling.append([s, data, 0]))
    queue.put(("flooding", {"held": len(held), "stalled": stalled_n,
                            "dribbling": len(dribbling), "tls_failed": failed}))
    cut = 0
    while not stop.is_set():
        for d in dribbling:
            if d[0] is None or d[2] >= len(d[1]):
                continue
            try:
                d[2] += d[0].send(d[1][d[2]:d[2] + 1])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
            except OSError:          # the webhook closed it
                d[0].close()
                d[0] = None
                cut += 1
        stop.wait(0.1)
    closed = 0
    for s in held:
        try:
            closed += s.recv(65536) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    queue.put(("done", {"dribblers_cut": cut, "held_closed_by_webhook": closed}))
