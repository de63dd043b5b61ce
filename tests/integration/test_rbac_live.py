"""The coordinator's Kubernetes permissions, live, on the real control plane
(kube-apiserver enforcing RBAC; the daemons as their ServiceAccounts of
the Helm chart, with tokens, as the coordinator's uid).

1. The requests the coordinator really makes.  tests/unit/test_rbac.py
   derives each daemon's (group, resource, verb) set from the code; here the
   two daemons run for real (`pyk8sres sync` and `pyk8sres webhook` against
   a real local Slurm), each through a recording proxy of its own, through a
   scenario that takes every path that calls Kubernetes: start (CRD check,
   lists, watches, the webhook configuration updated), a stray GenericNode
   and a stray placeholder pod removed, a pod bound (admission reads it), a
   job started and ended (placeholders follow it), pods coming and going, a
   GPU job (its holder claim) and a pod's claim allocated (the webhook reads
   the node's ResourceSlices).
   The requests seen, classified by the API server's rules, must be exactly
   the set derived from the code, all granted by the chart (the API server
   answered none of them 403) except the CRD check, which the API server
   must refuse.
2. A grant taken away: the coordinator fails closed -- no pod is
   admitted on a shared node while the webhook may not read pods, no share
   is lowered while sync may not list them -- and its log and /readyz name
   the verb and resource missing; given back, it recovers by itself.

Ports: port(27900) Slurm; the control plane a free block in 31000-31990
(its webhook port is where the webhook listens); the proxies take free
ephemeral ports.
"""
from __future__ import annotations

import copy
import http.client
import http.server
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from conftest_kube import done, http_get, pick_ports, rbac_manifest
from local_slurm import SLURM, port
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator.placeholder import RELIST_SECONDS
from pyk8sres.policy import placeholder
from pyk8sres.testbed import cluster, hybrid, pki
from pyk8sres.testbed import gpus as fake_gpus

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
import test_rbac  # noqa: E402  (the static derivation and the chart's grants)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")
NAMESPACE = hybrid.NAMESPACE
PLACEHOLDERS = test_rbac.PLACEHOLDERS
GPUS = 2   # each node's fake GPUs: a job's GPU gets a holder claim, a pod's claim is checked
KUBE_PORTS = (31000, 31990)


class Recorder(http.server.ThreadingHTTPServer):
    """A plain HTTP proxy to the API server (HTTPS, its CA trusted) that
    records (method, path, query, status); the daemon's token passes through."""
    daemon_threads = True

    def __init__(self, upstream: str, ca_file: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.ctx = ssl.create_default_context(cafile=ca_file)
        self.seen: list[tuple[str, str, dict, int]] = []
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
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        up = http.client.HTTPSConnection(srv.upstream.hostname, srv.upstream.port, timeout=300,
                                         context=srv.ctx)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("connection", "keep-alive", "proxy-connection", "host")}
        up.request(self.command, self.path, body=body or None, headers=headers)
        resp = up.getresponse()
        with srv.lock:
            srv.seen.append((self.command, url.path, urllib.parse.parse_qs(url.query),
                             resp.status))
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



def classify(seen) -> set:
    """{(group, resource, verb, namespace, status)} as the API server's authorizer sees them."""
    out = set()
    for method, path, query, status in seen:
        if path.startswith(("/version", "/openapi")) or path in ("/api", "/apis"):
            continue    # discovery: allowed to every authenticated user
        watch = query.get("watch", [""])[0] in ("true", "True", "1")
        rule, namespaced = test_rbac._rule(method, path, watch)
        parts = path.strip("/").split("/")
        ns = parts[parts.index("namespaces") + 1] if namespaced else None
        out.add((*rule, ns, status))
    return out


