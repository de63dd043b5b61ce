"""`pyk8sres cluster up/down`: a real local Slurm cluster on this host.

munged, slurmctld and N slurmd (multiple-slurmd: one host, one port per
node) run as root in the foreground under WORKDIR, on loopback ports of
their own, with our plugins installed into WORKDIR/plugins.  Every process
we start is recorded in WORKDIR/run/*.pid and stopped by that PID.

`slurm=` picks the Slurm: the installed one, or a release built from
Debian's source (releases.py, tools/slurm-build.sh), e.g. "24.11"; its
commands come first on the cluster's PATH (Cluster.env).
"""
from __future__ import annotations

import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time

from .. import install
from . import accounting as accounting_mod, releases, rest as rest_mod
# Shared with accounting.py and rest.py; ClusterError, alive, start_process and
# stop_process are also this module's API (cli.py, hybrid.py, kubernetes.py, tests).
from .daemons import (ClusterError, alive, log_tail, need as _need,  # noqa: F401
                      pid_path as _pid_path, running, start_process, stop_process,
                      wait_until, write_file)
from .releases import SLURM_PLUGIN_DIRS  # noqa: F401  (tests look for Slurm's plugins)


def slurm_plugin_dir() -> str:
    """The installed Slurm's PluginDir."""
    try:
        return releases.installed_plugin_dir()
    except releases.ReleaseError as e:
        raise ClusterError(str(e)) from None


