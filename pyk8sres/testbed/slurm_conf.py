"""The local test cluster's configuration, as text: its ports, its node
names and lines, slurm.conf and gres.conf, and how many scale nodes fit in
memory.  Nothing here starts a daemon; cluster.py writes these files under
WORKDIR and starts the daemons that read them.
"""
from __future__ import annotations

import socket

from .daemons import ClusterError


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def service_ports(base_port: int, nodes: int) -> dict[str, int]:
    """The cluster's port scheme past slurmctld (base) and slurmd n<i> (base+i)."""
    last = base_port + nodes
    return {"slurmdbd": last + 1, "mariadb": last + 2, "slurmrestd": last + 3}


def node_names(count: int) -> list[str]:
    return [f"n{i}" for i in range(1, count + 1)]


# --- scale nodes: node records without a slurmd ------------------------------
# `up(scale_nodes=N)` declares N more nodes s1..sN in slurm.conf, in a
# partition of their own (SCALE_PARTITION), and starts no slurmd for them.
# slurmctld treats such a node as it treats any node whose slurmd never came
# (22.05 node_conf.c: last_response starts at 0; ping_nodes.c sets a node DOWN
# "Not responding" only once last_response is non-zero and older than
# SlurmdTimeout): it stays UNKNOWN (sinfo "unk*") for good and is asked to
# register on every ping cycle (a refused connection: they all share one
# port nobody listens on, scale_port).  Its record is complete: the
# node_features plugin gives it k8scpu/k8smemory at startup (get_node(NULL),
# 22.05 and 24.11) and the ledger reserves on it as on any node.  Jobs only
# run where a slurmd is (n1..n<nodes>, the default partition); a job sent to
# the scale partition pends (its nodes never become available).
SCALE_PARTITION = "scale"
SCALE_PREFIX = "s"
# Resident memory per node, from bench/bench_scale.py (docs/performance-scale.md
# gives the runs and the command): slurmctld's, per node record with a ledger
# share; the Kubernetes control plane's (etcd, kube-apiserver, kcm,
# kube-scheduler, kwok), per kwok node without pods.  check_memory refuses a
# cluster that would not fit before anything starts, instead of the machine
# swapping or the OOM killer stopping a daemon midway.
SLURMCTLD_BYTES_PER_NODE = 4436
KUBE_BYTES_PER_NODE = 285 << 10
MEMORY_HEADROOM = 0.75          # never plan past this share of MemAvailable


def scale_names(count: int) -> list[str]:
    return [f"{SCALE_PREFIX}{i}" for i in range(1, count + 1)]


def scale_port(base_port: int, nodes: int) -> int:
    """The one port every scale node is declared on (no daemon listens there)."""
    return service_ports(base_port, nodes)["slurmrestd"] + 1


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ClusterError("no MemAvailable in /proc/meminfo")


