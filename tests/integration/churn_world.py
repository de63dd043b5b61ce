"""The churn test's world (tests/integration/test_churn.py): the cluster's
shape, the workload (Slurm jobs, pods created, scaled, deleted, resized, and
creates a ResourceQuota refuses) and the invariant checked all along from
ground truth.  The faults injected meanwhile are in churn_faults.py."""
import json
import os
import random
import subprocess
import sys
import threading
import time

import urllib3
from kubernetes import client as kclient

from ground_truth import Unreadable, over_capacity, pod_size
from pyk8sres.coordinator import kube as kube_calls

NODES, CPUS, MEMORY = 3, 8, 16000
CAPACITY = {f"n{i}": (CPUS, MEMORY) for i in range(1, NODES + 1)}
SECONDS = float(os.environ.get("PYK8SRES_CHURN_SECONDS", "60"))
NAMESPACE = "churn"
QUOTA_NAMESPACE = "churn-quota"   # a ResourceQuota of 0 pods: every create there fails
DEPLOYMENTS = {"web-a": ("500m", "512Mi"), "web-b": ("1500m", "1Gi")}
# A sample that could not be taken, or a 5xx, is explained only by a fault
# that makes its side unreachable (churn_faults.DISRUPTS) and overlaps it,
# give or take EXPLAINED_AFTER seconds after the fault's end (a restarted
# daemon answering its first callers).
EXPLAINED_AFTER = 15.0


def deployment(name: str, cpu: str, memory: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {
                         "terminationGracePeriodSeconds": 3,
                         "containers": [{"name": "web", "image": "nginx", "resources": {
                             "requests": {"cpu": cpu, "memory": memory}}}]}}}}


class Churn:
    """The workload and the invariant: each public method is a thread's
    loop, until `stop`; what they saw is in `counts`, `violations` and the
    lists below.  The faults (churn_faults.ChurnWithFaults) record their
    windows and state here too, so the checks can tell what explains a
    sample not taken."""

    def __init__(self, c, cp, kube, seed: int, nodes=None, over=None):
        """nodes: the Kubernetes nodes pods are put on directly (default
        CAPACITY's: this world's); over: the invariant's sample, a function
        of this Churn returning the violations (default over_capacity on
        CAPACITY, what this world shares)."""
        self.c, self.cp, self.kube = c, cp, kube
        self.nodes = sorted(nodes or CAPACITY)
        self.over = over or (lambda churn: over_capacity(
            churn.c.env, churn.kube, CAPACITY, churn.ctld_restarted_at, churn.still_running()))
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

    def _any_node(self) -> str:
        # randint as before self.nodes: a seed's churn stays the same run
        return self.nodes[self.rnd.randint(1, len(self.nodes)) - 1]

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
            node = self._any_node() if direct else None
            t0 = time.monotonic()
            try:
                kube_calls.create_pod(self.kube, NAMESPACE, self._pod(f"p{i}", node))
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
            except kube_calls.ApiException as e:
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
            except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError):
                pass     # API server restarting

    def delete_pods(self):
        while not self.stop.wait(self.rnd.uniform(0.5, 1.5)):
            try:
                pods = kube_calls.list_pods(self.kube, NAMESPACE)
                for p in self.rnd.sample(pods, min(len(pods), self.rnd.randint(0, 4))):
                    grace = self.rnd.choice([0, 1, 3, None])    # None: the pod's own (2 or 3 s)
                    if grace == 0:
                        self._ghost(p)
                    self.kube.core.delete_namespaced_pod(
                        p["metadata"]["name"], NAMESPACE, grace_period_seconds=grace,
                        _request_timeout=10)
                    self._count("pods deleted with a grace period" if grace != 0 else
                                "pods force-deleted (grace 0)")
            except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError):
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
                pods = [p for p in kube_calls.list_pods(self.kube, NAMESPACE)
                        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                        and not (p["metadata"].get("labels") or {}).get("app")]
                if not pods:
                    continue
                p = self.rnd.choice(pods)
                cpu = self.rnd.choice(["250m", "500m", "1", "2", "3", "4"])
                kube_calls.resize_pod(self.kube, NAMESPACE, p["metadata"]["name"],
                                      [{"name": "c", "resources": {"requests": {"cpu": cpu}}}])
                self._count("resizes admitted")
            except kube_calls.ApiException as e:
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
            pod = self._pod(f"q{i}", self._any_node())
            try:
                kube_calls.create_pod(self.kube, QUOTA_NAMESPACE, pod)
                with self.lock:
                    self.violations.append(f"{time.strftime('%T')} q{i} created in "
                                           f"{QUOTA_NAMESPACE} despite its quota of 0 pods")
            except kube_calls.ApiException as e:
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
        t0, since = time.monotonic(), self.ctld_restarted_at
        try:
            over = self.over(self)
            pods = kube_calls.list_pods(self.kube, NAMESPACE)
        except Unreadable as e:
            self._not_sampled(e.side, t0, e.detail)
            return
        except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            self._not_sampled("kubernetes", t0, f"list pods: {type(e).__name__}: {e}"[:300])
            return
        if self.ctld_restarted_at != since:
            # Jobs recovered from before the restart were not told apart.
            self._not_sampled("slurm", t0, "slurmctld restarted during the sample")
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
                for p in kube_calls.list_pods(self.kube, NAMESPACE) if p["spec"].get("nodeName")]
        return (f"faults before: {self.faults[-4:]}\n"
                f"ledger: {run(sys.executable, '-m', 'pyk8sres', 'ledger', 'show')}"
                f"jobs: {run('squeue', '-h', '-t', 'R', '-o', '%i %C %m %N %S')}"
                f"pods bound (name, node, terminating): {pods}\n"
                f"sync log: {self.c.log_tail('sync.out', 8)}")

    def unchecked_shared_nodes(self) -> list[str] | None:
        """Shared nodes the webhook's matchCondition names as unshared (it is
        called for every node but those); None if it cannot be read now."""
        try:
            doc = kube_calls.get_webhook_config(self.kube, "pyk8sres-admission")
        except (kube_calls.ApiException, urllib3.exceptions.HTTPError, OSError):
            return None
        if doc is None:
            return ["(no ValidatingWebhookConfiguration)"]
        text = json.dumps([w.get("matchConditions") for w in doc.get("webhooks") or []])
        return [n for n in CAPACITY if f"'{n}': true" in text]
