"""slurmctld's live partitions and nodes (pyk8sres.slurmctld.topology) and
how the job_submit policy uses them instead of slurm.conf's."""
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyk8sres.slurmctld import completion, embed, slurmconf, submit, topology
from pyk8sres.slurmctld.jobspec import (CR_CORE, CR_MEMORY, MEM_PER_CPU, Job, MemDefault, Nodes,
                                        Partition, PolicyError, Site)

N1 = "N 0 8 8000 1 8 0"
N2 = "N 1 32 32000 1 32 0"
SMALL = Nodes(threads_per_core=1, cpus=8, memory=8000, count=1, least_cpus=8,
              least_memory=8000, cpu_counts=((8, 1),), cores_per_socket=(8,))
BOTH = Nodes(threads_per_core=1, cpus=32, memory=32000, count=2, least_cpus=8,
             least_memory=8000, cpu_counts=((32, 1), (8, 1)), cores_per_socket=(8, 32))
BIG = Nodes(threads_per_core=1, cpus=32, memory=32000, count=1, least_cpus=32,
            least_memory=32000, cpu_counts=((32, 1),), cores_per_socket=(32,))

PARSED = [
    ("slurm.conf's small", f"{N1}\n{N2}\nP small 0\nP debug 0 1\nD debug\n",
     {"small": SMALL, "debug": BOTH}, BOTH, "debug"),
    ("small grown at run time", f"{N1}\n{N2}\nP small 0 1\nD small\n",
     {"small": BOTH}, BOTH, "small"),
    # a dynamic node in a hole of the table (index 5), and a partition whose
    # bitmap names an index with no node: ignored
    ("dynamic node", f"{N1}\nN 5 32 32000 1 32 0\nP all 0 5 7\n",
     {"all": dataclasses.replace(BOTH, cores_per_socket=(8, 32))}, BOTH, None),
    ("partition without nodes: the cluster bounds it", f"{N1}\n{N2}\nP empty\n",
     {"empty": BOTH}, BOTH, None),
    ("SMT and GPUs", "N 0 16 64000 2 4 4\nN 1 8 8000 1 8 0\nP g 0\n",
     {"g": Nodes(threads_per_core=2, cpus=16, memory=64000, count=1, least_cpus=16,
                 least_memory=64000, gpus=4, cpu_counts=((16, 1),), cores_per_socket=(4,))},
     Nodes(threads_per_core=2, cpus=16, memory=64000, count=2, least_cpus=8, least_memory=8000,
           gpus=4, cpu_counts=((16, 1), (8, 1)), cores_per_socket=(4, 8)), None),
    ("no RealMemory", "N 0 4 0 1 4 0\nP p 0\n",
     {"p": Nodes(cpus=4, memory=None, count=1, least_cpus=4, least_memory=1,
                 cpu_counts=((4, 1),), cores_per_socket=(4,))},
     Nodes(cpus=4, memory=None, count=1, least_cpus=4, least_memory=1,
           cpu_counts=((4, 1),), cores_per_socket=(4,)), None),
]


@pytest.mark.parametrize("name,text,partitions,all_nodes,default", PARSED,
                         ids=[p[0] for p in PARSED])
def test_parse(name, text, partitions, all_nodes, default):
    got = topology.parse(text)
    assert got.partitions == partitions
    assert got.all_nodes == all_nodes
    assert got.default_partition == default


@pytest.mark.parametrize("text", ["X 1 2\n", "N 0 8 8000 1\n", "N 0 eight 8000 1 8 0\n",
                                  "P small one\n", "D\n"])
def test_parse_refuses_what_the_plugin_never_sends(text):
    with pytest.raises(topology.TopologyError, match="line 1"):
        topology.parse(text)


@pytest.fixture
def conf_site():
    """slurm.conf's view: small = n1, debug = n1 and n2; forgets the live view after."""
    site = Site(slurm_version=0x160508, select_type_param=CR_CORE | CR_MEMORY,
                cluster_mem=MemDefault(per_cpu=100), all_nodes=BOTH, default_partition="debug",
                partitions={"small": Partition(nodes=SMALL, max_mem_per_cpu=4000),
                            "debug": Partition(nodes=BOTH), "gone": Partition(nodes=SMALL)})
    submit.use_site(site)
    yield site
    submit._topology = None
    submit.use_site(Site())


