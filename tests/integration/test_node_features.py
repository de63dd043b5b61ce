"""node_features/k8s_resources on a real local Slurm cluster (root only).

Three nodes on this host: n1 keeps `Gres=k8scpu:..,k8smemory:..` in
slurm.conf, n2 has no Gres= (the plugin supplies it), n3 is dynamic
(`slurmd -Z`).  With a job running on n1 we lower counts the way the sync
daemon does (state file first, then `scontrol update`), restart slurmd,
restart slurmctld, reconfigure, and after each step assert Gres/GresUsed/State
and that no node is drained.

Ports: PYK8SRES_TEST_BASE_PORT (default 28400) .. +5 on 127.0.0.1.
Needs the built plugins in pyk8sres/_lib (pip install . or a staged tree).
"""
import os
import re
import subprocess
import time

import pytest

from pyk8sres.testbed import cluster
from pyk8sres import install
from pyk8sres.slurmctld.nodestate import write_state
from local_slurm import RELEASE, port

BASE_PORT = port(28400)
CPUS, MEMORY = 4, 8000
DYN_CPUS, DYN_MEMORY = 2, 3000
DYN_CONF = f"CPUs={DYN_CPUS} RealMemory={DYN_MEMORY}"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster runs daemons as root"),
    pytest.mark.skipif(RELEASE is None, reason="slurmctld not installed"),
    pytest.mark.skipif(RELEASE is not None and
                       not os.path.exists(os.path.join(RELEASE.lib_dir, install.PLUGINS[1])),
                       reason="node_features_k8s_resources.so not built (-Dslurm_source)"),
]