def wait(what, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def world(kube_binaries):
    """Slurm (n1, n2: 4 CPUs, 4000 MB) and the control plane with the same
    nodes registered by their kubelets, the chart installed (CRD, RBAC, the
    webhook configuration); the ledger given to the coordinator's uid as
    hybrid.up gives it; no coordinator yet."""
    root = tempfile.mkdtemp(prefix="pyk8sres-rbac-live-")
    os.chmod(root, 0o755)          # the coordinator's uid reaches its files
    c = cluster.up(f"{root}/slurm", nodes=2, cpus=4, memory=4000, base_port=port(27900),
                   synced=True, slurm=SLURM, k8s_conf=hybrid.ledger_conf(f"{root}/slurm"),
                   gpus=GPUS)
    try:
        hybrid.confine(c)
        kube = hybrid.start_kubernetes(c.work, pick_ports(*KUBE_PORTS),
                                       {"n1": (4, 4000), "n2": (4, 4000)}, gpus=GPUS)
        yield c, kube, kube_calls.Kube(kube.kubeconfig)
    finally:
        hybrid.down(c.work)


@pytest.fixture
def recorded(world):
    """Strays for the daemons to clean up, then both daemons, each through
    its recording proxy with its ServiceAccount's token."""
    c, kube, direct = world
    # A GenericNode of no Slurm node, and one with a stale spec the sync
    # daemon must correct.
    direct.create_generic_node("ghost", {"alias": "ghost"}, {})
    direct.create_generic_node("n1", {"alias": "stale"}, {})
    proxies = {name: Recorder(kube.url, kube.ca_file) for name in ("sync", "webhook")}
    for p in proxies.values():
        threading.Thread(target=p.serve_forever, daemon=True).start()
    try:
        for name, account in (("sync", hybrid.SYNC_ACCOUNT), ("webhook", hybrid.WEBHOOK_ACCOUNT)):
            token = json.loads(Path(kube.service_account_kubeconfig(account, NAMESPACE))
                               .read_text())["users"][0]["user"]["token"]
            via = hybrid.own(pki.kubeconfig(
                f"{hybrid.coordinator_dir(c)}/{name}-via-proxy.kubeconfig", proxies[name].url,
                None, f"system:serviceaccount:{NAMESPACE}:{account}", token=token))
            # Node Events bumped within the scenario.
            config = hybrid.coordinator_config(c, kube, name, "event_update_seconds = 1.0\n"
                                               "metrics_seconds = 1.0\n")
            hybrid.start_coordinator(c, name, hybrid.coordinator_argv(
                c, kube, name, via, config, "--metrics-address", "127.0.0.1:0"))
        hybrid.wait_generic_nodes(kube, ["n1", "n2"], c)
        hybrid.wait_webhook(kube, c)
        # A placeholder pod of no shared node (its namespace is checked by the
        # webhook, which admits placeholders: made once the webhook answers).
        done(direct.core.create_namespaced_pod(
            PLACEHOLDERS, placeholder.pod("ghost", PLACEHOLDERS, 100, 1 << 20, (1000, 1 << 30)),
            _preload_content=False))
        yield proxies
    finally:
        for name in ("sync", "webhook"):
            cluster.stop_process(c.work, name)
        for p in proxies.values():
            p.shutdown()


def _pod(name, node=None, cpu="500m"):
    # Containers that stop at once (a forced delete then holds the share
    # only the test cluster's margin).
    spec = {"terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": "busybox",
                            "resources": {"requests": {"cpu": cpu, "memory": "100Mi"}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def placeholder_cpu(direct) -> dict:
    """node -> millicores its placeholder pods ask (by node: one pod per
    node or several, however the placeholders are cut)."""
    out: dict[str, int] = {}
    for p in kube_calls.list_namespace_pods(direct, PLACEHOLDERS):
        if placeholder.current(p) is not None:
            node = p["spec"]["nodeName"]
            out[node] = out.get(node, 0) + placeholder.current(p)[0]
    return out


def event_count(direct, ns, name, reason):
    evs = [e for e in kube_calls.list_events(direct, ns, f"involvedObject.name={name}")
           if e["reason"] == reason]
    return evs[0]["count"] if evs else 0


def _repairs_what_others_changed(direct) -> None:
    """The sync daemon deletes a stray GenericNode and corrects a stale
    spec; the webhook deletes a stray placeholder."""
    gns = lambda: set(direct.list_generic_nodes())          # noqa: E731
    wait("stray GenericNode deleted", lambda: "ghost" not in gns())
    wait("stale spec corrected", lambda: direct.list_generic_nodes()["n1"]["spec"]["alias"] == "n1")
    # Made by someone else, the stray is seen at the webhook's next relist of
    # its pods (placeholder.Placeholders relist_seconds, 30 s), not at once.
    wait("stray placeholder deleted", lambda: "ghost" not in placeholder_cpu(direct),
         timeout=RELIST_SECONDS + 15)


def _admits_counts_and_refuses(direct) -> None:
    """Pods bound by kube-scheduler and created on a node, and a refusal
    counted in its Event."""
    # A pod kube-scheduler binds through pods/binding (the webhook reads the
    # pod) and one created on a node; the sync daemon counts both.
    done(direct.core.create_namespaced_pod("default", _pod("bound"),
                                      _preload_content=False))
    wait("kube-scheduler bound the pod",
         lambda: (kube_calls.get_pod(direct, "default", "bound")["spec"].get("nodeName")))
    done(direct.core.create_namespaced_pod("default", _pod("direct", node="n2"),
                                      _preload_content=False))
    # A pod that does not fit is refused, twice (the refusal path): the
    # webhook posts an Event on it, then bumps its count.
    for _ in range(2):
        with pytest.raises(ApiException) as refused:
            direct.core.create_namespaced_pod("default", _pod("too-big", node="n1", cpu="64"),
                                              _preload_content=False)
        assert refused.value.status in (400, 403, 422) and "n1" in str(refused.value.body)
    wait("refusal Event counted twice",
         lambda: event_count(direct, "default", "too-big", "InsufficientSharedCapacity") == 2)


def _reports_oversubscription(c, direct) -> None:
    """The sync daemon's Oversubscribed Event on a GenericNode."""
    # n2 held beyond its capacity in the ledger (as pods bound without
    # admission would; set straight in the ledger, because the pod watch
    # through the recording proxy only delivers when it ends): the sync
    # daemon's next show() sees n2 oversubscribed and posts an Event on
    # GenericNode n2 (reading it for its UID), bumped a second later.  Its
    # repair (every repair_seconds) sets n2 back to the pods bound there, so
    # the test holds n2 over again whenever the repair came first.
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    n2_entries = lambda: {k: tuple(v) for k, v in                   # noqa: E731
                          ledger.show("n2")["nodes"]["n2"]["entries"].items()}
    held = n2_entries()

    def bumped_while_held_over():
        now = n2_entries()
        if "rbac-live-over" not in now:     # at first, and after each repair
            assert ledger.set("n2", {**now, "rbac-live-over": (8000, 1 << 20)}, 0)["oversubscribed"]
        return event_count(direct, "default", "n2", "Oversubscribed") >= 2
    try:
        wait("Oversubscribed Event bumped", bumped_while_held_over)
    finally:
        ledger.set("n2", held, 0)


def holder_claims(direct) -> list[str]:
    """The allocated holder claims (the GPUs Slurm's jobs hold)."""
    items = json.loads(direct.resource.list_namespaced_resource_claim(
        PLACEHOLDERS, _preload_content=False).data)["items"]
    return [c["metadata"]["name"] for c in items if (c.get("status") or {}).get("allocation")]


def _gpus_follow_jobs_and_claims(c, direct) -> None:
    """A job's GPU held by a holder claim (created, allocated; released
    when it ends: deallocated, then deleted), and a pod's claim allocated
    on a shared node (the webhook reads the node's ResourceSlices)."""
    job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-w", "n1",
                          "--gres=gpu:1", "--wrap", "sleep 300"], capture_output=True, text=True,
                         env=c.env, check=True).stdout.strip()
    wait("a holder claim for the job's GPU", lambda: holder_claims(direct), timeout=60)
    done(direct.resource.create_namespaced_resource_claim_template(
        "default", fake_gpus.claim_template("rbac-gpu"), _preload_content=False))
    pod = _pod("gpu", cpu="100m")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "n1"}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "rbac-gpu"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    done(direct.core.create_namespaced_pod("default", pod, _preload_content=False))
    wait("kube-scheduler bound the GPU pod",
         lambda: kube_calls.get_pod(direct, "default", "gpu")["spec"].get("nodeName"), timeout=60)
    subprocess.run(["scancel", job], env=c.env, check=True)
    wait("the holder claim released", lambda: not holder_claims(direct), timeout=60)
    done(direct.core.delete_namespaced_pod("gpu", "default", grace_period_seconds=0,
                                           _preload_content=False))