# (live description, job) -> per-node figures (PolicyError text if refused)
COMPLETED = [
    ("-n 20 --mincpus=4: slurm.conf's small caps at n1's 8 CPUs", None,
     Job(partition="small", num_tasks=20, pn_min_cpus=4), {"k8scpu": 8, "k8smemory": 800}),
    ("... small grown to n2 at run time: n2's 20", f"{N1}\n{N2}\nP small 0 1\nP debug 0 1\n",
     Job(partition="small", num_tasks=20, pn_min_cpus=4), {"k8scpu": 20, "k8smemory": 2000}),
    ("--mem=0 on slurm.conf's small: n1's memory", None,
     Job(partition="small", cpus_per_task=4, mem_per_node=0), {"k8scpu": 4, "k8smemory": 8000}),
    ("--mem=0 on small grown: refused with the sizes", f"{N1}\n{N2}\nP small 0 1\n",
     Job(partition="small", cpus_per_task=4, mem_per_node=0), "8000 to 32000 MB"),
    ("--mem=0 on small moved to n2", f"{N1}\n{N2}\nP small 1\n",
     Job(partition="small", cpus_per_task=4, mem_per_node=0), {"k8scpu": 4, "k8smemory": 32000}),
    ("a partition created at run time", f"{N1}\n{N2}\nP small 0\nP late 1\n",
     Job(partition="late", cpus_per_task=4, mem_per_node=0), {"k8scpu": 4, "k8smemory": 32000}),
    ("the default partition changed at run time", f"{N1}\n{N2}\nP small 1\nP debug 0 1\nD small\n",
     Job(cpus_per_task=4, mem_per_node=0), {"k8scpu": 4, "k8smemory": 32000}),
    ("a dynamic node joins a Nodes=ALL partition", f"{N1}\n{N2}\nN 2 64 64000 1 64 0\n"
     "P small 0\nP debug 0 1 2\n",
     Job(partition="debug", num_tasks=40, pn_min_cpus=2), {"k8scpu": 40, "k8smemory": 4000}),
]


@pytest.mark.parametrize("name,live,job,expected", COMPLETED, ids=[c[0] for c in COMPLETED])
def test_completion_follows_the_live_view(conf_site, name, live, job, expected):
    if live is not None:
        submit.use_topology(topology.parse(live))
    site = submit.site_for(MEM_PER_CPU | 100, 0x160508, CR_CORE | CR_MEMORY, 0)
    if isinstance(expected, str):
        with pytest.raises(PolicyError, match=expected):
            completion.complete(job, site)
    else:
        assert completion.complete(job, site).per_node == expected


def test_live_view_keeps_slurm_conf_settings_and_drops_deleted_partitions(conf_site):
    submit.use_topology(topology.parse(f"{N1}\n{N2}\nP small 0 1\nP late 1\n"))
    site = submit.current_site()
    assert set(site.partitions) == {"small", "late"}
    assert site.partitions["small"] == Partition(nodes=BOTH, max_mem_per_cpu=4000)
    assert site.partitions["late"] == Partition(nodes=BIG)
    assert site.default_partition == "debug"  # none sent: slurm.conf's


def test_each_new_view_empties_the_memo(conf_site):
    cleared = []
    submit.bind(lambda: cleared.append(1))
    try:
        submit.use_topology(topology.parse(f"{N1}\nP small 0\n"))
        assert cleared
    finally:
        submit.bind(None)


def test_reloading_slurm_conf_keeps_the_live_view(conf_site, tmp_path, monkeypatch):
    """node_features reloads slurm.conf too, unknown to the job_submit plugin:
    the live view stays until the plugin sends a new one."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=n1 CPUs=8 RealMemory=8000\nNodeName=n2 CPUs=32 RealMemory=32000\n"
                    "PartitionName=small Nodes=n1 Default=YES\n")
    monkeypatch.setattr(embed, "release_facts", lambda: {})
    submit.use_topology(topology.parse(f"{N1}\n{N2}\nP small 0 1\n"))
    embed.reconfigure(str(conf))
    assert submit.current_site().partitions["small"].nodes == BOTH


GRES = ["", "k8scpu:8,k8smemory:8000", "gpu:2", "gpu:a100:2,gpu:v100:1", "gpu",
        "gpu:a100", "gpu:2(S:0-1),k8scpu:8", "gpus:3", "k8scpu:8,gpu:tesla:4(S:0)", "mygpu:2"]


def test_the_plugin_counts_gpus_as_the_slurm_conf_reader(tmp_path):
    """plugins/job_submit_k8s_resource_completion.c _gres_gpus (node table)
    and slurmconf._gpus (slurm.conf) agree, compiled and run here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    source = (Path(__file__).resolve().parents[2] / "plugins" /
              "job_submit_k8s_resource_completion.c").read_text()
    body = re.search(r"static uint64_t _gres_gpus\(const char \*gres\)\n\{.*?\n\}\n", source,
                     re.S).group(0)
    program = tmp_path / "gpus.c"
    program.write_text("#include <stdint.h>\n#include <stdio.h>\n#include <stdlib.h>\n"
                       "#include <string.h>\n" + body +
                       "int main(int argc, char **argv)\n{\n\tfor (int i = 1; i < argc; i++)\n"
                       "\t\tprintf(\"%llu\\n\", (unsigned long long) _gres_gpus(argv[i]));\n"
                       "\treturn 0;\n}\n")
    subprocess.run([cc, "-o", str(tmp_path / "gpus"), str(program)], check=True)
    out = subprocess.run([str(tmp_path / "gpus"), *GRES], capture_output=True, text=True,
                         check=True).stdout.split()
    assert [int(n) for n in out] == [slurmconf._gpus(g) for g in GRES]
