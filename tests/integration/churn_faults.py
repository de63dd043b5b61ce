"""The faults the churn test (tests/integration/test_churn.py) injects while
its workload runs (churn_world.py): daemons killed and restarted, a
slurmctld fail-over, the webhook unreachable, forged AdmissionReviews, the
ledger's socket flooded, a node's kubelet lost."""
import json
import os
import signal
import ssl
import subprocess
import threading
import time

from churn_world import CAPACITY, EXPLAINED_AFTER, NAMESPACE, NODES, SECONDS, Churn
from conftest_kube import post_json
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.coordinator.slurm import Ledger, LedgerError, ledger_socket_path
from pyk8sres.policy import ledger as ledger_policy
from pyk8sres.testbed import cluster, faults, hybrid, pki

LOST_NODE = "n3"          # its kubelet goes away now and then
# The ledger's callers (tests/integration/test_ledger_hostile.py has the same):
# FLOODER may use the ledger (LedgerUsers, in the coordinator's group), STRANGER may not.
FLOODER, STRANGER = 65533, 65534
FLOOD_SECONDS = 5
MIN_GAP = 3.0            # seconds between two faults at least
STALL_MS = 1000          # a reply later than this: a caller held the others up
# What each fault may make unreachable for a while: "slurm" (scontrol gets no
# answer), "kubernetes" (the API server does not answer) and "webhook" (the
# API server gets no answer from it: creates on shared nodes fail with 5xx).
# A sample not taken or a 5xx of that side, during the fault or up to
# churn_world.EXPLAINED_AFTER after it, is no violation.
DISRUPTS = {
    "webhook unreachable": {"webhook"},
    "coordinator kill -9 + restart": {"webhook"},
    "slurmctld kill -9 + restart": {"slurm"},
    "backup slurmctld takes over, primary takes back": {"slurm"},
    "slurmctld + coordinator kill -9, all restarted at once": {"slurm", "webhook"},
    "scontrol reconfigure": {"slurm"},
    "kube-apiserver restart": {"kubernetes", "webhook"},
}
FAIL_CLOSED = "failed calling webhook"   # the API server's error when the webhook gives no answer


CUT_OFF = "test-kubelet-cut-off"


