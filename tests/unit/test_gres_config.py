"""GRES strings, k8s_resources.conf and slurm.conf parsing."""
import pytest
import yaml

from pyk8sres import data
from pyk8sres.slurmctld import config, embed
from pyk8sres.slurmctld import gres
from pyk8sres.coordinator import slurm
from pyk8sres.slurmctld import completion, jobspec, slurmconf
from pyk8sres.slurmctld.jobspec import CR_CORE, Job, MemDefault, Site


@pytest.mark.parametrize("text,name,count", [
    ("gres:k8scpu:3", "k8scpu", 3), ("gres/k8scpu:3", "k8scpu", 3),
    ("gres:gpu", "gpu", 1), ("gres:gpu:tesla:2", "gpu", 2), ("gres:k8smemory:2g", "k8smemory", 2 << 30),
    # 24.11's sbatch sends --gpus-per-task TRES-style
    ("gres/gpu=1", "gpu", 1), ("gres/gpu:a100=2", "gpu", 2), ("gres/k8scpu=3", "k8scpu", 3),
])
def test_parse_entries(text, name, count):
    assert gres.count_of(gres.parse(text), name) == count


def test_non_gres_entries_are_kept():
    entries = gres.parse("cpu:2,gres/gpu:1")
    assert gres.with_counts(entries, {"k8scpu": 2}, True) == "cpu:2,gres/gpu:1,gres/k8scpu:2"


@pytest.mark.parametrize("text,expected", [
    ("", config.Config()),
    ("OnInternalError=accept\nUnderRequest=reject # c\n", config.Config(
        on_internal_error="accept", under_request="reject")),
    ("reservecpus=2\nReserveMemory=1024\nLedgerSocket=/x\nLedgerUsers=1001, 1002", config.Config(
        reserve_cpus=2, reserve_memory_mb=1024, ledger_socket="/x", ledger_users=(1001, 1002))),
    ("LedgerUsers=990\nLedgerGroup=990", config.Config(ledger_users=(990,), ledger_group=990)),
    ("LedgerGroup=0", config.Config(ledger_group=0)),
    ("LedgerConnectionsPerUser=64", config.Config(ledger_connections_per_user=64)),
    ("ledgerconnectionsperuser=1", config.Config(ledger_connections_per_user=1)),
])
def test_config_parse(text, expected):
    assert config.parse(text) == expected


@pytest.mark.parametrize("text,message", [
    ("Bogus=1", "unknown setting"), ("UnderRequest=maybe", "must be one of"),
    ("ReserveCPUs=-1", "non-negative integer"), ("OnInternalError", "unknown setting"),
    ("LedgerGroup=slurm", "numeric gid"), ("LedgerGroup=", "numeric gid"),
    ("LedgerGroup=4294967296", "numeric gid"), ("LedgerGroup=-1", "numeric gid"),
    ("LedgerConnectionsPerUser=0", "from 1 to 1024"),
    ("LedgerConnectionsPerUser=1025", "from 1 to 1024"),
    ("LedgerConnectionsPerUser=²", "from 1 to 1024"),
    ("LedgerConnectionsPerUser=", "from 1 to 1024"),
])
def test_config_errors(text, message):
    with pytest.raises(config.ConfigError, match=message):
        config.parse(text)


@pytest.mark.parametrize("text", [
    "ReserveCPUs=\u00b2",            # superscript two: isdigit() says yes, int() raises
    "ReserveCPUs=\u0661\u0662",      # Arabic-Indic 12: int() would read it
    "ReserveMemory=\U0001d7d7",      # mathematical bold 9
    "LedgerUsers=990,\u0663", "LedgerGroup=\u00b2", "LedgerGroup=\u0969\u0669\u0966",
])
def test_config_integers_are_ascii_digits(tmp_path, text):
    """Only 0-9: any other digit is refused as a ConfigError that names the
    key and the value (the plugin reports it as a bad setting, not a bug),
    the same through the plugin's own entry point."""
    key, _, value = text.partition("=")
    with pytest.raises(config.ConfigError) as e:
        config.parse(text)
    assert key in str(e.value) and repr(value) in str(e.value)
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    (tmp_path / "k8s_resources.conf").write_text(text + "\n", encoding="utf-8")
    with pytest.raises(config.ConfigError, match=key):
        embed.reconfigure(str(tmp_path / "slurm.conf"))


