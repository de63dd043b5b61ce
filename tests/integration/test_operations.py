"""Operations, end to end: the coordinator's /metrics scraped by a real
Prometheus (Debian's package) and queried through its HTTP API, /healthz and
/readyz, the alert rules (the Helm chart's files/prometheus-alerts.yaml) evaluated by that
Prometheus, and the Kubernetes Events the coordinator posts.

The cluster is `pyk8sres cluster up --kubernetes` (testbed/hybrid.py): real
munged/slurmctld/slurmd, the real control plane (kube-apiserver with RBAC,
kube-scheduler, kube-controller-manager, kwok), `pyk8sres sync` and
`pyk8sres webhook` as their own processes with their ServiceAccounts' tokens,
each serving /metrics on its --metrics-address.  Ground truth: the ledger's
show (inside slurmctld), `scontrol -d show node`, the API server's Events.
Ports: port(28100...) Slurm; the control plane, the webhook and the daemons'
metrics a free block in 31000-31990 (kubernetes.Ports); port(28130)
Prometheus, port(28131/28132) extra sync daemons, port(28133) nobody.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from conftest_kube import done, http_get, pick_ports
from local_slurm import SLURM, port, slurm_conf
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.policy.events import Limits
from pyk8sres.testbed import chart, hybrid

REPO = Path(__file__).resolve().parents[2]
ALERTS = chart.ALERTS
CPUS, MEMORY = 8, 16000
KUBE_PORTS = (31000, 31990)
NOBODY_SCHEDULES = "test-binds-it-itself"     # kube-scheduler leaves such pods to the test
PROM_PORT = port(28130)
MIB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (Slurm daemons)")


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def root():
    # Under /tmp, enterable by others: the coordinator runs as its own uid.
    path = Path(tempfile.mkdtemp(prefix="pyk8sres-ops-"))
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def hyb(root):
    work = str(root / "cluster")
    c, kas = hybrid.up(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=port(28100),
                       kube_port=pick_ports(*KUBE_PORTS), slurm=SLURM)
    try:
        with slurm_conf(c.conf):
            yield c, kas
    finally:
        hybrid.down(work)


@pytest.fixture(scope="module")
def kube(hyb):
    return kube_calls.Kube(hyb[1].kubeconfig)


@pytest.fixture(scope="module")
def ledger(hyb):
    return slurm_calls.Ledger(slurm_calls.ledger_socket_path(hyb[0].conf))


def metrics_ports(hyb) -> tuple[int, int]:
    """(sync's, the webhook's) --metrics-address ports, as hybrid.up assigns them."""
    return hyb[1].ports.sync_metrics, hyb[1].ports.webhook_metrics


@pytest.fixture(scope="module")
def prometheus(hyb, root):
    """A real Prometheus scraping both daemons every second, with our alert
    rules; its own storage; stopped by PID."""
    sync_metrics, webhook_metrics = metrics_ports(hyb)
    binary = shutil.which("prometheus")
    assert binary, "prometheus not installed (apt-get install prometheus; tools/install-deps.sh)"
    d = root / "prometheus"
    d.mkdir()
    conf = d / "prometheus.yml"
    conf.write_text(json.dumps({   # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "pyk8sres-sync",
             "static_configs": [{"targets": [f"127.0.0.1:{sync_metrics}"]}]},
            {"job_name": "pyk8sres-webhook",
             "static_configs": [{"targets": [f"127.0.0.1:{webhook_metrics}"]}]}]}))
    with open(d / "prometheus.log", "ab") as out:
        proc = subprocess.Popen([binary, f"--config.file={conf}", f"--storage.tsdb.path={d}/data",
                                 f"--web.listen-address=127.0.0.1:{PROM_PORT}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{PROM_PORT}"
    try:
        wait_for(lambda: proc.poll() is None and http_get(url + "/-/ready")[0] == 200, 60,
                 "prometheus ready")
        # Both targets scraped and up.
        wait_for(lambda: sorted(r["metric"]["job"] for r in query(url, "up == 1")) ==
                 ["pyk8sres-sync", "pyk8sres-webhook"], 60, "both targets up")
        yield url
    finally:
        _stop(proc, 20)


@pytest.fixture
def ns(kube, hyb):
    name = "ops-" + uuid.uuid4().hex[:6]
    done(kube.core.create_namespace({"metadata": {"name": name}}, _preload_content=False))
    yield name
    hyb[0].cancel_all_jobs()
    for p in kube_calls.list_pods(kube, name):
        kube_calls.delete_pod(kube, name, p["metadata"]["name"])
    done(kube.core.delete_namespace(name, _preload_content=False))


# ----------------------------------------------------------------- helpers

def wait_for(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (OSError, ValueError, KeyError, IndexError) as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")



def query(prom: str, expr: str) -> list:
    code, body = http_get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    doc = json.loads(body)
    assert code == 200 and doc["status"] == "success", (expr, body)
    return doc["data"]["result"]


def value(prom: str, expr: str) -> float | None:
    """The one sample of expr now (None: no series)."""
    r = query(prom, expr)
    assert len(r) <= 1, (expr, r)
    return float(r[0]["value"][1]) if r else None


def settle(prom: str, expr: str, want, timeout=45.0) -> float:
    """Wait until Prometheus' latest scrape gives `want` (a number or a predicate)."""
    ok = want if callable(want) else (lambda v: v == want)
    box = []

    def check():
        box[:] = [value(prom, expr)]
        return box[0] is not None and ok(box[0])
    try:
        wait_for(check, timeout, expr)
    except AssertionError:
        raise AssertionError(f"{expr}: last {box}, want {want}") from None
    return box[0]


