"""job_submit/k8s_resource_completion for jobs submitted over slurmrestd (root only).

A local 2-node cluster with `AuthAltTypes=auth/jwt` and a real slurmrestd
(rest_auth/jwt, running as `nobody`) is started exactly as `pyk8sres cluster
up --rest` does (pyk8sres.testbed.rest), serving the newest API the release
under test has: openapi/v0.0.38 on 22.05, openapi/slurmctld with
data_parser v0.0.42 on 24.11, v0.0.44 on 25.11 and v0.0.45 on 26.05. Jobs are POSTed to /slurm/<version>/job/submit
over HTTP with a token from `scontrol token`, and `scontrol show job` must
show the same TresPerNode/TresPerTask as the sbatch tests in
test_job_submit.py expect for the equivalent options (DefMemPerCPU=100).

Needs the Debian packages `slurmrestd slurm-wlm-jwt-plugin` besides the
cluster's (`.ci/run` must install them, otherwise these tests are skipped).
Ports: 29100 (+ PYK8SRES_TEST_PORT_OFFSET) .. +2 for the cluster, +5 for
slurmrestd (cluster.service_ports).
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from pyk8sres.testbed import cluster, rest as testbed_rest
from local_slurm import RELEASE, SLURM, port, tres

BASE_PORT = port(29100)
CPUS, MEMORY = 8, 16000


def _api_version():
    try:
        return testbed_rest.api_version(RELEASE.plugin_dir)[1]
    except Exception:
        return None


VERSION = _api_version()
API = f"/slurm/{VERSION}"
# v0.0.38 (22.05) takes the script beside the job, an environment dict,
# plain numbers and "gres"; v0.0.40 on (23.11+) the script inside the job, a
# list of NAME=VALUE, {"set", "number"} for numbers that may be unset, and
# "tres_per_node".
LEGACY = VERSION == "v0.0.38"


def _slurmrestd():
    return shutil.which("slurmrestd") or next(
        (p for p in ("/usr/sbin/slurmrestd", "/usr/bin/slurmrestd") if os.path.exists(p)), None)


def _have_plugin(name):
    """In the PluginDir of the Slurm under test (PYK8SRES_TEST_SLURM)."""
    if RELEASE is not None and RELEASE.bin_dirs:
        return os.path.exists(os.path.join(RELEASE.plugin_dir, name))
    return any(glob.glob(os.path.join(d, name)) for d in cluster.SLURM_PLUGIN_DIRS)


# NOTE: `.ci/run` must `apt-get install slurmrestd slurm-wlm-jwt-plugin` for
# these tests to run rather than skip.
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster runs daemons as root"),
    pytest.mark.skipif(not shutil.which("slurmctld") and not os.path.exists("/usr/sbin/slurmctld"),
                       reason="slurmctld not installed (apt-get install slurmctld slurmd)"),
    pytest.mark.skipif(not _slurmrestd(),
                       reason="slurmrestd not installed (apt-get install slurmrestd)"),
    pytest.mark.skipif(not (_have_plugin("auth_jwt.so") and _have_plugin("rest_auth_jwt.so")
                            and VERSION),
                       reason="JWT or REST API plugins not there "
                              "(apt-get install slurmrestd slurm-wlm-jwt-plugin)"),
]


class Rest:
    """The cluster's slurmrestd (pyk8sres.testbed.rest, as `cluster up --rest`)."""

    def __init__(self, handle):
        self.handle = handle
        self.url = handle.rest_url
        self.log = os.path.join(handle.work, "log", "slurmrestd.out")

    @property
    def env(self):
        return self.handle.env

    @property
    def running(self) -> bool:
        return self.handle._running("slurmrestd")

    def token(self):
        return testbed_rest.token(self.handle, "root", lifespan=600)

    def request(self, method, path, body=None, token=None):
        """(HTTP status, decoded JSON) of one real HTTP request."""
        return testbed_rest.request(self.url, method, path, body, user="root",
                                    token=token or self.token())

    def submit(self, hold=True, script="sleep 300", token=None, **job):
        return self.request("POST", f"{API}/job/submit", job_body(script, hold, **job),
                            token=token)

    def log_tail(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return "(no log)"


def job_body(script: str, hold: bool, **job) -> dict:
    """A job/submit body in the API version's own shape (see LEGACY)."""
    job = dict(job, current_working_directory="/tmp", standard_output="/dev/null",
               standard_error="/dev/null")
    if hold:
        job["hold"] = True
    if LEGACY:
        job["environment"] = {"PATH": "/usr/bin:/bin"}
        return {"script": f"#!/bin/sh\n{script}\n", "job": job}
    for key in ("memory_per_node", "memory_per_cpu"):
        if key in job:
            job[key] = {"set": True, "number": job[key]}
    if "gres" in job:
        job["tres_per_node"] = tres("gres:" + job.pop("gres"))
    job["environment"] = ["PATH=/usr/bin:/bin"]
    job["script"] = f"#!/bin/sh\n{script}\n"
    return {"job": job}


def error_codes(body) -> list:
    return [e.get("error_code", e.get("error_number")) for e in body.get("errors", [])]


def ours(tres_text):
    """Our GRES entries of a TRES string (24.11 also puts cpu=N there)."""
    entries = [e for e in (tres_text or "").split(",") if e.startswith(("gres:", "gres/"))]
    return ",".join(entries) or None


@pytest.fixture(scope="module")
def rest():
    # slurmrestd reads slurm.conf as `nobody`: pytest's tmp dirs are 0700,
    # so the cluster lives in a directory others can traverse.
    work = tempfile.mkdtemp(prefix="pyk8sres-rest-")
    os.chmod(work, 0o755)
    try:
        handle = cluster.up(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=BASE_PORT,
                            node_features=False, def_mem_per_cpu=100, slurm=SLURM, rest=True)
        r = Rest(handle)
        key = os.path.join(work, "etc", "jwt_hs256.key")
        st = os.stat(key)
        assert (st.st_mode & 0o777, st.st_uid) == (0o600, 0), oct(st.st_mode)
        yield r
    finally:
        try:
            cluster.Cluster(work).cancel_all_jobs()
        finally:
            cluster.down(work)
            shutil.rmtree(work, ignore_errors=True)


def run(env, *args, check=True, timeout=60):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/tmp",
                          env=env)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(args)} failed: {proc.stderr}")
    return proc


