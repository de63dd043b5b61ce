"""`pyk8sres cluster up --kubernetes`: the local Slurm cluster plus the real
Kubernetes control plane (kubernetes.py), one kwok-simulated Kubernetes node
per Slurm node (same name and size), the Helm chart installed as a site
installs it for a coordinator outside the cluster (chart.py: the GenericNode
CRD, the coordinator's RBAC, the webhook configuration and its certificate,
the placeholders' namespace), and the coordinator itself: `pyk8sres sync`
and `pyk8sres webhook` (with its placeholder pods), each with its own
ServiceAccount's token, never as admin.

Both daemons run as the coordinator's own uid (`pyk8sres`, made by
tools/install-deps.sh), as a site runs them: listed in LedgerUsers=, the
ledger socket in a directory of its own (WORK/ledger, SlurmUser:pyk8sres
0750), StateSaveLocation private to SlurmUser, the munge key unreadable
(munged's socket reachable: sync runs scontrol), and their own files
(kubeconfigs, the webhook's certificate, the API server's client CA) in
WORK/coordinator, theirs alone.

Ports from --kube-port on: kubernetes.Ports.  Every process is recorded under
WORK (run/*.pid, kube/run/*.pid) and stopped by PID in `down`.
"""
from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import time
import urllib.request
from importlib import metadata

import pyk8sres
from .. import data, install
from ..coordinator.slurm import ledger_socket_path
from . import chart, cluster, kubernetes, pki, slurm_conf
from . import gpus as fake_gpus

NAMESPACE = chart.NAMESPACE
SYNC_ACCOUNT, WEBHOOK_ACCOUNT = "pyk8sres-sync", "pyk8sres-webhook"
COORDINATOR_USER = "pyk8sres"
LEDGER_SOCKET = "k8s_resources.socket"


def coordinator_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(COORDINATOR_USER)
    except KeyError:
        raise cluster.ClusterError(
            f"user {COORDINATOR_USER} does not exist: the coordinator runs as its own uid "
            "(tools/install-deps.sh creates it)") from None


def _ledger_group(slurm_user: str) -> int:
    """LedgerGroup=: the coordinator's group.  slurmctld gives the socket
    that group, so a SlurmUser other than root must be a member (slurmctld
    takes SlurmUser's groups from /etc/group: initgroups)."""
    me = coordinator_user()
    if slurm_user != "root" and slurm_user not in grp.getgrgid(me.pw_gid).gr_mem:
        raise cluster.ClusterError(
            f"SlurmUser {slurm_user} is not in group {COORDINATOR_USER} (LedgerGroup): "
            f"usermod -a -G {COORDINATOR_USER} {slurm_user} (tools/install-deps.sh does)")
    return me.pw_gid


def ledger_conf(work: str, slurm_user: str = "root", more_users: tuple = ()) -> str:
    """k8s_resources.conf lines that give the coordinator's uid (and
    `more_users`: uids a test lets call too) the ledger and nothing else,
    and its socket directory (made here: SlurmUser's, group pyk8sres, 0750)."""
    me = coordinator_user()
    directory = os.path.join(os.path.abspath(work), "ledger")
    os.makedirs(directory, exist_ok=True)
    os.chown(directory, pwd.getpwnam(slurm_user).pw_uid, me.pw_gid)
    os.chmod(directory, 0o750)
    users = ",".join(str(u) for u in (me.pw_uid, *more_users))
    return (f"LedgerUsers={users}\nLedgerGroup={_ledger_group(slurm_user)}\n"
            f"LedgerSocket={directory}/{LEDGER_SOCKET}\n")


