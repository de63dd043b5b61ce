"""The Helm chart (deploy/helm/pyk8sres): the one source of the coordinator's
Kubernetes objects (CRD, RBAC, webhook configuration and TLS, placeholder
namespace).  The test clusters install it as a site would, with the values
for a coordinator run as a host process; tests that need only some of its
objects render those with `helm template`."""
from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import yaml

from .. import data

CHART = data.path("deploy", "helm", "pyk8sres")
CRD = CHART / "crds" / "genericnode.yaml"
ALERTS = CHART / "files" / "prometheus-alerts.yaml"
RELEASE = "pyk8sres"
NAMESPACE = "pyk8sres-system"            # the release's, where the ServiceAccounts live
PLACEHOLDERS = "pyk8sres-placeholders"   # values.yaml placeholders.namespace
TLS_SECRET = "pyk8sres-webhook-tls"


class ChartError(RuntimeError):
    """helm refused (the message is helm's)."""


def host_values(client_ca: str, webhook_url: str) -> list[str]:
    """Values for a coordinator outside the cluster (coordinator.mode none):
    the API server calls `webhook_url`, and trusts only the client
    certificate `client_ca` (a PEM file) issued."""
    return ["--set", "coordinator.mode=none", "--set", f"webhook.url={webhook_url}",
            "--set-file", f"webhook.apiServerClientCA={client_ca}"]


def _helm(helm: str, args: list[str], timeout: float = 120) -> str:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ChartError(f"helm {' '.join(args[:2])}: {proc.stderr.strip()}")
    return proc.stdout


def render(helm: str, values: list[str], *templates: str, crds: bool = False) -> list[dict]:
    """`helm template` of the chart: every object, or only those of
    `templates` (file names under templates/), in the order given."""
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, *values]
    if crds:
        args.append("--include-crds")
    for t in templates:
        args += ["--show-only", f"templates/{t}"]
    return [d for d in yaml.safe_load_all(_helm(helm, args)) if d]


def rbac_manifest(helm: str, client_ca: str, path: str | Path) -> Path:
    """The coordinator's namespace, accounts and roles as the chart renders
    them, and the placeholders' namespace, as one file for `kubectl apply`
    (what tests apply, and apply again to restore a grant they took away)."""
    docs = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    docs += render(helm, host_values(client_ca, "https://127.0.0.1:1/validate"),
                   "placeholders.yaml", "rbac.yaml")
    path = Path(path)
    path.write_text(yaml.safe_dump_all(docs))
    return path


def webhook_configuration(helm: str, client_ca: str, url: str) -> dict:
    """The chart's ValidatingWebhookConfiguration calling `url`."""
    (doc,) = [d for d in render(helm, host_values(client_ca, url), "webhook.yaml")
              if d["kind"] == "ValidatingWebhookConfiguration"]
    return doc


def install(kube, values: list[str]) -> None:
    """`helm install` into the control plane `kube` as its admin (the
    release namespace created), as docs/install.md does it."""
    _helm(kube.bin.helm, ["--kubeconfig", kube.kubeconfig, "install", RELEASE, str(CHART),
                          "-n", NAMESPACE, "--create-namespace", *values])


def keep_ca_bundle(kube, configuration: str = "pyk8sres-admission") -> bool:
    """As the admin: the webhook configuration's caBundle back to the chart's
    CA (its Secret) if something else wrote it (a webhook with a CA of its
    own, in a test).  True if it had to."""
    ca = json.loads(kube.kubectl("get", "secret", "-n", NAMESPACE, TLS_SECRET, "-o",
                                 "json").stdout)["data"]["ca.crt"]
    vwc = json.loads(kube.kubectl("get", "validatingwebhookconfiguration", configuration,
                                  "-o", "json").stdout)
    patch = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": ca}
             for i, hook in enumerate(vwc["webhooks"])
             if base64.b64decode(hook["clientConfig"].get("caBundle", "")) != base64.b64decode(ca)]
    if patch:
        kube.kubectl("patch", "validatingwebhookconfiguration", configuration, "--type=json",
                     "-p", json.dumps(patch))
    return bool(patch)


def tls_files(kube) -> tuple[bytes, bytes]:
    """(certificate, key) PEM of the webhook's serving certificate the chart
    made (its Secret), for a coordinator outside the cluster."""
    secret = json.loads(kube.kubectl("get", "secret", "-n", NAMESPACE, TLS_SECRET,
                                     "-o", "json").stdout)
    return (base64.b64decode(secret["data"]["tls.crt"]),
            base64.b64decode(secret["data"]["tls.key"]))
