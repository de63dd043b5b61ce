"""Fixtures for tests against a real Kubernetes API server (pyk8sres-apiserver
+ etcd, see pyk8sres/kubeapi_server.py). Loaded as a pytest plugin:

    pytest_plugins = ["conftest_kube"]   # or import the fixtures directly

The first run builds the server (several minutes, cached outside the repo in
$PYK8SRES_CACHE or /var/cache/pyk8sres/kube); a failed build fails the tests
loudly instead of skipping them.

Ports: $PYK8SRES_KUBE_PORT if set, else the first free triple
(apiserver, etcd client, etcd peer) from 26400 upward.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pyk8sres.testbed import cluster
from pyk8sres.testbed.kubeapi_server import KubeAPIServer, build

REPO = Path(__file__).resolve().parents[2]
CRD_MANIFEST = REPO / "deploy" / "crd-genericnode.yaml"
RBAC_MANIFEST = REPO / "deploy" / "rbac.yaml"


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a plain GET, error statuses included (our daemons'
    /metrics, /healthz, /readyz; Prometheus)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def pick_ports(start: int = 26400, stop: int = 26990) -> int:
    """First port p with p, p+1, p+2 free on 127.0.0.1."""
    if os.environ.get("PYK8SRES_KUBE_PORT"):
        return int(os.environ["PYK8SRES_KUBE_PORT"])
    for p in range(start, stop, 3):
        if all(cluster.port_free(p + i) for i in range(3)):
            return p
    raise RuntimeError(f"no free port triple in {start}-{stop}")


@pytest.fixture(scope="session")
def kube_paths():
    """Built binaries (apiserver, etcd, kubectl). Fails if the build fails."""
    return build()


@pytest.fixture(scope="session")
def kube_server(kube_paths, tmp_path_factory):
    """A running server with the GenericNode CRD and RBAC manifests applied."""
    workdir = tmp_path_factory.mktemp("kubeapi")
    kas = KubeAPIServer(kube_paths).start(workdir, pick_ports())
    try:
        kas.apply(CRD_MANIFEST)
        kas.apply(RBAC_MANIFEST)
        yield kas
    finally:
        kas.stop()


@pytest.fixture(scope="session")
def kube_api_client(kube_server):
    """kubernetes.client.ApiClient for kube_server (official Python client)."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=kube_server.kubeconfig)
    yield client
    client.close()