def scraped(metrics_port: int, name: str, **labels) -> float:
    """A sample straight from a daemon's /metrics (0 if it has none yet)."""
    code, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert code == 200
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def pod(name, cpu, mem, node=None, scheduler=None):
    # Containers that stop at once: deleted with grace 0, the pod's share is
    # held only the test cluster's margin (a kubelet needs no grace period).
    spec = {"terminationGracePeriodSeconds": 0,
            "containers": [{"name": "c", "image": "x",
                            "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
    if node:
        spec["nodeName"] = node
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def sbatch(c, node, cpus, mem):
    out = subprocess.run(["sbatch", "--parsable", "-w", node, "-c", str(cpus), f"--mem={mem}",
                          "-o", "/dev/null", "--wrap", "sleep 600"],
                         env=c.env, capture_output=True, text=True, check=True).stdout
    job = out.strip().split(";")[0]
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=c.env,
                                    capture_output=True, text=True).stdout.strip() == "RUNNING",
             30, f"job {job} running")
    return job


def events(kube, namespace, **selector) -> list:
    sel = ",".join(f"{k}={v}" for k, v in selector.items())
    return kube_calls.list_events(kube, namespace, sel)


def webhook_in_force(kube, ns):
    """The webhook answers for n1 (its configuration reached the API server)."""
    def refused():
        try:
            kube_calls.create_pod(kube, ns, pod("probe", "100", "1Mi", node="n1"))
        except ApiException as e:
            return e.status == 403 and "does not fit" in (e.body or "")
        kube_calls.delete_pod(kube, ns, "probe")
        return False
    wait_for(refused, 30, "webhook in force")


# ----------------------------------------------------------------- tests

def test_promtool_accepts_the_alert_rules():
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (Debian package prometheus)"
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr


def test_health_endpoints(hyb):
    for p in metrics_ports(hyb):
        assert http_get(f"http://127.0.0.1:{p}/healthz") == (200, "ok\n")
        wait_for(lambda: http_get(f"http://127.0.0.1:{p}/readyz") == (200, "ok\n"), 30,
                 f"readyz on {p}")
        code, body = http_get(f"http://127.0.0.1:{p}/metrics")
        assert code == 200 and "pyk8sres_ledger_calls_total" in body
        assert http_get(f"http://127.0.0.1:{p}/nothing")[0] == 404


def test_node_shares_as_prometheus_sees_them(hyb, kube, ledger, prometheus, ns):
    c, _ = hyb
    webhook_in_force(kube, ns)
    job = sbatch(c, "n1", 2, 1000)
    for name, cpu, mem in (("a", "1500m", "1Gi"), ("b", "1", "512Mi")):
        kube_calls.create_pod(kube, ns, pod(name, cpu, mem, node="n1"))   # admitted: fits
    # What the two pods request, rounded up once (the ledger's rule): 3 CPUs, 1536 MB.
    want_cpu, want_mem = math.ceil(1.5 + 1), 1024 + 512
    sel = 'node="n1",side="kubernetes"'
    settle(prometheus, f'pyk8sres_node_allocated{{{sel},resource="cpu"}}', want_cpu)
    settle(prometheus, f'pyk8sres_node_allocated{{{sel},resource="memory"}}', want_mem * MIB)
    settle(prometheus, 'pyk8sres_node_allocated{node="n1",side="slurm",resource="cpu"}', 2)
    settle(prometheus, 'pyk8sres_node_allocated{node="n1",side="slurm",resource="memory"}',
           1000 * MIB)
    settle(prometheus, 'pyk8sres_node_free{node="n1",resource="cpu"}', CPUS - 2 - want_cpu)
    settle(prometheus, 'pyk8sres_node_free{node="n1",resource="memory"}',
           (MEMORY - 1000 - want_mem) * MIB)
    assert value(prometheus, 'pyk8sres_node_capacity{node="n1",resource="cpu"}') == CPUS
    assert value(prometheus, 'pyk8sres_node_oversubscribed{node="n1"}') == 0
    # Ground truth agrees: the ledger inside slurmctld, and Slurm's own GresUsed.
    shown = ledger.show("n1")["nodes"]["n1"]
    assert shown["share"] == {"cpu": want_cpu, "mem": want_mem}
    assert shown["jobs"] == {"cpu": 2, "mem": 1000}
    used = slurm_calls.get_node("n1").gres_used
    assert (used["k8scpu"], used["k8smemory"]) == (2 + want_cpu, 1000 + want_mem)
    # The webhook admitted both (plus the probes it refused); its latency was
    # recorded.  Another scrape target than the node figures above: wait for
    # its own next scrape (CI once read it before that, and got no series).
    settle(prometheus, 'sum(pyk8sres_admission_requests_total{result="allow",'
                       'reason="reserved"})', lambda v: v >= 2)
    settle(prometheus, 'sum(pyk8sres_admission_duration_seconds_count)', lambda v: v >= 3)
    settle(prometheus, 'sum(pyk8sres_ledger_calls_total{job="pyk8sres-webhook",'
                       'op="reserve"})', lambda v: v >= 2)
    settle(prometheus, 'pyk8sres_reconcile_duration_seconds_count{job="pyk8sres-sync"}',
           lambda v: v > 0)
    subprocess.run(["scancel", job], env=c.env, check=True)


def test_refused_pod_gets_one_event_with_a_count_and_the_deny_counter(hyb, kube, prometheus, ns):
    webhook_in_force(kube, ns)
    _, webhook_metrics = metrics_ports(hyb)
    deny = 'sum(pyk8sres_admission_requests_total{result="deny",reason="nofit"})'
    # From the webhook itself: Prometheus may not have scraped the probes yet.
    before = scraped(webhook_metrics, "pyk8sres_admission_requests_total",
                     result="deny", reason="nofit")
    # Not bound yet: allowed.  The test plays the scheduler that retries it
    # (kube-scheduler leaves a pod naming another scheduler alone).
    created = kube_calls.create_pod(kube, ns, pod("big", "7", "1Gi", scheduler=NOBODY_SCHEDULES))
    uid = created["metadata"]["uid"]
    job = sbatch(hyb[0], "n1", 4, 1000)                           # 4 of 8 CPUs left
    n = 25
    for _ in range(n):                                            # a scheduler retrying
        with pytest.raises(ApiException) as e:
            kube_calls.bind_pod(kube, ns, "big", "n1")
        assert e.value.status == 403 and "does not fit on node n1" in e.value.body
    settle(prometheus, deny, before + n)
    # One Event on the pod, its count all n refusals (the last ones folded and
    # written by the recorder within its update interval), not n objects.
    def one_event_counting_all():
        evs = events(kube, ns, **{"involvedObject.name": "big"})
        return len(evs) == 1 and evs[0]["count"] == n and evs
    evs = wait_for(one_event_counting_all, 30, f"one Event with count {n}")
    ev = evs[0]
    assert ev["reason"] == "InsufficientSharedCapacity" and ev["type"] == "Warning"
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": ns,
                                    "name": "big", "uid": uid}
    assert "node n1" in ev["message"] and "7000m CPU" in ev["message"]
    assert "Slurm jobs hold 4 of 8 CPUs" in ev["message"]
    assert ev["source"]["component"] == "pyk8sres-webhook"
    assert ev["firstTimestamp"] <= ev["lastTimestamp"]
    # kubectl describe pod shows it (it selects Events by the pod's UID).
    out = hyb[1].kubectl("describe", "pod", "-n", ns, "big").stdout
    assert "InsufficientSharedCapacity" in out and f"x{n} over" in out, out
    assert value(prometheus, 'sum(pyk8sres_events_total{job="pyk8sres-webhook",'
                             'action="folded"})') >= n - 5
    subprocess.run(["scancel", job], env=hyb[0].env, check=True)


