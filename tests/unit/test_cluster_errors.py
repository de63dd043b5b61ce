"""`pyk8sres cluster up` fails early and clearly (no daemon is started)."""
import argparse
import os
import shutil
import socket
import tempfile

import pytest

from pyk8sres import cli, install
from pyk8sres.testbed import accounting, cluster


def test_missing_binary_names_the_package():
    with pytest.raises(cluster.ClusterError, match="apt-get install no-such-package"):
        cluster._need("no-such-binary-pyk8sres", "no-such-package")


@pytest.mark.skipif(os.geteuid() != 0, reason="cluster up refuses non-root first")
def test_port_in_use_is_reported(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Its neighbours are Slurm's ports too and may be busy by chance.
        with pytest.raises(cluster.ClusterError,
                           match=rf"port\(s\) ([\d, ]*\b)?{port}\b[\d, ]* already in use"):
            cluster.up(str(tmp_path / "c"), nodes=1, base_port=port)
    assert not os.path.exists(tmp_path / "c" / "run")  # nothing was started


@pytest.mark.skipif(os.geteuid() != 0, reason="cluster up refuses non-root first")
@pytest.mark.parametrize("service,flags", [("slurmdbd", {"accounting": True}),
                                           ("mariadb", {"accounting": True}),
                                           ("slurmrestd", {"rest": True})])
def test_service_port_in_use_is_reported(tmp_path, service, flags):
    if not all(os.path.exists(f"/usr/sbin/{b}") for b in ("mariadbd", "slurmdbd", "slurmrestd")):
        pytest.skip("mariadb-server, slurmdbd, slurmrestd not installed (tools/install-deps.sh)")
    base = 30000 + int(os.environ.get("PYK8SRES_TEST_PORT_OFFSET", "0"))
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("0.0.0.0", cluster.service_ports(base, 1)[service]))
        except OSError:
            pytest.skip("that port is in use by someone else already")
        busy.listen()
        port = busy.getsockname()[1]
        # Its neighbours are Slurm's ports too and may be busy by chance.
        with pytest.raises(cluster.ClusterError,
                           match=rf"port\(s\) ([\d, ]*\b)?{port}\b[\d, ]* already in use"):
            cluster.up(str(tmp_path / "c"), nodes=1, base_port=base, **flags)
    assert not os.path.exists(tmp_path / "c" / "run")  # nothing was started


def test_slurm_conf_accounting_replaces_none(tmp_path):
    lines = accounting.slurm_conf_lines(str(tmp_path), 6819, "munge")
    text = cluster.slurm_conf_text(str(tmp_path), nodes=1, cpus=4, memory=8000, base_port=17000,
                                   node_features=True, def_mem_per_cpu=100, plugin_dir="/x",
                                   accounting=lines)
    assert "accounting_storage/none" not in text and "jobcomp/none" not in text
    assert text.count("AccountingStorageType=") == 1
    assert "AccountingStorageType=accounting_storage/slurmdbd\n" in text
    # With munge, slurmdbd connections use AccountingStoragePass as the socket.
    assert f"AccountingStoragePass=socket={tmp_path}/munge/munge.sock\n" in text
    plain = cluster.slurm_conf_text(str(tmp_path), nodes=1, cpus=4, memory=8000,
                                    base_port=17000, node_features=True, def_mem_per_cpu=100,
                                    plugin_dir="/x")
    assert "AccountingStorageType=accounting_storage/none\n" in plain


def test_slurm_conf_without_node_features_keeps_gres_on_node_lines(tmp_path):
    text = cluster.slurm_conf_text(str(tmp_path), nodes=2, cpus=4, memory=8000, base_port=17000,
                                   node_features=False, def_mem_per_cpu=100, plugin_dir="/x")
    assert "Gres=k8scpu:4,k8smemory:8000" in text and "NodeFeaturesPlugins" not in text
    text = cluster.slurm_conf_text(str(tmp_path), nodes=2, cpus=4, memory=8000, base_port=17000,
                                   node_features=True, def_mem_per_cpu=100, plugin_dir="/x")
    assert "Gres=" not in text and "NodeFeaturesPlugins=node_features/k8s_resources" in text
    assert "Port=[17001-17002]" in text and "JobSubmitPlugins=k8s_resource_completion" in text


def test_unreadable_python_is_reported():
    """slurmctld as SlurmUser=slurm cannot load a core under a 0700 directory."""
    base = tempfile.mkdtemp(dir="/tmp")  # /tmp itself lets everyone through
    try:
        os.chmod(base, 0o755)
        locked = os.path.join(base, "locked")
        os.makedirs(os.path.join(locked, "lib"))
        target = os.path.join(locked, "lib", "libx.so")
        open(target, "wb").close()
        os.chmod(locked, 0o700)
        assert install.unreadable_by_others(target) == locked
        os.chmod(locked, 0o755)
        assert install.unreadable_by_others(target) is None
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("cpus,layout,line", [
    (8, {}, ""),
    (8, {"threads_per_core": 2}, " Sockets=1 CoresPerSocket=4 ThreadsPerCore=2"),
    (16, {"sockets": 2, "threads_per_core": 2}, " Sockets=2 CoresPerSocket=4 ThreadsPerCore=2"),
    (12, {"sockets": 2, "cores_per_socket": 6}, " Sockets=2 CoresPerSocket=6 ThreadsPerCore=1"),
])
def test_node_layout(cpus, layout, line):
    assert cluster.topology(cpus, **layout) == line