@pytest.mark.parametrize("text,expected", [
    ("n[1-3]", ["n1", "n2", "n3"]), ("n[\u00b2-3]", []), ("n[\u0661-3]", []),
])
def test_slurm_conf_hostlists_read_ascii_digits_only(text, expected):
    assert slurmconf.expand_hostlist(text) == expected


def test_slurm_conf_numbers_read_ascii_digits_only(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nPartitionName=p Nodes=ALL DefMemPerCPU=\u00b2\n"
                    "PartitionName=q Nodes=ALL DefMemPerCPU=\u0661\u0662\n", encoding="utf-8")
    parts = slurmconf.load(str(conf)).partitions
    assert parts["p"].mem == parts["q"].mem == MemDefault()


@pytest.mark.parametrize("text", ["gres:k8scpu:\u00b2", "gres:k8scpu:\u0661\u0662"])
def test_gres_counts_are_ascii_digits(text):
    with pytest.raises(gres.GresError):
        gres.parse(text)


def test_partition_memory(tmp_path):
    (tmp_path / "parts.conf").write_text(
        "PartitionName=big Nodes=ALL DefMemPerCPU=2000 Default=YES\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nPartitionName=small Nodes=n1 DefMemPerNode=500\n"
                    "Include parts.conf\n# PartitionName=ghost DefMemPerCPU=1\n")
    loaded = slurmconf.load(str(conf))
    assert {name: p.mem for name, p in loaded.partitions.items()} == \
        {"small": MemDefault(per_node=500), "big": MemDefault(per_cpu=2000)}
    assert loaded.default_partition == "big"


def test_scontrol_record_parsing():
    line = ("NodeName=n1 Arch=x86_64 CPUAlloc=2 CPUTot=4 Gres=k8scpu:3,gpu:tesla:2(S:0) "
            "OS=Linux 6.1.0 #1 SMP Debian RealMemory=8000 AllocMem=400 "
            "State=MIXED ThreadsPerCore=1 GresUsed=k8scpu:2,gpu:tesla:1(IDX:0) Reason=a b=c")
    node = slurm.node_from_line(line)
    assert (node.name, node.cpus, node.alloc_cpus, node.real_memory, node.alloc_memory) == \
        ("n1", 4, 2, 8000, 400)
    assert node.gres == {"k8scpu": 3, "gpu": 2}
    assert node.gres_used == {"k8scpu": 2, "gpu": 1}


@pytest.mark.parametrize("text,expected", [
    ("k8scpu:4,k8smemory:125K", {"k8scpu": 4, "k8smemory": 128000}),
    ("k8smemory:1M", {"k8smemory": 1 << 20}),
    ("k8smemory:16000", {"k8smemory": 16000}),
    ("(null)", {}),
    ("gpu:tesla:2(IDX:0-1),gpu:k80:1(IDX:2)", {"gpu": 3}),
])
def test_scontrol_gres_counts(text, expected):
    assert slurm.parse_gres(text) == expected


SLURM_CONF = """
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory,CR_ONE_TASK_PER_CORE
MaxMemPerCPU=4000
NodeName=DEFAULT RealMemory=16000
NodeName=n[1-2] CPUs=8 ThreadsPerCore=2 CoresPerSocket=4
NodeName=big[01-02] Sockets=2 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=64000
PartitionName=DEFAULT DefMemPerCPU=300 MaxMemPerCPU=1000
PartitionName=smt Nodes=n[1-2] Default=YES
PartitionName=wide Nodes=big[01-02] DefMemPerNode=2000
PartitionName=all Nodes=ALL DefMemPerCPU=50
"""


