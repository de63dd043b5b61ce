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
import random
import re
import socket
import subprocess
import threading
import time

import pytest

from pyk8sres.testbed import cluster
from pyk8sres import install
from pyk8sres.coordinator.slurm import Ledger, ledger_socket_path
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
    cl = cluster.Cluster(work, RELEASE)  # PYK8SRES_TEST_SLURM (local_slurm)
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
    with open(os.path.join(work, "etc", "k8s_resources.conf"), "w") as f:
        f.write("# defaults\n")
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


def ledger(c) -> Ledger:
    return Ledger(ledger_socket_path(c.conf))


def hold(c, name, cpu, mem_mb):
    """What the sync daemon does for the pods bound to a node: set its share."""
    entries = {"pod-test": (cpu * 1000, mem_mb << 20)} if cpu or mem_mb else {}
    assert ledger(c).set(name, entries, 0)["ok"]


def restart_slurmd(c, name, dynamic_conf=None):
    c.stop(f"slurmd-{name}")
    c.start_slurmd(name, dynamic_conf=dynamic_conf)
    c.wait_nodes_idle([name])


def submit(c, node, cpus, mem, *extra):
    out = sh(c, "sbatch", "--parsable", "-w", node, "-o", "/dev/null", *extra,
             f"--gres=k8scpu:{cpus},k8smemory:{mem}", "-c", str(cpus), f"--mem={mem}",
             "--wrap", "sleep 600")
    return out.strip()


def job_state(c, job):
    out = sh(c, "squeue", "-h", "-j", job, "-o", "%T %r").split()
    return tuple(out[:2]) if out else ("GONE", "")


def test_registration_gives_counts_without_gres_lines(c):
    expect(c, "n1", CPUS, MEMORY)           # Gres= in slurm.conf
    expect(c, "n2", CPUS, MEMORY)           # no Gres= at all
    expect(c, "n3", DYN_CPUS, DYN_MEMORY)   # dynamic node
    no_node_drained(c)


def _events(c):
    """Everything after which Slurm rebuilds GRES allocations from jobs, or
    loses plugin memory (DESIGN.md §7), plus slurmd re-registration."""
    yield "slurmd restart", lambda: restart_slurmd(c, "n1")
    yield "partition update", lambda: sh(c, "scontrol", "update", "PartitionName=debug",
                                         "MaxTime=1000")
    yield "partition create", lambda: sh(c, "scontrol", "create", "PartitionName=extra",
                                         "Nodes=n1")
    yield "partition delete", lambda: sh(c, "scontrol", "delete", "PartitionName=extra")
    yield "setdebugflags", lambda: (sh(c, "scontrol", "setdebugflags", "+gres"),
                                    sh(c, "scontrol", "setdebugflags", "-gres"))
    yield "dynamic node create", lambda: sh(c, "scontrol", "create", "NodeName=d1", "CPUs=1",
                                            "RealMemory=100", "State=FUTURE")
    yield "dynamic node delete", lambda: sh(c, "scontrol", "delete", "NodeName=d1")
    yield "reconfigure", lambda: sh(c, "scontrol", "reconfigure")
    yield "slurmctld restart", c.restart_slurmctld
    yield "slurmctld kill -9", lambda: _kill9_slurmctld(c)


def _kill9_slurmctld(c):
    pid = int(open(os.path.join(c.work, "run", "proc-slurmctld.pid")).read())
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    c.start_slurmctld()


def test_share_pends_jobs_and_survives_every_rebuild(c):
    hold(c, "n1", 3, 6000)
    job1 = submit(c, "n1", 1, 1000)                   # fits next to the share
    wait_for(lambda: job_state(c, job1)[0] == "RUNNING", "job 1 running")
    job2 = submit(c, "n1", 1, 500)                    # 3 + 1 + 1 > 4: must pend
    wait_for(lambda: job_state(c, job2) == ("PENDING", "Resources"), "job 2 pending")
    expect(c, "n1", CPUS, MEMORY, 4, 7000)
    for what, event in _events(c):
        event()
        wait_for(lambda: used(node(c, "n1")) == {"k8scpu": 4, "k8smemory": 7000},
                 f"share back after {what}: {node(c, 'n1')['GresUsed']}", timeout=15)
        expect(c, "n1", CPUS, MEMORY, 4, 7000)
        assert job_state(c, job1)[0] == "RUNNING", what
        assert job_state(c, job2)[0] == "PENDING", what
        no_node_drained(c)
    hold(c, "n1", 0, 0)                                # the pods leave
    wait_for(lambda: job_state(c, job2)[0] == "RUNNING", "job 2 starts once the pods go")
    expect(c, "n1", CPUS, MEMORY, 2, 1500)
    sh(c, "scancel", job1, job2)
    wait_for(lambda: used(node(c, "n1")) == {"k8scpu": 0, "k8smemory": 0},
             "jobs gone")