def check_memory(count: int, bytes_per_node: int, available: int, what: str) -> None:
    """ClusterError, before anything starts, if `count` nodes at the
    measured `bytes_per_node` would take more than MEMORY_HEADROOM of the
    `available` memory."""
    need = count * bytes_per_node
    if need > available * MEMORY_HEADROOM:
        fits = int(available * MEMORY_HEADROOM // bytes_per_node)
        raise ClusterError(
            f"{count} nodes need ~{need / 2**30:.1f} GiB for {what} at the measured "
            f"{bytes_per_node / 2**10:.1f} KiB per node, more than {MEMORY_HEADROOM:.0%} of the "
            f"{available / 2**30:.1f} GiB available: at most {fits} nodes fit on this machine")


def scale_node_lines(count: int, base_port: int, nodes: int, cpus: int, memory: int,
                     node_features: bool, layout: str = "") -> str:
    """The scale nodes and their partition (slurm.conf lines)."""
    if count <= 0:
        return ""
    host = socket.gethostname()
    return (f"NodeName={SCALE_PREFIX}[1-{count}] NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port={scale_port(base_port, nodes)} CPUs={cpus}{layout} RealMemory={memory}"
            f"{_node_gres(0, node_features, cpus, memory)} State=UNKNOWN\n"
            f"PartitionName={SCALE_PARTITION} Nodes={SCALE_PREFIX}[1-{count}] MaxTime=INFINITE "
            f"State=UP\n")


def topology(cpus: int, sockets: int | None = None, cores_per_socket: int | None = None,
             threads_per_core: int | None = None) -> str:
    """The NodeName topology fields for `cpus` CPUs laid out as asked
    (e.g. 8 CPUs, 2 threads per core -> 1 socket x 4 cores x 2 threads);
    "" when no layout was asked (Slurm then assumes 1 thread per core)."""
    if sockets is None and cores_per_socket is None and threads_per_core is None:
        return ""
    sockets, threads = sockets or 1, threads_per_core or 1
    cores = cores_per_socket or cpus // (sockets * threads)
    if min(sockets, cores, threads) < 1 or sockets * cores * threads != cpus:
        raise ClusterError(f"--cpus {cpus} is not sockets x cores-per-socket x threads-per-core "
                           f"({sockets} x {cores} x {threads})")
    return f" Sockets={sockets} CoresPerSocket={cores} ThreadsPerCore={threads}"


NO_ACCOUNTING = "AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n"


def slurm_conf_text(work: str, *, nodes: int, cpus: int, memory: int, base_port: int,
                    node_features: bool, def_mem_per_cpu: int, plugin_dir: str,
                    extra: str = "", auth: str = "munge", slurm_user: str = "root",
                    layout: str = "", job_submit: bool = True,
                    partitions: str | None = None, accounting: str = "", gpus: int = 0,
                    sizes: list[tuple[int, int, str]] | None = None,
                    select_type_parameters: str = "CR_Core_Memory",
                    backup_controller: bool = False, scale_nodes: int = 0) -> str:
    """accounting: the AccountingStorage*/JobComp* lines (accounting.py);
    none by default.  gpus: GPUs per node (gres_conf_text gives their files).
    sizes: (CPUs, RealMemory, layout) of each node, for nodes of different
    sizes (else every node has cpus, memory and layout).  slurmd runs with
    SlurmdParameters=config_overrides: it reports these figures (not the
    host's), so one machine can look like SMT hardware or a mixed partition.
    backup_controller: two SlurmctldHost lines (controller_argv).
    scale_nodes: that many more nodes without slurmd (scale_node_lines);
    the default partition then holds n1..n<nodes> only.  nodes=0: no
    NodeName line (every node dynamic, e.g. Slurm inside Kubernetes)."""
    host = socket.gethostname()
    if sizes:  # one line per node
        node_lines = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_port} "
            f"CPUs={node_cpus}{node_layout} RealMemory={node_memory}"
            f"{_node_gres(gpus, node_features, node_cpus, node_memory)} State=UNKNOWN"
            for name, node_port, (node_cpus, node_memory, node_layout) in zip(
                node_names(nodes), range(base_port + 1, base_port + nodes + 1), sizes))
    elif not nodes:  # dynamic nodes only (slurmd -Z): none in slurm.conf
        node_lines = ""
    else:
        node_lines = (f"NodeName=n[1-{nodes}] NodeHostname={host} NodeAddr=127.0.0.1 "
                      f"Port=[{base_port + 1}-{base_port + nodes}] CPUs={cpus}{layout} "
                      f"RealMemory={memory}{_node_gres(gpus, node_features, cpus, memory)} "
                      f"State=UNKNOWN")
    features = "NodeFeaturesPlugins=node_features/k8s_resources\n" if node_features else ""
    submit = "JobSubmitPlugins=k8s_resource_completion\n" if job_submit else ""
    if partitions is None:
        members = f"n[1-{nodes}]" if scale_nodes else "ALL"
        partitions = f"PartitionName=debug Nodes={members} Default=YES MaxTime=INFINITE State=UP"
    scale = scale_node_lines(scale_nodes, base_port, nodes, cpus, memory, node_features, layout)
    return f"""# Generated by `pyk8sres cluster up`: a local test cluster.
ClusterName=pyk8sres
{controller_lines(host, backup_controller)}SlurmctldPort={base_port}
SlurmUser={slurm_user}
SlurmdUser=root
{auth_lines(work, auth)}StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/run/slurmctld.pid
SlurmdPidFile={work}/run/slurmd-%n.pid
SlurmctldLogFile={work}/log/slurmctld.log
SlurmdLogFile={work}/log/slurmd-%n.log
SlurmctldDebug=verbose
SlurmdDebug=info
PluginDir={work}/plugins:{plugin_dir}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{accounting or NO_ACCOUNTING}MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters={select_type_parameters}
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
MinJobAge=300
MaxJobCount=50000
DefMemPerCPU={def_mem_per_cpu}
# --- pyk8sres: share nodes with Kubernetes (see slurm-conf/) ---
GresTypes={"gpu," if gpus else ""}k8scpu,k8smemory
{submit}{features}{extra}
{node_lines}
{partitions}
{scale}"""


