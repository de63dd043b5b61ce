"""End to end: the admission webhook (pyk8sres/coordinator/webhook.py)
between a real local Slurm cluster (the ledger inside slurmctld) and the
real Kubernetes control plane (`pyk8sres cluster up --kubernetes`:
kube-apiserver with RBAC, kube-scheduler, kube-controller-manager, kwok as
the kubelets).  The coordinator runs as its ServiceAccounts and its own uid
(hybrid.py: LedgerUsers=, never SlurmUser); the API server calls the webhook
with its client certificate.

Ground truth only: Slurm's GresUsed (`scontrol -d show node`: jobs + the
share the ledger holds), its running jobs' CPU_IDs and Mem (`scontrol -d
show job`), job states from squeue, pods the API server has bound.

Nodes: n1, n2 (8 CPUs, 16000 MB) shared with Slurm; k8s-only, a Kubernetes
node Slurm does not have (cordoned, so the real kube-scheduler only places
the tests' pods on n1/n2).  Pods a test binds itself name a scheduler nobody
runs; the others are the real kube-scheduler's.
Ports: port(27600...) Slurm; the control plane and the coordinator
pick_ports(27700, 27790) (kubernetes.Ports).
The helpers and the hostile callers are in webhook_world.py.
"""

from __future__ import annotations

import base64
import os
import pwd
import re
import resource
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from conftest_kube import http_get, pick_ports
from local_slurm import SLURM, port, requires_slurm, slurm_conf
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator import slurm as slurm_calls
from pyk8sres.coordinator.certs import Certs
from pyk8sres.policy.admission import MIRROR_ANNOTATION
from pyk8sres.testbed import cluster, hybrid
from pyk8sres.testbed.faults import Caller
from webhook_world import (KUBELET_RESIZE, NODE_CPUS, NODE_MEM, NOBODY_SCHEDULES, active,
                           cpu_to, flood_webhook, hold_ledger, http_status, in_process_webhook,
                           job_state, no_double_booking, node_of, pod, probe_reach, ran_with,
                           refused_every_way, resize_pending, restart_coordinator_webhook, sbatch,
                           timed_create, used, wait_for)

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def world():
    work = tempfile.mkdtemp(prefix="pyk8sres-adm-it-")
    c, kube = hybrid.up(work, nodes=2, cpus=NODE_CPUS, memory=NODE_MEM, base_port=port(27600),
                        kube_port=pick_ports(27700, 27790), slurm=SLURM)
    try:
        kube.register_nodes({"k8s-only": (4, 8000)})
        kube.kubectl("cordon", "k8s-only")
        with slurm_conf(c.conf):
            yield c, kube
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=c.env, capture_output=True)
        hybrid.down(work)
        shutil.rmtree(work, ignore_errors=True)


def test_the_coordinator_runs_as_its_own_uid_with_the_ledger_and_nothing_else(world):
    """Both daemons as uid pyk8sres (listed in LedgerUsers=, never root or
    SlurmUser), admitting pods (the other tests here); that uid reaches the
    ledger through its own directory and cannot read StateSaveLocation, the
    journal or the munge key."""
    c, _ = world
    me = hybrid.coordinator_user()
    conf = open(os.path.join(c.work, "etc", "k8s_resources.conf")).read()
    assert f"LedgerUsers={me.pw_uid}\n" in conf
    for name in ("sync", "webhook"):
        pid = int(open(os.path.join(c.work, "run", f"proc-{name}.pid")).read())
        status = open(f"/proc/{pid}/status").read()
        ids = {k: {int(v) for v in re.search(rf"^{k}:[ \t]*(.*)$", status, re.M).group(1).split()}
               for k in ("Uid", "Gid", "Groups")}
        assert ids["Uid"] == {me.pw_uid} and ids["Gid"] == {me.pw_gid}, (name, ids)
        assert ids["Groups"] <= {me.pw_gid}, (name, ids)
    path = slurm_calls.ledger_socket_path(c.conf)
    assert os.path.dirname(path) == os.path.join(c.work, "ledger")
    state = os.path.join(c.work, "state")
    child = Caller(me.pw_uid, [me.pw_gid], probe_reach, path, state,
                   os.path.join(state, "k8s_resources.ledger"),
                   os.path.join(c.work, "munge", "munge.key"))
    event = child.queue.get(timeout=30)
    child.proc.join(10)
    assert event[0] == "done", event
    ok, nodes, denied = event[1]
    assert (ok, nodes) == (True, ["n1", "n2"])
    assert denied == ["journal", "munge key", "state"]


