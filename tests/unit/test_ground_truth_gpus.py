"""The GPU half of the integration tests' ground truth, on captured text:
which GPU index each Slurm job holds per node (`scontrol -d -o show job`),
which index each running pod's ResourceClaim holds (its allocation mapped
through the ResourceSlice's `index` attribute), and the GPUs both hold."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import ground_truth as G  # noqa: E402
from pyk8sres.testbed import gpus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURED = os.path.join(HERE, "scontrol_show_job_gpus.txt")


def captured() -> dict[str, str]:
    """job id -> its captured line."""
    with open(CAPTURED) as f:
        lines = [x for x in f.read().splitlines() if x.startswith("JobId=")]
    return {x.split()[0].split("=")[1]: x for x in lines}


@pytest.mark.parametrize("job,want", [
    ("2", {}),                                  # cancelled: GRES= empty
    ("3", {"n1": {1}, "n2": {0}}),              # one GPU on each of two nodes
    ("4", {"n2": {1}}),                         # --gpus=1
    ("5", {"n2": {0}}),
    ("6", {"n1": {0, 1}}),                      # IDX:0-1
    ("1", {"n1": {0, 1}, "n2": {0, 1}}),        # 26.05: Nodes=n[1-2]
])
def test_job_gpus_of_captured_lines(job, want):
    assert G.job_gpus(captured()[job]) == want


@pytest.mark.parametrize("what,detail,want", [
    ("typed GPUs, a list", " Nodes=n1 CPU_IDs=0 Mem=1 GRES=gpu:a100:3(IDX:0-1,3),k8scpu(CNT:1)",
     {"n1": {0, 1, 3}}),
    ("a host range", " Nodes=n[1-2] CPU_IDs=0 Mem=1 GRES=gpu:1(IDX:1)", {"n1": {1}, "n2": {1}}),
    ("no index known", " Nodes=n1 CPU_IDs=0 Mem=1 GRES=gpu:1(IDX:N/A)", {}),
    ("other GRES only", " Nodes=n1 CPU_IDs=0 Mem=1 GRES=k8scpu(CNT:1),k8smemory(CNT:100)", {}),
    ("not a GPU whose name ends in gpu",
     " Nodes=n1 CPU_IDs=0 Mem=1 GRES=fpgpu:1(IDX:0),gpu:1(IDX:1)", {"n1": {1}}),
])
def test_job_gpus_of_other_forms(what, detail, want):
    # hand-written in the captured lines' form
    assert G.job_gpus("JobId=1 JobState=RUNNING" + detail + " MinCPUsNode=1") == want, what


@pytest.mark.parametrize("text,want", [
    ("0", {0}), ("0-1", {0, 1}), ("0-1,3", {0, 1, 3}), ("N/A", set()), ("", set()),
])
def test_index_set(text, want):
    assert G.index_set(text) == want


def test_slurm_gpus_reads_running_jobs_only(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\nexec grep ^JobId= {CAPTURED}\n")
    fake.chmod(0o755)
    assert G.slurm_gpus({"PATH": f"{tmp_path}:/usr/bin:/bin"}) == {
        "n1": {0: {"1", "6"}, 1: {"1", "3", "6"}}, "n2": {0: {"1", "3", "5"}, 1: {"1", "4"}}}


# A claim as the API server had it (captured: kube-scheduler allocated it for
# pod gpu-pod on n1); its slice as the test cluster publishes it.
CLAIM = {"metadata": {"name": "gpu-pod-gpu-5gqqx", "namespace": "default"},
         "status": {"allocation": {"devices": {"results": [
             {"device": "gpu-0", "driver": "gpu.nvidia.com", "pool": "n1", "request": "gpu"}]},
             "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                 {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}},
             "reservedFor": [{"name": "gpu-pod", "resource": "pods",
                              "uid": "1e04a630-43e0-4c35-bfee-2d183d867370"}]}}
POD = "1e04a630-43e0-4c35-bfee-2d183d867370"
SLICES = [gpus.resource_slice("n1", 2), gpus.resource_slice("n2", 2)]


def claim(name, pod, *devices, driver=gpus.DRIVER):
    return {"metadata": {"name": name, "namespace": "ns"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": driver, "pool": pool, "device": d}
                for pool, d in devices]}},
                "reservedFor": [{"resource": "pods", "name": pod, "uid": pod}]}}


@pytest.mark.parametrize("what,claims,running,want", [
    ("the captured claim", [CLAIM], {POD}, {"n1": {0: {"default/gpu-pod-gpu-5gqqx"}}}),
    ("its pod no longer runs", [CLAIM], set(), {}),
    ("two devices, two nodes", [claim("a", "p", ("n1", "gpu-1")), claim("b", "q", ("n2", "gpu-0"),
                                                                         ("n2", "gpu-1"))],
     {"p", "q"}, {"n1": {1: {"ns/a"}}, "n2": {0: {"ns/b"}, 1: {"ns/b"}}}),
    ("not allocated yet", [{"metadata": {"name": "c", "namespace": "ns"}, "status": {}}],
     {"p"}, {}),
    ("another driver's device", [claim("a", "p", ("n1", "gpu-0"), driver="x.example.com")],
     {"p"}, {}),
])
def test_claim_gpus(what, claims, running, want):
    assert G.claim_gpus(claims, SLICES, running) == want, what


def test_a_device_no_slice_maps_is_an_unreadable_sample():
    with pytest.raises(G.Unreadable, match="gpu-7 of pool n1"):
        G.claim_gpus([claim("a", "p", ("n1", "gpu-7"))], SLICES, {"p"})


@pytest.mark.parametrize("jobs,pods,want", [
    ({"n1": {0: {"6"}, 1: {"6"}}}, {"n1": {0: {"default/c"}}},
     ["n1 gpu 0: jobs 6 and claims default/c"]),
    ({"n1": {0: {"6"}}}, {"n1": {1: {"default/c"}}}, []),          # disjoint
    ({"n1": {0: {"6"}}}, {"n2": {0: {"default/c"}}}, []),          # same index, other node
    ({"n2": {1: {"4", "5"}}}, {"n2": {1: {"a/x", "b/y"}}},
     ["n2 gpu 1: jobs 4,5 and claims a/x,b/y"]),
])
def test_gpu_overlaps(jobs, pods, want):
    assert G.gpu_overlaps(jobs, pods) == want


def _proc(root, pid: int, env: dict[str, str] | None) -> None:
    d = root / str(pid)
    d.mkdir()
    if env is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                             for k, v in env.items()))


def test_process_gpus_counts_the_jobs_running_on_this_cluster_only(tmp_path):
    """A job slurmctld forgot (killed -9) still runs: its processes'
    environment says which GPUs it has.  Other clusters' jobs, processes
    without a job or without GPUs, unreadable entries are left out."""
    conf = "/tmp/w/etc/slurm.conf"
    job = {"SLURM_CONF": conf, "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_GPUS": "2,3"}
    _proc(tmp_path, 10, job)
    _proc(tmp_path, 11, dict(job, SLURM_JOB_GPUS="0"))           # a step of it, another GPU
    _proc(tmp_path, 12, dict(job, SLURM_CONF=conf + ".other"))   # another cluster's job 7
    _proc(tmp_path, 13, dict(job, SLURM_JOB_ID="8", SLURMD_NODENAME="n2", SLURM_JOB_GPUS="1"))
    _proc(tmp_path, 14, {"SLURM_CONF": conf})                   # sbatch itself, no job
    _proc(tmp_path, 15, dict(job, SLURM_JOB_GPUS=""))            # a job without GPUs
    _proc(tmp_path, 16, None)                                    # gone, or unreadable
    (tmp_path / "self").mkdir()
    assert G.process_gpus(conf, str(tmp_path)) == {
        "n1": {0: {"7(processes)"}, 2: {"7(processes)"}, 3: {"7(processes)"}},
        "n2": {1: {"8(processes)"}}}


def test_a_forgotten_job_overlapping_a_claim_is_an_overlap(tmp_path):
    """merge_gpus: slurmctld shows job 7 (its ID given again) on GPU 1
    while the forgotten job 7's processes still use GPU 0, which a claim
    holds: the overlap is reported."""
    shown = {"n1": {1: {"7"}}}
    running = {"n1": {0: {"7(processes)"}}}
    jobs = G.merge_gpus(shown, running)
    assert jobs == {"n1": {0: {"7(processes)"}, 1: {"7"}}}
    assert G.gpu_overlaps(jobs, {"n1": {0: {"default/c"}}}) == [
        "n1 gpu 0: jobs 7(processes) and claims default/c"]


def test_a_completing_job_counts_through_its_processes_not_its_id(tmp_path, monkeypatch):
    """Job 9 was allocated GPUs 2-3 again after a kill -9 of slurmctld while
    the slurmstepd of its first run (on GPU 0) still lived: slurmd refused
    the launch (Duplicate jobid) and it is COMPLETING.  Its IDX 2-3 never
    ran anything; the first run's processes, still on GPU 0, are what count."""
    line = ("JobId=9 JobName=wrap JobState=COMPLETING Reason=None StartTime=2026-12-07T19:39:19 "
            "NodeList=n1 Nodes=n1 CPU_IDs=0 Mem=100 GRES=gpu:2(IDX:2-3),k8scpu(CNT:1)")
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho '{line}'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(G, "stepd_jobs", lambda env: {"9"})
    assert G.slurm_gpus({"PATH": f"{tmp_path}:/usr/bin:/bin"}) == {}
    procs = tmp_path / "proc"
    procs.mkdir()
    _proc(procs, 20, {"SLURM_CONF": "/c", "SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1",
                      "SLURM_JOB_GPUS": "0"})
    assert G.process_gpus("/c", str(procs)) == {"n1": {0: {"9(processes)"}}}


