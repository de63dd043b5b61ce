"""Randomized churn with injected faults on the real control plane: Slurm jobs
(sbatch, arrays, srun) and pods on 3 shared nodes -- placed by the real
kube-scheduler, straight onto nodes with spec.nodeName, and by two
Deployments scaled up and down; pods deleted with grace periods (they stay
Terminating, running, until it ends) and force-deleted (their kubelet may
run them for their grace period after the object is gone); pods resized in
place, up and down; creates on shared nodes that a ResourceQuota of 0 pods
refuses after admission -- while the coordinator, slurmctld,
kube-apiserver, kube-scheduler and kube-controller-manager are killed or
restarted, slurmctld reconfigured, a partition updated (its nodes too), the webhook made
unreachable for longer than its timeoutSeconds (a pod created on a shared
node meanwhile must be refused for want of its answer: admission fails
closed), and a node's kubelet (kwok) reports NotReady or is cut off
until the node is NotReady, then comes back.

Hostile faults join them: forged AdmissionReviews posted straight to the
webhook (no client certificate, one of another CA, one of the cluster's own
CA that is not the API server's: each refused, the ledger unchanged), the
ledger's socket flooded by an unprivileged uid (cannot connect) and by a
permitted client that never reads (root's `show` keeps answering), a backup
slurmctld taking over (the primary killed -9, or `scontrol takeover`: in turn)
and handing back, and slurmctld killed together with the coordinator
(sync and webhook), all restarted at once.  All along, the webhook
configuration must never leave a shared node unchecked.

The invariant is checked all along from ground truth only
(ground_truth.over_capacity): what slurmctld has really allocated to
jobs on each node (`scontrol -d show job`: CPU_IDs, Mem; RUNNING jobs and
COMPLETING ones whose processes still run) and the non-terminal pods the
API server has bound there, Terminating ones included, sized by the test's
own code, plus the force-deleted pods still within their grace period.  On
every node, at every sample: jobs + pods <= capacity.  A
sample that could not read Slurm or the API server, and a pod create
answered 5xx (counted apart from the webhook's refusals), fail the run
unless a fault of that side overlapped it.  At the end nothing is stuck:
with the pods gone every job starts.

CI runs a bounded version (PYK8SRES_CHURN_SECONDS, default 60 s of churn, extended
until every fault has happened once); a soak by hand:
PYK8SRES_CHURN_SECONDS=1800 python3 -m pytest -s tests/integration/test_churn.py
"""
import glob
import json
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
import urllib3
from kubernetes import client as kclient

from conftest_kube import pick_ports
from ground_truth import Unreadable, over_capacity, pod_size
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.coordinator import kube as K
from pyk8sres.coordinator.slurm import Ledger, LedgerError, ledger_socket_path
from pyk8sres.policy import ledger as L
from pyk8sres.testbed import cluster, faults, hybrid, pki

