"""`pyk8sres cluster up/down` as a user runs them: modes under a careless
umask, and nothing of the cluster left alive after `down`."""
import os
import stat
import subprocess
import sys
import time

import pytest

from local_slurm import RELEASE, SLURM, port, requires_slurm
from pyk8sres.testbed import cluster

pytestmark = requires_slurm
BASE_PORT = port(17200)


def _cli(*args, umask=None):
    return subprocess.run([sys.executable, "-m", "pyk8sres", *args], capture_output=True,
                          text=True, timeout=180, preexec_fn=(lambda: os.umask(umask))
                          if umask is not None else None)


def _writable_by_others(root: str) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [""] + filenames:
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            if (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) and st.st_mode & 0o022:
                bad.append(f"{path} {oct(st.st_mode & 0o777)}")
    return bad


def test_up_under_umask_000_then_down_leaves_nothing(tmp_path):
    work = str(tmp_path / "c")
    up = _cli("cluster", "up", "--workdir", work, "--nodes", "1", "--cpus", "2",
              "--memory", "2000", "--base-port", str(BASE_PORT), "--slurm", SLURM, umask=0)
    assert up.returncode == 0, up.stdout + up.stderr
    env = cluster.Cluster(work).env
    try:
        assert _writable_by_others(work) == []
        assert stat.S_IMODE(os.stat(os.path.join(work, "munge")).st_mode) == 0o700
        job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
        deadline = time.monotonic() + 30
        while "RUNNING" not in subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"],
                                              capture_output=True, text=True, env=env).stdout:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.3)
        time.sleep(1)  # the step's processes exist
        before = cluster.cluster_processes(work)
        names = {open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0] for p in before
                 if os.path.exists(f"/proc/{p}")}
        assert any(b"slurmstepd" in n for n in names), names
        assert any(n.endswith(b"sleep") for n in names), names
    finally:
        down = _cli("cluster", "down", "--workdir", work)
    assert down.returncode == 0, down.stdout + down.stderr
    assert cluster.cluster_processes(work) == []
    assert [p for p in before if cluster.alive(p)] == []


@pytest.mark.skipif(RELEASE is None or not RELEASE.has_plugin("auth_slurm"),
                    reason="this Slurm has no auth/slurm (23.11+)")
def test_auth_slurm_runs_without_munged(tmp_path):
    """Where the release has auth/slurm, the cluster needs no munged: a shared
    key next to slurm.conf, and jobs still run."""
    work = str(tmp_path / "s")
    c = cluster.up(work, nodes=1, cpus=2, memory=2000, base_port=BASE_PORT + 10, slurm=SLURM,
                   auth="slurm")
    try:
        assert "munged" not in c.names()
        conf = open(c.conf).read()
        assert "AuthType=auth/slurm" in conf and "CredType=cred/slurm" in conf
        assert stat.S_IMODE(os.stat(os.path.join(work, "etc", "slurm.key")).st_mode) == 0o600
        out = subprocess.run(["srun", "-c", "1", "printenv", "SLURM_JOB_ID"], capture_output=True,
                             text=True, env=c.env, timeout=60)
        assert out.returncode == 0 and out.stdout.strip().isdigit(), out.stderr
    finally:
        cluster.down(work)
