"""job_submit/k8s_resource_completion inside a real slurmctld (root only).

A local 3-node cluster (munged, slurmctld, 3 slurmd) is started from the
installed package, on the Slurm PYK8SRES_TEST_SLURM names (local_slurm.py): every submission below goes through sbatch/srun/salloc,
the real RPC, our plugin and the embedded Python, and is checked with
`scontrol show job` / `scontrol -d show node`.
Ports: PYK8SRES_TEST_JS_PORT (default 17100) .. +3.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from local_slurm import BUILD, SLURM, local_cluster, requires_slurm, port, tres
from test_job_submit_differential import allocations, held_short

import pyk8sres
from pyk8sres.testbed import cluster
from pyk8sres import install
from pyk8sres.slurmctld import _policy_build

BASE_PORT = port(17100)
CPUS, MEMORY = 8, 16000

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, "js", nodes=3, cpus=CPUS, memory=MEMORY,
                             base_port=BASE_PORT, node_features=False, def_mem_per_cpu=100)


def run(*args, check=True, timeout=60):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/tmp")
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(args)} failed: {proc.stderr}")
    return proc


def sbatch(*opts, hold=True, script="sleep 300"):
    args = ["sbatch", "--parsable", "--output=/dev/null"] + (["-H"] if hold else []) + list(opts)
    out = run(*args, "--wrap", script).stdout.strip()
    return out.split(";")[0]


def job(job_id) -> dict:
    out = run("scontrol", "-d", "show", "job", "-o", str(job_id)).stdout
    return dict(re.findall(r"(?:^|\s)(TresPerNode|TresPerTask|NumCPUs|NumTasks|JobState|Reason|"
                           r"NodeList|NumNodes|MinMemoryNode|MinMemoryCPU)=(\S*)", out.splitlines()[0]))


def ours(tres_text):
    """The GRES entries of a TRES string: from 23.02 on Slurm itself also puts
    cpu=N (from -c) into TresPerTask, which is not ours to check here."""
    entries = [e for e in (tres_text or "").split(",") if e.startswith(("gres:", "gres/"))]
    return ",".join(entries) or None


def gres_used(node) -> dict:
    out = run("scontrol", "-d", "show", "node", node).stdout
    used = re.search(r"GresUsed=(\S+)", out).group(1)
    return {k: int(v) for k, v in re.findall(r"(k8s\w+):(\d+)", used)}


def wait_state(job_id, state, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job(job_id)
        if info.get("JobState") == state:
            return info
        time.sleep(0.3)
    nodes = run("sinfo", "-N", "-h", "-o", "%N %T %E", check=False).stdout.strip()
    raise AssertionError(f"job {job_id} not {state}: {job(job_id)}; nodes: {nodes!r}")


@pytest.fixture(autouse=True)
def clean_queue(c):
    yield
    run("scancel", "--user=root", check=False)
    deadline = time.monotonic() + 20
    while run("squeue", "-h", "-t", "R,PD,CG").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.3)


# sbatch options -> TresPerNode / TresPerTask (DefMemPerCPU=100)
SUBMISSIONS = [
    ([], tres("gres:k8scpu:1,gres:k8smemory:100"), None),
    (["-c", "3"], tres("gres:k8scpu:3,gres:k8smemory:300"), None),
    (["--cpus-per-task=3", "--mem=4000"], tres("gres:k8scpu:3,gres:k8smemory:4000"), None),
    (["-c", "2", "--mem-per-cpu=500"], tres("gres:k8scpu:2,gres:k8smemory:1000"), None),
    (["-N", "2", "--ntasks-per-node=2", "-c", "2"], tres("gres:k8scpu:4,gres:k8smemory:400"), None),
    (["-n", "5", "-N", "2"], None, tres("gres:k8scpu:1,gres:k8smemory:100")),  # Slurm packs n1
    (["-n", "6"], None, tres("gres:k8scpu:1,gres:k8smemory:100")),
    (["-N", "3", "-c", "2"], tres("gres:k8scpu:2,gres:k8smemory:200"), None),
    (["--mincpus=6"], tres("gres:k8scpu:6,gres:k8smemory:600"), None),
    (["-c", "2", "--gres=k8scpu:5"], tres("gres:k8scpu:5,gres:k8smemory:200"), None),
    (["-c", "8", "--gres=k8scpu:0"], tres("gres:k8scpu:8,gres:k8smemory:800"), None),
    (["-c", "2", "--mem=0", "--exclusive"], tres("gres:k8scpu:2"), None),
    (["-c", "2", "--exclusive"], tres("gres:k8scpu:2,gres:k8smemory:200"), None),
]


@pytest.mark.parametrize("opts,per_node,per_task", SUBMISSIONS, ids=[" ".join(s[0]) or "plain"
                                                                       for s in SUBMISSIONS])
def test_sbatch_completion(c, opts, per_node, per_task):
    info = job(sbatch(*opts))
    assert info.get("TresPerNode") == per_node
    assert ours(info.get("TresPerTask")) == per_task


def test_job_array_every_task(c):
    job_id = sbatch("--array=1-3", "-c", "2")
    out = run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()
    assert out and all(tres("TresPerNode=gres:k8scpu:2,gres:k8smemory:200") in line for line in out)


def test_heterogeneous_job_every_component(c, tmp_path):
    script = tmp_path / "het.sh"
    script.write_text("#!/bin/sh\n#SBATCH -c 2\n#SBATCH hetjob\n#SBATCH -c 3 --mem=700\nsleep 300\n")
    out = run("sbatch", "--parsable", "-H", "--output=/dev/null", str(script)).stdout.strip()
    lead = out.split("+")[0].split(";")[0]
    lines = run("scontrol", "show", "job", "-o", lead).stdout.splitlines()
    per_node = sorted(re.search(r"TresPerNode=(\S+)", line).group(1) for line in lines)
    assert per_node == [tres("gres:k8scpu:2,gres:k8smemory:200"), tres("gres:k8scpu:3,gres:k8smemory:700")]


def test_srun_allocation_sees_completed_gres(c):
    out = run("srun", "-c", "3", "--mem=400", "sh", "-c",
              "scontrol show job -o $SLURM_JOB_ID").stdout
    assert tres("TresPerNode=gres:k8scpu:3,gres:k8smemory:400") in out


def test_salloc_allocation(c):
    proc = run("salloc", "--no-shell", "-c", "2", "--mem-per-cpu=300")
    job_id = re.search(r"Granted job allocation (\d+)", proc.stderr).group(1)
    assert job(job_id)["TresPerNode"] == tres("gres:k8scpu:2,gres:k8smemory:600")


def test_running_job_holds_gres_per_node(c):
    job_id = sbatch("-n", "10", hold=False)
    info = wait_state(job_id, "RUNNING")
    assert ours(info["TresPerTask"]) == tres("gres:k8scpu:1,gres:k8smemory:100")
    used = [gres_used(n) for n in ("n1", "n2", "n3")]
    assert sum(u["k8scpu"] for u in used) == 10
    assert sum(u["k8smemory"] for u in used) == 1000


def test_spread_job_runs_and_slurmctld_survives(c):
    """--spread-job with a per-task GRES segfaults slurmctld 24.11 (plain
    Slurm too, given --tres-per-task): there the plugin asks per node for it
    (SPREAD_PER_TASK_CRASHES, detected when building); the job runs, every
    node holds what it got, slurmctld lives on."""
    job_id = sbatch("-n", "9", "-N", "3", "--spread-job", hold=False)
    info = wait_state(job_id, "RUNNING")
    if BUILD.get("SPREAD_PER_TASK_CRASHES") == "1":
        assert ours(info.get("TresPerTask")) is None
        assert ours(info["TresPerNode"]) == tres("gres:k8scpu:7,gres:k8smemory:700")
    else:
        assert ours(info["TresPerTask"]) == tres("gres:k8scpu:1,gres:k8smemory:100")
    allocated = allocations(run("scontrol", "-d", "show", "job", job_id).stdout)
    assert len(allocated[0]["nodes"]) == 3 and not held_short(allocated)
    assert "UP" in run("scontrol", "ping").stdout


@pytest.mark.parametrize("gres,message", [
    ("k8scpu:abc", "k8scpu takes a plain count"),
    ("k8smemory:99999999999999999999", "count too large"),
])
def test_bad_gres_is_a_clear_error(c, gres, message):
    proc = run("sbatch", "--output=/dev/null", f"--gres={gres}", "--wrap", "true", check=False)
    assert proc.returncode != 0
    assert f"sbatch: error: invalid GRES '{gres}': {message}" in proc.stderr
    assert run("squeue", "-h").stdout.strip() == ""


def assert_holds_the_whole_node(job_id):
    """A -c 2 job Slurm gave all of a node's memory (Mem in `scontrol -d show
    job`) runs holding all of its k8smemory."""
    info = wait_state(job_id, "RUNNING")
    assert ours(info["TresPerNode"]) == tres(f"gres:k8scpu:2,gres:k8smemory:{MEMORY}")
    allocated = allocations(run("scontrol", "-d", "show", "job", job_id).stdout)
    assert [a["mem"] for a in allocated[0]["nodes"].values()] == [MEMORY]
    assert not held_short(allocated)


@pytest.mark.parametrize("opt", ["--mem=0", "--mem-per-cpu=0"])
def test_all_of_a_nodes_memory_holds_all_its_k8smemory(c, opt):
    """--mem=0, and --mem-per-cpu=0 which Slurm maps to it: Slurm allocates
    all of the node's memory, so the job holds all of its k8smemory."""
    job_id = sbatch("-c", "2", opt, hold=False)
    assert_holds_the_whole_node(job_id)


def test_no_memory_default_anywhere_holds_the_whole_node(c):
    """Slurm's own default (no DefMemPerCPU/DefMemPerNode: DefMemPerNode=UNLIMITED)
    gives a job without --mem all of the node's memory: it holds all of it."""
    with open(c.conf) as f:
        original = f.read()
    try:
        c.rewrite_conf("".join(line for line in original.splitlines(True)
                               if not line.startswith("DefMemPerCPU=")))
        run("scontrol", "reconfigure")
        assert "UNLIMITED" in run("scontrol", "show", "config").stdout.split("DefMemPerNode")[1][:30]
        job_id = sbatch("-c", "2", hold=False)
        assert_holds_the_whole_node(job_id)
    finally:
        run("scancel", "--user=root", check=False)
        c.rewrite_conf(original)
        run("scontrol", "reconfigure")


def test_exclusive_job_holds_everything_kubernetes_leaves(c):
    run("scontrol", "update", "NodeName=n2", f"Gres=k8scpu:{CPUS - 2},k8smemory:{MEMORY - 1000}")
    try:
        job_id = sbatch("--exclusive", "-w", "n2", "-c", "2", hold=False)
        wait_state(job_id, "RUNNING")
        assert gres_used("n2") == {"k8scpu": CPUS - 2, "k8smemory": MEMORY - 1000}
    finally:
        run("scancel", "--user=root", check=False)
        time.sleep(1)
        run("scontrol", "update", "NodeName=n2", f"Gres=k8scpu:{CPUS},k8smemory:{MEMORY}")


def test_huge_task_count_rejected_not_crashing(c):
    proc = run("sbatch", "--output=/dev/null", "-N", "1", "-n", "100000", "-c", "65000",
               "--wrap", "true", check=False)
    assert proc.returncode != 0
    assert run("scontrol", "ping").stdout.count("UP") == 1  # slurmctld is still there


def test_update_recomputes_without_duplicates(c):
    job_id = sbatch("-c", "2")
    run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    assert job(job_id)["TresPerNode"] == tres("gres:k8scpu:2,gres:k8smemory:200")
    run("scontrol", "update", f"JobId={job_id}", "MinMemoryCPU=300")
    assert job(job_id)["TresPerNode"] == tres("gres:k8scpu:2,gres:k8smemory:600")
    proc = run("scontrol", "update", f"JobId={job_id}", "NumTasks=3", check=False)
    if "cannot see a submitted job" in proc.stderr:
        pytest.fail("plugin built without -Dslurm_source: job_modify cannot recompute")
    assert proc.returncode == 0, proc.stderr
    info = job(job_id)  # 3 tasks, no -N: Slurm places them, so per task
    assert (info.get("TresPerNode") or "", ours(info["TresPerTask"])) == \
        ("", tres("gres:k8scpu:2,gres:k8smemory:600"))
    run("scontrol", "update", f"JobId={job_id}", "Gres=k8scpu:1")
    info = job(job_id)
    assert (info.get("TresPerNode") or "", ours(info["TresPerTask"])) == \
        ("", tres("gres:k8scpu:2,gres:k8smemory:600"))


def _tres(job_id) -> tuple:
    info = job(job_id)
    return info.get("TresPerNode") or "", info.get("TresPerTask") or ""


SHOWN_NODES = "<the job's NumNodes as shown after the update; no maximum = all 3 nodes>"


def shown_nodes(job_id) -> str:
    nodes = job(job_id)["NumNodes"]
    return nodes if "-" in nodes else f"{nodes}-3"


# (submitted with, update, the same shape submitted directly, or the expected
# (TresPerNode, TresPerTask) where no sbatch option gives that shape)
UPDATES = [
    (["-n", "4", "-N", "2"], ["NumTasks=6"], ["-n", "6", "-N", "2"]),
    (["-n", "4"], ["NumNodes=1-1"], ["-n", "4", "-N", "1"]),  # (NumNodes=1 keeps max open)
    # NumNodes=1 leaves the maximum open on 22.05 (shown NumNodes=1) and sets
    # it on 24.11 (shown 1-1): the same shape is what slurmctld shows.
    (["-n", "4"], ["NumNodes=1"], ["-n", "4", "-N", SHOWN_NODES]),
    (["-n", "4", "-N", "1"], ["NumNodes=1-3"], ["-n", "4", "-N", "1-3"]),
    # NumCPUs alone: the 6 CPUs may all land on one node
    (["-n", "2"], ["NumCPUs=6"], (tres("gres:k8scpu:6,gres:k8smemory:600"), "")),
    (["-c", "2"], ["MinMemoryNode=1500"], ["-c", "2", "--mem=1500"]),
    (["-n", "3", "--mem=900"], ["MinMemoryCPU=200"], ["-n", "3", "--mem-per-cpu=200"]),
    (["-c", "2"], ["Partition=rt"], ["-c", "2", "-p", "rt"]),
    (["-c", "2"], ["Gres="], ["-c", "2"]),
    (["-c", "4"], ["Gres=k8scpu:1"], ["-c", "4"]),  # a user cannot lower the count
    (["-c", "2", "--gres=k8scpu:5"], ["Gres=k8scpu:3"], ["-c", "2", "--gres=k8scpu:3"]),
]


@pytest.fixture
def rt_partition(c):
    """A partition with its own memory default, created at run time."""
    run("scontrol", "create", "PartitionName=rt", "Nodes=ALL", "DefMemPerCPU=300", "State=UP")
    yield "rt"
    run("scancel", "--user=root", check=False)
    run("scontrol", "delete", "PartitionName=rt", check=False)


@pytest.mark.parametrize("opts,update,same", UPDATES, ids=[" ".join(u[0] + u[1]) for u in UPDATES])
def test_update_is_exactly_as_at_submit(c, rt_partition, opts, update, same):
    job_id = sbatch(*opts)
    proc = run("scontrol", "update", f"JobId={job_id}", *update, check=False)
    assert proc.returncode == 0, proc.stderr
    tres = _tres(job_id)
    assert "gres:," not in ",".join(tres) and not any(t.endswith(",") for t in tres)
    if not isinstance(same, tuple):
        same = _tres(sbatch(*(shown_nodes(job_id) if o == SHOWN_NODES else o for o in same)))
    assert tres == same


def test_partition_updates_never_fail_spuriously(c, rt_partition):
    """24.11's _update_job returns errno when a partition change finds no
    association (no accounting): the plugin must leave errno as it found it,
    or a stale EAGAIN from the embedded Python fails one update in a few."""
    job_id = sbatch("-c", "2")
    for partition in ["rt", "debug"] * 10:
        proc = run("scontrol", "update", f"JobId={job_id}", f"Partition={partition}", check=False)
        assert proc.returncode == 0, proc.stderr
        assert job(job_id)["TresPerNode"] == tres(
            "gres:k8scpu:2,gres:k8smemory:" + ("600" if partition == "rt" else "200"))


def test_running_jobs_hold_what_an_update_asked(c):
    """NumTasks update of a per-task job, then started: held >= allocated per node."""
    job_id = sbatch("-n", "4", "-N", "2")
    run("scontrol", "update", f"JobId={job_id}", "NumTasks=6", "NumCPUs=6")
    run("scontrol", "release", job_id)
    wait_state(job_id, "RUNNING")
    out = run("scontrol", "-d", "show", "job", job_id).stdout
    lines = re.findall(r"Nodes=(\S+) CPU_IDs=(\S+) Mem=(\d+) GRES=k8scpu\(CNT:(\d+)\),"
                       r"k8smemory\(CNT:(\d+)\)", out)
    assert lines
    for _, ids, mem, k8scpu, k8smemory in lines:
        cpus = sum(int(b or a) - int(a) + 1 for a, _, b in
                   (item.partition("-") for item in ids.split(",")))
        assert int(k8scpu) >= cpus and int(k8smemory) >= int(mem), out


def test_partition_memory_changed_at_run_time(c, rt_partition):
    assert _tres(sbatch("-c", "2", "-p", "rt"))[0] == tres("gres:k8scpu:2,gres:k8smemory:600")
    run("scontrol", "update", "PartitionName=rt", "DefMemPerCPU=700")
    assert _tres(sbatch("-c", "2", "-p", "rt"))[0] == tres("gres:k8scpu:2,gres:k8smemory:1400")


def test_heterogeneous_job_starts(c, tmp_path):
    script = tmp_path / "het.sh"
    script.write_text("#!/bin/sh\n#SBATCH -n 3\n#SBATCH hetjob\n#SBATCH -n 2 -c 2 --mem=700\n"
                      "sleep 300\n")
    out = run("sbatch", "--parsable", "--output=/dev/null", str(script)).stdout.strip()
    lead = out.split("+")[0].split(";")[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = re.findall(r"JobState=(\S+)", run("scontrol", "show", "job", lead).stdout)
        if states and all(s == "RUNNING" for s in states):
            break
        time.sleep(0.3)
    assert states == ["RUNNING", "RUNNING"], run("scontrol", "show", "job", lead).stdout


def test_seed_scenario_kubernetes_usage_blocks_then_releases(c):
    """Kubernetes holds 3 of n1's 8 CPUs: one -c 3 job fits, the next pends."""
    run("scontrol", "update", "NodeName=n1", f"Gres=k8scpu:{CPUS - 3},k8smemory:{MEMORY}")
    try:
        first = sbatch("-w", "n1", "-c", "3", hold=False)
        wait_state(first, "RUNNING")
        second = sbatch("-w", "n1", "-c", "3", hold=False)
        time.sleep(3)  # a few scheduling passes
        info = job(second)
        assert (info["JobState"], info["Reason"]) == ("PENDING", "Resources")
        assert gres_used("n1")["k8scpu"] == 3
    finally:
        run("scontrol", "update", "NodeName=n1", f"Gres=k8scpu:{CPUS},k8smemory:{MEMORY}")
    wait_state(second, "RUNNING")
    assert gres_used("n1")["k8scpu"] == 6


def test_no_per_job_log_lines_at_default_level(c):
    for _ in range(5):
        sbatch("-c", "2")
    with open(os.path.join(c.work, "log", "slurmctld.log"), errors="replace") as f:
        ours = [line for line in f if "k8s_resource_completion" in line]
    assert any("init: loaded" in line for line in ours)  # the plugin is there
    assert not [line for line in ours if " uid " in line]  # per-job lines are debug only


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python >= 3.12 always uses cffi's entry")
def test_new_shapes_take_the_direct_call(c):
    """A shape the memo has not seen goes to Python through the direct call
    (pyk8sres_core.c _hot_args), not cffi's slower entry point: a failure
    there would only show as a slower slurmctld."""
    job_id = sbatch("-c", "3", "--mem=1234")
    assert "k8smemory:1234" in job(job_id)["TresPerNode"]
    with open(os.path.join(c.work, "log", "slurmctld.log"), errors="replace") as f:
        log = f.read()
    assert "new job shapes call Python directly, on one shared thread state" in log
    assert "cannot call Python directly" not in log


def test_plugin_refuses_to_load_without_its_python_core(tmp_path):
    """A broken core: slurmctld stops at startup with one clear line (no
    silent zero answers from a half-started Python)."""
    work = str(tmp_path / "broken")
    c2 = cluster.up(work, nodes=1, cpus=2, memory=2000, base_port=BASE_PORT + 20,
                    node_features=False, slurm=SLURM)
    try:
        core = os.path.join(c2.work, "plugins", install.CORE)
        os.unlink(core)
        os.symlink("/nonexistent/libpyk8sres_core.so", core)
        with pytest.raises(cluster.ClusterError, match="slurmctld exited"):
            c2.restart_slurmctld()
        with open(os.path.join(c2.work, "log", "slurmctld.log"), errors="replace") as f:
            log = f.read()
        assert "job_submit/k8s_resource_completion: cannot load the Python core" in log
        assert "run `pyk8sres install-plugins`" in log
    finally:
        cluster.down(work)


# A bug for the test below, in a copy of the package only its cluster loads:
# the policy raises for a job asking --mem=777.
INJECTED_BUG = """

_complete_for_real = complete


def complete(job, site):
    if job.mem_per_node == 777:
        raise RuntimeError("a bug injected by the test")
    return _complete_for_real(job, site)
"""


def _package_with_a_bug(root) -> str:
    """A copy of the installed package, its job_submit path interpreted
    (the compiled modules removed) with INJECTED_BUG; its _lib directory."""
    copy = os.path.join(root, "pyk8sres")
    shutil.copytree(os.path.dirname(pyk8sres.__file__), copy, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = os.path.join(copy, "slurmctld")
    for name in os.listdir(here):
        if name.endswith(".so") and name.split(".")[0] in _policy_build.MODULES:
            os.unlink(os.path.join(here, name))
    with open(os.path.join(here, "completion.py"), "a") as f:
        f.write(INJECTED_BUG)
    return os.path.join(copy, "_lib")


def test_on_internal_error_accept_is_never_silent(tmp_path):
    """OnInternalError=accept lets a job the plugin fails on run WITHOUT
    k8scpu/k8smemory (pods may then use its CPUs): slurmctld says so when
    the setting is on, and names every job it lets through (at most one
    line per 10 s, counting the jobs since the last), also for a job of
    the same shape as one before (the memo must not hide it)."""
    work = str(tmp_path / "accept")
    c2 = cluster.up(work, nodes=1, cpus=2, memory=2000, base_port=BASE_PORT + 30,
                    node_features=False, slurm=SLURM, k8s_conf="OnInternalError=accept\n",
                    plugin_lib=_package_with_a_bug(str(tmp_path / "site")))
    logfile = os.path.join(c2.work, "log", "slurmctld.log")

    def submit(*opts):
        return subprocess.run(["sbatch", "--parsable", "-H", "--output=/dev/null", *opts,
                               "--wrap", "sleep 60"], capture_output=True, text=True,
                              env=c2.env, timeout=60, cwd="/tmp")

    def uncounted_lines():
        with open(logfile, errors="replace") as f:
            return [line for line in f if "OnInternalError=accept: job from uid" in line]
    try:
        with open(logfile, errors="replace") as f:
            assert "OnInternalError=accept in k8s_resources.conf: a job this plugin fails " \
                "on (a bug) is accepted WITHOUT k8scpu/k8smemory" in f.read()
        ids = []
        for _ in range(3):
            proc = submit("--mem=777")
            assert proc.returncode == 0, proc.stderr
            ids.append(proc.stdout.strip().split(";")[0])
        for job_id in ids:       # ground truth: Slurm holds nothing for pods' sake
            out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                                 text=True, env=c2.env, timeout=30).stdout
            assert "JobId=" in out and "k8scpu" not in out and "k8smemory" not in out, out
        lines = uncounted_lines()
        assert len(lines) == 1 and "accepted UNCOUNTED" in lines[0], lines
        assert "RuntimeError" in lines[0] and "[1 such job(s) since the last such line, " \
            "1 since slurmctld started]" in lines[0], lines
        time.sleep(10.5)
        assert submit("--mem=777").returncode == 0
        lines = uncounted_lines()
        assert len(lines) == 2 and "[3 such job(s) since the last such line, 4 since " \
            "slurmctld started]" in lines[1], lines
        normal = submit("--mem=500")                  # the policy still runs for the rest
        assert normal.returncode == 0, normal.stderr
        out = subprocess.run(["scontrol", "show", "job", normal.stdout.strip()],
                             capture_output=True, text=True, env=c2.env, timeout=30).stdout
        assert "k8smemory:500" in out, out
        # The default (reject): the same job is refused, saying why.
        with open(os.path.join(c2.work, "etc", "k8s_resources.conf"), "w") as f:
            f.write("OnInternalError=reject\n")
        subprocess.run(["scontrol", "reconfigure"], env=c2.env, check=True, timeout=60)
        time.sleep(1)
        refused = submit("--mem=777")
        assert refused.returncode != 0 and "internal error (RuntimeError)" in refused.stderr
        assert len(uncounted_lines()) == 2
    finally:
        cluster.down(work)


@pytest.mark.parametrize("setting", ["ReserveCPUs=\u00b2", "ReserveMemory=\u0661\u0662"])
def test_a_setting_with_other_digits_is_refused_by_name(tmp_path, setting):
    """k8s_resources.conf numbers are 0-9: another script's digits (which
    Python's int() reads, or raises on) are refused as any bad value is at
    start: slurmctld stops with one line naming the file, key and value,
    not an internal error."""
    work = str(tmp_path / "digits")
    try:
        with pytest.raises(cluster.ClusterError, match="slurmctld exited"):
            cluster.up(work, nodes=1, cpus=2, memory=2000, base_port=BASE_PORT + 40,
                       slurm=SLURM, k8s_conf=setting + "\n")
        with open(os.path.join(work, "log", "slurmctld.log"), errors="replace") as f:
            log = f.read()
        key, _, value = setting.partition("=")
        assert f"k8s_resources.conf:2: {key} needs a non-negative integer (digits 0-9), " \
            f"not {value!r}" in log, log[-2000:]
        assert "invalid literal" not in log and "Traceback" not in log
    finally:
        cluster.down(work)


def test_ordinary_batch_script_with_steps_keeps_working(c, tmp_path):
    """#SBATCH lines and srun steps inside the job, unchanged by the completion."""
    out = tmp_path / "steps.out"
    script = tmp_path / "steps.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -N 2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=5
#SBATCH --output={out}
srun hostname | wc -l
srun -n 1 true && echo step-ok
srun --mem=50 -n 2 true && echo mem-step-ok
""")
    job_id = run("sbatch", "--parsable", str(script)).stdout.strip()
    wait_state(job_id, "COMPLETED", timeout=60)
    lines = [line for line in out.read_text().splitlines() if not line.startswith("srun: ")]
    assert lines == ["4", "step-ok", "mem-step-ok"]  # (srun's own warnings aside)


def test_embedded_python_ignores_the_daemons_environment(tmp_path, monkeypatch):
    """slurmctld started with PYTHONPATH (holding a sitecustomize.py), a
    bogus PYTHONHOME, PYTHONSTARTUP and a user site (~/.local, holding a
    usercustomize.py): the embedded interpreter uses none of them, and the
    plugin still completes jobs."""
    markers = tmp_path / "markers"
    markers.mkdir()
    hook = f"open({str(markers)!r} + '/%s', 'w').write('ran inside ' + __import__('sys').executable)\n"
    path_dir = tmp_path / "pythonpath"
    path_dir.mkdir()
    (path_dir / "sitecustomize.py").write_text(hook % "sitecustomize")
    home = tmp_path / "home"
    user_site = home / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" \
        / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "usercustomize.py").write_text(hook % "usercustomize")
    startup = tmp_path / "startup.py"
    startup.write_text(hook % "startup")
    env = {"PYTHONPATH": str(path_dir), "PYTHONHOME": "/nonexistent-python-home",
           "PYTHONSTARTUP": str(startup), "HOME": str(home), "PYTHONUSERBASE": str(home / ".local")}
    # The hooks are real: a plain interpreter with this environment runs them.
    check = subprocess.run([sys.executable, "-c", "pass"],
                           env={**os.environ, **env, "PYTHONHOME": sys.base_prefix},
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    assert sorted(p.name for p in markers.iterdir()) == ["sitecustomize", "usercustomize"]
    for marker in markers.iterdir():
        marker.unlink()

    work = str(tmp_path / "isolated")
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # inherited by the daemons cluster.up starts
    try:
        c2 = cluster.up(work, nodes=1, cpus=2, memory=2000, base_port=BASE_PORT + 30,
                        node_features=False, def_mem_per_cpu=100, slurm=SLURM)
    finally:
        monkeypatch.undo()
    try:
        with open(f"/proc/{open(os.path.join(c2.work, 'run', 'proc-slurmctld.pid')).read().strip()}"
                  "/environ", "rb") as f:
            assert f"PYTHONPATH={path_dir}".encode() in f.read().split(b"\0")
        out = subprocess.run(["sbatch", "--parsable", "-H", "--output=/dev/null", "-c", "2",
                              "--wrap", "true"], capture_output=True, text=True, timeout=30,
                             env=c2.env, cwd="/tmp")
        assert out.returncode == 0, out.stderr
        shown = subprocess.run(["scontrol", "show", "job", out.stdout.strip()], capture_output=True,
                               text=True, timeout=30, env=c2.env).stdout
        assert "TresPerNode=" + tres("gres:k8scpu:2,gres:k8smemory:200") in shown
        assert list(markers.iterdir()) == []
    finally:
        cluster.down(work)