def up(work: str, *, nodes: int, cpus: int, memory: int, base_port: int, kube_port: int,
       node_features: bool | None = None, extra_conf: str = "", k8s_conf: str = "",
       slurm: str | None = None, auth: str = "auto", slurmd: bool = True,
       accounting: bool = False, rest: bool = False, coordinator: bool = True,
       scale_nodes: int = 0, coordinator_path: str | None = None, ledger_users: tuple = (),
       **layout) -> tuple[cluster.Cluster, kubernetes.ControlPlane]:
    """slurmd=False: nodes in slurm.conf only (benchmarks); coordinator=False
    leaves sync and the webhook to the caller (start_sync, start_webhook);
    `layout`: sockets / cores_per_socket / threads_per_core / node_sizes /
    gpus / slurm_user, as cluster.up.  ledger_users: more uids that may
    call the ledger (in group pyk8sres to reach its socket).
    scale_nodes: N more Slurm nodes without slurmd (cluster.up), each also a
    kwok node of the same name and size (created in bulk; refused before
    the memory runs out, at the control plane's measured cost per node).
    coordinator_path: run sync and the webhook from the pyk8sres package in
    this directory (a benchmark's baseline build), not a copy of this one."""
    sizes = layout.get("node_sizes") or [(cpus, memory)] * nodes
    slurm_user = layout.get("slurm_user", "root")
    if scale_nodes:
        per_node = slurm_conf.SLURMCTLD_BYTES_PER_NODE + slurm_conf.KUBE_BYTES_PER_NODE
        slurm_conf.check_memory(scale_nodes, per_node, slurm_conf.available_memory(),
                                "slurmctld and the Kubernetes control plane")
    os.makedirs(work, exist_ok=True)
    blocked = install.unreadable_by_others(os.path.abspath(work))
    if blocked:
        raise cluster.ClusterError(f"{blocked} cannot be entered by {COORDINATOR_USER}, whom the "
                                   "coordinator runs as: use a work directory others can "
                                   "traverse (e.g. under /tmp)")
    k8s_conf = ledger_conf(work, slurm_user, ledger_users) + k8s_conf
    c = cluster.up(work, nodes=nodes, cpus=cpus, memory=memory, base_port=base_port,
                   node_features=node_features, synced=True, extra_conf=extra_conf,
                   k8s_conf=k8s_conf, slurm=slurm, auth=auth, slurmd=slurmd,
                   accounting=accounting, rest=rest, scale_nodes=scale_nodes, **layout)
    names = slurm_conf.node_names(nodes) + slurm_conf.scale_names(scale_nodes)
    try:
        confine(c)
        kube = start_kubernetes(c.work, kube_port, dict(zip(slurm_conf.node_names(nodes), sizes)),
                                gpus=layout.get("gpus", 0))
        if scale_nodes:
            budget = int(slurm_conf.available_memory() * slurm_conf.MEMORY_HEADROOM)
            kube.create_nodes({n: (cpus, memory) for n in slurm_conf.scale_names(scale_nodes)},
                              budget=budget)
        if coordinator:
            start_sync(c, kube, path=coordinator_path)
            wait_generic_nodes(kube, names, c, timeout=30 + scale_nodes / 5)
            start_webhook(c, kube, path=coordinator_path)
            wait_webhook(kube, c)
    except BaseException:
        down(work)
        raise
    return c, kube


def confine(c: cluster.Cluster) -> None:
    """What the coordinator's uid may reach of Slurm's: munged's socket (its
    scontrol authenticates), never the key (root's, 0400) nor
    StateSaveLocation (the journal, job scripts: SlurmUser's, 0700)."""
    with open(c.conf, encoding="utf-8") as f:
        if "AuthType=auth/slurm" in f.read():
            raise cluster.ClusterError(
                f"auth/slurm: the coordinator's uid ({COORDINATOR_USER}) cannot read the key its "
                "scontrol would need: use munge (apt-get install munge)")
    os.chmod(os.path.join(c.work, "munge"), 0o711)
    os.chmod(os.path.join(c.work, "state"), 0o700)


def webhook_url(kube: kubernetes.ControlPlane) -> str:
    """Where the API server calls the coordinator's webhook (a host process)."""
    return f"https://127.0.0.1:{kube.ports.webhook}/validate"