NODES, CPUS, MEMORY = 3, 8, 16000
CAPACITY = {f"n{i}": (CPUS, MEMORY) for i in range(1, NODES + 1)}
SECONDS = float(os.environ.get("PYK8SRES_CHURN_SECONDS", "60"))
# The churn, the rest of the first cycle of faults (up to 600 s), and the
# backlog it leaves (it grows with the churn's length).
pytestmark = requires_slurm + [pytest.mark.timeout(int(4 * SECONDS) + 1500)]
NAMESPACE = "churn"
QUOTA_NAMESPACE = "churn-quota"   # a ResourceQuota of 0 pods: every create there fails
DEPLOYMENTS = {"web-a": ("500m", "512Mi"), "web-b": ("1500m", "1Gi")}
LOST_NODE = "n3"          # its kubelet goes away now and then
# Liveness after the churn.  The churn leaves a backlog (jobs are submitted
# near the cluster's capacity: 60 s of churn leave 1.5-2 minutes of jobs).  A
# queue is stuck when no pending job starts for longer than a job can run:
# each has a 1-minute limit (plus KillWait 5 s and a scheduling pass).
STALL_SECONDS = 90
# The ledger's callers (tests/integration/test_ledger_hostile.py has the same):
# FLOODER may use the ledger (LedgerUsers, in the coordinator's group), STRANGER may not.
FLOODER, STRANGER = 65533, 65534
FLOOD_SECONDS = 5
MIN_GAP = 3.0            # seconds between two faults at least
STALL_MS = 1000          # a reply later than this: a caller held the others up
# What each fault may make unreachable for a while: "slurm" (scontrol gets no
# answer), "kubernetes" (the API server does not answer) and "webhook" (the
# API server gets no answer from it: creates on shared nodes fail with 5xx).
# A sample that could not be taken, or a 5xx, is explained only by a fault
# of its side that overlaps it, give or take EXPLAINED_AFTER seconds after
# the fault's end (a restarted daemon answering its first callers).
DISRUPTS = {
    "webhook unreachable": {"webhook"},
    "coordinator kill -9 + restart": {"webhook"},
    "slurmctld kill -9 + restart": {"slurm"},
    "backup slurmctld takes over, primary takes back": {"slurm"},
    "slurmctld + coordinator kill -9, all restarted at once": {"slurm", "webhook"},
    "scontrol reconfigure": {"slurm"},
    "kube-apiserver restart": {"kubernetes", "webhook"},
}
EXPLAINED_AFTER = 15.0
FAIL_CLOSED = "failed calling webhook"   # the API server's error when the webhook gives no answer


def pending_jobs(env) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-t", "PD", "-o", "%i %r"], capture_output=True,
                         text=True, env=env).stdout
    return [line for line in out.split("\n") if line.strip()]


def held_after_a_refused_second_copy(c, pending: list[str]) -> list[str]:
    """Pending jobs Slurm itself held in its kill -9 window (seen once in CI):
    slurmctld, killed -9 just after it launched a batch job, recovers the job,
    sees it end, and launches it again while slurmd still has the first copy.
    slurmd refuses ("Job N already running, do not launch second copy",
    slurmd/req.c) and slurmctld requeues the job held ("launch failed
    requeued held").  Only jobs with that reason AND that slurmd log line."""
    logs = ""
    for path in glob.glob(os.path.join(c.work, "log", "slurmd-*.log")):
        with open(path, errors="replace") as f:
            logs += f.read()
    out = []
    for line in pending:
        job, _, reason = line.partition(" ")
        if reason != "launch failed requeued held":
            continue
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                               text=True, env=c.env).stdout
        found = re.search(r"JobId=(\d+)", shown)
        if found and f"Job {found.group(1)} already running, do not launch second copy" in logs:
            out.append(job)
    return out


def drained_for_a_second_copy(c) -> list[str]:
    """Nodes slurmctld drained in the same kill -9 window: slurmd reported
    the first copy of a job it had launched again ("Duplicate jobid",
    slurmctld's own reason).  An admin resumes them; so does the test."""
    shown = subprocess.run(["scontrol", "-o", "show", "node"], capture_output=True, text=True,
                           env=c.env, check=True).stdout
    return re.findall(r"^NodeName=(\S+) .*\bReason=Duplicate jobid\b", shown, re.M)


def drain(env) -> list[str]:
    """Wait while the queue drains.  Returns the jobs still pending when it
    stops draining (nothing started for STALL_SECONDS).  Nothing is submitted
    any more, so this ends, however long a soak's backlog is."""
    pending, progressed = pending_jobs(env), time.monotonic()
    while pending and time.monotonic() < progressed + STALL_SECONDS:
        time.sleep(1)
        now = pending_jobs(env)
        if {p.split()[0] for p in pending} - {p.split()[0] for p in now}:
            progressed = time.monotonic()     # a job left the queue: it started
        pending = now
    return pending


def deployment(name: str, cpu: str, memory: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {
                         "terminationGracePeriodSeconds": 3,
                         "containers": [{"name": "web", "image": "nginx", "resources": {
                             "requests": {"cpu": cpu, "memory": memory}}}]}}}}


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