def test_exclusive_job_pends_while_pods_hold_part_of_its_node(c):
    hold(c, "n2", 1, 1000)
    job = submit(c, "n2", 1, 100, "--exclusive")
    wait_for(lambda: job_state(c, job) == ("PENDING", "Resources"), "exclusive job pending")
    hold(c, "n2", 0, 0)
    wait_for(lambda: job_state(c, job)[0] == "RUNNING", "exclusive job starts")
    sh(c, "scancel", job)


def test_reserve_answers(c):
    l = ledger(c)
    assert l.reserve("n3", "a", 2000, 3000 << 20)["ok"]           # exactly the node
    again = l.reserve("n3", "a", 2000, 3000 << 20)                  # idempotent
    assert again["ok"]
    big = l.reserve("n3", "b", 1, 0)
    assert big["code"] == "nofit" and "n3" in big["error"]
    assert l.reserve("n9", "a", 1, 1)["code"] == "unknown_node"
    assert l.call("reserve", node="n3", key="c", cpu_m=-1, mem_bytes=0)["code"] == "badrequest"
    assert l.call("reserve", node="n3", key="c", cpu_m=10**30, mem_bytes=0)["code"] == "badrequest"
    assert l.call("frobnicate")["code"] == "badrequest"
    shown = l.show("n3")["nodes"]["n3"]
    assert shown["share"] == {"cpu": DYN_CPUS, "mem": DYN_MEMORY} and shown["free"]["cpu"] == 0
    assert l.release("n3", "a")["ok"]
    assert ledger(c).show("n3")["nodes"]["n3"]["share"] == {"cpu": 0, "mem": 0}
    expect(c, "n3", DYN_CPUS, DYN_MEMORY)


def test_malformed_lines_and_strangers_leave_slurmctld_unaffected(c):
    path = ledger_socket_path(c.conf)
    for garbage in (b"{\n", b"\x00\xff\n", b"[1,2]\n", b"x" * 100 + b"\n",
                    b'{"op":"set","node":"n1","entries":{"k":[1]}}\n'):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(garbage)
            assert b'"ok":false' in s.makefile("rb").readline()
    # A caller who is neither root nor SlurmUser nor listed cannot even
    # connect: the socket is 0600 (no LedgerGroup).  (The test's tmp dirs
    # are root-only: let others traverse them meanwhile, so that the
    # socket's own mode is what stops it.)
    opened = []
    d = os.path.dirname(path)
    while d != "/":
        mode = os.stat(d).st_mode & 0o7777
        if not mode & 0o001:
            opened.append((d, mode))
            os.chmod(d, mode | 0o001)
        d = os.path.dirname(d)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(b'{"op":"reserve","node":"n1","key":"x","cpu_m":1,"mem_bytes":1}\n')
                os.write(w, s.makefile("rb").readline())
        except OSError as exc:
            os.write(w, type(exc).__name__.encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    for d, mode in opened:
        os.chmod(d, mode)
    os.close(w)
    reply = os.read(r, 4096)
    assert reply == b"PermissionError", reply
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    assert ledger(c).show("n1")["ok"]
    sh(c, "scontrol", "ping")


def test_node_features_stay_as_configured(c):
    # The marker feature slurmd reports is removed again.
    for name in ("n1", "n2", "n3"):
        n = node(c, name)
        assert "k8s_resources_managed" not in n.get("AvailableFeatures", ""), n
        assert "k8s_resources_managed" not in n.get("ActiveFeatures", ""), n




def test_job_larger_than_what_pods_leave_everywhere_pends_not_refused(c):
    for name in ("n1", "n2"):
        hold(c, name, 3, 1000)
    out = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-x", "n3", "-o", "/dev/null",
                          "--gres=k8scpu:2,k8smemory:100", "-c", "2", "--mem=100",
                          "--wrap", "sleep 600"], capture_output=True, text=True, env=c.env)
    assert out.returncode == 0, out.stderr       # before the ledger: refused at submit
    job = out.stdout.strip()
    wait_for(lambda: job_state(c, job) == ("PENDING", "Resources"), "pending on Resources")
    hold(c, "n2", 0, 0)
    wait_for(lambda: job_state(c, job)[0] == "RUNNING", "starts where the pods left")
    sh(c, "scancel", job)
    hold(c, "n1", 0, 0)


