"""The Helm chart (deploy/helm/pyk8sres) with the real helm binary against the
real control plane: lint, each values variant rendered and applied with a
server-side dry run, install, upgrade (the webhook's CA is kept), uninstall
(no webhook configuration is left behind to block every binding), the
chart's own snapshot tests, and values that contradict each other refused
at render time with the value's name."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest
import yaml

from pyk8sres import data
from pyk8sres.testbed import kubernetes

from conftest_kube import pick_ports

CHART = str(data.path("deploy", "helm", "pyk8sres"))
NAMESPACE = "pyk8sres-system"


@pytest.fixture(scope="module")
def kube(kube_binaries, tmp_path_factory):
    """A control plane of its own: the session one has the RBAC applied by hand."""
    work = tmp_path_factory.mktemp("helm")
    port = pick_ports(26700, 26990)
    cp = kubernetes.ControlPlane(str(work), port, kube_binaries).start()
    try:
        yield cp
    finally:
        cp.stop()


def helm(kube, *args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([kube.bin.helm, "--kubeconfig", kube.kubeconfig, *args],
                          capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {proc.stderr}")
    return proc


def ca_args(kube) -> list[str]:
    return ["--set-file", f"webhook.apiServerClientCA={kube.webhook_client_ca}"]


# The NetworkPolicy is on by default (mode deployment): it needs to know
# where the API server calls from.
NP_ARGS = ["--set", "networkPolicy.apiServerCIDRs={10.0.0.1/32}"]

VARIANTS = {
    "deployment": NP_ARGS,
    "sidecar": ["--set", "coordinator.mode=sidecar"],
    "host process": ["--set", "coordinator.mode=none",
                     "--set", "webhook.url=https://127.0.0.1:8443/validate"],
    "hardened": ["--set", "networkPolicy.enabled=true",
                 "--set", "networkPolicy.apiServerCIDRs={10.0.0.1/32}",
                 "--set", "podDisruptionBudget.enabled=true", "--set", "webhook.replicas=2",
                 "--set", "webhook.excludeNamespaces={slurm}",
                 "--set", "sync.slurmWorkers={slurm}", "--set", "sync.nodeMap.k8s-a=n1"],
}


def test_lint(kube):
    out = helm(kube, "lint", "--strict", CHART, *ca_args(kube), *NP_ARGS)
    assert "0 chart(s) failed" in out.stdout


def test_snapshots(kube):
    proc = subprocess.run([kube.bin.helm_unittest, CHART], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Snapshot:" in proc.stdout and "failed" not in proc.stdout.split("Tests:")[1]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_is_accepted_by_the_api_server(kube, variant):
    """Rendered, then applied with a server-side dry run: the real API server
    validates every object (Deployments and StatefulSets included)."""
    rendered = helm(kube, "template", "pyk8sres", CHART, "-n", NAMESPACE, "--include-crds",
                    *ca_args(kube), *VARIANTS[variant]).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(rendered) if d)
    assert "ValidatingWebhookConfiguration" in kinds and "CustomResourceDefinition" in kinds
    # The namespaces first (a dry run creates nothing, so objects in them
    # could not be checked otherwise).
    for ns in (NAMESPACE, "pyk8sres-placeholders"):
        kube.kubectl("create", "namespace", ns, check=False)
    try:
        proc = kube.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=test",
                            "-f", "-", input=rendered, check=False)
    finally:
        kube.kubectl("delete", "namespace", NAMESPACE, "pyk8sres-placeholders", "--wait",
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("serverside-applied (server dry run)") == len(kinds)


@pytest.mark.parametrize("values,message", [
    ([], "webhook.apiServerClientCA is required"),
    (["--set", "webhook.certManager.enabled=true"], "does not serve cert-manager.io/v1"),
    (["--set", "sync.nodeMap.k8s-a="], "names no node"),
    (["--set", "networkPolicy.enabled=true"], "networkPolicy.apiServerCIDRs is required"),
    (["--set", "metrics.prometheusRule=true"], "monitoring.coreos.com/v1"),
    (["--set", "sync.nodeKey=example.com/slurm-node"], "node-restriction.kubernetes.io/"),
    (["--set", "coordinator.mode=daemonset"], "coordinator/mode"),       # values.schema.json
    (["--set", "webhook.replicas=0"], "webhook/replicas"),
    (["--set", "ledger.timeoutSeconds=3"], "must be under half of webhook.timeoutSeconds"),
    (["--set", "sync.workerPods=slinky"], "needs sync.workerNamespace"),
    (["--set", "sync.workerNamespace=slurm"], "need sync.workerPods"),
    (["--set", "sync.workerPods=operator"], "/sync/workerPods"),          # values.schema.json
])
def test_contradictions_are_refused_at_render_time(kube, values, message):
    ca = ca_args(kube) if values else []
    proc = helm(kube, "template", "pyk8sres", CHART, *ca, *values, check=False)
    assert proc.returncode != 0 and message in proc.stderr


def webhook_ca(kube) -> tuple[str, str]:
    """(the chart's CA in its Secret, the caBundle the API server uses)."""
    secret = json.loads(kube.kubectl("get", "secret", "-n", NAMESPACE, "pyk8sres-webhook-tls",
                                     "-o", "json").stdout)
    vwc = json.loads(kube.kubectl("get", "validatingwebhookconfiguration", "pyk8sres-admission",
                                  "-o", "json").stdout)
    return (base64.b64decode(secret["data"]["ca.crt"]).decode(),
            base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]).decode())


