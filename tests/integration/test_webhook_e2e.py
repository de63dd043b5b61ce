"""End to end: the admission webhook (pyk8sres/coordinator/webhook.py) between
a real local Slurm cluster (with the ledger inside slurmctld) and a real
Kubernetes API server; placeholder pods; and a kube-scheduler stand-in.

No kube-scheduler binary can be had here (Debian, PyPI and npm ship none),
so the scheduler path is driven by pyk8sres/testbed/scheduler.py, which fits
pods by requests against allocatable minus the pods already bound, POSTs
pods/binding and backs off on errors, as kube-scheduler does.

Ground truth only: Slurm's GresUsed (`scontrol -d show node`: jobs + the
share the ledger holds), job states from squeue, pods from the API server.
Ports: port(27600...) Slurm, port(27700) API server, port(27710) webhook,
port(27713) the repair's health.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
from kubernetes.client.exceptions import ApiException

from local_slurm import SLURM, port
from pyk8sres.coordinator import kube as K
from pyk8sres.coordinator import slurm as S
from pyk8sres.coordinator import sync
from pyk8sres.coordinator import webhook as W
from pyk8sres.coordinator.placeholder import Placeholders
from pyk8sres.policy import placeholder as P
from pyk8sres.policy.admission import MIRROR_ANNOTATION as A_MIRROR
from pyk8sres.testbed import cluster as slurm_cluster
from pyk8sres.testbed.kubeapi_server import KubeAPIServer
from pyk8sres.testbed.scheduler import Scheduler

from conftest_kube import RBAC_MANIFEST, http_get

NODE_CPUS, NODE_MEM = 8, 16000
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")


@pytest.fixture(scope="module")
def root():
    return tempfile.mkdtemp(prefix="pyk8sres-adm-it-")


@pytest.fixture(scope="module")
def slurm(root):
    work = f"{root}/slurm"
    c = slurm_cluster.up(work, nodes=2, cpus=NODE_CPUS, memory=NODE_MEM, base_port=port(27600),
                         synced=True, slurm=SLURM)
    os.environ["SLURM_CONF"] = c.conf
    yield c
    subprocess.run(["scancel", "--full", "-u", "root"], env=c.env, capture_output=True)
    slurm_cluster.down(work)


@pytest.fixture(scope="module")
def api(kube_paths, root):
    server = KubeAPIServer(kube_paths).start(f"{root}/kube", port(27700))
    server.apply(RBAC_MANIFEST)          # the pyk8sres-system namespace
    yield server
    server.stop()


@pytest.fixture(scope="module")
def kube(api):
    k = K.Kube(api.kubeconfig)
    for n in ("n1", "n2"):
        k.core.create_node({"metadata": {"name": n}, "status": {
            "allocatable": {"cpu": str(NODE_CPUS), "memory": f"{NODE_MEM}Mi"},
            "capacity": {"cpu": str(NODE_CPUS), "memory": f"{NODE_MEM}Mi"}}},
            _preload_content=False).release_conn()
    return k


@pytest.fixture(scope="module")
def ledger(slurm):
    return S.Ledger(S.ledger_socket_path(slurm.conf))


@pytest.fixture(scope="module")
def webhook(slurm, kube, ledger, root):
    p = port(27710)
    wcfg = W.WebhookConfig(listen=f"127.0.0.1:{p}", url=f"https://127.0.0.1:{p}/validate",
                           cert_dir=f"{root}/webhook-tls", refresh_seconds=1.0)
    hook = W.Webhook(wcfg, sync.SyncConfig(), kube, ledger).start()
    yield hook
    hook.stop()


@pytest.fixture(scope="module")
def repair(slurm, api, root):
    """The sync daemon (level-triggered repair): releases the share of pods
    that are deleted or terminal.  Its own process, stopped by PID."""
    conf, health = f"{root}/sync.toml", port(27713)
    with open(conf, "w") as f:
        f.write("resync_seconds = 0.5\n")
    with open(f"{root}/sync.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pyk8sres.coordinator.sync",
                                 "--kubeconfig", api.kubeconfig, "--config", conf,
                                 "--metrics-address", f"127.0.0.1:{health}"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(slurm.env),
                                start_new_session=True)
    # Ready (pods listed) before the first test: a pod created and deleted
    # before the repair lists pods leaves its reservation for the whole
    # grace period, longer than the tests wait for nodes to empty.
    wait_for(lambda: ready(f"http://127.0.0.1:{health}/readyz"), 30, "the repair ready")
    yield proc
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def ns(kube, slurm, ledger, repair):
    name = "a-" + uuid.uuid4().hex[:8]
    kube.core.create_namespace({"metadata": {"name": name}}, _preload_content=False).release_conn()
    yield name
    subprocess.run(["scancel", "-u", "root"], env=slurm.env, capture_output=True)
    for p in K.list_pods(kube, name):
        K.delete_pod(kube, name, p["metadata"]["name"])
    kube.core.delete_namespace(name, _preload_content=False).release_conn()
    # Nothing leaks: the repair releases deleted pods' shares.
    wait_for(lambda: used(slurm, "n1") == (0, 0) and used(slurm, "n2") == (0, 0), 30,
             "nodes empty")


# ----------------------------------------------------------------- helpers

def wait_for(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def ready(url: str) -> bool:
    try:
        return http_get(url)[0] == 200
    except OSError:             # not listening yet
        return False


def used(slurm, node):
    """Slurm's own word: k8scpu/k8smemory allocated = jobs + Kubernetes' share."""
    n = S.get_node(node)
    return n.gres_used.get("k8scpu", 0), n.gres_used.get("k8smemory", 0)


def sbatch(slurm, node, cpus, mem=1000):
    out = subprocess.run(["sbatch", "--parsable", "-w", node, "-c", str(cpus), f"--mem={mem}",
                          "--wrap", "sleep 300"],
                         env=slurm.env, capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


def job_state(slurm, job):
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=slurm.env,
                         capture_output=True, text=True).stdout.split()
    return tuple(out[:2]) if out else ("GONE", "")


def pod(name, cpu, mem="1Gi", node=None):
    spec = {"containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def active(kube, ns):
    """Wait until the webhook is in force: its configuration reaches the API
    server's plugin through an informer, and the ledger answers (slurmctld
    may have just restarted).  The probe asks for more than any node has:
    refused by the ledger, so it reserves nothing."""
    last = []

    def refused():
        try:
            K.create_pod(kube, ns, pod("probe", "100", node="n1"))
        except ApiException as e:
            last[:] = [e.status, e.body]
            return e.status == 403 and "does not fit" in (e.body or "")
        last[:] = ["created"]
        K.delete_pod(kube, ns, "probe")
        return False
    try:
        wait_for(refused, 30, "webhook in force")
    except AssertionError:
        raise AssertionError(f"webhook not in force: last answer {last}; configuration "
                             f"{K.get_webhook_config(kube, 'pyk8sres-admission')}") from None


# ----------------------------------------------------------------- tests

def test_refusal_names_node_and_slurm_and_nothing_is_double_booked(slurm, kube, webhook, ns, ledger):
    active(kube, ns)
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")
    # pods with spec.nodeName on the node Slurm holds: refused, with the reason
    with pytest.raises(ApiException) as e:
        K.create_pod(kube, ns, pod("direct", "4", node="n1"))
    assert e.value.status == 403
    assert "does not fit on node n1" in e.value.body and "n1" in e.value.body
    print("refusal:", e.value.body)
    # nothing the pod's creator writes exempts it (issue 8 item 9)
    selfish = pod("selfish", "4", node="n1")
    selfish["metadata"]["labels"] = {"pyk8sres.io/slurm-worker": "true"}
    selfish["metadata"]["annotations"] = {"pyk8sres.io/slurm-worker": "true"}
    with pytest.raises(ApiException) as e:
        K.create_pod(kube, ns, selfish)
    assert e.value.status == 403 and "does not fit on node n1" in e.value.body
    # the scheduler path: pods/binding to the same node
    K.create_pod(kube, ns, pod("sched", "4"))
    with pytest.raises(ApiException) as e:
        K.bind_pod(kube, ns, "sched", "n1")
    assert e.value.status == 403 and "does not fit on node n1" in e.value.body
    assert (K.get_pod(kube, ns, "sched") or {})["spec"].get("nodeName") is None
    assert used(slurm, "n1")[0] == 6                       # only the job
    # the other node has room: allowed, and Slurm holds the pod's share
    K.bind_pod(kube, ns, "sched", "n2")
    assert K.get_pod(kube, ns, "sched")["spec"]["nodeName"] == "n2"
    assert used(slurm, "n2") == (4, 1024)
    # ...so a job that needs more than what is left pends on Resources
    j2 = sbatch(slurm, "n2", 5)
    wait_for(lambda: job_state(slurm, j2) == ("PENDING", "Resources"), 20, "job 2 pends")
    # fits exactly: 2 CPUs left on n1
    K.create_pod(kube, ns, pod("fits", "2", "512Mi", node="n1"))
    assert used(slurm, "n1") == (8, 1000 + 512)


def test_idempotent_dry_run_and_resize(slurm, kube, webhook, ns, ledger):
    active(kube, ns)
    K.create_pod(kube, ns, pod("p", "2", "1Gi"))
    kube.core.create_namespaced_pod_binding(
        "p", ns, {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n2"}},
        dry_run="All", _preload_content=False).release_conn()
    assert used(slurm, "n2") == (0, 0)                      # dry run: nothing reserved
    K.bind_pod(kube, ns, "p", "n2")
    with pytest.raises(ApiException) as e:                  # a retry: already bound (409)
        K.bind_pod(kube, ns, "p", "n2")
    assert e.value.status == 409
    assert used(slurm, "n2") == (2, 1024)                   # reserved once
    uid = K.get_pod(kube, ns, "p")["metadata"]["uid"]
    assert ledger.show("n2")["nodes"]["n2"]["entries"] == {uid: [2000, 1 << 30]}
    # pods/resize: an increase that fits is reserved, one that does not is refused
    K.resize_pod(kube, ns, "p", [{"name": "c", "resources": {"requests": {"cpu": "6",
                                                                          "memory": "1Gi"}}}])
    assert used(slurm, "n2") == (6, 1024)
    with pytest.raises(ApiException) as e:
        K.resize_pod(kube, ns, "p", [{"name": "c", "resources": {"requests": {"cpu": "9",
                                                                              "memory": "1Gi"}}}])
    assert e.value.status == 403 and "n2" in e.value.body
    assert K.get_pod(kube, ns, "p")["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "6"
    assert used(slurm, "n2") == (6, 1024)


def test_fail_closed_when_slurmctld_is_down(slurm, kube, webhook, ns):
    active(kube, ns)
    K.create_pod(kube, ns, pod("w", "1"))
    slurm.stop("slurmctld")
    try:
        with pytest.raises(ApiException) as e:
            K.bind_pod(kube, ns, "w", "n1")
        assert e.value.status == 403 and "ledger did not answer" in e.value.body
        assert K.get_pod(kube, ns, "w")["spec"].get("nodeName") is None
        # a node not shared with Slurm is unaffected (the matchCondition never sends it)
        K.create_pod(kube, ns, pod("other", "1", node="not-shared"))
    finally:
        slurm.restart_slurmctld()


def test_fail_closed_when_coordinator_is_down(slurm, kube, webhook, ns):
    active(kube, ns)
    K.create_pod(kube, ns, pod("w", "1"))
    webhook.server.close()
    try:
        with pytest.raises(ApiException) as e:
            K.bind_pod(kube, ns, "w", "n1")
        assert e.value.status >= 500 and "failed calling webhook" in e.value.body
        K.bind_pod(kube, ns, "w", "not-shared")             # other nodes unaffected
        assert used(slurm, "n1") == (0, 0)
    finally:
        host, p = webhook.addr
        webhook.server = W.WebhookServer((host, p), webhook.server.admission,
                                         webhook.server.cert_file, webhook.server.key_file)
        threading.Thread(target=webhook.server.serve_forever, daemon=True).start()


def test_placeholder_follows_slurm_and_scheduler_goes_elsewhere(slurm, kube, webhook, ns, ledger,
                                                                 repair):
    """The demo's story: kube-scheduler (stand-in) sees Slurm's share through
    the placeholder pod and places the pod on the other node; without the
    placeholder it picks the full node, is refused, backs off."""
    active(kube, ns)
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")

    # 1) no placeholder: the scheduler sees n1 as empty as n2, picks it, is refused.
    K.create_pod(kube, ns, pod("web", "4"))
    tried = Scheduler(kube, namespace=ns, node_names=["n1"]).run_once()
    assert tried == [(f"{ns}/web", "n1", "403")]

    # 2) placeholders on: slurm-share-n1 holds the job's 6 CPUs within a second
    ph = Placeholders(kube, ledger, W.Scope(sync.SyncConfig()), "pyk8sres-system").start()
    try:
        name = P.name_for("n1")
        wait_for(lambda: P.current(K.get_pod(kube, "pyk8sres-system", name) or {}) ==
                 (6000, 1000 << 20), 5, "placeholder sized to the job")
        assert used(slurm, "n1")[0] == 6          # the placeholder reserved nothing
        sched = Scheduler(kube, namespace=ns, node_names=["n1", "n2"])
        tried = sched.run_once()
        assert tried == [(f"{ns}/web", "n2", None)]
        assert K.get_pod(kube, ns, "web")["spec"]["nodeName"] == "n2"

        # job end: the placeholder shrinks within a second (resized in place, same UID)
        uid = K.get_pod(kube, "pyk8sres-system", name)["metadata"]["uid"]
        subprocess.run(["scancel", job], env=slurm.env, check=True)
        t_cancel = time.monotonic()
        t_gone = t_ph = None
        while time.monotonic() - t_cancel < 20 and (t_gone is None or t_ph is None):
            now = time.monotonic()
            if t_gone is None and job_state(slurm, job)[0] not in ("RUNNING", "COMPLETING"):
                t_gone = now
            if t_ph is None and P.current(K.get_pod(kube, "pyk8sres-system", name) or {}) == (0, 0):
                t_ph = now
            time.sleep(0.02)
        assert t_gone is not None and t_ph is not None
        print(f"placeholder resized {t_ph - t_cancel:.2f} s after scancel, "
              f"{t_ph - t_gone:+.2f} s after the job left squeue")
        assert t_ph - t_gone < 1.0
        assert K.get_pod(kube, "pyk8sres-system", name)["metadata"]["uid"] == uid
        # job start: grows within a second
        j2 = sbatch(slurm, "n1", 3)
        wait_for(lambda: job_state(slurm, j2)[0] == "RUNNING", 20, "job 2 running")
        t0 = time.monotonic()
        wait_for(lambda: P.current(K.get_pod(kube, "pyk8sres-system", name) or {}) ==
                 (3000, 1000 << 20), 5, "placeholder grows")
        print(f"placeholder resized {time.monotonic() - t0:.2f} s after the job showed RUNNING")
        assert time.monotonic() - t0 < 1.0
    finally:
        ph.stop()
        for n in ("n1", "n2"):
            K.delete_pod(kube, "pyk8sres-system", P.name_for(n))


def test_certificate_and_ca_rotation_under_traffic(slurm, kube, ledger, ns, root):
    """Short lifetimes: the serving certificate renews every few seconds and
    the CA rotates (new CA in caBundle first, signing later), while the API
    server keeps calling the webhook: every call gets through TLS."""
    from cryptography import x509
    p = port(27711)
    wcfg = W.WebhookConfig(listen=f"127.0.0.1:{p}", url=f"https://127.0.0.1:{p}/validate",
                           cert_dir=f"{root}/rotating-tls", refresh_seconds=0.5,
                           configuration="pyk8sres-rotation", cert_days=6 / 86400,
                           ca_days=24 / 86400, ca_promote_seconds=3)
    hook = W.Webhook(wcfg, sync.SyncConfig(), kube, ledger).start()
    served = []                      # monotonic times of the calls that reached us
    review = hook.server.admission.review
    hook.server.admission.review = lambda body: served.append(time.monotonic()) or review(body)
    try:
        def cas():
            return {c.subject.rfc4514_string()
                    for c in x509.load_pem_x509_certificates(hook.certs.bundle())}
        certs, seen_cas, failures = set(), set(cas()), []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 40:
            try:   # more than n1 has: refused by the ledger, nothing reserved
                K.create_pod(kube, ns, pod("probe", "100", node="n1"))
                failures.append("allowed")
            except ApiException as e:
                if "pyk8sres-rotation" in e.body or "x509" in e.body or "tls" in e.body.lower():
                    failures.append(e.body[:300])
            certs.add(open(hook.certs.cert_file).read())
            seen_cas |= cas()
            time.sleep(0.2)
        print(f"{len(served)} calls served, {len(certs)} serving certificates, "
              f"{len(seen_cas)} CAs, {len(failures)} failures")
        # The configuration takes a moment to reach the API server's plugin.
        first = served[0] if served else None
        assert first is not None and first - t0 < 5
        assert not failures, failures[:3]
        assert len(certs) >= 4 and len(seen_cas) >= 2
        # no gap: calls kept arriving through every renewal
        gaps = [b - a for a, b in zip(served, served[1:])]
        assert max(gaps) < 2.0, max(gaps)
    finally:
        hook.stop()
        kube.admission.delete_validating_webhook_configuration(
            "pyk8sres-rotation", _preload_content=False).release_conn()


def test_cert_manager_mode(slurm, kube, ledger, ns, root):
    """With tls_cert_file/tls_key_file (a cert-manager Secret mounted as
    files) the coordinator serves those, reloads them when they change, and
    leaves caBundle to cert-manager's cainjector (played here by the test)."""
    import base64
    issuer = W.Certs(f"{root}/cert-manager", ["localhost"], ["127.0.0.1"], 1, 10, 60)
    issuer.ensure()
    p = port(27712)
    name = "pyk8sres-cm"
    wcfg = W.WebhookConfig(listen=f"127.0.0.1:{p}", url=f"https://127.0.0.1:{p}/validate",
                           tls_cert_file=issuer.cert_file, tls_key_file=issuer.key_file,
                           configuration=name, refresh_seconds=0.5)
    hook = W.Webhook(wcfg, sync.SyncConfig(), kube, ledger).start()
    served = []
    review = hook.server.admission.review
    hook.server.admission.review = lambda body: served.append(time.monotonic()) or review(body)

    def inject():   # what cainjector does
        cur = K.get_webhook_config(kube, name)
        cur["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(issuer.bundle()).decode()
        K.put_webhook_config(kube, cur)

    def calls_get_through():
        n = len(served)
        try:
            K.create_pod(kube, ns, pod("probe", "100", node="n1"))
        except ApiException:
            pass
        return len(served) > n
    try:
        cur = wait_for(lambda: K.get_webhook_config(kube, name), 10, "configuration")
        assert "caBundle" not in cur["webhooks"][0]["clientConfig"]   # not ours to set
        inject()
        wait_for(calls_get_through, 20, "calls with the injected CA")
        # cert-manager renews with a new CA: files change, cainjector updates the bundle
        import shutil
        shutil.rmtree(f"{root}/cert-manager")
        fresh = W.Certs(f"{root}/cert-manager", ["localhost"], ["127.0.0.1"], 1, 10, 60)
        fresh.ensure()
        issuer = fresh
        inject()
        wait_for(calls_get_through, 20, "calls after the renewal")
        cur = K.get_webhook_config(kube, name)
        assert base64.b64decode(cur["webhooks"][0]["clientConfig"]["caBundle"]) == fresh.bundle()
    finally:
        hook.stop()
        kube.admission.delete_validating_webhook_configuration(
            name, _preload_content=False).release_conn()


def test_static_pod_from_its_kubelet_is_allowed_and_counted_even_over_capacity(
        slurm, kube, webhook, ns, ledger, repair, api):
    """A static pod runs because its kubelet started it; the mirror pod the
    kubelet then creates is only its record.  Refusing it would hide a
    running pod from both sides, so the node's own kubelet (system:node:n1)
    gets it allowed, counted, and the node reported oversubscribed.  The
    mirror annotation written by anyone else exempts nothing."""
    active(kube, ns)
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")
    static = pod("etcd-n1", "4", "1Gi", node="n1")
    static["metadata"]["annotations"] = {A_MIRROR: "0123abcd"}
    with pytest.raises(ApiException) as e:                  # a user, with the annotation
        K.create_pod(kube, ns, static)
    assert e.value.status == 403 and "does not fit on node n1" in e.value.body
    kubelet = K.Kube(api.kubeconfig)
    kubelet.api.set_default_header("Impersonate-User", "system:node:n1")
    kubelet.api.set_default_header("Impersonate-Group", "system:nodes")
    K.create_pod(kubelet, ns, static)                        # the kubelet: allowed
    uid = K.get_pod(kube, ns, "etcd-n1")["metadata"]["uid"]
    # The repair counts it (its share cannot be carried next to the job) ...
    view = wait_for(lambda: (lambda v: v if uid in v.get("entries", {}) else None)(
        ledger.show("n1")["nodes"]["n1"]), 10, "static pod in the ledger")
    assert view["entries"][uid] == [4000, 1 << 30] and view["oversubscribed"] is True
    # ... so Slurm starts nothing more there, and a pod is refused.
    assert used(slurm, "n1")[0] == 8
    j2 = sbatch(slurm, "n1", 1)
    wait_for(lambda: job_state(slurm, j2) == ("PENDING", "Resources"), 20, "job 2 pends")
    with pytest.raises(ApiException) as e:
        K.create_pod(kube, ns, pod("late", "100m", "10Mi", node="n1"))
    assert e.value.status == 403
    # The job ends: the static pod fits again, and the job that pended runs.
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    wait_for(lambda: job_state(slurm, j2)[0] == "RUNNING", 30, "job 2 runs")
    assert ledger.show("n1")["nodes"]["n1"]["oversubscribed"] is False
