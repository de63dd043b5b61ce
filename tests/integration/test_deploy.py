"""deploy/: the kustomize base, its sidecar component and the systemd units.

The base is rendered by kubectl's own kustomize and applied for real to the
real control plane (kube-apiserver with its stock admission chain,
kube-controller-manager; a control plane of this module's own: the base
installs a fail-closed admission webhook, which would refuse other modules'
pods).  Every object is read back; kube-controller-manager makes the
Deployments' pods, each running as its own ServiceAccount.  The webhook
configuration is then live: a pod aimed at a node in a checked namespace is
refused while no coordinator answers (fail closed), and the coordinator's own
namespace is not checked.  The sidecar component cannot really run here (a
slurmctld image, volume claims): it goes through the API server's
server-side dry run, with strict field validation like everything else.

The systemd units pass `systemd-analyze verify` (with ExecStart pointing at
this machine's pyk8sres), and their command lines parse with the daemons'
own argument parsers.  RBAC content itself: tests/unit/test_rbac.py.
Ports: the control plane a free block in 31000-31990.
"""
import configparser
import copy
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

import yaml

from conftest_kube import pick_ports
from pyk8sres.coordinator import sync, webhook
from pyk8sres.testbed import kubernetes

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE_PORTS = (31000, 31990)
NAMESPACE = "pyk8sres-system"


def render(kubectl: str, path: Path) -> list[dict]:
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def key(doc: dict) -> tuple:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


@pytest.fixture(scope="module")
def server(kube_binaries, tmp_path_factory):
    kube = kubernetes.ControlPlane(str(tmp_path_factory.mktemp("deploy-kube")),
                                   pick_ports(*KUBE_PORTS), kube_binaries).start()
    try:
        yield kube
    finally:
        kube.stop()


def served(kube) -> set[tuple[str, str]]:
    """(apiVersion, kind) the server's discovery lists."""
    kinds = set()
    groups = json.loads(kube.kubectl("get", "--raw", "/apis").stdout)["groups"]
    for path in ["/api/v1"] + [f"/apis/{v['groupVersion']}" for g in groups
                               for v in g["versions"]]:
        body = json.loads(kube.kubectl("get", "--raw", path).stdout)
        kinds |= {(body["groupVersion"], r["kind"]) for r in body["resources"]
                  if "/" not in r["name"]}
    return kinds


def dry_run(kube, path: Path) -> list[dict]:
    """kubectl apply --dry-run=server, fields validated strictly by the API
    server (an unknown or misplaced field is an error): the objects as it
    would store them."""
    out = kube.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", str(path),
                       "-o", "json").stdout
    doc = json.loads(out)
    return doc["items"] if doc.get("kind") == "List" else [doc]


def prerequisites(kube, docs, tmp_path) -> None:
    """The Namespace and the CRD for real: a dry run creates neither, and
    the objects in them or of them need them."""
    for d in docs:
        if d["kind"] in ("Namespace", "CustomResourceDefinition"):
            first = tmp_path / f"{d['kind']}.yaml"
            first.write_text(yaml.safe_dump(d))
            kube.apply(first)


def test_base_renders_and_applies(server, tmp_path, kube_binaries):
    docs = render(kube_binaries.kubectl, DEPLOY)
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    # Everything kustomization.yaml lists, each file's every object.
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    from_files = {key(d) for f in listed
                  for d in yaml.safe_load_all((DEPLOY / f).read_text()) if d}
    assert {key(d) for d in docs} == from_files
    assert {"CustomResourceDefinition", "ClusterRole", "Role", "ValidatingWebhookConfiguration",
            "Deployment", "Service"} <= {k for _, k in kinds}
    assert kinds <= served(server)

    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    # Strict field validation first (apply alone would drop unknown fields
    # with a warning), then for real.
    prerequisites(server, docs, tmp_path)
    assert sorted(key(d) for d in dry_run(server, path)) == sorted(key(d) for d in docs)
    # (the check bites: a misspelled field is refused, not dropped)
    bad = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(kubernetes.KubeError, match='unknown field.*imagePullPolicyy'):
        dry_run(server, tmp_path / "bad.yaml")
    names = server.apply(path)
    assert len(names) == len(docs), names
    for d in docs:
        kind, ns, name = key(d)
        args = ["get", kind, name, "-o", "yaml"] + (["-n", ns] if ns else [])
        back = yaml.safe_load(server.kubectl(*args).stdout)
        if kind in ("ClusterRole", "Role"):
            assert back["rules"] == d["rules"], name
        if kind.endswith("Binding"):
            assert back["subjects"] == d["subjects"] and back["roleRef"] == d["roleRef"]

    # kube-controller-manager runs the Deployments: one pod each, as its own
    # ServiceAccount (the ServiceAccount admission plugin refuses a pod whose
    # account does not exist).  No node here: they pend.
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    deadline = time.monotonic() + 60
    while True:
        pods = json.loads(server.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)
        accounts = sorted(p["spec"]["serviceAccountName"] for p in pods["items"])
        if accounts == sorted(deps) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert accounts == sorted(deps), server.kubectl("get", "events", "-n", NAMESPACE).stdout

    # The webhook configuration is live and fails closed: nothing answers at
    # its Service, so a pod with spec.nodeName in a checked namespace is refused ...
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "busybox"}]}}
    pod_file = tmp_path / "pod.yaml"
    pod_file.write_text(yaml.safe_dump(pod))
    # (the configuration reaches the API server's admission plugin through an
    # informer: a create right after the apply may still pass)
    deadline = time.monotonic() + 30
    while True:
        refused = server.kubectl("create", "-n", "default", "-f", str(pod_file), check=False)
        if refused.returncode != 0 or time.monotonic() > deadline:
            break
        server.kubectl("delete", "-n", "default", "pod", "probe", "--grace-period=0",
                       "--force", "--wait=false")
        time.sleep(0.2)
    assert refused.returncode != 0 and "admission.pyk8sres.io" in refused.stderr, refused
    # ... while the coordinator's own namespace stays schedulable.
    server.kubectl("create", "-n", NAMESPACE, "-f", str(pod_file))
    server.kubectl("delete", "-n", NAMESPACE, "pod", "probe", "--grace-period=0", "--force",
                   "--wait=false")


