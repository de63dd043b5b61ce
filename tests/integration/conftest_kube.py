"""Fixtures for tests against the real Kubernetes control plane
(pyk8sres/testbed/kubernetes.py: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok), loaded by conftest.py.

The first run builds it (kube/build.sh, about 6 minutes, cached outside the
repository); a failed build fails the tests loudly instead of skipping them.

Ports: $PYK8SRES_KUBE_PORT if set, else the first free block of
kubernetes.Ports from 26400 upward.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kubernetes import config

from local_slurm import port
from pyk8sres.coordinator.kube import done  # noqa: F401 (the tests' too)
from pyk8sres.coordinator.kube import Kube
from pyk8sres.testbed import chart, cluster, hybrid, kubernetes

REPO = Path(__file__).resolve().parents[2]
CRD_MANIFEST = chart.CRD
BLOCK = len(kubernetes.Ports(0).all())


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a plain GET, error statuses included (our daemons'
    /metrics, /healthz, /readyz; Prometheus)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def rbac_manifest(kube) -> Path:
    """The coordinator's RBAC as the Helm chart renders it (its namespace,
    accounts, roles, the placeholders' namespace), one file under the
    control plane's directory: what tests apply, and apply again to restore it."""
    path = Path(kube.work) / "chart-rbac.yaml"
    if not path.exists():
        chart.rbac_manifest(kube.bin.helm, kube.webhook_client_ca, path)
    return path


def pick_ports(start: int = 26400, stop: int = 26990) -> int:
    """First port p with the control plane's whole block (kubernetes.Ports)
    free, in start..stop moved as every test port (local_slurm.port), so that
    a run on other ports never races this one for a block."""
    if os.environ.get("PYK8SRES_KUBE_PORT"):
        return int(os.environ["PYK8SRES_KUBE_PORT"])
    start, stop = port(start), port(stop)
    for p in range(start, stop, BLOCK):
        if all(cluster.port_free(p + i) for i in range(BLOCK)):
            return p
    raise RuntimeError(f"no {BLOCK} free ports in a row in {start}-{stop}")


@pytest.fixture(scope="session")
def kube_binaries():
    """The built control plane. Fails if the build fails."""
    return kubernetes.build()


@pytest.fixture(scope="session")
def kube_server(kube_binaries, tmp_path_factory):
    """A running control plane with nodes k1, k2 (4 CPUs, 8000 MB each), the
    GenericNode CRD and the coordinator's RBAC applied.  Session-wide: tests
    that restart or break it start their own."""
    workdir = tmp_path_factory.mktemp("kube")
    port = pick_ports()
    kube = kubernetes.ControlPlane(str(workdir), port, kube_binaries).start(
        webhook_urls=(f"127.0.0.1:{kubernetes.Ports(port).webhook}",))
    try:
        kube.register_nodes({"k1": (4, 8000), "k2": (4, 8000)})
        kube.apply(CRD_MANIFEST)
        kube.apply(rbac_manifest(kube))
        yield kube
    finally:
        kube.stop()


@pytest.fixture(scope="session")
def kube_api_client(kube_server):
    """kubernetes.client.ApiClient for kube_server as admin (official Python client)."""
    client = config.new_client_from_config(config_file=kube_server.kubeconfig)
    yield client
    client.close()


def post_json(url: str, body: bytes, ctx: ssl.SSLContext, timeout: float) -> tuple:
    """POST a JSON body over TLS: (HTTP status, body), or ("tls", why) when
    no HTTP answer came (handshake refused, connection dropped)."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError) as e:
        return "tls", str(e)


def wait_for(pred, timeout=15.0, what="condition", every=0.05):
    """pred()'s first true value, polled every `every` seconds; fails
    naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def wait(pred, what: str, timeout: float = 30):
    """wait_for, `what` first, polled every 0.2 s (for predicates that run a command)."""
    return wait_for(pred, timeout, what, every=0.2)


def hybrid_world(prefix: str, **up):
    """A module's hybrid cluster (hybrid.up with `up`): yields (slurm
    cluster, control plane, Kube client); its jobs cancelled and every
    daemon stopped after, even when it failed to come up.  With
    PYK8SRES_KEEP_WORK set the work directory (slurmctld's log and state,
    the ledger's journal, the coordinator's and the control plane's logs)
    is left for a post-mortem and its path printed."""
    work = tempfile.mkdtemp(prefix=prefix)
    keep = bool(os.environ.get("PYK8SRES_KEEP_WORK"))
    try:
        c, cp = hybrid.up(work, **up)
    except BaseException:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        yield c, cp, Kube(cp.kubeconfig)
    finally:
        subprocess.run(["scancel", "-u", "root"], env=c.env, capture_output=True)
        hybrid.down(work)
        if keep:
            print(f"kept the work directory {work} (PYK8SRES_KEEP_WORK)")
        else:
            shutil.rmtree(work, ignore_errors=True)