def test_churn_of_refused_pods_stays_within_the_event_budget(hyb, kube, ns):
    """Many different pods refused at once: Events for the first ones (the
    budget's burst, then its rate), the rest suppressed and counted."""
    limits = Limits()
    webhook_in_force(kube, ns)
    _, webhook_metrics = metrics_ports(hyb)
    suppressed = scraped(webhook_metrics, "pyk8sres_events_total", action="suppressed")
    n = limits.burst + 40
    t0 = time.monotonic()
    for i in range(n):
        with pytest.raises(ApiException) as e:
            kube_calls.create_pod(kube, ns, pod(f"churn-{i}", "100", "1Mi", node="n1"))
        assert e.value.status == 403
    elapsed = time.monotonic() - t0
    wait_for(lambda: scraped(webhook_metrics, "pyk8sres_events_total", action="suppressed")
             > suppressed, 30, "suppressed Events counted")
    time.sleep(1)      # the recorder's queue is drained by now
    posted = [ev for ev in events(kube, ns) if ev["involvedObject"]["name"].startswith("churn-")]
    assert 0 < len(posted) <= limits.burst + limits.rate * (elapsed + 1) < n, (len(posted), elapsed)
    assert {ev["reason"] for ev in posted} == {"InsufficientSharedCapacity"}


