"""`pyk8sres cluster up --accounting --rest` on the real daemons (root only).

The cluster is started through the command line, as an admin would: a
private MariaDB, slurmdbd as `slurm`, slurmctld with
AccountingStorageTRES=gres/k8scpu,gres/k8smemory, slurmrestd with JWT.
Jobs go through the job_submit plugin (sbatch, and docs/test-cluster.md's REST block
as it stands); sacct's AllocTRES must show, for every job, exactly the
k8scpu/k8smemory `scontrol -d show job` shows allocated on its nodes, and at
least the CPUs and memory Slurm gave it.  Secrets: slurmdbd.conf and the JWT
key are 0600, and the database password appears in no log, no output and no
other file.

Needs mariadb-server, slurmdbd, slurmrestd and slurm-wlm-jwt-plugin
(tools/install-deps.sh installs them).  Ports: 29200 (+ the offset) .. +5.
"""
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from local_slurm import RELEASE, SLURM, port, requires_slurm, tres
from pyk8sres.testbed import cluster, rest

REPO = Path(__file__).resolve().parents[2]
BASE_PORT = port(29200)
NODES, CPUS, MEMORY = 2, 4, 4000
PORTS = cluster.service_ports(BASE_PORT, NODES)

pytestmark = requires_slurm + [
    pytest.mark.skipif(not all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}")
                               for b in ("mariadbd", "slurmdbd", "slurmrestd")),
                       reason="apt-get install mariadb-server slurmdbd slurmrestd "
                              "slurm-wlm-jwt-plugin (tools/install-deps.sh)"),
]


def sh(env, *argv, check=True, timeout=60):
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd="/tmp")
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(argv)}: {proc.stderr}{proc.stdout}")
    return proc.stdout


class Up:
    def __init__(self, work, output):
        self.work, self.output = work, output
        self.handle = cluster.Cluster(work)
        self.env = dict(self.handle.env, USER="root")

    def pid(self, name):
        return int(open(os.path.join(self.work, "run", f"proc-{name}.pid")).read())

    def password(self):
        text = open(os.path.join(self.work, "etc", "slurmdbd.conf")).read()
        return re.search(r"(?m)^StoragePass=(\S+)$", text).group(1)


@pytest.fixture(scope="module")
def up():
    # slurmrestd reads slurm.conf as nobody: a directory others can traverse.
    work = tempfile.mkdtemp(prefix="pyk8sres-acct-")
    os.chmod(work, 0o755)
    cmd = [sys.executable, "-m", "pyk8sres", "cluster", "up", "--workdir", work,
           "--nodes", str(NODES), "--cpus", str(CPUS), "--memory", str(MEMORY),
           "--base-port", str(BASE_PORT), "--accounting", "--rest", "--slurm", SLURM]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/tmp")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield Up(work, proc.stdout + proc.stderr)
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)


def test_daemons_users_and_private_files(up):
    users = {name: pwd.getpwuid(os.stat(f"/proc/{up.pid(name)}").st_uid).pw_name
             for name in ("mariadb", "slurmdbd", "slurmrestd")}
    assert users == {"mariadb": "mysql", "slurmdbd": "slurm", "slurmrestd": "nobody"}
    # Our own MariaDB: no configuration file read, our datadir and socket.
    cmdline = open(f"/proc/{up.pid('mariadb')}/cmdline").read().split("\0")
    assert cmdline[1] == "--no-defaults"
    assert f"--datadir={up.work}/mysql/data" in cmdline
    assert f"--socket={up.work}/mysql/mysqld.sock" in cmdline
    assert "--bind-address=127.0.0.1" in cmdline and f"--port={PORTS['mariadb']}" in cmdline

    def mode(path):
        st = os.stat(os.path.join(up.work, path))
        return pwd.getpwuid(st.st_uid).pw_name, oct(st.st_mode & 0o777)
    assert mode("etc/slurmdbd.conf") == ("slurm", "0o600")
    # slurmctld runs as root here; slurmdbd (as slurm) validates tokens too.
    assert mode("etc/jwt_hs256.key") == ("slurm", "0o600")
    assert mode("mysql") == ("mysql", "0o700")
    assert mode("dbd") == ("slurm", "0o700")
    conf = open(os.path.join(up.work, "etc", "slurm.conf")).read()
    assert "AccountingStorageTRES=gres/k8scpu,gres/k8smemory\n" in conf
    assert f"AccountingStoragePort={PORTS['slurmdbd']}\n" in conf
    assert "AuthAltTypes=auth/jwt\n" in conf
    assert f"http://127.0.0.1:{PORTS['slurmrestd']}" in up.output


def _gres(text):
    """{'k8scpu': n, 'k8smemory': m} summed over `name(CNT:n)` / `name:n` entries."""
    total = {}
    for name, count in re.findall(r"\b(k8scpu|k8smemory)(?:\(CNT:|[:=])(\d+)", text):
        total[name] = total.get(name, 0) + int(count)
    return total