def start_kubernetes(work: str, kube_port: int, nodes: dict[str, tuple[int, int]],
                     gpus: int = 0, values: tuple = (),
                     namespaces: tuple = ()) -> kubernetes.ControlPlane:
    """The control plane under WORK/kube, the nodes registered by their
    kubelets (with `gpus`, each node's GPUs published as NVIDIA's DRA
    driver would: gpus.dra_objects), the chart installed (values for a
    host-run coordinator: its webhook at webhook_url, the API server's
    webhook client CA; `values`: more of helm's --set arguments; `namespaces`
    made before, e.g. Slurm's, which the chart's worker Role lives in).  From here
    on bindings to every node are checked: until the webhook answers, they
    are refused (fail closed)."""
    ports = kubernetes.Ports(kube_port)
    kube = kubernetes.ControlPlane(os.path.join(work, "kube"), kube_port).start(
        webhook_urls=(f"127.0.0.1:{ports.webhook}",))
    kube.register_nodes(nodes)
    if gpus:
        kube.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": fake_gpus.dra_objects(list(nodes), gpus)}))
    for namespace in namespaces:
        kube.kubectl("create", "namespace", namespace)
    chart.install(kube, chart.host_values(kube.webhook_client_ca, webhook_url(kube))
                  + list(values))
    return kube


def coordinator_dir(c: cluster.Cluster) -> str:
    """WORK/coordinator: the coordinator's own files, its uid's alone (0700)."""
    path = os.path.join(c.work, "coordinator")
    me = coordinator_user()
    os.makedirs(path, exist_ok=True)
    os.chown(path, me.pw_uid, me.pw_gid)
    os.chmod(path, 0o700)
    return path


def own(path: str) -> str:
    """`path` (a file) becomes the coordinator uid's, 0600."""
    me = coordinator_user()
    os.chown(path, me.pw_uid, me.pw_gid)
    os.chmod(path, 0o600)
    return path


def coordinator_kubeconfig(c: cluster.Cluster, kube: kubernetes.ControlPlane,
                           account: str) -> str:
    """A kubeconfig with ServiceAccount `account`'s token and the API
    server's CA, in the coordinator's directory, readable by its uid alone."""
    d = coordinator_dir(c)
    ca = own(shutil.copyfile(kube.ca_file, os.path.join(d, "apiserver-ca.crt")))
    token = json.loads(open(kube.service_account_kubeconfig(account, NAMESPACE)).read()
                       )["users"][0]["user"]["token"]
    return own(pki.kubeconfig(os.path.join(d, f"{account}.kubeconfig"), kube.url, ca,
                                f"system:serviceaccount:{NAMESPACE}:{account}", token=token))


KWOK_MARGIN = 2.0   # departed_margin_seconds of the test cluster's sync


def coordinator_config(c: cluster.Cluster, kube: kubernetes.ControlPlane, name: str,
                       settings: str = "") -> str:
    """WORK/coordinator/NAME.toml (NAME: sync, webhook): the ledger socket, the webhook's
    serving certificate the chart made (its Secret) and the CA of the API
    server's client certificate; `settings`: more [sync] keys."""
    d = coordinator_dir(c)
    cert, key = chart.tls_files(kube)
    for file, pem in (("tls.crt", cert), ("tls.key", key)):
        with open(own(_touch(os.path.join(d, file))), "wb") as f:
            f.write(pem)
    client_ca = own(shutil.copyfile(kube.webhook_client_ca, os.path.join(d, "client-ca.crt")))
    if "departed_margin_seconds" not in settings:
        # kwok kills a pod's "containers" the moment it is told to: a
        # kubelet's own delay, which the margin covers on a site, is nil here.
        settings = f"departed_margin_seconds = {KWOK_MARGIN}\n{settings}"
    path = os.path.join(d, f"{name}.toml")
    with open(own(_touch(path)), "w", encoding="utf-8") as f:
        f.write(f"[sync]\nledger_socket = {json.dumps(ledger_socket_path(c.conf))}\n{settings}"
                f"[webhook]\ntls_cert_file = {json.dumps(os.path.join(d, 'tls.crt'))}\n"
                f"tls_key_file = {json.dumps(os.path.join(d, 'tls.key'))}\n"
                f"client_ca_file = {json.dumps(client_ca)}\n"
                f"client_names = [{json.dumps(kubernetes.WEBHOOK_CLIENT)}]\n")
    return path


