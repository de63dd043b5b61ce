"""The ledger under admission load, checked while it runs (short; the long
run is bench/bench_ledger_stress.py): 6 clients reserve and release on two
nodes running real jobs of random sizes; no grant is lost, nothing is
granted beyond capacity against `scontrol -d show job`, and slurmctld
answers squeue and sbatch within 1 s throughout.  Plus 50 scale nodes
(`cluster up --scale-nodes`): slurmctld keeps asking them to register."""
import os
import subprocess
import time

import pytest

from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
from pyk8sres.policy.ledger import merged_show
from pyk8sres.testbed import stress
from ground_truth import slurm_jobs
from ledger_checks import sh
from local_slurm import RELEASE, local_cluster, port, requires_slurm

pytestmark = requires_slurm + [
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)")]

CPUS, MEMORY = 8, 8000
SECONDS = float(os.environ.get("PYK8SRES_STRESS_SECONDS", "25"))


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "ledger-stress", nodes=2, cpus=CPUS,
                             memory=MEMORY, base_port=port(28750), scale_nodes=50,
                             node_features=True)


def test_scale_nodes_stay_unknown_with_capacity(c):
    out = subprocess.run(["sinfo", "-h", "-p", "scale", "-o", "%D %t"], env=c.env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "50" and out[1].startswith("unk"), out
    shown = Ledger(ledger_socket_path(c.conf)).show("s50")["nodes"]["s50"]
    assert shown["capacity"] == {"cpu": CPUS, "mem": MEMORY}


def test_show_since_a_token_lists_what_changed_and_merges_to_the_truth(c):
    """The plugin's per-node change numbers in slurmctld: a `show` since a
    token lists the node a reserve touched and the node a job started on,
    no other; merged, it says what a full `show` and Slurm itself say."""
    ledger = Ledger(ledger_socket_path(c.conf))
    first = ledger.show()
    assert first["full"] and len(first["nodes"]) == 52
    quiet = ledger.show(since=first["token"])
    assert quiet["ok"] and quiet["full"] is False and quiet["nodes"] == {}, quiet
    assert ledger.reserve("s7", "since-pod", 1500, 1 << 20)["ok"]
    job = sh(c, "sbatch", "--parsable", "-w", "n2", "-c", "3", "--mem=500", "-o", "/dev/null",
             "--wrap", "sleep 300").strip()
    try:
        deadline = time.monotonic() + 30
        while "R" != sh(c, "squeue", "-h", "-j", job, "-o", "%t").strip():
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        since = ledger.show(since=quiet["token"])
        assert since["full"] is False and sorted(since["nodes"]) == ["n2", "s7"], since["nodes"]
        assert since["nodes"]["s7"]["share"]["cpu"] == 2
        truth = slurm_jobs(c.env, ["n2"])["n2"]
        assert [since["nodes"]["n2"]["jobs"][k] for k in ("cpu", "mem")] == truth
        merged, changed = merged_show(first["nodes"], since)
        assert changed == {"n2", "s7"} and merged == ledger.show()["nodes"]
    finally:
        subprocess.run(["scancel", job], env=c.env)
        ledger.release("s7", "since-pod")


def test_no_grant_lost_nothing_beyond_capacity_slurmctld_answers(c):
    run = stress.Stress(c, {"n1": (CPUS, MEMORY), "n2": (CPUS, MEMORY)}, clients=6)
    report = run.run(SECONDS)
    print(report.summary())
    assert not report.errors, report.errors[:5]
    assert not report.violations, report.violations[:5]
    # The load was real: grants and refusals, jobs, checks and probes.
    assert report.granted > 50 and report.refused > 0, report.summary()
    assert report.jobs_submitted > 10 and report.checks > 10 and report.probes > 10
    # The capacity check bit: jobs and pods together came close to full.
    assert max(report.max_cpu_used.values()) >= CPUS - 2, report.max_cpu_used


def test_the_checker_sees_a_lost_grant_and_an_overbooking(c):
    run = stress.Stress(c, {"n1": (CPUS, MEMORY)})
    ledger = Ledger(ledger_socket_path(c.conf))
    # A grant the ledger does not hold.
    run.grants["forged"] = stress.Grant("n1", 100, 1 << 20, granted=0.0)
    # A repair `set` may leave a node oversubscribed (the ledger reports it).
    assert ledger.set("n1", {"too-big": (CPUS * 1000 + 1000, 1 << 20)}, 0)["ok"]
    try:
        run.check_once(ledger)
    finally:
        ledger.set("n1", {}, 0)
    assert any("grant lost: forged" in v for v in run.report.violations), run.report.violations
    assert any("beyond capacity on n1" in v for v in run.report.violations), run.report.violations
