"""GRES strings, k8s_resources.conf and slurm.conf parsing."""
import pytest

from pyk8sres.slurmctld import config
from pyk8sres.slurmctld import gres
from pyk8sres.coordinator import slurm
from pyk8sres.slurmctld import slurmconf
from pyk8sres.slurmctld.completion import MemDefault


@pytest.mark.parametrize("text,name,count", [
    ("gres:k8scpu:3", "k8scpu", 3), ("gres/k8scpu:3", "k8scpu", 3),
    ("gres:gpu", "gpu", 1), ("gres:gpu:tesla:2", "gpu", 2), ("gres:k8smemory:2g", "k8smemory", 2 << 30),
])
def test_parse_entries(text, name, count):
    assert gres.count_of(gres.parse(text), name) == count


def test_non_gres_entries_are_kept():
    entries = gres.parse("cpu:2,gres/gpu:1")
    assert gres.with_counts(entries, {"k8scpu": 2}, 0x180B05) == "cpu:2,gres/gpu:1,gres/k8scpu:2"


@pytest.mark.parametrize("text,expected", [
    ("", config.Config()),
    ("OnInternalError=accept\nUnderRequest=reject # c\n", config.Config(
        on_internal_error="accept", under_request="reject")),
    ("reservecpus=2\nReserveMemory=1024\nLedgerSocket=/x\nLedgerUsers=1001, 1002", config.Config(
        reserve_cpus=2, reserve_memory_mb=1024, ledger_socket="/x", ledger_users=(1001, 1002))),
])
def test_config_parse(text, expected):
    assert config.parse(text) == expected


@pytest.mark.parametrize("text,message", [
    ("Bogus=1", "unknown setting"), ("UnderRequest=maybe", "must be one of"),
    ("ReserveCPUs=-1", "non-negative integer"), ("OnInternalError", "unknown setting"),
])
def test_config_errors(text, message):
    with pytest.raises(config.ConfigError, match=message):
        config.parse(text)


def test_partition_memory(tmp_path):
    (tmp_path / "parts.conf").write_text(
        "PartitionName=big Nodes=ALL DefMemPerCPU=2000 Default=YES\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nPartitionName=small Nodes=n1 DefMemPerNode=500\n"
                    "Include parts.conf\n# PartitionName=ghost DefMemPerCPU=1\n")
    parts, default = slurmconf.load_partition_memory(str(conf))
    assert parts == {"small": MemDefault(per_node=500), "big": MemDefault(per_cpu=2000)}
    assert default == "big"


def test_scontrol_record_parsing():
    line = ("NodeName=n1 Arch=x86_64 CPUAlloc=2 CPUTot=4 Gres=k8scpu:3,gpu:tesla:2(S:0) "
            "OS=Linux 6.1.0 #1 SMP Debian RealMemory=8000 AllocMem=400 "
            "State=MIXED ThreadsPerCore=1 GresUsed=k8scpu:2,gpu:tesla:1(IDX:0) Reason=a b=c")
    node = slurm.node_from_line(line)
    assert (node.name, node.cpus, node.alloc_cpus, node.real_memory, node.alloc_memory) == \
        ("n1", 4, 2, 8000, 400)
    assert node.gres == {"k8scpu": 3, "gpu": 2}
    assert node.gres_used == {"k8scpu": 2, "gpu": 1}
    assert slurm.gres_update_text(node.gres_raw, {"k8scpu": 1, "k8smemory": 10}) == \
        "gpu:tesla:2,k8scpu:1,k8smemory:10"


@pytest.mark.parametrize("text,expected", [
    ("k8scpu:4,k8smemory:125K", {"k8scpu": 4, "k8smemory": 128000}),
    ("k8smemory:1M", {"k8smemory": 1 << 20}),
    ("k8smemory:16000", {"k8smemory": 16000}),
    ("(null)", {}),
    ("gpu:tesla:2(IDX:0-1),gpu:k80:1(IDX:2)", {"gpu": 3}),
])
def test_scontrol_gres_counts(text, expected):
    assert slurm.parse_gres(text) == expected
