"""`tools/demo.sh --containerized` and `--gpus`, run as a reader runs them.

--containerized: the reference walkthrough with Slurm inside Kubernetes
(ACK's layout).  Its output must read as the reference's: the GenericNode
NAME is the Kubernetes node and ALIAS the worker pod
slurm-test-worker-cpu-0, the second srun pends behind the Deployment's
pods, and runs once they are scaled down.

--gpus: a job holds IDX 0-1, a pod's claim gets gpu-2 and gpu-3, a pod
asking for one more pends; scontrol, the claims, the GenericNode's GPU
column and the ledger print the same devices; the job ends and the
waiting pod gets one of its GPUs.

Ports: port(29650) the cluster's base, then its SlurmdPort and the worker's;
the control plane pick_ports(29700, 29790)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest_kube import pick_ports
from local_slurm import REPO, SLURM, port, requires_slurm
from pyk8sres.testbed import hybrid, releases

pytestmark = requires_slurm
TIMEOUT = 420


def run_demo(option: str, timeout: float = TIMEOUT) -> str:
    """tools/demo.sh `option` in a fresh directory, torn down after: its
    output (it exited 0)."""
    if SLURM != releases.INSTALLED:
        pytest.skip("demo.sh runs the installed Slurm")
    work = tempfile.mkdtemp(prefix="pyk8sres-demo-")
    os.chmod(work, 0o755)
    env = dict(os.environ, BASE_PORT=str(port(29650)), KUBE_PORT=str(pick_ports(29700, 29790)),
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = subprocess.Popen([str(REPO / "tools" / "demo.sh"), option, work],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        hybrid.down(work)
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # what the demo left running (sruns)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(out)              # the walkthrough, for the log (pytest -s)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_demo_containerized_reads_as_the_reference(kube_binaries):
    out = run_demo("--containerized")
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


def printed(out: str, command: str) -> str:
    """What `$ command` printed (up to the next command or step); the last
    time it ran."""
    found = re.findall(r"^(?:developer)?\$ " + re.escape(command) + r"\n(.*?)(?=^\$ |^developer\$ |^\x1b|\Z)",
                       out, re.M | re.S)
    assert found, f"no `{command}` in:\n{out[-3000:]}"
    return found[-1]


def test_demo_gpus_all_views_agree(kube_binaries):
    out = run_demo("--gpus", timeout=240)
    assert "GRES=gpu:2(IDX:0-1)" in out, out[-3000:]
    pending = out[out.index("none is free"):out.index("agree, device by device")]
    assert re.search(r"^notebook\s+0/1\s+Pending", pending, re.M), pending
    # The four views of the same devices (Slurm's job and the pods' claims
    # both allocated in the gpu GRES; IDX printed by newer releases).
    agree = out[out.index("agree, device by device"):out.index("The job ends")]
    assert re.search(r"GresUsed=gpu:(\S*:)?4(\(IDX:0-3\))?,", agree), agree
    claims = printed(agree, "kubectl get resourceclaims -A -o custom-columns="
                     "'NAMESPACE:.metadata.namespace,NAME:.metadata.name,"
                     "DEVICES:.status.allocation.devices.results[*].device'".replace("'", ""))
    assert re.search(r"^default\s+training-\S+\s+gpu-2,gpu-3$", claims, re.M), claims
    assert re.search(r"^pyk8sres-placeholders\s+slurm-gpu-n1-gpu-0\S*\s+gpu-0$", claims, re.M)
    gn = printed(agree, "kubectl get genericnode")
    assert gn.split("\n")[0].split()[-1] == "GPU", gn
    assert re.search(r"^n1 .* slurm:0-1 k8s:2-3 free:-$", gn, re.M), gn
    ledger = printed(agree, "pyk8sres ledger show")
    assert re.search(r"^n1 .* 0,1 +2,3\b", ledger, re.M), ledger
    # The job gone, the waiting pod runs on one of its GPUs.
    after = out[out.index("The job ends"):]
    assert re.search(r"^notebook\s+1/1\s+Running", after, re.M), after
    gn = printed(after, "kubectl get genericnode")
    assert re.search(r"^n1 .* slurm:- k8s:(0,2-3|1-3) free:[01]$", gn, re.M), gn