def kubelet_cut_off(node: str) -> dict:
    """A ValidatingAdmissionPolicy (and its binding) refusing what kwok
    writes for `node`."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": CUT_OFF},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [
                     {"apiGroups": [""], "apiVersions": ["v1"],
                      "operations": ["CREATE", "UPDATE", "DELETE"],
                      "resources": ["pods", "pods/status", "nodes", "nodes/status"]},
                     {"apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"],
                      "operations": ["CREATE", "UPDATE"], "resources": ["leases"]}]},
                 "matchConditions": [{"name": "kwok", "expression":
                                      "request.userInfo.username == 'kwok-controller'"}],
                 "validations": [{"expression": (
                     f"request.resource.resource == 'pods' ? (oldObject == null || "
                     f"oldObject.spec.nodeName != '{node}') : (oldObject == null ? "
                     f"object.metadata.name != '{node}' : oldObject.metadata.name != '{node}')"),
                     "message": f"test: the kubelet of {node} is cut off"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": CUT_OFF},
               "spec": {"policyName": CUT_OFF, "validationActions": ["Deny"]}}
    return {"apiVersion": "v1", "kind": "List", "items": [policy, binding]}


def argv_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().rstrip(b"\0").split(b"\0")]


class ChurnWithFaults(Churn):
    """The churn, and the faults: `inject` runs every fault in turn, cycle
    after cycle, and `node_outages` takes a node's kubelet away now and
    then.  What a fault could not do is in `fault_errors`; daemons found
    dead after one, in `revived`."""

    def __init__(self, c, cp, kube, seed: int):
        super().__init__(c, cp, kube, seed)
        self.every_fault_done = threading.Event()   # the first cycle of faults is through
        self.fault_errors: list[str] = []    # a fault that could not be carried out
        self.revived: list[str] = []         # daemons found dead or hung after a fault
        self.takeover_how = ["kill -9", "takeover"]
        self.reregistered = 0                # Node objects deleted and registered again
        self.ledger_path = ledger_socket_path(c.conf)
        self.flood_ms: list[float] = []      # root's `show` while a flood runs
        # How sync and the webhook were started: they are started again so.
        self.coordinator_argv = {name: argv_of(c.pid(name)) for name in ("sync", "webhook")}

    def _restart(self, name: str, how=signal.SIGKILL, pause: float = 1.0):
        pid = self.c.pid(name)
        os.kill(pid, how)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            while cluster.alive(pid):
                time.sleep(0.05)
        time.sleep(pause)
        hybrid.start_coordinator(self.c, name, self.coordinator_argv[name])

    def _slurmctld_restart(self):
        self.ctld_restarted_at = time.time()
        faults.kill_and_restart(self.c)
        self._count("controller changes")

    def _fail_over_and_back(self):
        """The backup slurmctld takes control, runs the cluster a while, and
        the primary takes it back: the primary killed -9 (the first cycle,
        so the bounded run has it), then handing over (`scontrol takeover`),
        in turn."""
        how = self.takeover_how[0]
        self.takeover_how.reverse()
        self.ctld_restarted_at = time.time()
        took = faults.fail_over(self.c, how)
        time.sleep(3)
        self.ctld_restarted_at = time.time()
        back = faults.fail_back(self.c)
        self._count("controller changes", 2)
        self._backup_standing_by()
        return f"{how}: backup served after {took:.1f} s, primary again after {back:.1f} s"

    def _backup_standing_by(self, timeout: float = 20):
        """The backup must be back in standby (`scontrol ping`: UP) before it
        can take over again.  Slurm 22.05's own (seen without node_features
        too): a backup that took over twice (`scontrol takeover`, handed
        back, then the primary killed -9; in a soak) hangs when it hands
        control back the second time -- its main thread joins slurmctld's purge-files
        thread forever, the backup log ends with "REQUEST_CONTROL reply but
        backup not completely done relinquishing control", and `scontrol
        ping` says it is DOWN.  Such a backup is restarted, as its supervisor
        would, and reported."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.c.ping().get("backup") == "UP":
                return
            time.sleep(1)
        self.c.stop("slurmctld-backup")
        self.c.start_slurmctld(backup=True, wait=False)
        with self.lock:
            self.revived.append(f"{time.strftime('%T')} slurmctld-backup (not back in "
                                f"standby {timeout:.0f} s after handing control back)")

    def _slurmctld_and_coordinator_restart(self):
        """kill -9 slurmctld, sync and the webhook at once; start them all
        again at once (the coordinator meets a ledger that is not there,
        then not ready)."""
        self.ctld_restarted_at = time.time()
        pids = [self.c.pid(n) for n in ("slurmctld", "sync", "webhook")]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            while cluster.alive(pid):
                time.sleep(0.02)
        time.sleep(0.3)
        self.c.start_slurmctld(wait=False)
        for name, argv in self.coordinator_argv.items():
            hybrid.start_coordinator(self.c, name, argv)
        took = faults.wait_ledger(self.c)
        self._count("controller changes")
        return f"ledger served again after {took:.1f} s"

    def _post_review(self, body: dict, client_cert) -> tuple:
        """POST an AdmissionReview straight to the webhook, as anyone on the
        network could (server certificate not checked: curl -k)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if client_cert:
            ctx.load_cert_chain(*client_cert)
        return post_json(f"https://127.0.0.1:{self.cp.ports.webhook}/validate",
                         json.dumps(body).encode(), ctx, 10)

    def _forged_reviews(self):
        """Reviews forged to shrink a bound pod's reservation to nothing (its
        UID, no requests) and to reserve 64 CPUs for a pod that does not
        exist, each posted with no client certificate, one of another CA
        and a user's of the cluster's own CA: every one refused, and the
        ledger holds the same for both keys afterwards."""
        pods = [p for p in kube_calls.list_pods(self.kube, NAMESPACE)
                if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
        victim = self.rnd.choice(pods) if pods else None
        node = victim["spec"]["nodeName"] if victim else "n1"
        uid = victim["metadata"]["uid"] if victim else "no-victim"
        forged_uid = f"forged-{self.rnd.randrange(1 << 30)}"

        def review(pod_uid, requests):
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "request": {"uid": f"r-{pod_uid}", "operation": "CREATE",
                                "resource": {"group": "", "version": "v1", "resource": "pods"},
                                "subResource": "", "namespace": NAMESPACE, "name": "forged",
                                "userInfo": {"username": "system:kube-scheduler"},
                                "object": {"metadata": {"name": "forged", "uid": pod_uid,
                                                        "namespace": NAMESPACE},
                                           "spec": {"nodeName": node, "containers": [
                                               {"name": "c", "resources": {
                                                   "requests": requests}}]}}}}

        def held():
            entries = Ledger(self.ledger_path).show(node)["nodes"][node].get("entries") or {}
            return entries.get(uid), entries.get(forged_uid)
        pki_dir = os.path.join(self.c.work, "forger")
        certs = {"no client certificate": None,
                 "a certificate of another CA": pki.Authority(
                     pki_dir, "other-ca", "forger CA").issue("apiserver", "kube-apiserver"),
                 "a user's certificate of the cluster's CA": pki.Authority(
                     self.cp.pki_dir, "ca", "x").issue("forger", "forger")}
        before = held()
        for what, cert in certs.items():
            for body in (review(uid, {}), review(forged_uid, {"cpu": "64", "memory": "1Gi"})):
                status, text = self._post_review(body, cert)
                if status in (401, 403, "tls") and '"allowed": true' not in text:
                    self._count("forged reviews refused")
                else:
                    with self.lock:
                        self.violations.append(f"{time.strftime('%T')} forged review with "
                                               f"{what} answered {status}: {text[:200]}")
        after = held()
        still_bound = victim is not None and any(
            p["metadata"]["uid"] == uid and not p["metadata"].get("deletionTimestamp")
            for p in kube_calls.list_pods(self.kube, NAMESPACE))
        if after[1] is not None or (still_bound and before[0] and after[0] != before[0]):
            with self.lock:
                self.violations.append(f"{time.strftime('%T')} forged reviews changed the "
                                       f"ledger on {node}: {before} -> {after}")
        return f"victim on {node}, ledger held {before[0]} -> {after[0]}"

    def _timed_shows(self, seconds: float) -> None:
        """Root's `show` every 50 ms for `seconds`: timed, and each must answer."""
        ledger = Ledger(self.ledger_path, timeout=5)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                reply = ledger.show()
                failed = None if reply.get("ok") or ledger_policy.not_ready(reply) else reply
            except LedgerError as e:
                failed = e
            ms = (time.perf_counter() - t0) * 1000
            with self.lock:
                self.flood_ms.append(ms)
                if failed is not None or ms > STALL_MS:
                    self.violations.append(f"{time.strftime('%T')} root's ledger show during "
                                           f"a flood: {failed or f'{ms:.0f} ms'}")
            time.sleep(0.05)

    def _flood_permitted(self):
        """A permitted client (LedgerUsers) floods `show` on as many
        connections as it may open, never reading a reply."""
        with faults.LedgerFlood(self.ledger_path, FLOODER, [hybrid.coordinator_user().pw_gid]) as flood:
            self._timed_shows(FLOOD_SECONDS)
            done = flood.stop()
        self._count("flood connections", done["connected"])
        self._count("flood connections dropped", done["dropped"])
        return f"{done['connected']} connections, {done['dropped']} dropped by the server"

    def _flood_stranger(self):
        """A uid that may not use the ledger connects again and again."""
        with faults.ConnectStorm(self.ledger_path, STRANGER, [STRANGER]) as storm:
            self._timed_shows(FLOOD_SECONDS)
            outcomes = storm.stop()
        reached = {k: v for k, v in outcomes.items() if k not in ("PermissionError", "denied")}
        if reached:
            with self.lock:
                self.violations.append(f"{time.strftime('%T')} uid {STRANGER} reached the "
                                       f"ledger: {outcomes}")
        self._count("stranger connects refused", sum(outcomes.values()) - sum(reached.values()))
        return f"outcomes {outcomes}"

    def _webhook_unreachable(self):
        """The webhook stopped (SIGSTOP: its port still takes connections,
        nothing answers) for longer than its timeoutSeconds, so the API
        server really gets no answer; meanwhile a pod created straight onto
        a shared node must be refused with the webhook-call failure
        (failurePolicy Fail), never admitted."""
        doc = kube_calls.get_webhook_config(self.kube, "pyk8sres-admission")
        timeout = max(w.get("timeoutSeconds", 10) for w in doc["webhooks"])
        pid = int(open(os.path.join(self.c.work, "run", "proc-webhook.pid")).read())
        name = f"fault-probe-{self.rnd.randrange(1 << 30)}"
        node = f"n{self.rnd.randint(1, NODES)}"
        os.kill(pid, signal.SIGSTOP)
        stopped = self.webhook_stopped_at = time.monotonic()
        try:
            try:
                kube_calls.create_pod(self.kube, NAMESPACE, {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"nodeName": node, "terminationGracePeriodSeconds": 2,
                             "containers": [{"name": "c", "image": "x", "resources": {
                                 "requests": {"cpu": "250m", "memory": "128Mi"}}}]}})
                answer = "admitted"
            except kube_calls.ApiException as e:
                answer = f"{e.status}: {(e.body or '')[:300]}"
            took = time.monotonic() - stopped
            time.sleep(max(0.0, timeout + 2 - took))
        finally:
            self.webhook_stopped_at = None
            os.kill(pid, signal.SIGCONT)
        if answer.startswith("500") and FAIL_CLOSED in answer:
            self._count("creates refused while the webhook was stopped")
        else:
            with self.lock:
                self.violations.append(f"{time.strftime('%T')} a pod created on {node} while "
                                       f"the webhook was stopped was not refused for want of "
                                       f"its answer: {answer}")
            if answer == "admitted":
                kube_calls.delete_pod(self.kube, NAMESPACE, name)
        return f"stopped {time.monotonic() - stopped:.1f} s, timeoutSeconds {timeout}; " \
               f"a create on {node} answered in {took:.1f} s: {answer[:60]}"

    def _node_ready(self, node: str) -> str:
        return self.cp.kubectl("get", "node", node, "-o", "jsonpath={.status.conditions[?("
                               "@.type==\"Ready\")].status}", check=False).stdout.strip()

    def _kubectl(self, *args, input=None):
        """As the admin, retried while kube-apiserver restarts (another fault)."""
        deadline = time.monotonic() + 60
        while self.cp.kubectl(*args, check=False, input=input).returncode != 0:
            assert time.monotonic() < deadline, f"kubectl {args} kept failing"
            time.sleep(0.5)

    def _poke(self, node: str):
        """Touch the node and its pods: kwok plays a stage on an object's
        change only, and the stages it tried while cut off were refused."""
        self._kubectl("annotate", "--overwrite", "node", node, f"pyk8sres.io/poked={time.time()}")
        for p in kube_calls.list_pods(self.kube, field_selector=f"spec.nodeName={node}"):
            self.cp.kubectl("annotate", "--overwrite", "pod", "-n", p["metadata"]["namespace"],
                            p["metadata"]["name"], f"pyk8sres.io/poked={time.time()}",
                            check=False)

    def _not_ready(self, node: str, how: str):
        """Take the node's kubelet down (until kube-controller-manager marks
        the node NotReady or Unknown and taints it), then let it back."""
        if how == "reports NotReady":       # its runtime is down (kube/kwok.yaml)
            self._kubectl("label", "--overwrite", "node", node,
                          "pyk8sres.io/kubelet-not-ready=true")
        else:   # cut off: the API server refuses all kwok writes for it, as a partition would
            self._kubectl("apply", "-f", "-", input=json.dumps(kubelet_cut_off(node)))
        deadline = time.monotonic() + 60
        while self._node_ready(node) == "True" and time.monotonic() < deadline:
            time.sleep(0.5)
        lost = self._node_ready(node)
        time.sleep(3)
        if how == "reports NotReady":
            self._kubectl("label", "node", node, "pyk8sres.io/kubelet-not-ready-")
        else:
            self._kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy",
                          CUT_OFF, "--ignore-not-found")
        deadline = time.monotonic() + 60
        while self._node_ready(node) != "True" and time.monotonic() < deadline:
            if how != "reports NotReady":
                self._poke(node)
            time.sleep(2)
        return lost

    def node_outages(self):
        """The node's kubelet alternately reports NotReady (its runtime down)
        and is cut off (kwok's writes for it refused: its Lease, its
        status, its pods' status and deletions, so Terminating pods stay);
        each time until the node is NotReady, then it comes back.  (kwok 0.8
        keeps a node's Lease when the node loses its kwok.x-k8s.io/node
        annotation, so that does not do it.)"""
        kinds = ["reports NotReady", "cut off"]
        while not self.stop.wait(SECONDS / 10):
            how = kinds[0]
            kinds.reverse()
            lost = self._not_ready(LOST_NODE, how)
            with self.lock:
                self.faults.append(f"{time.strftime('%T')} {LOST_NODE}'s kubelet {how} "
                                   f"(Ready={lost or '?'}), back (Ready="
                                   f"{self._node_ready(LOST_NODE) or '?'})")
                if lost in ("False", "Unknown"):
                    self.counts["node outages"] += 1

    def inject(self):
        faults = [
            ("webhook unreachable (SIGSTOP past its timeoutSeconds)", self._webhook_unreachable),
            ("coordinator kill -9 + restart",
             lambda: (self._restart("sync"), self._restart("webhook"))),
            ("slurmctld kill -9 + restart", self._slurmctld_restart),
            ("forged AdmissionReviews", self._forged_reviews),
            ("ledger flood by a permitted client that never reads", self._flood_permitted),
            ("backup slurmctld takes over, primary takes back", self._fail_over_and_back),
            ("ledger connect storm by an unprivileged uid", self._flood_stranger),
            ("slurmctld + coordinator kill -9, all restarted at once",
             self._slurmctld_and_coordinator_restart),
            ("kube-scheduler restart", lambda: self.cp.restart("kube-scheduler")),
            ("scontrol reconfigure", lambda: subprocess.run(
                ["scontrol", "reconfigure"], env=self.c.env, capture_output=True, timeout=60)),
            # A partition update makes Slurm rebuild allocations from jobs;
            # MaxTime stays unlimited (the jobs have no time limit).
            ("partition update", lambda: subprocess.run(
                ["scontrol", "update", "PartitionName=debug", "MaxTime=UNLIMITED"],
                env=self.c.env, capture_output=True, timeout=60)),
            ("partition's nodes changed at runtime, then back", self._partition_nodes),
            ("Node object deleted under its pods, registered again", self._node_reregisters),
            ("kube-controller-manager restart",
             lambda: self.cp.restart("kube-controller-manager")),
            ("kube-apiserver restart", lambda: self.cp.restart("kube-apiserver")),
        ]
        while not self.stop.is_set():
            # Fault k of each cycle at k/(n+1) of SECONDS from its start:
            # a slow fault (an API server restart) delays the next, not all.
            # At least MIN_GAP between two faults: a component restarted must
            # be up before the next fault hits what it depends on.
            cycle = time.monotonic()
            for k, (name, fault) in enumerate(faults, 1):
                due = cycle + SECONDS * k / (len(faults) + 1)
                if self.stop.wait(max(MIN_GAP, due - time.monotonic())):
                    return
                sides = next((v for k, v in DISRUPTS.items() if name.startswith(k)), set())
                t0 = time.monotonic()
                try:
                    detail = fault()
                except Exception as e:
                    with self.lock:
                        self.windows.append((name, sides, t0, time.monotonic()))
                        self.fault_errors.append(f"{time.strftime('%T')} {name}: "
                                                 f"{type(e).__name__}: {e}")
                    continue
                with self.lock:
                    self.windows.append((name, sides, t0, time.monotonic()))
                with self.lock:
                    self.faults.append(f"{time.strftime('%T')} {name}"
                                       + (f" ({detail})" if isinstance(detail, str) else ""))
                    self.counts["faults"] += 1
                self._revive_control_plane()
                self._coordinator_alive()
            self.every_fault_done.set()

    def _partition_nodes(self):
        """`scontrol update PartitionName=debug Nodes=...` without one node,
        then with every node again: job_submit completes new jobs against
        the partition slurmctld has at that moment, not slurm.conf's."""
        every = ",".join(CAPACITY)
        for nodes in (",".join(sorted(CAPACITY)[:-1]), every):
            subprocess.run(["scontrol", "update", "PartitionName=debug", f"Nodes={nodes}"],
                           env=self.c.env, capture_output=True, timeout=60, check=True)
            if self.stop.wait(2.0) and nodes == every:
                break

    def _node_reregisters(self):
        """A node's mapping lost and gained under running pods: its Node
        object deleted (an admin, an autoscaler, a kubelet re-registering),
        then registered again by its kubelet's identity.  The pods stay
        bound and running all along (back well within pod GC's quarantine
        for pods of a missing node), so ground truth counts them: their
        share must stay while the node is gone, and count again at once
        when it is back."""
        self.reregistered += 1
        node = sorted(n for n in CAPACITY if n != LOST_NODE)[self.reregistered % 2]
        bound = len(kube_calls.list_pods(self.kube, field_selector=f"spec.nodeName={node}"))
        self._kubectl("delete", "node", node, "--wait=true")
        time.sleep(2.0)     # long enough for sync and the webhook to see it gone
        self.cp.register_nodes({node: CAPACITY[node]}, timeout=60)
        return f"{node}, {bound} pods bound there"

    def _coordinator_alive(self):
        """sync and the webhook never exit of a fault; one that did is an
        error of the run (nothing would shrink shares or admit pods)."""
        for name in ("sync", "webhook"):
            if self.c.pid(name) is None:
                t0 = time.monotonic()
                with self.lock:
                    self.fault_errors.append(f"{time.strftime('%T')} {name} has exited; "
                                             f"log/{name}.out ends:\n{self.c.log_tail(name + '.out')}")
                hybrid.start_coordinator(self.c, name, self.coordinator_argv[name])
                with self.lock:
                    self.windows.append((f"{name} started again", {"webhook"}, t0,
                                         time.monotonic()))

    def _revive_control_plane(self):
        """A control-plane component that died of a fault (kube-controller-
        manager exits when kube-apiserver restarts while it builds its
        controllers) is started again, as the kubelet or systemd would, and
        reported."""
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            if not self.cp.running(name):
                t0 = time.monotonic()
                self.cp.restart(name)
                with self.lock:
                    self.revived.append(f"{time.strftime('%T')} {name} (had exited)")
                    if name == "kube-apiserver":
                        self.windows.append((f"{name} started again", {"kubernetes", "webhook"},
                                             t0 - EXPLAINED_AFTER, time.monotonic()))