def test_oversubscribed_node_event_gauge_and_alert(hyb, kube, prometheus, ns):
    c, kas = hyb
    job = sbatch(c, "n2", CPUS, 1000)                 # Slurm holds all of n2
    # A pod in a namespace the webhook excludes bypasses admission; the sync
    # daemon still counts it: n2 is now oversubscribed.
    kube_calls.create_pod(kube, "pyk8sres-system", pod("bypass", "2", "100Mi", node="n2"))
    try:
        settle(prometheus, 'pyk8sres_node_oversubscribed{node="n2"}', 1)
        assert settle(prometheus, 'pyk8sres_oversubscription_detected_total{node="n2"}',
                      lambda v: v >= 1)
        assert value(prometheus, 'pyk8sres_node_oversubscribed{node="n1"}') == 0
        evs = wait_for(lambda: events(kube, "default", **{
            "involvedObject.kind": "GenericNode", "involvedObject.name": "n2",
            "reason": "Oversubscribed"}), 30, "Oversubscribed Event on GenericNode n2")
        assert len(evs) == 1, evs
        ev = evs[0]
        gn = json.loads(kas.kubectl("get", "genericnode", "n2", "-o", "json").stdout)
        assert ev["involvedObject"]["uid"] == gn["metadata"]["uid"]
        assert ev["involvedObject"]["apiVersion"] == "pyk8sres.io/v1alpha1"
        assert "n2" in ev["message"] and "2 CPUs" in ev["message"]
        assert ev["source"]["component"] == "pyk8sres-sync"
        out = kas.kubectl("describe", "genericnode", "n2").stdout     # what an admin reads
        assert "Oversubscribed" in out and "pyk8sres-sync" in out, out
        # The alert rule sees it (pending: its `for` is 1 minute).
        def alerting():
            code, body = http_get(f"{prometheus}/api/v1/alerts")
            return [a for a in json.loads(body)["data"]["alerts"]
                    if a["labels"]["alertname"] == "PyK8sResNodeOversubscribed"]
        alerts = wait_for(alerting, 30, "PyK8sResNodeOversubscribed pending")
        assert [a["labels"]["node"] for a in alerts] == ["n2"]
        assert alerts[0]["state"] in ("pending", "firing")
    finally:
        kube_calls.delete_pod(kube, "pyk8sres-system", "bypass")
        subprocess.run(["scancel", job], env=c.env)
    settle(prometheus, 'pyk8sres_node_oversubscribed{node="n2"}', 0)


def _sync(hyb, root, name, metrics_port, kubeconfig):
    """An extra sync daemon (no Events, no GenericNodes), stopped by PID by the caller."""
    c, _ = hyb
    log = open(root / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "pyk8sres.cli", "sync", "--kubeconfig", kubeconfig,
         "--no-events", "--no-generic-nodes", "--metrics-address", f"127.0.0.1:{metrics_port}"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(c.env, PYTHONUNBUFFERED="1"),
        start_new_session=True)