def _cpus_on(c, job: str) -> dict:
    """Ground truth: CPUs Slurm allocated the job per node (scontrol -d show job)."""
    out = sh(c, "scontrol", "-d", "show", "job", job)
    per_node = {}
    for nodes, ids in re.findall(r"Nodes=(\S+) CPU_IDs=(\S+)", out):
        count = sum(int(b) - int(a) + 1 if "-" in part else 1
                    for part in ids.split(",") for a, _, b in [part.partition("-")])
        per_node[nodes] = count
    return per_node


def test_reserve_raced_against_job_starts_never_overlaps(c):
    """A job needing 3 of n1's 4 CPUs and a pod needing 2 arrive together,
    120 times: exactly one of them gets the node, checked from what
    Slurm allocated (scontrol -d show job) and what the ledger holds."""
    rnd = random.Random(5)
    l = ledger(c)
    outcomes = {"job": 0, "pod": 0}

    def race(i, delay, replies):
        time.sleep(delay)       # sbatch takes ~100-300 ms to reach slurmctld
        replies["r"] = ledger(c).reserve("n1", f"race-{i}", 2000, 100 << 20)
    for i in range(120):
        replies = {}
        reserve = threading.Thread(target=race, args=(i, rnd.uniform(0, 0.6), replies))
        reserve.start()
        job = submit(c, "n1", 3, 100)
        reserve.join()
        wait_for(lambda: job_state(c, job)[0] in ("RUNNING", "PENDING"), "job settled")
        time.sleep(0.05)
        running = job_state(c, job)[0] == "RUNNING"
        job_cpus = _cpus_on(c, job).get("n1", 0) if running else 0
        share = l.show("n1")["nodes"]["n1"]["share"]["cpu"]
        assert job_cpus + share <= CPUS, (i, job_cpus, share, replies)
        assert running != replies["r"]["ok"], (i, running, replies)
        outcomes["job" if running else "pod"] += 1
        sh(c, "scancel", job)
        l.release("n1", f"race-{i}")
        wait_for(lambda: job_state(c, job)[0] in ("GONE", "CANCELLED", "COMPLETED"), "job gone")
        wait_for(lambda: used(node(c, "n1"))["k8scpu"] == 0, "n1 free again")
    print(f"race outcomes over 120 rounds: {outcomes}")
    assert min(outcomes.values()) >= 5, outcomes   # both sides really won races


def test_what_a_job_frees_on_an_oversubscribed_node_goes_to_the_pods(c):
    """Pods bound without admission hold more than jobs leave: the share is
    clamped.  When the job ends, what it frees is the pods' first -- never
    the next job's (seen before the fix: the next job started into it)."""
    job_a = submit(c, "n1", 3, 1000)
    wait_for(lambda: job_state(c, job_a)[0] == "RUNNING", "job A running")
    hold(c, "n1", 3, 1000)                             # 3 + 3 > 4: clamped to 1
    expect(c, "n1", CPUS, MEMORY, 4, 2000)
    job_b = submit(c, "n1", 2, 100)
    wait_for(lambda: job_state(c, job_b) == ("PENDING", "Resources"), "job B pends")
    sh(c, "scancel", job_a)
    wait_for(lambda: job_state(c, job_a)[0] in ("GONE", "CANCELLED", "COMPLETED"), "A gone")
    time.sleep(3)                                      # several scheduling passes
    assert job_state(c, job_b)[0] == "PENDING"         # 3 of 4 CPUs are the pods'
    expect(c, "n1", CPUS, MEMORY, 3, 1000)
    hold(c, "n1", 0, 0)
    wait_for(lambda: job_state(c, job_b)[0] == "RUNNING", "job B starts once the pods go")
    sh(c, "scancel", job_b)
