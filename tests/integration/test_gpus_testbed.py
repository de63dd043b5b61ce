"""The test cluster's fake GPUs (`cluster up --kubernetes --gpus 2`) on both
sides, and the GPU ground truth (ground_truth.gpu_sample) on them.

Slurm: each GPU is a character device under WORK/dev, so slurmd keeps every
one in the node's devices (a plain file is left out with "is not a valid
character or block device"); jobs get GPU indices (`scontrol -d show job`:
GRES=gpu:1(IDX:0)).  Kubernetes: the DeviceClass gpu.nvidia.com and n1's
ResourceSlice as NVIDIA's DRA driver would publish them; the real
kube-scheduler allocates a pod's claim a device there and binds the pod to
the kwok node, which runs it.

The product keeps GPUs apart (docs/gpus.md; tests/integration/
test_gpus_shared.py): to show that the checker sees an overlap, the test
makes one behind the product's back, as an admin could: a claim in the
coordinator's own namespace (the webhook never sees it) whose allocation the
admin writes naming the job's GPU, and a pod there using it; and a disjoint
pair to show it reports none then.
"""
import json
import os
import stat
import subprocess

import pytest

from conftest_kube import hybrid_world, pick_ports, wait
from ground_truth import gpu_sample
from local_slurm import SLURM, port, requires_slurm
from pyk8sres.testbed import gpus

pytestmark = requires_slurm
GPUS = 2


@pytest.fixture(scope="module")
def world():
    yield from hybrid_world("pyk8sres-gpus-", nodes=1, cpus=4, memory=8000,
                            base_port=port(29300), kube_port=pick_ports(29400, 29490),
                            slurm=SLURM, gpus=GPUS)


def test_slurm_gpus_are_character_devices_every_slurmd_keeps(world):
    c, _, _ = world
    paths = [os.path.join(c.work, "dev", f"gpu{i}") for i in range(GPUS)]
    assert all(stat.S_ISCHR(os.stat(p).st_mode) for p in paths), paths
    node = subprocess.run(["scontrol", "show", "node", "n1"], env=c.env, capture_output=True,
                          text=True, check=True).stdout
    assert f"gpu:{GPUS}" in node.split("Gres=")[1].split()[0], node
    with open(os.path.join(c.work, "log", "slurmd-n1.log"), errors="replace") as f:
        log = f.read()
    assert "not a valid character or block device" not in log
    assert "AutoDetect requires NodeName" not in log


def sbatch_gpu(c) -> tuple[str, int]:
    """A running `sbatch --gres=gpu:1` job on n1 and its GPU index."""
    job = subprocess.run(["sbatch", "--parsable", "-w", "n1", "--gres=gpu:1", "-o", "/dev/null",
                          "--wrap", "sleep 300"], env=c.env, capture_output=True, text=True,
                         check=True, cwd="/tmp").stdout.strip().split(";")[0]

    def running():
        out = subprocess.run(["scontrol", "-d", "show", "job", job], env=c.env,
                             capture_output=True, text=True).stdout
        if "JobState=RUNNING" in out and "(IDX:" in out:
            return out
    out = wait(running, f"job {job} running with a GPU")
    return job, int(out.split("GRES=gpu:1(IDX:")[1].split(")")[0])


def gpu_pod(cp, name: str, index: int) -> str:
    """Pod `name` on n1 with a claim (from a ResourceClaimTemplate, as the
    developer writes it) for the GPU of that `index` attribute; returns the
    claim's name once kube-scheduler has allocated it and kwok runs the pod."""
    template = gpus.claim_template(name)
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{gpus.DRIVER}"].index == {index}'}}]
    pod = gpus.gpu_pod(name, name, "n1")
    cp.kubectl("create", "-f", "-", identity="developer",
               input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [template, pod]}))

    def started():
        p = json.loads(cp.kubectl("get", "pod", name, "-o", "json").stdout)
        if p["status"].get("phase") == "Running":
            return p
    try:
        p = wait(started, f"pod {name} running")
    except AssertionError:
        why = cp.kubectl("describe", "pod", name).stdout
        raise AssertionError(f"pod {name} did not run:\n{why[-1500:]}") from None
    assert p["spec"]["nodeName"] == "n1"
    claim = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    got = json.loads(cp.kubectl("get", "resourceclaim", claim, "-o", "json").stdout)
    assert got["status"]["allocation"]["devices"]["results"] == [
        {"request": "gpu", "driver": gpus.DRIVER, "pool": "n1", "device": f"gpu-{index}"}]
    return claim


FORCED_NS = "pyk8sres-system"   # the release namespace: the webhook never sees it


def forced_gpu_pod(cp, name: str, node: str, index: int) -> str:
    """Pod `name` in FORCED_NS on `node` with a claim the admin allocated
    the GPU `index` by hand (kube-scheduler only reserves an allocated
    claim); returns the claim's name once the pod runs."""
    template = gpus.claim_template(name, namespace=FORCED_NS)
    claim = {"apiVersion": gpus.API_VERSION, "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": FORCED_NS},
             "spec": template["spec"]["spec"]}
    made = json.loads(cp.kubectl("create", "-f", "-", "-o", "json",
                                 input=json.dumps(claim)).stdout)
    made["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": gpus.DRIVER, "pool": node,
                                 "device": gpus.device_name(index)}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    cp.kubectl("replace", "--subresource=status", "-f", "-", input=json.dumps(made))
    resources = {"requests": {"cpu": "100m", "memory": "64Mi"}, "claims": [{"name": "gpu"}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": FORCED_NS},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [{"name": "c", "image": "busybox", "resources": resources}]}}
    cp.kubectl("create", "-f", "-", input=json.dumps(pod))
    wait(lambda: json.loads(cp.kubectl("get", "pod", "-n", FORCED_NS, name, "-o", "json").stdout)
         ["status"].get("phase") == "Running", f"pod {name} running")
    return name


def test_checker_reports_disjoint_gpus_then_an_overlap(world):
    c, cp, kube = world
    job, idx = sbatch_gpu(c)
    other = 1 - idx
    apart = gpu_pod(cp, "gpu-apart", other)
    # The job is seen twice: as slurmctld shows it and through its processes.
    seen = {job, f"{job}(processes)"}
    jobs, pods, overlaps = gpu_sample(c.env, kube)
    assert jobs == {"n1": {idx: seen}}
    assert pods == {"n1": {other: {f"default/{apart}"}}}
    assert overlaps == []

    # An overlap made behind the product's back is seen.
    same = forced_gpu_pod(cp, "gpu-same", "n1", idx)
    jobs, pods, overlaps = gpu_sample(c.env, kube)
    assert pods == {"n1": {other: {f"default/{apart}"}, idx: {f"{FORCED_NS}/{same}"}}}
    assert overlaps == [f"n1 gpu {idx}: jobs {','.join(sorted(seen))} and claims "
                        f"{FORCED_NS}/{same}"]

    # Once that pod is gone its claim no longer counts.
    cp.kubectl("delete", "pod", "-n", FORCED_NS, "gpu-same", "--grace-period=1", "--wait=true")
    assert gpu_sample(c.env, kube)[2] == []
    subprocess.run(["scancel", job], env=c.env, check=True)
    wait(lambda: gpu_sample(c.env, kube)[0] == {}, f"job {job} to free its GPU")