def _stop(proc, timeout: float = 15):
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_readiness_follows_the_ledger_and_the_watches(hyb, kube, prometheus, ns, root):
    c, kas = hyb
    webhook_in_force(kube, ns)
    sync_metrics, webhook_metrics = metrics_ports(hyb)
    # The extra daemons are sync too: its ServiceAccount's token.
    token = kas.service_account_kubeconfig(hybrid.SYNC_ACCOUNT, hybrid.NAMESPACE)
    # A kubeconfig pointing at a port nobody serves: the watches never list.
    bad = root / "bad-kubeconfig"
    bad.write_text(Path(token).read_text().replace(f":{kas.ports.apiserver}",
                                                   f":{port(28133)}"))
    assert bad.read_text() != Path(token).read_text()
    errors_before = value(prometheus, 'sum(pyk8sres_ledger_errors_total{job="pyk8sres-sync"})') or 0
    slurm_read_before = value(
        prometheus, 'pyk8sres_reconcile_errors_total{stage="slurm_read"}') or 0
    c.stop("slurmctld")
    fresh = unlisted = None
    try:
        for p in (sync_metrics, webhook_metrics):
            code, body = wait_for(lambda: (lambda r: r[0] == 503 and r)(
                http_get(f"http://127.0.0.1:{p}/readyz")), 30, f"readyz 503 on {p}")
            assert "ledger: the ledger did not answer" in body, body
            assert http_get(f"http://127.0.0.1:{p}/healthz") == (200, "ok\n")
        # Started while slurmctld is down: not ready from the start.
        fresh = _sync(hyb, root, "sync-fresh", port(28131), token)
        code, body = wait_for(lambda: (lambda r: r[0] == 503 and "ledger" in r[1] and r)(
            http_get(f"http://127.0.0.1:{port(28131)}/readyz")), 30, "fresh sync readyz 503")
        # A pod is refused with the reason and gets an Event; the sync daemon
        # puts one on the GenericNode (its sets fail).
        with pytest.raises(ApiException) as e:
            kube_calls.create_pod(kube, ns, pod("late", "1", "1Gi", node="n1"))
        assert e.value.status == 403 and "ledger did not answer" in e.value.body
        wait_for(lambda: [ev for ev in events(kube, ns, **{"involvedObject.name": "late"})
                          if ev["reason"] == "LedgerUnreachable"], 30, "Event on the pod")
        gn = wait_for(lambda: [ev for ev in events(kube, "default", **{
            "involvedObject.kind": "GenericNode", "involvedObject.name": "n1",
            "reason": "LedgerUnreachable"})], 60, "LedgerUnreachable Event on GenericNode n1")
        assert len(gn) == 1 and gn[0]["source"]["component"] == "pyk8sres-sync"
        assert "Slurm's ledger" in gn[0]["message"] and "n1" in gn[0]["message"]
        settle(prometheus, 'pyk8sres_ready{job="pyk8sres-webhook"}', 0)
        settle(prometheus, 'sum(pyk8sres_ledger_errors_total{job="pyk8sres-sync"})',
               lambda v: v > errors_before)
        settle(prometheus, 'pyk8sres_reconcile_errors_total{stage="slurm_read"}',
               lambda v: v > slurm_read_before)
        settle(prometheus, 'count(ALERTS{alertname="PyK8sResNotReady",alertstate="pending"})',
               lambda v: v >= 1)
    finally:
        c.start_slurmctld()
    try:
        unlisted = _sync(hyb, root, "sync-unlisted", port(28132), str(bad))
        for p in (sync_metrics, webhook_metrics, port(28131)):
            wait_for(lambda: http_get(f"http://127.0.0.1:{p}/readyz") == (200, "ok\n"), 45,
                     f"readyz 200 on {p} once slurmctld is back")
        # The ledger answers it too, but its watches never listed ("starting" first).
        code, body = wait_for(lambda: (lambda r: r[0] == 503 and "watches" in r[1] and
                                       "ledger" not in r[1] and r)(
            http_get(f"http://127.0.0.1:{port(28132)}/readyz")), 30, "unlisted: only the watches")
        assert body == "watches: pods, nodes not listed/watched (or silent)\n", body
        for kind in ("pods", "nodes"):     # each failed list counts as a restart
            assert scraped(port(28132), "pyk8sres_watch_restarts_total", kind=kind,
                           reason="error") >= 1
        assert http_get(f"http://127.0.0.1:{port(28132)}/healthz") == (200, "ok\n")
        settle(prometheus, 'pyk8sres_ready{job="pyk8sres-webhook"}', 1)
    finally:
        for proc in (fresh, unlisted):
            if proc is not None:
                _stop(proc)