def _deployments(docs):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}


def test_deployments_run_each_daemon_with_its_own_account(kube_binaries):
    docs = render(kube_binaries.kubectl, DEPLOY)
    deps = _deployments(docs)
    assert set(deps) == {"pyk8sres-sync", "pyk8sres-webhook"}
    accounts = {key(d)[2] for d in docs if d["kind"] == "ServiceAccount"}
    service = next(d for d in docs if d["kind"] == "Service")
    for name, dep in deps.items():
        spec = dep["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == name and name in accounts
        (container,) = spec["containers"]
        daemon = container["args"][0]
        assert name == f"pyk8sres-{daemon}"
        parser = {"sync": sync.parse_args, "webhook": webhook.parse_args}[daemon]
        parser(container["args"][1:])              # the code accepts the command line
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True
        mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
        assert mounts["/var/spool/slurmctld"] is True   # the ledger socket; never its journal
        assert mounts["/etc/slurm"] is True
        labels = dep["spec"]["template"]["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert selected == (daemon == "webhook"), (name, service["spec"]["selector"])
    hook = deps["pyk8sres-webhook"]["spec"]["template"]["spec"]["containers"][0]
    assert hook["ports"][0]["containerPort"] == service["spec"]["ports"][0]["targetPort"]


def test_sidecar_component(server, tmp_path, kube_binaries):
    site = tmp_path / "site"
    site.mkdir()
    rel = os.path.relpath(DEPLOY, site)
    (site / "kustomization.yaml").write_text(
        f"resources: [{rel}]\ncomponents: [{rel}/sidecar]\n")
    docs = render(kube_binaries.kubectl, site)
    assert _deployments(docs) == {}
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    spec = sts["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert {"slurmctld", "pyk8sres-sync", "pyk8sres-webhook"} <= set(containers)

    def mount(c, path):
        return next((m["name"] for m in c["volumeMounts"] if m["mountPath"] == path), None)
    # One StateSaveLocation volume for slurmctld and both sidecars (the ledger socket).
    state = {mount(c, "/var/spool/slurmctld") for c in containers.values() if c["name"] != "munged"}
    assert state == {"state"}
    assert "state" in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    read_only = {n: next(m.get("readOnly", False) for m in c["volumeMounts"]
                         if m["mountPath"] == "/var/spool/slurmctld")
                 for n, c in containers.items() if n != "munged"}
    assert read_only == {"slurmctld": False, "pyk8sres-sync": True, "pyk8sres-webhook": True}
    # The Kubernetes token reaches the sidecars only.
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert spec["automountServiceAccountToken"] is False
    assert {n for n, c in containers.items() if mount(c, token)} == \
        {"pyk8sres-sync", "pyk8sres-webhook"}
    for name in ("pyk8sres-sync", "pyk8sres-webhook"):
        args = containers[name]["args"]
        {"sync": sync.parse_args, "webhook": webhook.parse_args}[args[0]](args[1:])
    # Every binding now names the pod's account, and the Service selects the pod.
    bindings = [d for d in docs if d["kind"].endswith("RoleBinding")]
    assert bindings and all(d["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                               "name": spec["serviceAccountName"]}]
                            for d in bindings)
    service = next(d for d in docs if d["kind"] == "Service")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    # The API server takes all of it (server-side dry run, strict fields; the
    # namespace and the CRD for real first: a dry run creates neither).
    prerequisites(server, docs, tmp_path)
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    back = {key(d): d for d in dry_run(server, path)}
    assert set(back) == {key(d) for d in docs}
    assert back[("ClusterRoleBinding", None, "pyk8sres-sync")]["subjects"][0]["name"] == \
        "pyk8sres-slurmctld"
    sts_back = back[key(sts)]
    assert sts_back["spec"]["template"]["spec"]["serviceAccountName"] == "pyk8sres-slurmctld"


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
    assert svc["User"] == "slurm" and svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict" and svc["CapabilityBoundingSet"] == ""
    argv = shlex.split(svc["ExecStart"])
    assert argv[0] == "/usr/local/bin/pyk8sres"
    parser = {"sync": sync.parse_args, "webhook": webhook.parse_args}[argv[1]]
    parser(argv[2:])
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