# With a backup controller: both controllers on this host, each in a UTS and
# mount namespace of its own, whose hostname (how slurmctld tells which
# SlurmctldHost it is) resolves to its own loopback address, where it
# listens (NoCtldInAddrAny): Slurm has one SlurmctldPort for all controllers.
CONTROLLERS = (("pyk8sres-ctl1", "127.0.0.1"), ("pyk8sres-ctl2", "127.0.0.2"))


def controller_lines(host: str, backup_controller: bool) -> str:
    if not backup_controller:
        return f"SlurmctldHost={host}(127.0.0.1)\n"
    # SlurmctldTimeout: how long the backup waits on a silent primary before it
    # takes over; short, so that failover tests end soon.
    return ("".join(f"SlurmctldHost={name}({addr})\n" for name, addr in CONTROLLERS) +
            "CommunicationParameters=NoCtldInAddrAny\nSlurmctldTimeout=6\n")


def _node_gres(gpus: int, node_features: bool, cpus: int, memory: int) -> str:
    """A node's Gres=: its GPUs, and its k8s capacity when no node_features
    plugin sets that."""
    node_gres = ([f"gpu:{gpus}"] if gpus else []) + \
        ([] if node_features else [f"k8scpu:{cpus}", f"k8smemory:{memory}"])
    return f" Gres={','.join(node_gres)}" if node_gres else ""


def auth_lines(work: str, auth: str) -> str:
    """munge: our own munged's socket.  slurm (auth/slurm, 23.11+): no daemon,
    a shared key etc/slurm.key next to slurm.conf."""
    if auth == "slurm":
        return "AuthType=auth/slurm\nCredType=cred/slurm\n"
    return f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={work}/munge/munge.sock\n"


GRES_CONF = """# pyk8sres: count-only GRES mirroring what Kubernetes leaves free.
Name=k8scpu Flags=CountOnly
Name=k8smemory Flags=CountOnly
"""


def gres_conf_text(work: str, gpus: int = 0) -> str:
    """gres.conf; with `gpus`, GPUs whose device files are character devices
    under WORK/dev (gpu_device_paths; workdir.write_node_files makes them),
    so GPU jobs, their IDX and the DefCpuPerGPU/DefMemPerGPU defaults can be
    tested without GPUs.  The line names no node: every slurmd of the test
    cluster runs on this machine and sees the same files, and Slurm only
    needs the paths to differ within a node.  AutoDetect=off (the global
    line: on a Name= line it would need a NodeName=): the files are the
    whole truth, a Slurm built with NVML would otherwise look for real GPUs."""
    if not gpus:
        return GRES_CONF
    return GRES_CONF + f"AutoDetect=off\nName=gpu File={work}/dev/gpu[0-{gpus - 1}]\n"


def gpu_device_paths(work: str, gpus: int) -> list[str]:
    """The device file of each GPU, by Slurm's index (IDX) order."""
    return [f"{work}/dev/gpu{i}" for i in range(gpus)]