def _ground_truth(env, job):
    """While the job runs: the GRES, CPUs and memory allocated on each node."""
    out = sh(env, "scontrol", "-d", "show", "job", job)
    gres, mem = {}, 0
    # Nodes with the same allocation share a line: Nodes=n[1-2] ... Mem=200 GRES=...
    for hosts, node_mem, node_gres in re.findall(
            r"Nodes=(\S+) CPU_IDs=\S+ Mem=(\d+) GRES=(\S*)", out):
        count = len(sh(env, "scontrol", "show", "hostnames", hosts).split())
        mem += count * int(node_mem)
        for name, n in _gres(node_gres).items():
            gres[name] = gres.get(name, 0) + count * n
    cpus = int(re.search(r"NumCPUs=(\d+)", out).group(1))
    return {"gres": gres, "cpus": cpus, "mem": mem}


# Shapes of every kind the plugin completes (per node, per task, several
# nodes, exclusive); sbatch through job_submit/k8s_resource_completion.
SHAPES = [["-c", "3", "--mem=700"], ["-n", "3"], ["-N", "2", "--ntasks-per-node=2"],
          ["-n", "5", "-N", "2"], ["--exclusive"]]


def test_sacct_shows_k8s_tres_of_every_job(up):
    env = up.env
    jobs = [sh(env, "sbatch", "--parsable", "-o", "/dev/null", *shape, "--wrap",
               "sleep 3").strip() for shape in SHAPES]
    truth = {}
    deadline = time.monotonic() + 120
    while len(truth) < len(jobs):
        assert time.monotonic() < deadline, (truth, sh(env, "squeue"))
        states = dict(line.split() for line in sh(env, "squeue", "-h", "-o", "%i %T").splitlines())
        for job in jobs:
            if job not in truth and states.get(job) == "RUNNING":
                truth[job] = _ground_truth(env, job)
            assert job in truth or job in states, f"job {job} ended before we saw it run"
        time.sleep(0.2)
    # Accounting records the allocation at start; wait until every job ended
    # and slurmdbd has it (slurmctld sends asynchronously).
    deadline = time.monotonic() + 60
    while True:
        out = sh(env, "sacct", "-X", "-n", "-P", "-S", "now-1hour", "-j", ",".join(jobs),
                 "-o", "JobID,State,AllocTRES%60,ReqTRES%60")
        rows = {r.split("|")[0]: r.split("|") for r in out.splitlines() if r}
        if all(rows.get(j, [0, ""])[1] == "COMPLETED" for j in jobs):
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
    for job, shape in zip(jobs, SHAPES):
        alloc = rows[job][2]
        got = _gres(alloc)
        t = truth[job]
        assert got == t["gres"], (shape, alloc, t)
        assert set(got) == {"k8scpu", "k8smemory"}, (shape, alloc)
        # What Slurm allocated is covered (the project's invariant).
        assert got["k8scpu"] >= t["cpus"] and got["k8smemory"] >= t["mem"], (shape, alloc, t)
        assert f"cpu={t['cpus']}," in alloc, (shape, alloc, t)
    # slurmrestd's accounting API shows the same TRES (the JWT is checked by
    # slurmdbd this time).
    token = rest.token(up.handle)
    api = rest.api_version(RELEASE.plugin_dir)[1]
    for job in jobs:
        status, body = rest.request(f"http://127.0.0.1:{PORTS['slurmrestd']}", "GET",
                                    f"/slurmdb/{api}/job/{job}", user="root", token=token)
        assert status == 200 and not body.get("errors"), (status, body)
        (record,) = body["jobs"]
        over_rest = {t["name"]: t["count"] for t in record["tres"]["allocated"]
                     if t["type"] == "gres"}
        assert over_rest == truth[job]["gres"], (job, record["tres"])
    # The docs' form of the command (docs/test-cluster.md) shows the same.
    readme_form = sh(env, "sacct", "-o", "JobID,AllocTRES%60", "-P", "-j", jobs[0])
    assert f"gres/k8scpu={truth[jobs[0]]['gres']['k8scpu']}," in readme_form
    # jobcomp/filetxt: one line per finished job, with the TRES it
    # requested (22.05 writes tres_fmt_req_str there: sacct's ReqTRES).
    jobcomp = open(os.path.join(up.work, "log", "jobcomp.txt")).read()
    for job in jobs:
        line = re.search(rf"(?m)^JobId={job} .*$", jobcomp)
        requested = _gres(rows[job][3])
        assert set(requested) == {"k8scpu", "k8smemory"}, rows[job]
        assert line and _gres(re.search(r"Tres=(\S+)", line.group(0)).group(1)) == \
            requested, (job, line and line.group(0), rows[job])


def _readme_rest_block():
    text = (REPO / "docs" / "test-cluster.md").read_text()
    return re.search(r"<!-- rest-example -->\n```sh\n(.*?)```", text, re.S).group(1)


