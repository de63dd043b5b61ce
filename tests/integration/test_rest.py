"""job_submit/k8s_resource_completion for jobs submitted over slurmrestd (root only).

A local 2-node cluster with `AuthAltTypes=auth/jwt` is started from the
installed package, plus a real slurmrestd (openapi/v0.0.38, rest_auth/jwt,
running as `nobody`). Jobs are POSTed to /slurm/v0.0.38/job/submit over
HTTP with a token from `scontrol token`, and `scontrol show job` must show the
same TresPerNode/TresPerTask as the sbatch tests in test_job_submit.py expect
for the equivalent options (DefMemPerCPU=100).

Needs the Debian packages `slurmrestd slurm-wlm-jwt-plugin` besides the
cluster's (`.ci/run` must install them, otherwise these tests are skipped).
Ports: PYK8SRES_TEST_REST_PORT (default 29100) .. +2 for the cluster, +10 for
slurmrestd.
"""
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from pyk8sres.testbed import cluster
from local_slurm import RELEASE, SLURM, port

BASE_PORT = port(29100)
REST_PORT = BASE_PORT + 10
CPUS, MEMORY = 8, 16000
API = "/slurm/v0.0.38"


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
                            and _have_plugin("openapi_v0_0_38.so")),
                       reason="JWT/openapi v0.0.38 plugins not there (22.05's REST API, which "
                              "this module speaks: apt-get install slurmrestd slurm-wlm-jwt-plugin)"),
]