def _placeholders_follow_jobs(c, direct) -> None:
    """Placeholders grown, downsized in place and deleted as jobs come and go."""
    # Two 1-CPU jobs on n1 started in one scheduling pass (an array): one
    # placeholder pod grows for both; when the first ends it is downsized in
    # place (pods/resize, then read until the kubelet applied it); when the
    # second ends it is deleted.
    job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-w", "n1", "-c", "1",
                          "--array=0-1", "--wrap", "sleep $((4 + 6 * SLURM_ARRAY_TASK_ID))"],
                         capture_output=True, text=True, env=c.env, check=True).stdout.strip()
    wait("placeholders grown for both jobs", lambda: placeholder_cpu(direct).get("n1", 0) >= 2000)
    wait("placeholders follow the first job's end",
         lambda: placeholder_cpu(direct).get("n1", 0) == 1000, timeout=30)
    wait("jobs ended", lambda: not subprocess.run(
        ["squeue", "-h", "-j", job], capture_output=True, text=True, env=c.env).stdout.strip(),
        timeout=30)
    wait("placeholders back to 0", lambda: max(placeholder_cpu(direct).values(), default=0) == 0)
    kube_calls.delete_pod(direct, "default", "bound")


def _webhook_configuration_repaired(kas, direct) -> None:
    """Someone edits the webhook configuration: the webhook puts its
    shared-node condition back (an update of what it created at start)."""
    def condition():
        cfg = kube_calls.get_webhook_config(direct, "pyk8sres-admission")
        return next(c["expression"] for c in cfg["webhooks"][0]["matchConditions"]
                    if c["name"] == "shared-node")
    published = condition()
    assert published != "true"
    kas.kubectl("patch", "validatingwebhookconfiguration", "pyk8sres-admission", "--type=json",
                "-p", json.dumps([{"op": "replace", "path": "/webhooks/0/matchConditions",
                                   "value": [{"name": "shared-node", "expression": "true"}]}]))
    wait("webhook configuration repaired", lambda: condition() == published, timeout=30)


