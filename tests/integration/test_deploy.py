"""deploy/: the Helm chart (what ships: tests/integration/test_helm.py
lints, renders, installs and upgrades it) run for real as a site runs it, and
the systemd units.

The chart, coordinator mode `deployment`, is installed with the real helm
into the real control plane (kube-apiserver with its stock admission chain,
kube-controller-manager; a control plane of this module's own: the chart
installs a fail-closed admission webhook, which would refuse other modules'
pods).  kube-controller-manager makes the Deployments' pods, each running as
its own ServiceAccount.  The webhook configuration is then live: a pod aimed
at a node in a checked namespace is refused while no coordinator answers
(fail closed), and the coordinator's own namespace is not checked.  What
each daemon may reach on the slurmctld host is read from the rendered
Deployments and sidecars: the ledger socket's directory, never
StateSaveLocation nor the munge key, as the coordinator's own uid.

The systemd units pass `systemd-analyze verify` (with ExecStart pointing at
this machine's pyk8sres), and their command lines parse with the daemons'
own argument parsers.  RBAC content itself: tests/unit/test_rbac.py.
Ports: the control plane a free block in 31000-31990.
"""
import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest_kube import pick_ports
from pyk8sres.coordinator import sync, webhook
from pyk8sres.testbed import chart, kubernetes, pki

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE_PORTS = (31000, 31990)
NAMESPACE = chart.NAMESPACE
SLURM_UID = 64030            # Debian's slurm: never the coordinator's
PARSERS = {"sync": sync.parse_args, "webhook": webhook.parse_args}


@pytest.fixture(scope="module")
def server(kube_binaries, tmp_path_factory):
    kube = kubernetes.ControlPlane(str(tmp_path_factory.mktemp("deploy-kube")),
                                   pick_ports(*KUBE_PORTS), kube_binaries).start()
    try:
        yield kube
    finally:
        kube.stop()


# The chart's NetworkPolicy (on by default) needs the API server's address.
NP_ARGS = ["--set", "networkPolicy.apiServerCIDRs={127.0.0.1/32}"]


def values(kube) -> list[str]:
    return ["--set-file", f"webhook.apiServerClientCA={kube.webhook_client_ca}", *NP_ARGS]


def key(doc: dict) -> tuple:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


def test_chart_installs_runs_each_daemon_as_its_account_and_fails_closed(server):
    docs = chart.render(server.bin.helm, values(server))
    chart.install(server, values(server))
    try:
        # Every object the chart renders is there.
        for kind, ns, name in map(key, docs):
            args = ["get", kind, name, "-o", "name"] + (["-n", ns] if ns else [])
            assert server.kubectl(*args, check=False).returncode == 0, (kind, ns, name)
        # kube-controller-manager runs the Deployments: one pod each, as its
        # own ServiceAccount (the ServiceAccount admission plugin refuses a
        # pod whose account does not exist).  No node here: they pend.
        deps = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
        assert deps == {"pyk8sres-sync", "pyk8sres-webhook"}
        deadline = time.monotonic() + 60
        while True:
            pods = json.loads(server.kubectl("get", "pods", "-n", NAMESPACE, "-o",
                                             "json").stdout)
            accounts = sorted(p["spec"]["serviceAccountName"] for p in pods["items"])
            if accounts == sorted(deps) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert accounts == sorted(deps), server.kubectl("get", "events", "-n", NAMESPACE).stdout
        for p in pods["items"]:
            assert all(c["securityContext"]["runAsUser"] != SLURM_UID
                       for c in p["spec"]["containers"])

        # The webhook configuration is live and fails closed: nothing answers
        # at its Service, so a pod with spec.nodeName in a checked namespace
        # is refused ...
        pod = json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                          "spec": {"nodeName": "n1",
                                   "containers": [{"name": "c", "image": "busybox"}]}})
        # (the configuration reaches the API server's admission plugin
        # through an informer: a create right after the install may pass)
        deadline = time.monotonic() + 30
        while True:
            refused = server.kubectl("create", "-n", "default", "-f", "-", input=pod,
                                     check=False)
            if refused.returncode != 0 or time.monotonic() > deadline:
                break
            server.kubectl("delete", "-n", "default", "pod", "probe", "--grace-period=0",
                           "--force", "--wait=false")
            time.sleep(0.2)
        assert refused.returncode != 0 and "admission.pyk8sres.io" in refused.stderr, refused
        # ... while the coordinator's own namespace stays schedulable.
        server.kubectl("create", "-n", NAMESPACE, "-f", "-", input=pod)
        server.kubectl("delete", "-n", NAMESPACE, "pod", "probe", "--grace-period=0", "--force",
                       "--wait=false")
    finally:
        subprocess.run([server.bin.helm, "--kubeconfig", server.kubeconfig, "uninstall",
                        chart.RELEASE, "-n", NAMESPACE, "--wait"], capture_output=True,
                       timeout=120)