def node_line_split(text: str) -> str:
    """n1 with Gres= in slurm.conf, n2 without: the plugin must cope with both."""
    host = re.search(r"NodeHostname=(\S+)", text).group(1)
    common = f"NodeHostname={host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory={MEMORY} State=UNKNOWN"
    lines = (f"NodeName=n1 Port={BASE_PORT + 1} {common} Gres=k8scpu:{CPUS},k8smemory:{MEMORY}\n"
             f"NodeName=n2 Port={BASE_PORT + 2} {common}\n")
    return re.sub(r"^NodeName=.*\n", lines, text, flags=re.M)


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("nf"))
    taken = [p for p in range(BASE_PORT, BASE_PORT + 6) if not cluster.port_free(p)]
    if taken:
        pytest.skip(f"ports {taken} busy (set PYK8SRES_TEST_BASE_PORT)")
    cl = cluster.Cluster(work, RELEASE)
    for sub in ("etc", "munge", "state", "run", "log", "plugins", "spool/n1", "spool/n2", "spool/n3"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    os.chmod(os.path.join(work, "munge"), 0o700)
    with open(os.path.join(work, "munge", "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(work, "munge", "munge.key"), 0o400)
    install.install_plugins(os.path.join(work, "plugins"), check_version=False,
                            lib_dir=RELEASE.lib_dir)
    with open(os.path.join(work, "etc", "release"), "w") as f:  # for cluster.down
        f.write(f"{RELEASE.name}\n{os.pathsep.join(RELEASE.bin_dirs)}\n")
    text = cluster.slurm_conf_text(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=BASE_PORT,
                                   node_features=True, def_mem_per_cpu=100,
                                   plugin_dir=RELEASE.plugin_dir,
                                   # the dynamic slurmd takes SlurmdPort (Port= is
                                   # not allowed in --conf)
                                   extra=f"MaxNodeCount=8\nSlurmdPort={BASE_PORT + 3}\n")
    # This test is about node counts: jobs ask for k8scpu/k8smemory
    # explicitly instead of relying on the job_submit plugin.
    text = re.sub(r"^JobSubmitPlugins=.*\n", "", text, flags=re.M)
    with open(cl.conf, "w") as f:
        f.write(node_line_split(text))
    with open(os.path.join(work, "etc", "gres.conf"), "w") as f:
        f.write(cluster.GRES_CONF)
    cl.state_file = os.path.join(work, "state", "k8s_resources.state")
    with open(os.path.join(work, "etc", "k8s_resources.conf"), "w") as f:
        f.write(f"StateFile={cl.state_file}\n")
    # Before any daemon: n1 lowered by Kubernetes, n2 Slurm-only, n3 not yet counted.
    write_state(cl.state_file, {"n1": {"k8scpu": 3, "k8smemory": 6000}}, unmanaged=["n2"])
    try:
        cl.start_munged()
        cl.start_slurmctld()
        for node in ("n1", "n2"):
            cl.start_slurmd(node)
        cl.start_slurmd("n3", dynamic_conf=DYN_CONF)
        cl.wait_nodes_idle(["n1", "n2", "n3"])
        yield cl
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=cl.env, capture_output=True)
        time.sleep(1)
        cluster.down(work)


def sh(c, *argv) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True, env=c.env, timeout=60)
    assert p.returncode == 0, f"{argv}: {p.stderr}"
    return p.stdout


def node(c, name: str) -> dict:
    out = sh(c, "scontrol", "-d", "-o", "show", "node", name)
    return dict(re.findall(r"(\w+)=(\S*)", out))


def gres(value: str) -> dict:
    """'k8scpu:3,k8smemory:6000' (GresUsed may add '(IDX:..)') -> {name: count}."""
    out = {}
    for tok in re.sub(r"\([^)]*\)", "", value).split(","):
        m = re.fullmatch(r"(\w+):(?:\w+:)?(\d+)([KMGT]?)", tok)
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024 ** " KMGT".index(m.group(3) or " ")
    return out


def used(n: dict) -> dict:
    """GresUsed as counts; 24.11 omits GresUsed when the node's Gres is empty
    (all counts 0), 22.05 prints k8scpu:0,k8smemory:0."""
    counts = gres(n.get("GresUsed", ""))
    return {k: counts.get(k, 0) for k in ("k8scpu", "k8smemory")}


def expect(c, name, cpu, mem, used_cpu=0, used_mem=0):
    n = node(c, name)
    assert gres(n["Gres"]) == {"k8scpu": cpu, "k8smemory": mem}, n
    assert used(n) == {"k8scpu": used_cpu, "k8smemory": used_mem}, n
    assert not re.search(r"DRAIN|DOWN|INVAL|FAIL", n["State"]), n


def no_node_drained(c):
    out = sh(c, "sinfo", "-h", "-N", "-o", "%N %t")
    assert not re.search(r"drain|drng|down|inval|fail", out), out


def wait_for(pred, what, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out: {what}")


def lower(c, counts, unmanaged=("n2",)):
    """What the sync daemon does: state file first, then Slurm."""
    write_state(c.state_file, counts, unmanaged=list(unmanaged))
    for name, v in counts.items():
        sh(c, "scontrol", "update", f"NodeName={name}",
           f"Gres=k8scpu:{v['k8scpu']},k8smemory:{v['k8smemory']}")


def restart_slurmd(c, name, dynamic_conf=None):
    c.stop(f"slurmd-{name}")
    c.start_slurmd(name, dynamic_conf=dynamic_conf)
    time.sleep(1)
    c.wait_nodes_idle([name])


def submit(c, node, cpus, mem):
    """A job holding `cpus` CPUs + k8scpu and `mem` MB + k8smemory on `node`."""
    return sh(c, "sbatch", "--parsable", "-w", node, "-n", str(cpus), f"--mem={mem}",
              f"--gres=k8scpu:{cpus},k8smemory:{mem}", "-o", "/dev/null",
              "--wrap", "sleep 600").strip()


def job_state(c, job):
    return sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip()


def test_registration_gives_counts_without_gres_lines(c):
    expect(c, "n1", 3, 6000)            # Gres= in slurm.conf, lowered by state
    expect(c, "n2", CPUS, MEMORY)       # no Gres=, unmanaged: full capacity
    # dynamic node the daemon has not counted yet: held at 0 (node stays up)
    n3 = node(c, "n3")
    assert used(n3) == {"k8scpu": 0, "k8smemory": 0}
    assert not re.search(r"DRAIN|DOWN|INVAL", n3["State"]), n3
    lower(c, {"n1": {"k8scpu": 3, "k8smemory": 6000}, "n3": {"k8scpu": 2, "k8smemory": 2500}})
    expect(c, "n3", 2, 2500)
    no_node_drained(c)


def test_lowered_counts_survive_restarts_with_jobs_running(c):
    job = submit(c, "n1", 2, 1000)
    wait_for(lambda: job_state(c, job) == "RUNNING", "job on n1")
    expect(c, "n1", 3, 6000, 2, 1000)

    # Kubernetes takes more: 3 -> 3 CPUs of which the job holds 2.
    lower(c, {"n1": {"k8scpu": 3, "k8smemory": 4000}, "n3": {"k8scpu": 2, "k8smemory": 2500}})
    expect(c, "n1", 3, 4000, 2, 1000)
    # Fits n1's free CPUs (2 of 4) but not its free k8scpu (1): must wait,
    # through every restart below.
    blocked = submit(c, "n1", 2, 100)

    restart_slurmd(c, "n1")
    expect(c, "n1", 3, 4000, 2, 1000)
    restart_slurmd(c, "n3", dynamic_conf=DYN_CONF)
    expect(c, "n3", 2, 2500)
    no_node_drained(c)

    c.restart_slurmctld()
    # Set at startup under slurmctld's locks, before the first scheduling
    # pass and before any slurmd registers again.
    expect(c, "n1", 3, 4000, 2, 1000)
    expect(c, "n2", CPUS, MEMORY)
    expect(c, "n3", 2, 2500)

    sh(c, "scontrol", "reconfigure")
    expect(c, "n1", 3, 4000, 2, 1000)
    expect(c, "n3", 2, 2500)
    time.sleep(5)  # a few scheduling passes (sched_interval=2)
    assert job_state(c, blocked) == "PENDING"
    assert job_state(c, job) == "RUNNING"
    expect(c, "n1", 3, 4000, 2, 1000)
    no_node_drained(c)
    sh(c, "scancel", blocked)


def test_count_below_what_jobs_hold(c):
    # Kubernetes overcommits: k8scpu 1 while the job holds 2.  Accepted at
    # once; on re-registration/restart the plugin keeps what the job holds
    # (Slurm would otherwise drop the job's GRES when it rebuilds allocations
    # and hand them out again), so nothing new fits either way.
    lower(c, {"n1": {"k8scpu": 1, "k8smemory": 4000}, "n3": {"k8scpu": 2, "k8smemory": 2500}})
    expect(c, "n1", 1, 4000, 2, 1000)
    restart_slurmd(c, "n1")
    expect(c, "n1", 2, 4000, 2, 1000)
    c.restart_slurmctld()
    expect(c, "n1", 2, 4000, 2, 1000)
    blocked = submit(c, "n1", 1, 100)
    time.sleep(5)
    assert job_state(c, blocked) == "PENDING"
    expect(c, "n1", 2, 4000, 2, 1000)
    no_node_drained(c)
    sh(c, "scancel", blocked)


def test_busy_node_not_subtracted_twice(c):
    # Raise n1 again while its job runs: free k8scpu must be 4 - 2 = 2, not 0
    # (gres_node_feature alone would store avail = 4 - 2 and the scheduler
    # would subtract the job again).
    lower(c, {"n1": {"k8scpu": CPUS, "k8smemory": MEMORY}, "n3": {"k8scpu": 2, "k8smemory": 2500}})
    c.restart_slurmctld()
    expect(c, "n1", CPUS, MEMORY, 2, 1000)
    restart_slurmd(c, "n1")
    expect(c, "n1", CPUS, MEMORY, 2, 1000)
    second = submit(c, "n1", 2, 1000)
    wait_for(lambda: job_state(c, second) == "RUNNING", "second job on busy n1")
    expect(c, "n1", CPUS, MEMORY, 4, 2000)
    no_node_drained(c)
    sh(c, "scancel", second)


def test_node_features_stay_as_configured(c):
    # The marker feature slurmd reports is removed again.
    for name in ("n1", "n2", "n3"):
        n = node(c, name)
        assert "k8s_resources_managed" not in n.get("AvailableFeatures", ""), n
        assert "k8s_resources_managed" not in n.get("ActiveFeatures", ""), n


def test_corrupt_state_file_holds_and_keeps_node_up(c):
    with open(c.state_file, "w") as f:
        f.write("{not json")
    restart_slurmd(c, "n2")
    n2 = node(c, "n2")
    assert used(n2) == {"k8scpu": 0, "k8smemory": 0}
    assert gres(n2["Gres"]) == {}, n2     # held at 0 (Slurm hides zero counts)
    assert not re.search(r"DRAIN|DOWN|INVAL", n2["State"]), n2
    log = open(os.path.join(c.work, "log", "slurmctld.log"), errors="replace").read()
    assert "node_features/k8s_resources: _apply: node n2:" in log
    assert "holding k8scpu/k8smemory at 0" in log
    # The daemon writes a good file again: the next registration recovers.
    write_state(c.state_file, {"n1": {"k8scpu": CPUS, "k8smemory": MEMORY},
                               "n3": {"k8scpu": 2, "k8smemory": 2500}}, unmanaged=["n2"])
    restart_slurmd(c, "n2")
    expect(c, "n2", CPUS, MEMORY)
    no_node_drained(c)