class Churn:
    def __init__(self, c, cp, kube, seed: int):
        self.c, self.cp, self.kube = c, cp, kube
        self.apps = kclient.AppsV1Api(kube.api)
        self.rnd = random.Random(seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.jobs: list[str] = []
        self.sruns: list[tuple[str, subprocess.Popen]] = []
        self.scheduled: set[str] = set()      # pods created for kube-scheduler to place
        self.placed: set[str] = set()         # ... and seen bound
        self.deployed: set[str] = set()       # Deployment pods seen bound
        self.counts = {"pods admitted": 0, "pods refused": 0, "pod create errors": 0,
                       "pod creates answered 5xx": 0, "pods force-deleted (grace 0)": 0,
                       "creates refused while the webhook was stopped": 0,
                       "samples not taken": 0,
                       "pods deleted with a grace period": 0, "deployment scalings": 0,
                       "jobs submitted": 0, "sruns": 0, "faults": 0, "node outages": 0,
                       "samples": 0, "most Terminating pods in a sample": 0,
                       "webhook scope samples": 0, "forged reviews refused": 0,
                       "flood connections": 0, "flood connections dropped": 0,
                       "stranger connects refused": 0, "controller changes": 0,
                       "resizes admitted": 0, "resizes refused": 0,
                       "creates refused by a quota": 0}
        # Pods force-deleted whose containers their kubelet may still run:
        # (node, cpus, bytes, until monotonic).  The API server no longer has
        # them; the kubelet kills them within their grace period.
        self.ghosts: list[tuple[str, object, int, float]] = []
        self.violations: list[str] = []
        self.first_violation = ""            # what each side said when the first was seen
        # (name, sides, start, end) of every fault, monotonic: what may explain
        # a sample that could not be taken or a 5xx answer.
        self.windows: list[tuple[str, set, float, float]] = []
        self.not_sampled: list[tuple[str, float, float, str]] = []  # side, start, end, why
        self.server_errors: list[tuple[float, float, str]] = []     # start, end, answer
        self.check_errors: list[str] = []    # the checker itself broke: the run fails
        self.webhook_stopped_at: float | None = None   # monotonic, while it is SIGSTOPped
        self.ctld_restarted_at = 0.0
        self.faults: list[str] = []
        self.every_fault_done = threading.Event()   # the first cycle of faults is through
        self.fault_errors: list[str] = []    # a fault that could not be carried out
        self.revived: list[str] = []         # daemons found dead or hung after a fault
        self.takeover_how = ["kill -9", "takeover"]
        self.ledger_path = ledger_socket_path(c.conf)
        self.flood_ms: list[float] = []      # root's `show` while a flood runs
        # How sync and the webhook were started: they are started again so.
        self.coordinator_argv = {name: argv_of(c.pid(name)) for name in ("sync", "webhook")}

    def _count(self, key, n=1):
        with self.lock:
            self.counts[key] += n

    # --- the workload -------------------------------------------------------
    def submit_jobs(self):
        while not self.stop.wait(self.rnd.uniform(0.2, 0.6)):
            cpus, mem = self.rnd.randint(1, 4), self.rnd.choice([100, 500, 1000, 2000, 4000])
            secs = self.rnd.randint(1, 6)
            kind = self.rnd.random()
            try:
                if kind < 0.15:
                    with self.lock:
                        self.counts["sruns"] += 1
                        name = f"churn-srun-{self.counts['sruns']}"
                    p = subprocess.Popen(["srun", "-J", name, "-t", "1", "-c", str(cpus),
                                          f"--mem={mem}", "sleep", str(secs)], env=self.c.env,
                                         cwd="/tmp", stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
                    with self.lock:
                        self.sruns.append((name, p))
                    continue
                extra = ["--array=0-2"] if kind < 0.3 else []
                out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-t", "1",
                                      "-c", str(cpus),
                                      f"--mem={mem}", *extra, "--wrap", f"sleep {secs}"],
                                     capture_output=True, text=True, env=self.c.env, timeout=30,
                                     cwd="/tmp")
                if out.returncode == 0:
                    with self.lock:
                        self.jobs.append(out.stdout.strip().split(";")[0])
                        self.counts["jobs submitted"] += 1
            except subprocess.TimeoutExpired:
                pass    # slurmctld being killed: submissions may time out

    def _pod(self, name: str, node: str | None) -> dict:
        cpu = self.rnd.choice(["250m", "500m", "1", "1500m", "2", "3"])
        mem = self.rnd.choice(["128Mi", "512Mi", "1Gi", "2Gi", "4Gi"])
        spec = {"terminationGracePeriodSeconds": 2,
                "containers": [{"name": "c", "image": "x",
                                "resources": {"requests": {"cpu": cpu, "memory": mem}}}]}
        if node:
            spec["nodeName"] = node
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    def create_pods(self):
        i = 0
        while not self.stop.wait(self.rnd.uniform(0.1, 0.4)):
            i += 1
            direct = self.rnd.random() < 0.5
            node = f"n{self.rnd.randint(1, NODES)}" if direct else None
            t0 = time.monotonic()
            try:
                K.create_pod(self.kube, NAMESPACE, self._pod(f"p{i}", node))
                stopped = self.webhook_stopped_at
                if direct and stopped is not None and t0 > stopped:
                    with self.lock:     # asked and answered while the webhook could not answer
                        self.violations.append(f"{time.strftime('%T')} p{i} admitted on {node} "
                                               f"while the webhook was stopped")
                if direct:
                    self._count("pods admitted")
                else:
                    with self.lock:
                        self.scheduled.add(f"p{i}")
            except K.ApiException as e:
                if e.status >= 500:     # no answer from the webhook, or the API server's own
                    self._server_error(t0, f"{e.status} {e.reason}: {(e.body or '')[:200]}")
                elif direct and e.status == 403 and "denied the request" in (e.body or ""):
                    self._count("pods refused")     # the webhook's answer: it does not fit
                else:
                    self._count("pod create errors")
            except (urllib3.exceptions.HTTPError, OSError):
                self._count("pod create errors")   # API server restarting

    def scale_deployments(self):
        while not self.stop.wait(self.rnd.uniform(1.0, 3.0)):
            name = self.rnd.choice(sorted(DEPLOYMENTS))
            try:
                self.apps.patch_namespaced_deployment_scale(
                    name, NAMESPACE, {"spec": {"replicas": self.rnd.randint(0, 6)}},
                    _request_timeout=10)
                self._count("deployment scalings")
            except (K.ApiException, urllib3.exceptions.HTTPError, OSError):
                pass     # API server restarting

    def delete_pods(self):
        while not self.stop.wait(self.rnd.uniform(0.5, 1.5)):
            try:
                pods = K.list_pods(self.kube, NAMESPACE)
                for p in self.rnd.sample(pods, min(len(pods), self.rnd.randint(0, 4))):
                    grace = self.rnd.choice([0, 1, 3, None])    # None: the pod's own (2 or 3 s)
                    if grace == 0:
                        self._ghost(p)
                    self.kube.core.delete_namespaced_pod(
                        p["metadata"]["name"], NAMESPACE, grace_period_seconds=grace,
                        _request_timeout=10)
                    self._count("pods deleted with a grace period" if grace != 0 else
                                "pods force-deleted (grace 0)")
            except (K.ApiException, urllib3.exceptions.HTTPError, OSError):
                pass     # gone already, or the API server restarting

    def _ghost(self, pod: dict) -> None:
        """A pod about to be force-deleted: its kubelet hears of it only
        afterwards and may run it for its whole grace period (counted from
        just before the delete, so never too short)."""
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return
        cpu, mem = pod_size(pod)
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        with self.lock:
            self.ghosts.append((node, cpu, mem, time.monotonic() + grace))

    def still_running(self) -> dict:
        """node -> (cpus, bytes) of the force-deleted pods that may still run."""
        now, out = time.monotonic(), {}
        with self.lock:
            self.ghosts = [g for g in self.ghosts if g[3] > now]
            for node, cpu, mem, _ in self.ghosts:
                c0, m0 = out.get(node, (0, 0))
                out[node] = (c0 + cpu, m0 + mem)
        return out

    def resize_pods(self):
        """In-place resizes, up and down, of the pods bound on shared nodes:
        a growth that does not fit is refused; one that fits is reserved
        before the kubelet (kwok) applies it."""
        while not self.stop.wait(self.rnd.uniform(0.5, 1.5)):
            try:
                pods = [p for p in K.list_pods(self.kube, NAMESPACE)
                        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                        and not (p["metadata"].get("labels") or {}).get("app")]
                if not pods:
                    continue
                p = self.rnd.choice(pods)
                cpu = self.rnd.choice(["250m", "500m", "1", "2", "3", "4"])
                K.resize_pod(self.kube, NAMESPACE, p["metadata"]["name"],
                             [{"name": "c", "resources": {"requests": {"cpu": cpu}}}])
                self._count("resizes admitted")
            except K.ApiException as e:
                if e.status == 403 and "denied the request" in (e.body or ""):
                    self._count("resizes refused")
            except (urllib3.exceptions.HTTPError, OSError):
                pass     # API server restarting

    def quota_refused_creates(self):
        """Creates on shared nodes that the webhook may admit and a
        ResourceQuota (pods: 0) then refuses: they must hold nothing."""
        i = 0
        while not self.stop.wait(self.rnd.uniform(0.5, 1.5)):
            i += 1
            pod = self._pod(f"q{i}", f"n{self.rnd.randint(1, NODES)}")
            try:
                K.create_pod(self.kube, QUOTA_NAMESPACE, pod)
                with self.lock:
                    self.violations.append(f"{time.strftime('%T')} q{i} created in "
                                           f"{QUOTA_NAMESPACE} despite its quota of 0 pods")
            except K.ApiException as e:
                if e.status == 403:
                    self._count("creates refused by a quota")
            except (urllib3.exceptions.HTTPError, OSError):
                pass

    # --- the invariant ------------------------------------------------------
    def check(self):
        while not self.stop.wait(0.2):
            try:
                self._sample()
            except Exception as e:     # noqa: BLE001 - a broken checker fails the run
                with self.lock:
                    self.check_errors.append(f"{time.strftime('%T')} {type(e).__name__}: {e}")

    def _sample(self):
        """One sample from ground truth; one that cannot read Slurm or the
        API server is recorded, never counted as clean."""
        t0 = time.monotonic()
        try:
            over = over_capacity(self.c.env, self.kube, CAPACITY, self.ctld_restarted_at,
                                 self.still_running())
            pods = K.list_pods(self.kube, NAMESPACE)
        except Unreadable as e:
            self._not_sampled(e.side, t0, e.detail)
            return
        except (K.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            self._not_sampled("kubernetes", t0, f"list pods: {type(e).__name__}: {e}"[:300])
            return
        if over and not self.first_violation:
            try:
                self.first_violation = self.snapshot()
            except Exception as e:      # the API server restarting: the rest still says much
                self.first_violation = f"faults before: {self.faults[-4:]} (snapshot: {e})"
        unchecked = self.unchecked_shared_nodes()
        terminating = sum(1 for p in pods if p["metadata"].get("deletionTimestamp"))
        with self.lock:
            for p in pods:
                if p["spec"].get("nodeName"):
                    if p["metadata"]["name"] in self.scheduled:
                        self.placed.add(p["metadata"]["name"])
                    elif (p["metadata"].get("labels") or {}).get("app"):
                        self.deployed.add(p["metadata"]["uid"])
            self.counts["samples"] += 1
            self.counts["most Terminating pods in a sample"] = max(
                terminating, self.counts["most Terminating pods in a sample"])
            self.violations += over
            if unchecked is not None:
                self.counts["webhook scope samples"] += 1
            if unchecked:
                self.violations.append(f"{time.strftime('%T')} the webhook configuration "
                                       f"leaves shared nodes unchecked: {unchecked}")

    def _not_sampled(self, side: str, t0: float, why: str):
        with self.lock:
            self.counts["samples not taken"] += 1
            self.not_sampled.append((side, t0, time.monotonic(), f"{time.strftime('%T')} {why}"))

    def _server_error(self, t0: float, answer: str):
        with self.lock:
            self.counts["pod creates answered 5xx"] += 1
            self.server_errors.append((t0, time.monotonic(), f"{time.strftime('%T')} {answer}"))

    def unexplained(self) -> list[str]:
        """Samples not taken and 5xx answers that no fault of their side
        explains (none overlapped them, up to EXPLAINED_AFTER after its end)."""
        def explained(side, start, end):
            return any(side in sides and start <= t1 + EXPLAINED_AFTER and end >= t0
                       for _, sides, t0, t1 in self.windows)
        out = [f"sample not taken ({side}): {why}" for side, start, end, why in self.not_sampled
               if not explained(side, start, end)]
        return out + [f"create answered {answer}" for start, end, answer in self.server_errors
                      if not explained("webhook", start, end)
                      and not explained("kubernetes", start, end)]

    def snapshot(self) -> str:
        """The ledger, Slurm's running jobs and the pods bound, as they are
        now (right after a violation was seen), and the last faults: what a
        CI log must carry to explain it."""
        def run(*argv):
            try:
                return subprocess.run(argv, capture_output=True, text=True, env=self.c.env,
                                      timeout=10).stdout
            except subprocess.TimeoutExpired:
                return f"{argv[0]}: timed out\n"
        pods = [(p["metadata"]["name"], p["spec"].get("nodeName"),
                 p["metadata"].get("deletionTimestamp") is not None)
                for p in K.list_pods(self.kube, NAMESPACE) if p["spec"].get("nodeName")]
        return (f"faults before: {self.faults[-4:]}\n"
                f"ledger: {run(sys.executable, '-m', 'pyk8sres', 'ledger', 'show')}"
                f"jobs: {run('squeue', '-h', '-t', 'R', '-o', '%i %C %m %N %S')}"
                f"pods bound (name, node, terminating): {pods}\n"
                f"sync log: {self.c.log_tail('sync.out', 8)}")

    def unchecked_shared_nodes(self) -> list[str] | None:
        """Shared nodes the webhook's matchCondition names as unshared (it is
        called for every node but those); None if it cannot be read now."""
        try:
            doc = K.get_webhook_config(self.kube, "pyk8sres-admission")
        except (K.ApiException, urllib3.exceptions.HTTPError, OSError):
            return None
        if doc is None:
            return ["(no ValidatingWebhookConfiguration)"]
        text = json.dumps([w.get("matchConditions") for w in doc.get("webhooks") or []])
        return [n for n in CAPACITY if f"'{n}': true" in text]

    # --- faults -------------------------------------------------------------
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
        req = urllib.request.Request(f"https://127.0.0.1:{self.cp.ports.webhook}/validate",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ssl.SSLError, ConnectionError) as e:
            return "tls", str(e)

    def _forged_reviews(self):
        """Reviews forged to shrink a bound pod's reservation to nothing (its
        UID, no requests) and to reserve 64 CPUs for a pod that does not
        exist, each posted with no client certificate, one of another CA
        and a user's of the cluster's own CA: every one refused, and the
        ledger holds the same for both keys afterwards."""
        pods = [p for p in K.list_pods(self.kube, NAMESPACE)
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
            for p in K.list_pods(self.kube, NAMESPACE))
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
                failed = None if reply.get("ok") or L.not_ready(reply) else reply
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
        doc = K.get_webhook_config(self.kube, "pyk8sres-admission")
        timeout = max(w.get("timeoutSeconds", 10) for w in doc["webhooks"])
        pid = int(open(os.path.join(self.c.work, "run", "proc-webhook.pid")).read())
        name = f"fault-probe-{self.rnd.randrange(1 << 30)}"
        node = f"n{self.rnd.randint(1, NODES)}"
        os.kill(pid, signal.SIGSTOP)
        stopped = self.webhook_stopped_at = time.monotonic()
        try:
            try:
                K.create_pod(self.kube, NAMESPACE, {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"nodeName": node, "terminationGracePeriodSeconds": 2,
                             "containers": [{"name": "c", "image": "x", "resources": {
                                 "requests": {"cpu": "250m", "memory": "128Mi"}}}]}})
                answer = "admitted"
            except K.ApiException as e:
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
                K.delete_pod(self.kube, NAMESPACE, name)
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
        for p in K.list_pods(self.kube, field_selector=f"spec.nodeName={node}"):
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


