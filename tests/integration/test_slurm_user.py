"""slurmctld as SlurmUser=slurm, as real sites run it (not root): both
plugins load from a pyk8sres build that user can read, the ledger's journal
and socket belong to it, and nobody else can write them or use the ledger."""
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from local_slurm import SLURM, port, readable_build, requires_slurm
from pyk8sres.testbed import cluster

pytestmark = requires_slurm
BASE_PORT = port(17300)


@pytest.fixture(scope="module")
def c():
    lib = readable_build()
    work = tempfile.mkdtemp(prefix="pyk8sres-su-")
    os.chmod(work, 0o755)
    handle = cluster.up(work, nodes=1, cpus=4, memory=4000, base_port=BASE_PORT,
                        slurm_user="slurm", plugin_lib=lib, slurm=SLURM)
    try:
        yield handle
    finally:
        cluster.down(work)
        shutil.rmtree(work, ignore_errors=True)


def _as(uid: int, gid: int, fn) -> bytes:
    """Run fn() in a child process with that uid/gid; its bytes come back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(w, fn())
        except BaseException as exc:
            os.write(w, f"raised {type(exc).__name__}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    return out


def _ask(path: str, line: bytes):
    def fn():
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(line)
            return s.makefile("rb").readline()
    return fn


def _sh(c, *argv):
    return subprocess.run(argv, capture_output=True, text=True, env=c.env, check=True,
                          timeout=60).stdout


def test_slurmctld_runs_as_slurm_and_the_ledger_is_its_own(c):
    slurm = pwd.getpwnam("slurm")
    pid = int(open(os.path.join(c.work, "run", "proc-slurmctld.pid")).read())
    assert os.stat(f"/proc/{pid}").st_uid == slurm.pw_uid      # really not root
    log = open(os.path.join(c.work, "log", "slurmctld.log")).read()
    assert "node_features/k8s_resources: init: loaded" in log, log[-2000:]
    assert "job_submit/k8s_resource_completion" in log

    state = os.path.join(c.work, "state")
    journal = os.path.join(state, "k8s_resources.ledger")
    sock = os.path.join(state, "k8s_resources.socket")
    st = os.stat(journal)
    assert (st.st_uid, st.st_mode & 0o777) == (slurm.pw_uid, 0o600)
    assert os.stat(state).st_mode & 0o022 == 0

    # SlurmUser may use the ledger, root may, anybody else is refused.
    show = b'{"op":"show"}\n'
    assert b'"ok":true' in _as(slurm.pw_uid, slurm.pw_gid, _ask(sock, show))
    reserve = b'{"op":"reserve","node":"n1","key":"pod-a","cpu_m":3000,"mem_bytes":1048576000}\n'
    assert b'"ok":true' in _as(0, 0, _ask(sock, reserve))
    # Nobody else can even connect: the socket is SlurmUser's, 0600.
    st = os.stat(sock)
    assert (st.st_uid, st.st_mode & 0o777) == (slurm.pw_uid, 0o600)
    assert _as(65534, 65534, _ask(sock, show)) == b"raised PermissionError"
    # ... and cannot touch the journal.
    assert _as(65534, 65534, lambda: open(journal, "ab") and b"opened") == \
        b"raised PermissionError"

    # The share works as for a root slurmctld: a job that does not fit pends ...
    job = _sh(c, "sbatch", "--parsable", "-o", "/dev/null", "-c", "2", "--wrap",
              "sleep 300").strip()
    deadline = time.monotonic() + 20
    while _sh(c, "squeue", "-h", "-j", job, "-o", "%r").strip() != "Resources":
        assert time.monotonic() < deadline, "job did not pend on Resources"
        time.sleep(0.3)
    # ... and a restart as slurm reads its own journal back.
    c.restart_slurmctld()
    deadline = time.monotonic() + 15
    while "k8scpu:3" not in _sh(c, "scontrol", "-d", "show", "node", "n1"):
        assert time.monotonic() < deadline, "share not back after restart"
        time.sleep(0.3)
    assert _sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() == "PENDING"
    assert b'"ok":true' in _as(0, 0, _ask(sock, b'{"op":"release","node":"n1","key":"pod-a"}\n'))
    deadline = time.monotonic() + 30
    while _sh(c, "squeue", "-h", "-j", job, "-o", "%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "job did not start after release"
        time.sleep(0.3)