def job(env, job_id) -> dict:
    out = run(env, "scontrol", "-d", "show", "job", "-o", str(job_id)).stdout
    return dict(re.findall(r"(?:^|\s)(TresPerNode|TresPerTask|NumCPUs|NumTasks|JobState|Reason|"
                           r"NodeList|MinMemoryNode|MinMemoryCPU)=(\S*)", out.splitlines()[0]))


def job_ids(env) -> set:
    return set(run(env, "squeue", "-h", "-o", "%i").stdout.split())


def submitted(rest, **job_fields) -> str:
    status, body = rest.submit(**job_fields)
    codes = error_codes(body)
    # A held job comes back with ESLURM_JOB_HELD (2042) as an "error".
    assert body.get("job_id") and set(codes) <= {2042}, (status, body, rest.log_tail())
    assert status == 200, (status, body)
    return str(body["job_id"])


@pytest.fixture(autouse=True)
def clean_queue(rest):
    yield
    run(rest.env, "scancel", "--user=root", check=False)
    deadline = time.monotonic() + 20
    while run(rest.env, "squeue", "-h", "-t", "R,PD,CG").stdout.strip() \
            and time.monotonic() < deadline:
        time.sleep(0.3)


def up(ping: dict) -> bool:
    """One controller's ping answer says it is up: "ping": "UP" (v0.0.38),
    "pinged": "UP" (to v0.0.44), "responding": true (v0.0.44 on; v0.0.45
    has only that)."""
    if "responding" in ping:
        return ping["responding"] is True
    return ping.get("ping", ping.get("pinged")) == "UP"


def test_ping_with_token(rest):
    status, body = rest.request("GET", f"{API}/ping")
    assert status == 200, body
    assert up(body["pings"][0]), body


def test_bad_token_is_refused(rest):
    # rest_auth/jwt only passes the token through: slurmctld refuses it, and
    # slurmrestd 22.05 answers 500 ("slurmctld config is unable to load").
    # 24.11 answers the ping itself with 200 and reports slurmctld DOWN.
    before = job_ids(rest.env)
    status, body = rest.request("GET", f"{API}/ping", token="not-a-token")
    pings = body.get("pings") or [{}]
    assert (status >= 400 and body.get("errors")) or not up(pings[0]), (status, body)
    status, body = rest.submit(token="not-a-token", script="true")
    assert status >= 400 and not body.get("job_id"), (status, body)
    assert job_ids(rest.env) == before