@pytest.fixture(scope="module")
def world():
    work = tempfile.mkdtemp(prefix="pyk8sres-churn-")
    os.chmod(work, 0o755)       # the ledger's callers of other uids reach its socket
    # Time limits as a site has them: an srun whose allocation answer died
    # with a kill -9'd slurmctld waits forever, its allocation ends at the limit.
    # A backup controller; FLOODER may call the ledger too (the coordinator's group reaches its socket).
    c, cp = hybrid.up(work, nodes=NODES, cpus=CPUS, memory=MEMORY, base_port=port(17450),
                      kube_port=pick_ports(27800, 27990), extra_conf="KillWait=5\n",
                      slurm=SLURM, backup_controller=True,
                      ledger_users=(FLOODER,))
    kube = K.Kube(cp.kubeconfig, None, 10)
    try:
        kube.core.create_namespace({"metadata": {"name": NAMESPACE}})
        kube.core.create_namespace({"metadata": {"name": QUOTA_NAMESPACE}})
        kube.core.create_namespaced_resource_quota(QUOTA_NAMESPACE, {
            "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
        apps = kclient.AppsV1Api(kube.api)
        for name, (cpu, memory) in DEPLOYMENTS.items():
            apps.create_namespaced_deployment(NAMESPACE, deployment(name, cpu, memory))
        yield c, cp, kube
    finally:
        hybrid.down(work)
        if not os.environ.get("PYK8SRES_KEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)


def test_churn_with_faults_never_double_books(world):
    c, cp, kube = world
    churn = Churn(c, cp, kube, seed=int(os.environ.get("PYK8SRES_CHURN_SEED", "8")))
    workers = [threading.Thread(target=f, daemon=True) for f in
               (churn.submit_jobs, churn.create_pods, churn.scale_deployments, churn.delete_pods,
                churn.resize_pods, churn.quota_refused_creates, churn.check, churn.inject,
                churn.node_outages)]
    for w in workers:
        w.start()
    time.sleep(SECONDS)
    # A short run goes on until each fault has happened once.
    churn.every_fault_done.wait(600)
    churn.stop.set()
    for w in workers:
        w.join(180)

    refused_bindings = sum(e.get("count") or 1 for e in K.list_events(
        kube, NAMESPACE, field_selector="reason=InsufficientSharedCapacity"))

    # Nothing stuck: with the pods gone, every job starts (or has run).
    apps = kclient.AppsV1Api(kube.api)
    for name in DEPLOYMENTS:
        apps.patch_namespaced_deployment_scale(name, NAMESPACE, {"spec": {"replicas": 0}})
    for p in K.list_pods(kube, NAMESPACE):
        K.delete_pod(kube, NAMESPACE, p["metadata"]["name"])
    drain_started = time.monotonic()
    # Jobs and nodes Slurm held itself after its kill -9 window hold nothing;
    # released and resumed, they must run like every other job and node.
    resumed = drained_for_a_second_copy(c)
    if resumed:
        subprocess.run(["scontrol", "update", f"NodeName={','.join(resumed)}", "State=RESUME"],
                       env=c.env, check=True, capture_output=True)
    pending = drain(c.env)
    refused_copies = held_after_a_refused_second_copy(c, pending)
    if refused_copies:
        subprocess.run(["scontrol", "release", *refused_copies], env=c.env, check=True,
                       capture_output=True)
        pending = drain(c.env)
    drained_in = time.monotonic() - drain_started
    deadline = time.monotonic() + STALL_SECONDS
    lost = 0
    for name, p in churn.sruns:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            known = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True,
                                   text=True, env=c.env).stdout.strip()
            if known:
                pending.append(f"srun {name} (job {known})")
            else:
                # Its job was accepted by a slurmctld killed -9 before it
                # saved its state: srun waits for an answer that never comes.
                # Slurm's own window, not a stuck job; nothing holds resources.
                lost += 1
                p.kill()
                p.wait()
    states = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True,
                            env=c.env).stdout
    started = len(re.findall(r"JobState=(?:COMPLETED|RUNNING|COMPLETING)", states))
    summary = dict(churn.counts, **{"pods for kube-scheduler": len(churn.scheduled),
                                    "of them seen bound": len(churn.placed),
                                    "Deployment pods seen bound": len(churn.deployed),
                                    "bindings the webhook refused": refused_bindings,
                                    "jobs started (still known to slurmctld)": started,
                                    "sruns whose job died with slurmctld's kill -9": lost,
                                    "jobs Slurm held after slurmd refused a second copy "
                                    "(released, then ran)": len(refused_copies),
                                    "nodes Slurm drained for such a copy (resumed)":
                                        len(resumed),
                                    "seconds the backlog took to run": round(drained_in),
                                    "violations": len(churn.violations)})
    print("\nchurn summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    print("faults: " + "; ".join(churn.faults))
    sides = {}
    for side, *_ in churn.not_sampled:
        sides[side] = sides.get(side, 0) + 1
    print(f"samples not taken (each must overlap a fault of its side): {sides or 'none'}; "
          f"creates answered 5xx: {[e[2] for e in churn.server_errors[:3]]}")
    print("daemons found dead or hung after a fault, started again: "
          + ("; ".join(churn.revived) or "none"))
    if churn.flood_ms:
        ms = sorted(churn.flood_ms)
        print(f"root's ledger show during floods: {len(ms)} calls, median "
              f"{ms[len(ms) // 2]:.1f} ms, p99 {ms[int(len(ms) * 0.99)]:.1f} ms, "
              f"max {ms[-1]:.1f} ms")
    assert not churn.violations, (f"{len(churn.violations)} violations: "
                                  f"{churn.violations[:5]}\n{churn.first_violation}\n"
                                  f"faults: {churn.faults}")
    assert not churn.fault_errors, churn.fault_errors
    assert not churn.check_errors, churn.check_errors[:5]
    # A sample that could not be taken, or a 5xx, only where a fault explains it.
    unexplained = churn.unexplained()
    assert not unexplained, (f"{len(unexplained)} unexplained: {unexplained[:5]}\n"
                             f"faults: {churn.faults}")
    if pending:
        ledger = subprocess.run([sys.executable, "-m", "pyk8sres", "ledger", "show"],
                                capture_output=True, text=True, env=c.env).stdout
        jobs = subprocess.run(["squeue", "-o", "%i %T %C %m %N %r %b %S"], capture_output=True,
                              text=True, env=c.env).stdout
        first = subprocess.run(["scontrol", "-d", "show", "job", pending[0].split()[0]],
                               capture_output=True, text=True, env=c.env).stdout
        nodes = subprocess.run(["scontrol", "-d", "show", "node"], capture_output=True,
                               text=True, env=c.env).stdout
        pytest.fail(f"stuck after the churn: {pending}\nledger:\n{ledger}\njobs:\n{jobs}\n"
                    f"{first}\n{nodes}\nsync log: {c.log_tail('sync.out', 10)}\n"
                    f"daemon logs kept in {c.work}/log")
    # The churn really churned, and the faults really happened.
    counts = churn.counts
    assert counts["samples"] > 50 and counts["faults"] >= 8 and counts["node outages"] >= 1
    assert counts["deployment scalings"] >= 10 and counts["pods deleted with a grace period"] > 10
    assert counts["most Terminating pods in a sample"] > 0
    assert counts["pods admitted"] > 0 and counts["pods refused"] > 0
    assert counts["pods force-deleted (grace 0)"] > 0 and counts["resizes admitted"] > 0
    assert counts["creates refused by a quota"] > 0
    # Admission failed closed while the webhook gave no answer.
    assert counts["creates refused while the webhook was stopped"] >= 1
    assert len(churn.placed) > 5 and len(churn.deployed) > 5 and started > 10
    assert counts["pods admitted"] + len(churn.placed) + len(churn.deployed) > 30
    # ... and so did the hostile ones.
    assert churn.every_fault_done.is_set(), churn.faults
    assert counts["forged reviews refused"] >= 6 and counts["flood connections"] >= 8
    assert counts["stranger connects refused"] > 0 and counts["controller changes"] >= 4
    assert counts["webhook scope samples"] > 50
