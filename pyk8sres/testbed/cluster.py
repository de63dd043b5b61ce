"""`pyk8sres cluster up/down`: a real local Slurm cluster on this host.

munged, slurmctld and N slurmd (multiple-slurmd: one host, one port per
node) run as root in the foreground under WORKDIR, on loopback ports of
their own, with our plugins installed into WORKDIR/plugins.  Every process
we start is recorded in WORKDIR/run/*.pid and stopped by that PID.

`slurm=` picks the Slurm: the installed one, or a release built from
Debian's source (releases.py, tools/slurm-build.sh), e.g. "24.11"; its
commands come first on the cluster's PATH (Cluster.env).

This module starts and stops the daemons; slurm_conf.py writes the
configuration they read (slurm.conf, gres.conf, ports, node lines) and
workdir.py prepares WORKDIR.  Imports run one way: cluster.py imports
accounting.py and rest.py, which take a cluster handle as an argument
(daemons.SlurmHandle) and import neither this module nor each other.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import time

from .. import install
from . import accounting, releases, rest, workdir
# ClusterError, alive, start_process and stop_process are also this module's
# API (hybrid.py, benchmarks, tests).
from .daemons import (ClusterError, alive, log_tail, need as _need,  # noqa: F401
                      pid_path as _pid_path, running, start_process, stop_process,
                      wait_until, write_file)
from .releases import SLURM_PLUGIN_DIRS  # noqa: F401  (tests look for Slurm's plugins)
from .slurm_conf import (CONTROLLERS, SLURMCTLD_BYTES_PER_NODE, available_memory,
                         check_memory, node_names, port_free, scale_port, service_ports,
                         slurm_conf_text, topology)
# The configuration's names that cli.py, tests and benchmarks reach through
# this module, the one they import to run a cluster.
from .slurm_conf import (GRES_CONF, MEMORY_HEADROOM, SCALE_PARTITION,  # noqa: F401
                         SCALE_PREFIX, scale_names)


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
            # holds pings until the backup has let go, longer than
            # this timeout: no answer yet, not an error.
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
    gpus: that many (fake) GPUs per node (slurm_conf.gres_conf_text).
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
    (see slurm_conf.scale_node_lines: they stay UNKNOWN, the ledger works on them,
    jobs run on n1..n<nodes>); refused before anything starts when they
    would not fit in memory (check_memory)."""
    layout, sizes = _checked_nodes(nodes, cpus, sockets, cores_per_socket, threads_per_core,
                                   node_sizes, gpus, scale_nodes)
    release, auth = _checked_release_and_auth(slurm, auth, accounting, rest)
    cluster = _new_cluster(work, release)
    services = service_ports(base_port, nodes)
    _check_ports_free(base_port, nodes, services, slurmd=slurmd, with_accounting=accounting,
                      with_rest=rest, scale_nodes=scale_nodes)
    if node_features is None:
        node_features = os.path.exists(os.path.join(plugin_lib or release.lib_dir, install.PLUGINS[1]))
    work = cluster.work
    workdir.make_dirs(work, nodes, slurmd=slurmd, backup_controller=backup_controller)
    workdir.write_key(os.path.join(work, "munge", "munge.key"), 0o400)
    acct = _new_accounting(work, services) if accounting else None
    jwt_key = _write_jwt_key(work, slurm_user, acct) if rest else None
    workdir.install_plugins(work, release, plugin_lib)
    write_file(cluster.conf, slurm_conf_text(
        work, nodes=nodes, cpus=cpus, memory=memory, base_port=base_port,
        node_features=node_features, def_mem_per_cpu=def_mem_per_cpu,
        plugin_dir=release.plugin_dir, extra=extra_conf + _jwt_conf_lines(jwt_key), auth=auth,
        slurm_user=slurm_user, layout=layout, job_submit=job_submit, partitions=partitions,
        gpus=gpus, sizes=sizes, select_type_parameters=select_type_parameters,
        backup_controller=backup_controller, scale_nodes=scale_nodes,
        accounting=_accounting_conf_lines(acct, auth)))
    if auth == "slurm":
        workdir.write_key(os.path.join(work, "etc", "slurm.key"), 0o600)
    workdir.write_node_files(work, gpus, k8s_conf)
    if slurm_user != "root":
        workdir.hand_to(work, slurm_user)
    _start_or_clean_up(cluster, acct, services, auth=auth, nodes=nodes, slurmd=slurmd,
                       backup_controller=backup_controller, jwt_key=jwt_key, with_rest=rest,
                       with_accounting=accounting)
    return cluster