def test_a_job_recovered_from_before_a_restart_counts_only_while_it_runs(tmp_path, monkeypatch):
    """Job 1 ended while slurmctld was down (killed -9 before it saved the
    end): recovered RUNNING on GPUs 0-1, its slurmstepd lingering to report
    the end, nothing of it running.  It holds them only while its
    processes run; a job started after the restart counts as Slurm says."""
    lines = ["JobId=1 JobName=wrap JobState=RUNNING Reason=None StartTime=2026-12-07T21:10:11 "
             "NodeList=n2 Nodes=n2 CPU_IDs=0 Mem=100 GRES=gpu:2(IDX:0-1),k8scpu(CNT:1)",
             "JobId=2 JobName=wrap JobState=RUNNING Reason=None StartTime=2026-12-07T21:10:30 "
             "NodeList=n2 Nodes=n2 CPU_IDs=1 Mem=100 GRES=gpu:1(IDX:2),k8scpu(CNT:1)"]
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{x}'\n" for x in lines))
    fake.chmod(0o755)
    monkeypatch.setattr(G, "stepd_jobs", lambda env: {"1", "2"})
    restarted = time.mktime(time.strptime("2026-12-07T21:10:17", "%Y-%m-%dT%H:%M:%S"))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    assert G.slurm_gpus(env, restarted, running=set()) == {"n2": {2: {"2"}}}
    assert G.slurm_gpus(env, restarted, running={"1"}) == {"n2": {0: {"1"}, 1: {"1"}, 2: {"2"}}}
    assert G.slurm_gpus(env) == {"n2": {0: {"1"}, 1: {"1"}, 2: {"2"}}}
