"""The Slinky layout of the containerized test cluster (pure parts): the
worker pods as slurm-operator's NodeSet controller labels them, and each
one's slurmd --conf as its entrypoint writes it."""
import pytest

from pyk8sres.policy import workers
from pyk8sres.testbed import containerized as ct
from pyk8sres.testbed import slinky


def node(cpu="4", memory="8000Mi"):
    return {"metadata": {"name": "cn-hongkong.10.1.0.19"},
            "status": {"capacity": {"cpu": cpu, "memory": memory, "pods": "110"}}}


def test_worker_pod_labelled_as_the_operator_labels_it():
    p = slinky.pod(1, cpus=4, memory=8000)
    assert p["metadata"]["name"] == "slurm-worker-slinky-1"
    assert p["metadata"]["namespace"] == "slurm"
    labels = p["metadata"]["labels"]
    assert {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/component",
                                   "app.kubernetes.io/instance", "slinky.slurm.net/cluster",
                                   "nodeset.slinky.slurm.net/pod-hostname")} == {
        "app.kubernetes.io/name": "slurmd", "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/instance": "slurm-worker-slinky", "slinky.slurm.net/cluster": "slurm",
        "nodeset.slinky.slurm.net/pod-hostname": "slinky-1"}
    assert p["spec"]["hostname"] == "slinky-1"
    (term,) = p["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    (c,) = p["spec"]["containers"]
    assert c["resources"]["limits"] == {"cpu": "3", "memory": "7488Mi"}


def test_the_coordinators_slinky_preset_takes_it_as_the_slurm_node_it_names():
    p = dict(slinky.pod(0, 4, 8000))
    p["spec"] = dict(p["spec"], nodeName="cn-hongkong.10.1.0.19")
    sel = workers.selector("slinky", "slurm")
    assert workers.worker_pod(p, sel) == workers.WorkerPod(
        "slurm/slurm-worker-slinky-0", "cn-hongkong.10.1.0.19", "slinky-0")
    assert slinky.slurm_node(p) == "slinky-0"


@pytest.mark.parametrize("limits, host, conf", [
    ({"cpu": "3", "memory": "7488Mi"}, node(),
     "Features=slinky CPUs=4 RealMemory=8000 CoreSpecCount=1 MemSpecLimit=512"),
    # No limits: the whole host, nothing held back.
    ({}, node(), "Features=slinky CPUs=4 RealMemory=8000 CoreSpecCount=0 MemSpecLimit=0"),
    # A fractional CPU limit holds back whole cores only (rounded up for the pod).
    ({"cpu": "2500m", "memory": "4Gi"}, node("8", "16Gi"),
     "Features=slinky CPUs=8 RealMemory=16384 CoreSpecCount=5 MemSpecLimit=12288"),
    # Limits above the host: nothing held back.
    ({"cpu": "16", "memory": "64Gi"}, node(),
     "Features=slinky CPUs=4 RealMemory=8000 CoreSpecCount=0 MemSpecLimit=0"),
])
def test_dynamic_conf_is_the_host_less_what_lies_outside_the_limits(limits, host, conf):
    p = slinky.pod(0, 4, 8000)
    p["spec"]["containers"][0]["resources"]["limits"] = limits
    assert slinky.dynamic_conf(p, host) == conf


def test_dynamic_conf_needs_the_hosts_size():
    with pytest.raises(ValueError, match="capacity"):
        slinky.dynamic_conf(slinky.pod(0, 4, 8000), {"metadata": {"name": "n"}, "status": {}})


def test_wanted_by_slurm_node_name():
    p = slinky.pod(0, 4, 8000)
    p["metadata"]["uid"] = "u0"
    p["spec"]["nodeName"] = "cn-hongkong.10.1.0.19"
    unlabelled = slinky.pod(1, 4, 8000)
    unlabelled["metadata"]["uid"] = "u1"
    unlabelled["spec"]["nodeName"] = "cn-hongkong.10.1.0.20"
    del unlabelled["metadata"]["labels"][slinky.HOSTNAME_LABEL]
    assert ct.wanted([p, unlabelled], slinky.slurm_node) == {
        "slinky-0": ("u0", "cn-hongkong.10.1.0.19", "slurm-worker-slinky-0")}
    # the worker's address and port follow its Slurm node's index
    assert ct.worker_address("slinky-1") == "127.0.1.2"


def test_chart_values_and_settings_name_the_preset():
    assert ct.chart_values(True, "slinky") == ("--set", "sync.workerPods=slinky",
                                               "--set", "sync.workerNamespace=slurm")
    assert 'worker_pods = "slinky"' in ct.coordinator_settings("slinky")
    assert 'worker_pods = "ack"' in ct.coordinator_settings("ack")