def release_of(slurm: str | None) -> releases.Release:
    try:
        return releases.get(slurm)
    except releases.ReleaseError as e:
        raise ClusterError(str(e)) from None


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
# Measured resident memory per node (bench/bench_scale.py, Debian 12, Slurm
# 22.05.8, docs/performance-scale.md): slurmctld, 10 -> 10,000 node records
# with a ledger share each (20.3 -> 62.6 MB); the Kubernetes control plane
# (etcd, kube-apiserver, kcm, kube-scheduler, kwok), 10 -> 3,000 kwok nodes
# without pods (593 -> 1,425 MB).
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
    the default partition then holds n1..n<nodes> only."""
    host = socket.gethostname()
    if sizes:  # one line per node
        node_lines = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_port} "
            f"CPUs={node_cpus}{node_layout} RealMemory={node_memory}"
            f"{_node_gres(gpus, node_features, node_cpus, node_memory)} State=UNKNOWN"
            for name, node_port, (node_cpus, node_memory, node_layout) in zip(
                node_names(nodes), range(base_port + 1, base_port + nodes + 1), sizes))
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
    # SlurmctldTimeout: the backup takes over 6-10 s after the primary dies.
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
    """gres.conf; with `gpus`, GPUs whose device files are empty files under
    WORK/dev (slurmd only checks that they exist), so GPU jobs and the
    DefCpuPerGPU/DefMemPerGPU defaults can be tested without GPUs."""
    if not gpus:
        return GRES_CONF
    return GRES_CONF + f"Name=gpu File={work}/dev/gpu[0-{gpus - 1}]\n"


class Cluster:
    """Handle on a local cluster living in `work`."""

    def __init__(self, work: str, release: releases.Release | None = None):
        self.work = os.path.abspath(work)
        self.conf = os.path.join(self.work, "etc", "slurm.conf")
        self.release = release or self._recorded_release()
        self.rest_url: str | None = None     # set by up(rest=True)

    def _recorded_release(self) -> releases.Release:
        """The release `up` wrote to etc/release (so down() and later
        handles run the same Slurm's commands)."""
        try:
            with open(os.path.join(self.work, "etc", "release"), encoding="utf-8") as f:
                name, bins = (f.read().splitlines() + ["", ""])[:2]
        except OSError:
            return releases.Release(releases.INSTALLED)
        return releases.Release(name or releases.INSTALLED,
                                tuple(b for b in bins.split(os.pathsep) if b))

    @property
    def env(self) -> dict:
        return dict(os.environ, SLURM_CONF=self.conf, PATH=self.release.path_env())

    def rewrite_conf(self, text: str) -> None:
        """Replace slurm.conf whole: a daemon re-reading it mid-write (slurmd on
        a reconfigure) would see it empty and stop."""
        tmp = self.conf + ".new"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        st = os.stat(self.conf)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, self.conf)

    def names(self) -> list[str]:
        return sorted(os.path.basename(p)[5:-4]
                      for p in glob.glob(os.path.join(self.work, "run", "proc-*.pid")))

    # --- daemons ---------------------------------------------------------
    def start_munged(self) -> None:
        munge_dir = os.path.join(self.work, "munge")
        start_process(self.work, "munged", [
            _need("munged", "munge"), "-F", "--force",
            f"--socket={munge_dir}/munge.sock", f"--key-file={munge_dir}/munge.key",
            f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
            f"--seed-file={munge_dir}/munged.seed"])
        self._wait(lambda: os.path.exists(f"{munge_dir}/munge.sock"), "munged socket", 10)

    def has_backup(self) -> bool:
        """Was the cluster made with a backup controller (up(backup_controller=True))?"""
        try:
            with open(self.conf, encoding="utf-8") as f:
                return f"SlurmctldHost={CONTROLLERS[1][0]}(" in f.read()
        except OSError:
            return False

    def controller_argv(self, backup: bool = False) -> list[str]:
        """slurmctld's command line; with a backup controller, inside its own
        UTS and mount namespaces: its hostname is its SlurmctldHost name,
        /etc/hosts resolves it to its address, and the backup's pid and log
        files are its own (WORK/backup/{run,log} over WORK/run and WORK/log),
        as on a host of its own."""
        argv = [_need("slurmctld", "slurmctld", self.release), "-D", "-i", "-f", self.conf]
        if not self.has_backup():
            return argv
        name = CONTROLLERS[1 if backup else 0][0]
        script = f"mount --bind {self.work}/etc/hosts /etc/hosts && hostname {name}"
        if backup:
            script += "".join(f" && mount --bind {self.work}/backup/{d} {self.work}/{d}"
                              for d in ("run", "log"))
        return [_need("unshare", "util-linux"), "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script + ' && exec "$@"', "slurmctld", *argv]

    def start_slurmctld(self, backup: bool = False, wait: bool = True) -> None:
        """Start the (primary, or with backup=True the backup) slurmctld and
        (wait=True) wait until it answers pings."""
        name = "slurmctld-backup" if backup else "slurmctld"
        start_process(self.work, name, self.controller_argv(backup), env=self.env)
        if wait:
            self.wait_slurmctld(backup)

    def wait_slurmctld(self, backup: bool = False, timeout: float = 60) -> None:
        """Until that slurmctld answers pings (ClusterError if it exits)."""
        name = "slurmctld-backup" if backup else "slurmctld"
        log = "backup/log/slurmctld.log" if backup else "log/slurmctld.log"
        self._wait(lambda: self._ctld_up(name), f"{name} to answer (see {log})", timeout)

    def pid(self, name: str) -> int | None:
        """The PID of a daemon we started (e.g. "slurmctld"), if it runs."""
        try:
            pid = int(open(_pid_path(self.work, name)).read())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    def ping(self) -> dict[str, str]:
        """`scontrol ping`: each controller's state, {"primary": "UP", "backup": "DOWN"}."""
        try:
            proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                                  env=self.env, timeout=15)
        except subprocess.TimeoutExpired:
            # 24.11: a primary starting while its backup is in control
            # holds pings until the backup has let go (seen: ~30 s).
            return {}
        return {m.group(1).lower(): m.group(2) for m in
                re.finditer(r"Slurmctld\((\w+)\) at \S+ is (\w+)", proc.stdout)}

    def start_slurmd(self, node: str, dynamic_conf: str | None = None) -> None:
        argv = [_need("slurmd", "slurmd", self.release), "-D", "-N", node, "-f", self.conf]
        if dynamic_conf is not None:
            argv += ["-Z", "--conf", dynamic_conf]
        start_process(self.work, f"slurmd-{node}", argv, env=self.env)

    def stop(self, name: str) -> bool:
        return stop_process(self.work, name)

    def cancel_all_jobs(self, timeout: float = 30) -> None:
        """scancel every job and wait until none is left running."""
        def jobs() -> list[str]:
            out = subprocess.run(["squeue", "-h", "-o", "%A %t"], capture_output=True,
                                 text=True, env=self.env, timeout=15).stdout
            return [line.split()[0] for line in out.splitlines()
                    if line.split()[1:] and line.split()[1] not in ("CD", "F", "CA")]
        try:
            ids = jobs()
            if ids:
                subprocess.run(["scancel", *ids], capture_output=True, env=self.env, timeout=30)
                self._wait(lambda: not jobs(), "cancelled jobs to end", timeout)
        except (ClusterError, OSError, subprocess.SubprocessError):
            pass  # down() still finds and kills what is left, by PID

    def restart_slurmctld(self) -> None:
        self.stop("slurmctld")
        self.start_slurmctld()

    def _ctld_up(self, name: str = "slurmctld") -> bool:
        if not self._running(name):
            log = "../backup/log/slurmctld.log" if name == "slurmctld-backup" else "slurmctld.log"
            raise ClusterError(f"{name} exited: " + self.log_tail(log))
        return self.ping().get("backup" if name == "slurmctld-backup" else "primary") == "UP"

    def _running(self, name: str) -> bool:
        return running(self.work, name)

    def _wait(self, ready, what: str, timeout: float) -> None:
        wait_until(ready, what, timeout)

    def log_tail(self, name: str, lines: int = 20) -> str:
        return log_tail(self.work, name, lines)

    def wait_nodes_idle(self, nodes: list[str], timeout: float = 60) -> None:
        def ready():
            # Only these nodes: with thousands of scale nodes a full listing is slow.
            try:
                out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"],
                                     capture_output=True, text=True, env=self.env,
                                     timeout=15).stdout
            except subprocess.TimeoutExpired:   # a loaded machine: ask again until the timeout
                return False
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in nodes)
        self._wait(ready, f"nodes {','.join(nodes)} to be idle", timeout)


