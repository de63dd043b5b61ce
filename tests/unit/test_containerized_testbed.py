"""The containerized test cluster's pure parts: names, the worker
StatefulSet, each worker's slurmd --conf, address and slurm.conf copy, and
which pods get a slurmd."""
import pytest

from pyk8sres.testbed import containerized as ct
from pyk8sres.testbed.cluster import ClusterError


def test_kube_node_names_look_like_a_clouds():
    assert ct.kube_node_names(3) == ["cn-hongkong.10.1.0.19", "cn-hongkong.10.1.0.20",
                                     "cn-hongkong.10.1.0.21"]
    with pytest.raises(ClusterError):
        ct.kube_node_names(300)


def test_statefulset_one_pod_per_node_sized_below_the_node():
    sts = ct.statefulset(2, cpus=4, memory=8000)
    assert sts["metadata"] == {"name": "slurm-test-worker-cpu", "namespace": "slurm",
                               "labels": sts["spec"]["selector"]["matchLabels"]}
    assert sts["spec"]["replicas"] == 2
    pod = sts["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"] == {"cpu": "3", "memory": "7488Mi"}


@pytest.mark.parametrize("limits, conf", [
    ({"cpu": "3", "memory": "7488Mi"}, "CPUs=3 RealMemory=7488 Feature=cpu"),
    ({"cpu": "2500m", "memory": "2Gi"}, "CPUs=2 RealMemory=2048 Feature=cpu"),
    ({"cpu": "500m", "memory": "1G"}, "CPUs=1 RealMemory=953 Feature=cpu"),
])
def test_dynamic_conf_is_the_pods_limits(limits, conf):
    pod = {"metadata": {"name": "w-0"}, "spec": {"containers": [
        {"name": "slurmd", "resources": {"limits": limits}}]}}
    assert ct.dynamic_conf(pod) == conf


def test_dynamic_conf_without_limits_is_refused():
    pod = {"metadata": {"name": "w-0"}, "spec": {"containers": [{"name": "slurmd"}]}}
    with pytest.raises(ValueError, match="no cpu and memory limits"):
        ct.dynamic_conf(pod)


def test_worker_address_is_per_index():
    assert ct.worker_address("slurm-test-worker-cpu-0") == "127.0.1.1"
    assert ct.worker_address("slurm-test-worker-cpu-12") == "127.0.1.13"
    for bad in ("worker", "slurm-test-worker-cpu-254"):
        with pytest.raises(ValueError):
            ct.worker_address(bad)


def _pod(name, uid, node=None, deleting=False, phase="Running"):
    meta = {"name": name, "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase}}


def test_wanted_bound_live_pods_only():
    pods = [_pod("a-0", "u0", "k1"), _pod("a-1", "u1"), _pod("a-2", "u2", "k2", deleting=True),
            _pod("a-3", "u3", "k3", phase="Failed")]
    assert ct.wanted(pods) == {"a-0": ("u0", "k1", "a-0")}


def test_slurmd_conf_copy_listens_on_the_workers_address_only():
    text = "ClusterName=x\nSlurmctldHost=myhost(127.0.0.1)\n"
    out = ct.slurmd_conf_text(text)
    assert out.startswith(text) and out.endswith("\nCommunicationParameters=NoInAddrAny\n")
    with pytest.raises(ClusterError):
        ct.slurmd_conf_text(text + "CommunicationParameters=NoCtldInAddrAny\n")


def test_node_addr():
    assert ct.node_addr("NodeName=w-0 Arch=x NodeAddr=127.0.1.1 NodeHostName=w-0") == "127.0.1.1"
    assert ct.node_addr("") is None


@pytest.mark.parametrize("argv, message", [
    (["--containerized", "ack"], "--containerized needs --kubernetes"),
    (["--kubernetes", "--workers", "2"], "--workers needs --containerized"),
])
def test_cli_refuses_containerized_options_alone(argv, message, capsys, tmp_path):
    from pyk8sres import cli
    assert cli.main(["cluster", "up", "--workdir", str(tmp_path / "c"), *argv]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("nodes, workers, message", [
    (3, 4, "--workers 4: 1 to --nodes"), (2, 0, "--workers 0: 1 to --nodes"),
])
def test_up_refuses_more_workers_than_nodes(nodes, workers, message, tmp_path):
    with pytest.raises(ClusterError, match=message):
        ct.up(str(tmp_path / "c"), nodes=nodes, workers=workers, cpus=4, memory=8000,
              base_port=1, kube_port=2)
    assert not (tmp_path / "c").exists()


def test_slurm_conf_with_dynamic_nodes_only(tmp_path):
    from pyk8sres.testbed.slurm_conf import slurm_conf_text
    text = slurm_conf_text(str(tmp_path), nodes=0, cpus=4, memory=8000, base_port=17000,
                           node_features=True, def_mem_per_cpu=100, plugin_dir="/x",
                           extra="MaxNodeCount=10\nSlurmdPort=17001\n")
    assert "NodeName=" not in text
    assert "PartitionName=debug Nodes=ALL Default=YES" in text
    assert "MaxNodeCount=10\nSlurmdPort=17001\n" in text


def test_worker_port_and_slurmd_port():
    assert ct.worker_port(17001, "slurm-test-worker-cpu-0") == 17002
    assert ct.worker_port(17001, "slurm-test-worker-cpu-3") == 17005
    assert ct.slurmd_port_of("A=1\nSlurmdPort=17001\n") == 17001
    with pytest.raises(ClusterError, match="no SlurmdPort"):
        ct.slurmd_port_of("A=1\n")