def _mounts(container) -> dict[str, bool]:
    return {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}


def test_deployments_reach_the_ledger_directory_only_as_their_own_uid(kube_binaries, tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text(Path(pki.Authority(tmp_path / "pki", "ca", "any").cert_file).read_text())
    docs = chart.render(kube_binaries.helm, ["--set-file", f"webhook.apiServerClientCA={ca}",
                                             *NP_ARGS])
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    service = next(d for d in docs if d["kind"] == "Service")
    accounts = {key(d)[2] for d in docs if d["kind"] == "ServiceAccount"}
    for name, dep in deps.items():
        spec = dep["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == name and name in accounts
        (container,) = spec["containers"]
        daemon = container["args"][0]
        assert name == f"pyk8sres-{daemon}"
        PARSERS[daemon](container["args"][1:])          # the code accepts the command line
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] not in (0, SLURM_UID)
        mounts = _mounts(container)
        assert mounts["/run/pyk8sres-ledger"] is True      # the socket's directory, read-only
        host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        # Of the slurmctld host: the ledger's directory, and for sync
        # slurm.conf and munged's socket directory; never StateSaveLocation
        # nor the munge key.
        assert set(host.values()) == ({"/run/pyk8sres-ledger", "/etc/slurm", "/run/munge"}
                                      if daemon == "sync" else {"/run/pyk8sres-ledger"})
        labels = dep["spec"]["template"]["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert selected == (daemon == "webhook"), (name, service["spec"]["selector"])

    # As sidecars of slurmctld: the ledger's directory is shared, StateSaveLocation is not.
    docs = chart.render(kube_binaries.helm, ["--set-file", f"webhook.apiServerClientCA={ca}",
                                             "--set", "coordinator.mode=sidecar"])
    assert not [d for d in docs if d["kind"] == "Deployment"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    spec = sts["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    for name in ("sync", "webhook"):
        c = containers[name]
        PARSERS[c["args"][0]](c["args"][1:])
        assert "/var/spool/slurmctld" not in _mounts(c)
        assert _mounts(c)["/run/pyk8sres-ledger"] is True
        assert c["securityContext"]["runAsUser"] not in (0, SLURM_UID)
    assert _mounts(containers["slurmctld"])["/var/spool/slurmctld"] is False
    # The Kubernetes token reaches the sidecars only.
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert spec["automountServiceAccountToken"] is False
    assert {n for n, c in containers.items() if token in _mounts(c)} == {"sync", "webhook"}


UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def _unit(path):
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read(path)
    return cp


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_systemd_unit(unit, tmp_path):
    cp = _unit(unit)
    svc = cp["Service"]
    assert "slurmctld.service" in cp["Unit"]["After"].split()
    # The coordinator's own user, never SlurmUser or root; Slurm's state and
    # munge's key out of its reach.
    assert (svc["User"], svc["Group"]) == ("pyk8sres", "pyk8sres")
    assert svc["NoNewPrivileges"] == "yes"
    hidden = svc["InaccessiblePaths"].split()
    assert {"-/var/lib/slurm", "-/var/spool/slurmctld", "-/etc/munge"} <= set(hidden)
    assert svc["ProtectSystem"] == "strict" and svc["CapabilityBoundingSet"] == ""
    argv = shlex.split(svc["ExecStart"])
    assert argv[0] == "/usr/local/bin/pyk8sres"
    parser = {"sync": sync.parse_args, "webhook": webhook.parse_args}[argv[1]]
    args = parser(argv[2:])
    # The ledger socket's own directory, not StateSaveLocation.
    assert args.ledger_socket == "/run/pyk8sres-ledger/k8s_resources.socket"
    assert "/run/pyk8sres-ledger 0750 slurm pyk8sres" in unit.read_text()
    # verify needs ExecStart to exist: point it at this machine's pyk8sres.
    exe = shutil.which("pyk8sres") or str(Path(sys.executable).parent / "pyk8sres")
    if not os.access(exe, os.X_OK):
        exe = sys.executable         # `python3 -m pyk8sres` then
        text = unit.read_text().replace("/usr/local/bin/pyk8sres", f"{exe} -m pyk8sres")
    else:
        text = unit.read_text().replace("/usr/local/bin/pyk8sres", exe)
    copy = tmp_path / unit.name
    copy.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                         text=True, timeout=60)
    # Only our unit's lines count (verify also loads the units it names).
    ours = [line for line in (out.stdout + out.stderr).splitlines() if unit.name in line]
    assert out.returncode == 0 and ours == [], out.stdout + out.stderr
    assert re.search(r"(?m)^WantedBy=multi-user.target$", text)