# REST job fields -> TresPerNode / TresPerTask, as the equivalent sbatch
# options in test_job_submit.SUBMISSIONS (DefMemPerCPU=100).
SUBMISSIONS = [
    ("plain", {}, "gres:k8scpu:1,gres:k8smemory:100", None),
    ("-c 3 --mem=4000", {"cpus_per_task": 3, "memory_per_node": 4000},
     "gres:k8scpu:3,gres:k8smemory:4000", None),
    ("-c 2 --mem-per-cpu=500", {"cpus_per_task": 2, "memory_per_cpu": 500},
     "gres:k8scpu:2,gres:k8smemory:1000", None),
    ("-N 2 --ntasks-per-node=2 -c 2", {"nodes": "2", "tasks_per_node": 2, "cpus_per_task": 2},
     "gres:k8scpu:4,gres:k8smemory:400", None),
    ("-n 5 -N 2", {"tasks": 5, "nodes": "2"}, None, "gres:k8scpu:1,gres:k8smemory:100"),
    ("-n 4", {"tasks": 4}, None, "gres:k8scpu:1,gres:k8smemory:100"),
    ("--mincpus=6", {"minimum_cpus_per_node": 6}, "gres:k8scpu:6,gres:k8smemory:600", None),
    ("-c 2 --gres=k8scpu:5", {"cpus_per_task": 2, "gres": "k8scpu:5"},
     "gres:k8scpu:5,gres:k8smemory:200", None),
]


@pytest.mark.parametrize("fields,per_node,per_task", [s[1:] for s in SUBMISSIONS],
                         ids=[s[0] for s in SUBMISSIONS])
def test_rest_completion(rest, fields, per_node, per_task):
    info = job(rest.env, submitted(rest, **fields))
    assert info["JobState"] == "PENDING" and info["Reason"] == "JobHeldUser", info
    assert info.get("TresPerNode") == (per_node and tres(per_node))
    assert ours(info.get("TresPerTask")) == (per_task and tres(per_task))


def test_rest_job_runs_holding_gres(rest):
    job_id = submitted(rest, hold=False, cpus_per_task=3, memory_per_node=700)
    deadline = time.monotonic() + 30
    while (info := job(rest.env, job_id)).get("JobState") != "RUNNING":
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
    assert info["TresPerNode"] == tres("gres:k8scpu:3,gres:k8smemory:700")
    out = run(rest.env, "scontrol", "-d", "show", "node", info["NodeList"]).stdout
    used = re.search(r"GresUsed=(\S+)", out).group(1)
    assert dict(re.findall(r"(k8s\w+):(\d+)", used)) == {"k8scpu": "3", "k8smemory": "700"}


@pytest.mark.parametrize("gres,message", [
    ("k8scpu:abc", "k8scpu takes a plain count"),
    ("k8smemory:99999999999999999999", "count too large"),
])
def test_bad_gres_is_rejected(rest, gres, message):
    log = os.path.join(rest.handle.work, "log", "slurmctld.log")
    before_ids = job_ids(rest.env)
    offset = os.path.getsize(log)
    # The plugin logs its reason at debug level; over REST only the code comes back.
    run(rest.env, "scontrol", "setdebug", "debug")
    try:
        status, body = rest.submit(gres=gres)
    finally:
        run(rest.env, "scontrol", "setdebug", "verbose")
    codes = error_codes(body)
    assert status >= 400, (status, body)
    assert 2072 in codes, body  # ESLURM_INVALID_GRES: "Invalid generic resource (gres) specification"
    assert not body.get("job_id"), body
    assert job_ids(rest.env) == before_ids
    assert run(rest.env, "scontrol", "ping").stdout.count("UP") == 1  # slurmctld still up
    with open(log, errors="replace") as f:
        f.seek(offset)
        tail = f.read()
    assert f"rejected job from uid 0: invalid GRES '{gres}': {message}" in tail
    assert rest.running  # slurmrestd still serving
    assert rest.request("GET", f"{API}/ping")[0] == 200