class Rest:
    def __init__(self, handle, proc, log):
        self.handle, self.proc, self.log = handle, proc, log
        self.url = f"http://127.0.0.1:{REST_PORT}"

    @property
    def env(self):
        return self.handle.env

    def token(self):
        out = run(self.env, "scontrol", "token", "username=root", "lifespan=600").stdout
        return re.search(r"SLURM_JWT=(\S+)", out).group(1)

    def request(self, method, path, body=None, token=None):
        """(HTTP status, decoded JSON) of one real HTTP request."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json",
            "X-SLURM-USER-NAME": "root",
            "X-SLURM-USER-TOKEN": token or self.token(),
        })
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw or b"{}")
        except ValueError:
            return status, {"raw": raw.decode(errors="replace")}

    def submit(self, hold=True, script="sleep 300", **job):
        job = dict(job, current_working_directory="/tmp", standard_output="/dev/null",
                   standard_error="/dev/null", environment={"PATH": "/usr/bin:/bin"})
        if hold:
            job["hold"] = True
        return self.request("POST", f"{API}/job/submit",
                            {"script": f"#!/bin/sh\n{script}\n", "job": job})

    def log_tail(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return "(no log)"


def _stop(proc):
    """Stop slurmrestd by its PID (never by name)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _listening(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def rest(tmp_path_factory):
    if not cluster.port_free(REST_PORT):
        pytest.fail(f"port {REST_PORT} already in use: set PYK8SRES_TEST_REST_PORT")
    work = str(tmp_path_factory.mktemp("rest"))
    key = os.path.join(work, "jwt_hs256.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    os.chmod(key, 0o600)  # slurmctld (root) only: slurmrestd just passes tokens through
    handle = cluster.up(work, nodes=2, cpus=CPUS, memory=MEMORY, base_port=BASE_PORT,
                        node_features=False, def_mem_per_cpu=100, slurm=SLURM,
                        extra_conf=f"AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key={key}\n")
    proc = None
    # slurmrestd reads slurm.conf after dropping to `nobody`, and pytest's
    # tmp dirs (/tmp/pytest-of-root) are 0700: give it a world-readable copy
    # whose PluginDir is Slurm's own (it checks every entry is readable and
    # needs none of ours).
    conf_dir = tempfile.mkdtemp(prefix="pyk8sres-rest-")
    try:
        os.chmod(conf_dir, 0o755)
        rest_conf = os.path.join(conf_dir, "slurm.conf")
        with open(handle.conf) as f:
            text = re.sub(r"(?m)^PluginDir=.*$", f"PluginDir={cluster.slurm_plugin_dir()}", f.read())
        with open(rest_conf, "w") as f:
            f.write(text)
        os.chmod(rest_conf, 0o644)
        log = os.path.join(work, "log", "slurmrestd.out")
        # slurmrestd refuses to run as root (-u: setuid right after binding
        # the socket, before reading slurm.conf). SLURM_JWT=daemon makes it talk to
        # slurmctld with the caller's token (auth/jwt) instead of munge, which
        # `nobody` cannot reach anyway; without it every token is rejected
        # ("Rejecting thread config token for user root").
        env = dict(handle.env, SLURM_CONF=rest_conf, SLURM_JWT="daemon")
        argv = [_slurmrestd(), "-f", rest_conf, "-u", "nobody", "-s", "openapi/v0.0.38",
                "-a", "rest_auth/jwt", "-v", f"127.0.0.1:{REST_PORT}"]
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd="/tmp")
        with open(os.path.join(work, "run", "slurmrestd.pid"), "w") as f:
            f.write(str(proc.pid))
        r = Rest(handle, proc, log)
        deadline = time.monotonic() + 20
        while not _listening(REST_PORT):
            if proc.poll() is not None:
                pytest.fail(f"slurmrestd exited ({proc.returncode}): {r.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"slurmrestd not listening on {REST_PORT}: {r.log_tail()}")
            time.sleep(0.1)
        yield r
    finally:
        try:
            if proc is not None:
                run(handle.env, "scancel", "--user=root", check=False)
                _stop(proc)
        finally:
            cluster.down(work)
            shutil.rmtree(conf_dir, ignore_errors=True)


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
    codes = [e.get("error_code") for e in body.get("errors", [])]
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


def test_ping_with_token(rest):
    status, body = rest.request("GET", f"{API}/ping")
    assert status == 200, body
    assert body["pings"][0]["ping"] == "UP"


def test_bad_token_is_refused(rest):
    # rest_auth/jwt only passes the token through: slurmctld refuses it, and
    # slurmrestd 22.05 answers 500 ("slurmctld config is unable to load").
    before = job_ids(rest.env)
    status, body = rest.request("GET", f"{API}/ping", token="not-a-token")
    assert status >= 400 and body.get("errors"), (status, body)
    status, body = rest.request("POST", f"{API}/job/submit", token="not-a-token", body={
        "script": "#!/bin/sh\ntrue\n", "job": {"hold": True, "current_working_directory": "/tmp",
                                               "environment": {"PATH": "/usr/bin:/bin"}}})
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
    assert info.get("TresPerNode") == per_node
    assert info.get("TresPerTask") == per_task


def test_rest_job_runs_holding_gres(rest):
    job_id = submitted(rest, hold=False, cpus_per_task=3, memory_per_node=700)
    deadline = time.monotonic() + 30
    while (info := job(rest.env, job_id)).get("JobState") != "RUNNING":
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
    assert info["TresPerNode"] == "gres:k8scpu:3,gres:k8smemory:700"
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
    codes = [e.get("error_code") for e in body.get("errors", [])]
    assert status >= 400, (status, body)
    assert 2072 in codes, body  # ESLURM_INVALID_GRES: "Invalid generic resource (gres) specification"
    assert not body.get("job_id"), body
    assert job_ids(rest.env) == before_ids
    assert run(rest.env, "scontrol", "ping").stdout.count("UP") == 1  # slurmctld still up
    with open(log, errors="replace") as f:
        f.seek(offset)
        tail = f.read()
    assert f"rejected job from uid 0: invalid GRES '{gres}': {message}" in tail
    assert rest.proc.poll() is None  # slurmrestd still serving
    assert rest.request("GET", f"{API}/ping")[0] == 200