def test_requests_made_are_exactly_the_derived_calls_and_granted(world, recorded):
    c, kas, direct = world
    proxies = recorded
    _repairs_what_others_changed(direct)
    _admits_counts_and_refuses(direct)
    _reports_oversubscription(c, direct)
    _placeholders_follow_jobs(c, direct)
    _gpus_follow_jobs_and_claims(c, direct)
    _webhook_configuration_repaired(kas, direct)
    time.sleep(3)          # a few more reconcile and refresh cycles
    for name in ("sync", "webhook"):
        cluster.stop_process(c.work, name)

    calls = test_rbac.code_calls()
    grants = test_rbac.granted([d for d in yaml.safe_load_all(rbac_manifest(kas).read_text()) if d])
    for daemon, account in (("sync", "pyk8sres-sync"), ("webhook", "pyk8sres-webhook")):
        answered = classify(proxies[daemon].seen)
        denied = {r for a, r in test_rbac.DENIED_ON_PURPOSE if a == account}
        # RBAC is enforced: the API server refused the CRD check (meant to be
        # refused: "the admin applied it"), and nothing else.
        refused = {(g, r, v) for g, r, v, ns, status in answered if status == 403}
        assert refused == {r for r in denied if r[2] == "get"}, (account, refused)
        assert not [a for a in answered if a[4] == 401], account
        seen = {a[:4] for a in answered}
        cluster_wide, local = grants[account]
        for group, resource, verb, ns in seen:
            rule = (group, resource, verb)
            assert rule in cluster_wide or rule in denied or \
                (ns == PLACEHOLDERS and rule in local), f"{account}: {rule} in {ns} not granted"
        code_cluster, code_local = calls[account]
        # The CRD check is refused (403: "the admin applied it"), so its
        # create never comes: leave those calls out on both sides.
        code_cluster = code_cluster - denied
        seen = {s for s in seen if s[:3] not in denied}
        seen_cluster = {(g, r, v) for g, r, v, ns in seen
                        if not (ns == PLACEHOLDERS and (g, r, v) in code_local)}
        seen_local = {(g, r, v) for g, r, v, ns in seen
                      if ns == PLACEHOLDERS and (g, r, v) in code_local}
        # Both ways: the static derivation misses nothing that happens, and
        # this scenario took every call it derived.
        assert seen_cluster == code_cluster, (account, seen_cluster ^ code_cluster)
        assert seen_local == code_local, (account, seen_local ^ code_local)


# ----------------------------------------------------------------- a grant taken away

