"""Randomized churn with injected faults on the real control plane: Slurm jobs
(sbatch, arrays, srun) and pods on 3 shared nodes -- placed by the real
kube-scheduler, straight onto nodes with spec.nodeName, and by two
Deployments scaled up and down; pods deleted with grace periods (they stay
Terminating, running, until it ends) and force-deleted (their kubelet may
run them for their grace period after the object is gone); pods resized in
place, up and down; creates on shared nodes that a ResourceQuota of 0 pods
refuses after admission -- while the coordinator, slurmctld,
kube-apiserver, kube-scheduler and kube-controller-manager are killed or
restarted, slurmctld reconfigured, a partition updated (its nodes too), a
node's Node object deleted under its pods and registered again, the webhook made
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

The workload and the checks are in churn_world.py, the faults in
churn_faults.py.

CI runs a bounded version (PYK8SRES_CHURN_SECONDS, default 60 s of churn, extended
until every fault has happened once); a soak by hand:
PYK8SRES_CHURN_SECONDS=1800 python3 -m pytest -s tests/integration/test_churn.py
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from kubernetes import client as kclient

from churn_faults import FLOODER, ChurnWithFaults
from churn_world import (CPUS, DEPLOYMENTS, MEMORY, NAMESPACE, NODES, QUOTA_NAMESPACE,
                         SECONDS, deployment)
from conftest_kube import pick_ports
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.coordinator import kube as kube_calls
from pyk8sres.testbed import hybrid

# The churn, the rest of the first cycle of faults (up to 600 s), and the
# backlog it leaves (it grows with the churn's length).
pytestmark = requires_slurm + [pytest.mark.timeout(int(4 * SECONDS) + 1500)]
# Liveness after the churn.  The churn leaves a backlog (jobs are submitted
# near the cluster's capacity: 60 s of churn leave 1.5-2 minutes of jobs).  A
# queue is stuck when no pending job starts for longer than a job can run:
# each has a 1-minute limit (plus KillWait 5 s and a scheduling pass).
STALL_SECONDS = 90


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
    kube = kube_calls.Kube(cp.kubeconfig, None, 10)
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


def run_the_churn(churn) -> None:
    """The workload, the checker and the faults, each in its thread, for
    SECONDS and until every fault has happened once."""
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


def run_the_backlog(c, kube, churn) -> tuple:
    """The pods gone, the queue drained: (jobs still pending when it stopped
    draining, nodes resumed and jobs released that Slurm held itself,
    seconds it took, sruns lost with a slurmctld killed -9)."""
    apps = kclient.AppsV1Api(kube.api)
    for name in DEPLOYMENTS:
        apps.patch_namespaced_deployment_scale(name, NAMESPACE, {"spec": {"replicas": 0}})
    for p in kube_calls.list_pods(kube, NAMESPACE):
        kube_calls.delete_pod(kube, NAMESPACE, p["metadata"]["name"])
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
    return pending, resumed, refused_copies, drained_in, lost


def report(churn, summary: dict) -> None:
    """What the churn did, for the CI log."""
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


def stuck(c, pending: list[str]) -> str:
    """What a CI log must carry to explain jobs still pending after the churn."""
    ledger = subprocess.run([sys.executable, "-m", "pyk8sres", "ledger", "show"],
                            capture_output=True, text=True, env=c.env).stdout
    jobs = subprocess.run(["squeue", "-o", "%i %T %C %m %N %r %b %S"], capture_output=True,
                          text=True, env=c.env).stdout
    first = subprocess.run(["scontrol", "-d", "show", "job", pending[0].split()[0]],
                           capture_output=True, text=True, env=c.env).stdout
    nodes = subprocess.run(["scontrol", "-d", "show", "node"], capture_output=True,
                           text=True, env=c.env).stdout
    return (f"stuck after the churn: {pending}\nledger:\n{ledger}\njobs:\n{jobs}\n"
            f"{first}\n{nodes}\nsync log: {c.log_tail('sync.out', 10)}\n"
            f"daemon logs kept in {c.work}/log")


def test_churn_with_faults_never_double_books(world):
    c, cp, kube = world
    churn = ChurnWithFaults(c, cp, kube, seed=int(os.environ.get("PYK8SRES_CHURN_SEED", "8")))
    run_the_churn(churn)

    refused_bindings = sum(e.get("count") or 1 for e in kube_calls.list_events(
        kube, NAMESPACE, field_selector="reason=InsufficientSharedCapacity"))

    # Nothing stuck: with the pods gone, every job starts (or has run).
    pending, resumed, refused_copies, drained_in, lost = run_the_backlog(c, kube, churn)
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
    report(churn, summary)
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
        pytest.fail(stuck(c, pending))
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