def test_slurm_conf_topology_and_defaults(tmp_path):
    (tmp_path / "slurm.conf").write_text(SLURM_CONF)
    conf = slurmconf.load(str(tmp_path / "slurm.conf"))
    assert conf.select_type_param == \
        jobspec.CR_CORE | jobspec.CR_MEMORY | jobspec.CR_ONE_TASK_PER_CORE
    assert conf.max_mem_per_cpu == 4000
    assert conf.default_partition == "smt"
    smt, wide, every = conf.partitions["smt"], conf.partitions["wide"], conf.partitions["all"]
    assert smt == jobspec.Partition(mem=MemDefault(per_cpu=300), max_mem_per_cpu=1000,
                                       nodes=jobspec.Nodes(2, 8, 16000, 2, 8, 16000,
                                                              cores_per_socket=(4,),
                                                              cpu_counts=((8, 2),)))
    # DefMemPerNode on the line beats the DEFAULT line's DefMemPerCPU (Slurm: mutually exclusive)
    assert wide.mem == MemDefault(per_node=2000)
    assert wide.nodes == jobspec.Nodes(1, 16, 64000, 2, 16, 64000,  # CPUs from sockets x cores x threads
                                          cores_per_socket=(8,), cpu_counts=((16, 2),))
    assert every.mem == MemDefault(per_cpu=50) and \
        every.nodes == jobspec.Nodes(2, 16, 64000, 4, 8, 16000, cores_per_socket=(4, 8),
                                        cpu_counts=((16, 2), (8, 2)))


@pytest.mark.parametrize("line,cores", [
    ("NodeName=a CPUs=8", 1),                               # Slurm: sockets of one core
    ("NodeName=a CPUs=16 Sockets=2 ThreadsPerCore=2", 4),    # cores from CPUs
    ("NodeName=a Sockets=2 CoresPerSocket=6", 6),
    ("NodeName=a Boards=2 SocketsPerBoard=2 CoresPerSocket=3 ThreadsPerCore=2", 3),
])
def test_slurm_conf_cores_per_socket(line, cores):
    conf = slurmconf.parse([line, "PartitionName=p Nodes=ALL"])
    assert conf.partitions["p"].nodes.cores_per_socket == (cores,)


@pytest.mark.parametrize("text,names", [
    ("n[1-3,7],login1", ["n1", "n2", "n3", "n7", "login1"]),
    ("x[01-03]-ib", ["x01-ib", "x02-ib", "x03-ib"]),
    ("solo", ["solo"]),
])
def test_hostlist(text, names):
    assert slurmconf.expand_hostlist(text) == names


GPU_SLURM_CONF = """
DefCpuPerGPU=3
DefMemPerGPU=3000
GresTypes=gpu,k8scpu,k8smemory
NodeName=g[1-2] CPUs=16 RealMemory=64000 Gres=gpu:a100:2,gpu:v100:2,k8scpu:16
NodeName=c1 CPUs=8 RealMemory=16000
PartitionName=DEFAULT DefCpuPerGPU=2
PartitionName=gpu Nodes=g[1-2] Default=YES DefMemPerGPU=8000
PartitionName=cpu Nodes=c1 DefCpuPerGPU=0
"""


def test_slurm_conf_gpu_defaults_and_counts(tmp_path):
    """DefCpuPerGPU/DefMemPerGPU of the cluster and of each partition (a DEFAULT
    line's too), and the most GPUs on a partition's nodes (typed ones added up)."""
    (tmp_path / "slurm.conf").write_text(GPU_SLURM_CONF)
    conf = slurmconf.load(str(tmp_path / "slurm.conf"))
    assert conf.cluster_gpu == jobspec.GpuDefault(cpus=3, mem=3000)
    gpu, cpu = conf.partitions["gpu"], conf.partitions["cpu"]
    assert gpu.gpu == jobspec.GpuDefault(cpus=2, mem=8000)
    assert cpu.gpu == jobspec.GpuDefault(cpus=0)
    assert (gpu.nodes.gpus, cpu.nodes.gpus, conf.all_nodes.gpus) == (4, None, 4)


def test_list_nodes_parses_only_the_lines_that_changed(monkeypatch):
    lines = {"n1": "NodeName=n1 CPUTot=4 RealMemory=8000 State=IDLE",
             "n2": "NodeName=n2 CPUTot=8 RealMemory=16000 State=IDLE"}
    monkeypatch.setattr(slurm, "run", lambda *a, **k: "\n".join(lines.values()) + "\n")
    monkeypatch.setattr(slurm, "_last_read", {})
    first = {n.name: n for n in slurm.list_nodes()}
    lines["n2"] = "NodeName=n2 CPUTot=8 RealMemory=16000 AllocMem=100 State=MIXED"
    second = {n.name: n for n in slurm.list_nodes()}
    assert second["n1"] is first["n1"]                      # unchanged: not parsed again
    assert (second["n2"].state, second["n2"].alloc_memory) == ("MIXED", 100)
    del lines["n1"]
    assert [n.name for n in slurm.list_nodes()] == ["n2"]
    assert set(slurm._last_read) == {lines["n2"]}           # a gone node is not kept