@pytest.fixture(scope="module")
def slurm(world):
    return world[0]


@pytest.fixture(scope="module")
def control_plane(world):
    return world[1]


@pytest.fixture(scope="module")
def kube(control_plane):
    """The test's own client: the cluster's admin."""
    return kube_calls.Kube(control_plane.kubeconfig)


@pytest.fixture(scope="module")
def ledger(slurm):
    return slurm_calls.Ledger(slurm_calls.ledger_socket_path(slurm.conf))


@pytest.fixture
def ns(kube, slurm, ledger):
    name = "a-" + uuid.uuid4().hex[:8]
    kube.core.create_namespace({"metadata": {"name": name}})
    yield name
    subprocess.run(["scancel", "-u", "root"], env=slurm.env, capture_output=True)
    for p in kube_calls.list_pods(kube, name):
        kube_calls.delete_pod(kube, name, p["metadata"]["name"])
    kube.core.delete_namespace(name)
    # Nothing leaks: the sync daemon releases deleted pods' shares.
    wait_for(lambda: used(slurm, "n1") == (0, 0) and used(slurm, "n2") == (0, 0), 30,
             "nodes empty")


# ----------------------------------------------------------------- tests

def test_refusal_names_node_and_slurm_and_nothing_is_double_booked(slurm, kube, ns):
    active(kube, ns)
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")
    # every way onto the node Slurm holds is refused, with the reason
    body = refused_every_way(kube, ns, "n1", "4")
    assert "Slurm jobs hold 6 of 8 CPUs" in body
    print("refusal:", body)
    assert used(slurm, "n1")[0] == 6                       # only the job
    # the other node has room: allowed, and Slurm holds the pod's share
    kube_calls.bind_pod(kube, ns, "sched", "n2")
    assert node_of(kube, ns, "sched") == "n2"
    assert used(slurm, "n2") == (4, 1024)
    # ...so a job that needs more than what is left pends on Resources
    j2 = sbatch(slurm, "n2", 5)
    wait_for(lambda: job_state(slurm, j2) == ("PENDING", "Resources"), 20, "job 2 pends")
    # fits exactly: 2 CPUs left on n1
    kube_calls.create_pod(kube, ns, pod("fits", "2", "512Mi", node="n1"))
    assert used(slurm, "n1") == (8, 1000 + 512)
    # The real kube-scheduler: a 4-CPU pod goes where Slurm left room (n2),
    # never to n1, which it sees full (the job's placeholder + "fits").
    kube_calls.create_pod(kube, ns, pod("web", "4"))
    assert wait_for(lambda: node_of(kube, ns, "web"), 20, "web bound") == "n2"
    assert used(slurm, "n2") == (8, 2048)
    assert job_state(slurm, j2)[0] == "PENDING"
    no_double_booking(slurm, kube)


