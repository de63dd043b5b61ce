"""The Kubernetes requests the coordinator really makes, against deploy/rbac.yaml.

tests/unit/test_rbac.py derives each daemon's (group, resource, verb) set
from the code; here the two daemons run for real (`pyk8sres sync` and
`pyk8sres webhook` against a real local Slurm and a real API server), each
through a recording HTTP proxy of its own, through a scenario that takes
every path that calls Kubernetes: start (CRD check, lists, watches,
webhook configuration created then updated), a stray GenericNode and a
stray placeholder pod removed, a pod bound (admission reads it), a job
started and ended (placeholder created and resized), pods coming and going.

The requests seen, classified by the API server's rules, must be exactly
the set derived from the code, and all granted by rbac.yaml (except the
CRD check, which is meant to be refused).  Ports: port(27900) Slurm,
port(27950) API server (+1, +2 etcd), port(27960) webhook; the proxies take
free ephemeral ports.
"""
from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from local_slurm import SLURM, port
from pyk8sres.coordinator import kube as K
from pyk8sres.coordinator import slurm as S
from pyk8sres.policy import placeholder as P
from pyk8sres.testbed import cluster, hybrid
from pyk8sres.testbed.kubeapi_server import KubeAPIServer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
import test_rbac as R  # noqa: E402  (the static derivation and rbac.yaml's grants)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")
NAMESPACE = "pyk8sres-system"
WEBHOOK_PORT = port(27960)


class Recorder(http.server.ThreadingHTTPServer):
    """A plain HTTP proxy to the API server that records (method, path, query)."""
    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.seen: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"      # one request per connection, body until close

    def log_message(self, *args):
        pass

    def _forward(self):
        srv = self.server
        url = urllib.parse.urlsplit(self.path)
        with srv.lock:
            srv.seen.append((self.command, url.path, urllib.parse.parse_qs(url.query)))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        up = http.client.HTTPConnection(srv.upstream.hostname, srv.upstream.port, timeout=300)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("connection", "keep-alive", "proxy-connection")}
        up.request(self.command, self.path, body=body or None, headers=headers)
        resp = up.getresponse()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            while chunk := resp.read1(65536):   # watches stream: pass each piece on at once
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, http.client.IncompleteRead):
            pass
        finally:
            up.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward


def kubeconfig(path: str, server: str) -> str:
    with open(path, "w") as f:
        json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                   "clusters": [{"name": "c", "cluster": {"server": server}}],
                   "users": [{"name": "u", "user": {}}],
                   "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}, f)
    return path


def classify(seen) -> set:
    """{(group, resource, verb, namespace)} as the API server's authorizer sees them."""
    out = set()
    for method, path, query in seen:
        if path.startswith(("/version", "/openapi")) or path in ("/api", "/apis"):
            continue    # discovery: allowed to every authenticated user
        watch = query.get("watch", [""])[0] in ("true", "1")
        rule, namespaced = R._rule(method, path, watch)
        parts = path.strip("/").split("/")
        ns = parts[parts.index("namespaces") + 1] if namespaced else None
        out.add((*rule, ns))
    return out