def test_install_upgrade_keeps_the_ca_and_uninstall_leaves_nothing(kube):
    args = ["-n", NAMESPACE, "--create-namespace", *ca_args(kube),
            "--set", "coordinator.mode=none", "--set", "webhook.url=https://127.0.0.1:1/validate"]
    helm(kube, "install", "pyk8sres", CHART, *args, "--wait", "--timeout", "60s")
    ca, bundle = webhook_ca(kube)
    assert "BEGIN CERTIFICATE" in ca and ca == bundle
    assert kube.kubectl("get", "crd", "genericnodes.pyk8sres.io", check=False).returncode == 0
    labels = json.loads(kube.kubectl("get", "namespace", "pyk8sres-placeholders", "-o",
                                     "json").stdout)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    # The RBAC the chart made is what the coordinator may do, live.
    sa = f"system:serviceaccount:{NAMESPACE}:pyk8sres-webhook"
    can = lambda *a: kube.kubectl("auth", "can-i", *a, "--as", sa, check=False).stdout.strip()
    assert can("update", "validatingwebhookconfigurations/pyk8sres-admission") == "yes"
    assert can("update", "validatingwebhookconfigurations/someone-elses") == "no"
    assert can("create", "validatingwebhookconfigurations") == "no"
    assert can("create", "pods", "-n", "pyk8sres-placeholders") == "yes"
    assert can("create", "pods", "-n", "default") == "no"

    helm(kube, "upgrade", "pyk8sres", CHART, *args, "--set", "webhook.timeoutSeconds=7")
    assert webhook_ca(kube) == (ca, ca)          # kept: nothing to restart or re-trust
    vwc = json.loads(kube.kubectl("get", "validatingwebhookconfiguration", "pyk8sres-admission",
                                  "-o", "json").stdout)
    assert vwc["webhooks"][0]["timeoutSeconds"] == 7

    helm(kube, "uninstall", "pyk8sres", "-n", NAMESPACE, "--wait", "--timeout", "60s")
    left = kube.kubectl("get", "validatingwebhookconfigurations", "-o", "name").stdout.split()
    assert "validatingwebhookconfiguration.admissionregistration.k8s.io/pyk8sres-admission" \
        not in left
    assert kube.kubectl("get", "clusterrole", "pyk8sres-webhook", check=False).returncode != 0