def test_node_layout_must_multiply_to_cpus():
    with pytest.raises(cluster.ClusterError, match="not sockets x cores-per-socket x threads"):
        cluster.topology(8, sockets=2, cores_per_socket=3, threads_per_core=2)


def test_slurm_conf_smt_layout_and_no_job_submit(tmp_path):
    text = cluster.slurm_conf_text(str(tmp_path), nodes=2, cpus=8, memory=8000, base_port=17000,
                                   node_features=False, def_mem_per_cpu=100, plugin_dir="/x",
                                   layout=cluster.topology(8, threads_per_core=2),
                                   job_submit=False)
    assert "CPUs=8 Sockets=1 CoresPerSocket=4 ThreadsPerCore=2" in text
    assert "SlurmdParameters=config_overrides" in text and "JobSubmitPlugins" not in text


def test_slurm_conf_nodes_of_different_sizes(tmp_path):
    sizes = [(8, 16000, ""), (4, 8000, ""), (12, 24000, cluster.topology(12, sockets=2))]
    text = cluster.slurm_conf_text(str(tmp_path), nodes=3, cpus=0, memory=0, base_port=17000,
                                   node_features=False, def_mem_per_cpu=100, plugin_dir="/x",
                                   sizes=sizes)
    lines = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in lines] == ["NodeName=n1", "NodeName=n2", "NodeName=n3"]
    assert "Port=17002 CPUs=4 RealMemory=8000 Gres=k8scpu:4,k8smemory:8000" in lines[1]
    assert "CPUs=12 Sockets=2 CoresPerSocket=6 ThreadsPerCore=1 RealMemory=24000" in lines[2]


@pytest.mark.parametrize("text,sizes", [
    ("8:16000,4:8000", [(8, 16000), (4, 8000)]),
    ("12:24000", [(12, 24000)]),
    ("8", None), ("8:16000,", None), ("0:100", None), ("a:b", None),
])
def test_node_sizes_option(text, sizes):
    if sizes is None:
        with pytest.raises(argparse.ArgumentTypeError, match="expected CPUS:MB"):
            cli._node_sizes(text)
    else:
        assert cli._node_sizes(text) == sizes


@pytest.mark.skipif(os.geteuid() != 0, reason="cluster up refuses non-root first")
def test_node_sizes_must_match_nodes(tmp_path):
    with pytest.raises(cluster.ClusterError, match="2 node sizes for 3 nodes"):
        cluster.up(str(tmp_path), nodes=3, node_sizes=[(8, 16000), (4, 8000)])


@pytest.mark.parametrize("count,per_node,available,fits", [
    (10_000, 2200, 16 << 30, True),          # slurmctld alone: 22 MB
    (10_000, 400 << 10, 16 << 30, True),     # ~3.8 GiB of 12 GiB usable
    (40_000, 400 << 10, 16 << 30, False),    # ~15.3 GiB of 12 GiB usable
    (100_000, 400 << 10, 16 << 30, False),
    (1, 1 << 30, 1 << 30, False),            # one node past the headroom
])
def test_node_count_checked_against_measured_memory(count, per_node, available, fits):
    if fits:
        cluster.check_memory(count, per_node, available, "x")
        return
    with pytest.raises(cluster.ClusterError) as e:
        cluster.check_memory(count, per_node, available, "x")
    text = str(e.value)
    assert f"{count} nodes need" in text and f"{per_node / 1024:.1f} KiB per node" in text
    assert f"at most {int(available * cluster.MEMORY_HEADROOM // per_node)} nodes fit" in text


@pytest.mark.skipif(os.geteuid() != 0, reason="cluster up refuses non-root first")
def test_too_many_scale_nodes_refused_before_anything_starts(tmp_path):
    count = int(cluster.available_memory() / cluster.SLURMCTLD_BYTES_PER_NODE) + 1
    with pytest.raises(cluster.ClusterError, match="KiB per node.*nodes fit on this machine"):
        cluster.up(str(tmp_path / "c"), nodes=1, scale_nodes=count)
    assert not os.path.exists(tmp_path / "c" / "run")


def test_scale_nodes_in_their_own_partition_on_one_port():
    text = cluster.slurm_conf_text("/w", nodes=2, cpus=8, memory=16000, base_port=22100,
                                   node_features=True, def_mem_per_cpu=100, plugin_dir="/p",
                                   scale_nodes=5000)
    port = cluster.scale_port(22100, 2)
    assert port not in range(22100, 22103) and port not in cluster.service_ports(22100, 2).values()
    assert "PartitionName=debug Nodes=n[1-2] Default=YES" in text
    assert "NodeName=s[1-5000] " in text and f" Port={port} " in text
    assert "PartitionName=scale Nodes=s[1-5000] " in text
    assert "Nodes=ALL" not in cluster.slurm_conf_text(
        "/w", nodes=2, cpus=8, memory=16000, base_port=22100, node_features=True,
        def_mem_per_cpu=100, plugin_dir="/p", scale_nodes=1)
    assert "PartitionName=debug Nodes=ALL" in cluster.slurm_conf_text(
        "/w", nodes=2, cpus=8, memory=16000, base_port=22100, node_features=True,
        def_mem_per_cpu=100, plugin_dir="/p")