def _checked_nodes(nodes, cpus, sockets, cores_per_socket, threads_per_core, node_sizes, gpus,
                   scale_nodes):
    """The CPU layout of every node (and of each node of `node_sizes`), or a
    ClusterError before anything is written; scale nodes only where they
    fit in memory."""
    if scale_nodes < 0:
        raise ClusterError(f"--scale-nodes {scale_nodes}: 0 or more")
    if scale_nodes:
        check_memory(scale_nodes, SLURMCTLD_BYTES_PER_NODE, available_memory(), "slurmctld")
    layout = topology(cpus, sockets, cores_per_socket, threads_per_core)
    if node_sizes is not None and len(node_sizes) != nodes:
        raise ClusterError(f"{len(node_sizes)} node sizes for {nodes} nodes")
    sizes = [(n, m, topology(n, sockets, cores_per_socket, threads_per_core))
             for n, m in node_sizes] if node_sizes else None
    if gpus < 0:
        raise ClusterError(f"--gpus {gpus}: a node has 0 or more GPUs")
    return layout, sizes


def _checked_release_and_auth(slurm: str | None, auth: str, with_accounting: bool,
                              with_rest: bool) -> tuple[releases.Release, str]:
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
    if with_accounting:
        if auth == "slurm":
            raise ClusterError("--accounting runs slurmdbd as slurm, which cannot read this "
                               "cluster's auth/slurm key: use munge (apt-get install munge)")
        accounting.Accounting.check_installed(release)
    if with_rest:
        rest.check_installed(release)
    return release, auth


def _new_cluster(work: str, release: releases.Release) -> Cluster:
    """A handle on `work`, refused while daemons of an earlier cluster run there."""
    cluster = Cluster(work, release)
    if cluster.names():
        raise ClusterError(f"{cluster.work} already runs {', '.join(cluster.names())}: "
                           "`pyk8sres cluster down` first")
    return cluster


def _check_ports_free(base_port: int, nodes: int, services: dict[str, int], *, slurmd: bool,
                      with_accounting: bool, with_rest: bool,
                      scale_nodes: int = 0) -> None:
    """slurmctld's port, one per slurmd, and the optional services' ports."""
    ports = list(range(base_port, base_port + (nodes + 1 if slurmd else 1)))
    ports += [services[s] for s, on in (("slurmdbd", with_accounting),
                                        ("mariadb", with_accounting),
                                        ("slurmrestd", with_rest)) if on]
    if scale_nodes:  # nobody may listen there: slurmctld's pings must be refused
        ports.append(scale_port(base_port, nodes))
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise ClusterError(f"port(s) {', '.join(map(str, taken))} already in use: "
                           "choose another --base-port")


def _new_accounting(work: str, services: dict[str, int]) -> accounting.Accounting:
    return accounting.Accounting(work, services["slurmdbd"], services["mariadb"])


def _accounting_conf_lines(acct: accounting.Accounting | None, auth: str) -> str:
    """slurm.conf's accounting lines: slurmdbd's with accounting, else none
    (slurm_conf_text then writes accounting_storage/none)."""
    return accounting.slurm_conf_lines(acct.work, acct.dbd_port, auth) if acct else ""


def _write_jwt_key(work: str, slurm_user: str, acct: accounting.Accounting | None) -> str:
    """slurmrestd's JWT key; returns its path."""
    # With accounting slurmdbd (as its SlurmUser) reads the key too;
    # a root slurmctld reads it whoever owns it.
    key_owner = accounting.DBD_USER if acct and slurm_user == "root" else slurm_user
    return rest.write_jwt_key(work, key_owner)


def _jwt_conf_lines(jwt_key: str | None) -> str:
    return rest.slurm_conf_lines(jwt_key) if jwt_key else ""


def _start_or_clean_up(cluster: Cluster, acct: accounting.Accounting | None,
                       services: dict[str, int], *, auth: str, nodes: int, slurmd: bool,
                       backup_controller: bool, jwt_key: str | None, with_rest: bool,
                       with_accounting: bool) -> None:
    """Every daemon (_start_daemons), then slurmrestd; if any fails to start,
    everything started so far is stopped (down) before the error goes on."""
    try:
        _start_daemons(cluster, acct, auth=auth, nodes=nodes, slurmd=slurmd,
                       backup_controller=backup_controller, jwt_key=jwt_key)
        if with_rest:
            cluster.rest_url = rest.start(cluster, services["slurmrestd"], with_accounting)
    except BaseException:
        down(cluster.work)
        raise


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