def without_verb(kube, role: str, resource: str, verb: str) -> None:
    """As the admin: ClusterRole `role` of the chart less `verb` on
    `resource` (as an admin's mistake or a stale manifest would leave it)."""
    docs = [d for d in yaml.safe_load_all(rbac_manifest(kube).read_text()) if d]
    doc = copy.deepcopy(next(d for d in docs if d["kind"] == "ClusterRole"
                             and d["metadata"]["name"] == role))
    rules = []
    for rule in doc["rules"]:
        if resource in rule["resources"]:
            assert verb in rule["verbs"], (role, rule)
            others = [r for r in rule["resources"] if r != resource]
            if others:    # the rule's other resources keep every verb
                rules.append({**rule, "resources": others})
            rule = {**rule, "resources": [resource],
                    "verbs": [v for v in rule["verbs"] if v != verb]}
        if rule["verbs"]:                                  # a rule needs a verb
            rules.append(rule)
    doc["rules"] = rules
    kube.kubectl("apply", "-f", "-", input=json.dumps(doc))
    kind, _, sub = resource.partition("/")
    assert kube.kubectl("auth", "can-i", verb, kind, *(["--subresource", sub] if sub else []),
                        "-A", "--as", f"system:serviceaccount:{NAMESPACE}:{role}",
                        check=False).stdout.strip() == "no"


def readyz(port_) -> tuple[int, str]:
    """(status, body) of a daemon's /readyz; (0, why) while it does not listen yet."""
    try:
        return http_get(f"http://127.0.0.1:{port_}/readyz")
    except OSError as e:
        return 0, str(e)


def log_of(c, name) -> str:
    with open(f"{c.work}/log/{name}.out", errors="replace") as f:
        return f.read()


def share(ledger, node) -> dict:
    """The pods' entries the ledger holds on `node` (inside slurmctld)."""
    return ledger.show(node)["nodes"][node]["entries"]


def k8s_used(c, node) -> tuple[int, int]:
    """Slurm's own word (scontrol show node): k8scpu/k8smemory allocated."""
    n = slurm_calls.get_node(node)
    return n.gres_used.get("k8scpu", 0), n.gres_used.get("k8smemory", 0)


@pytest.fixture
def coordinator(world):
    """Both daemons as `cluster up --kubernetes` runs them (their
    ServiceAccounts' tokens), ready; the chart's RBAC as shipped again afterwards."""
    c, kube, direct = world
    os.environ["SLURM_CONF"] = c.conf
    for p in kube_calls.list_pods(direct, "default"):      # what an earlier test left
        kube_calls.delete_pod(direct, "default", p["metadata"]["name"])
    # Deleted while no sync ran: a sync started now would hold their shares
    # for a grace period (nobody saw their containers stop).  Emptied by hand.
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    try:
        for n in ("n1", "n2"):
            for key in share(ledger, n):
                assert ledger.release(n, key)["ok"]
    finally:
        ledger.close()
    hybrid.start_sync(c, kube)
    hybrid.wait_generic_nodes(kube, ["n1", "n2"], c)
    hybrid.start_webhook(c, kube)
    hybrid.wait_webhook(kube, c)
    for p in (kube.ports.sync_metrics, kube.ports.webhook_metrics):
        wait(f"readyz on {p}", lambda: readyz(p) == (200, "ok\n"), 60)
    wait("no pod's share on n1, n2", lambda: all(k8s_used(c, n) == (0, 0) for n in ("n1", "n2")))
    try:
        yield c, kube, direct
    finally:
        kube.apply(rbac_manifest(kube))
        for name in ("sync", "webhook"):
            cluster.stop_process(c.work, name)
        for p in kube_calls.list_pods(direct, "default"):
            kube_calls.delete_pod(direct, "default", p["metadata"]["name"])


def _webhook_without_get_pods(c, kube, direct, ledger, before) -> tuple[str, str]:
    """The webhook may no longer read pods: the pod kube-scheduler tries to
    bind to a shared node is refused every time (fail closed), and the
    webhook says which grant it lacks.  Given back, the pod binds: its
    (node, uid)."""
    hook = kube.ports.webhook_metrics
    without_verb(kube, hybrid.WEBHOOK_ACCOUNT, "pods", "get")
    done(direct.core.create_namespaced_pod("default", _pod("w", cpu="1"),
                                      _preload_content=False))
    code, body = None, ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (code == 503 and "get pods" in body):
        code, body = readyz(hook)
        time.sleep(0.2)
    assert code == 503 and "permissions: forbidden by RBAC: get pods" in body, body
    for _ in range(25):        # 5 s of kube-scheduler's retries (backoff 1-10 s)
        pod = kube_calls.get_pod(direct, "default", "w")
        assert not pod["spec"].get("nodeName"), "admitted without its pod read"
        assert all(pod["metadata"]["uid"] not in share(ledger, n) for n in ("n1", "n2"))
        assert {n: k8s_used(c, n) for n in ("n1", "n2")} == before
        time.sleep(0.2)
    text = log_of(c, "webhook")
    assert "Kubernetes RBAC refuses get pods in namespace default" in text
    assert 'cannot get resource \\"pods\\"' not in text       # one line, not the raw body
    assert 'cannot get resource "pods"' in text
    # Given back: kube-scheduler's next retry binds it; the webhook is ready again.
    kube.apply(rbac_manifest(kube))
    wait("the pod bound once the grant is back",
         lambda: kube_calls.get_pod(direct, "default", "w")["spec"].get("nodeName"), 30)
    node = kube_calls.get_pod(direct, "default", "w")["spec"]["nodeName"]
    uid = kube_calls.get_pod(direct, "default", "w")["metadata"]["uid"]
    assert uid in share(ledger, node)
    wait("webhook ready again", lambda: readyz(hook) == (200, "ok\n"))
    assert "Kubernetes RBAC now allows get pods in namespace default" in log_of(c, "webhook")
    wait("sync holds the pod", lambda: k8s_used(c, node) == (before[node][0] + 1,
                                                             before[node][1] + 100))
    return node, uid