def test_ledger_connection_budget_covers_the_charts_default_replicas():
    """Every coordinator process runs as one uid: each webhook replica holds
    two ledger connections (admission, placeholders), the sync daemon one,
    `pyk8sres status` one; the default leaves room for twice that."""
    values = yaml.safe_load(open(data.path("deploy", "helm", "pyk8sres", "values.yaml")))
    need = 2 * values["webhook"]["replicas"] + 1 + 1
    assert config.Config().ledger_connections_per_user >= 2 * need
    assert config.Config().ledger_connections_per_user >= 2 * 8 + 2    # 8 replicas fit too


@pytest.mark.parametrize("lines,memory", [
    (["NodeName=a CPUs=4 RealMemory=8000"], 8000),
    # MemSpecLimit is never given to jobs, --mem=0 included
    (["NodeName=a CPUs=4 RealMemory=8000 MemSpecLimit=512"], 7488),
    (["NodeName=DEFAULT MemSpecLimit=1000", "NodeName=a CPUs=4 RealMemory=8000"], 7000),
    (["NodeName=a CPUs=4 RealMemory=8000 MemSpecLimit=8000"], None),
])
def test_slurm_conf_memory_is_what_a_job_can_get(lines, memory):
    conf = slurmconf.parse(lines + ["PartitionName=p Nodes=ALL"])
    assert conf.partitions["p"].nodes.memory == memory


@pytest.mark.parametrize("lines,cpus", [
    (["NodeName=a CPUs=4"], 4),
    # the specialized cores are never given to jobs, a whole node included
    (["NodeName=a CPUs=4 CoreSpecCount=1"], 3),
    (["NodeName=DEFAULT CoreSpecCount=2", "NodeName=a CPUs=8"], 6),
    # x threads per core when Slurm schedules threads
    (["NodeName=a Sockets=1 CoresPerSocket=4 ThreadsPerCore=2 CoreSpecCount=1"], 6),
    (["NodeName=a CPUs=8 ThreadsPerCore=2 CoreSpecCount=1"], 6),
    # ... and x 1 when it schedules cores (CPUs = cores)
    (["NodeName=a CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=2 CoreSpecCount=1"], 3),
    # CpuSpecList replaces CoreSpecCount; each CPU reserves its whole core
    (["NodeName=a CPUs=4 CpuSpecList=0,2"], 2),
    (["NodeName=a CPUs=4 CpuSpecList=2-3 CoreSpecCount=1"], 2),
    (["NodeName=a Sockets=1 CoresPerSocket=4 ThreadsPerCore=2 CpuSpecList=0"], 6),
    (["NodeName=a Sockets=1 CoresPerSocket=4 ThreadsPerCore=2 CpuSpecList=0-1,5"], 4),
    (["NodeName=a CPUs=2 CoreSpecCount=2"], 0),
])
def test_slurm_conf_cpus_are_what_a_job_can_get(lines, cpus):
    conf = slurmconf.parse(lines + ["PartitionName=p Nodes=ALL"])
    nodes = conf.partitions["p"].nodes
    assert (nodes.cpus, nodes.least_cpus, nodes.cpu_counts) == (cpus, cpus, ((cpus, 1),))


@pytest.mark.parametrize("job", [
    Job(num_tasks=5, min_nodes=2, pn_min_cpus=2),
    Job(num_tasks=5, min_nodes=2, threads_per_core=1),
])
def test_a_job_sized_by_the_biggest_node_asks_no_more_than_its_effective_cpus(job):
    """The most tasks a node can get (4) capped at the biggest node's CPUs,
    which are CPUs less the specialized ones (3): all Slurm can give."""
    conf = slurmconf.parse(["NodeName=w[0-1] CPUs=4 RealMemory=8000 CoreSpecCount=1",
                            "PartitionName=p Nodes=ALL Default=YES"])
    site = Site(select_type_param=CR_CORE, partitions=conf.partitions, default_partition="p",
                all_nodes=conf.all_nodes)
    assert completion.complete(job, site).per_node["k8scpu"] == 3
