"""The local test cluster's work directory, made ready before any daemon
starts: its directories with explicit modes, keys, our plugins, gres.conf
and k8s_resources.conf, and (for a SlurmUser other than root) what
slurmctld writes handed to that user.
"""
from __future__ import annotations

import os
import pwd
import secrets
import stat

from .. import install
from . import releases
from .daemons import ClusterError, need, write_file
from .slurm_conf import CONTROLLERS, gpu_device_paths, gres_conf_text, node_names

# Every directory `up` makes, with its mode (munge's key stays private).
DIR_MODES = {"etc": 0o755, "munge": 0o700, "state": 0o755, "run": 0o755, "log": 0o755,
             "plugins": 0o755, "spool": 0o755}


def _mkdir(path: str, mode: int) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def make_dirs(work: str, nodes: int, *, slurmd: bool, backup_controller: bool) -> None:
    """WORK and its DIR_MODES, a spool per slurmd, and with a backup
    controller its own run/log and the /etc/hosts naming both controllers."""
    # Explicit modes whatever the caller's umask: root's slurmctld loads the
    # .so files under plugins/, so no other user may write anywhere here.
    _mkdir(work, 0o755)
    for sub, mode in DIR_MODES.items():
        _mkdir(os.path.join(work, sub), mode)
    for node in node_names(nodes) if slurmd else ():
        _mkdir(os.path.join(work, "spool", node), 0o755)
    if backup_controller:
        need("unshare", "util-linux")
        for sub in ("backup", "backup/run", "backup/log"):
            _mkdir(os.path.join(work, sub), 0o755)
        with open("/etc/hosts", encoding="utf-8") as f:
            hosts = f.read()
        write_file(os.path.join(work, "etc", "hosts"),
                   "".join(f"{addr} {name}\n" for name, addr in CONTROLLERS) + hosts)


def write_key(path: str, mode: int) -> None:
    """A new random 1024-byte key (munge's, auth/slurm's); an existing one is kept."""
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))


def install_plugins(work: str, release: releases.Release, plugin_lib: str | None) -> None:
    """Our plugins into WORK/plugins, built for `release`; etc/release records
    which release the cluster runs (Cluster reads it back)."""
    write_file(os.path.join(work, "etc", "release"),
               f"{release.name}\n{os.pathsep.join(release.bin_dirs)}\n")
    install.install_plugins(os.path.join(work, "plugins"), lib_dir=plugin_lib or release.lib_dir,
                            slurm_version=None if release.name == releases.INSTALLED else release.name)


def write_node_files(work: str, gpus: int, k8s_conf: str) -> None:
    """gres.conf, the fake GPU device files it names, and k8s_resources.conf."""
    write_file(os.path.join(work, "etc", "gres.conf"), gres_conf_text(work, gpus))
    if gpus:
        _mkdir(os.path.join(work, "dev"), 0o755)
        for path in gpu_device_paths(work, gpus):
            make_gpu_device(path)
    write_file(os.path.join(work, "etc", "k8s_resources.conf"),
               "# pyk8sres (slurm-conf/k8s_resources.conf); the ledger lives in state/\n"
               + k8s_conf)


# Slurm's gres.conf wants each GPU's File= to be a character (or block)
# device, one path per GPU: slurmd stat()s it and leaves out of the node's
# devices, with "is not a valid character or block device", a GPU whose file
# is anything else (22.05's gres_common.c, gres.c later); the same path twice
# on a node is refused as a duplicate.
# It never opens the file (task/none, no device cgroup here), so all our GPUs
# can be the same harmless device, /dev/null's (char 1:3), under their own
# names: that needs only mknod as root, no /dev/ttyN of the host's.
NULL_DEVICE = (1, 3)


def make_gpu_device(path: str) -> None:
    """A character device node at `path` with /dev/null's numbers; an older
    plain file there (an earlier test cluster's) is replaced."""
    try:
        st = os.lstat(path)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(*NULL_DEVICE):
            return
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*NULL_DEVICE))
    except OSError as e:
        raise ClusterError(f"cannot make the fake GPU device {path} (mknod c 1 3): {e}; "
                           "--gpus needs root with CAP_MKNOD") from None
    os.chmod(path, 0o666)


def hand_to(work: str, user: str) -> None:
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