def test_idempotent_dry_run_and_resize(slurm, kube, ns, ledger):
    active(kube, ns)
    kube_calls.create_pod(kube, ns, pod("p", "2", "1Gi", scheduler=NOBODY_SCHEDULES))
    resp = kube.core.create_namespaced_pod_binding(   # answered with a Status: read raw
        "p", ns, {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n2"}},
        dry_run="All", _preload_content=False)
    resp.drain_conn()
    resp.release_conn()
    assert used(slurm, "n2") == (0, 0)                      # dry run: nothing reserved
    kube_calls.bind_pod(kube, ns, "p", "n2")
    with pytest.raises(ApiException) as e:                  # a retry: already bound (409)
        kube_calls.bind_pod(kube, ns, "p", "n2")
    assert e.value.status == 409
    assert used(slurm, "n2") == (2, 1024)                   # reserved once
    uid = kube_calls.get_pod(kube, ns, "p")["metadata"]["uid"]
    assert ledger.show("n2")["nodes"]["n2"]["entries"] == {uid: [2000, 1 << 30]}
    # pods/resize: an increase that fits is reserved, one that does not is refused
    kube_calls.resize_pod(kube, ns, "p", [{"name": "c", "resources": {"requests": {
        "cpu": "6", "memory": "1Gi"}}}])
    assert used(slurm, "n2") == (6, 1024)
    with pytest.raises(ApiException) as e:
        kube_calls.resize_pod(kube, ns, "p", [{"name": "c", "resources": {"requests": {
            "cpu": "9", "memory": "1Gi"}}}])
    assert e.value.status == 403 and "n2" in e.value.body
    spec = kube_calls.get_pod(kube, ns, "p")["spec"]
    assert spec["containers"][0]["resources"]["requests"]["cpu"] == "6"
    assert used(slurm, "n2") == (6, 1024)
    # the kubelet (kwok) applies the resize it was allowed: the pod runs with 6 CPUs
    wait_for(lambda: (((kube_calls.get_pod(kube, ns, "p") or {}).get("status") or {}).get(
        "containerStatuses") or [{}])[0].get("resources", {}).get("requests", {}).get("cpu")
        == "6", 10, "resize applied by the kubelet")
    no_double_booking(slurm, kube)


def test_fail_closed_when_slurmctld_is_down(slurm, kube, ns):
    active(kube, ns)
    kube_calls.create_pod(kube, ns, pod("w", "1", scheduler=NOBODY_SCHEDULES))
    slurm.stop("slurmctld")
    try:
        with pytest.raises(ApiException) as e:
            kube_calls.bind_pod(kube, ns, "w", "n1")
        assert e.value.status == 403 and "ledger did not answer" in e.value.body
        assert node_of(kube, ns, "w") is None
        # a node known not shared with Slurm is unaffected (the matchCondition skips it)
        kube_calls.create_pod(kube, ns, pod("other", "1", node="k8s-only"))
    finally:
        slurm.restart_slurmctld()


def test_fail_closed_when_coordinator_is_down(slurm, control_plane, kube, ns):
    active(kube, ns)
    kube_calls.create_pod(kube, ns, pod("w", "1", scheduler=NOBODY_SCHEDULES))
    assert cluster.stop_process(slurm.work, "webhook")
    try:
        with pytest.raises(ApiException) as e:
            kube_calls.bind_pod(kube, ns, "w", "n1")
        assert e.value.status >= 500 and "failed calling webhook" in e.value.body
        kube_calls.bind_pod(kube, ns, "w", "k8s-only")               # known unshared: unaffected
        assert used(slurm, "n1") == (0, 0)
        # The real kube-scheduler's bindings fail the same way: its pod stays pending.
        kube_calls.create_pod(kube, ns, pod("sched", "1"))
        time.sleep(3)
        assert node_of(kube, ns, "sched") is None
    finally:
        restart_coordinator_webhook(slurm, control_plane, kube, ns)
    # back: the scheduler's retry goes through
    assert wait_for(lambda: node_of(kube, ns, "sched"), 30, "bound after restart") in ("n1", "n2")


def test_certificate_and_ca_rotation_under_traffic(slurm, control_plane, kube, ledger, ns):
    """Short lifetimes: the serving certificate renews every few seconds and
    the CA rotates (new CA in caBundle first, signing later), while the API
    server keeps calling the webhook: every call gets through TLS."""
    root = tempfile.mkdtemp(prefix="pyk8sres-rot-", dir=slurm.work)
    hook, served = in_process_webhook(slurm, control_plane, ledger,
                                      cert_dir=f"{root}/rotating-tls", refresh_seconds=0.5,
                                      cert_days=6 / 86400, ca_days=24 / 86400,
                                      ca_promote_seconds=3)
    try:
        def cas():
            return {c.subject.rfc4514_string()
                    for c in x509.load_pem_x509_certificates(hook.certs.bundle())}
        certs, seen_cas, failures, refused = set(), set(cas()), [], 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 40:
            try:   # more than n1 has: refused by the ledger, nothing reserved
                kube_calls.create_pod(kube, ns, pod("probe", "100", node="n1"))
                failures.append("allowed")
            except ApiException as e:
                if e.status == 403 and "does not fit" in e.body:
                    refused += 1
                elif served:       # the configuration has reached the API server
                    failures.append(e.body[:300])
            certs.add(open(hook.certs.cert_file).read())
            seen_cas |= cas()
            time.sleep(0.2)
        print(f"{len(served)} calls served, {refused} refused by the ledger, {len(certs)} "
              f"serving certificates, {len(seen_cas)} CAs, {len(failures)} failures")
        # The new CA takes a moment to reach the API server's plugin.
        first = served[0] if served else None
        assert first is not None and first - t0 < 5
        assert not failures, failures[:3]
        assert len(certs) >= 4 and len(seen_cas) >= 2
        # no gap: calls kept arriving through every renewal
        gaps = [b - a for a, b in zip(served, served[1:])]
        assert max(gaps) < 2.0, max(gaps)
    finally:
        hook.stop()
        restart_coordinator_webhook(slurm, control_plane, kube, ns)


def test_cert_manager_mode(slurm, control_plane, kube, ledger, ns):
    """With tls_cert_file/tls_key_file (a cert-manager Secret mounted as
    files) the coordinator serves those, reloads them when they change, and
    leaves caBundle to cert-manager's cainjector (played by the test, as
    the admin)."""
    root = tempfile.mkdtemp(prefix="pyk8sres-cm-", dir=slurm.work)
    issuer = Certs(f"{root}/cert-manager", ["localhost"], ["127.0.0.1"], 1, 10, 60)
    issuer.ensure()
    name = "pyk8sres-admission"
    before = kube_calls.get_webhook_config(kube, name)["webhooks"][0]["clientConfig"]["caBundle"]
    hook, served = in_process_webhook(slurm, control_plane, ledger,
                                      tls_cert_file=issuer.cert_file,
                                      tls_key_file=issuer.key_file, refresh_seconds=0.5)

    def inject(certs):   # what cainjector does
        cur = kube_calls.get_webhook_config(kube, name)
        cur["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(certs.bundle()).decode()
        kube_calls.put_webhook_config(kube, cur)

    def calls_get_through():
        n = len(served)
        try:
            kube_calls.create_pod(kube, ns, pod("probe", "100", node="n1"))
        except ApiException:
            pass
        return len(served) > n
    try:
        time.sleep(2)                 # several refreshes: it never writes caBundle
        assert kube_calls.get_webhook_config(kube, name)["webhooks"][0]["clientConfig"][
            "caBundle"] == before
        inject(issuer)
        wait_for(calls_get_through, 20, "calls with the injected CA")
        # cert-manager renews with a new CA: files change, cainjector updates the bundle
        shutil.rmtree(f"{root}/cert-manager")
        fresh = Certs(f"{root}/cert-manager", ["localhost"], ["127.0.0.1"], 1, 10, 60)
        fresh.ensure()
        inject(fresh)
        wait_for(calls_get_through, 20, "calls after the renewal")
        cur = kube_calls.get_webhook_config(kube, name)
        assert base64.b64decode(cur["webhooks"][0]["clientConfig"]["caBundle"]) == fresh.bundle()
    finally:
        hook.stop()
        restart_coordinator_webhook(slurm, control_plane, kube, ns)


def test_static_pod_from_its_kubelet_is_allowed_and_counted_even_over_capacity(
        slurm, control_plane, kube, ns, ledger):
    """A static pod runs because its kubelet started it; the mirror pod the
    kubelet then creates is only its record.  Refusing it would hide a
    running pod from both sides, so the node's own kubelet (system:node:n1,
    its real identity under NodeRestriction) gets it allowed, counted, and
    the node reported oversubscribed.  The mirror annotation written by
    anyone else exempts nothing."""
    active(kube, ns)
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 20, "job running")
    node_uid = kube.core.read_node("n1").metadata.uid
    static = pod("etcd-n1", "4", "1Gi", node="n1")
    static["metadata"]["annotations"] = {MIRROR_ANNOTATION: "0123abcd"}
    static["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "n1",
                                              "uid": node_uid, "controller": True}]
    with pytest.raises(ApiException) as e:                  # a user, with the annotation
        kube_calls.create_pod(kube, ns, static)
    assert e.value.status == 403 and "does not fit on node n1" in e.value.body
    kubelet = kube_calls.Kube(control_plane.node_identity("n1"))
    kube_calls.create_pod(kubelet, ns, static)                        # its kubelet: allowed
    uid = kube_calls.get_pod(kube, ns, "etcd-n1")["metadata"]["uid"]
    # The sync daemon counts it (its share cannot be carried next to the job) ...
    view = wait_for(lambda: (lambda v: v if uid in v.get("entries", {}) else None)(
        ledger.show("n1")["nodes"]["n1"]), 10, "static pod in the ledger")
    assert view["entries"][uid] == [4000, 1 << 30] and view["oversubscribed"] is True
    # ... so Slurm starts nothing more there, and a pod is refused.
    assert used(slurm, "n1")[0] == 8
    j2 = sbatch(slurm, "n1", 1)
    wait_for(lambda: job_state(slurm, j2) == ("PENDING", "Resources"), 20, "job 2 pends")
    with pytest.raises(ApiException) as e:
        kube_calls.create_pod(kube, ns, pod("late", "100m", "10Mi", node="n1"))
    assert e.value.status == 403
    # The job ends: the static pod fits again, and the job that pended runs.
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    wait_for(lambda: job_state(slurm, j2)[0] == "RUNNING", 30, "job 2 runs")
    assert ledger.show("n1")["nodes"]["n1"]["oversubscribed"] is False
    no_double_booking(slurm, kube)
    # the kubelet removes its mirror pod
    kube_calls.delete_pod(kubelet, ns, "etcd-n1")