def wait(what, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def world(kube_paths):
    root = tempfile.mkdtemp(prefix="pyk8sres-rbac-live-")
    c = cluster.up(f"{root}/slurm", nodes=2, cpus=4, memory=4000, base_port=port(27900),
                   synced=True, slurm=SLURM)
    kas = None
    proxies = []
    try:
        kas = KubeAPIServer(kube_paths).start(f"{root}/kube", port(27950))
        kas.apply(R.REPO / "deploy" / "crd-genericnode.yaml")
        kas.apply(R.REPO / "deploy" / "rbac.yaml")
        with open(f"{root}/nodes.json", "w") as f:
            json.dump(hybrid.node_manifest(["n1", "n2"], 4, 4000), f)
        kas.apply(f"{root}/nodes.json")
        direct = K.Kube(kas.kubeconfig)
        # Strays the daemons must clean up: a GenericNode of no Slurm node,
        # a placeholder pod of no shared node ...
        direct.create_generic_node("ghost", {"alias": "ghost"}, {})
        # ... and one with a stale spec the sync daemon must correct.
        direct.create_generic_node("n1", {"alias": "stale"}, {})
        direct.core.create_namespaced_pod(NAMESPACE, P.pod("ghost", NAMESPACE, 100, 1 << 20,
                                                           (1000, 1 << 30)),
                                          _preload_content=False).release_conn()
        proxies = {name: Recorder(kas.url) for name in ("sync", "webhook")}
        for p in proxies.values():
            threading.Thread(target=p.serve_forever, daemon=True).start()
        env = dict(c.env, PYTHONUNBUFFERED="1")
        with open(f"{root}/sync.toml", "w") as f:   # node Events bumped within the scenario
            f.write("event_update_seconds = 1.0\nmetrics_seconds = 1.0\n")
        cluster.start_process(c.work, "sync", [
            sys.executable, "-m", "pyk8sres.cli", "sync", "--kubeconfig",
            kubeconfig(f"{root}/sync.kubeconfig", proxies["sync"].url),
            "--config", f"{root}/sync.toml", "--metrics-address", "127.0.0.1:0"], env=env)
        cluster.start_process(c.work, "webhook", [
            sys.executable, "-m", "pyk8sres.cli", "webhook", "--kubeconfig",
            kubeconfig(f"{root}/webhook.kubeconfig", proxies["webhook"].url),
            "--listen", f"127.0.0.1:{WEBHOOK_PORT}",
            "--url", f"https://127.0.0.1:{WEBHOOK_PORT}/validate",
            "--cert-dir", f"{root}/webhook-tls", "--metrics-address", "127.0.0.1:0"], env=env)
        hybrid.wait_generic_nodes(kas, ["n1", "n2"], c)
        hybrid.wait_webhook(kas, c)
        yield c, kas, direct, proxies
    finally:
        for p in proxies.values() if isinstance(proxies, dict) else ():
            p.shutdown()
        cluster.down(c.work)
        if kas is not None:
            kas.stop()


def _pod(name, node=None, cpu="500m"):
    spec = {"containers": [{"name": "c", "image": "busybox",
                            "resources": {"requests": {"cpu": cpu, "memory": "100Mi"}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_requests_made_are_exactly_the_derived_calls_and_granted(world):
    c, kas, direct, proxies = world
    gns = lambda: set(direct.list_generic_nodes())          # noqa: E731
    wait("stray GenericNode deleted", lambda: "ghost" not in gns())
    wait("stale spec corrected", lambda: direct.list_generic_nodes()["n1"]["spec"]["alias"] == "n1")
    placeholders = lambda: {p["metadata"]["name"] for p in           # noqa: E731
                            K.list_namespace_pods(direct, NAMESPACE)}
    wait("stray placeholder deleted", lambda: P.name_for("ghost") not in placeholders())
    wait("placeholders created", lambda: {P.name_for("n1"), P.name_for("n2")} <= placeholders())

    # A pod bound through pods/binding (the webhook reads the pod) and one
    # created on a node; the sync daemon counts both.
    direct.core.create_namespaced_pod("default", _pod("bound"),
                                      _preload_content=False).release_conn()
    K.bind_pod(direct, "default", "bound", "n1")
    direct.core.create_namespaced_pod("default", _pod("direct", node="n2"),
                                      _preload_content=False).release_conn()
    # A pod that does not fit is refused, twice (the refusal path): the
    # webhook posts an Event on it, then bumps its count.
    for _ in range(2):
        with pytest.raises(ApiException) as refused:
            direct.core.create_namespaced_pod("default", _pod("too-big", node="n1", cpu="64"),
                                              _preload_content=False)
        assert refused.value.status in (400, 403, 422) and "n1" in str(refused.value.body)

    def event_count(ns, name, reason):
        evs = [e for e in K.list_events(direct, ns, f"involvedObject.name={name}")
               if e["reason"] == reason]
        return evs[0]["count"] if evs else 0
    wait("refusal Event counted twice",
         lambda: event_count("default", "too-big", "InsufficientSharedCapacity") == 2)
    # n2 held beyond its capacity in the ledger (as pods bound without
    # admission would; set straight in the ledger, because the pod watch
    # through the recording proxy only delivers when it ends): the sync
    # daemon's next show() sees n2 oversubscribed and posts an Event on
    # GenericNode n2 (reading it for its UID), bumped a second later.
    ledger = S.Ledger(S.ledger_socket_path(c.conf))
    held = {k: tuple(v) for k, v in ledger.show("n2")["nodes"]["n2"]["entries"].items()}
    assert ledger.set("n2", {**held, "rbac-live-over": (8000, 1 << 20)}, 0)["oversubscribed"]
    try:
        wait("Oversubscribed Event bumped",
             lambda: event_count("default", "n2", "Oversubscribed") >= 2)
    finally:
        ledger.set("n2", held, 0)
    # A job: its placeholder grows, then shrinks when it ends.
    job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-c", "2",
                                  "--wrap", "sleep 4"], capture_output=True, text=True,
                                 env=c.env, check=True).stdout.strip()

    def placeholder_cpu():
        return {p["metadata"]["name"]: P.current(p)[0]
                for p in K.list_namespace_pods(direct, NAMESPACE) if P.current(p)}
    wait("placeholder resized for the job", lambda: max(placeholder_cpu().values()) >= 2000)
    wait("job ended", lambda: not subprocess.run(
        ["squeue", "-h", "-j", job], capture_output=True, text=True, env=c.env).stdout.strip())
    wait("placeholder back to 0", lambda: max(placeholder_cpu().values()) == 0)
    K.delete_pod(direct, "default", "bound")
    # Someone edits the webhook configuration: the webhook puts its
    # shared-node condition back (an update of what it created at start).
    def condition():
        cfg = K.get_webhook_config(direct, "pyk8sres-admission")
        return next(c["expression"] for c in cfg["webhooks"][0]["matchConditions"]
                    if c["name"] == "shared-node")
    published = condition()
    assert published != "true"
    kas.kubectl("patch", "validatingwebhookconfiguration", "pyk8sres-admission", "--type=json",
                "-p", json.dumps([{"op": "replace", "path": "/webhooks/0/matchConditions",
                                   "value": [{"name": "shared-node", "expression": "true"}]}]))
    wait("webhook configuration repaired", lambda: condition() == published, timeout=30)
    time.sleep(3)          # a few more reconcile and refresh cycles
    for name in ("sync", "webhook"):
        cluster.stop_process(c.work, name)

    calls, grants = R.code_calls(), R.granted()
    for daemon, account in (("sync", "pyk8sres-sync"), ("webhook", "pyk8sres-webhook")):
        seen = classify(proxies[daemon].seen)
        denied = {r for a, r in R.DENIED_ON_PURPOSE if a == account}
        cluster_wide, local = grants[account]
        for group, resource, verb, ns in seen:
            rule = (group, resource, verb)
            assert rule in cluster_wide or rule in denied or \
                (ns == NAMESPACE and rule in local), f"{account}: {rule} in {ns} not granted"
        code_cluster, code_local = calls[account]
        # The CRD check is meant to be refused (403: "the admin applied it");
        # here the server allows everything and the CRD is there, so its
        # create never comes: leave those calls out on both sides.
        code_cluster = code_cluster - denied
        seen = {s for s in seen if s[:3] not in denied}
        seen_cluster = {(g, r, v) for g, r, v, ns in seen
                        if not (ns == NAMESPACE and (g, r, v) in code_local)}
        seen_local = {(g, r, v) for g, r, v, ns in seen
                      if ns == NAMESPACE and (g, r, v) in code_local}
        # Both ways: the static derivation misses nothing that happens, and
        # this scenario took every call it derived.
        assert seen_cluster == code_cluster, (account, seen_cluster ^ code_cluster)
        assert seen_local == code_local, (account, seen_local ^ code_local)