# Every directory `up` makes, with its mode (munge's key stays private).
DIR_MODES = {"etc": 0o755, "munge": 0o700, "state": 0o755, "run": 0o755, "log": 0o755,
             "plugins": 0o755, "spool": 0o755}


def _mkdir(path: str, mode: int) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def _hand_to(work: str, user: str) -> None:
    """What a non-root slurmctld writes becomes that user's (state, logs,
    pid files); the munge socket's directory becomes traversable (the key
    stays root's, 0400).  Everything else stays root's and read-only."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ClusterError(f"SlurmUser {user} does not exist (Debian's slurm packages "
                           "create `slurm`)") from None
    for sub in ("state", "log", "run", "backup/log", "backup/run"):
        if os.path.isdir(os.path.join(work, sub)):
            os.chown(os.path.join(work, sub), pw.pw_uid, pw.pw_gid)
    os.chmod(os.path.join(work, "munge"), 0o711)
    blocked = install.unreadable_by_others(os.path.join(work, "etc", "slurm.conf"))
    if blocked:
        raise ClusterError(f"{blocked} cannot be entered by {user}: use a work directory "
                           "others can traverse")


def up(work: str, *, nodes: int = 2, cpus: int = 4, memory: int = 8000, base_port: int = 17000,
       node_features: bool | None = None, def_mem_per_cpu: int = 100, extra_conf: str = "",
       k8s_conf: str = "", synced: bool = False, slurmd: bool = True,
       slurm: str | None = None, auth: str = "auto", slurm_user: str = "root",
       plugin_lib: str | None = None,
       sockets: int | None = None, cores_per_socket: int | None = None,
       threads_per_core: int | None = None, job_submit: bool = True,
       partitions: str | None = None, accounting: bool = False,
       rest: bool = False, gpus: int = 0,
       node_sizes: list[tuple[int, int]] | None = None,
       select_type_parameters: str = "CR_Core_Memory",
       backup_controller: bool = False, scale_nodes: int = 0) -> Cluster:
    """Write the configuration, start every daemon, wait until nodes are idle.

    slurmd=False starts only munged and slurmctld: nodes then exist in
    slurm.conf alone (enough for GRES updates; benchmarks use thousands).
    slurm: "installed" (default) or a built release such as "24.11"
    (releases.get).  auth: "munge", "slurm" (auth/slurm, no munged; the
    release must have it) or "auto" (munge if munged is installed, else
    auth/slurm where the release has it).
    slurm_user: SlurmUser, as real sites run slurmctld (Debian: `slurm`);
    slurmctld then owns only its state, log and pid files, and everything it
    loads (plugin_lib: a pyk8sres build that user can read; default the
    release's) must be readable by it.  slurmd and munged stay root.
    sockets/cores_per_socket/threads_per_core lay the `cpus` out like real
    (e.g. SMT) hardware; job_submit=False leaves our job_submit plugin out
    (plain Slurm, for comparisons); `partitions` replaces the one default
    partition line.
    accounting: also a private MariaDB and slurmdbd (accounting.py), with
    the k8s GRES as accounted TRES; rest: slurmrestd with JWT (rest.py);
    gpus: that many (fake) GPUs per node (gres_conf_text).
    node_sizes: (CPUs, RealMemory) of each node, for a partition of nodes
    of different sizes (cpus and memory are then unused; the layout's
    sockets and threads per core hold on every node).
    select_type_parameters: slurm.conf's SelectTypeParameters (e.g.
    CR_Socket_Memory: whole sockets).
    backup_controller: a second slurmctld as BackupController (two
    SlurmctldHost lines, the same StateSaveLocation): the primary on
    127.0.0.1, the backup on 127.0.0.2, both on the base port
    (Cluster.controller_argv); it takes over within SlurmctldTimeout=6.
    Their ports follow the slurmd ones (service_ports).
    scale_nodes: N more nodes s1..sN without slurmd, in partition "scale"
    (see scale_node_lines: they stay UNKNOWN, the ledger works on them,
    jobs run on n1..n<nodes>); refused before anything starts when they
    would not fit in memory (check_memory)."""
    if scale_nodes < 0:
        raise ClusterError(f"--scale-nodes {scale_nodes}: 0 or more")
    if scale_nodes:
        check_memory(scale_nodes, SLURMCTLD_BYTES_PER_NODE, available_memory(), "slurmctld")
    layout, sizes = _checked_layout(cpus, sockets, cores_per_socket, threads_per_core,
                                    nodes, node_sizes, gpus)
    release, auth = _checked_release_and_auth(slurm, auth, accounting, rest)
    cluster = Cluster(work, release)
    if cluster.names():
        raise ClusterError(f"{cluster.work} already runs {', '.join(cluster.names())}: "
                           "`pyk8sres cluster down` first")
    services = service_ports(base_port, nodes)
    _check_ports_free(base_port, nodes, services, slurmd=slurmd, accounting=accounting, rest=rest,
                      scale_nodes=scale_nodes)
    if node_features is None:
        node_features = os.path.exists(os.path.join(plugin_lib or release.lib_dir, install.PLUGINS[1]))
    work = cluster.work
    _make_work_dirs(work, nodes, slurmd=slurmd, backup_controller=backup_controller)
    _write_key(os.path.join(work, "munge", "munge.key"), 0o400)
    acct = accounting_mod.Accounting(work, services["slurmdbd"], services["mariadb"]) \
        if accounting else None
    jwt_key = None
    if rest:
        # With accounting slurmdbd (as its SlurmUser) reads the key too;
        # a root slurmctld reads it whoever owns it.
        key_owner = accounting_mod.DBD_USER if acct and slurm_user == "root" else slurm_user
        jwt_key = rest_mod.write_jwt_key(work, key_owner)
        extra_conf += rest_mod.slurm_conf_lines(jwt_key)
    _install_plugins(work, release, plugin_lib)
    write_file(cluster.conf, slurm_conf_text(work, nodes=nodes, cpus=cpus, memory=memory,
                                             base_port=base_port, node_features=node_features,
                                             def_mem_per_cpu=def_mem_per_cpu,
                                             plugin_dir=release.plugin_dir, extra=extra_conf,
                                             auth=auth, slurm_user=slurm_user, layout=layout,
                                             job_submit=job_submit, partitions=partitions,
                                             gpus=gpus, sizes=sizes,
                                             select_type_parameters=select_type_parameters,
                                             backup_controller=backup_controller,
                                             scale_nodes=scale_nodes,
                                             accounting=accounting_mod.slurm_conf_lines(
                                                 work, services["slurmdbd"], auth) if acct else ""))
    if auth == "slurm":
        _write_key(os.path.join(work, "etc", "slurm.key"), 0o600)
    _write_node_files(work, gpus, k8s_conf)
    if slurm_user != "root":
        _hand_to(work, slurm_user)
    try:
        _start_daemons(cluster, acct, auth=auth, nodes=nodes, slurmd=slurmd,
                       backup_controller=backup_controller, jwt_key=jwt_key)
        if rest:
            cluster.rest_url = rest_mod.start(cluster, services["slurmrestd"], accounting)
    except BaseException:
        down(work)
        raise
    return cluster


def _checked_layout(cpus, sockets, cores_per_socket, threads_per_core, nodes, node_sizes, gpus):
    """The CPU layout of every node (and of each node of `node_sizes`), or a
    ClusterError before anything is written."""
    layout = topology(cpus, sockets, cores_per_socket, threads_per_core)
    if node_sizes is not None and len(node_sizes) != nodes:
        raise ClusterError(f"{len(node_sizes)} node sizes for {nodes} nodes")
    sizes = [(n, m, topology(n, sockets, cores_per_socket, threads_per_core))
             for n, m in node_sizes] if node_sizes else None
    if gpus < 0:
        raise ClusterError(f"--gpus {gpus}: a node has 0 or more GPUs")
    return layout, sizes


def _checked_release_and_auth(slurm: str | None, auth: str, accounting: bool,
                              rest: bool) -> tuple[releases.Release, str]:
    """The Slurm release and auth plugin to run, once every binary they need
    is known to be installed (a ClusterError naming the package if not)."""
    if os.geteuid() != 0:
        raise ClusterError("the local cluster runs its daemons as root: run as root")
    release = release_of(slurm)
    if auth == "auto":
        auth = "munge" if shutil.which("munged") or os.path.exists("/usr/sbin/munged") else "slurm"
    if auth == "slurm" and not release.has_plugin("auth_slurm"):
        raise ClusterError(f"Slurm {release.name} has no auth/slurm (23.11+): "
                           "apt-get install munge, or use a newer release")
    if auth not in ("munge", "slurm"):
        raise ClusterError(f"unknown auth {auth!r}: munge, slurm or auto")
    if auth == "munge":
        _need("munged", "munge")
    for binary, package in (("slurmctld", "slurmctld"), ("slurmd", "slurmd"),
                            ("scontrol", "slurm-client")):
        _need(binary, package, release)
    if accounting:
        if auth == "slurm":
            raise ClusterError("--accounting runs slurmdbd as slurm, which cannot read this "
                               "cluster's auth/slurm key: use munge (apt-get install munge)")
        accounting_mod.Accounting.check_installed(release)
    if rest:
        rest_mod.check_installed(release)
    return release, auth


def _check_ports_free(base_port: int, nodes: int, services: dict[str, int], *, slurmd: bool,
                      accounting: bool, rest: bool, scale_nodes: int = 0) -> None:
    """slurmctld's port, one per slurmd, and the optional services' ports."""
    ports = list(range(base_port, base_port + (nodes + 1 if slurmd else 1)))
    ports += [services[s] for s, on in (("slurmdbd", accounting), ("mariadb", accounting),
                                        ("slurmrestd", rest)) if on]
    if scale_nodes:  # nobody may listen there: slurmctld's pings must be refused
        ports.append(scale_port(base_port, nodes))
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise ClusterError(f"port(s) {', '.join(map(str, taken))} already in use: "
                           "choose another --base-port")


def _make_work_dirs(work: str, nodes: int, *, slurmd: bool, backup_controller: bool) -> None:
    # Explicit modes whatever the caller's umask: root's slurmctld loads the
    # .so files under plugins/, so no other user may write anywhere here.
    _mkdir(work, 0o755)
    for sub, mode in DIR_MODES.items():
        _mkdir(os.path.join(work, sub), mode)
    for node in node_names(nodes) if slurmd else ():
        _mkdir(os.path.join(work, "spool", node), 0o755)
    if backup_controller:
        _need("unshare", "util-linux")
        for sub in ("backup", "backup/run", "backup/log"):
            _mkdir(os.path.join(work, sub), 0o755)
        with open("/etc/hosts", encoding="utf-8") as f:
            hosts = f.read()
        write_file(os.path.join(work, "etc", "hosts"),
                   "".join(f"{addr} {name}\n" for name, addr in CONTROLLERS) + hosts)


def _write_key(path: str, mode: int) -> None:
    """A new random 1024-byte key (munge's, auth/slurm's); an existing one is kept."""
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))


def _install_plugins(work: str, release: releases.Release, plugin_lib: str | None) -> None:
    """Our plugins into WORK/plugins, built for `release`; etc/release records
    which release the cluster runs (Cluster reads it back)."""
    write_file(os.path.join(work, "etc", "release"),
               f"{release.name}\n{os.pathsep.join(release.bin_dirs)}\n")
    install.install_plugins(os.path.join(work, "plugins"), lib_dir=plugin_lib or release.lib_dir,
                            slurm_version=None if release.name == releases.INSTALLED else release.name)


def _write_node_files(work: str, gpus: int, k8s_conf: str) -> None:
    """gres.conf, the fake GPU device files it names, and k8s_resources.conf."""
    write_file(os.path.join(work, "etc", "gres.conf"), gres_conf_text(work, gpus))
    if gpus:
        _mkdir(os.path.join(work, "dev"), 0o755)
        for i in range(gpus):
            write_file(os.path.join(work, "dev", f"gpu{i}"), "")
    write_file(os.path.join(work, "etc", "k8s_resources.conf"),
               "# pyk8sres (slurm-conf/k8s_resources.conf); the ledger lives in state/\n"
               + k8s_conf)


def _start_daemons(cluster: Cluster, acct, *, auth: str, nodes: int, slurmd: bool,
                   backup_controller: bool, jwt_key: str | None) -> None:
    """munged, then accounting (MariaDB, slurmdbd), slurmctld (and its backup),
    then the slurmd of every node, waiting until the nodes are idle."""
    if acct:
        acct.prepare(auth, jwt_key)
    if auth == "munge":
        cluster.start_munged()
    if acct:
        acct.start_mariadb()
        acct.start_slurmdbd(cluster)
        acct.register_cluster(cluster)
    cluster.start_slurmctld()
    if backup_controller:
        cluster.start_slurmctld(backup=True)
    if slurmd:
        for node in node_names(nodes):
            cluster.start_slurmd(node)
        cluster.wait_nodes_idle(node_names(nodes))


def down(work: str) -> list[str]:
    """Stop everything of the cluster under `work`, by PID: first the jobs
    (cancelled while slurmctld and slurmd still run, so their steps end
    cleanly), then slurmd, slurmctld, munged; then any step daemon or job
    process left behind.  Raises ClusterError if a process survives."""
    cluster = Cluster(work)
    names = cluster.names()
    if "slurmctld" in names and cluster._running("slurmctld"):
        cluster.cancel_all_jobs()
    # Clients first, then slurmctld, then what it talks to (slurmdbd, then
    # its database), munged last.
    # The backup first, or it takes over when the primary stops.
    last = ("slurmctld-backup", "slurmctld", "slurmdbd", "mariadb", "munged")
    order = sorted(names, key=lambda n: (last.index(n) + 1 if n in last else 0, n))
    stopped = [name for name in order if stop_process(cluster.work, name)]
    leftovers = cluster_processes(cluster.work)
    for pid in leftovers:
        _kill(pid)
    deadline = time.monotonic() + 10
    while (left := cluster_processes(cluster.work)) and time.monotonic() < deadline:
        for pid in left:
            _kill(pid)
        time.sleep(0.1)
    if left:
        raise ClusterError(f"processes of {cluster.work} survived SIGKILL: {left}")
    if leftovers:
        stopped.append(f"{len(leftovers)} leftover job process(es)")
    return stopped


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, os.WNOHANG)
    except (ProcessLookupError, ChildProcessError):
        pass


def unix_sockets_under(root: str) -> dict[str, str]:
    """Path -> inode of the unix sockets bound to a path under `root` and
    listening now (/proc/net/unix: a file left behind does not count)."""
    bound = {}
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7].startswith(root + "/"):
                    bound[fields[7]] = fields[6]
    except OSError:
        pass
    return bound


def cluster_processes(work: str) -> list[int]:
    """PIDs still belonging to the cluster under `work`: any process whose
    command line names the work directory (our daemons), any slurmstepd that
    holds a socket in the cluster's spool, and all their descendants (the
    jobs' own processes)."""
    root = os.path.abspath(work)
    sockets = {f"socket:[{inode}]" for inode in unix_sockets_under(root).values()}
    parents, roots = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(") ", 1)[1].split()
            if stat[0] == "Z":
                continue
            parents[pid] = int(stat[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            if root + "/" in cmdline.replace("\0", " ") + " ":
                roots.add(pid)
            elif sockets and "slurmstepd" in cmdline:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                        roots.add(pid)
                        break
        except (OSError, IndexError, ValueError):
            continue
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    return sorted(found)