# ----------------------------------------------------------------- resizes

def test_a_shrink_after_an_infeasible_growth_stays_held(slurm, kube, ns):
    """A pod at 1 CPU is resized to 4, which its kubelet leaves Infeasible;
    then to 3.  The PodResizePending condition still says Infeasible (it is
    the kubelet's, about the 4), and the kubelet may apply 3 as soon as it
    looks again: Slurm's ledger must hold at least 3 from the moment the
    resize is stored, so an 8-CPU node leaves a 6-CPU job pending."""
    active(kube, ns)
    g = pod("g", "1", node="n1")
    g["metadata"]["annotations"] = {KUBELET_RESIZE: "Infeasible"}
    kube_calls.create_pod(kube, ns, g)
    wait_for(lambda: ran_with(kube, ns, "g") == "1", 15, "running with 1 CPU")
    cpu_to(kube, ns, "g", "4")                              # fits: reserved
    assert used(slurm, "n1")[0] == 4
    wait_for(lambda: resize_pending(kube, ns, "g") == "Infeasible", 10, "left Infeasible")
    time.sleep(2)                       # the sync daemon has seen the Infeasible pod
    cpu_to(kube, ns, "g", "3")
    time.sleep(2)                       # ... and the smaller resize
    assert ran_with(kube, ns, "g") == "1" and resize_pending(kube, ns, "g") == "Infeasible"
    held = used(slurm, "n1")
    print(f"after 1 -> 4 (Infeasible) -> 3: Slurm holds {held[0]} CPUs for the pod")
    assert held[0] >= 3, f"the ledger holds {held[0]} CPUs; the kubelet may run 3"
    job = sbatch(slurm, "n1", 6)
    wait_for(lambda: job_state(slurm, job) == ("PENDING", "Resources"), 20, "6-CPU job pends")
    time.sleep(2)
    assert job_state(slurm, job)[0] == "PENDING"
    no_double_booking(slurm, kube)


