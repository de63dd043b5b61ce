"""`tools/demo.sh --containerized`, run as a reader runs it: the reference
walkthrough with Slurm inside Kubernetes (ACK's layout).  Its output must
read as the reference's: the GenericNode NAME is the Kubernetes node and
ALIAS the worker pod slurm-test-worker-cpu-0, the second srun pends behind
the Deployment's pods, and runs once they are scaled down.

Ports: port(29650) the cluster's base, then its SlurmdPort and the worker's;
the control plane pick_ports(29700, 29790)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from conftest_kube import pick_ports
from local_slurm import REPO, SLURM, port, requires_slurm
from pyk8sres.testbed import hybrid, releases

pytestmark = requires_slurm
TIMEOUT = 420


def test_demo_containerized_reads_as_the_reference(kube_binaries):
    if SLURM != releases.INSTALLED:
        import pytest
        pytest.skip("demo.sh runs the installed Slurm")
    work = tempfile.mkdtemp(prefix="pyk8sres-demo-")
    os.chmod(work, 0o755)
    env = dict(os.environ, BASE_PORT=str(port(29650)), KUBE_PORT=str(pick_ports(29700, 29790)),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = subprocess.Popen([str(REPO / "tools" / "demo.sh"), "--containerized", work],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        hybrid.down(work)
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # the demo's two sruns, left running
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(out)              # the walkthrough, for the log (pytest -s)
    assert proc.returncode == 0, out[-3000:]
    node = re.search(r"^\$ kubectl get genericnode (cn-hongkong\.10\.1\.0\.\d+)$", out, re.M)
    assert node, out[-3000:]
    rows = [line.split() for line in out.splitlines()
            if line.startswith(node.group(1) + " ")]
    assert any(r[-3:] == ["slurm-test-worker-cpu-0", "Slurm",
                          '[{"allocated":{"cpu":"0","memory":"0"},"type":"Slurm"},'
                          '{"allocated":{"cpu":"1735m","memory":"2393Mi"},"type":"Kubernetes"}]']
               for r in rows), out
    squeues = re.findall(r"^\$ squeue\n(.*?)(?=^\$ |^\x1b|\Z)", out, re.M | re.S)
    assert len(squeues) == 2, out[-3000:]
    pending, ran = squeues
    assert re.search(r"PD\s+0:00\s+1 \(Resources\)", pending), pending
    assert re.search(r" R .* slurm-test-worker-cpu-0$", pending, re.M), pending
    assert "PD" not in ran and len(re.findall(r" R .* slurm-test-worker-cpu-0$", ran, re.M)) == 2, \
        ran
