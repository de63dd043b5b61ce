"""The Kubernetes half of the test cluster: the real control plane, built from
upstream Go modules by kube/build.sh, on loopback ports of its own.

    etcd                     data under WORK/etcd
    kube-apiserver           HTTPS, client-certificate and ServiceAccount-token
                             authentication, Node,RBAC authorization, the stock
                             admission chain plus NodeRestriction; it calls
                             admission webhooks with a client certificate
    kube-controller-manager  and kube-scheduler (its default profile, as shipped)
    kwok                     the kubelet of every node (kube/kwok.yaml)

Identities (kubeconfigs under WORK/kubeconfig/): admin (system:masters),
developer (edit in namespace default only), one per kubelet
(system:node:<name>), and ServiceAccount tokens on demand.

Every process is recorded in WORK/run/*.pid and stopped by that PID.
"""
from __future__ import annotations

import dataclasses
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from .. import data
from . import daemons, pki
from .slurm_conf import port_free

HOST = "127.0.0.1"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
DEVELOPER_NAMESPACE = "default"
WEBHOOK_CLIENT = "kube-apiserver"       # the identity the API server shows a webhook
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class KubeError(RuntimeError):
    """A component failed to build or start (the message names its log)."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    kube_apiserver: str
    kube_controller_manager: str
    kube_scheduler: str
    kubectl: str
    etcd: str
    kwok: str
    helm: str
    helm_unittest: str


def build() -> Binaries:
    """kube/build.sh (cached: seconds once built)."""
    proc = subprocess.run(["bash", str(data.path("kube", "build.sh"))], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
        raise KubeError(f"kube/build.sh failed (exit {proc.returncode}):\n{tail}")
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    try:
        return Binaries(**{f.name: found[f.name.replace("_", "-")]
                           for f in dataclasses.fields(Binaries)})
    except KeyError as e:
        raise KubeError(f"kube/build.sh printed no {e} path:\n{proc.stdout}") from None


@dataclasses.dataclass(frozen=True)
class Ports:
    """The control plane's ports from `base` on (the coordinator's too: the
    test cluster starts it beside)."""
    base: int

    apiserver = property(lambda self: self.base)
    etcd = property(lambda self: self.base + 1)
    etcd_peer = property(lambda self: self.base + 2)
    webhook = property(lambda self: self.base + 3)
    sync_metrics = property(lambda self: self.base + 4)
    webhook_metrics = property(lambda self: self.base + 5)
    controller_manager = property(lambda self: self.base + 6)
    scheduler = property(lambda self: self.base + 7)
    kwok = property(lambda self: self.base + 8)

    def all(self) -> list[int]:
        return list(range(self.base, self.base + 9))


def node_object(name: str, cpus: int, memory_mb: int, pods: int = 110) -> dict:
    """A Node as its kubelet registers it; kwok plays that kubelet."""
    resources = {"cpu": str(cpus), "memory": f"{memory_mb}Mi", "pods": str(pods)}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok"}},
            "status": {"capacity": resources, "allocatable": resources}}


class ControlPlane:
    """The control plane living in `work` (pki/, etcd/, kubeconfig/, run/, log/)."""

    def __init__(self, work: str, port: int, binaries: Binaries | None = None):
        self.work = os.path.abspath(work)
        self.ports = Ports(port)
        self.bin = binaries
        self.url = f"https://{HOST}:{self.ports.apiserver}"
        self.pki_dir = os.path.join(self.work, "pki")
        self.kubeconfig_dir = os.path.join(self.work, "kubeconfig")
        self.ca_file = os.path.join(self.pki_dir, "ca.crt")

    # -- paths and identities -------------------------------------------------
    @property
    def kubeconfig(self) -> str:
        """The admin's kubeconfig."""
        return self.identity("admin")

    def identity(self, name: str) -> str:
        return os.path.join(self.kubeconfig_dir, f"{name}.kubeconfig")

    def node_identity(self, node: str) -> str:
        return self.identity(f"node-{node}")

    @property
    def webhook_client_ca(self) -> str:
        """The CA a webhook must trust to know the API server's client certificate."""
        return os.path.join(self.pki_dir, "webhook-client-ca.crt")

    # -- lifecycle ------------------------------------------------------------
    def start(self, webhook_urls: tuple[str, ...] = (), timeout: float = 60) -> "ControlPlane":
        """Start every component; webhook_urls: the admission webhooks the
        API server will call (host:port of each gets its client certificate)."""
        taken = [p for p in self.ports.all() if not port_free(p)]
        if taken:
            raise KubeError(f"port(s) {', '.join(map(str, taken))} already in use: "
                            "choose another --kube-port")
        self.bin = self.bin or build()
        for sub in ("run", "log", "etcd", "config"):
            os.makedirs(os.path.join(self.work, sub), exist_ok=True)
        os.makedirs(self.kubeconfig_dir, mode=0o700, exist_ok=True)
        self._credentials(webhook_urls)
        try:
            self.start_etcd(timeout)
            self.start_apiserver(timeout)
            self.apply(data.path("kube", "bootstrap.yaml"))
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                self.start_component(name, timeout)
            self._wait("kube-controller-manager", self._settled, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _credentials(self, webhook_urls) -> None:
        ca = pki.Authority(self.pki_dir, "ca", "pyk8sres test cluster CA")
        serving = ca.issue("apiserver", "kube-apiserver", server_names=(
            HOST, "localhost", "10.96.0.1", "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"), client=False)
        pki.signing_key(self.pki_dir)
        users = {"admin": ("kubernetes-admin", ["system:masters"]),
                 "kube-controller-manager": ("system:kube-controller-manager", []),
                 "kube-scheduler": ("system:kube-scheduler", []),
                 "kwok": ("kwok-controller", []),
                 "developer": ("developer", [])}
        for name, (cn, groups) in users.items():
            pki.kubeconfig(self.identity(name), self.url, self.ca_file, cn,
                           cert=ca.issue(name, cn, groups))
        hook_ca = pki.Authority(self.pki_dir, "webhook-client-ca", "pyk8sres webhook client CA")
        hook_cert = hook_ca.issue("webhook-client", WEBHOOK_CLIENT)
        self._admission_config(webhook_urls, hook_cert)
        self.serving = serving

    def _admission_config(self, webhook_urls, cert: tuple[str, str]) -> None:
        """AdmissionConfiguration: the API server presents `cert` to each
        webhook in webhook_urls (matched by host:port)."""
        users = [{"name": u, "user": {"client-certificate": cert[0], "client-key": cert[1]}}
                 for u in webhook_urls]
        kubeconfig = os.path.join(self.work, "config", "webhook-client.kubeconfig")
        with open(kubeconfig, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "users": users}, f, indent=1)
        plugin = {"apiVersion": "apiserver.config.k8s.io/v1",
                  "kind": "WebhookAdmissionConfiguration", "kubeConfigFile": kubeconfig}
        with open(os.path.join(self.work, "config", "admission.json"), "w") as f:
            json.dump({"apiVersion": "apiserver.config.k8s.io/v1",
                       "kind": "AdmissionConfiguration",
                       "plugins": [{"name": n, "configuration": plugin} for n in
                                   ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")]},
                      f, indent=1)

    def _argv(self, name: str) -> list[str]:
        p, w = self.ports, self.work
        if name == "etcd":
            peer, client = f"http://{HOST}:{p.etcd_peer}", f"http://{HOST}:{p.etcd}"
            return [self.bin.etcd, "--name", "default", "--data-dir", f"{w}/etcd",
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"default={peer}", "--log-level", "warn",
                    "--unsafe-no-fsync"]   # test data: speed over power-loss durability
        if name == "kube-apiserver":
            k = self.pki_dir
            return [self.bin.kube_apiserver, f"--bind-address={HOST}",
                    f"--advertise-address={HOST}", f"--secure-port={p.apiserver}",
                    f"--etcd-servers=http://{HOST}:{p.etcd}",
                    f"--tls-cert-file={k}/apiserver.crt", f"--tls-private-key-file={k}/apiserver.key",
                    f"--client-ca-file={k}/ca.crt",
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-account-key-file={k}/sa.pub",
                    f"--service-account-signing-key-file={k}/sa.key",
                    "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                    f"--admission-control-config-file={w}/config/admission.json",
                    "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
                    f"--cert-dir={w}/config", "--profiling=false",
                    "--etcd-compaction-interval=5m"]
        common = [f"--bind-address={HOST}", f"--cert-dir={w}/config/{name}", "--leader-elect=false"]
        if name == "kube-controller-manager":
            kc = self.identity(name)
            return [self.bin.kube_controller_manager, f"--kubeconfig={kc}",
                    f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                    f"--secure-port={p.controller_manager}", *common,
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={self.pki_dir}/sa.key",
                    f"--root-ca-file={self.ca_file}", "--cluster-name=pyk8sres",
                    "--node-monitor-grace-period=20s", "--node-monitor-period=2s"]
        if name == "kube-scheduler":
            kc = self.identity(name)
            return [self.bin.kube_scheduler, f"--kubeconfig={kc}",
                    f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                    f"--secure-port={p.scheduler}", *common]
        if name == "kwok":
            return [self.bin.kwok, f"--kubeconfig={self.identity('kwok')}",
                    f"--config={data.path('kube', 'kwok.yaml')}",
                    f"--server-address={HOST}:{p.kwok}"]
        raise KeyError(name)

    def _settled(self) -> bool:
        """What a user expects of a fresh cluster is there: the aggregated
        `edit` role (kube-controller-manager fills it) and namespace
        default's ServiceAccount."""
        can = self.kubectl("auth", "can-i", "create", "pods", "-n", DEVELOPER_NAMESPACE,
                           identity="developer", check=False).stdout.strip()
        sa = self.kubectl("get", "serviceaccount", "default", "-n", DEVELOPER_NAMESPACE,
                          "-o", "name", check=False).returncode
        return can == "yes" and sa == 0

    def _health_url(self, name: str) -> str | None:
        port = {"kube-apiserver": self.ports.apiserver, "kube-controller-manager":
                self.ports.controller_manager, "kube-scheduler": self.ports.scheduler}.get(name)
        return f"https://{HOST}:{port}/healthz" if port else None

    def start_etcd(self, timeout: float = 60) -> None:
        self._spawn("etcd")
        self._wait("etcd", lambda: _get(f"http://{HOST}:{self.ports.etcd}/health", None), timeout)

    def start_apiserver(self, timeout: float = 60) -> None:
        self._spawn("kube-apiserver")
        self._wait("kube-apiserver", lambda: _get(f"{self.url}/readyz", self.ca_file), timeout)

    def start_component(self, name: str, timeout: float = 60) -> None:
        """kube-controller-manager, kube-scheduler or kwok."""
        self._spawn(name)
        url = self._health_url(name)
        if url:  # their own self-signed serving certificates: liveness only
            self._wait(name, lambda: _get(url, None), timeout)

    def _spawn(self, name: str) -> None:
        daemons.start_process(self.work, name, self._argv(name))

    def _wait(self, name: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running(name):
                raise KubeError(f"{name} exited; its log {self.log_path(name)} ends:\n"
                                + self.log_tail(name))
            if ready():
                return
            time.sleep(0.1)
        raise KubeError(f"{name} was not ready after {timeout:.0f} s; its log "
                        f"{self.log_path(name)} ends:\n{self.log_tail(name)}")

    def log_path(self, name: str) -> str:
        return os.path.join(self.work, "log", f"{name}.out")

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(self.log_path(name), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def running(self, name: str) -> bool:
        try:
            with open(os.path.join(self.work, "run", f"proc-{name}.pid")) as f:
                return daemons.alive(int(f.read()))
        except (OSError, ValueError):
            return False

    def stop_component(self, name: str) -> bool:
        return daemons.stop_process(self.work, name)

    def restart(self, name: str, timeout: float = 60) -> None:
        self.stop_component(name)
        {"etcd": self.start_etcd, "kube-apiserver": self.start_apiserver}.get(
            name, lambda t: self.start_component(name, t))(timeout)

    def stop(self) -> list[str]:
        """Stop every component, clients first, by PID."""
        return [name for name in reversed(COMPONENTS) if self.stop_component(name)]

    # -- using it -------------------------------------------------------------
    def kubectl(self, *args: str, identity: str = "admin", check: bool = True,
                timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.bin.kubectl, "--kubeconfig", self.identity(identity), *args],
                              capture_output=True, text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise KubeError(f"kubectl {' '.join(args)} (as {identity}) failed: "
                            f"{proc.stderr.strip()}")
        return proc

    def apply(self, path, timeout: float = 30) -> list[str]:
        """kubectl apply -f path as admin; waits until CRDs are Established."""
        names = self.kubectl("apply", "-f", str(path), "-o", "name").stdout.split()
        crds = [n for n in names if n.startswith("customresourcedefinition")]
        if crds:
            self.kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s",
                         *crds, timeout=timeout + 10)
        return names

    def register_nodes(self, nodes: dict[str, tuple[int, int]], timeout: float = 60) -> None:
        """Each node registers as its own kubelet would (system:node:<name>,
        NodeRestriction applies), with {name: (CPUs, MB)}; returns once kwok
        reports them Ready."""
        ca = pki.Authority(self.pki_dir, "ca", "pyk8sres test cluster CA")
        for name, (cpus, memory) in nodes.items():
            cn = f"system:node:{name}"
            pki.kubeconfig(self.node_identity(name), self.url, self.ca_file, cn,
                           cert=ca.issue(f"node-{name}", cn, ["system:nodes"]))
            self.kubectl("create", "-f", "-", identity=f"node-{name}",
                         input=json.dumps(node_object(name, cpus, memory)))
        self.wait_nodes_ready(list(nodes), timeout)

    def create_nodes(self, nodes: dict[str, tuple[int, int]], chunk: int = 500,
                     budget: int | None = None, timeout: float = 600) -> float:
        """Many kwok nodes at once (the scale nodes): created by the admin
        in lists of `chunk`, not one kubelet identity each.  With `budget`
        (bytes the control plane may still grow by), the growth of the
        control plane's resident memory per node is measured after every
        list; before it would pass the budget, KubeError says how many
        nodes fit.  Returns the measured bytes per node (0 if not measured)."""
        names = list(nodes)
        base = self.rss()
        per_node = 0.0
        for start in range(0, len(names), chunk):
            if budget is not None and start and per_node * len(names) > budget:
                raise KubeError(
                    f"{len(names)} kwok nodes would need ~{per_node * len(names) / 2**30:.1f} GiB "
                    f"in the control plane at the measured {per_node / 2**10:.0f} KiB per node "
                    f"(after {start}); only {budget / 2**30:.1f} GiB may be used: at most "
                    f"{int(budget // per_node)} nodes fit on this machine")
            items = [node_object(n, *nodes[n]) for n in names[start:start + chunk]]
            self.kubectl("create", "-f", "-", timeout=timeout,
                         input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
            grown = self.rss() - base
            per_node = grown / (start + len(items)) if grown > 0 else per_node
        self.wait_nodes_ready(names, timeout)
        return per_node

    def pid(self, name: str) -> int | None:
        try:
            with open(os.path.join(self.work, "run", f"proc-{name}.pid")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def rss(self) -> int:
        """Resident memory of the control plane's processes, in bytes."""
        total = 0
        for name in COMPONENTS:
            pid = self.pid(name)
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += int(f.read().split("VmRSS:")[1].split()[0]) * 1024
            except (OSError, IndexError, TypeError, ValueError):
                pass
        return total

    def wait_nodes_ready(self, names: list[str], timeout: float = 60) -> None:
        def ready() -> bool:
            out = self.kubectl("get", "nodes", "-o", "jsonpath={range .items[*]}{.metadata.name}="
                               "{.status.conditions[?(@.type==\"Ready\")].status} {end}").stdout
            states = dict(kv.split("=", 1) for kv in out.split())
            return all(states.get(n) == "True" for n in names)
        self._wait("kwok", ready, timeout)

    def service_account_kubeconfig(self, name: str, namespace: str,
                                   hours: int = 8760) -> str:
        """A kubeconfig holding a token of ServiceAccount namespace/name
        (TokenRequest, as `kubectl create token`)."""
        token = self.kubectl("create", "token", name, "-n", namespace,
                             f"--duration={hours}h").stdout.strip()
        return pki.kubeconfig(self.identity(f"sa-{namespace}-{name}"), self.url, self.ca_file,
                              f"system:serviceaccount:{namespace}:{name}", token=token)


def _get(url: str, ca_file: str | None) -> bool:
    """True if GET url answers 200 (ca_file None: the server's own
    self-signed certificate, for liveness probes only)."""
    ctx = ssl.create_default_context(cafile=ca_file) if ca_file else ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