def test_readme_rest_submission(up):
    block = _readme_rest_block()
    # The one line that differs: this cluster's URL instead of the example's.
    url_line = re.search(r"(?m)^export SLURMRESTD_URL=\S+", block).group(0)
    script = block.replace(url_line,
                           f"export SLURMRESTD_URL=http://127.0.0.1:{PORTS['slurmrestd']}")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                          text=True, env=up.env, timeout=120, cwd="/tmp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (written as 22.05 prints it: gres/k8scpu:2 from 23.02 on)
    expected = tres(re.search(r"(?m)^# (TresPerNode=\S+)$", block).group(1))
    assert proc.stdout.strip() == expected, proc.stdout
    # Ground truth: the newest job is the docs' block's, and once it runs its
    # node holds that GRES.
    job = sh(up.env, "squeue", "-h", "-o", "%i", "--sort=-i").split()[0]
    deadline = time.monotonic() + 30
    while "RUNNING" not in sh(up.env, "squeue", "-h", "-j", job, "-o", "%T"):
        assert time.monotonic() < deadline, sh(up.env, "squeue")
        time.sleep(0.3)
    assert _ground_truth(up.env, job)["gres"] == _gres(expected)
    sh(up.env, "scancel", job)


def test_password_never_logged_or_printed(up):
    password = up.password()
    assert len(password) >= 24
    assert password not in up.output
    key_path = os.path.join(up.work, "etc", "jwt_hs256.key")
    key = open(key_path, "rb").read()
    assert len(key) == 32
    # Every file of the cluster but slurmdbd.conf and MariaDB's own data
    # files (which hold only the hash): neither the password nor the JWT key.
    leaks = []
    for root, _, files in os.walk(up.work):
        if root.startswith(os.path.join(up.work, "mysql", "data")):
            continue
        for name in files:
            path = os.path.join(root, name)
            if path == os.path.join(up.work, "etc", "slurmdbd.conf") or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                content = f.read()
            if password.encode() in content or (path != key_path and key in content):
                leaks.append(path)
    assert leaks == []
    assert os.path.getsize(os.path.join(up.work, "dbd", "slurmdbd.log")) > 0
    # Nor through Slurm's own configuration dumps.
    assert password not in sh(up.env, "scontrol", "show", "config")
    assert password not in sh(up.env, "sacctmgr", "show", "configuration")
    for pid in (up.pid("mariadb"), up.pid("slurmdbd")):
        assert password not in open(f"/proc/{pid}/cmdline").read()


def test_down_stops_every_daemon_by_pid(up):
    pids = {name: up.pid(name) for name in ("mariadb", "slurmdbd", "slurmrestd", "slurmctld")}
    stopped = cluster.down(up.work)
    assert {"mariadb", "slurmdbd", "slurmrestd", "slurmctld"} <= set(stopped)
    assert [n for n, pid in pids.items() if cluster.alive(pid)] == []
    assert not os.path.exists(os.path.join(up.work, "mysql", "mysqld.sock"))


def test_as_slurm_user():
    """SlurmUser=slurm, as sites run it: the JWT key is slurm's (0600) and
    slurmctld reads it, slurmdbd takes slurmctld's registration, a job's
    k8s GRES reach sacct.  (Our plugins stay out: this Python is not
    readable by slurm; test_slurm_user.py covers them as slurm.)"""
    work = tempfile.mkdtemp(prefix="pyk8sres-acct-su-")
    os.chmod(work, 0o755)
    base = BASE_PORT + 10
    try:
        c = cluster.up(work, nodes=1, cpus=CPUS, memory=MEMORY, base_port=base,
                       slurm_user="slurm", job_submit=False, node_features=False,
                       accounting=True, rest=True, slurm=SLURM)
        slurm = pwd.getpwnam("slurm").pw_uid
        st = os.stat(os.path.join(work, "etc", "jwt_hs256.key"))
        assert (st.st_uid, st.st_mode & 0o777) == (slurm, 0o600)
        assert os.stat(f"/proc/{Up(work, '').pid('slurmctld')}").st_uid == slurm
        token = rest.token(c)          # slurmctld (as slurm) signed it with the key
        api = rest.api_version(c.release.plugin_dir)[1]
        status, body = rest.request(c.rest_url, "GET", f"/slurm/{api}/ping", user="root",
                                    token=token)
        ping = body.get("pings", [{}])[0]
        # "ping": "UP" (v0.0.38), "pinged": "UP" (to v0.0.44), "responding": true (v0.0.44 on)
        assert status == 200 and (ping.get("responding") is True or
                                  ping.get("ping", ping.get("pinged")) == "UP"), body
        job = sh(c.env, "sbatch", "--parsable", "-o", "/dev/null", "--gres=k8scpu:2,k8smemory:300",
                 "-c", "2", "--wrap", "true").strip()
        deadline = time.monotonic() + 60
        while True:
            out = sh(c.env, "sacct", "-X", "-n", "-P", "-j", job, "-o", "State,AllocTRES%60")
            if out.startswith("COMPLETED"):
                break
            assert time.monotonic() < deadline, out
            time.sleep(0.5)
        assert _gres(out) == {"k8scpu": 2, "k8smemory": 300}, out
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)