def test_an_unbound_pod_may_shrink_but_not_grow(slurm, kube, ns):
    """Its binding may already be sized from the old requests (a binding is
    admitted before the API server stores it with the pod as it is then)."""
    active(kube, ns)
    kube_calls.create_pod(kube, ns, pod("u", "2", scheduler=NOBODY_SCHEDULES))
    with pytest.raises(ApiException) as e:
        cpu_to(kube, ns, "u", "3")
    assert e.value.status == 403 and "not bound to a node yet" in e.value.body, e.value.body
    cpu_to(kube, ns, "u", "1")                              # a shrink is fine
    kube_calls.bind_pod(kube, ns, "u", "n2")
    assert used(slurm, "n2")[0] == 1
    cpu_to(kube, ns, "u", "3")                              # bound: reserved there
    assert used(slurm, "n2")[0] == 3
    no_double_booking(slurm, kube)


# ----------------------------------------------------------------- creates refused later

def test_creates_refused_by_quota_after_admission_do_not_hold_the_node(slurm, kube, ns):
    """ResourceQuota runs after the validating webhooks: a create the webhook
    reserved can still be refused.  Five 6-CPU creates on n1 in a namespace
    allowed no pods; then an 8-CPU job on n1 must start within seconds."""
    active(kube, ns)
    kube.core.create_namespaced_resource_quota(
        ns, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    wait_for(lambda: (kube.core.read_namespaced_resource_quota("no-pods", ns).status
                      .hard or {}).get("pods") == "0", 20, "quota in force")
    answers = []
    for i in range(5):
        with pytest.raises(ApiException) as e:
            kube_calls.create_pod(kube, ns, pod(f"q{i}", "6", node="n1"))
        assert e.value.status == 403, e.value.body
        answers.append("quota" if "quota" in e.value.body else "webhook")
    assert "quota" in answers, answers       # at least one was reserved, then refused
    t0 = time.monotonic()
    job = sbatch(slurm, "n1", 8)
    wait_for(lambda: job_state(slurm, job)[0] == "RUNNING", 10, "the 8-CPU job runs")
    print(f"answers {answers}; the 8-CPU job ran {time.monotonic() - t0:.1f} s after submit")
    assert kube_calls.list_pods(kube, ns) == []
    no_double_booking(slurm, kube)


# ----------------------------------------------------------------- flooded webhook

IDLE_CONNECTIONS = 4000
STALLED_HANDSHAKES = 1100      # more than the descriptors systemd gives a service


def test_admission_holds_under_idle_connections_and_slowloris(slurm, control_plane, kube, ns):
    """An unprivileged local user (nobody) holds 4,000 idle TCP connections
    to the webhook's port and 1,100 TLS handshakes it never finishes, and
    dribbles ClientHellos and HTTP headers byte by byte.  The webhook was
    just restarted, so the API server must open a new connection
    meanwhile; it starts with the soft descriptor limit systemd gives
    services (1024).  A pod that fits is admitted within 1 s (create to
    the API server's answer), one that does not is still refused."""
    nobody = pwd.getpwnam("nobody")
    active(kube, ns)
    cluster.stop_process(slurm.work, "webhook")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        hybrid.start_webhook(slurm, control_plane)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    port = control_plane.ports.webhook
    metrics_url = f"http://127.0.0.1:{control_plane.ports.webhook_metrics}/readyz"
    wait_for(lambda: http_status(metrics_url) == 200, 30, "the new webhook ready")
    flood = Caller(nobody.pw_uid, [nobody.pw_gid], flood_webhook, port, IDLE_CONNECTIONS,
                   STALLED_HANDSHAKES, 100, 50)
    try:
        print("flood:", flood.started(60))
        time.sleep(0.5)
        answers = []
        for i in range(3):                        # at once, then while the flood is held
            answers.append(timed_create(kube, ns, pod(f"fits-{i}", "1", "100Mi", node="n1")))
            answers.append(timed_create(kube, ns, pod(f"big-{i}", "100", node="n1")))
            time.sleep(1.5)
        print("answers (seconds, outcome):",
              [(round(s, 3), a if a == "created" else (a.status, a.body[:120]))
               for s, a in answers])
        for i, (seconds, outcome) in enumerate(answers):
            if i % 2 == 0:
                assert outcome == "created", (i, outcome)
                assert seconds < 1.0, answers
            else:
                assert isinstance(outcome, ApiException) and outcome.status == 403 \
                    and "does not fit on node n1" in outcome.body, outcome
        assert used(slurm, "n1") == (3, 300)
        # The flood reached the webhook, and what it holds stayed capped.
        _, text = http_get(f"http://127.0.0.1:{control_plane.ports.webhook_metrics}/metrics")
        cut = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^pyk8sres_webhook_connections_cut_total\{reason="(\w+)"\} (\S+)$', text, re.M)}
        print("webhook cut:", cut)
        assert cut.get("evicted_pending", 0) >= IDLE_CONNECTIONS - 1024, cut
        print("flood ended:", flood.stop())
    finally:
        if flood.proc.is_alive():
            flood.proc.kill()
        cluster.stop_process(slurm.work, "webhook")
        restart_coordinator_webhook(slurm, control_plane, kube, ns)
    no_double_booking(slurm, kube)


def test_readiness_fails_while_the_ledger_answers_busy(slurm, control_plane, kube, ns):
    """The coordinator's uid holds its whole connection budget
    (LedgerConnectionsPerUser=, every replica's together): a webhook
    replica started then gets "busy" from the ledger, refuses pods, and
    says so on /readyz; once a connection is free it is ready again."""
    me = hybrid.coordinator_user()
    path = slurm_calls.ledger_socket_path(slurm.conf)
    readyz = f"http://127.0.0.1:{control_plane.ports.webhook_metrics}/readyz"
    cluster.stop_process(slurm.work, "webhook")
    _, gid, groups = hybrid.run_as_coordinator(slurm)
    hog = Caller(me.pw_uid, [gid, *groups], hold_ledger, path, 1000)
    try:
        held = hog.started(30)
        print("connections held by the coordinator's uid:", held)
        hybrid.start_webhook(slurm, control_plane)

        def why_not_ready():
            try:
                urllib.request.urlopen(readyz, timeout=2)
                return "ready"
            except urllib.error.HTTPError as e:
                return e.read().decode()
            except OSError:
                return ""
        reason = wait_for(lambda: (lambda r: r if "refused this process" in r else None)(
            why_not_ready()), 30, "/readyz naming the ledger's refusal")
        assert "busy" in reason or "connections to the ledger" in reason, reason
        print("readyz:", reason.strip())
    finally:
        hog.stop()
    wait_for(lambda: http_status(readyz) == 200, 30, "ready once a connection is free")
    active(kube, ns)