def _touch(path: str) -> str:
    """An empty 0600 file (written only once it is the coordinator's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    return path


def run_as_coordinator(c: cluster.Cluster) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary gids) the daemons run as: LedgerGroup added
    when it is not the coordinator's own group (SlurmUser's)."""
    me = coordinator_user()
    with open(os.path.join(c.work, "etc", "k8s_resources.conf"), encoding="utf-8") as f:
        groups = [int(line.split("=", 1)[1]) for line in f
                  if line.startswith("LedgerGroup=")]
    return me.pw_uid, me.pw_gid, [g for g in groups if g != me.pw_gid]


RUNTIME = os.path.join(os.environ.get("PYK8SRES_CACHE", "/var/cache/pyk8sres"),
                       "coordinator-python")
RUNTIME_PACKAGES = ("kubernetes", "prometheus-client", "cryptography", "PyYAML")


def coordinator_python() -> str:
    """An interpreter the coordinator's uid can run: a venv of Debian's
    Python (this one may sit where only root can enter, e.g. /root/.pyenv)
    with the coordinator's dependencies at the versions this Python has.
    Made once (flock'd: shared by every cluster), kept under RUNTIME."""
    pins = [f"{p}=={metadata.version(p)}" for p in RUNTIME_PACKAGES]
    python = os.path.join(RUNTIME, "bin", "python")
    ready = os.path.join(RUNTIME, ".ready")
    os.makedirs(os.path.dirname(RUNTIME), exist_ok=True)
    with open(RUNTIME + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(ready) and open(ready).read() == " ".join(pins):
            return python
        if not os.path.exists("/usr/bin/python3"):
            raise cluster.ClusterError("/usr/bin/python3 missing (apt-get install python3-venv)")
        shutil.rmtree(RUNTIME, ignore_errors=True)
        for argv in (["/usr/bin/python3", "-m", "venv", RUNTIME],
                     [python, "-I", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      *pins]):
            proc = subprocess.run(argv, capture_output=True, text=True, umask=0o022)
            if proc.returncode != 0:
                raise cluster.ClusterError(f"{' '.join(argv[:4])}: {proc.stderr.strip()[-2000:]}")
        with open(ready, "w") as f:
            f.write(" ".join(pins))
    return python


def coordinator_package(c: cluster.Cluster) -> str:
    """WORK/python: a copy of the pyk8sres this process runs (and the files
    it ships besides code), readable by the coordinator's uid wherever the
    original lives; made once per cluster (a running daemon still imports
    from it); returns the directory for PYTHONPATH."""
    root = os.path.join(c.work, "python")
    target = os.path.join(root, "pyk8sres")
    if os.path.isdir(target):
        return root
    shutil.copytree(os.path.dirname(pyk8sres.__file__), target + ".tmp",
                    ignore=shutil.ignore_patterns("__pycache__", "kube"))
    os.rename(target + ".tmp", target)
    if not os.path.isdir(os.path.join(target, "_data")):      # a source checkout
        shutil.copytree(data.path("deploy"), os.path.join(target, "_data", "deploy"))
    for d, dirs, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return root


def coordinator_argv(c: cluster.Cluster, kube: kubernetes.ControlPlane, name: str,
                     kubeconfig: str, config: str, *extra: str) -> list[str]:
    """`pyk8sres sync` / `pyk8sres webhook` as start_sync/start_webhook run them."""
    argv = [coordinator_python(), "-m", "pyk8sres.cli", name, "--kubeconfig", kubeconfig,
            "--config", config]
    if name == "webhook":
        argv += ["--listen", f"127.0.0.1:{kube.ports.webhook}", "--url", webhook_url(kube)]
    return argv + list(extra)


def coordinator_env(c: cluster.Cluster, path: str | None = None) -> dict:
    """The environment a coordinator process gets (run it with cwd /);
    path: the directory of another pyk8sres package to run (it must be
    readable by the coordinator's uid)."""
    return dict(c.env, PYTHONUNBUFFERED="1", PYTHONPATH=path or coordinator_package(c),
                PYTHONDONTWRITEBYTECODE="1")


def start_coordinator(c: cluster.Cluster, name: str, argv: list[str],
                      path: str | None = None) -> None:
    """One daemon as the coordinator's uid (cwd /: nothing of ours to read)."""
    cluster.start_process(c.work, name, argv, env=coordinator_env(c, path), cwd="/",
                          user=run_as_coordinator(c))


def start_sync(c: cluster.Cluster, kube: kubernetes.ControlPlane, settings: str = "",
               path: str | None = None) -> None:
    start_coordinator(c, "sync", coordinator_argv(
        c, kube, "sync", coordinator_kubeconfig(c, kube, SYNC_ACCOUNT),
        coordinator_config(c, kube, "sync", settings),
        "--metrics-address", f"127.0.0.1:{kube.ports.sync_metrics}"), path)


def start_webhook(c: cluster.Cluster, kube: kubernetes.ControlPlane, *extra: str,
                  path: str | None = None, settings: str = "") -> None:
    """`pyk8sres webhook` as its ServiceAccount, serving the certificate the
    chart made (the configuration trusts the chart's CA again if a test's
    webhook wrote its own); extra: more of its options (e.g. --no-placeholders);
    path: as up's coordinator_path; settings: more [sync] keys (as start_sync's)."""
    chart.keep_ca_bundle(kube)
    start_coordinator(c, "webhook", coordinator_argv(
        c, kube, "webhook", coordinator_kubeconfig(c, kube, WEBHOOK_ACCOUNT),
        coordinator_config(c, kube, "webhook", settings),
        "--metrics-address", f"127.0.0.1:{kube.ports.webhook_metrics}", *extra), path)


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


def generic_nodes_behind(metrics_port: int) -> float | None:
    """The sync daemon's pyk8sres_generic_nodes_behind (None: no answer yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            body = r.read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith("pyk8sres_generic_nodes_behind "):
            return float(line.split()[1])
    return None


def generic_nodes_current(kube, count: int, metrics_port: int) -> bool:
    """Do `count` GenericNodes exist, each showing its newest state?  Sync's
    writes are paced (generic_node_qps), so a new cluster keeps it busy for
    a while.  (The gauge reads 0 before sync's first pass too, hence the
    count.)"""
    if generic_nodes_behind(metrics_port) != 0:
        return False
    out = kube.kubectl("get", "genericnode", "-o", "name", check=False).stdout
    return len(out.split()) >= count


def wait_generic_nodes_current(kube, count: int, metrics_port: int, c: cluster.Cluster,
                               timeout: float) -> None:
    _wait(lambda: generic_nodes_current(kube, count, metrics_port),
          "the sync daemon's GenericNode writes did not catch up", "sync.out", c, timeout)


def wait_webhook(kube, c: cluster.Cluster, timeout: float = 30) -> None:
    """Until the coordinator has published its scope: the chart's
    matchCondition "true" (every node checked) replaced by the nodes known
    not shared."""
    def published() -> bool:
        out = kube.kubectl("get", "validatingwebhookconfiguration", "pyk8sres-admission",
                           "-o", "json", check=False).stdout
        conditions = json.loads(out)["webhooks"][0].get("matchConditions", []) if out else []
        return any(m["name"] == "shared-node" and m["expression"] != "true"
                   for m in conditions)
    _wait(published, "the admission webhook did not publish its configuration", "webhook.out",
          c, timeout)


def down(work: str) -> list[str]:
    """The coordinator first, then the control plane by their PIDs (before
    cluster.down, whose sweep would otherwise SIGKILL them: their command
    lines name the work directory), then Slurm."""
    work = os.path.abspath(work)
    # container-runtime (containerized.py) first: it would start again the
    # worker slurmds cluster.down stops.
    stopped = [name for name in ("container-runtime", "sync", "webhook")
               if cluster.stop_process(work, name)]
    kube_dir = os.path.join(work, "kube")
    if os.path.isdir(os.path.join(kube_dir, "run")):
        stopped += kubernetes.ControlPlane(kube_dir, 0).stop()
    return stopped + cluster.down(work)