def _sync_without_list_pods(c, kube, direct, ledger, before, node, uid) -> None:
    """sync restarted with a role that may not list pods: it cannot know
    which pods are gone, so it lowers no share -- not even for a pod
    deleted meanwhile -- and says why it is not ready."""
    sync = kube.ports.sync_metrics
    cluster.stop_process(c.work, "sync")
    without_verb(kube, hybrid.SYNC_ACCOUNT, "pods", "list")
    kube_calls.delete_pod(direct, "default", "w")
    assert kube_calls.get_pod(direct, "default", "w") is None           # gone from the API server
    hybrid.start_sync(c, kube)
    wait("sync says it may not list pods", lambda: (lambda r: r[0] == 503 and
                                                     "list pods" in r[1])(readyz(sync)))
    code, body = readyz(sync)
    assert "permissions: forbidden by RBAC: list pods" in body, body
    assert "watches: pods" in body, body
    for _ in range(25):
        assert uid in share(ledger, node)                      # still held
        assert k8s_used(c, node) == (before[node][0] + 1, before[node][1] + 100)
        time.sleep(0.2)
    assert "Kubernetes RBAC refuses list pods" in log_of(c, "sync")
    kube.apply(rbac_manifest(kube))
    wait("share lowered once sync may list pods again",
         lambda: uid not in share(ledger, node) and k8s_used(c, node) == before[node], 60)
    wait("sync ready again", lambda: readyz(sync) == (200, "ok\n"), 30)


def _sync_without_generic_node_status(c, kube, direct, before) -> None:
    """sync may no longer patch GenericNodes' status: what the ledger holds
    still follows the pods (nothing else needs that grant), the GenericNode
    does not, and sync says so."""
    sync = kube.ports.sync_metrics
    without_verb(kube, hybrid.SYNC_ACCOUNT, "genericnodes/status", "patch")
    kube_calls.create_pod(direct, "default", _pod("g", node="n2", cpu="1"))
    wait("n2's share follows the pod", lambda: k8s_used(c, "n2") == (before["n2"][0] + 1,
                                                                     before["n2"][1] + 100))
    wait("sync says it may not patch GenericNode status", lambda: (lambda r: r[0] == 503 and
         "patch genericnodes/status (API group pyk8sres.io)" in r[1])(readyz(sync)))

    def kubernetes_side():
        gn = direct.list_generic_nodes()["n2"]
        return next(a["allocated"] for a in gn["status"]["allocatedResources"]
                    if a["type"] == "Kubernetes")
    assert kubernetes_side() == {"cpu": "0", "memory": "0"}
    kube.apply(rbac_manifest(kube))
    wait("GenericNode n2 current again",
         lambda: kubernetes_side() == {"cpu": "1", "memory": "100Mi"}, 30)
    wait("sync ready again", lambda: readyz(sync) == (200, "ok\n"), 30)


def test_a_verb_taken_away_fails_closed_and_is_named(coordinator):
    c, kube, direct = coordinator
    ledger = slurm_calls.Ledger(slurm_calls.ledger_socket_path(c.conf))
    before = {"n1": (0, 0), "n2": (0, 0)}      # the coordinator fixture waited for it
    node, uid = _webhook_without_get_pods(c, kube, direct, ledger, before)
    _sync_without_list_pods(c, kube, direct, ledger, before, node, uid)
    _sync_without_generic_node_status(c, kube, direct, before)
